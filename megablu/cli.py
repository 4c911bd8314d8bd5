"""`megablu` command. Results go to stdout, every log line to stderr.

Subcommands are registered by the module that owns them (`register(subparsers)`), so this
file stays a table of contents:
  config check      megablu.cli (here)
  data ...          megablu.data.cli
  eval, compare     megablu.eval.cli
  ckpt ..., hub ... megablu.train.ckpt_cli
  plan, probe       megablu.plan / megablu.train.probe
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
    "megablu.train.ckpt_cli",
    "megablu.plan_cli",
]


def _config_check(args) -> int:
    from .config import ConfigError, config_warnings, load_config, to_yaml

    try:
        cfg = load_config(args.file, args.set, world_size=args.world_size, device=args.device)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    for w in config_warnings(cfg):
        print(f"warning: {w}", file=sys.stderr)
    sys.stdout.write(to_yaml(cfg))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megablu", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    cfg = sub.add_parser("config", help="configuration tools").add_subparsers(dest="config_cmd", required=True)
    chk = cfg.add_parser("check", help="validate a config: print it resolved (exit 0) or list every violation (exit 2)")
    chk.add_argument("file")
    chk.add_argument("--set", action="append", default=[], metavar="a.b=v", help="override (repeatable)")
    chk.add_argument("--world-size", type=int, default=None, help="check topology invariants for this many ranks")
    chk.add_argument("--device", choices=["cpu", "cuda"], default=None, help="check device invariants (bf16 on cpu)")
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
