"""The one rule for every destructive flag (megablu/utils/files.py replace_problem, swap_in): megablu
replaces only what it wrote itself, and only once the new one is complete. The refusals are cases in
tests/test_bad_input.py; here, that the allowed replacements work and that a failed swap loses nothing."""

from __future__ import annotations

import json
import os

import pytest

from megablu.cli import main
from megablu.config.schema import TokenizerConfig
from megablu.data.build import Source, build_dataset
from megablu.data.shards import DataError, dataset_files, verify_dataset
from megablu.utils.files import replace_problem, swap_in

BYTE = TokenizerConfig(kind="byte")


def _src(tmp_path, name, text):
    d = tmp_path / name
    d.mkdir()
    (d / "a.txt").write_text(text)
    return d


def test_overwrite_replaces_a_dataset_megablu_wrote(tmp_path):
    out = tmp_path / "ds"
    build_dataset([Source(str(_src(tmp_path, "s1", "one " * 50)))], BYTE, out, workers=1, progress=False)
    verify_dataset(out)  # leaves the verification cache, which the dataset may hold
    with pytest.raises(DataError, match="pass --overwrite"):
        build_dataset([Source(str(_src(tmp_path, "s2", "two " * 80)))], BYTE, out, workers=1, progress=False)
    m = build_dataset([Source(str(tmp_path / "s2"))], BYTE, out, workers=1, progress=False, overwrite=True)
    assert sum(e["n_tokens"] for e in m["shards"]) == 320 and verify_dataset(out) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "s1", "s2"]  # no .old or .tmp left
    assert {p.relative_to(out).as_posix() for p in out.rglob("*")} <= dataset_files(out)


def test_force_replaces_an_export_megablu_wrote(tmp_path, capsys):
    from tests.bad_input_lab import Lab

    lab = Lab(tmp_path / "lab")
    _, run = lab.run(steps=(2,), with_weights=True)
    out = tmp_path / "hf"
    assert main(["ckpt", "export", str(run), "--out", str(out)]) == 0
    first = json.loads((out / "megablu_export.json").read_text())["exported_unix"]
    assert main(["ckpt", "export", str(run), "--out", str(out), "--force"]) == 0
    rec = json.loads((out / "megablu_export.json").read_text())
    assert rec["exported_unix"] > first and sorted(rec["files"]) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "lab"]


def _owned_all(d):
    return {p.relative_to(d).as_posix() for p in d.rglob("*")}


def test_replace_problem_rules(tmp_path):
    out = tmp_path / "out"
    kw = dict(what="a thing", flag="--force", owned=_owned_all)
    assert replace_problem(out, replace=False, **kw) is None  # new
    out.mkdir()
    assert replace_problem(out, replace=False, **kw) is None  # empty
    (out / "x").write_text("x")
    assert "pass --force" in replace_problem(out, replace=False, **kw)
    assert replace_problem(out, replace=True, **kw) is None
    assert "is not a thing" in replace_problem(out, replace=True, what="a thing", flag="--force", owned=lambda d: None)
    assert "also holds x" in replace_problem(out, replace=True, what="a thing", flag="--force", owned=lambda d: set())
    for inp, word in ((out, "is"), (out / "x", "holds"), (tmp_path, "lies inside")):
        assert f"{word} an input" in replace_problem(out, replace=True, inputs=[inp], **kw)
    link = tmp_path / "link"
    link.symlink_to(out)
    assert "is an input" in replace_problem(link, replace=True, inputs=[out], **kw)  # resolved, not by name


def test_a_failed_swap_puts_the_old_one_back(tmp_path, monkeypatch):
    old, new = tmp_path / "out", tmp_path / "new"
    old.mkdir()
    (old / "keep").write_text("old")
    new.mkdir()
    (new / "keep").write_text("new")
    real, calls = os.replace, []

    def flaky(a, b):
        calls.append((a, b))
        if len(calls) == 2:  # new -> out fails after out was moved aside
            raise OSError("disk gone")
        return real(a, b)

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(OSError, match="disk gone"):
        swap_in(new, old)
    assert (old / "keep").read_text() == "old" and (new / "keep").read_text() == "new"
    monkeypatch.setattr(os, "replace", real)
    swap_in(new, old)
    assert (old / "keep").read_text() == "new" and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
