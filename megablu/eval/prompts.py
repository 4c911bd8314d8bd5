"""Prompts built to an exact token length in the model's own tokenizer, seeded per prompt.

A prompt is composed in token space: each text segment (instruction, filler or haystack,
needle, question) is encoded once and the id lists are concatenated, so its length is
exactly the requested one (encoding a whole string and trimming cannot promise that with
BPE, where merges cross the cut). Segments meet at whitespace, where BPE pre-tokenizers
split anyway.

Determinism: every random choice of prompt i comes from its own RNG seeded by
sha256(seed, task, i) -- the key, the depth, the distractors -- so prompt i carries the
same key at the same relative depth at every length (lengths are paired), and adding a
length or an arm never changes the others. Only the haystack offset also depends on the
length. `prompt_digest` hashes the ids, so arms can check they saw identical prompts.

Seeds: another seed is another sample of the same design, drawn independently. Every draw
takes the seed into its sha256 input, whole digest to RNG (no truncation two seeds could
collide in), so two seeds share no draw: the keys, values and distractors; which depth
stratum each prompt gets (a seeded permutation, `stratified_depth`) and where inside it; the
arrangement of the real-text haystack's documents and each window's offset
(needle.Haystack.stream). What is the same for every seed is what the task fixes: the
templates and the passkey's repeated filler sentences (Mohtashami & Jaggi's, whose prefix and
suffix both start at the first sentence; RULER's noise haystack is the same text).
"""

from __future__ import annotations

import hashlib
import operator
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Protocol, Union


class EvalError(Exception):
    """The evaluation cannot produce a meaningful result (never an empty report)."""


class TokenizerLike(Protocol):
    vocab_size: int
    eot_id: int
    identity: str

    @property
    def stop_ids(self) -> tuple[int, ...]: ...  # eot_id first: generation stops at any of them

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


# A haystack: one text, a list of documents, or a callable returning an iterable of documents
# (e.g. a dataset's val split). Documents are consumed in order; the order must be stable.
HaystackSource = Union[str, Sequence[str], Callable[[], Iterable[str]]]


@dataclass(frozen=True)
class Prompt:
    task: str
    length: int
    index: int
    ids: tuple[int, ...]
    answer: str  # what counts as correct (exact digits), or the answers joined by ", "
    depth: Optional[float]  # relative position of the (target) needle in the context, 0..1; None: no needle
    meta: dict = field(default_factory=dict, compare=False)
    answers: tuple[str, ...] = ()  # every expected answer (RULER scoring); () = (answer,)
    depths: tuple[Optional[float], ...] = ()  # each answer's depth in the context; () = (depth,)
    scoring: str = "exact"  # "exact" (first digit run), "all" or "part" (RULER)

    @property
    def expected(self) -> tuple[str, ...]:
        return self.answers or (self.answer,)

    @property
    def answer_depths(self) -> tuple[Optional[float], ...]:
        return self.depths or (self.depth,) * len(self.expected)


def check_seed(seed) -> int:
    """The seed as an int >= 0, else an EvalError: a bool or a negative number is refused (no
    seed may stand for another one; random.Random itself would take -s for s)."""
    if isinstance(seed, bool):
        raise EvalError(f"seed={seed!r}: a bool is not a seed; give an integer >= 0 (e.g. eval.seed=1)")
    try:
        s = operator.index(seed)
    except TypeError:
        raise EvalError(f"seed={seed!r}: not an integer; give an integer >= 0 (e.g. eval.seed=1)") from None
    if s < 0:
        raise EvalError(f"seed={seed!r} is negative; give an integer >= 0 (e.g. eval.seed={-s})")
    return s


def rng_for(seed: int, *parts) -> random.Random:
    """An RNG that depends only on (seed, parts), not on Python's hash seed or call order.

    The whole 256-bit digest seeds it (random.Random takes every bit of an int seed): distinct
    (seed, parts) share a stream only if their SHA-256 digests, or MT19937's seeding from them,
    collide; a 64-bit prefix would let a search of ~2^32 seeds find two that share one."""
    h = hashlib.sha256(repr((check_seed(seed),) + tuple(parts)).encode()).digest()
    return random.Random(int.from_bytes(h, "little"))


@lru_cache(maxsize=256)
def strata(seed: int, task: str, n: int) -> tuple[int, ...]:
    """Which depth stratum each of n prompts gets: a permutation of 0..n-1 drawn from (seed, task, n)."""
    order = list(range(n))
    rng_for(seed, task, "strata", n).shuffle(order)
    return tuple(order)


def stratified_depth(seed: int, task: str, index: int, n: int) -> float:
    """Depth of prompt i among n: one uniform draw inside stratum [s/n, (s+1)/n), s = strata(seed, task, n)[i].

    Every stratum holds one prompt, so the depths spread evenly over the context (lower variance
    than independent draws, and the report's depth bins are all populated); which prompt holds
    which stratum is seeded, so another seed moves every prompt to an independent depth. Every
    length sees the same depths (lengths are paired)."""
    if not 0 <= index < n:
        raise EvalError(f"prompt index {index} outside 0..{n - 1} (n={n})")
    return (strata(check_seed(seed), task, n)[index] + rng_for(seed, task, "depth", index).random()) / n


def repeat_to(ids: Sequence[int], count: int, start: int = 0) -> list[int]:
    """count ids of the infinite repetition of `ids`, starting at offset `start`."""
    if count <= 0:
        return []
    if not ids:
        raise EvalError("filler encodes to zero tokens")
    reps = (start + count) // len(ids) + 1
    return (list(ids) * reps)[start : start + count]


def check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise EvalError(
            f"{what}: token ids {bad[:5]} outside the model vocabulary 0..{vocab_size - 1}; the "
            f"tokenizer does not belong to this model"
        )


_DIGITS = re.compile(r"\d+")


def extract_answer(text: str) -> str:
    """The first run of digits in the generated text ('' if none)."""
    m = _DIGITS.search(text)
    return m.group(0) if m else ""


def is_correct(text: str, answer: str) -> bool:
    """Exact match of the first digit run: a prefix, a superset or a near miss is wrong."""
    return extract_answer(text) == answer


def _clean(text: str) -> str:
    """RULER's postprocess_pred: control characters become newlines, then strip."""
    return re.sub(r"[\x00-\x1f]", "\n", text).strip()


def score(text: str, prompt: Prompt) -> tuple[float, list[bool]]:
    """(score in [0, 1], found per expected answer) for the generated text (cut at EOT).

    - exact (passkey, needle, multikey): the first digit run equals the answer;
    - all (RULER string_match_all, every NIAH task, vt, cwe, fwe): the fraction of the expected
      answers that occur in the output, case-insensitively: part credit per answer;
    - part (RULER string_match_part): 1 if any expected answer occurs."""
    if prompt.scoring == "exact":
        ok = is_correct(text, prompt.answer)
        return float(ok), [ok]
    out = _clean(text).lower()
    found = [a.lower() in out for a in prompt.expected]
    if prompt.scoring == "all":
        return sum(found) / len(found), found
    if prompt.scoring == "part":
        return float(any(found)), found
    raise ValueError(f"unknown scoring {prompt.scoring!r}")


def prompt_digest(prompts: Iterable[Prompt]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(repr((p.task, p.length, p.index, p.answer) + ((p.answers,) if p.answers else ())).encode())
        h.update(b",".join(str(i).encode() for i in p.ids))
        h.update(b"\n")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- shared by the RULER-grade tasks
_WORDS: Optional[tuple[str, ...]] = None


def words() -> tuple[str, ...]:
    """The shipped English word list (assets/words.txt, 2006 words, sorted): cwe's list, NIAH's
    word keys (adjective-noun style pairs 'w1-w2', as RULER's wonderwords keys) and word values."""
    global _WORDS
    if _WORDS is None:
        from pathlib import Path

        text = (Path(__file__).parent / "assets" / "words.txt").read_text()
        _WORDS = tuple(w for w in text.split("\n") if w and not w.startswith("#"))
    return _WORDS


def draw_items(
    rng: random.Random, kind: str, count: int, exclude: Iterable[str] = (), nested_ok: bool = False
) -> list[str]:
    """`count` distinct items of a kind: 'numbers' (7 digits, RULER's), 'words' (one word),
    'pairs' (two words 'w1-w2', RULER's word keys) or 'uuids' (UUID4-shaped hex).

    No item is a substring of another or of `exclude` (substring scoring must not credit a
    neighbour); nested_ok checks that against `exclude` only (many distractors, few answers)."""
    exclude = list(exclude)
    seen, out = set(exclude), list[str]()
    ws = words()
    while len(out) < count:
        if kind == "numbers":
            x = str(rng.randint(1_000_000, 9_999_999))
        elif kind == "words":
            x = rng.choice(ws)
        elif kind == "pairs":
            x = f"{rng.choice(ws)}-{rng.choice(ws)}"
        elif kind == "uuids":
            h = f"{rng.getrandbits(128):032x}"
            x = f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{'89ab'[int(h[16], 16) % 4]}{h[17:20]}-{h[20:32]}"
        else:
            raise ValueError(kind)
        # no item inside another (substring scoring must not credit a neighbour)
        if x in seen or any(x in y or y in x for y in (exclude if nested_ok else seen)):
            continue
        seen.add(x)
        out.append(x)
    return out


def insert_at(ctx: Sequence[int], pieces: Sequence[Sequence[int]], cuts: Sequence[int]) -> list[int]:
    """ctx with pieces[j] inserted before ctx[cuts[j]] (cuts in any order; equal cuts keep order)."""
    order = sorted(range(len(pieces)), key=lambda j: (cuts[j], j))
    out, prev = [], 0
    for j in order:
        out += list(ctx[prev : cuts[j]]) + list(pieces[j])
        prev = cuts[j]
    return out + list(ctx[prev:])


def pad_ids(tokenizer: TokenizerLike, count: int) -> list[int]:
    """count tokens of blank lines: the remainder when a task's whole items cannot fill a length exactly."""
    return repeat_to(tokenizer.encode("\n"), count)
