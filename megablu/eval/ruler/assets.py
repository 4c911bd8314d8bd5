"""The RULER suite's word lists and essay text, shipped in megablu/eval/assets/ruler (provenance and
licences: its README.md; built by make_assets.py), read once per process."""

from __future__ import annotations

import functools
import gzip
import re
from pathlib import Path

DIR = Path(__file__).resolve().parents[1] / "assets" / "ruler"


def _lines(name: str) -> list[str]:
    # wonderwords' _get_words_from_text_file: every line, right-stripped (random_word.py line 88)
    return [w.rstrip() for w in (DIR / name).read_text(encoding="utf-8").split("\n") if w.rstrip()]


@functools.cache
def wonderwords(category: str) -> tuple[str, ...]:
    """wonderwords 3.0.1's list: 'nouns', 'adjectives' or 'verbs'."""
    return tuple(_lines(f"wonderwords_{category}.txt"))


def niah_key(rng) -> str:
    """A key as niah.py lines 97-101 and 113-115 draw it: one of the 'adjective-noun' pairs, uniformly (a
    uniform adjective and a uniform noun: the same law without building RULER's 6.2M-string list)."""
    return f"{rng.choice(wonderwords('adjectives'))}-{rng.choice(wonderwords('nouns'))}"


@functools.cache
def cwe_words() -> tuple[str, ...]:
    """common_words_extraction.py lines 72-76: nouns + adjectives + verbs, sorted, distinct (8,166 words;
    RULER then shuffles them with its seed, here each prompt's rng samples them)."""
    return tuple(sorted(set(wonderwords("nouns") + wonderwords("adjectives") + wonderwords("verbs"))))


@functools.cache
def english_words() -> tuple[str, ...]:
    """The longer list cwe samples from when a prompt needs more words than cwe_words has (RULER's
    randle_words, json/english_words.json, lines 81-83 and 86-89): 23k SCOWL base words."""
    return tuple(_lines("english_words.txt"))


@functools.cache
def essay_text() -> str:
    """The essay haystack, whitespace-normalised as RULER's (niah.py line 87: re.sub(r'\\s+', ' ', essay)):
    one line of prose, documents in a fixed order."""
    with gzip.open(DIR / "essays.txt.gz", "rt", encoding="utf-8") as f:
        return re.sub(r"\s+", " ", f.read()).strip()
