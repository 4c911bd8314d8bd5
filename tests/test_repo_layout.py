"""The repository stays a product (issue 41): nothing tracked over 500 KB, no tarballs, traces or JUnit XML
(raw results stay out of git: a study's README says where they are), and yaml_configs/ does not come back
(configs/ holds the user recipes, tests/configs/ the tiny arms, experiments/<study>/ the study arms), and every
repository path the package names (a docstring's "experiments/speed/LOG.md compares them", a message's
"configs/ext32k.yaml") exists: a moved or deleted doc leaves no dangling pointer in megablu/."""

import glob
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 500 * 1024
PACKAGE = ROOT / "megablu"
# a path from the repository root: a top-level folder, not inside a longer path or a word ("~/.cache/megablu/x",
# "relaunch/") and not a placeholder ("configs/<arm>.yaml" is skipped below); "*" is a glob
REPO_PATH = re.compile(
    r"(?<![\w/.~-])(?:megablu|tests|bench|docs|configs|experiments|examples|launch|dev|csrc|"
    r"yaml_configs)/[A-Za-z0-9_./*<>-]*"
)
RAW = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".json.gz", ".xml", ".pt", ".safetensors", ".whl")


def tracked() -> list[str]:
    r = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr  # the tests run in a git checkout
    return [f for f in r.stdout.split("\0") if f and (ROOT / f).is_file()]


def test_nothing_tracked_is_large_or_raw():
    files = tracked()
    assert "README.md" in files and any(f.startswith("experiments/") for f in files), files[:5]
    big = {f: (ROOT / f).stat().st_size for f in files if (ROOT / f).stat().st_size > LIMIT}
    assert not big, f"tracked files over 500 KB (keep raw data out of git, say where it is): {big}"
    raw = [f for f in files if f.endswith(RAW)]
    assert not raw, f"tarballs, traces or JUnit XML in git (keep them out; a study README says where): {raw}"


def test_configs_live_where_the_layout_says():
    files = tracked()
    assert not any(f.startswith("yaml_configs/") for f in files)
    assert {
        "configs/base.yaml",
        "configs/ext32k.yaml",
        "tests/configs/tiny_cpu.yaml",
        "examples/quickstart/quickstart_cpu.yaml",
    } <= set(files)
    studies = {f.split("/")[1] for f in files if f.startswith("experiments/") and f.count("/") >= 2}
    for study in studies:
        assert f"experiments/{study}/README.md" in files, f"experiments/{study}/ has no README.md"


def missing_paths(text: str) -> list[str]:
    """The repository paths named in `text` that match nothing in the tree (placeholders skipped)."""
    named = {m.rstrip(".,;:") for m in REPO_PATH.findall(text)}
    return sorted(p for p in named if "<" not in p and not glob.glob(str(ROOT / p)))


@pytest.mark.parametrize(
    "text, missing",
    [
        ("docs/EXPERIMENTS.md has the rows; see experiments/speed/LOG.md.", ["docs/EXPERIMENTS.md"]),
        (
            "(yaml_configs/tiny_cpu.yaml, bench/h200_issue14.sh)",
            ["bench/h200_issue14.sh", "yaml_configs/tiny_cpu.yaml"],
        ),
        ("configs/<arm>.yaml, ~/.cache/megablu/verified, tests/ops/*.py, /dev/shm, csrc/", []),
    ],
)
def test_missing_paths_finds_what_it_must(text, missing):
    assert missing_paths(text) == missing


def test_every_repo_path_named_in_the_package_exists():
    files = sorted(PACKAGE.rglob("*.py")) + sorted(PACKAGE.rglob("*.md"))
    named = [m for f in files for m in REPO_PATH.findall(f.read_text(encoding="utf-8"))]
    assert len(named) > 50 and "experiments/speed/LOG.md" in named, named[:10]  # the scan sees the package's paths
    found = [f"{f.relative_to(ROOT)}: {p}" for f in files for p in missing_paths(f.read_text(encoding="utf-8"))]
    assert found == [], (
        "megablu/ names repository paths that do not exist; point at where the content lives "
        "now (experiments/<study>/, docs/) or say it without a pointer:\n" + "\n".join(found)
    )
