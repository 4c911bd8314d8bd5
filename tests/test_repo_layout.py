"""The repository stays a product (issue 41): nothing tracked over 500 KB, no tarballs, traces or JUnit XML
(raw results stay out of git: a study's README says where they are), and yaml_configs/ does not come back
(configs/ holds the user recipes, tests/configs/ the tiny arms, experiments/<study>/ the study arms)."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 500 * 1024
RAW = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".json.gz", ".xml", ".pt", ".safetensors", ".whl")


def tracked() -> list[str]:
    r = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr                 # the tests run in a git checkout
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
    assert {"configs/base.yaml", "configs/ext32k.yaml", "tests/configs/tiny_cpu.yaml",
            "examples/quickstart/quickstart_cpu.yaml"} <= set(files)
    studies = {f.split("/")[1] for f in files if f.startswith("experiments/") and f.count("/") >= 2}
    for study in studies:
        assert f"experiments/{study}/README.md" in files, f"experiments/{study}/ has no README.md"
