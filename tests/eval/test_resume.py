"""run_eval(resume=True), what `megablu eval` does: an eval cut short keeps its finished cells in
step_<N>.json.partial and a rerun goes on where it stopped, with the same result as one uninterrupted run;
a partial of another model, setup or prompt set is never reused."""

import json
import logging

import pytest

import megablu.eval.harness as harness
from megablu.config.schema import EvalConfig
from megablu.eval.harness import run_eval, weights_fingerprint

from .conftest import tiny_model

CFG = EvalConfig(lengths=[400, 600], tasks=["passkey", "niah_single_1"], n=3, max_new=6, pad=32)
TIMING = ("seconds", "prompts_per_s")
REAL = harness.greedy_generate


class Cut(Exception):
    pass


def _counting(monkeypatch, die_at_call=None):
    """greedy_generate, recording the length of every batch it is asked for (one batch per cell here: n=3
    prompts of <= 600 tokens in 16384), raising Cut at call number die_at_call (cells run task by task, each
    task's lengths shortest first)."""
    seen = []

    def gen(model, ids, *a, **kw):
        seen.append(ids.shape[1])
        if len(seen) == die_at_call:
            raise Cut(f"killed at call {die_at_call}")
        return REAL(model, ids, *a, **kw)

    monkeypatch.setattr(harness, "greedy_generate", gen)
    return seen


def _partials(out):
    return sorted(out.glob("step_3.*.json.partial"))


def _untimed(cells):
    return [{k: v for k, v in c.items() if k not in TIMING} for c in cells]


def _run(model, tok, out, cfg=CFG, **kw):
    return run_eval(model, tok, cfg, 1024, step=3, out_dir=out, rank=0, plot=False, resume=True, **kw)


def test_a_cut_eval_goes_on_where_it_stopped(tmp_path, byte_tok, monkeypatch):
    whole = run_eval(tiny_model(), byte_tok, CFG, 1024, step=3, out_dir=tmp_path / "whole", rank=0, plot=False)
    out = tmp_path / "cut"
    _counting(monkeypatch, die_at_call=3)  # passkey@400, passkey@600, then death in niah_single_1@400
    with pytest.raises(Cut):
        _run(tiny_model(), byte_tok, out)
    assert not (out / "step_3.json").exists()
    (path,) = _partials(out)
    part = json.loads(path.read_text())
    assert [(c["task"], c["length"]) for c in part["cells"]] == [("passkey", 400), ("passkey", 600)]
    assert len(part["samples"]) == 2 * CFG.n

    seen = _counting(monkeypatch)
    res = _run(tiny_model(), byte_tok, out)
    assert seen == [400, 600]  # only niah_single_1's cells ran
    assert res["resumed"] == ["passkey@400", "passkey@600"]
    assert _untimed(res["cells"]) == _untimed(whole["cells"]) and res["samples"] == whole["samples"]
    assert json.loads((out / "step_3.json").read_text())["cells"] == res["cells"]
    assert not _partials(out)  # removed once the result is written
    # a finished eval leaves no partial: a third run does every cell again
    seen = _counting(monkeypatch)
    assert "resumed" not in _run(tiny_model(), byte_tok, out) and len(seen) == 4


@pytest.mark.parametrize("change", ["weights", "n", "max_new", "no_resume"])
def test_a_partial_of_another_model_setup_or_prompts_is_not_reused(tmp_path, byte_tok, monkeypatch, caplog, change):
    """Another setup is another key, hence another file: the old cells are neither used nor overwritten (the
    likeliest rerun after an OOM changes --batch-tokens), and a warning names the file."""
    out = tmp_path / "e"
    _counting(monkeypatch, die_at_call=2)  # passkey@400 kept
    with pytest.raises(Cut):
        _run(tiny_model(), byte_tok, out)
    (old,) = _partials(out)
    before = old.read_text()
    model, cfg = tiny_model(seed=1 if change == "weights" else 0), CFG
    if change == "n":
        cfg = CFG.model_copy(update={"n": 4})
    if change == "max_new":
        cfg = CFG.model_copy(update={"max_new": 7})
    seen = _counting(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="megablu.eval.harness"):
        if change == "no_resume":
            res = run_eval(model, byte_tok, cfg, 1024, step=3, out_dir=out, rank=0, plot=False)
        else:
            res = _run(model, byte_tok, out, cfg=cfg)
    assert len(seen) == 4 and "resumed" not in res
    assert ("another model, setup or megablu version" in caplog.text) == (change != "no_resume")
    assert _partials(out) == [old] and old.read_text() == before


def test_more_lengths_reuse_the_cells_they_share(tmp_path, byte_tok, monkeypatch):
    out = tmp_path / "m"
    _counting(monkeypatch, die_at_call=2)
    with pytest.raises(Cut):
        _run(tiny_model(), byte_tok, out)
    seen = _counting(monkeypatch)
    res = _run(tiny_model(), byte_tok, out, cfg=CFG.model_copy(update={"lengths": [400, 500, 600]}))
    assert res["resumed"] == ["passkey@400"] and seen == [500, 600, 400, 500, 600]


def test_weights_fingerprint_sees_one_changed_weight():
    a, b = tiny_model(), tiny_model()
    assert weights_fingerprint(a) == weights_fingerprint(b)
    with __import__("torch").no_grad():
        next(iter(b.parameters())).view(-1)[5] += 1e-3
    assert weights_fingerprint(a) != weights_fingerprint(b)


def test_the_same_setup_on_other_prompts_is_not_reused(tmp_path, bpe_tok, haystack_docs, monkeypatch):
    """The key holds the setup, not the haystack's text (eval.haystack is a path, or a source passed in): a
    haystack rebuilt under the same name gives other prompts, and each cell's digest catches it."""
    from .conftest import OracleModel

    cfg = EvalConfig(lengths=[600], tasks=["niah_single_2", "passkey"], n=3, max_new=12, pad=64)
    out = tmp_path / "h"
    _counting(monkeypatch, die_at_call=2)  # niah_single_2@600 kept
    with pytest.raises(Cut):
        run_eval(
            OracleModel(bpe_tok),
            bpe_tok,
            cfg,
            1024,
            step=3,
            out_dir=out,
            rank=0,
            plot=False,
            resume=True,
            haystack=haystack_docs,
        )
    seen = _counting(monkeypatch)
    res = run_eval(
        OracleModel(bpe_tok),
        bpe_tok,
        cfg,
        1024,
        step=3,
        out_dir=out,
        rank=0,
        plot=False,
        resume=True,
        haystack=haystack_docs[::-1],
    )
    assert len(seen) == 2 and "resumed" not in res
    assert [c["acc_pp"] for c in res["cells"]] == [100.0, 100.0]


def test_a_rerun_with_fewer_lengths_keeps_the_other_cells(tmp_path, byte_tok, monkeypatch):
    out = tmp_path / "f"
    _counting(monkeypatch, die_at_call=3)  # passkey@400 and @600 kept
    with pytest.raises(Cut):
        _run(tiny_model(), byte_tok, out)
    seen = _counting(monkeypatch)
    res = _run(tiny_model(), byte_tok, out, cfg=CFG.model_copy(update={"lengths": [400]}))
    assert res["resumed"] == ["passkey@400"] and seen == [400]
    (path,) = _partials(out)  # passkey@600 waits for a run that asks for it
    assert [(c["task"], c["length"]) for c in json.loads(path.read_text())["cells"]] == [("passkey", 600)]
    seen = _counting(monkeypatch)
    res = _run(tiny_model(), byte_tok, out)
    assert res["resumed"] == ["passkey@600"] and seen == [400, 400, 600] and not _partials(out)


@pytest.mark.parametrize("content", ["[]", '{"cells": [{"length": 400}], "samples": []}', "{trunc"])
def test_a_malformed_partial_runs_its_cells_again(tmp_path, byte_tok, monkeypatch, caplog, content):
    out = tmp_path / "g"
    _counting(monkeypatch, die_at_call=2)
    with pytest.raises(Cut):
        _run(tiny_model(), byte_tok, out)
    (path,) = _partials(out)
    path.write_text(content)
    seen = _counting(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="megablu.eval.harness"):
        res = _run(tiny_model(), byte_tok, out)
    assert len(seen) == 4 and "resumed" not in res and "unreadable" in caplog.text and not _partials(out)


def test_a_failed_partial_write_does_not_end_the_eval(tmp_path, byte_tok, monkeypatch, caplog):
    real = harness.results.write_result

    def write(res, path):
        if str(path).endswith(".partial"):
            raise OSError(28, "No space left on device")
        return real(res, path)

    monkeypatch.setattr(harness.results, "write_result", write)
    with caplog.at_level(logging.WARNING, logger="megablu.eval.harness"):
        res = _run(tiny_model(), byte_tok, tmp_path / "h")
    assert len(res["cells"]) == 4 and "No space left" in caplog.text and (tmp_path / "h" / "step_3.json").exists()


def test_the_key_holds_the_kernels_and_the_code(byte_tok):
    """memory.attention / memory.ops change a GPU's bf16 numbers, hence greedy answers: another kernel is another
    key. The code digest covers the sources that generate and score."""
    from megablu.config.schema import MemoryConfig
    from megablu.eval.harness import _kernels, _resume_key, code_digest
    from megablu.memory.apply import apply_memory

    models = {
        att: apply_memory(tiny_model(), MemoryConfig(attention=att, ops="torch"), device="cpu")
        for att in ("sdpa", "auto")
    }
    keys = {att: _resume_key(m, byte_tok, CFG, 1024, 3, "a", 16384, None, None, None) for att, m in models.items()}
    assert keys["sdpa"] != keys["auto"]
    assert keys["sdpa"] == _resume_key(models["sdpa"], byte_tok, CFG, 1024, 3, "a", 16384, None, None, None)
    assert "fa4_imports" in _kernels(models["auto"]) and "fa4_imports" not in _kernels(models["sdpa"])
    assert len(code_digest()) == 16 and code_digest() == code_digest()
