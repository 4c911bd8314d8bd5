"""Aggregation tasks (RULER, Hsieh et al. 2024): the answer is a statistic of the whole context,
not one needle, so they measure whether a model reads all of it. Structure follows RULER's
common_words_extraction.py and freq_words_extraction.py; the prompts are written here.

cwe -- common words extraction:

    Below is a numbered list of words. In these words, some appear more often than others.
    Memorize the ones that appear most often.
    <a worked example: a short list and its answer>
    1. garden
    2. paused
    ...
    Question: What are the 10 most common words in the above list? Answer: The top 10 words that
    appear most often in the list are:

`common` words appear `freq_common` times each, every other word `freq_uncommon` times; as many
uncommon words as fill the length. The shipped list has 2006 words: past ~27k tokens (cl100k)
it runs out and the uncommon words take further rounds (each at most freq_common - 1 times),
so the common words stay the most common, by a smaller factor. Answers: the common words.

fwe -- frequent words extraction:

    Read the following coded text and track the frequency of each coded word. Find the three
    most frequently appeared coded words.
    .... kzqwhr .... ptlmva .... kzqwhr ...
    Question: Do not provide any explanation. Please ignore the dots '....'. What are the three
    most frequently appeared words in the above coded text? Answer: According to the coded text
    above, the three most frequently appeared words are:

Word of rank k (random 6-letter codes) appears floor(N k^-alpha / zeta(alpha)) times, N chosen
to fill the length; rank 1 is the noise '....'; answers: ranks 2 .. top+1. Both tasks have no
needle depth (depth None). Lists and texts are composed in token space, item by item, so the
length is exact; what whole items cannot fill (fewer tokens than one item) is blank lines
before the question.
"""

from __future__ import annotations

import math
import string

from .prompts import EvalError, Prompt, TokenizerLike, check_seed, pad_ids, rng_for, words

CWE_HEAD = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
CWE_Q = (
    "\nQuestion: What are the {k} most common words in the above list? Answer: The top {k} words that "
    "appear most often in the list are:"
)
FWE_HEAD = (
    "Read the following coded text and track the frequency of each coded word. Find the {k} most "
    "frequently appeared coded words.\n"
)
FWE_Q = (
    "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the {k} most "
    "frequently appeared words in the above coded text? Answer: According to the coded text above, the "
    "{k} most frequently appeared words are:"
)
_NUM = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def _k(k: int) -> str:
    return _NUM[k] if k < len(_NUM) else str(k)


class CWEBuilder:
    EXAMPLE_COMMON_FREQ, EXAMPLE_UNCOMMON = 3, 12

    def __init__(self, task: str, spec, tokenizer: TokenizerLike, seed: int, n: int):
        self.task, self.spec, self.tok, self.seed, self.n = task, spec, tokenizer, check_seed(seed), n
        self.head = tokenizer.encode(CWE_HEAD)
        self.question = tokenizer.encode(CWE_Q.format(k=spec.common))
        self.words = words()
        if len(self.words) < 2 * spec.common + self.EXAMPLE_UNCOMMON + 1:
            raise EvalError(f"{task}: the word list has {len(self.words)} words, too few for {spec.common} common")
        self._wcost: dict[str, list[int]] = {}
        self._ncost: list[list[int]] = [[]]

    def _num(self, i: int) -> list[int]:
        while len(self._ncost) <= i:
            self._ncost.append(self.tok.encode(f"{len(self._ncost)}."))
        return self._ncost[i]

    def _word(self, w: str) -> list[int]:
        if w not in self._wcost:
            self._wcost[w] = self.tok.encode(f" {w}\n")
        return self._wcost[w]

    def _list(self, seq: list[str]) -> list[int]:
        out = []
        for i, w in enumerate(seq, 1):
            out += self._num(i) + self._word(w)
        return out

    def _draw(self, index: int):
        rng = rng_for(self.seed, self.task, "words", index)
        order = list(self.words)
        rng.shuffle(order)
        c = self.spec.common
        common, ex_common = order[:c], order[c : 2 * c]
        ex_unc = order[2 * c : 2 * c + self.EXAMPLE_UNCOMMON]
        uncommon = order[2 * c + self.EXAMPLE_UNCOMMON :]
        ex = ex_common * self.EXAMPLE_COMMON_FREQ + ex_unc
        rng.shuffle(ex)
        example = self._list(ex) + self.question + self.tok.encode(" " + ", ".join(ex_common) + "\n\n")
        return rng, common, uncommon, example

    def _occurrences(self, common, uncommon, budget: int) -> list[str]:
        """The multiset of list words filling `budget` tokens: common x freq_common, then uncommon
        words freq_uncommon times each, then (list exhausted) further rounds, one word at a time."""
        s = self.spec
        seq = [w for w in common for _ in range(s.freq_common)]
        used = sum(len(self._num(i)) for i in range(1, len(seq) + 1)) + sum(len(self._word(w)) for w in seq)
        if used > budget:
            raise EvalError(f"{self.task}: {used} tokens of common words alone exceed the {budget} available")
        rounds = [s.freq_uncommon] + [1] * (s.freq_common - 1 - s.freq_uncommon)
        for times in rounds:
            for w in uncommon:
                cost = sum(len(self._num(len(seq) + 1 + t)) for t in range(times)) + times * len(self._word(w))
                if used + cost > budget:
                    return seq
                seq += [w] * times
                used += cost
        raise EvalError(
            f"{self.task}: {budget} tokens is more than the word list can fill with the common words "
            f"still the most common; use shorter lengths or a larger freq_common"
        )

    def min_length(self) -> int:
        worst = 0
        for i in range(self.n):
            _, common, uncommon, example = self._draw(i)
            # the common words and the first uncommon one, numbered as in the list
            seq = [w for w in common for _ in range(self.spec.freq_common)] + [uncommon[0]] * self.spec.freq_uncommon
            worst = max(worst, len(self.head) + len(example) + len(self._list(seq)) + len(self.question))
        return worst

    def build(self, length: int, index: int) -> Prompt:
        rng, common, uncommon, example = self._draw(index)
        budget = length - len(self.head) - len(example) - len(self.question)
        if budget < 0:
            raise EvalError(f"{self.task}: length {length} is shorter than its instruction, example and question")
        seq = self._occurrences(common, uncommon, budget)
        if len(seq) == self.spec.common * self.spec.freq_common:
            raise EvalError(
                f"{self.task}: length {length} holds the common words but no uncommon one; use lengths "
                f">= {self.min_length()}"
            )
        rng.shuffle(seq)
        body = self._list(seq)
        ids = self.head + example + body + pad_ids(self.tok, budget - len(body)) + self.question
        assert len(ids) == length, (len(ids), length)
        return Prompt(
            self.task,
            length,
            index,
            tuple(ids),
            ", ".join(common),
            None,
            {"entries": len(seq), "distinct": len(set(seq))},
            answers=tuple(common),
            scoring="all",
        )


class _Costs:
    """Tokens of ' <word>' per rank, encoded on first use: only ranks with a count >= 1 are
    (about sqrt(N / zeta) of the 2000 at alpha 2)."""

    def __init__(self, tok, vocab):
        self.tok, self.vocab, self.c = tok, vocab, {}

    def __getitem__(self, k: int) -> int:
        if k not in self.c:
            self.c[k] = len(self.tok.encode(" " + self.vocab[k]))
        return self.c[k]


def _zeta(a: float, terms: int = 100000) -> float:
    """Riemann zeta(a), a > 1: the partial sum plus the integral tail (error < 1e-10 for a >= 2)."""
    return sum(k**-a for k in range(1, terms)) + terms ** (1 - a) / (a - 1)


class FWEBuilder:
    VOCAB = 2000  # coded words per prompt (RULER's vocab_size)

    def __init__(self, task: str, spec, tokenizer: TokenizerLike, seed: int, n: int):
        self.task, self.spec, self.tok, self.seed, self.n = task, spec, tokenizer, check_seed(seed), n
        k = _k(spec.top)
        self.head = tokenizer.encode(FWE_HEAD.format(k=k))
        self.question = tokenizer.encode(FWE_Q.format(k=k))
        self.z = _zeta(spec.alpha)

    def _vocab(self, index: int):
        rng = rng_for(self.seed, self.task, "codes", index)
        seen, vocab = {"...."}, ["...."]  # rank 1 is the noise (RULER)
        while len(vocab) < self.VOCAB:
            w = "".join(rng.choice(string.ascii_lowercase) for _ in range(6))
            if w not in seen:
                seen.add(w)
                vocab.append(w)
        return rng, vocab, _Costs(self.tok, vocab)

    def _counts(self, N: int) -> list[int]:
        a = self.spec.alpha
        out = []
        for k in range(1, self.VOCAB + 1):
            c = int(N * k**-a / self.z)
            if c == 0:
                break
            out.append(c)
        return out

    def _separated(self, counts: list[int]) -> bool:
        t = self.spec.top
        return len(counts) >= t + 2 and all(counts[r] > counts[r + 1] for r in range(1, t + 1))

    def _fit(self, costs: list[int], budget: int) -> list[int]:
        """The counts for the largest N whose text fits `budget` tokens (binary search; monotone in N)."""
        cost = lambda N: sum(c * costs[k] for k, c in enumerate(self._counts(N)))  # noqa: E731
        lo, hi = 0, max(1, budget)
        while cost(hi) <= budget:
            hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid)
        return self._counts(lo)

    def min_length(self) -> int:
        worst = 0
        for i in range(self.n):
            _, _, costs = self._vocab(i)
            N = 1
            while not self._separated(self._counts(N)):
                N = math.ceil(N * 1.1) + 1
            worst = max(worst, sum(c * costs[k] for k, c in enumerate(self._counts(N))))
        return worst + len(self.head) + len(self.question)

    def build(self, length: int, index: int) -> Prompt:
        rng, vocab, costs = self._vocab(index)
        budget = length - len(self.head) - len(self.question)
        counts = self._fit(costs, budget) if budget > 0 else []
        if not self._separated(counts):
            raise EvalError(
                f"{self.task}: length {length} is too short for the top {self.spec.top} coded words to "
                f"be strictly the most frequent; use lengths >= {self.min_length()}"
            )
        # counts: the first words of vocab, as many as fit the length
        seq = [w for w, c in zip(vocab, counts, strict=False) for _ in range(c)]
        rng.shuffle(seq)
        ids: list[int] = []
        enc = {w: self.tok.encode(" " + w) for w in vocab[: len(counts)]}
        for w in seq:
            ids += enc[w]
        ids = self.head + ids + pad_ids(self.tok, budget - len(ids)) + self.question
        assert len(ids) == length, (len(ids), length)
        top = tuple(vocab[1 : self.spec.top + 1])
        return Prompt(
            self.task,
            length,
            index,
            tuple(ids),
            ", ".join(top),
            None,
            {"counts": counts[: self.spec.top + 2]},
            answers=top,
            scoring="all",
        )
