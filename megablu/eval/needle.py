"""Needle in a haystack of real text, single key and RULER-style multi-key.

Templates follow RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", niah_single / niah_multikey_1): needles
"One of the special magic numbers for {key} is: {value}." with 7-digit values inside real
text; the multi-key variant adds distractor needles with other keys (and other values) at
their own depths, and the question asks for one key.

The haystack's documents are tokenized once; each seed arranges them in its own order into
a stream (each document followed by a blank line), and each prompt takes a window of that
stream at a seeded offset and inserts its needles after the sentence-ending token nearest to
each target depth. So another seed is another draw of windows from the same text, not the
same windows again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Optional

from .prompts import (
    EvalError,
    HaystackSource,
    Prompt,
    TokenizerLike,
    check_seed,
    draw_items,
    insert_at,
    pad_ids,
    repeat_to,
    rng_for,
    stratified_depth,
)

log = logging.getLogger(__name__)

INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE = " One of the special magic numbers for {key} is: {value}. "
QUESTION = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)

_ADJ = (
    "amber",
    "brave",
    "calm",
    "dusty",
    "eager",
    "fancy",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lively",
    "mellow",
    "nimble",
    "odd",
    "proud",
    "quiet",
    "rusty",
    "silent",
    "tidy",
    "upbeat",
    "vast",
    "witty",
    "young",
)
_NOUN = (
    "anchor",
    "badger",
    "candle",
    "dolphin",
    "engine",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchid",
    "pepper",
    "quarry",
    "river",
    "saddle",
    "tunnel",
    "umbrella",
    "violin",
    "walrus",
    "yarn",
)
KEYS = tuple(f"{a}-{b}" for a in _ADJ for b in _NOUN)  # 576 distinct keys

SNAP_RADIUS = 64  # tokens searched either side of the target for a sentence end


def _documents(source: HaystackSource) -> Iterable[str]:
    if isinstance(source, str):
        return [source]
    if callable(source):
        return source()
    return source


# the text every real-text haystack is read to (when the val split has it): 2 x 128k, so that
# prompts of lengths up to 128k do not depend on the job's longest length
HAYSTACK_TOKENS = 2 * 131072


class HaystackStream:
    """A token stream of real text plus, per position, whether that token ends a sentence."""

    def __init__(self, ids: list[int], sentence_end: list[bool]):
        self.ids, self.sentence_end = ids, sentence_end

    def snap(self, pos: int, lo: int, hi: int) -> int:
        """An insertion point in [lo, hi] right after a sentence end, nearest to pos (else pos)."""
        for d in range(SNAP_RADIUS + 1):
            for p in (pos - d, pos + d):
                if lo <= p <= hi and p > 0 and self.sentence_end[p - 1]:
                    return p
        return pos

    def window(self, task: str, length: int, index: int, n_ctx: int, seed: int) -> int:
        """The seeded offset of prompt `index`'s n_ctx-token window (an error when the text is shorter)."""
        span = len(self.ids) - n_ctx
        if span < 0:
            raise EvalError(
                f"{task}: the haystack holds {len(self.ids)} tokens < {n_ctx} needed at length {length}; "
                f"point eval.haystack at a larger val split"
            )
        return rng_for(seed, task, "offset", length, index).randrange(span + 1)


class Haystack(HaystackStream):
    """The source's documents, tokenized once. As a stream itself: the documents in the source's
    order; `stream(seed)`: the same documents in a seeded order, what the builders read."""

    def __init__(self, source: HaystackSource, tokenizer: TokenizerLike, min_tokens: int, target_tokens: int = 0):
        """Text up to max(min_tokens, target_tokens) tokens (all of it when there is less); an error
        below min_tokens. Prompts take their offsets from the stream's length, so a fixed target
        (HAYSTACK_TOKENS) makes task@L's prompts the same whatever other lengths a job holds."""
        sep = tokenizer.encode("\n\n")
        want = max(min_tokens, target_tokens)
        docs: list[list[int]] = []
        total = 0
        for doc in _documents(source):
            if not doc:
                continue
            docs.append(tokenizer.encode(doc) + sep)
            total += len(docs[-1])
            if total >= want:
                break
        if total < min_tokens:
            raise EvalError(
                f"haystack: only {total} tokens of text, need {min_tokens} (the longest length "
                f"plus room for distinct offsets); point eval.haystack at a larger val split"
            )
        self.docs = docs
        ends: dict[int, bool] = {}
        for t in {t for d in docs for t in d}:
            s = tokenizer.decode([t]).rstrip(" \t")
            ends[t] = s.endswith((".", "!", "?", "\n"))
        self._ends = ends
        super().__init__(*self._join(range(len(docs))))
        self._streams: dict[int, HaystackStream] = {}

    def _join(self, order) -> tuple[list[int], list[bool]]:
        ids = [t for d in order for t in self.docs[d]]
        return ids, [self._ends[t] for t in ids]

    def stream(self, seed: int) -> HaystackStream:
        """The documents in the order seed draws (a permutation of all of them), joined as in the source."""
        seed = check_seed(seed)
        if seed not in self._streams:
            order = list(range(len(self.docs)))
            rng_for(seed, "haystack", len(self.docs)).shuffle(order)
            self._streams[seed] = HaystackStream(*self._join(order))
        return self._streams[seed]


class NeedleBuilder:
    """task 'needle' (one needle) or 'multikey' (the target plus n_distractors other keys)."""

    def __init__(
        self, task: str, tokenizer: TokenizerLike, seed: int, n: int, haystack: Haystack, n_distractors: int = 3
    ):
        if task not in ("needle", "multikey"):
            raise ValueError(task)
        self.task, self.tok, self.seed, self.n, self.hay = task, tokenizer, check_seed(seed), n, haystack
        self.stream = haystack.stream(self.seed)
        self.n_distractors = n_distractors if task == "multikey" else 0
        self.head = tokenizer.encode(INSTRUCTION)

    def _draw(self, index: int):
        rng = rng_for(self.seed, self.task, "needles", index)
        keys = rng.sample(KEYS, 1 + self.n_distractors)
        values = rng.sample(range(1_000_000, 10_000_000), 1 + self.n_distractors)
        depths = [stratified_depth(self.seed, self.task, index, self.n)]
        depths += [rng.random() for _ in range(self.n_distractors)]
        return keys, [str(v) for v in values], depths

    def min_length(self) -> int:
        """The longest fixed content (instruction, needles, question) over this task's n prompts: the
        shortest length every prompt can be built at (harness.preflight_problems asks every builder)."""

        def bare(i: int) -> int:
            keys, values, _ = self._draw(i)
            return (
                len(self.head)
                + sum(len(self.tok.encode(NEEDLE.format(key=k, value=v))) for k, v in zip(keys, values, strict=True))
                + len(self.tok.encode(QUESTION.format(key=keys[0])))
            )

        return max(bare(i) for i in range(self.n))

    def build(self, length: int, index: int) -> Prompt:
        keys, values, depths = self._draw(index)
        needles = [self.tok.encode(NEEDLE.format(key=k, value=v)) for k, v in zip(keys, values, strict=True)]
        question = self.tok.encode(QUESTION.format(key=keys[0]))
        n_ctx = length - len(self.head) - sum(map(len, needles)) - len(question)
        if n_ctx < 0:
            raise EvalError(
                f"{self.task}: length {length} is shorter than the prompt without haystack ({length - n_ctx} tokens)"
            )
        hay = self.stream
        off = hay.window(self.task, length, index, n_ctx, self.seed)
        # insertion points (relative to the window), snapped to sentence ends
        cuts = [hay.snap(off + round(d * n_ctx), off, off + n_ctx) - off for d in depths]
        ctx = insert_at(hay.ids[off : off + n_ctx], needles, cuts)
        ids = self.head + ctx + question
        assert len(ids) == length, (len(ids), length)
        return Prompt(
            self.task,
            length,
            index,
            tuple(ids),
            values[0],
            cuts[0] / max(n_ctx, 1),
            {"key": keys[0], "offset": off, "distractors": list(zip(keys[1:], values[1:], strict=True))},
        )


# ---------------------------------------------------------------- RULER's NIAH family
_TYPE_V = {"numbers": "numbers", "words": "words", "uuids": "uuids"}
_KEY_KIND = {"words": "pairs", "numbers": "numbers", "uuids": "uuids"}
R_INSTRUCTION = (
    "Some special magic {tv} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {tv} afterwards.\n"
)
R_NEEDLE = " One of the special magic {tv} for {key} is: {value}. "
R_KV_LINE = "One of the special magic {tv} for {key} is: {value}.\n"
R_QUESTION = (
    "\nWhat are all the special magic {tv} for {query} mentioned in the provided text? "
    "The special magic {tv} for {query} mentioned in the provided text are"
)


def _join_query(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


class NiahBuilder:
    """RULER's niah.py structure (niah_single_*, niah_multikey_*, niah_multivalue,
    niah_multiquery) on three haystacks, written here:

        Some special magic {numbers|words|uuids} are hidden within the following text. ...
        <haystack> One of the special magic numbers for {key} is: {value}. <haystack> ...
        What are all the special magic numbers for {query} mentioned in the provided text?
        The special magic numbers for {query} mentioned in the provided text are

    Haystacks: `filler` (the passkey's repeated sentences, needles at sentence-group
    boundaries), `text` (a window of real val text at a seeded offset, needles after the
    sentence end nearest each depth), `kv` (lines of other key-value needles of the same types,
    needles between lines). The first asked key's first value sits at the prompt's stratified
    depth; every other needle at a uniform random depth. Answers: every value of every asked
    key (scored RULER's string_match_all)."""

    def __init__(
        self, task: str, spec, tokenizer: TokenizerLike, seed: int, n: int, haystack: Optional[Haystack] = None
    ):
        if spec.haystack == "text" and haystack is None:
            raise EvalError(
                f"task {task!r} needs a real-text haystack: set eval.haystack (a dataset dir whose val "
                f"split is the haystack) or pass haystack="
            )
        self.task, self.spec, self.tok, self.n, self.hay = task, spec, tokenizer, n, haystack
        self.seed = check_seed(seed)
        self.stream = haystack.stream(self.seed) if spec.haystack == "text" and haystack is not None else None
        self.tv = _TYPE_V[spec.value]
        self.head = tokenizer.encode(R_INSTRUCTION.format(tv=self.tv))
        if spec.haystack == "filler":
            from .passkey import FILLER

            self.unit = tokenizer.encode(FILLER)

    def _draw(self, index: int):
        s = self.spec
        rng = rng_for(self.seed, self.task, "needles", index)
        keys = draw_items(rng, _KEY_KIND[s.key], s.keys)
        flat = draw_items(rng, s.value, s.values * s.keys, exclude=keys)
        values = [flat[j * s.values : (j + 1) * s.values] for j in range(s.keys)]
        # depth of each (key j, value m): the first asked needle stratified, the others uniform
        depths = [[rng.random() for _ in range(s.values)] for _ in keys]
        depths[0][0] = stratified_depth(self.seed, self.task, index, self.n)
        return rng, keys, values, depths

    def _fixed(self, index: int):
        """(rng, keys, values, depths, needle ids per (key, value), question ids) of prompt `index`."""
        rng, keys, values, depths = self._draw(index)
        # in a kv haystack a needle is one more line, indistinguishable from the others
        tmpl = R_KV_LINE if self.spec.haystack == "kv" else R_NEEDLE
        needles = [
            [self.tok.encode(tmpl.format(tv=self.tv, key=k, value=v)) for v in vs]
            for k, vs in zip(keys, values, strict=True)
        ]
        question = self.tok.encode(R_QUESTION.format(tv=self.tv, query=_join_query(keys[: self.spec.queries])))
        return rng, keys, values, depths, needles, question

    def min_length(self) -> int:
        """The longest fixed content (instruction, needles, question) over this task's n prompts."""
        worst = 0
        for i in range(self.n):
            _, _, _, _, needles, q = self._fixed(i)
            worst = max(worst, len(self.head) + sum(len(x) for ns in needles for x in ns) + len(q))
        return worst

    def build(self, length: int, index: int) -> Prompt:
        s = self.spec
        rng, keys, values, depths, needles, question = self._fixed(index)
        flat_n = [x for ns in needles for x in ns]
        flat_d = [d for ds in depths for d in ds]
        n_ctx = length - len(self.head) - sum(map(len, flat_n)) - len(question)
        if n_ctx < 0:
            raise EvalError(
                f"{self.task}: length {length} is shorter than the prompt without haystack "
                f"({length - n_ctx} tokens); use lengths >= {self.min_length()}"
            )
        ctx, snap = self._haystack(length, index, n_ctx, rng, keys, values)
        cuts = [snap(round(d * n_ctx)) for d in flat_d]
        ids = self.head + insert_at(ctx, flat_n, cuts) + question
        assert len(ids) == length, (len(ids), length)
        asked = [v for vs in values[: s.queries] for v in vs]
        asked_depths = [cuts[j * s.values + m] / max(n_ctx, 1) for j in range(s.queries) for m in range(s.values)]
        return Prompt(
            self.task,
            length,
            index,
            tuple(ids),
            ", ".join(asked),
            asked_depths[0],
            {"keys": keys[: s.queries], "distractor_keys": keys[s.queries :]},
            answers=tuple(asked),
            depths=tuple(round(d, 4) for d in asked_depths),
            scoring="all",
        )

    def _haystack(self, length, index, n_ctx, rng, keys, values):
        """(n_ctx haystack ids, snap: position -> the allowed insertion point nearest it)."""
        kind = self.spec.haystack
        if kind == "filler":
            u = len(self.unit)
            last = (n_ctx // u) * u
            return repeat_to(self.unit, n_ctx), lambda p: min(round(p / u) * u, last)
        if kind == "text":
            hay = self.stream
            off = hay.window(self.task, length, index, n_ctx, self.seed)
            return hay.ids[off : off + n_ctx], lambda p: hay.snap(off + p, off, off + n_ctx) - off
        # kv: lines of other keys with values of the same kinds, as many whole lines as fit
        lrng = rng_for(self.seed, self.task, "kv", length, index)
        taken = keys + [v for vs in values for v in vs]
        ctx, bounds = [], [0]
        while True:
            k = draw_items(lrng, _KEY_KIND[self.spec.key], 1, exclude=taken, nested_ok=True)[0]
            v = draw_items(lrng, self.spec.value, 1, exclude=taken, nested_ok=True)[0]
            line = self.tok.encode(R_KV_LINE.format(tv=self.tv, key=k, value=v))
            if len(ctx) + len(line) > n_ctx:
                break
            ctx += line
            bounds.append(len(ctx))
        ctx += pad_ids(self.tok, n_ctx - len(ctx))
        return ctx, lambda p: min(bounds, key=lambda b: (abs(b - p), b))
