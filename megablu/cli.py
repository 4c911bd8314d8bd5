"""megablu: long-context training for small decoder LMs on DeepSpeed.

Extend a model's window with YaRN, train it with Ulysses sequence parallelism and ZeRO, and
measure -- with confidence intervals -- whether it got better at long context without getting
worse at short context.

A run, in the order you need the commands:
  1. megablu data build --input DIR --tokenizer SPEC --out data_cache/X     text -> dataset
     (megablu data synth: retrieval documents; megablu data mix CONFIG: a mixture resolved)
  2. megablu config check CONFIG --world-size N    every invariant and input, as the launch checks
  3. megablu plan --config CONFIG --gpus 1,2,4     will it fit: memory per GPU count and window
     megablu probe --config CONFIG --gpus N        3 real steps: peak memory, tokens/s
  4. megablu train --config CONFIG --gpus N        train: a run dir under runs/ (the same as
     deepspeed --num_gpus N launch/ext32k.py --config CONFIG; --dry-run prints the launch)
  5. megablu eval --ckpt runs/RUN --config CONFIG  retrieval per length, held-out loss, gate
  6. megablu compare runs/A runs/B --plot cmp.png  arms side by side, differences with intervals
  7. megablu runs [show RUN]                       every run's state, loss, checkpoint, last eval
  megablu ckpt verify|list|export, megablu hub download|upload: checkpoints and the Hub.
First time: bash examples/quickstart/quickstart.sh (a tiny real run on CPU, a few minutes). `megablu
COMMAND --help` explains each command. Results go to stdout, every log line to stderr; exit 0
ok, 2 invalid input (config, data, checkpoint: nothing was started), 1 anything else.

Subcommands are registered by the module that owns them (`register(subparsers)`), in the order
above, so this file stays a table of contents: data (megablu.data.cli), config check (here),
plan (megablu.plan.cli), train and probe (megablu.train.cli), eval and compare
(megablu.eval.cli), runs (megablu.train.runs_cli), ckpt (megablu.checkpoint.cli), hub
(megablu.hub).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from . import __version__

# module path -> registers its subcommands, in the order `megablu --help` lists them (the order
# a user needs them); a module that is absent is a packaging bug, so import errors are not swallowed.
_SUBCOMMAND_MODULES = [
    "megablu.data.cli",
    "megablu.cli",  # config check (register below)
    "megablu.plan.cli",
    "megablu.train.cli",
    "megablu.eval.cli",
    "megablu.train.runs_cli",
    "megablu.checkpoint.cli",
    "megablu.hub",
]


def _config_check(args) -> int:
    """The entry's own checks (train/preflight.py): what passes here passes the launch."""
    from .config import ConfigError, to_yaml
    from .train.preflight import check

    try:
        ok = check(
            args.file,
            args.set,
            world_size=args.world_size,
            device=args.device,
            resume=args.resume,
            files=not args.no_files,
        )
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    for w in ok.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if ok.ctx is not None and ok.ctx.complete and ok.ctx.run_dir is not None:
        print(f"note: run {ok.ctx.run_dir.name} is already complete; a resume has nothing to train", file=sys.stderr)
    sys.stdout.write(to_yaml(ok.cfg))
    return 0


def register(sub) -> None:
    cfg = sub.add_parser("config", help="check a config and every input it names, as the launch does").add_subparsers(
        dest="config_cmd", required=True
    )
    chk = cfg.add_parser(
        "check",
        help="validate a config and every input it names, as the training entry does: "
        "print it resolved (exit 0) or list every problem (exit 2)",
    )
    chk.add_argument("file", help="configs/<arm>.yaml")
    chk.add_argument("--set", action="append", default=[], metavar="a.b=v", help="override (repeatable)")
    chk.add_argument("--world-size", type=int, default=None, help="check topology invariants for this many ranks")
    chk.add_argument("--device", choices=["cpu", "cuda"], default=None, help="check device invariants (bf16 on cpu)")
    chk.add_argument(
        "--resume",
        default=None,
        metavar="RUN",
        help="check a resume of this run (checkpoint, config changes, a live job holding it)",
    )
    chk.add_argument(
        "--no-files",
        action="store_true",
        help="the config alone: no data, tokenizer, parent or run checks (a config written for another machine)",
    )
    chk.set_defaults(func=_config_check)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megablu",
        description=__doc__.split("\n\nSubcommands")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"megablu {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in _SUBCOMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
