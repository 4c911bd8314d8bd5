"""eval.string (STRING at evaluation, megablu/model/string.py) as a user sets it: validated config (the
field, the values and the fix), both variants (authors: S = int(shift_ratio x length) and the authors'
attention factor; fixed_shift: S in tokens), `megablu eval --set eval.string...` end to end on a tiny model
(the result records the variant, the tables label it), a shift outside the prompt refused, refused under
sp > 1, applied for the eval only (run_eval restores the model), and never merged with a result of another
setting or variant."""

import json
import math

import pytest
import torch
from pydantic import ValidationError

from megablu.cli import main
from megablu.config.load import load_config
from megablu.config.schema import EvalConfig, StringConfig, check_invariants
from megablu.eval import harness
from megablu.eval.prompts import EvalError
from megablu.eval.report import make_result, markdown, merge_results
from megablu.model.string import StringSetting, apply_string, installed

from .conftest import tiny_model
from .test_cli import _config

FIXED = {"variant": "fixed_shift"}
# the authors' attention factor (HKUNLP/STRING string_for_llama.py replace_with_string: 0.1*math.log(2) + 1)
AF = 0.1 * math.log(2) + 1


def test_string_config_validation():
    assert EvalConfig().string is None  # off by default
    s = EvalConfig(string={**FIXED, "shift": 10922, "local": 128}).string
    assert (s.shift, s.local, s.attention_factor, s.shift_ratio) == (10922, 128, 1.0, None)
    with pytest.raises(ValidationError, match=r"local=128 >= shift=128.*set local < shift"):
        StringConfig(**FIXED, shift=128, local=128)
    with pytest.raises(ValidationError, match="shift"):
        StringConfig(**FIXED, shift=0, local=0)
    with pytest.raises(ValidationError, match="local"):
        StringConfig(**FIXED, shift=10, local=-1)
    with pytest.raises(ValidationError, match="shift"):
        StringConfig(**FIXED, shift=10.5, local=1)  # an integer, not a float
    with pytest.raises(ValidationError, match=r"fixed_shift needs shift and local \(no default"):
        StringConfig(**FIXED)
    with pytest.raises(ValidationError, match=r"shift_ratio=0.3 with variant fixed_shift.*variant=authors"):
        StringConfig(**FIXED, shift=64, local=8, shift_ratio=0.3)


def test_the_authors_variant_is_the_default_with_their_values():
    """variant authors (the default): shift_ratio 0.33 (their RULER script's and README's), local 128, the
    factor 0.1 ln 2 + 1, written into the setting; a `shift` in tokens there is an error naming the variant
    that takes it; shift_ratio must lie in (0, 1)."""
    s = EvalConfig(string={}).string
    assert (s.variant, s.shift_ratio, s.local, s.shift, s.attention_factor) == ("authors", 0.33, 128, None, AF)
    assert StringConfig.model_validate(s.model_dump()) == s  # a dumped setting reads back the same
    assert StringConfig(shift_ratio=0.25, local=256, attention_factor=1.0).attention_factor == 1.0
    with pytest.raises(ValidationError, match=r"shift=10922 .* fixed_shift's field.*variant=fixed_shift to keep"):
        StringConfig(shift=10922, local=128)  # an old {shift, local} setting
    for bad in (0, 1, 1.5, -0.1):
        with pytest.raises(ValidationError, match="shift_ratio"):
            StringConfig(shift_ratio=bad)
    with pytest.raises(ValidationError, match="variant"):
        StringConfig(variant="paper")


@pytest.mark.parametrize(
    "ratio,length,S", [(0.33, 300, 99), (0.33, 481, 158), (0.33, 32744, 10805), (0.29, 100, 28), (0.5, 16360, 8180)]
)
def test_the_authors_shift_follows_the_length(ratio, length, S):
    """S = int(shifted_ratio * test_max_length), as ruler/test_ruler_llama.py computes shifted_offset: a
    truncated float product (0.29 * 100 is 28.999999999999996 in binary: 28, not 29), worked out by hand."""
    assert StringConfig(shift_ratio=ratio, local=8).shift_for(length) == S
    assert StringConfig(**FIXED, shift=64, local=8).shift_for(length) == 64


def test_config_refuses_string_under_sequence_parallelism(tmp_path):
    """The trainer's own evals run run_eval, which applies eval.string there too; under parallel.sp > 1
    they would be sequence-parallel, so the config refuses the pair, naming both fields and the fix."""
    cfg = load_config(_config(tmp_path), ["eval.string.local=8"])
    assert check_invariants(cfg) == []
    from megablu.config import ConfigError

    with pytest.raises(ConfigError, match=r"eval.string with parallel.sp=2.*parallel.sp=1"):
        load_config(_config(tmp_path), ["eval.string.local=8", "parallel.sp=2"])


def test_a_shift_outside_the_prompt_is_a_config_error(tmp_path):
    """fixed_shift with S >= an eval length STRING applies to (no distance of that prompt reaches S), and the
    authors' S = int(ratio x L) <= local at a short length: config errors naming the field, the values and the
    fix (beyond >= that length clears them)."""
    from megablu.config import ConfigError

    fixed = ["eval.string.variant=fixed_shift", "eval.string.local=8"]
    with pytest.raises(
        ConfigError,
        match=r"eval.string.shift=300 >= eval length 300 \(variant fixed_shift, "
        r"beyond=0\).*eval.string.beyond >= 300",
    ):
        load_config(_config(tmp_path), fixed + ["eval.string.shift=300"])  # lengths 300 and 480
    assert load_config(_config(tmp_path), fixed + ["eval.string.shift=299"]).eval.string.shift == 299
    assert load_config(_config(tmp_path), fixed + ["eval.string.shift=400", "eval.string.beyond=300"])
    with pytest.raises(ConfigError, match=r"at length 300: S = int\(shift_ratio 0.33 x 300\) = 99 <= local=128"):
        load_config(_config(tmp_path), ["eval.string.variant=authors"])  # the default local 128
    with pytest.raises(ConfigError, match=r"short documents: at 200 tokens S = int\(shift_ratio 0.33 x 200\) = 66"):
        load_config(
            _config(tmp_path, {"loss": {"data": "x", "short_min": 200, "short_max": 400}}), ["eval.string.local=80"]
        )


def test_eval_cli_with_string(tmp_path, capsys):
    from megablu.model.hf import to_hf

    hf_dir = tmp_path / "hf"
    to_hf(tiny_model(seed=4), max_position=512).save_pretrained(str(hf_dir))
    cfg = _config(tmp_path)
    run = ["eval", "--config", str(cfg), "--hf", str(hf_dir), "--step", "0", "--no-plot"]
    fixed = ["--set", "eval.string.variant=fixed_shift"]
    rc = main(
        run + ["--out", str(tmp_path / "s"), *fixed, "--set", "eval.string.shift=64", "--set", "eval.string.local=8"]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = json.loads((tmp_path / "s" / "step_0.json").read_text())
    want = {
        "variant": "fixed_shift",
        "shift_ratio": None,
        "shift": 64,
        "local": 8,
        "attention_factor": 1.0,
        "beyond": 0,
    }
    assert res["eval"]["string"] == want
    assert "tiny@0 +string(S=64,W=8)" in out
    assert {c["length"]: c["string_shift"] for c in res["cells"]} == {300: 64, 480: 64}
    # the mapping form of --set works too
    assert (
        main(run + ["--out", str(tmp_path / "s2"), "--set", "eval.string={variant: fixed_shift, shift: 64, local: 8}"])
        == 0
    )
    s2 = json.loads((tmp_path / "s2" / "step_0.json").read_text())
    assert s2["eval"]["string"] == want
    # the authors' variant (the default): S per length, their factor; another arm than the fixed shift's
    capsys.readouterr()
    assert main(run + ["--out", str(tmp_path / "a"), "--set", "eval.string.local=8"]) == 0
    out = capsys.readouterr().out
    ra = json.loads((tmp_path / "a" / "step_0.json").read_text())
    assert ra["eval"]["string"] == {
        "variant": "authors",
        "shift_ratio": 0.33,
        "shift": None,
        "local": 8,
        "attention_factor": AF,
        "beyond": 0,
    }
    assert {c["length"]: c["string_shift"] for c in ra["cells"]} == {300: 99, 480: 158}  # int(0.33 L)
    assert "tiny@0 +string(authors,S=0.33L,W=8,af=1.069)" in out
    assert main(["compare", str(tmp_path / "a" / "step_0.json"), str(tmp_path / "s" / "step_0.json")]) == 0
    out = capsys.readouterr().out  # one row each, never merged
    assert "| tiny@0 +string(authors,S=0.33L,W=8,af=1.069) |" in out and "| tiny@0 +string(S=64,W=8) |" in out
    assert (
        main(
            run
            + ["--out", str(tmp_path / "p"), *fixed, "--set", "eval.string.shift=64", "--set", "eval.string.local=64"]
        )
        == 2
    )
    assert "eval.string: local=64 >= shift=64" in capsys.readouterr().err
    # an old {shift, local} setting without its variant: the error says how to keep it
    assert (
        main(run + ["--out", str(tmp_path / "p"), "--set", "eval.string.shift=64", "--set", "eval.string.local=8"]) == 2
    )
    assert "eval.string.variant=fixed_shift to keep S=64" in capsys.readouterr().err
    assert (
        main(
            run
            + ["--out", str(tmp_path / "p"), *fixed, "--set", "eval.string.shift=300", "--set", "eval.string.local=8"]
        )
        == 2
    )
    assert "eval.string.shift=300 >= eval length 300" in capsys.readouterr().err
    assert main(run + ["--out", str(tmp_path / "p"), "--set", "eval.string.local=8", "--set", "parallel.sp=2"]) == 2
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
        seen.append((installed(model), k["prefill_chunk"]))
        return real(model, *a, **k)

    monkeypatch.setattr(harness, "greedy_generate", spy)
    cfg = EvalConfig(lengths=[300], n=2, max_new=4, pad=32, string={**FIXED, "shift": 64, "local": 8})
    res = harness.run_eval(m, byte_tok, cfg, 512, step=1, out_dir=tmp_path, rank=0, plot=False)
    assert res["eval"]["string"] == cfg.string.model_dump(mode="json")
    assert seen and all(s == (StringSetting(64, 8), 2048) for s in seen)
    assert installed(m) is None and "forward" not in m.layers[0].self_attn.__dict__ and m.training
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: 2)
    seen.clear()
    with pytest.raises(EvalError, match="parallel.sp=1"):
        harness.run_eval(m, byte_tok, cfg, 512, step=2, out_dir=tmp_path, rank=0, sp_group=object(), plot=False)
    assert not seen


def _res(arm, string=None, length=1024):
    cells = [
        {
            "task": "passkey",
            "length": length,
            "n": 2,
            "correct": 1,
            "acc_pp": 50.0,
            "ci_pp": [0, 100],
            "padded_len": length,
            "digest": "d",
            "seconds": 0,
            "by_depth": [],
        }
    ]
    samples = [{"task": "passkey", "length": length, "index": i, "correct": i == 0} for i in range(2)]
    return make_result(
        cells,
        samples,
        arm=arm,
        step=5,
        window=32768,
        tokenizer_identity="t",
        sp=1,
        eval_cfg=EvalConfig(lengths=[length], string=string),
    )


def test_results_of_another_string_setting_are_another_arm():
    """merge_results joins the cells of one arm@step measured in separate jobs: a result with another
    eval.string (another variant included) is another row (never joined into one arm), and the tables name the
    setting."""
    s = {**FIXED, "shift": 512, "local": 64}
    merged = merge_results([_res("a", s, 1024), _res("a", s, 2048)])
    assert len(merged) == 1 and len(merged[0]["cells"]) == 2
    # a result written before eval.string.beyond and the variants existed (only shift and local) is the fixed
    # shift it ran, beyond 0, no factor ...
    old = _res("a", s, 4096)
    old["eval"]["string"] = {"shift": 512, "local": 64}
    assert len(merge_results([_res("a", s, 1024), old])[0]["cells"]) == 2
    # ... and another beyond, another factor or the authors' variant is another row, as is the plain eval
    for other in ({**s, "beyond": 1024}, {**s, "attention_factor": AF}, {"shift_ratio": 0.33, "local": 64}, None):
        for first in (_res("a", s, 1024), old):
            rows = merge_results([first, _res("a", other, 2048)])
            assert len(rows) == 2 and all(len(r["cells"]) == 1 for r in rows)
    md = markdown(merge_results([_res("a"), _res("a-string", s), _res("a-authors", {"local": 64})]))
    assert "| a@5 |" in md and "| a-string@5 +string(S=512,W=64) |" in md
    assert "| a-authors@5 +string(authors,S=0.33L,W=64,af=1.069) |" in md


def test_run_eval_with_either_string_kernel_gives_the_same_answers_and_records_which_ran(
    tmp_path, byte_tok, monkeypatch
):
    """eval.string.kernel=flex (eager on the CPU) and sdpa: the same generated text for every prompt, and the
    result says which kernel ran (string_kernel); the kernel is how, not what: it is not in the result's
    eval.string (its identity). Without STRING there is no such field."""
    outs = {}
    for impl in ("sdpa", "flex"):
        cfg = EvalConfig(
            lengths=[300], n=3, max_new=4, pad=32, string={**FIXED, "shift": 64, "local": 8, "kernel": impl}
        )
        m = tiny_model(seed=5).double()
        res = harness.run_eval(m, byte_tok, cfg, 512, step=1, out_dir=tmp_path / impl, rank=0, plot=False)
        assert res["string_kernel"] == impl and "kernel" not in res["eval"]["string"]
        used = res["string_kernels_used"]  # every forward here has more keys than S = 64: no plain call
        assert set(used) == {impl} and used[impl] > 0, used
        outs[impl] = [s["output"] for s in res["samples"]]
    assert outs["sdpa"] == outs["flex"] and len(outs["sdpa"]) == 3
    res = harness.run_eval(
        tiny_model(seed=5),
        byte_tok,
        EvalConfig(lengths=[300], n=1, max_new=4, pad=32),
        512,
        step=1,
        out_dir=tmp_path / "plain",
        rank=0,
        plot=False,
    )
    assert "string_kernel" not in res


def test_run_eval_refuses_a_shift_outside_the_prompt(tmp_path, byte_tok):
    """A fixed S at least a prompt's length (the prompt holds no distance that reaches it) and the authors' S at
    most W are refused by run_eval too (the trainer's evals and callers that skip the config check), before
    any generation, naming the field, the values and the fix; the model is left as it was."""
    m = tiny_model(seed=5)
    cfg = EvalConfig(lengths=[300], n=1, max_new=4, pad=32, string={**FIXED, "shift": 400, "local": 8})
    with pytest.raises(EvalError, match=r"eval.string.shift=400 >= eval length 300.*beyond >= 300"):
        harness.run_eval(m, byte_tok, cfg, 512, step=1, out_dir=tmp_path, rank=0, plot=False)
    cfg = EvalConfig(lengths=[300], n=1, max_new=4, pad=32, string={"shift_ratio": 0.1, "local": 30})
    with pytest.raises(EvalError, match=r"S = int\(shift_ratio 0.1 x 300\) = 30 <= local=30"):
        harness.run_eval(m, byte_tok, cfg, 512, step=1, out_dir=tmp_path, rank=0, plot=False)
    assert installed(m) is None and not (tmp_path / "step_1.json").exists()


def test_run_eval_with_the_authors_variant_sets_s_per_length(tmp_path, byte_tok, monkeypatch):
    """variant authors: every prompt of a cell built to L tokens is generated with S = int(0.33 L) (worked out
    by hand: 99 at 300, 231 at 700), W and the factor as configured (the layers' q scale is its square), and the
    cell records its S; afterwards the model is as before."""
    seen = []
    real = harness.greedy_generate

    def spy(model, ids, *a, **k):
        seen.append((ids.shape[1], installed(model)))
        return real(model, ids, *a, **k)

    monkeypatch.setattr(harness, "greedy_generate", spy)
    m = tiny_model(seed=5)
    cfg = EvalConfig(lengths=[300, 700], n=2, max_new=4, pad=32, string={"local": 8})
    res = harness.run_eval(m, byte_tok, cfg, 1024, step=1, out_dir=tmp_path, rank=0, plot=False)
    assert sorted(set(seen)) == [(300, StringSetting(99, 8, AF)), (700, StringSetting(231, 8, AF))]
    assert {c["length"]: (c["string"], c["string_shift"]) for c in res["cells"]} == {300: (True, 99), 700: (True, 231)}
    assert res["eval"]["string"]["variant"] == "authors"
    assert installed(m) is None


def test_the_resume_key_tells_the_variants_apart(byte_tok):
    """A cell kept in a partial file is reused only for the same setting: the two variants (and two factors)
    never share a resume key, so their cells never mix."""
    m = tiny_model(seed=5)

    def key(string):
        return harness._resume_key(
            m, byte_tok, EvalConfig(lengths=[300], string=string), 512, 1, "a", 16384, None, None, "sdpa"
        )

    fixed = {**FIXED, "shift": 99, "local": 8}
    keys = {key(fixed), key({"shift_ratio": 0.33, "local": 8}), key({**fixed, "attention_factor": AF}), key(None)}
    assert len(keys) == 4
    assert key(fixed) == key(dict(fixed))


def test_beyond_evaluates_the_short_cells_plain(tmp_path, byte_tok, monkeypatch):
    """eval.string.beyond: the prompts of cells of at most `beyond` tokens are generated without STRING
    (nothing installed at generation; the cell says string false), the longer ones with it; the result
    records the setting, the tables label it, and the model is restored afterwards."""
    seen = []
    real = harness.greedy_generate

    def spy(model, ids, *a, **k):
        seen.append((ids.shape[1], installed(model)))
        return real(model, ids, *a, **k)

    monkeypatch.setattr(harness, "greedy_generate", spy)
    m = tiny_model(seed=5)
    cfg = EvalConfig(
        lengths=[300, 700], n=2, max_new=4, pad=32, string={**FIXED, "shift": 16, "local": 1, "beyond": 300}
    )
    res = harness.run_eval(m, byte_tok, cfg, 1024, step=1, out_dir=tmp_path, rank=0, plot=False)
    assert sorted({(n <= 300, st is None) for n, st in seen}) == [(False, False), (True, True)], seen
    assert all(st == StringSetting(16, 1) for _, st in seen if st is not None)
    assert {c["length"]: c["string"] for c in res["cells"]} == {300: False, 700: True}
    assert res["eval"]["string"] == cfg.string.model_dump(mode="json") and res["eval"]["string"]["beyond"] == 300
    assert "+string(S=16,W=1,>300)" in markdown([res])
    assert installed(m) is None
    with pytest.raises(ValidationError, match="beyond"):
        StringConfig(**FIXED, shift=64, local=8, beyond=-1)


def test_beyond_in_the_held_out_loss_is_per_sequence(monkeypatch):
    """run_loss with eval.string.beyond: each sequence longer than `beyond` is scored with STRING, each
    other one plain, whatever the order; with the authors' variant S follows each sequence's own length
    (int(0.33 x 300) = 99, int(0.33 x 150) = 49, worked out by hand)."""
    from megablu.eval import loss as loss_mod

    m = tiny_model(seed=5)
    seen = []
    monkeypatch.setattr(
        loss_mod,
        "sequence_nll",
        lambda model, s, **k: seen.append((len(s), installed(model))) or (1.0, len(s), 0.5, len(s) // 2),
    )
    data = {"by_length": {300: [[1] * 300, [2] * 300]}, "short": [[3] * 80, [4] * 150, [5] * 90]}
    for string, at300, at150 in (
        ({**FIXED, "shift": 64, "local": 8, "beyond": 100}, StringSetting(64, 8), StringSetting(64, 8)),
        ({"local": 8, "beyond": 100}, StringSetting(99, 8, AF), StringSetting(49, 8, AF)),
    ):
        seen.clear()
        cfg = EvalConfig(lengths=[300], string=string, loss={"data": "x"})
        apply_string(m, StringSetting(5, 1))  # whatever was installed before
        loss_mod.run_loss(m, data, cfg)
        assert seen == [(300, at300), (300, at300), (80, None), (150, at150), (90, None)]
        assert installed(m) == StringSetting(5, 1)  # left as it came in, not as the last sequence had it


def test_a_bad_string_kernel_is_a_config_error():
    """eval.string.kernel is checked with the config (no environment variable chooses it): a name it does not
    know is refused there, naming the field and the choices; the default is auto."""
    assert StringConfig(**FIXED, shift=64, local=8).kernel == "auto"
    # how, not what: out of every JSON dump (results, resolved config, hash), kept by a python round trip
    # (megablu eval's --lengths/--n/--tasks rebuild the section from model_dump())
    cfg = EvalConfig(lengths=[300], string={**FIXED, "shift": 64, "local": 8, "kernel": "sdpa"})
    assert "kernel" not in cfg.model_dump(mode="json")["string"]
    assert EvalConfig.model_validate({**cfg.model_dump(), "n": 3}).string.kernel == "sdpa"
    with pytest.raises(ValidationError, match=r"kernel[\s\S]*'auto', 'sdpa' or 'flex'"):
        EvalConfig(string={**FIXED, "shift": 64, "local": 8, "kernel": "bogus"})
