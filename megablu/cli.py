"""`megablu` command. Results go to stdout, every log line to stderr.

Subcommands are registered by the module that owns them (`register(subparsers)`), so this
file stays a table of contents:
  config check      megablu.cli (here)
  data ...          megablu.data.cli
  eval, compare     megablu.eval.cli
  ckpt ...          megablu.checkpoint.cli
  hub ...           megablu.hub
  plan              megablu.plan.cli
  train, probe      megablu.train.cli
Exit codes: 0 ok, 2 invalid input (config, data, checkpoint), 1 anything else.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# module path -> registers its subcommands; a module that is absent is a packaging bug, so
# import errors are not swallowed.
_SUBCOMMAND_MODULES = [
    "megablu.data.cli",
    "megablu.eval.cli",
    "megablu.checkpoint.cli",
    "megablu.hub",
    "megablu.plan.cli",
    "megablu.train.cli",
]


def _config_check(args) -> int:
    """The entry's own checks (train/preflight.py): what passes here passes the launch."""
    from .config import ConfigError, to_yaml
    from .train.preflight import check

    try:
        ok = check(args.file, args.set, world_size=args.world_size, device=args.device, resume=args.resume,
                   files=not args.no_files)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    for w in ok.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if ok.ctx is not None and ok.ctx.complete:
        print(f"note: run {ok.ctx.run_dir.name} is already complete; a resume has nothing to train", file=sys.stderr)
    sys.stdout.write(to_yaml(ok.cfg))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megablu", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    cfg = sub.add_parser("config", help="configuration tools").add_subparsers(dest="config_cmd", required=True)
    chk = cfg.add_parser("check", help="validate a config and every input it names, as the training entry does: "
                                       "print it resolved (exit 0) or list every problem (exit 2)")
    chk.add_argument("file")
    chk.add_argument("--set", action="append", default=[], metavar="a.b=v", help="override (repeatable)")
    chk.add_argument("--world-size", type=int, default=None, help="check topology invariants for this many ranks")
    chk.add_argument("--device", choices=["cpu", "cuda"], default=None, help="check device invariants (bf16 on cpu)")
    chk.add_argument("--resume", default=None, metavar="RUN", help="check a resume of this run (checkpoint, config "
                     "changes, a live job holding it)")
    chk.add_argument("--no-files", action="store_true", help="the config alone: no data, tokenizer, parent or run "
                     "checks (a config written for another machine)")
    chk.set_defaults(func=_config_check)

    for mod in _SUBCOMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
