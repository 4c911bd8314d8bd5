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
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence, Union


class EvalError(Exception):
    """The evaluation cannot produce a meaningful result (never an empty report)."""


class TokenizerLike(Protocol):
    vocab_size: int
    eot_id: int
    identity: str

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
    answer: str                   # the digits that count as correct, exactly
    depth: float                  # relative position of the (target) needle in the context, 0..1
    meta: dict = field(default_factory=dict, compare=False)


def rng_for(seed: int, *parts) -> random.Random:
    """An RNG that depends only on (seed, parts), not on Python's hash seed or call order."""
    h = hashlib.sha256(repr((int(seed),) + tuple(parts)).encode()).digest()
    return random.Random(int.from_bytes(h[:8], "little"))


def stratified_depth(seed: int, task: str, index: int, n: int) -> float:
    """Depth of prompt i among n: one uniform draw inside stratum [i/n, (i+1)/n).

    Every length sees the same depths, spread evenly over the context (lower variance than
    independent draws, and the depth breakdown in the report has every bin populated)."""
    return (index + rng_for(seed, task, "depth", index).random()) / n


def repeat_to(ids: Sequence[int], count: int, start: int = 0) -> list[int]:
    """count ids of the infinite repetition of `ids`, starting at offset `start`."""
    if count <= 0:
        return []
    if not ids:
        raise EvalError("filler encodes to zero tokens")
    reps = (start + count) // len(ids) + 1
    return (list(ids) * reps)[start:start + count]


def check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise EvalError(f"{what}: token ids {bad[:5]} outside the model vocabulary 0..{vocab_size - 1}; the "
                        f"tokenizer does not belong to this model")


_DIGITS = re.compile(r"\d+")


def extract_answer(text: str) -> str:
    """The first run of digits in the generated text ('' if none)."""
    m = _DIGITS.search(text)
    return m.group(0) if m else ""


def is_correct(text: str, answer: str) -> bool:
    """Exact match of the first digit run: a prefix, a superset or a near miss is wrong."""
    return extract_answer(text) == answer


def prompt_digest(prompts: Iterable[Prompt]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(repr((p.task, p.length, p.index, p.answer)).encode())
        h.update(b",".join(str(i).encode() for i in p.ids))
        h.update(b"\n")
    return h.hexdigest()[:16]
