"""RULER's aggregation tasks: common words extraction (common_words_extraction.py) and frequent words
extraction (freq_words_extraction.py).

cwe: one worked example, then a numbered list on one line ("1. w 2. w ...") where num_cw words appear
freq_cw times and every other word freq_ucw times (lines 85-98); below length 4096 the example has 20
words (3 and 1 times) and the list 6 and 1 times, else 40 words (10 and 3 times) and freq_cw / freq_ucw
(lines 102-111). The example is the whole task with its answer, "1. w1 2. w2 ... 10. w10" (line 120),
a newline, then the task; with a chat template on, the example is an earlier user turn and its answer
the assistant's (RULER repeats its model template around the example). Words: wonderwords' 8,166
nouns, adjectives and verbs while a length needs no more, else the 23k-word English list (RULER's
english_words.json fallback, lines 86-89): every uncommon word is distinct at every length; a length
needing more words than the list has is an error, never a repeat. Answers: the num_cw common words.

fwe: coded words (6 random lower-case letters) of a vocabulary of (length - 50) // 50 (lines 113-114);
rank k appears int(N k^-alpha / zeta(alpha)) times (lines 85-91), rank 1 being the noise '...'; N is the
largest that fits. Answers: ranks 2-4 (line 91: vocab[1:4]).

Both fill the length with whole items; the few tokens left (less than one more word's occurrences) are
newlines before the question.
"""

from __future__ import annotations

import itertools
import string

from ..prompts import EvalError
from .assets import cwe_words, english_words
from .common import RulerBuilder, repeat_ids
from .templates import CWE_ANSWER, CWE_TEMPLATE, FWE_ANSWER, FWE_NOISE, FWE_TEMPLATE


def _numbered(words) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


class RulerCWE(RulerBuilder):
    def __init__(self, task, spec, tokenizer, seed, n, chat_template):
        super().__init__(task, spec, tokenizer, seed, n, chat_template)
        self.before, self.after = CWE_TEMPLATE.split("{context}")
        self._num: list[list[int]] = [[]]
        self._word: dict[str, int] = {}
        self._numcum: list[int] = [0]
        self._orders: dict = {}
        self.pad = self.enc("\n")

    def _regime(self, length: int) -> tuple[tuple[int, int, int], tuple[int, int]]:
        """((example words, common, uncommon repeats), (common, uncommon repeats)): lines 102-111."""
        s = self.spec
        return ((20, 3, 1), (6, 1)) if length < 4096 else ((40, 10, 3), (s.freq_cw, s.freq_ucw))

    def _example(self, index: int, ex) -> tuple[str, str]:
        """(the example's task text, its answer "1. w1 ... 10. w10"); words drawn as get_example's."""
        rng = self.rng("example", index)
        words = rng.sample(cwe_words(), ex[0])
        common, uncommon = words[: self.spec.num_cw], words[self.spec.num_cw :]
        seq = common * ex[1] + uncommon * ex[2]
        rng.shuffle(seq)
        return CWE_TEMPLATE.format(context=_numbered(seq)), _numbered(common)

    def _order(self, index: int, what: str, source) -> list[str]:
        """Prompt index's own order of a word list (the same at every length)."""
        key = (index, what, len(source()))
        if key not in self._orders:
            order = list(source())
            self.rng(what, index).shuffle(order)
            self._orders = {key: order, **{k: v for k, v in self._orders.items() if k[0] == index}}
        return self._orders[key]

    def _num_ids(self, i: int) -> list[int]:
        while len(self._num) <= i:  # " 12." (the first entry follows the template's newline: "1.")
            j = len(self._num)
            self._num.append(self.enc(f"{j}." if j == 1 else f" {j}."))
        return self._num[i]

    def _wcost(self, w: str) -> int:
        if w not in self._word:
            self._word[w] = len(self.enc(" " + w))
        return self._word[w]

    def _numbers(self, E: int) -> int:
        """Tokens of the numbers 1..E ("1." " 2." ...): a running sum, extended on demand."""
        while len(self._numcum) <= E:
            self._numcum.append(self._numcum[-1] + len(self._num_ids(len(self._numcum))))
        return self._numcum[E]

    def _coster(self, words, reps):
        """cost(W): tokens of the list of the first W of `words` (O(1) per call after a running sum)."""
        c = self.spec.num_cw
        cum = list(itertools.accumulate((self._wcost(w) for w in words), initial=0))

        def cost(W: int) -> int:
            return self._numbers(c * reps[0] + (W - c) * reps[1]) + reps[0] * cum[c] + reps[1] * (cum[W] - cum[c])

        return cost

    def build(self, length: int, index: int):
        c = self.spec.num_cw
        ex, reps = self._regime(length)
        ex_text, ex_answer = self._example(index, ex)
        if self.chat.on:
            head, tail = self.frame(
                self.before,
                self.after,
                CWE_ANSWER,
                turns=[("user", ex_text), ("assistant", CWE_ANSWER.strip() + " " + ex_answer)],
            )
        else:
            head, tail = self.frame(ex_text + CWE_ANSWER + " " + ex_answer + "\n" + self.before, self.after, CWE_ANSWER)
        budget = self.budget(length, len(head) + len(tail))
        # the most words whose list fits; each prompt's own order of the list (the same at every length
        # while one list serves), so its common words are the same at every length
        wonder = self._order(index, "words", cwe_words)
        cost = self._coster(wonder, reps)
        lo, hi = c, len(wonder)
        if cost(hi) <= budget:  # wonderwords runs out: the longer list (RULER's too)
            wonder = self._order(index, "english-words", english_words)
            cost = self._coster(wonder, reps)
            lo, hi = c, len(wonder)
            if cost(hi) <= budget:
                raise EvalError(
                    f"{self.task}: length {length} needs more than the {hi} distinct words of "
                    f"the English word list (every uncommon word is distinct); use shorter lengths"
                )
        while hi - lo > 1:  # largest W with cost(W) <= budget, cost(hi) > budget
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid)
        words = wonder[:lo]
        if lo <= c or cost(lo) > budget:
            raise EvalError(
                f"{self.task}: length {length} holds no uncommon word after the {c} common ones; use "
                f"longer lengths (preflight names the shortest)"
            )
        seq = words[:c] * reps[0] + words[c:] * reps[1]
        self.rng("order", length, index).shuffle(seq)
        body = []
        for i, w in enumerate(seq, 1):
            body += self._num_ids(i) + self.enc(" " + w)
        ids = head + body + repeat_ids(self.pad, budget - len(body)) + tail
        return self.prompt(
            length,
            index,
            ids,
            words[:c],
            (),
            {
                "words": len(words),
                "entries": len(seq),
                "list": "wonderwords" if len(words) <= len(cwe_words()) else "english_words",
            },
        )


class RulerFWE(RulerBuilder):
    CODE = 6  # coded_wordlen

    def __init__(self, task, spec, tokenizer, seed, n, chat_template):
        super().__init__(task, spec, tokenizer, seed, n, chat_template)
        from scipy.special import zeta  # RULER's (line 42)

        self.z = float(zeta(spec.alpha))
        self.before, self.after = FWE_TEMPLATE.split(" {context}")
        self.pad = self.enc("\n")

    def _vocab(self, index: int, size: int) -> list[str]:
        """size distinct codes, the first replaced by the noise '...' (lines 76-81); a prompt's codes are
        a prefix of one stream, so its answers are the same at every length."""
        rng, seen, out = self.rng("codes", index), set[str](), list[str]()
        while len(out) < size:
            w = "".join(rng.choice(string.ascii_lowercase) for _ in range(self.CODE))
            if w not in seen:
                seen.add(w)
                out.append(w)
        out[0] = FWE_NOISE
        return out

    def _counts(self, N: int, size: int) -> list[int]:
        a = self.spec.alpha
        return [int(N * k**-a / self.z) for k in range(1, size + 1)]

    def build(self, length: int, index: int):
        size = (length - self.ttg) // 50
        if size < 5:
            raise EvalError(
                f"{self.task}: length {length} gives a vocabulary of {size} < 5 coded words; use longer "
                f"lengths (preflight names the shortest)"
            )
        vocab = self._vocab(index, size)
        cost = [len(self.enc(" " + w)) for w in vocab]
        head, tail = self.frame(self.before, self.after, FWE_ANSWER)
        budget = self.budget(length, len(head) + len(tail))
        total = lambda N: sum(c * k for c, k in zip(self._counts(N, size), cost, strict=True))  # noqa: E731
        lo, hi = 0, max(1, budget)
        while total(hi) <= budget:
            hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
        counts = self._counts(lo, size)
        if not all(counts[r] > counts[r + 1] for r in (1, 2, 3)):
            raise EvalError(
                f"{self.task}: at length {length} the three answers are not strictly the most frequent "
                f"(counts {counts[:5]}); use longer lengths (preflight names the shortest)"
            )
        seq = [w for w, k in zip(vocab, counts, strict=True) for _ in range(k)]
        self.rng("order", length, index).shuffle(seq)
        enc = {w: self.enc(" " + w) for w in vocab}
        body = [t for w in seq for t in enc[w]]
        ids = head + body + repeat_ids(self.pad, budget - len(body)) + tail
        return self.prompt(length, index, ids, vocab[1:4], (), {"N": lo, "counts": counts[:5], "vocab": size})
