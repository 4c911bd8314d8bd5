"""Checks shared by the device scripts' CPU rehearsals (tests/test_bench_issue14.py, tests/test_bench_ruler.py,
tests/experiments/test_recipe_4x_run.py).

A script run with REHEARSE_CPU=1 finds a `timeout` on PATH that logs each guarded command instead of
running it; what the logged commands would meet first on the device is checked here: the config with its
overrides, the arguments against the program's own parser, an eval's setup against its window."""

from __future__ import annotations

import argparse
import importlib.util
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

ROOT = Path(__file__).resolve().parents[1]
Command = Union[str, Sequence[str]]  # a logged line split on spaces, or the exact argv (printf %q, shlex)


def _words(c: Command) -> list[str]:
    return c.split() if isinstance(c, str) else list(c)


def assert_configs_load(cmds: Sequence[Command]) -> None:
    """Every logged command's --config (or `data mix`'s config) with its --set overrides passes the config
    checks the real command runs first (2026-12-05: the position probe's factor 8 without the 65536 window it
    implies logged fine here and was a config error on the device, costing both of its cells)."""
    from megablu.config import ConfigError, load_config

    for c in cmds:
        words = _words(c)
        if "--config" in words:
            cfg = words[words.index("--config") + 1]
        elif " data mix " in f" {' '.join(words)} ":
            cfg = words[words.index("mix") + 1]
        else:
            continue
        sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        try:
            load_config(ROOT / cfg, sets)
        except ConfigError as e:
            raise AssertionError(f"{shlex.join(words)}\n{e}") from None


def _bench_parser(script: str) -> argparse.ArgumentParser:
    """build_parser() of bench/<script>, loaded from its file (bench/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"_rehearsed_{Path(script).stem}", ROOT / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_parser()


def parse_command(c: Command) -> Optional[tuple[str, argparse.Namespace]]:
    """(program, its parsed arguments) of a logged `python3 -m megablu.cli ...` or `python3 bench/<x>.py ...`
    (an `env VAR=...` prefix skipped), None for any other command. Arguments the program's own parser
    refuses fail the test: on the device they would have cost the call's step."""
    words = _words(c)
    if words[:1] == ["env"]:
        words = words[1:]
        while words and "=" in words[0]:
            words = words[1:]
    if not words or not words[0].startswith("python"):
        return None
    if words[1:3] == ["-m", "megablu.cli"]:
        from megablu.cli import build_parser

        prog, parser, rest = "megablu", build_parser(), words[3:]
    elif len(words) > 1 and words[1].startswith("bench/") and words[1].endswith(".py"):
        prog, parser, rest = words[1], _bench_parser(words[1]), words[2:]
    else:
        return None
    try:
        return prog, parser.parse_args(rest)
    except SystemExit:  # argparse has written the reason to stderr
        raise AssertionError(f"{prog} refuses the arguments of: {shlex.join(words)}") from None


def evals_by_out(cmds: Sequence[Command]) -> dict:
    """{--out's name: parsed arguments} of the logged `megablu eval` commands, in the order they ran."""
    out = {}
    for c in cmds:
        if _words(c)[1:4] == ["-m", "megablu.cli", "eval"]:
            ns = parse_command(c)[1]
            out[Path(ns.out).name] = ns
    return out


def eval_problems_of(ns: argparse.Namespace) -> list[str]:
    """What `megablu eval` with these arguments finds before it loads a weight, tokenizer-free: its config
    with --tasks/--lengths/--n applied as megablu/eval/cli.py applies them, against data.window (the PAD
    rule per task, each task's content, the haystack a task needs)."""
    from megablu.config import load_config
    from megablu.config.schema import eval_problems

    cfg = load_config(ROOT / ns.config, ns.set)
    over = {k: v for k, v in (("lengths", ns.lengths), ("n", ns.n), ("tasks", ns.tasks)) if v is not None}
    e = type(cfg.eval).model_validate({**cfg.eval.model_dump(), **over})
    return eval_problems(e, cfg.data.window)
