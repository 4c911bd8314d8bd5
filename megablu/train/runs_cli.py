"""`megablu runs`: every run of a runs dir and its state; `megablu runs show RUN`: one run in full.

    megablu runs                      # runs/ (the configs' default runs_dir)
    megablu runs /scratch/runs --json
    megablu runs show tiny_cpu_ext-0001 [--runs-dir runs] [--plot out.png]

Read-only on the runs (only `show` writes its plot, by default <run>/train.png). The state of
a run comes from what it left behind, not from its exit code:
  running   a live job holds run.lock (heartbeat, pid on this host)
  finished  its metrics reached train.max_steps (with a gate failure, still finished: the
            eval column says so)
  stopped   its last session ended before max_steps on purpose (train.stop_after or
            stop_after_s: summary.json was written at the step the metrics end): resume it
  failed    a rank of the last session wrote logs/rank<N>.error.txt with an error, or the
            probe ran out of memory
  killed    none of the above: the job vanished (kill -9, the OOM killer, a lost node) or
            every rank's error is a signal (SIGTERM, Ctrl-C) or followed its launcher's death
            (LauncherGone); its run.lock may be left stale
  unreadable  its files cannot be read (a binary metrics.csv): the other runs still list
Loss is the mean of the last 10 steps in metrics.csv; tokens/s the mean over the steps, the
first step of each session left out (as summary.json); the checkpoint is the newest one that
`resume` would take (sizes checked; `megablu ckpt verify` hashes them); the eval is the newest
eval/step_<N>.json. Exit 0, or 2 when the runs dir or the run does not exist (or `show` is given a
folder that is no run: a runs dir is named as such).
"""

from __future__ import annotations

import csv
import json
import logging
import re
import sys
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

SMOOTH = 10  # steps in the "last loss" mean
SIGNALS = ("Terminated", "KeyboardInterrupt", "LauncherGone")  # errors that say the job was stopped from outside


def _rows(run: Path) -> list[dict]:
    """metrics.csv's rows as floats; ValueError (or csv.Error, OSError) when the file is not text at all."""
    path = run / "metrics.csv"
    if not path.exists():
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for r in csv.DictReader(f):
            try:
                out.append({k: float(v) for k, v in r.items() if v not in ("", None)})
            except ValueError:  # a row cut by a kill mid-write: ignore it, keep the rest
                continue
    return [r for r in out if "step" in r and "loss" in r]


def _json(path: Path) -> Optional[dict]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _max_steps(run: Path) -> Optional[int]:
    import yaml

    try:
        d = yaml.safe_load((run / "config.resolved.yaml").read_text()) or {}
        return int(d["train"]["max_steps"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def _errors(run: Path) -> list[tuple[int, str]]:
    """[(rank, the error's last line)] from logs/rank<N>.error.txt (the trainer's one-line failures)
    of the last session: a file older than metrics.csv is an earlier session's, since resumed."""
    try:
        since = (run / "metrics.csv").stat().st_mtime
    except OSError:
        since = 0.0
    out = []
    for p in sorted((run / "logs").glob("rank*.error.txt")):
        m = re.fullmatch(r"rank(\d+)\.error\.txt", p.name)
        try:
            if p.stat().st_mtime < since:
                continue
            lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
        except OSError:
            continue
        if m and lines:
            out.append((int(m.group(1)), lines[-1].strip()))
    return out


def state_of(run: Path, rows: Optional[list[dict]] = None) -> tuple[str, str]:
    """(state, why): running / finished / stopped / failed / killed (module docstring)."""
    from .runs import LOCK, _read_lock, lock_state

    rows = _rows(run) if rows is None else rows
    lock = run / LOCK
    stale = ""
    if lock.exists():
        live, why = lock_state(_read_lock(lock), lock)
        if live:
            return "running", why
        stale = f"stale run.lock ({why})"
    steps, max_steps = (int(rows[-1]["step"]) if rows else 0), _max_steps(run)
    summary = _json(run / "summary.json") or {}
    if max_steps is not None and steps >= max_steps:
        return "finished", f"step {steps} of {max_steps}" + ("; eval gate FAILED" if summary.get("gate") else "")
    if summary and int(summary.get("steps", -1)) == steps and not stale:
        # the session wrote its summary at the step the metrics end: it ended on purpose
        why = summary.get("stopped") or "train.stop_after"
        return "stopped", f"session ended at step {steps} of {max_steps} ({why}); resume it to go on"
    probe = _json(run / "probe.json") or {}
    if probe.get("oom"):
        return "failed", "out of memory in the probe steps (probe.json)"
    errs = _errors(run)
    real = [(r, e) for r, e in errs if not _is_signal(e)]
    if real:
        r, e = real[0]
        return "failed", f"rank {r}: {e}"
    if errs:
        return "killed", "; ".join(x for x in (f"rank {errs[0][0]}: {errs[0][1]}", stale) if x)
    return "killed", "; ".join(x for x in (f"no error recorded after step {steps}", stale) if x)


def _is_signal(line: str) -> bool:
    """A traceback's last line naming SIGTERM or Ctrl-C ('Terminated: ...', 'pkg.mod.Terminated: ...')."""
    return line.split(":", 1)[0].strip().rsplit(".", 1)[-1] in SIGNALS


def _tokens_per_s(rows: list[dict], summary: dict) -> Optional[float]:
    firsts = {int(s.get("from_step", 0)) + 1 for s in summary.get("sessions", []) if isinstance(s, dict)} or {1}
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and int(r["step"]) not in firsts]
    tps = tps or [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    return sum(tps) / len(tps) if tps else None


def _eval_brief(res: dict) -> str:
    """'step 16: passkey@480 72.0%, loss@480 3.210' -- each task and the loss at its longest length."""
    parts = []
    for task in dict.fromkeys(c["task"] for c in res.get("cells", [])):
        c = max((c for c in res["cells"] if c["task"] == task), key=lambda c: c["length"])
        parts.append(f"{task}@{c['length']} {c['acc_pp']:.1f}%")
    by = (res.get("loss") or {}).get("by_length") or []
    if by:
        c = max(by, key=lambda c: c["length"])
        parts.append(f"loss@{c['length']} {c['loss']:.3f}")
    gate = res.get("gate")
    if gate is not None:
        parts.append("gate " + ("passed" if gate.get("passed") else "FAILED"))
    return f"step {res.get('step')}: " + ", ".join(parts)


def _last_eval(run: Path) -> Optional[dict]:
    from ..eval.prompts import EvalError
    from ..eval.report import load_result

    if not (run / "eval").is_dir():
        return None
    try:
        return load_result(run)
    except EvalError:
        return None


def describe(run: Path, deep: bool = False) -> dict:
    """One run's row: {run, state, why, steps, max_steps, loss, tokens_per_s, checkpoint, eval}."""
    from ..checkpoint.layout import scan_steps

    rows = _rows(run)
    state, why = state_of(run, rows)
    summary = _json(run / "summary.json") or {}
    newest, skipped = scan_steps(run, deep=deep)
    last = [r["loss"] for r in rows[-SMOOTH:]]
    res = _last_eval(run)
    return {
        "run": run.name,
        "path": str(run),
        "state": state,
        "why": why,
        "steps": int(rows[-1]["step"]) if rows else 0,
        "max_steps": _max_steps(run),
        "loss": sum(last) / len(last) if last else None,
        "loss_steps": len(last),
        "tokens_per_s": _tokens_per_s(rows, summary),
        "checkpoint": newest.name if newest else None,
        "checkpoints_unusable": [p.name for p, _ in skipped],
        "eval": _eval_brief(res) if res else None,
        "eval_json": res.get("_path") if res else None,
    }


def unreadable(run: Path, e: Exception) -> dict:
    """The row of a run whose files cannot be read (a binary metrics.csv): listed as such, the others still are."""
    why = f"{type(e).__name__}: {e}"[:200]
    return {
        "run": run.name,
        "path": str(run),
        "state": "unreadable",
        "why": f"its files cannot be read ({why}); look at {run}",
        "steps": 0,
        "max_steps": _max_steps(run),
        "loss": None,
        "loss_steps": 0,
        "tokens_per_s": None,
        "checkpoint": None,
        "checkpoints_unusable": [],
        "eval": None,
        "eval_json": None,
    }


def describe_or_unreadable(run: Path, deep: bool = False) -> dict:
    try:
        return describe(run, deep=deep)
    except (OSError, ValueError, csv.Error) as e:  # UnicodeDecodeError is a ValueError
        return unreadable(run, e)


def _is_run(d: Path) -> bool:
    return (d / "run.json").exists() or (d / "metrics.csv").exists() or (d / "checkpoints").is_dir()


def _not_a_run(d: Path) -> str:
    """What `runs show` says of a folder that is no run: a runs dir (runs inside it), or something else."""
    runs = (
        sorted(x.name for x in d.iterdir() if x.is_dir() and not x.name.startswith(".") and _is_run(x))
        if d.is_dir()
        else []
    )
    if runs or (d / ".ids").is_dir():
        shown = ", ".join(runs[-5:]) + (f" and {len(runs) - 5} more" if len(runs) > 5 else "")
        return (
            f"{d} is a runs dir, not a run (it holds {len(runs)} run(s){': ' + shown if runs else ''}): list them "
            f"with `megablu runs {d}`" + (f", or show one with `megablu runs show {d / runs[-1]}`" if runs else "")
        )
    return (
        f"{d} is not a run (no run.json, metrics.csv or checkpoints/ in it): give a run id in --runs-dir or a run "
        f"directory (`megablu runs RUNS_DIR` lists them)"
    )


def _table(rows: list[dict]) -> str:
    head = ["run", "state", "steps", "loss", "tokens/s", "checkpoint", "last eval"]
    body = [
        [
            r["run"],
            r["state"],
            f"{r['steps']}/{r['max_steps'] if r['max_steps'] is not None else '?'}",
            "-" if r["loss"] is None else f"{r['loss']:.3f}",
            "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
            r["checkpoint"] or "none",
            r["eval"] or "-",
        ]
        for r in rows
    ]
    w = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = lambda xs: "  ".join(x.ljust(w[i]) for i, x in enumerate(xs)).rstrip()  # noqa: E731
    return "\n".join([fmt(head)] + [fmt(b) for b in body])


def _list(args) -> int:
    root = Path(args.runs_dir)
    if not root.is_dir():
        print(
            f"megablu runs: {root} is not a directory (the runs dir: a config's runs_dir, default 'runs')",
            file=sys.stderr,
        )
        return 2
    runs = [d for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".") and _is_run(d)]
    rows = [describe_or_unreadable(d, deep=args.verify) for d in runs]
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print(f"no runs in {root}", file=sys.stderr)
        return 0
    print(_table(rows))
    for r in rows:
        if r["state"] in ("failed", "killed", "stopped", "unreadable"):
            print(f"{r['run']}: {r['state']}: {r['why']}", file=sys.stderr)
    return 0


def plot_training(run: Path, path: Path) -> Path:
    """loss (each step and the SMOOTH-step mean), lr and tokens/s against the step, one panel
    each; a dashed line where a session (a resume) started."""
    from ..eval.report import _mpl

    rows = _rows(run)
    if not rows:
        raise ValueError(f"{run}: no metrics.csv rows to plot")
    plt = _mpl()
    summary = _json(run / "summary.json") or {}
    starts = [int(s["from_step"]) for s in summary.get("sessions", [])[1:] if isinstance(s, dict)]
    x = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    mean = [
        sum(loss[max(0, i - SMOOTH + 1) : i + 1]) / len(loss[max(0, i - SMOOTH + 1) : i + 1]) for i in range(len(loss))
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    axes[0].plot(x, loss, lw=0.7, alpha=0.5, label="loss per step")
    axes[0].plot(x, mean, lw=1.5, label=f"mean of the last {SMOOTH}")
    axes[0].set_ylabel("training loss (nats/token)")
    axes[0].legend(fontsize=7)
    axes[1].plot(x, [r.get("lr", float("nan")) for r in rows])
    axes[1].set_ylabel("learning rate")
    axes[2].plot(x, [r.get("tokens_per_s", float("nan")) for r in rows], lw=0.8)
    axes[2].set_ylabel("tokens/s")
    for ax in axes:
        ax.set_xlabel("step")
        for s in starts:
            ax.axvline(s, ls="--", lw=0.8, color="grey")
    fig.suptitle(f"{run.name}" + (f" (dashed: resumed at step {', '.join(map(str, starts))})" if starts else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _show(args) -> int:
    from .runs import RunError, find_run

    try:
        run = find_run(args.runs_dir, args.run)
    except RunError as e:
        given = Path(args.run)
        print(f"megablu runs show: {_not_a_run(given) if given.is_dir() else e}", file=sys.stderr)
        return 2
    if not _is_run(run):
        print(f"megablu runs show: {_not_a_run(run)}", file=sys.stderr)
        return 2
    d = describe_or_unreadable(run, deep=args.verify)
    summary = _json(run / "summary.json") or {}
    out = [
        f"# {d['run']}  ({d['path']})",
        "",
        f"state       {d['state']}: {d['why']}",
        f"steps       {d['steps']} of {d['max_steps'] if d['max_steps'] is not None else '?'}",
        "loss        " + ("-" if d["loss"] is None else f"{d['loss']:.4f} (mean of the last {d['loss_steps']} steps)"),
        "tokens/s    " + ("-" if d["tokens_per_s"] is None else f"{d['tokens_per_s']:,.0f}"),
        f"checkpoint  {d['checkpoint'] or 'none'}"
        + (f" (unusable: {', '.join(d['checkpoints_unusable'])})" if d["checkpoints_unusable"] else ""),
    ]
    for i, s in enumerate(summary.get("sessions", [])):
        if isinstance(s, dict):
            out.append(f"session {i + 1}   steps {s.get('from_step')}..{s.get('to_step')}  {s.get('world') or ''}")
    if not args.no_plot and d["state"] != "unreadable":
        target = Path(args.plot) if args.plot else run / "train.png"
        try:
            out.append(f"plot        {plot_training(run, target)}")
        except Exception as e:  # noqa: BLE001 - no metrics or no matplotlib: the text still stands
            out.append(f"plot        none ({e})")
    res = _last_eval(run)
    if res is not None:
        from ..eval.report import markdown

        out += ["", f"## eval {Path(res['_path']).name} (newest)", "", markdown([res])]
    else:
        out += ["", "## eval: none (no eval/step_<N>.json)"]
    print("\n".join(out))
    return 0


def _runs(args) -> int:
    words = list(args.args)
    if words[:1] == ["show"]:
        if len(words) != 2:
            print("megablu runs show: give one RUN (an id in --runs-dir, or a run directory)", file=sys.stderr)
            return 2
        args.run = words[1]
        return _show(args)
    if len(words) > 1:
        print(f"megablu runs: expected [RUNS_DIR] or 'show RUN', got {' '.join(words)}", file=sys.stderr)
        return 2
    if words:
        args.runs_dir = words[0]
    return _list(args)


def register(sub) -> None:
    r = sub.add_parser(
        "runs",
        help="every run and its state (running, finished, stopped, failed, killed); "
        "'runs show RUN' for one run with a training plot and its eval tables",
        description=__doc__.split("\n\n")[0],
        usage="megablu runs [RUNS_DIR] [--json] [--verify]\n       "
        "megablu runs show RUN [--runs-dir DIR] [--plot PNG | --no-plot] [--verify]",
    )
    r.add_argument(
        "args",
        nargs="*",
        metavar="RUNS_DIR | show RUN",
        help="a runs dir to list (default: runs), or 'show' and a run id (looked up in --runs-dir) or a run directory",
    )
    r.add_argument("--runs-dir", default="runs", help="where 'show RUN' looks up a run id (default: runs)")
    r.add_argument("--json", action="store_true", help="the list as one JSON line (a list of rows) on stdout")
    r.add_argument(
        "--verify",
        action="store_true",
        help="hash every checkpoint file (sha256) to find the newest "
        "usable step; default: manifest, presence and sizes",
    )
    r.add_argument(
        "--plot", metavar="PNG", help="show: where the loss / lr / tokens-per-s plot goes (default: <run>/train.png)"
    )
    r.add_argument("--no-plot", action="store_true", help="show: no plot")
    r.set_defaults(func=_runs)
