"""Result identity (issue 39 items 3-4): an arm in compare is the model it scored (weights, rope,
STRING, tokenizer), never a name; the gate never takes a parent scored with an inference-time
change; an eval never replaces another model's result or writes one step's weights under another
step's name; a hub card shows the evals of the weights it uploads."""

import json

from megablu.cli import main
from megablu.config.schema import EvalConfig, GateConfig
from megablu.eval.gate import check_gate, parent_problems
from megablu.eval.report import make_result, markdown, merge_results, write_result

from .conftest import tiny_model
from .test_cli import _ckpt_step, _config

PLAIN = {"theta": 10000.0, "yarn": None}
YARN4 = {"theta": 10000.0, "yarn": {"factor": 4.0, "original_max_position": 256}}


def _res(arm, acc, rope=PLAIN, string=None, weights="w0", n=100, override=None):
    cells = []
    for L, a in acc.items():
        cells.append(
            {
                "task": "passkey",
                "length": L,
                "n": n,
                "correct": a,
                "acc_pp": float(a),
                "ci_pp": [0, 100],
                "padded_len": L,
                "digest": "d",
                "seconds": 0,
                "by_depth": [],
            }
        )
    ev = EvalConfig(lengths=list(acc), **({"string": string} if string else {}))
    extra = {"rope": rope, "weights": weights, **({"rope_override": override} if override else {})}
    return make_result(
        cells,
        [{"task": "passkey", "length": L, "correct": True} for L in acc],
        arm=arm,
        step=800,
        window=1024,
        eval_cfg=ev,
        tokenizer_identity="t",
        sp=1,
        extra=extra,
    )


def test_compare_never_merges_a_rope_override_into_the_plain_row():
    """The audit's case: a parent's plain cells (128, 240) and its --rope-override YaRN x4 cells (480, 992), both
    under the run's name, became one row with "eff. length 992" for a model trained at 256."""
    plain = _res("parent", {128: 100, 240: 99})
    yarn = _res("parent", {480: 100, 992: 92}, rope=YARN4, override={"differences": ["rope.yarn: None vs {...}"]})
    rows = merge_results([plain, yarn])
    assert len(rows) == 2 and sorted(len(r["cells"]) for r in rows) == [2, 2]
    md = markdown(rows)
    assert "| parent@800 [rope theta 10000 plain] | 100.0 | 99.0 | - | - |" in md
    assert "| parent@800 [rope theta 10000 yarn x4] | - | - | 100.0 | 92.0 |" in md
    # other weights under the same name: two rows too; the same model measured in two jobs: one row
    assert len(merge_results([plain, _res("parent", {480: 50}, weights="w1")])) == 2
    assert len(merge_results([plain, _res("parent", {480: 50})])) == 1
    assert len(merge_results([plain, _res("parent", {480: 50}, weights=None)])) == 1  # not recorded: unknown


def test_compare_keeps_a_string_eval_apart_from_the_plain_one():
    plain = _res("arm", {128: 90})
    st = _res("arm", {128: 99}, string={"variant": "fixed_shift", "shift": 64, "local": 8})
    rows = merge_results([plain, st])
    assert len(rows) == 2 and {r["eval"]["string"] is None for r in rows} == {True, False}


def test_the_gate_refuses_a_parent_scored_with_an_inference_change():
    gate = GateConfig(short_lengths=[128])
    arm = _res("ext", {128: 100})
    for parent in (
        _res("parent", {128: 100}, string={"variant": "fixed_shift", "shift": 64, "local": 8}),
        _res("parent", {128: 100}, rope=YARN4, override={"differences": ["rope.yarn"]}),
    ):
        assert any("inference-time change" in p for p in parent_problems(parent, gate, ["passkey"]))
        g = check_gate(arm, parent, gate)
        assert not g.passed and "cannot check against a parent evaluated with" in g.message
    assert check_gate(arm, _res("parent", {128: 100}), gate).passed


def test_an_eval_adds_to_its_own_result_and_never_replaces_another_models(tmp_path, capsys):
    from megablu.model.hf import to_hf

    cfg = _config(tmp_path)
    out = tmp_path / "o"
    for seed in (4, 5):
        to_hf(tiny_model(seed=seed), max_position=512).save_pretrained(str(tmp_path / f"hf{seed}"))
    base = ["eval", "--config", str(cfg), "--step", "0", "--arm", "a", "--out", str(out), "--no-plot"]
    assert main(base + ["--hf", str(tmp_path / "hf4"), "--lengths", "300"]) == 0
    assert main(base + ["--hf", str(tmp_path / "hf4"), "--lengths", "480"]) == 0  # the same model: cells join
    res = json.loads((out / "step_0.json").read_text())
    assert sorted(c["length"] for c in res["cells"]) == [300, 480]
    assert sorted({s["length"] for s in res["samples"]}) == [300, 480]
    before = (out / "step_0.json").read_bytes()
    capsys.readouterr()
    for other in (
        ["--hf", str(tmp_path / "hf5")],  # other weights, same name
        ["--hf", str(tmp_path / "hf4"), "--set", "eval.seed=1"],  # other prompts at 300
        ["--hf", str(tmp_path / "hf4"), "--arm", "b"],
    ):  # another arm's name
        assert main(base + other + ["--lengths", "300"]) == 2
        err = capsys.readouterr().err
        assert "writing this one would lose its cells" in err, err
    assert (out / "step_0.json").read_bytes() == before


def test_step_must_name_the_weights_it_loads(tmp_path, capsys):
    from megablu.data.tokenizer import ByteTokenizer

    cfg = _config(tmp_path)
    run = tmp_path / "runs" / "tiny-0001"
    for s in (10, 20):
        _ckpt_step(run, s, ByteTokenizer().identity)
    assert main(["eval", "--config", str(cfg), "--ckpt", str(run), "--step", "10", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "--step 10, but the weights loaded from" in err and "are step 20" in err
    assert "checkpoints/step_0000010" in err and not (run / "eval").exists()
    assert main(["eval", "--config", str(cfg), "--ckpt", str(run / "checkpoints" / "step_0000010"), "--no-plot"]) == 0
    assert json.loads((run / "eval" / "step_10.json").read_text())["step"] == 10


def test_hub_card_shows_the_evals_of_the_uploaded_step_only(tmp_path):
    from megablu.hub import model_card

    run = tmp_path / "run"
    write_result(_res("run", {128: 11}), run / "eval" / "step_800.json")
    r12 = _res("run", {128: 77})
    r12["step"] = 1200
    write_result(r12, run / "eval" / "step_1200.json")
    card = model_card(run, {"run_id": "run", "step": 800}, {})
    assert "## Evaluation (step 800)" in card and "| 11.0 |" in card and "77.0" not in card
    assert "other steps, not shown (other weights): 1200" in card
    card = model_card(run, {"run_id": "run", "step": 400}, {})
    assert "_no eval of step 400 (the uploaded weights) recorded in this run_" in card and "11.0" not in card
