"""What the RULER builders share: the seeded draws, the prompt's frame in token space, line haystacks.

A prompt is [chat prefix][task text before the context][context][task text after it][chat suffix +
answer prefix], each piece encoded once, the context filled to exactly length - tokens_to_generate
tokens in all (RULER's max_seq_length counts the generation budget: prepare.py's --max_seq_length,
niah.py line 245 `len(tokens) + tokens_to_generate <= max_seq_length`). Pieces meet at whitespace.

Seeds: every random choice of prompt i comes from rng_for(eval.seed, task, what, i) -- keys, values,
words, the needle depths -- plus the length for what fills the length (the haystack window, the
distractor lines, the list order), so prompt i asks the same thing at every length (lengths are
paired) and another eval.seed is another sample of every choice. The first asked needle's depth is
stratified: prompt i takes stratum perm[i] of n, perm a seed-dependent permutation, a uniform draw
inside it (the marginal law of RULER's uniform depth, with every depth band covered).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence

from ..prompts import EvalError, Prompt, TokenizerLike, rng_for
from .assets import niah_key
from .chat import Chat


def random_item(rng, kind: str) -> str:
    """niah.py lines 108-126: 7-digit numbers, 'adjective-noun' words, UUID4s."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return niah_key(rng)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(kind)


def repeat_ids(ids: Sequence[int], count: int) -> list[int]:
    """The first `count` ids of ids repeated."""
    if count <= 0:
        return []
    if not ids:
        raise EvalError("a RULER filler piece encodes to zero tokens")
    return (list(ids) * (count // len(ids) + 1))[:count]


class RulerBuilder:
    """Base: `build(length, index)` and `min_length()` as every megablu builder (tasks.py)."""

    def __init__(self, task: str, spec, tokenizer: TokenizerLike, seed: int, n: int, chat_template: str):
        self.task, self.spec, self.tok, self.seed, self.n = task, spec, tokenizer, seed, n
        self.chat = Chat(tokenizer, chat_template, task)
        self.ttg = spec.tokens_to_generate

    def rng(self, *parts):
        return rng_for(self.seed, self.task, *parts)

    @functools.cached_property
    def _strata(self) -> list[int]:
        perm = list(range(self.n))
        self.rng("strata").shuffle(perm)
        return perm

    def depth(self, index: int) -> float:
        """Prompt index's stratified depth in [0, 1)."""
        return (self._strata[index] + self.rng("depth", index).random()) / self.n

    def enc(self, text: str) -> list[int]:
        return self.tok.encode(text) if text else []

    def frame(self, user_before: str, user_after: str, answer_prefix: str, turns=()) -> tuple[list[int], list[int]]:
        """(ids before the context, ids after it): the chat template around the user's text (when on),
        the task text, the answer prefix at the start of the assistant's turn."""
        pre, post = self.chat.around(turns)
        return self.enc(pre + user_before), self.enc(user_after) + self.enc(post + answer_prefix)

    def budget(self, length: int, fixed: int) -> int:
        """Context tokens left at `length` (RULER's max_seq_length) after `fixed` tokens and the budget."""
        n_ctx = length - self.ttg - fixed
        if n_ctx < 0:
            raise EvalError(
                f"{self.task}: length {length} cannot hold the prompt without its context ({fixed} "
                f"tokens) plus tokens_to_generate {self.ttg}; use longer lengths (preflight names the "
                f"shortest)"
            )
        return n_ctx

    def prompt(self, length, index, ids, answers, depths=(), meta=None) -> Prompt:
        assert len(ids) == length - self.ttg, (self.task, len(ids), length - self.ttg)
        depths = tuple(round(d, 4) for d in depths)
        return Prompt(
            self.task,
            length,
            index,
            tuple(ids),
            ", ".join(answers),
            depths[0] if depths else None,
            {**(meta or {}), "chat": self.chat.on},
            answers=tuple(answers),
            depths=depths,
            scoring="all",
        )

    def min_length(self) -> int:
        """The shortest length every one of the n prompts builds at (searched: builds are cheap there)."""
        lo, hi = self.ttg, self.ttg + 64
        while not self._builds(hi):
            lo, hi = hi, 2 * hi
            if hi > 1 << 22:
                raise EvalError(f"{self.task}: no length up to {hi} holds its prompts in this tokenizer")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._builds(mid) else (mid, hi)
        return hi

    def _builds(self, length: int) -> bool:
        try:
            for i in range(self.n):
                self.build(length, i)
        except EvalError:
            return False
        return True

    def build(self, length: int, index: int) -> Prompt:
        raise NotImplementedError


def lines_context(
    line_ids: Sequence[Sequence[int]], inserts: Sequence[tuple[int, list[int]]], n_ctx: int, tail: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Lines joined by newlines (each piece its line + '\\n') with `inserts` (slot, ids) placed before line
    `slot` (RULER's sentences.insert), then the first tokens of `tail` (the next line, cut) to fill n_ctx.
    Returns (context ids, the start of each insert in it)."""
    out: list[int] = []
    starts = [0] * len(inserts)
    order = sorted(range(len(inserts)), key=lambda j: (inserts[j][0], j))
    k = 0
    for s, line in enumerate(list(line_ids) + [None]):
        while k < len(order) and inserts[order[k]][0] <= s:
            starts[order[k]] = len(out)
            out += inserts[order[k]][1]
            k += 1
        if line is not None:
            out += line
    if len(out) > n_ctx:
        raise EvalError(f"lines_context: {len(out)} tokens > {n_ctx}")
    out += repeat_ids(tail, n_ctx - len(out))
    return out, starts
