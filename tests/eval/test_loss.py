"""Held-out loss (issue 20 item 2, issue 15 item 3): loss per eval length and on whole short val
documents equals a plain full-sequence cross-entropy, is the same data for every arm, lands in
the JSON / table / plot, and the gate fails an arm whose short-document loss rose beyond the
relative margin even when its retrieval is intact."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megablu.config.schema import EvalConfig, GateConfig, LossEvalConfig
from megablu.eval.gate import check_gate, parent_problems
from megablu.eval.harness import preflight_problems, run_eval
from megablu.eval.loss import loss_inputs, sequence_nll

from .conftest import tiny_model


@pytest.fixture(scope="module")
def val_data(tmp_path_factory, byte_tok, haystack_docs):
    """A byte-tokenized dataset whose val split holds long documents and 300..1200-byte ones."""
    from megablu.data.shards import DatasetWriter

    root = tmp_path_factory.mktemp("lossdata") / "ds"
    meta = {"identity": byte_tok.identity, "vocab_size": byte_tok.vocab_size, "eot_id": byte_tok.eot_id}
    text = "\n".join(haystack_docs)
    docs = [text[:6000], text[6000:13000]] + [text[20000 + 900 * i : 20000 + 900 * i + 300 + 97 * i] for i in range(9)]
    with DatasetWriter(root, meta, edges=(1024, 1 << 20)) as w:
        for i, d in enumerate(docs):
            w.add(
                np.asarray(byte_tok.encode(d), dtype=np.int64),
                "val",
                {"source": "stdlib", "license": "PSF", "key": f"s/{i}"},
            )
        w.finish()
    return str(root)


def _cfg(data, **kw):
    loss = LossEvalConfig(data=data, n=2, short_docs=5, short_min=300, short_max=1200)
    return EvalConfig(lengths=[300, 700], tasks=["passkey"], n=2, max_new=6, pad=32, loss=loss, **kw)


def test_sequence_nll_equals_full_cross_entropy():
    m = tiny_model(vocab=257, seed=1).double()
    ids = torch.randint(0, 257, (1, 333), generator=torch.Generator().manual_seed(0))
    logits = m(ids)
    ref = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
    import megablu.eval.loss as L

    L.HEAD_CHUNK, old = 100, L.HEAD_CHUNK  # several vocab chunks, one ragged
    try:
        a, n, b, k = sequence_nll(m, ids[0].tolist(), tail_from=166)
    finally:
        L.HEAD_CHUNK = old
    assert n == 332 and k == 332 - 166
    assert a == pytest.approx(ref.sum().item(), rel=1e-10) and b == pytest.approx(ref[166:].sum().item(), rel=1e-10)


def test_loss_in_result_table_plot_and_same_data(tmp_path, byte_tok, val_data):
    cfg = _cfg(val_data)
    d1, d2 = loss_inputs(cfg, byte_tok), loss_inputs(cfg, byte_tok)
    assert d1 == d2 and [len(s) for s in d1["by_length"][700]] == [700, 700] and len(d1["short"]) == 5
    assert all(300 <= len(s) <= 1200 for s in d1["short"])
    res = run_eval(tiny_model(seed=2), byte_tok, cfg, 1024, step=4, out_dir=tmp_path / "a" / "eval", rank=0)
    lo = res["loss"]
    assert [c["length"] for c in lo["by_length"]] == [300, 700]
    c = lo["by_length"][1]
    assert c["tokens"] == 2 * 699 and math.isclose(c["ppl"], math.exp(c["loss"]))
    assert 4.5 < c["loss"] < 6.5  # an untrained model: ~ln(257) = 5.55 nats
    assert lo["short"]["n_docs"] == 5 and lo["short"]["tokens"] == sum(len(s) - 1 for s in d1["short"])
    on_disk = json.loads((tmp_path / "a" / "eval" / "step_4.json").read_text())
    assert on_disk["loss"] == lo
    md = (tmp_path / "a" / "eval" / "step_4.md").read_text()
    assert "### held-out loss" in md and f"| a@4 | {lo['by_length'][0]['loss']:.3f} (" in md
    assert (tmp_path / "a" / "eval" / "step_4.png").is_file()


def test_gate_fails_a_short_document_loss_rise(tmp_path, byte_tok, val_data):
    """Same retrieval, worse language modelling: the arm fails on the loss alone."""
    cfg = _cfg(val_data, gate=GateConfig(short_lengths=[300], margin_pp=100))
    parent = run_eval(
        tiny_model(seed=2), byte_tok, cfg, 1024, step=0, out_dir=tmp_path / "p" / "eval", rank=0, plot=False
    )
    same = run_eval(
        tiny_model(seed=2),
        byte_tok,
        cfg,
        1024,
        step=1,
        out_dir=tmp_path / "s" / "eval",
        rank=0,
        plot=False,
        parent=parent,
    )
    assert same["gate"]["passed"], same["gate"]["message"]
    worse = tiny_model(seed=2)
    with torch.no_grad():
        worse.lm_head.weight.mul_(40.0)  # confident and wrong: the loss rises, retrieval stays 0 = 0
    bad = run_eval(
        worse, byte_tok, cfg, 1024, step=1, out_dir=tmp_path / "b" / "eval", rank=0, plot=False, parent=parent
    )
    g = bad["gate"]
    assert not g["passed"] and "short-document loss" in g["message"] and "> margin 2%" in g["message"]
    assert "paired 95%" in g["message"]
    loss_check = [c for c in g["checks"] if c["task"] == "loss:short_docs"][0]
    assert loss_check["rel"] > 0.02 and loss_check["ci_rel"][0] > 0  # resolved: every document got worse
    # a parent without the loss cannot gate an arm that measures it (found before any work)
    old = {k: v for k, v in parent.items() if k != "loss"}
    assert parent_problems(old, cfg.gate, cfg.tasks, loss=True)
    assert (
        not check_gate(bad, old, cfg.gate).passed
        and "cannot check the short-document loss" in check_gate(bad, old, cfg.gate).message
    )


def test_loss_data_problems_before_any_work(byte_tok, val_data, tmp_path):
    assert preflight_problems(_cfg(val_data), byte_tok, 1024) == []
    p = preflight_problems(_cfg(str(tmp_path / "none")), byte_tok, 1024)
    assert len(p) == 1 and "eval.loss.data=" in p[0]
    far = _cfg(val_data).model_copy(update={"loss": LossEvalConfig(data=val_data, short_min=7100, short_max=8000)})
    assert "no val document of 7100..8000 tokens" in preflight_problems(far, byte_tok, 8192)[0]


def test_loss_sets_scored_apart_reported_merged_and_gated(tmp_path, byte_tok, val_data):
    """eval.loss.sets (issue 40 item 5): the shipped essays (text outside the training corpus) scored beside
    eval.loss.data, each set in its own section of the result, table and gate; an eval of another length joins
    the set's lengths; a set that cannot be read is found before any work, named by its field."""
    from megablu.eval.loss import ESSAYS
    from megablu.eval.report import markdown, merge_results

    sets = {"essays": ESSAYS}
    cfg = _cfg(val_data).model_copy(
        update={"loss": LossEvalConfig(data=val_data, n=2, short_docs=5, short_min=300, short_max=4000, sets=sets)}
    )
    d = loss_inputs(cfg, byte_tok, "essays")
    assert d["source"] == ESSAYS and [len(s) for s in d["by_length"][700]] == [700, 700] and d["short"]
    assert d["by_length"] != loss_inputs(cfg, byte_tok)["by_length"]  # other text than the data's
    res = run_eval(tiny_model(seed=2), byte_tok, cfg, 1024, step=4, out_dir=tmp_path / "a" / "eval", rank=0, plot=False)
    es = res["loss_sets"]["essays"]
    assert es["data"] == ESSAYS and [c["length"] for c in es["by_length"]] == [300, 700] and es["short"]["n_docs"]
    assert res["loss"]["data"] == val_data and res["loss"]["short"]["loss"] != es["short"]["loss"]
    md = markdown([res])
    assert "### held-out loss: essays (eval.loss.sets)" in md and f"on {ESSAYS} (val split)" in md
    # a second eval at another length in the same folder: the set's lengths are joined
    more = cfg.model_copy(update={"lengths": [500]})
    res2 = run_eval(
        tiny_model(seed=2), byte_tok, more, 1024, step=4, out_dir=tmp_path / "a" / "eval", rank=0, plot=False
    )
    assert [c["length"] for c in res2["loss_sets"]["essays"]["by_length"]] == [300, 500, 700]
    assert [c["length"] for c in merge_results([res, res2])[0]["loss_sets"]["essays"]["by_length"]] == [300, 500, 700]
    # gated on the set: a parent with the set passes the same model, one without cannot check it
    g = check_gate(res, res, GateConfig(short_lengths=[300], margin_pp=100))
    assert g.passed and "loss:short_docs:essays" in [c["task"] for c in g.checks]
    # bad sets, before any work: a missing dataset, a bad name
    bad = _cfg(val_data).model_copy(update={"loss": LossEvalConfig(sets={"web": str(tmp_path / "none")})})
    (p,) = preflight_problems(bad, byte_tok, 1024)
    assert p.startswith(f"eval.loss.sets.web={str(tmp_path / 'none')!r}:")
    with pytest.raises(ValueError, match=r"eval.loss.sets: names \['data'\] are not plain names"):
        LossEvalConfig(sets={"data": ESSAYS})
