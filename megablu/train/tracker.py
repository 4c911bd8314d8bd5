"""Experiment trackers beside metrics.csv and TensorBoard (train.tracker), local-first:

  none     metrics.csv and TensorBoard only (the default)
  wandb    Weights & Biases in offline mode: its files under <run dir>/wandb/, nothing sent;
           `wandb sync <run dir>/wandb/offline-run-*` uploads them later if you want
  trackio  trackio's local store (its own directory, TRACKIO_DIR); `trackio show` browses it

What the tracker prints goes to stderr (stdout carries only a command's result). Neither
package is a dependency of megablu: each is an extra (`pip install 'megablu[wandb]'`),
and a config that asks for one that does not import here is refused by the preflight
(`tracker_problem`), before any rank starts. Rank 0 writes, as for metrics.csv. The tracker's
run is named after the run dir and resumed with it (`--resume RUN` continues the same run).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Optional

PROJECT = "megablu"
# train.tracker -> the module it imports (also the name of its setup.py extra)
MODULES = {"wandb": "wandb", "trackio": "trackio"}


def tracker_problem(name: str) -> Optional[str]:
    """Why train.tracker=`name` cannot run here ('field: problem; fix'), or None."""
    module = MODULES.get(name)
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return (
        f"train.tracker={name}: the {module} package is not installed; pip install 'megablu[{name}]' "
        f"(or pip install {module}), or set train.tracker=none (metrics.csv and TensorBoard are always written)"
    )


class Tracker:
    """One tracker run: `log(row, step)` per logged step, `close()` at the end of the session."""

    def __init__(self, name: str, run_dir: Path, config: dict):
        why = tracker_problem(name)
        if why:
            raise RuntimeError(why)
        self.name = name
        self.lib: Any = importlib.import_module(MODULES[name])
        run_dir = Path(run_dir)
        with contextlib.redirect_stdout(sys.stderr):
            if name == "wandb":
                # offline: written under the run dir, never sent; id = run name, so a resume continues it
                self.run = self.lib.init(
                    project=PROJECT,
                    name=run_dir.name,
                    id=run_dir.name,
                    resume="allow",
                    dir=str(run_dir),
                    config=config,
                    mode="offline",
                )
            else:
                self.run = self.lib.init(project=PROJECT, name=run_dir.name, resume="allow", config=config)

    def log(self, row: dict, step: int) -> None:
        scalars = {
            f"train/{k}": v
            for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        with contextlib.redirect_stdout(sys.stderr):
            self.run.log(scalars, step=step)

    def close(self) -> None:
        # the module's finish(), not the run's: it also clears the library's current run, which
        # trackio would otherwise finish (and announce on stdout) again at exit
        with contextlib.redirect_stdout(sys.stderr):
            self.lib.finish()


def open_tracker(name: str, run_dir: Path, config: dict) -> Optional[Tracker]:
    """The tracker train.tracker names (None for "none")."""
    return None if name == "none" else Tracker(name, run_dir, config)
