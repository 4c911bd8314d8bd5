"""One version (megablu/__init__.py), printed by `megablu --version` and read by setup.py; the
extras setup.py declares for the optional kernels and trackers the error messages name."""

import re
import runpy
from pathlib import Path

import pytest
import setuptools

import megablu
from megablu.cli import main
from megablu.train.tracker import MODULES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_kwargs():
    """What setup.py hands setuptools.setup (run without building anything)."""
    seen = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
        runpy.run_path(str(ROOT / "setup.py"))
    return seen


def test_megablu_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"megablu {megablu.__version__}\n"


def test_setup_reads_the_one_version(setup_kwargs):
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", megablu.__version__)
    assert setup_kwargs["version"] == megablu.__version__
    assert not re.search(r"""version\s*=\s*["']""", (ROOT / "setup.py").read_text())  # not written twice


def test_extras_declare_the_optional_kernels_and_trackers(setup_kwargs):
    extras = {k: [re.split(r"[<>=!~\[ ]", r)[0] for r in v] for k, v in setup_kwargs["extras_require"].items()}
    assert extras["liger"] == ["liger-kernel"] and extras["fa4"] == ["flash-attn-4"]
    assert sorted(extras["gpu"]) == ["flash-attn-4", "liger-kernel"]
    for name, module in MODULES.items():  # train.tracker's error says pip install 'megablu[<name>]'
        assert extras[name] == [module]
    assert not {"liger-kernel", "flash-attn-4", *MODULES} & {
        re.split(r"[<>=!~\[ ]", r)[0] for r in setup_kwargs["install_requires"]
    }
