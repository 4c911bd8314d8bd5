"""Fixtures shared by the end-to-end tests."""

import subprocess
import sys
import sysconfig

import pytest


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory):
    """A real dataset built once per session through `megablu data build`: the stdlib's json and
    email packages, tokenized with the shipped 4k BPE (what the tiny CPU arms train on)."""
    out = tmp_path_factory.mktemp("data") / "stdlib"
    stdlib = sysconfig.get_paths()["stdlib"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megablu.cli",
            "data",
            "build",
            "--input",
            f"{stdlib}/json",
            "--input",
            f"{stdlib}/email",
            "--include",
            "*.py",
            "--tokenizer",
            "tiktoken_file:megablu:stdlib4k",
            "--out",
            str(out),
            "--no-progress",
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return out
