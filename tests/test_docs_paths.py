"""Every committed result the docs point to is in the repo: each results path (`experiments/<study>/results/...`,
`examples/quickstart/results/...`), figure (`*.png`) and study file named in README.md, docs/*.md,
experiments/*/*.md, examples/*/*.md and dev/*.md exists (a glob: at least one match; a `{a,b}` form: each of
its paths). A path written `<commit>:path` names a file in git history (raw data kept out of the tree), not
here. A device call's carry limit once had us take these files out of the working tree for a while; a commit
made in that window deleted twelve figures and ten result tarballs once
(2026-12-06, restored from history). This test makes such a commit fail CI."""

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(ROOT.glob("experiments/*/*.md")),
    *sorted(ROOT.glob("examples/*/*.md")),
    *sorted((ROOT / "dev").glob("*.md")),
]
PATH_RE = re.compile(
    r"(?<![\w:/.-])(?:docs/img|bench/results|experiments|examples/quickstart/results)/"
    r"(?:[A-Za-z0-9_./<>*-]|\{[^{}\s]*\})+"
)
BRACES = re.compile(r"\{([^{}]*)\}")


def expand(p: str) -> list[str]:
    """`a.{md,json}` -> a.md, a.json (each form named must exist, not just one)."""
    m = BRACES.search(p)
    if not m:
        return [p]
    return [q for alt in m.group(1).split(",") for q in expand(p[: m.start()] + alt + p[m.end() :])]


def named_paths() -> dict[str, list[str]]:
    """path pattern -> the docs naming it (trailing punctuation trimmed, `{a,b}` expanded)."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for m in PATH_RE.findall(doc.read_text(encoding="utf-8")):
            for p in expand(m.rstrip(".,;:)")):
                if "<" in p:  # a placeholder (`<arm>`): not a committed path
                    continue
                found.setdefault(p, []).append(doc.name)
    return found


def test_docs_name_some_paths():
    """The scan sees the docs' results (a broken regex would pass the test below vacuously)."""
    paths = named_paths()
    assert any(p.endswith(".png") for p in paths), sorted(paths)
    assert any("/results/" in p for p in paths), sorted(paths)
    assert not any(p.startswith("bench/results/") for p in paths), "results live in experiments/<study>/results"
    assert expand("r/a.{md,json}") == ["r/a.md", "r/a.json"] and expand("r/{x,y}_{1,2}") == [
        "r/x_1",
        "r/x_2",
        "r/y_1",
        "r/y_2",
    ]


@pytest.mark.parametrize("pattern", sorted(named_paths()))
def test_named_path_exists(pattern):
    hits = glob.glob(str(ROOT / pattern))
    assert hits, (
        f"{pattern} is named in {sorted(set(named_paths()[pattern]))} but is not in the repo: "
        f"restore it (git log --diff-filter=D -- '{pattern}'; git checkout <commit>~1 -- <path>) "
        "or correct the doc"
    )
