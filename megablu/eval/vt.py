"""Variable tracking (RULER, Hsieh et al. 2024: variable_tracking.py's structure, written here).

    Memorize and track the chain(s) of variable assignment hidden in the following text.

    <one worked example: a short filler with one chain, its question and its answer>

    The grass is green. ... VAR QWERT = 52810. ... VAR ASDFG = VAR QWERT. ... (repeated filler)
    Question: Find all variables that are assigned the value 52810 in the text above.
    Answer: According to the chain(s) of variable assignment in the text above, 5 variables are
    assigned the value 52810, they are:

`chains` chains of `hops` assignments each (X0 = value, X1 = X0, ..., X_hops = X_{hops-1});
the statements sit at sorted uniform depths at filler-sentence boundaries, each chain in its
own order, interleaved. Chain 0's value is asked; its hops + 1 variables are the answers
(string_match_all). Variables are 5 uppercase letters, values 5 digits, all distinct.
"""

from __future__ import annotations

import itertools
import string

from .passkey import FILLER
from .prompts import EvalError, Prompt, TokenizerLike, check_seed, insert_at, repeat_to, rng_for

INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
QUESTION = (
    "\nQuestion: Find all variables that are assigned the value {value} in the text above. "
    "Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
    "assigned the value {value}, they are:"
)
EXAMPLE_UNITS = 2  # filler sentences groups around the worked example's chain


class VTBuilder:
    def __init__(self, task: str, spec, tokenizer: TokenizerLike, seed: int, n: int):
        self.task, self.spec, self.tok, self.seed, self.n = task, spec, tokenizer, check_seed(seed), n
        self.head = tokenizer.encode(INSTRUCTION)
        self.unit = tokenizer.encode(FILLER)
        if not self.unit:
            raise EvalError(f"{task}: the filler sentence encodes to zero tokens")

    def _chains(self, rng, taken: set) -> tuple[list[list[str]], list[str]]:
        names: list[str] = []
        values: list[str] = []
        while len(names) < self.spec.chains * (self.spec.hops + 1):
            v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if v not in taken:
                taken.add(v)
                names.append(v)
        while len(values) < self.spec.chains:
            x = str(rng.randint(10000, 99999))
            if x not in taken:
                taken.add(x)
                values.append(x)
        h = self.spec.hops + 1
        return [names[c * h : (c + 1) * h] for c in range(self.spec.chains)], values

    def _statements(self, chain: list[str], value: str) -> list[str]:
        return [f" VAR {chain[0]} = {value}. "] + [f" VAR {b} = VAR {a}. " for a, b in itertools.pairwise(chain)]

    def _example(self, rng, taken: set) -> list[int]:
        """One worked example (its own chain of the same hops) with its answer: RULER's one-shot ICL."""
        (chain,), (value,) = _one(self._chains(rng, taken))
        ctx = list(self.unit)
        for st in self._statements(chain, value):
            ctx += self.tok.encode(st) + list(self.unit) * (EXAMPLE_UNITS - 1)
        text = " " + ", ".join(chain) + "\n\n"
        return ctx + self.tok.encode(QUESTION.format(value=value, n=len(chain))) + self.tok.encode(text)

    def _fixed(self, index: int):
        rng = rng_for(self.seed, self.task, "chains", index)
        taken: set = set()
        example = self._example(rng, taken)
        chains, values = self._chains(rng, taken)
        stmts = [[self.tok.encode(s) for s in self._statements(ch, v)] for ch, v in zip(chains, values, strict=True)]
        question = self.tok.encode(QUESTION.format(value=values[0], n=len(chains[0])))
        return rng, example, chains, stmts, question

    def min_length(self) -> int:
        worst = 0
        for i in range(self.n):
            _, ex, _, stmts, q = self._fixed(i)
            worst = max(worst, len(self.head) + len(ex) + sum(len(x) for st in stmts for x in st) + len(q))
        return worst

    def build(self, length: int, index: int) -> Prompt:
        rng, example, chains, stmts, question = self._fixed(index)
        flat = [x for st in stmts for x in st]
        n_ctx = length - len(self.head) - len(example) - sum(map(len, flat)) - len(question)
        if n_ctx < 0:
            raise EvalError(
                f"{self.task}: length {length} is shorter than the prompt without filler "
                f"({length - n_ctx} tokens); use lengths >= {self.min_length()}"
            )
        u = len(self.unit)
        # sorted depths, dealt to the statements in an interleaving that keeps each chain in order
        depths = sorted(rng.random() for _ in flat)
        owners = [c for c, st in enumerate(stmts) for _ in st]
        rng.shuffle(owners)
        nxt, cuts = [0] * len(stmts), [0] * len(flat)
        starts = [sum(len(st) for st in stmts[:c]) for c in range(len(stmts))]
        for d, c in zip(depths, owners, strict=True):
            j = starts[c] + nxt[c]
            nxt[c] += 1
            cuts[j] = min(round(d * n_ctx / u) * u, (n_ctx // u) * u)
        ctx = repeat_to(self.unit, n_ctx)
        ids = self.head + example + insert_at(ctx, flat, cuts) + question
        assert len(ids) == length, (len(ids), length)
        ds = tuple(round(cuts[j] / max(n_ctx, 1), 4) for j in range(len(chains[0])))
        return Prompt(
            self.task,
            length,
            index,
            tuple(ids),
            ", ".join(chains[0]),
            ds[0],
            {"chains": chains},
            answers=tuple(chains[0]),
            depths=ds,
            scoring="all",
        )


def _one(pair):
    chains, values = pair
    return chains[:1], values[:1]
