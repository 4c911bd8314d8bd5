"""eval.string (STRING at evaluation, megablu/model/string.py) as a user sets it: validated config (the
field, the values and the fix), `megablu eval --set eval.string.shift=... --set eval.string.local=...`
end to end on a tiny model (the result records it, the tables label it), refused under sp > 1, applied
for the eval only (run_eval restores the model), and never merged with a result of another setting."""
import json

import pytest
import torch
from pydantic import ValidationError

from megablu.cli import main
from megablu.config.load import load_config
from megablu.config.schema import EvalConfig, StringConfig, check_invariants
from megablu.eval import harness
from megablu.eval.prompts import EvalError
from megablu.eval.report import make_result, markdown, merge_results
from megablu.model.string import apply_string

from .conftest import tiny_model
from .test_cli import _config


def test_string_config_validation():
    assert EvalConfig().string is None                       # off by default
    s = EvalConfig(string={"shift": 10922, "local": 128}).string
    assert (s.shift, s.local) == (10922, 128)
    with pytest.raises(ValidationError, match=r"local=128 >= shift=128.*set local < shift"):
        StringConfig(shift=128, local=128)
    with pytest.raises(ValidationError, match="shift"):
        StringConfig(shift=0, local=0)
    with pytest.raises(ValidationError, match="local"):
        StringConfig(shift=10, local=-1)
    with pytest.raises(ValidationError, match="shift"):
        StringConfig(shift=10.5, local=1)                    # an integer, not a float


def test_config_refuses_string_under_sequence_parallelism(tmp_path):
    """The trainer's own evals run run_eval, which applies eval.string there too; under parallel.sp > 1
    they would be sequence-parallel, so the config refuses the pair, naming both fields and the fix."""
    cfg = load_config(_config(tmp_path), ["eval.string.shift=64", "eval.string.local=8"])
    assert check_invariants(cfg) == []
    from megablu.config import ConfigError

    with pytest.raises(ConfigError, match=r"eval.string with parallel.sp=2.*parallel.sp=1"):
        load_config(_config(tmp_path), ["eval.string.shift=64", "eval.string.local=8", "parallel.sp=2"])


def test_eval_cli_with_string(tmp_path, capsys):
    from megablu.model.hf import to_hf

    hf_dir = tmp_path / "hf"
    to_hf(tiny_model(seed=4), max_position=512).save_pretrained(str(hf_dir))
    cfg = _config(tmp_path)
    run = ["eval", "--config", str(cfg), "--hf", str(hf_dir), "--step", "0", "--no-plot"]
    rc = main(run + ["--out", str(tmp_path / "s"), "--set", "eval.string.shift=64", "--set", "eval.string.local=8"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = json.loads((tmp_path / "s" / "step_0.json").read_text())
    assert res["eval"]["string"] == {"shift": 64, "local": 8, "beyond": 0}
    assert "tiny@0 +string(S=64,W=8)" in out
    # the mapping form of --set works too
    assert main(run + ["--out", str(tmp_path / "s2"), "--set", "eval.string={shift: 64, local: 8}"]) == 0
    s2 = json.loads((tmp_path / "s2" / "step_0.json").read_text())
    assert s2["eval"]["string"] == {"shift": 64, "local": 8, "beyond": 0}
    capsys.readouterr()
    assert main(run + ["--out", str(tmp_path / "p"), "--set", "eval.string.shift=64",
                       "--set", "eval.string.local=64"]) == 2
    assert "eval.string: local=64 >= shift=64" in capsys.readouterr().err
    assert main(run + ["--out", str(tmp_path / "p"), "--set", "eval.string.shift=64",
                       "--set", "eval.string.local=8", "--set", "parallel.sp=2"]) == 2
    err = capsys.readouterr().err
    assert "eval.string with parallel.sp=2" in err and "parallel.sp=1" in err
    assert not (tmp_path / "p").exists()
    # a plain eval of the same weights: another row in compare, never merged with the string one
    assert main(run + ["--out", str(tmp_path / "o")]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "o" / "step_0.json"), str(tmp_path / "s" / "step_0.json")]) == 0
    out = capsys.readouterr().out
    assert "| tiny@0 |" in out and "| tiny@0 +string(S=64,W=8) |" in out


def test_run_eval_applies_string_for_the_eval_only(tmp_path, byte_tok, monkeypatch):
    """Generation sees STRING on (shift, local as configured); afterwards the model is as before (the
    trainer's model goes back to training without it); an sp group of 2 is refused before generating."""
    m = tiny_model(seed=5)
    m.train()
    seen = []
    real = harness.greedy_generate

    def spy(model, *a, **k):
        seen.append((model.string, model.layers[0].self_attn.core.string_shift, k["prefill_chunk"]))
        return real(model, *a, **k)

    monkeypatch.setattr(harness, "greedy_generate", spy)
    cfg = EvalConfig(lengths=[300], n=2, max_new=4, pad=32, string={"shift": 64, "local": 8})
    res = harness.run_eval(m, byte_tok, cfg, 512, step=1, out_dir=tmp_path, rank=0, plot=False)
    assert res["eval"]["string"] == {"shift": 64, "local": 8, "beyond": 0}
    assert seen and all(s == (StringConfig(shift=64, local=8), 64, 2048) for s in seen)
    assert m.string is None and m.layers[0].self_attn.core.string_shift is None and m.training
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: 2)
    seen.clear()
    with pytest.raises(EvalError, match="parallel.sp=1"):
        harness.run_eval(m, byte_tok, cfg, 512, step=2, out_dir=tmp_path, rank=0, sp_group=object(), plot=False)
    assert not seen


def _res(arm, string=None, length=1024):
    cells = [{"task": "passkey", "length": length, "n": 2, "correct": 1, "acc_pp": 50.0, "ci_pp": [0, 100],
              "padded_len": length, "digest": "d", "seconds": 0, "by_depth": []}]
    samples = [{"task": "passkey", "length": length, "index": i, "correct": i == 0} for i in range(2)]
    return make_result(cells, samples, arm=arm, step=5, window=32768, tokenizer_identity="t", sp=1,
                       eval_cfg=EvalConfig(lengths=[length], string=string))


def test_results_of_another_string_setting_are_another_arm():
    """merge_results joins the cells of one arm@step measured in separate jobs: a result with another
    eval.string is another row (never joined into one arm), and the tables name the setting."""
    s = {"shift": 512, "local": 64}
    merged = merge_results([_res("a", s, 1024), _res("a", s, 2048)])
    assert len(merged) == 1 and len(merged[0]["cells"]) == 2
    # a result written before eval.string.beyond existed (no such field) is the same setting as beyond 0 ...
    old = _res("a", s, 4096)
    old["eval"]["string"].pop("beyond")
    assert len(merge_results([_res("a", s, 1024), old])[0]["cells"]) == 2
    # ... and another beyond is another row, as is the plain eval
    for other in (_res("a", {**s, "beyond": 1024}, 2048), _res("a", None, 2048)):
        rows = merge_results([_res("a", s, 1024), other])
        assert len(rows) == 2 and all(len(r["cells"]) == 1 for r in rows)
    md = markdown(merge_results([_res("a"), _res("a-string", s)]))
    assert "| a@5 |" in md and "| a-string@5 +string(S=512,W=64) |" in md


def test_run_eval_with_either_string_kernel_gives_the_same_answers_and_records_which_ran(tmp_path, byte_tok,
                                                                                     monkeypatch):
    """MEGABLU_STRING_IMPL=flex (eager on the CPU) and sdpa: the same generated text for every prompt, and the
    result says which kernel ran (string_kernel); without STRING there is no such field."""
    from megablu.model import string as string_mod

    cfg = EvalConfig(lengths=[300], n=3, max_new=4, pad=32, string={"shift": 64, "local": 8})
    outs = {}
    for impl in ("sdpa", "flex"):
        monkeypatch.setenv(string_mod.ENV, impl)
        m = tiny_model(seed=5).double()
        res = harness.run_eval(m, byte_tok, cfg, 512, step=1, out_dir=tmp_path / impl, rank=0, plot=False)
        assert res["string_kernel"] == impl
        used = res["string_kernels_used"]   # every forward here has more keys than S = 64: no plain call
        assert set(used) == {impl} and used[impl] > 0, used
        outs[impl] = [s["output"] for s in res["samples"]]
    assert outs["sdpa"] == outs["flex"] and len(outs["sdpa"]) == 3
    monkeypatch.delenv(string_mod.ENV)
    res = harness.run_eval(tiny_model(seed=5), byte_tok, EvalConfig(lengths=[300], n=1, max_new=4, pad=32), 512,
                           step=1, out_dir=tmp_path / "plain", rank=0, plot=False)
    assert "string_kernel" not in res


def test_run_eval_below_the_shift_is_the_plain_eval(tmp_path, byte_tok):
    """Prompts (with their answers) shorter than S: STRING is the identity, so the eval runs the plain
    attention (string_kernels_used counts only plain calls) and writes the plain eval's answers, bit for bit,
    with no kernel compiled per length (the 2026-12-06 H100 eval of short documents hit flex's recompile
    limit)."""
    cfg = EvalConfig(lengths=[300], n=3, max_new=4, pad=32)
    plain = harness.run_eval(tiny_model(seed=5), byte_tok, cfg, 512, step=1, out_dir=tmp_path / "p", rank=0,
                             plot=False)
    cfg_s = EvalConfig(lengths=[300], n=3, max_new=4, pad=32, string={"shift": 400, "local": 8})
    res = harness.run_eval(tiny_model(seed=5), byte_tok, cfg_s, 512, step=1, out_dir=tmp_path / "s", rank=0,
                           plot=False)
    assert set(res["string_kernels_used"]) == {"plain"}, res["string_kernels_used"]
    assert [s["output"] for s in res["samples"]] == [s["output"] for s in plain["samples"]]


def test_beyond_evaluates_the_short_cells_plain(tmp_path, byte_tok, monkeypatch):
    """eval.string.beyond: the prompts of cells of at most `beyond` tokens are generated without STRING
    (model.string None at generation; the cell says string false), the longer ones with it; the result
    records the setting, the tables label it, and the model is restored afterwards."""
    seen = []
    real = harness.greedy_generate

    def spy(model, ids, *a, **k):
        seen.append((ids.shape[1], model.string))
        return real(model, ids, *a, **k)

    monkeypatch.setattr(harness, "greedy_generate", spy)
    m = tiny_model(seed=5)
    cfg = EvalConfig(lengths=[300, 700], n=2, max_new=4, pad=32, string={"shift": 16, "local": 1, "beyond": 300})
    res = harness.run_eval(m, byte_tok, cfg, 1024, step=1, out_dir=tmp_path, rank=0, plot=False)
    s = StringConfig(shift=16, local=1, beyond=300)
    assert sorted({(n <= 300, st is None) for n, st in seen}) == [(False, False), (True, True)], seen
    assert all(st == s for _, st in seen if st is not None)
    assert {c["length"]: c["string"] for c in res["cells"]} == {300: False, 700: True}
    assert res["eval"]["string"] == {"shift": 16, "local": 1, "beyond": 300}
    assert "+string(S=16,W=1,>300)" in markdown([res])
    assert m.string is None and m.layers[0].self_attn.core.string_shift is None
    with pytest.raises(ValidationError, match="beyond"):
        StringConfig(shift=64, local=8, beyond=-1)


def test_beyond_in_the_held_out_loss_is_per_sequence(monkeypatch):
    """run_loss with eval.string.beyond: each sequence longer than `beyond` is scored with STRING, each
    other one plain, whatever the order."""
    from megablu.eval import loss as loss_mod

    m = tiny_model(seed=5)
    seen = []
    monkeypatch.setattr(loss_mod, "sequence_nll",
                        lambda model, s, **k: seen.append((len(s), model.string)) or (1.0, len(s), 0.5, len(s) // 2))
    s = StringConfig(shift=64, local=8, beyond=100)
    cfg = EvalConfig(lengths=[300], string=s.model_dump(), loss={"data": "x"})
    data = {"by_length": {300: [[1] * 300, [2] * 300]}, "short": [[3] * 80, [4] * 150, [5] * 90]}
    apply_string(m, s)          # as run_eval installs it
    loss_mod.run_loss(m, data, cfg)
    assert seen == [(300, s), (300, s), (80, None), (150, s), (90, None)]
    assert m.string == s        # left as it came in, not as the last sequence had it


def test_run_eval_restores_the_model_when_the_string_kernel_setting_is_bad(tmp_path, byte_tok, monkeypatch):
    """A bad MEGABLU_STRING_IMPL is refused before STRING is installed: the model is left as it was."""
    from megablu.model import string as string_mod

    monkeypatch.setenv(string_mod.ENV, "bogus")
    m = tiny_model(seed=5)
    cfg = EvalConfig(lengths=[300], n=1, max_new=2, pad=32, string={"shift": 64, "local": 8})
    with pytest.raises(ValueError, match="MEGABLU_STRING_IMPL"):
        harness.run_eval(m, byte_tok, cfg, 512, step=1, out_dir=tmp_path, rank=0, plot=False)
    assert m.string is None and m.layers[0].self_attn.core.string_shift is None
