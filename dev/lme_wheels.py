"""lm-eval for the device, which reaches no registry (issue 40's oracle, experiments/ruler_baselines/run.sh).

Here (needs the registries): ``python dev/lme_wheels.py build`` fills the git-ignored ``.whl_lme/`` with
wheels (python 3.12, manylinux) of requirements.txt's lm-eval block less pyarrow, which the GPU image holds
and which alone would fill a call's carry; its three sdists are turned into wheels.

On the device: ``python3 dev/lme_wheels.py install --target /tmp/site`` installs every pure-python wheel
(the pins CI tests) and a compiled one only where the image lacks that distribution: a compiled package
the image already has is built against the image's numpy and stays. It stamps ``/tmp/site/.megablu_lme``,
which run.sh's oracle arm checks before installing anything itself.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = {"pyarrow"}  # held by the image; 55 MB
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _block() -> list[str]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("lm-eval=="))
    reqs = [line.strip() for line in lines[start:] if line.strip() and not line.startswith("#")]
    return [r for r in reqs if _norm(r.split("==")[0]) not in SKIP]


def build(out: Path) -> None:
    out.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        plat = [a for p in PLATFORMS for a in ("--platform", p)]
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--python-version", "3.12"]
        subprocess.run([*cmd, "--implementation", "cp", *plat, "-d", tmp, *_block()], check=True)
        for f in Path(tmp).iterdir():
            if f.suffix == ".whl":
                f.rename(out / f.name)
            else:  # an sdist: its pure-python wheel
                subprocess.run(
                    [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(f)], check=True
                )
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(f"{out}: {len(list(out.glob('*.whl')))} wheels, {size:,} B")


def _held(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def choose(wheels: list[Path], held=_held) -> tuple[list[Path], list[str]]:
    """(the wheels to install, the image's distributions kept): every pure-python wheel, and a compiled
    one only where `held` says the image lacks its distribution."""
    chosen, kept = [], []
    for whl in sorted(wheels):
        dist, platform = whl.name.split("-")[0], whl.stem.split("-")[-1]
        if platform != "any" and held(dist):
            kept.append(dist)
        else:
            chosen.append(whl)
    return chosen, kept


def install(wheels: Path, target: Path) -> None:
    chosen, kept = choose(list(wheels.glob("*.whl")))
    print(f"installing {len(chosen)} wheels; the image's own kept: {' '.join(kept) or 'none'}")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    subprocess.run([*cmd, "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, chosen)], check=True)
    (target / ".megablu_lme").touch()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, default=ROOT / ".whl_lme")
    i = sub.add_parser("install")
    i.add_argument("--wheels", type=Path, default=ROOT / ".whl_lme")
    i.add_argument("--target", type=Path, required=True)
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.out)
    else:
        install(a.wheels, a.target)


if __name__ == "__main__":
    main()
