"""`megablu --help` teaches: what megablu is, the commands in the order a user needs them, and
help text on every option and positional of every subcommand."""

import argparse

from megablu.cli import build_parser


def _walk(parser, path):
    """(command path, parser) for the root and every subcommand, depth first."""
    yield path, parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _walk(sub, f"{path} {name}")


def test_every_option_of_every_subcommand_has_help():
    missing, commands = [], 0
    for path, p in _walk(build_parser(), "megablu"):
        commands += 1
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not (a.help or "").strip() or a.help == argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(a.option_strings) or a.dest}")
    assert commands > 20  # the walk reached the subcommands (data build, eval, runs show ...)
    assert not missing, f"{len(missing)} option(s) without help: " + ", ".join(missing)


def test_subcommands_have_help_and_the_workflow_order():
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    names = list(sub.choices)
    helps = {c.dest: c.help for c in sub._choices_actions}
    assert all(helps.get(n) for n in names), helps
    order = [n for n in ("data", "config", "plan", "train", "eval", "compare", "runs") if n in names]
    assert [n for n in names if n in order] == order, names
    text = p.format_help()
    assert "long-context training" in text and "examples/quickstart/quickstart.sh" in text
    # the workflow lines in the description are in the order a user runs them
    steps = [
        "megablu data build",
        "megablu config check",
        "megablu plan",
        "launch/ext32k.py",
        "megablu eval",
        "megablu compare",
        "megablu runs",
    ]
    pos = [text.index(s) for s in steps]
    assert pos == sorted(pos), dict(zip(steps, pos))


def test_commands_that_train_nothing_start_without_torch(tmp_path):
    """Registering every subcommand, and the commands that read files only (config check, runs, the
    launch's dry run on CPU), leave torch unimported: its import is ~1 s of every such command's
    start, paid dozens of times by a script or this suite."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\nfrom megablu.cli import build_parser, main\nbuild_parser()\nrc = main(sys.argv[1:])\n"
        "print('torch' in sys.modules)\nsys.exit(rc)\n"
    )
    root = Path(__file__).resolve().parents[1]
    for args in (
        ["runs", str(tmp_path)],
        ["config", "check", "tests/configs/tiny_cpu.yaml", "--world-size", "1", "--device", "cpu", "--no-files"],
        ["train", "--config", "tests/configs/tiny_cpu_ext.yaml", "--device", "cpu", "--gpus", "2", "--dry-run"],
    ):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=root, timeout=120)
        assert r.returncode == 0 and r.stdout.splitlines()[-1] == "False", (args, r.stdout[-500:], r.stderr[-2000:])
