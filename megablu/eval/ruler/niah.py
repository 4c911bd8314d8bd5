"""RULER's needle-in-a-haystack (scripts/data/synthetic/niah.py): 8 tasks, 3 haystacks.

    Some special magic numbers are hidden within the following text. Make sure to memorize it. I will
    quiz you about the numbers afterwards.
    <context with the needles "One of the special magic numbers for {key} is: {value}.">
    What are all the special magic numbers for {query} mentioned in the provided text? The special magic
    numbers for {query} mentioned in the provided text are

singular when one value is asked ("A special magic number is hidden ... What is the special magic number
for {key} ... text is"). Haystacks (niah.py lines 84-93, 147-182):
  noise   RULER's five sentences, one per line, the needles as lines between them;
  essay   prose (the shipped essays stand in for Paul Graham's), the needles between its sentences;
  needle  lines of other needles (keys and values of the same kinds), the needles among them.
num_needle_k keys with num_needle_v values each; num_needle_q of the keys are asked; the answers are every
value of every asked key (scored string_match_all).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ..prompts import EvalError, TokenizerLike
from .assets import essay_text
from .common import RulerBuilder, lines_context, random_item
from .templates import NEEDLE, NIAH_ANSWER, NIAH_TEMPLATE, NOISE, join_query, singular

SNAP = 64  # tokens searched either side of a target position for a sentence end


class EssayStream:
    """The essay text as one token stream and, per token, whether a sentence ends with it: the token ends in
    . ! or ? and the next one starts with whitespace (RULER places needles between the sentences of its
    split, niah.py lines 155-166; '2.3', 'os.path' or 'e.g.' followed by a word do not end one)."""

    def __init__(self, tokenizer: TokenizerLike, text: str):
        self.ids = tokenizer.encode(text)
        if len(self.ids) < 2:
            raise EvalError("the RULER essay haystack encodes to fewer than 2 tokens")
        pieces = {t: tokenizer.decode([t]) for t in set(self.ids)}
        punct = {t: p.rstrip().endswith((".", "!", "?")) for t, p in pieces.items()}
        space = {t: p[:1].isspace() for t, p in pieces.items()}
        N = len(self.ids)  # the stream wraps round (window), so the last token's next is the first
        self.end = [
            punct[t] and (pieces[t] != pieces[t].rstrip() or space[self.ids[(i + 1) % N]])
            for i, t in enumerate(self.ids)
        ]

    def window(self, off: int, count: int) -> tuple[list[int], list[bool]]:
        """count tokens from off, wrapping round the stream (RULER repeats its essays when a length needs
        more words than they hold, niah.py lines 150-154)."""
        N = len(self.ids)
        idx = [(off + j) % N for j in range(count)]
        return [self.ids[i] for i in idx], [self.end[i] for i in idx]


@functools.lru_cache(maxsize=4)
def _stream(tokenizer, text: str) -> EssayStream:
    return EssayStream(tokenizer, text)


def _snap(ends: Sequence[bool], pos: int, n: int) -> int:
    """The insertion point nearest pos in [0, n] that follows a sentence end (pos itself if none near)."""
    for d in range(SNAP + 1):
        for p in (pos - d, pos + d):
            if 0 < p <= n and ends[p - 1]:
                return p
    return pos


class RulerNiah(RulerBuilder):
    def __init__(self, task, spec, tokenizer, seed, n, chat_template, essay: str | None = None):
        super().__init__(task, spec, tokenizer, seed, n, chat_template)
        s = spec
        self.nk = max(s.num_needle_k, s.num_needle_q)  # niah.py line 77
        full, self.tv = NIAH_TEMPLATE + NIAH_ANSWER, s.type_needle_v
        if s.num_needle_q * s.num_needle_v == 1:
            full, self.tv = singular(full, s.type_needle_v)
        cut = full.rfind(NIAH_ANSWER[:10])  # niah.py line 277: where the answer prefix starts
        self.user, self.answer = full[:cut], full[cut:]
        if s.type_haystack == "essay":
            self.essay = _stream(tokenizer, essay if essay is not None else essay_text())
        elif s.type_haystack == "noise":
            self.unit = self.enc(NOISE + "\n")

    def _draw(self, index: int):
        """keys, values per key, the asked keys' indices, each needle's (key j, value m) depth."""
        s, rng = self.spec, self.rng("needles", index)
        keys: list[str] = []
        values: list[list[str]] = []
        seen: set[str] = set()
        while len(keys) < self.nk:
            k = random_item(rng, s.type_needle_k)
            if k not in seen:
                seen.add(k)
                keys.append(k)
        for _ in keys:
            vs: list[str] = []
            while len(vs) < s.num_needle_v:
                v = random_item(rng, s.type_needle_v)
                if v not in seen:
                    seen.add(v)
                    vs.append(v)
            values.append(vs)
        asked = rng.sample(range(self.nk), s.num_needle_q)  # niah.py line 186
        depths = [[rng.random() for _ in vs] for vs in values]
        depths[asked[0]][0] = self.depth(index)
        return keys, values, asked, depths

    def _frame(self, keys, asked):
        before, after = self.user.split("{context}")
        query = join_query([keys[i] for i in asked])
        return self.frame(
            before.format(type_needle_v=self.tv),
            after.format(type_needle_v=self.tv, query=query),
            self.answer.format(type_needle_v=self.tv, query=query),
        )

    def build(self, length: int, index: int):
        s = self.spec
        keys, values, asked, depths = self._draw(index)
        head, tail = self._frame(keys, asked)
        # the needle text is plural in every task (niah.py line 137 formats it with args.type_needle_v)
        needles = [
            (j, m, NEEDLE.format(type_needle_v=s.type_needle_v, key=k, value=v))
            for j, (k, vs) in enumerate(zip(keys, values, strict=True))
            for m, v in enumerate(vs)
        ]
        sep = " " if s.type_haystack == "essay" else ""
        nid = [self.enc(sep + t + ("\n" if s.type_haystack != "essay" else "")) for _, _, t in needles]
        n_ctx = self.budget(length, len(head) + len(tail) + sum(map(len, nid)))
        ds = [depths[j][m] for j, m, _ in needles]
        ctx, starts, meta = self._context(length, index, n_ctx, nid, ds, keys, values)
        pos = {(j, m): st for (j, m, _), st in zip(needles, starts, strict=True)}
        total = n_ctx + sum(map(len, nid))
        answers = [v for j in asked for v in values[j]]
        where = [pos[(j, m)] / max(total, 1) for j in asked for m in range(s.num_needle_v)]
        return self.prompt(
            length,
            index,
            head + ctx + tail,
            answers,
            where,
            {
                **meta,
                "keys": [keys[j] for j in asked],
                "distractor_keys": [k for j, k in enumerate(keys) if j not in asked],
            },
        )

    def _context(self, length, index, n_ctx, nid, ds, keys, values):
        """(context ids with the needles, each needle's start, meta) for n_ctx haystack tokens."""
        kind = self.spec.type_haystack
        if kind == "essay":
            st = self.essay
            rng = self.rng("offset", length, index)
            off = rng.randrange(len(st.ids))
            # start at a sentence (RULER's text starts at its first word): the stream's start is one, else
            # after the next sentence end
            if off:
                _, ends = st.window(off, SNAP)
                off += next((i + 1 for i, e in enumerate(ends) if e), 0)
            hay, ends = st.window(off, n_ctx)
            cuts = [_snap(ends, round(d * n_ctx), n_ctx) for d in ds]
            order = sorted(range(len(nid)), key=lambda j: (cuts[j], j))
            out, starts, prev = [], [0] * len(nid), 0
            for j in order:
                out += hay[prev : cuts[j]]
                starts[j] = len(out)
                out += nid[j]
                prev = cuts[j]
            return out + hay[prev:], starts, {"offset": off}
        if kind == "noise":
            full = n_ctx // len(self.unit)
            lines = [self.unit] * full
            tail = self.unit
        else:  # needle: lines of other keys and values, as many whole lines as fit
            rng = self.rng("lines", length, index)
            taken = set(keys) | {v for vs in values for v in vs}
            lines, used = [], 0
            while True:
                k = random_item(rng, self.spec.type_needle_k)
                if k in taken:
                    continue
                line = self.enc(
                    NEEDLE.format(
                        type_needle_v=self.spec.type_needle_v, key=k, value=random_item(rng, self.spec.type_needle_v)
                    )
                    + "\n"
                )
                if used + len(line) > n_ctx:
                    tail = line
                    break
                lines.append(line)
                used += len(line)
        slots = [round(d * len(lines)) for d in ds]
        ctx, starts = lines_context(lines, list(zip(slots, nid, strict=True)), n_ctx + sum(map(len, nid)), tail)
        return ctx, starts, {"lines": len(lines)}
