"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"; as used by YaRN).

    <instruction>
    The grass is green. The sky is blue. ... (repeated)
    The pass key is 12345. Remember it. 12345 is the pass key.
    The grass is green. ... (repeated)
    What is the pass key? The pass key is

The key is a 5-digit number (`digits` in a task_def: 1..9; with 1 the key is 0..9); the needle
sits at a filler-sentence boundary nearest to the prompt's stratified depth (over `depth` [lo, hi]
of the filler; default all of it); the filler after it is cut wherever the exact length ends.

A seed draws the keys and the depths (which stratum each prompt gets, and where in it). The
filler is the task's constant, the same for every seed: in the authors' code (epfml/landmark-
attention, llama/run_test.py) the prefix and the suffix around the needle both start at "The
grass is green.", and only the key and the needle position are random. Starting the filler at a
seeded sentence would be another task (and not what quickstart.passkey_docs trains on).
"""

from __future__ import annotations

from .prompts import EvalError, Prompt, TokenizerLike, check_seed, repeat_to, rng_for, stratified_depth

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


class PasskeyBuilder:
    task = "passkey"

    def __init__(
        self, tokenizer: TokenizerLike, seed: int, n: int, digits: int = 5, depth: tuple[float, float] = (0.0, 1.0)
    ):
        self.tok, self.seed, self.n, self.digits = tokenizer, check_seed(seed), n, digits
        self.depth = depth
        self.head = tokenizer.encode(INSTRUCTION)
        self.unit = tokenizer.encode(FILLER)
        self.question = tokenizer.encode(QUESTION)
        if not self.unit:
            raise EvalError("passkey: the filler sentence encodes to zero tokens")

    def key(self, index: int) -> str:
        lo = 10 ** (self.digits - 1) if self.digits > 1 else 0
        return str(rng_for(self.seed, self.task, "key", index).randint(lo, 10**self.digits - 1))

    def min_length(self) -> int:
        return len(self.head) + len(self.tok.encode(NEEDLE.format(key="9" * self.digits))) + len(self.question)

    def build(self, length: int, index: int) -> Prompt:
        key = self.key(index)
        lo, hi = self.depth
        depth = lo + (hi - lo) * stratified_depth(self.seed, self.task, index, self.n)
        needle = self.tok.encode(NEEDLE.format(key=key))
        n_fill = length - len(self.head) - len(needle) - len(self.question)
        if n_fill < 0:
            raise EvalError(
                f"passkey: length {length} is shorter than the prompt without filler ({length - n_fill} tokens)"
            )
        # snap the needle to the filler-unit boundary nearest depth * n_fill
        u = len(self.unit)
        before = min(round(depth * n_fill / u) * u, (n_fill // u) * u)
        ids = (
            self.head
            + repeat_to(self.unit, before)
            + needle
            + repeat_to(self.unit, n_fill - before, before)
            + self.question
        )
        assert len(ids) == length, (len(ids), length)
        return Prompt(
            self.task, length, index, tuple(ids), key, before / max(n_fill, 1), {"needle_pos": len(self.head) + before}
        )
