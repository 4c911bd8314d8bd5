"""RULER's variable tracking (scripts/data/synthetic/variable_tracking.py), num_chains chains of
num_hops hops in the noise haystack, after one worked example:

    <example: the same task on <= 500 tokens, 3-letter names, its answer>
    Memorize and track the chain(s) of variable assignment hidden in the following text.

    The grass is green. ... There and back again.
    VAR QWERT = 52810
    The grass is green. ...
    VAR ASDFG = VAR QWERT
    ...
    Question: Find all variables that are assigned the value 52810 in the text above. Answer: According
    to the chain(s) of variable assignment in the text above, 5 variables are assigned the value 52810,
    they are:

The example (lines 193-197, 216-218, 262-265, 303-307): the task text with its answer prefix, a space, the
names, a newline, then a newline before the task (inside the user's turn when a chat template is on).
Chain lines go to uniformly drawn, sorted line slots (lines 152-157), the first chain's value is asked
and its 5 names are the answers (string_match_all).
"""

from __future__ import annotations

import string

from ..prompts import EvalError
from .common import RulerBuilder, lines_context
from .templates import NOISE, VT_ANSWER, VT_HOP, VT_TEMPLATE, VT_VALUE

ICL_TOKENS = 500  # the example's budget (main() line 304: max_seq_length=500)


class RulerVT(RulerBuilder):
    def __init__(self, task, spec, tokenizer, seed, n, chat_template):
        super().__init__(task, spec, tokenizer, seed, n, chat_template)
        self.unit = self.enc(NOISE + "\n")
        self.before, self.after = VT_TEMPLATE.split("{context}")
        self._examples: dict[int, str] = {}

    def _chains(self, rng, k: int, hops: int, value_of) -> tuple[list[list[str]], list[list[str]]]:
        """(names per chain, lines per chain): generate_chains, lines 93-114."""
        names: list[str] = []
        while len(names) < self.spec.num_chains * (hops + 1):
            x = "".join(rng.choice(string.ascii_uppercase) for _ in range(k))
            if x not in names:
                names.append(x)
        out_n, out_l = [], []
        for c in range(self.spec.num_chains):
            vs = names[c * (hops + 1) : (c + 1) * (hops + 1)]
            out_n.append(vs)
            out_l.append(
                [VT_VALUE.format(var=vs[0], value=value_of())]
                + [VT_HOP.format(var=vs[j + 1], prev=vs[j]) for j in range(hops)]
            )
        return out_n, out_l

    def _context(self, rng, chains, units: int, n_ctx: int):
        """units noise lines with every chain's lines at sorted uniform slots (lines 152-157), filled to
        n_ctx with the start of one more noise line; (ids, start of each chain line)."""
        inserts = []
        for ls in chains:
            if units < len(ls):
                raise EvalError(
                    f"{self.task}: {units} noise lines cannot hold a chain of {len(ls)} lines; use "
                    f"longer lengths (preflight names the shortest)"
                )
            # before noise line p (p < units: a noise line always follows, as RULER's insert at p + j)
            slots = sorted(rng.sample(range(units), len(ls)))
            inserts += [(p, self.enc(x + "\n")) for p, x in zip(slots, ls, strict=True)]
        return lines_context([self.unit] * units, inserts, n_ctx, self.unit)

    def _example(self, index: int) -> str:
        if index not in self._examples:  # the same at every length
            self._examples[index] = self._make_example(index)
        return self._examples[index]

    def _make_example(self, index: int) -> str:
        """The worked example's text: 3-letter names, a 5-digit value, min(10, hops) hops, as many noise
        lines as keep it within ICL_TOKENS (its answer after that, lines 216-218)."""
        rng = self.rng("example", index)
        hops = min(10, self.spec.num_hops)
        names, chains = self._chains(rng, 3, hops, lambda: str(rng.randint(10000, 99998)))
        value = chains[0][0].split("=")[-1].strip()

        def text(units: int) -> str:
            r = self.rng("example-slots", index)
            ctx = [NOISE] * units
            for ls in chains:
                slots = sorted(r.sample(range(units), len(ls)))
                for j, (s, x) in enumerate(zip(slots, ls, strict=True)):
                    ctx.insert(s + j, x)
            return (VT_TEMPLATE + VT_ANSWER).format(context="\n".join(ctx), query=value, num_v=hops + 1)

        units = hops + 1  # the fewest lines a chain fits in
        while len(self.enc(text(units + 1))) <= ICL_TOKENS and units < 10 * ICL_TOKENS:
            units += 1
        return text(units) + " " + " ".join(names[0]) + "\n"

    def build(self, length: int, index: int):
        s = self.spec
        rng = self.rng("chains", index)
        names, chains = self._chains(rng, 5, s.num_hops, lambda: str(rng.randint(10000, 99998)))
        value = chains[0][0].split("=")[-1].strip()
        example = self._example(index)
        head, tail = self.frame(
            example + "\n" + self.before,
            self.after.format(query=value),
            VT_ANSWER.format(num_v=s.num_hops + 1, query=value),
        )
        chain_ids = sum(len(self.enc(x + "\n")) for ls in chains for x in ls)
        n_ctx = self.budget(length, len(head) + len(tail) + chain_ids)
        units = n_ctx // len(self.unit)
        ctx, starts = self._context(self.rng("slots", length, index), chains, units, n_ctx + chain_ids)
        # the first chain's lines are the answers; their depths in the context
        where = [starts[j] / len(ctx) for j in range(s.num_hops + 1)]
        return self.prompt(length, index, head + ctx + tail, names[0], where, {"value": value, "chains": names})
