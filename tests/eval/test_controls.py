"""Controls in `megablu compare` (issue 40 item 5): every inference-time change on a trained arm (STRING, another
YaRN factor) is shown beside the same change on the untrained parent + YaRN, or compare says it has none (and
--require-controls refuses); the pairing never takes another trained arm, another architecture or tokenizer;
the gate runs for every configuration compare reports, RULER's tasks at the parent's window included, and on
every held-out loss set."""

import json

from megablu.cli import main
from megablu.config.schema import EvalConfig, GateConfig
from megablu.eval.controls import NO_CONTROL, controls_markdown, find_controls
from megablu.eval.gate import check_gate, parent_problems
from megablu.eval.report import make_result, merge_results, write_result

PLAIN = {"theta": 10000.0, "yarn": None}
YARN4 = {
    "theta": 10000.0,
    "yarn": {"factor": 4.0, "original_max_position": 256, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True},
}
YARN8 = {**YARN4, "yarn": {**YARN4["yarn"], "factor": 8.0}}
STRING = {"variant": "fixed_shift", "shift": 64, "local": 8}
MODEL = {"n_layers": 2, "d_model": 32}


def _res(
    arm,
    hits,
    *,
    rope=YARN4,
    trained=None,
    string=None,
    weights="wA",
    tok="t",
    model=MODEL,
    task="passkey",
    n=20,
    step=800,
    digest="d",
):
    """A result of `arm`: hits = {length: prompts right of n}, prompt i right when i < hits (so two results on
    the same prompts pair prompt by prompt). trained: the rope the weights were trained with, when the eval
    overrode it (--rope-override)."""
    cells, samples = [], []
    for L, k in hits.items():
        cells.append(
            {
                "task": task,
                "length": L,
                "n": n,
                "correct": k,
                "acc_pp": 100 * k / n,
                "ci_pp": [0, 100],
                "padded_len": L,
                "digest": f"{digest}{L}",
                "seconds": 0,
                "by_depth": [],
            }
        )
        samples += [{"task": task, "length": L, "index": i, "correct": i < k, "score": float(i < k)} for i in range(n)]
    ev = EvalConfig(lengths=list(hits), **({"string": string} if string else {}))
    extra = {
        "rope": rope,
        "weights": weights,
        "model": model,
        **({"rope_override": {"checkpoint": trained, "differences": ["rope.yarn ..."]}} if trained else {}),
    }
    return make_result(
        cells, samples, arm=arm, step=step, window=1024, eval_cfg=ev, tokenizer_identity=tok, sp=1, extra=extra
    )


def _four(**kw):
    """The arm plain and with STRING; the parent (weights wP, trained plain) + YaRN x4 plain and with STRING."""
    return [
        _res("ext", {1024: 12, 4096: 8}),
        _res("ext", {1024: 18, 4096: 17}, string=STRING),
        _res("parent", {1024: 10, 4096: 5}, weights="wP", trained=PLAIN, step=0),
        _res("parent", {1024: 16, 4096: 14}, weights="wP", trained=PLAIN, step=0, string=STRING, **kw),
    ]


def test_string_on_the_arm_is_shown_beside_string_on_the_untrained_parent():
    rows = merge_results(_four())
    (c,) = find_controls(rows)
    assert c.problem is None and c.arm["weights"] == "wA" and c.reference["eval"]["string"] is None
    assert c.control["weights"] == c.control_reference["weights"] == "wP" and c.control["eval"]["string"]
    md = "\n".join(controls_markdown([c]))
    # +6/20 = +30 pp and +9/20 = +45 pp on the arm; +6/20 and +9/20 on the control too: nothing left for training
    assert "| trained | +30.0 [" in md and "| control | +30.0 [" in md
    assert md.count("+45.0 [") == 2 and "indep." not in md and "prompts differ" not in md  # paired
    assert "| trained - control | +0.0 [" in md
    assert "trained: ext@800 +string(S=64,W=8) minus ext@800; control: parent@0" in md


def test_a_missing_control_is_said_and_require_controls_refuses(tmp_path, capsys, caplog):
    for i, r in enumerate(_four()[:2]):
        write_result(r, tmp_path / f"r{i}.json")
    files = [str(tmp_path / f"r{i}.json") for i in range(2)]
    assert main(["compare", *files]) == 0
    out, err = capsys.readouterr()
    assert f"STRING fixed_shift S=64 W=8: {NO_CONTROL} (no untrained parent + YaRN among the inputs" in out
    assert NO_CONTROL in caplog.text  # a warning too
    assert main(["compare", *files, "--require-controls"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--require-controls" in err and "ext@800 +string(S=64,W=8)" in err
    # with the control, --require-controls passes and the table holds both effects
    for i, r in enumerate(_four()[2:]):
        write_result(r, tmp_path / f"c{i}.json")
    assert main(["compare", *files, str(tmp_path / "c0.json"), str(tmp_path / "c1.json"), "--require-controls"]) == 0
    out = capsys.readouterr()[0]
    assert "| control | +30.0 [" in out and NO_CONTROL not in out


def test_the_control_lacking_the_change_is_not_a_control():
    rows = merge_results(_four()[:3])
    (c,) = find_controls(rows)
    assert "the control parent@0" in c.problem and "was not evaluated with the change" in c.problem
    # another STRING setting on the parent is another change
    (c,) = find_controls(
        merge_results(
            _four()[:3] + [_res("parent", {1024: 20}, weights="wP", trained=PLAIN, string={**STRING, "shift": 32})]
        )
    )
    assert c.problem and "was not evaluated with the change" in c.problem


def test_the_pairing_never_takes_a_trained_arm_another_tokenizer_or_architecture():
    arm, arm_s = _four()[:2]
    wrong = [
        # another trained arm with the same rope and STRING: trained, not a control
        [_res("other", {1024: 5}, weights="wB"), _res("other", {1024: 9}, weights="wB", string=STRING)],
        # the parent + YaRN of another tokenizer, and of another architecture
        [
            _res("p", {1024: 5}, weights="wP", trained=PLAIN, tok="t2"),
            _res("p", {1024: 9}, weights="wP", trained=PLAIN, tok="t2", string=STRING),
        ],
        [
            _res("p", {1024: 5}, weights="wP", trained=PLAIN, model={"n_layers": 3}),
            _res("p", {1024: 9}, weights="wP", trained=PLAIN, model={"n_layers": 3}, string=STRING),
        ],
        # weights trained at YaRN x8 (not a parent of x4), and the parent + YaRN x8 (not the arm's rope)
        [
            _res("p", {1024: 5}, weights="wP", trained=YARN8),
            _res("p", {1024: 9}, weights="wP", trained=YARN8, string=STRING),
        ],
        [
            _res("p", {1024: 5}, weights="wP", rope=YARN8, trained=PLAIN),
            _res("p", {1024: 9}, weights="wP", rope=YARN8, trained=PLAIN, string=STRING),
        ],
    ]
    for extra in wrong:
        (c,) = [c for c in find_controls(merge_results([arm, arm_s, *extra])) if c.arm["weights"] == "wA"]
        assert c.problem and "no untrained parent + YaRN among the inputs" in c.problem, extra
    # two untrained parents of the same architecture: ambiguous, neither is used
    twins = _four() + [
        _res("p2", {1024: 5}, weights="wQ", trained=PLAIN),
        _res("p2", {1024: 9}, weights="wQ", trained=PLAIN, string=STRING),
    ]
    (c,) = find_controls(merge_results(twins))
    assert "ambiguous: 2 untrained parents + YaRN" in c.problem and c.control is None


def test_another_yarn_factor_on_the_arm_is_controlled_by_the_same_factor_on_the_parent():
    """The arm (trained at YaRN x4) evaluated at x8 (--rope-override): its reference is the arm at x4; the
    control is the parent at x8 minus the parent at x4."""
    rows = merge_results(
        [
            _res("ext", {1024: 12}),
            _res("ext", {1024: 4}, rope=YARN8, trained=YARN4),
            _res("parent", {1024: 10}, weights="wP", trained=PLAIN, step=0),
            _res("parent", {1024: 6}, weights="wP", rope=YARN8, trained=PLAIN, step=0),
        ]
    )
    controls = find_controls(rows)
    assert len(controls) == 1  # the parent's own YaRN evaluations are the control's side, not a trained arm's
    (c,) = controls
    assert c.problem is None and c.control["rope"] == YARN8 and c.control_reference["rope"] == YARN4
    assert "| trained | -40.0 [" in "\n".join(controls_markdown(controls))
    assert "| control | -20.0 [" in "\n".join(controls_markdown(controls))
    # per prompt: the arm lost prompts 4-11, the control 6-9; beyond the control: prompts 4, 5, 10, 11 = -20 pp
    assert "| trained - control | -20.0 [" in "\n".join(controls_markdown(controls))


def test_a_parent_that_is_itself_a_yarn_extension_is_the_control_not_an_arm():
    """Parent trained at YaRN x2, the arm at x4 (same original length): the parent at x4 (--rope-override) with
    and without STRING is the arm's control, and its rows are not reported as arms lacking a control."""
    yarn2 = {**YARN4, "yarn": {**YARN4["yarn"], "factor": 2.0}}
    rows = merge_results(
        _four()[:2]
        + [
            _res("parent", {1024: 10, 4096: 5}, weights="wP", trained=yarn2, step=0),
            _res("parent", {1024: 16, 4096: 14}, weights="wP", trained=yarn2, step=0, string=STRING),
        ]
    )
    (c,) = find_controls(rows)
    assert c.problem is None and c.arm["weights"] == "wA" and c.control["weights"] == "wP"


def test_a_control_on_other_prompts_is_marked():
    rows = merge_results(_four(digest="other"))
    md = "\n".join(controls_markdown(find_controls(rows)))
    assert "(other prompts than the arm's)" in md


# ------------------------------------------------------------------------------------------------ the gate
def test_compare_gates_every_configuration_and_flags_an_unchecked_one(tmp_path, capsys):
    """The STRING row and the untrained parent + YaRN are gated like the plain arm; a configuration without
    the short lengths is UNCHECKED in the table and fails compare."""
    parent = _res("parent", {1024: 20, 4096: 20}, rope=PLAIN, weights="wP", step=0)
    rows = [
        _res("ext", {1024: 20, 4096: 19}),
        _res("ext", {1024: 20, 4096: 10}, string=STRING),
        _res("ext", {16384: 20}, string={**STRING, "shift": 999}),
    ]
    files = []
    for i, r in enumerate([parent, *rows]):
        files.append(str(write_result(r, tmp_path / f"r{i}.json")))
    rc = main(["compare", *files, "--gate-parent", files[0]])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "### short-context gate against parent@0" in out
    assert "| ext@800 [rope theta 10000 yarn x4] | passed |" not in out  # labels carry what tells rows apart
    assert "| ext@800 | passed | 2 | - |" in out
    assert "| ext@800 +string(S=64,W=8) | FAILED | 2 | passkey@4096 |" in out
    assert "| ext@800 +string(S=999,W=8) | UNCHECKED | 0 | cannot check passkey@1024 (arm has no result)" in out
    assert "| parent@0 |" not in out.split("### short-context gate")[1]  # the parent is not gated against itself
    assert "ext@800 +string(S=999,W=8): SHORT-CONTEXT GATE FAILED" in err


def _ruler(arm, acc, weights="w", step=0):
    return _res(arm, acc, task="ruler_niah_single_1", rope=PLAIN, weights=weights, step=step)


def test_the_gate_checks_ruler_tasks_at_the_parents_window():
    parent = _ruler("parent", {1024: 20, 4096: 20, 8192: 18})
    gate = GateConfig(short_lengths=[1024, 4096])
    arm = _ruler("ext", {1024: 20, 4096: 20, 8192: 8, 16384: 5}, weights="wA")
    g = check_gate(arm, parent, gate)
    assert not g.passed and "ruler_niah_single_1@8192: 40.0% vs parent 90.0%" in g.message
    assert [c["length"] for c in g.checks] == [1024, 4096, 8192]
    assert check_gate(arm, parent, GateConfig(short_lengths=[1024, 4096], ruler_at_window=False)).passed
    # an arm that did not measure the parent's window is unchecked, and parent_problems says so beforehand
    short = _ruler("ext", {1024: 20, 4096: 20}, weights="wA")
    g = check_gate(short, parent, gate)
    assert not g.passed and g.verdict == "UNCHECKED" and "ruler_niah_single_1@8192 (arm has no result)" in g.message
    (p,) = parent_problems(parent, gate, ["ruler_niah_single_1"], lengths=[1024, 4096])
    assert "ruler_niah_single_1@8192" in p and "eval.gate.ruler_at_window=false" in p
    assert parent_problems(parent, gate, ["ruler_niah_single_1"], lengths=[1024, 4096, 8192]) == []
    # passkey is not a RULER task: gated at the short lengths only
    pk = _res("parent", {1024: 20, 4096: 20, 8192: 20}, rope=PLAIN)
    assert check_gate(_res("ext", {1024: 20, 4096: 20, 8192: 0}), pk, gate).passed


def _with_losses(res, **short):
    """res with a short-document loss per held-out set (None: eval.loss.data)."""

    def sec(loss):
        return {
            "data": "x",
            "by_length": [],
            "short": {
                "range": [1, 2],
                "n_docs": 2,
                "tokens": 10,
                "loss": loss,
                "ppl": 1.0,
                "per_doc": [[5, loss], [5, loss]],
                "digest": "q",
            },
        }

    res = json.loads(json.dumps(res))
    if "data" in short:
        res["loss"] = sec(short.pop("data"))
    res["loss_sets"] = {k: sec(v) for k, v in short.items()}
    return res


def test_the_gate_checks_every_held_out_loss_set():
    gate = GateConfig(short_lengths=[1024])
    parent = _with_losses(_res("parent", {1024: 20}, rope=PLAIN), data=2.0, essays=3.0)
    arm = _res("ext", {1024: 20})
    # in-corpus loss down (domain adaptation), out-of-corpus loss up 10%: fails on the essays
    g = check_gate(_with_losses(arm, data=1.5, essays=3.3), parent, gate)
    assert not g.passed and "short-document loss on essays 3.3000 vs parent 3.0000 = +10.0%" in g.message
    assert [c["task"] for c in g.checks] == ["passkey", "loss:short_docs", "loss:short_docs:essays"]
    assert check_gate(_with_losses(arm, data=1.5, essays=3.01), parent, gate).passed
    # a parent without the set cannot check it
    g = check_gate(
        _with_losses(arm, data=1.5, essays=3.0), _with_losses(_res("p", {1024: 20}, rope=PLAIN), data=2.0), gate
    )
    assert not g.passed and "cannot check the short-document loss on essays (parent has none)" in g.message
    assert any(
        "eval.loss.sets.essays" in p
        for p in parent_problems(
            _with_losses(_res("p", {1024: 20}, rope=PLAIN), data=2.0), gate, ["passkey"], loss_sets=["essays"]
        )
    )
