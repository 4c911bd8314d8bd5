"""megablu's RULER-like suite (issue 15; RULER as published: test_ruler.py): every task's prompts have
the exact length and are the same
for every arm; a scripted oracle that reads the answer out of the prompt TEXT scores 100% on
every task (and 0 past its limit, so effective lengths come from real scoring), a random tiny
model ~0%; part-credit scoring; config errors before any work; the RULER average, tables and
heatmaps from run_eval and `megablu compare`, merging results written before the suite."""

import json
import re

import pytest

from megablu.config.eval_tasks import MEGABLU_SUITE, PRESETS
from megablu.config.schema import EvalConfig, GateConfig, eval_problems
from megablu.eval.harness import build_prompts, preflight_problems, run_eval
from megablu.eval.prompts import EvalError, Prompt, prompt_digest, score
from megablu.eval.report import cell

from .conftest import OracleModel, ruler_oracle, tiny_model

LENGTHS = [2000, 3100]
OWN = [t for t in PRESETS if not t.startswith("ruler_")]  # megablu's tasks (RULER's: test_ruler*.py)


def _cfg(**kw):
    base = dict(lengths=LENGTHS, tasks=list(MEGABLU_SUITE), n=3, max_new=12, pad=64, haystack="unused")
    return EvalConfig(**{**base, **kw})


def test_every_task_exact_length_same_for_every_arm_and_answerable(bpe_tok, haystack_docs):
    cfg = _cfg(tasks=OWN, n=4)
    a = build_prompts(cfg, bpe_tok, haystack=haystack_docs)
    b = build_prompts(cfg, bpe_tok, haystack=lambda: iter(haystack_docs))
    assert {t for t, _ in a} == set(OWN)
    assert {k: prompt_digest(v) for k, v in a.items()} == {k: prompt_digest(v) for k, v in b.items()}
    other = build_prompts(cfg.model_copy(update={"seed": 1}), bpe_tok, haystack=haystack_docs)
    assert all(prompt_digest(a[k]) != prompt_digest(other[k]) for k in a)
    for (task, L), ps in a.items():
        assert len(ps) == 4 and all(len(p.ids) == L for p in ps), task
        assert len({p.answer for p in ps}) == 4, task  # every prompt its own answers
        for p in ps:
            text = bpe_tok.decode(list(p.ids))
            assert all(x in text for x in p.expected), (task, p.expected)
            if task in MEGABLU_SUITE:  # the text alone determines the answers (the oracle derives them)
                assert sorted(ruler_oracle(text).split(", ")) == sorted(p.expected), (task, L, p.index)
            d = [x for x in p.answer_depths if x is not None]
            assert all(0 <= x <= 1 for x in d) and (task in ("cwe", "fwe")) == (not d)
    # paired across lengths: the same prompt index asks the same keys / chain / words at every length
    for task in ("niah_multiquery", "vt", "cwe"):
        assert a[(task, 2000)][1].expected == a[(task, 3100)][1].expected


def test_prompts_of_a_length_do_not_depend_on_the_jobs_other_lengths(bpe_tok, haystack_docs):
    """Arms are often evaluated one length per job, or with other length lists: task@L must be the
    same prompts either way (the real-text haystack is read to a fixed size, not 2x the job's
    longest length), else compare cannot pair them."""
    tasks = ["needle", "niah_single_2", "niah_multikey_1", "niah_multiquery"]
    alone = build_prompts(_cfg(tasks=tasks, lengths=[2000]), bpe_tok, haystack=haystack_docs)
    joint = build_prompts(_cfg(tasks=tasks, lengths=[2000, 3100]), bpe_tok, haystack=haystack_docs)
    for t in tasks:
        assert prompt_digest(alone[(t, 2000)]) == prompt_digest(joint[(t, 2000)]), t


def test_niah_structure(bpe_tok, haystack_docs):
    ps = build_prompts(
        _cfg(tasks=["niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery"], lengths=[3000]),
        bpe_tok,
        haystack=haystack_docs,
    )
    kv = bpe_tok.decode(list(ps[("niah_multikey_2", 3000)][0].ids))
    lines = re.findall(r"^One of the special magic numbers for [\w-]+ is: \d{7}\.$", kv, flags=re.M)
    assert len(lines) > 50  # the haystack is other key-value lines ...
    key = ps[("niah_multikey_2", 3000)][0].meta["keys"][0]
    assert sum(key in ln for ln in lines) == 1  # ... and the needle is one of them
    uu = bpe_tok.decode(list(ps[("niah_multikey_3", 3000)][0].ids))
    assert re.search(r"for [0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12} is: ", uu)
    mv = ps[("niah_multivalue", 3000)][0]
    assert len(mv.expected) == 4 and len(set(mv.answer_depths)) == 4
    mq = ps[("niah_multiquery", 3000)][0]
    assert ", and " in bpe_tok.decode(list(mq.ids))[-400:] and len(mq.meta["keys"]) == 4


def test_scoring_part_credit_and_cells():
    p = Prompt("t", 10, 0, (1,), "a, b", 0.1, answers=("ABC", "def", "7788"), depths=(0.05, 0.5, 0.95), scoring="all")
    assert score(" abc, DEF and 7788.", p) == (1.0, [True, True, True])  # case-insensitive (RULER)
    assert score(" abc and 77", p) == (1 / 3, [True, False, False])  # part credit per answer
    assert score("", p)[0] == 0.0
    assert score(" def", Prompt("t", 10, 0, (1,), "", 0.1, answers=("abc", "def"), scoring="part"))[0] == 1.0
    assert score(" 43140. x", Prompt("t", 1, 0, (1,), "43140", 0.5)) == (1.0, [True])  # passkey: exact digits
    assert score(" 431400", Prompt("t", 1, 0, (1,), "43140", 0.5))[0] == 0.0
    samples = [
        {"correct": False, "score": 1 / 3, "depth": 0.05, "depths": [0.05, 0.5, 0.95], "found": [True, False, False]},
        {"correct": True, "score": 1.0, "depth": 0.05, "depths": [0.05, 0.5, 0.95], "found": [True] * 3},
    ]
    c = cell("niah_multivalue", 10, samples, _cfg(), [p], 2.0)
    assert c["n"] == 2 and c["correct"] == pytest.approx(4 / 3) and c["acc_pp"] == pytest.approx(200 / 3)
    assert c["all_correct"] == 1 and c["ci_pp"][0] < c["acc_pp"] < c["ci_pp"][1]
    bins = {tuple(b["depth"]): (b["n"], b["correct"]) for b in c["by_depth"]}
    assert bins[(0.0, 0.1)] == (2, 2) and bins[(0.5, 0.6)] == (2, 1) and bins[(0.9, 1.0)] == (2, 1)


def test_oracle_scores_100_random_0_and_reports(tmp_path, bpe_tok, haystack_docs):
    from megablu.eval.report import write_artifacts

    cfg = _cfg()
    res = run_eval(
        OracleModel(bpe_tok, max_ok_len=2500),
        bpe_tok,
        cfg,
        4096,
        step=3,
        out_dir=tmp_path / "oracle" / "eval",
        rank=0,
        haystack=haystack_docs,
        batch_tokens=4000,
        plot=False,
    )
    acc = {(c["task"], c["length"]): c["acc_pp"] for c in res["cells"]}
    for task in MEGABLU_SUITE:
        assert (acc[(task, 2000)], acc[(task, 3100)]) == (100.0, 0.0), task
    avg = res["megablu_suite"]
    assert [r["acc_pp"] for r in avg["by_length"]] == [100.0, 0.0] and avg["effective_length"] == 2000
    assert avg["tasks"] == list(MEGABLU_SUITE)
    out = tmp_path / "oracle" / "eval"
    md = (out / "step_3.md").read_text()
    assert "### megablu suite average" in md and "### RULER average" not in md
    assert "| oracle@3 | 11 | 100.0 [" in md and "### niah_single_1" in md
    # the pictures run_eval writes (of three tasks here: matplotlib is the slow part of this test)
    few = {**res, "cells": [c for c in res["cells"] if c["task"] in ("niah_multivalue", "vt", "cwe")]}
    write_artifacts(few, out, 3)
    heat = sorted(p.name for p in out.glob("step_3_depth_*.png"))
    assert heat == ["step_3_depth_niah_multivalue.png", "step_3_depth_vt.png"]  # cwe: no needle depth
    assert (out / "step_3.png").read_bytes()[:4] == b"\x89PNG"
    # a random tiny model (the tokenizer's whole vocabulary) finds nothing
    rnd = run_eval(
        tiny_model(vocab=bpe_tok.vocab_size, seed=3),
        bpe_tok,
        cfg.model_copy(update={"lengths": [2000], "n": 1}),
        4096,
        step=0,
        out_dir=tmp_path / "rnd" / "eval",
        rank=0,
        haystack=haystack_docs,
        plot=False,
        batch_tokens=4000,
    )
    assert max(c["acc_pp"] for c in rnd["cells"]) <= 10.0
    assert rnd["megablu_suite"]["by_length"][0]["acc_pp"] < 2.0


def test_config_errors_name_the_task_and_the_fix(bpe_tok, haystack_docs):
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['niah_single_9'\]; known tasks: .*'niah_single_1'"):
        EvalConfig(tasks=["passkey", "niah_single_9"])
    with pytest.raises(ValueError, match="built-in task names"):
        EvalConfig(tasks=["vt"], task_defs={"vt": {"family": "vt", "hops": 2}})
    with pytest.raises(ValueError, match="queries=3 > keys=2"):
        EvalConfig(tasks=["x"], task_defs={"x": {"family": "niah", "haystack": "kv", "keys": 2, "queries": 3}})
    mine = EvalConfig(lengths=[1200], tasks=["short_vt"], task_defs={"short_vt": {"family": "vt", "hops": 2}})
    assert mine.spec("short_vt").hops == 2 and eval_problems(mine, 2048) == []
    # a length that cannot hold the content, a text task without a haystack, the PAD rule per task
    errs = eval_problems(EvalConfig(lengths=[300, 4000], tasks=["cwe", "niah_single_2"]), 4096)
    assert any("[300] cannot hold task cwe's content" in e for e in errs), errs
    assert any("eval.haystack: task niah_single_2 needs a real-text haystack" in e for e in errs), errs
    assert any("cwe@4000 + max_new 128 pads to 4352" in e for e in errs), errs
    # exactly, in the tokenizer: cwe needs its 300 common entries
    probs = preflight_problems(_cfg(tasks=["cwe", "niah_single_1"], lengths=[1200, 3000], haystack=None), bpe_tok, 4096)
    assert len(probs) == 1 and "[1200] cannot hold task cwe" in probs[0] and "tiktoken:cl100k_base" in probs[0]
    assert (
        "needs a real-text haystack"
        in preflight_problems(_cfg(tasks=["niah_single_2"], haystack=None), bpe_tok, 4096)[0]
    )
    with pytest.raises(EvalError, match="needs a real-text haystack"):
        build_prompts(_cfg(tasks=["niah_multivalue"]), bpe_tok)


def test_compare_merges_old_results_with_the_suite_and_gates_any_task(tmp_path, bpe_tok, haystack_docs, capsys):
    from megablu.cli import main
    from megablu.eval.report import make_result, write_result

    cfg = _cfg(tasks=["niah_single_1", "vt", "fwe"], lengths=[2000])
    for arm, ok in (("parent", 10**9), ("arm", 0)):
        run_eval(
            OracleModel(bpe_tok, max_ok_len=ok),
            bpe_tok,
            cfg,
            4096,
            step=1,
            out_dir=tmp_path / arm / "eval",
            rank=0,
            plot=False,
        )
    old = {
        "task": "passkey",
        "length": 2000,
        "n": 50,
        "correct": 45,
        "acc_pp": 90.0,
        "ci_pp": [0, 100],
        "padded_len": 2048,
        "digest": "d",
        "seconds": 0,
        "by_depth": [{"depth": [i / 5, (i + 1) / 5], "n": 10, "correct": 9} for i in range(5)],
    }  # pre-suite cell
    write_result(
        make_result(
            [old],
            [{"correct": True}],
            arm="parent",
            step=1,
            window=4096,
            eval_cfg=EvalConfig(lengths=[2000]),
            tokenizer_identity=bpe_tok.identity,
            sp=1,
        ),
        tmp_path / "old.json",
    )
    heat = tmp_path / "h" / "cmp"
    rc = main(
        [
            "compare",
            str(tmp_path / "parent"),
            str(tmp_path / "old.json"),
            str(tmp_path / "arm"),
            "--heatmap",
            str(heat),
            "--gate-parent",
            str(tmp_path / "parent"),
            "--short-lengths",
            "2000",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 1 and "SHORT-CONTEXT GATE FAILED" in err and "vt@2000" in err and "fwe@2000" in err
    assert "### passkey" in out and "| parent@1 | 90.0 |" in out  # the old cell merged in
    assert "### megablu suite average" in out and "| arm@1 | 3 | 0.0 [" in out
    # parent right on all 3 prompts, arm on none: paired, but 3 discordant prompts cannot reach p < 0.05 (exact
    # McNemar p = 0.25): no star, however far apart
    assert "-100.0 [" in out and "-100.0*" not in out and "p 0.25 adj" in out
    assert sorted(p.name for p in heat.parent.iterdir()) == ["cmp_niah_single_1.png", "cmp_passkey.png", "cmp_vt.png"]
    res = json.loads((tmp_path / "arm" / "eval" / "step_1.json").read_text())
    assert {s["task"] for s in res["samples"] if "found" in s} == {"niah_single_1", "vt", "fwe"}


def test_gate_config_carries_the_loss_margin():
    assert GateConfig().loss_margin_rel == 0.02
