"""Needle in a haystack of real text, single key and RULER-style multi-key.

Templates follow RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", niah_single / niah_multikey_1): needles
"One of the special magic numbers for {key} is: {value}." with 7-digit values inside real
text; the multi-key variant adds distractor needles with other keys (and other values) at
their own depths, and the question asks for one key.

The haystack is tokenized once into a stream (documents in the source's order, joined by a
blank line); each prompt takes a window of it at a seeded offset and inserts its needles
after the sentence-ending token nearest to each target depth.
"""
from __future__ import annotations

import logging
from typing import Iterable

from .prompts import EvalError, HaystackSource, Prompt, TokenizerLike, rng_for, stratified_depth

log = logging.getLogger(__name__)

INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")
NEEDLE = " One of the special magic numbers for {key} is: {value}. "
QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? "
            "The special magic number for {key} mentioned in the provided text is")

_ADJ = ("amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "keen",
        "lively", "mellow", "nimble", "odd", "proud", "quiet", "rusty", "silent", "tidy", "upbeat", "vast",
        "witty", "young")
_NOUN = ("anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchid", "pepper", "quarry", "river", "saddle", "tunnel",
         "umbrella", "violin", "walrus", "yarn")
KEYS = tuple(f"{a}-{b}" for a in _ADJ for b in _NOUN)  # 576 distinct keys

SNAP_RADIUS = 64  # tokens searched either side of the target for a sentence end


def _documents(source: HaystackSource) -> Iterable[str]:
    if isinstance(source, str):
        return [source]
    if callable(source):
        return source()
    return source


class Haystack:
    """A token stream of real text plus, per position, whether that token ends a sentence."""

    def __init__(self, source: HaystackSource, tokenizer: TokenizerLike, min_tokens: int):
        ids: list[int] = []
        sep = tokenizer.encode("\n\n")
        for doc in _documents(source):
            if not doc:
                continue
            ids.extend(tokenizer.encode(doc))
            ids.extend(sep)
            if len(ids) >= min_tokens:
                break
        if len(ids) < min_tokens:
            raise EvalError(f"haystack: only {len(ids)} tokens of text, need {min_tokens} (the longest length "
                            f"plus room for distinct offsets); point eval.haystack at a larger val split")
        self.ids = ids
        ends: dict[int, bool] = {}
        for t in set(ids):
            s = tokenizer.decode([t]).rstrip(" \t")
            ends[t] = s.endswith((".", "!", "?", "\n"))
        self.sentence_end = [ends[t] for t in ids]

    def snap(self, pos: int, lo: int, hi: int) -> int:
        """An insertion point in [lo, hi] right after a sentence end, nearest to pos (else pos)."""
        for d in range(SNAP_RADIUS + 1):
            for p in (pos - d, pos + d):
                if lo <= p <= hi and p > 0 and self.sentence_end[p - 1]:
                    return p
        return pos


class NeedleBuilder:
    """task 'needle' (one needle) or 'multikey' (the target plus n_distractors other keys)."""

    def __init__(self, task: str, tokenizer: TokenizerLike, seed: int, n: int, haystack: Haystack,
                 n_distractors: int = 3):
        if task not in ("needle", "multikey"):
            raise ValueError(task)
        self.task, self.tok, self.seed, self.n, self.hay = task, tokenizer, seed, n, haystack
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
        """The longest of the n prompts without haystack (instruction + needles + question): the
        shortest length every prompt can be built at. Needs no haystack."""
        def bare(i: int) -> int:
            keys, values, _ = self._draw(i)
            return (len(self.head) + sum(len(self.tok.encode(NEEDLE.format(key=k, value=v))) for k, v in zip(keys, values))
                    + len(self.tok.encode(QUESTION.format(key=keys[0]))))
        return max(bare(i) for i in range(self.n))

    def build(self, length: int, index: int) -> Prompt:
        keys, values, depths = self._draw(index)
        needles = [self.tok.encode(NEEDLE.format(key=k, value=v)) for k, v in zip(keys, values)]
        question = self.tok.encode(QUESTION.format(key=keys[0]))
        n_ctx = length - len(self.head) - sum(map(len, needles)) - len(question)
        if n_ctx < 0:
            raise EvalError(f"{self.task}: length {length} is shorter than the prompt without haystack "
                            f"({length - n_ctx} tokens)")
        span = len(self.hay.ids) - n_ctx
        off = rng_for(self.seed, self.task, "offset", length, index).randrange(span + 1)
        # insertion points (relative to the window), snapped to sentence ends
        cuts = [self.hay.snap(off + round(d * n_ctx), off, off + n_ctx) - off for d in depths]
        order = sorted(range(len(needles)), key=lambda j: (cuts[j], j))
        ctx, prev = [], 0
        for j in order:
            ctx += self.hay.ids[off + prev:off + cuts[j]] + needles[j]
            prev = cuts[j]
        ctx += self.hay.ids[off + prev:off + n_ctx]
        ids = self.head + ctx + question
        assert len(ids) == length, (len(ids), length)
        return Prompt(self.task, length, index, tuple(ids), values[0], cuts[0] / max(n_ctx, 1),
                      {"key": keys[0], "offset": off, "distractors": list(zip(keys[1:], values[1:]))})
