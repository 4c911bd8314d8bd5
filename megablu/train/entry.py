"""megablu training entry, one process per rank: what `deepspeed` / `torchrun` start.

  deepspeed --num_gpus 2 --module megablu.train.entry --config configs/ext32k.yaml
  megablu train --config configs/ext32k.yaml --gpus 2     # resolves the launch, then the above
  deepspeed --num_gpus 2 launch/ext32k.py --config ...          # the same, through the script shim

The config is validated against the launch's world size and device, and every input is
checked (train/preflight.py, the same checks as `megablu config check`), before any rank
initialises distributed state; every problem is listed and the exit code is 2. Results (the
run summary) go to stdout on rank 0 as one JSON line, and with `--json FILE` to FILE too: under
`deepspeed` the launcher prints its own INFO lines on stdout, so scripts read FILE; logs go to
stderr. A rank that fails prints one line (its traceback goes to runs/<id>/logs/) and, last,
the command that resumes the run; a rank whose launcher dies stops within a second.
"""

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="megablu long-context training")
    p.add_argument("--config", required=True, help="configs/<arm>.yaml")
    p.add_argument("--set", action="append", default=[], metavar="a.b=v", help="override (repeatable)")
    p.add_argument("--resume", default=None, help="run id or run dir to resume from its newest verified checkpoint")
    p.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="also write the run's summary (the JSON line of "
        "stdout) to FILE, atomically: what a script reads, since the `deepspeed` launcher prints its own "
        "INFO lines on stdout too",
    )
    p.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=int(os.environ.get("LOCAL_RANK", 0)),
        help="set by the launcher",
    )
    args = p.parse_args(argv)

    launched = "RANK" in os.environ  # by deepspeed / torchrun: a launcher whose death must end this rank
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
    )

    from ..config import ConfigError

    world = int(os.environ.get("WORLD_SIZE", 1))
    ok = _checked(args, rank, world)
    if ok is None:
        return 2
    cfg, topo = ok.cfg, ok.topology
    assert ok.ctx is not None and topo is not None  # check() with files=True resolves both
    if rank == 0:  # nodes, dp x sp, which ranks share a node; the config's warnings
        _report_setup(topo, ok.warnings)
    if ok.ctx.complete:
        return _already_complete(ok.ctx, rank, args.json)
    _deepspeed_env(ok.device, launched)

    from .probe import ProbeOOM
    from .resume import how_to_continue
    from .trainer import GateFailed, Trainer

    try:  # the Trainer re-applies the rope lineage rule (it guards the Python API too)
        trainer = Trainer(cfg, resume=args.resume, local_rank=args.local_rank)
    except ConfigError as e:
        if rank == 0:
            print(str(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C while the run is being set up (the handlers below come after)
        return _failed(e, None, rank, lambda: "no step was trained: start the same command again")

    def next_step() -> str:
        return (
            how_to_continue(trainer.run_dir, world, topo.nodes)
            if trainer.run_dir is not None
            else "no run dir was allocated yet: start the same command again"
        )

    if launched:
        from .watchdog import exit_with_launcher

        exit_with_launcher(next_step, record=lambda why: _record_gone(trainer.run_dir, rank, why))
    # Ctrl-C (SIGINT) and DeepSpeed's launcher, which SIGTERMs every rank when one fails or when it is
    # interrupted itself: say which signal came and how to go on, as a failure does
    handlers = {s: signal.signal(s, _terminated) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        # libraries print chatter on stdout (DeepSpeed's op builds); stdout is for the result only
        with contextlib.redirect_stdout(sys.stderr):
            summary = trainer.train()
    except ProbeOOM as e:  # the numbers measured so far and the planner's way out
        print(str(e), file=sys.stderr)
        return 1
    except GateFailed as e:  # trained and saved, but worse at short context than the parent
        if rank == 0:
            _emit(e.summary, args.json)
            print(f"eval gate FAILED: {e}", file=sys.stderr)
        _FAILING.set()  # every rank exits 1: the launcher's SIGTERM to the slower ones is not a new failure
        _leave(rank)
        return 1
    except (Exception, KeyboardInterrupt, Terminated) as e:  # noqa: BLE001 - one line per rank, then the way on
        _FAILING.set()
        return _failed(e, trainer.run_dir, rank, next_step)
    finally:
        for s, h in handlers.items():  # this process may go on (an in-process caller): its own handlers back
            signal.signal(s, h)
        _FAILING.clear()
    written = _emit(summary, args.json) if rank == 0 else True
    return _leave(rank) or (0 if written else 1)  # every rank leaves the process group together


def _deepspeed_env(device, launched: bool) -> None:
    """What DeepSpeed reads from the environment at import, set before it is imported."""
    if device == "cpu":
        # DeepSpeed picks its accelerator at import; on CPU it must be told before that
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not launched:
        # started as a plain `python` process: a world of one (else DeepSpeed looks for MPI)
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", str(port)),
        )


def _report_setup(topo, warnings: list[str]) -> None:
    print(topo.format(), file=sys.stderr)
    for w in warnings:
        logging.warning("config: %s", w)


def _checked(args, rank: int, world: int):
    """The launch's preflight (train/preflight.py `check`), or None once the problems are printed (exit 2)."""
    from ..config import ConfigError
    from ..parallel.topology import ranks_per_node_from_env
    from ..utils.files import output_file_problem
    from .preflight import check

    why = output_file_problem(args.json, "--json") if args.json and rank == 0 else None
    if why:  # the summary is written once the run is over: a path that cannot take it is refused now
        print(f"megablu train: {why} (nothing was started)", file=sys.stderr)
        return None
    try:
        # sha256 of data and checkpoints on rank 0 only; if it fails, the launcher ends the others
        return check(
            args.config,
            args.set,
            world_size=world,
            device="auto",
            resume=args.resume,
            hash=rank == 0,
            ranks_per_node=ranks_per_node_from_env(),
        )
    except ConfigError as e:
        if rank == 0 or int(os.environ.get("LOCAL_RANK", 0)) == 0:  # the first rank of every node says it
            print(str(e), file=sys.stderr)
        return None


def _leave(rank: int) -> int:
    """utils.dist.finish() on a rank whose run ended well: 0, or 1 with one line when leaving the
    group fails (typically a peer already gone; it reports its own failure; this rank's work is saved)."""
    from ..utils.dist import finish

    try:
        finish()
    except Exception as e:  # noqa: BLE001 - one line, not a traceback
        first = (str(e).splitlines() or [repr(e)])[0]
        print(
            f"rank {rank}: finished its work, but leaving the process group failed ({type(e).__name__}: "
            f"{first}); a peer that exited first reports its own error",
            file=sys.stderr,
        )
        return 1
    return 0


def run(argv=None) -> NoReturn:
    """main(), then the exit. A rank with peers (world > 1) whose run ended well (0: it left the process
    group with them) ends with os._exit once stdout, stderr and the log handlers are flushed: the
    interpreter's own teardown (C++ destructors of torch's and DeepSpeed's objects) can still abort
    a two-rank gloo process after finish() ("terminate called without an active exception", exit 250
    through the launcher; seen once in CI, tests/eval/test_autoeval.py), turning a finished run into
    a failed one. Every file the run writes is closed by then (metrics, checkpoints, run.lock,
    summary). One rank (no peer to race; cProfile's dump) and failures keep the ordinary exit."""
    rc = main(argv)
    if rc == 0 and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(rc)
    sys.exit(rc)


def _emit(summary: dict, path) -> bool:
    """The result: one JSON line on stdout and, with --json FILE, the same JSON in FILE (tmp + rename).
    False (said on stderr) when FILE cannot be written after all (checked before the run: a disk since full)."""
    line = json.dumps(summary)
    print(line)
    if path:
        tmp = Path(f"{path}.tmp{os.getpid()}")
        try:
            tmp.write_text(line + "\n")
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            print(
                f"--json {path}: cannot write the summary ({e.strerror or e}); it is the JSON line on stdout",
                file=sys.stderr,
            )
            return False
    return True


class Terminated(BaseException):
    """A stop signal: SIGINT (Ctrl-C) or SIGTERM (the launcher stopping every rank because one failed or it was
    interrupted, or a job scheduler). `signum` is the one this rank got first."""

    def __init__(self, signum: int):
        self.signum = signum
        sig = signal.Signals(signum)
        super().__init__(f"stopped by {sig.name} ({_SIGNAL_WHY.get(sig, 'from outside')})")


_SIGNAL_WHY = {
    signal.SIGINT: "Ctrl-C",
    signal.SIGTERM: "DeepSpeed's launcher stops every rank when one fails or "
    "when it is interrupted; a job scheduler sends it too",
}


class LauncherGone(RuntimeError):
    """A rank's error that followed its launcher's death (a peer ended by its watchdog first)."""


_FAILING = threading.Event()  # set once a failure is being reported: a SIGTERM then lets it finish


def _terminated(signum, frame):
    if not _FAILING.is_set():  # the first signal names the stop; a second one (the launcher's) lets it finish
        _FAILING.set()
        raise Terminated(signum)


def _already_complete(ctx, rank: int, json_path=None) -> int:
    """A resume of a finished run: says so, leaves summary.json as it is (writes it if missing)."""
    from .metrics import run_summary

    path = ctx.run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        summary = None
    if rank == 0:
        if summary is None:  # killed after its last step and eval, before the summary
            step = int(ctx.resume_step.name.split("_")[-1])
            summary = run_summary(ctx.run_dir, {"from_step": step, "to_step": step, "world": None})
        _emit(summary, json_path)
        print(
            f"run {ctx.run_dir.name} is already complete ({ctx.resume_step.name}, train.max_steps="
            f"{ctx.cfg.train.max_steps}): nothing to train; {path} left as it was",
            file=sys.stderr,
        )
    return 1 if (summary or {}).get("gate") else 0


def _record_gone(run_dir, rank: int, why: str) -> None:
    """The watchdog's exit in the rank's error file (appended: a failure being reported when the
    launcher died keeps its traceback above), so `megablu runs` says killed, and why."""
    if run_dir is None:
        return
    logs = Path(run_dir) / "logs"
    logs.mkdir(exist_ok=True)
    with open(logs / f"rank{rank}.error.txt", "a") as f:
        f.write(f"{LauncherGone.__name__}: {why}; the rank's watchdog stopped it\n")


def _failed(e: BaseException, run_dir, rank: int, next_step) -> int:
    """One line for a rank's error (the traceback goes to the run's logs/), then the way on."""
    from ..checkpoint import CheckpointError
    from ..config import ConfigError
    from ..data.shards import DataError
    from ..data.tokenizer import TokenizerError
    from .runs import RunError
    from .watchdog import launcher_gone

    if isinstance(e, KeyboardInterrupt):  # Ctrl-C before the handler was installed: the same stop
        e = Terminated(signal.SIGINT)
    gone = None if isinstance(e, Terminated) else launcher_gone()
    if gone:  # the launcher died first: that is the cause, the error (often gloo's) its echo
        try:
            raise LauncherGone(
                f"{gone}; this rank's error followed it: {type(e).__name__}: "
                + "; ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())[:300]
            ) from e
        except LauncherGone as wrapped:
            e = wrapped
    text = "; ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()) or repr(e)
    where = ""
    if run_dir is not None:
        try:
            logs = Path(run_dir) / "logs"
            logs.mkdir(exist_ok=True)
            (logs / f"rank{rank}.error.txt").write_text("".join(traceback.format_exception(e)))
            where = f" (traceback: {logs / f'rank{rank}.error.txt'})"
        except OSError:
            pass
    if not where and rank == 0 and not isinstance(e, Terminated):  # a stop signal needs no traceback
        traceback.print_exception(e, file=sys.stderr)
    print(f"rank {rank}: {type(e).__name__}: {text}{where}", file=sys.stderr)
    print(next_step(), file=sys.stderr)
    sys.stderr.flush()
    if isinstance(e, Terminated):
        return 128 + e.signum
    return 2 if isinstance(e, (CheckpointError, ConfigError, DataError, RunError, TokenizerError)) else 1


if __name__ == "__main__":
    run()
