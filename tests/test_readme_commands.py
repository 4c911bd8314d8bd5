"""The launch commands printed in README.md and in launch/ext32k.py's docstring pass the
config check for the world they launch (issue 19 item 11: the README's one-GPU command used
l2.yaml, whose sp=2 needs two ranks). The pure check: the data and parents are on the GPU box."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megablu.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[tuple[str, str]]:
    out = []
    for src in (ROOT / "README.md", ROOT / "launch" / "ext32k.py"):
        text = src.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split("  #")[0].strip().lstrip("# ").strip()
            if line.startswith("deepspeed ") and "launch/ext32k.py" in line:
                out.append((src.name, line))
    return out


def _world(argv: list[str]) -> int:
    if "--num_gpus" in argv:
        return int(argv[argv.index("--num_gpus") + 1])
    host = ROOT / argv[argv.index("--hostfile") + 1]
    lines = [ln for ln in host.read_text().splitlines() if not ln.lstrip().startswith("#")]
    return sum(int(n) for n in re.findall(r"slots=(\d+)", "\n".join(lines)))


def test_the_readme_shows_the_one_gpu_command():
    assert any("--num_gpus 1" in c for _, c in _commands())


@pytest.mark.parametrize("src,cmd", _commands(), ids=[c for _, c in _commands()])
def test_printed_launch_command_passes_the_config_check(src, cmd):
    argv = shlex.split(cmd)
    config = argv[argv.index("--config") + 1]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    device = "cpu" if "tiny_cpu" in config else "cuda"
    load_config(ROOT / config, sets, world_size=_world(argv), device=device)  # ConfigError lists every problem


def test_readme_is_at_most_10_kb():
    """The README stays a front page (issue 41): results, the two commands, workflow, features, layout;
    the dated logs live in experiments/<study>/ and dev/LOG.md."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 10 * 1024, f"README.md is {size} bytes > 10 KB: move detail to docs/ or experiments/"
