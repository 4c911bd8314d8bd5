"""run_eval end to end: an oracle scores 100% (and fails past its limit, so slope and effective
length come out of real scoring), a random tiny model scores ~0, files are written by rank 0
only, prompts are identical across arms, and nothing is ever reported empty."""

import json

import pytest

from megablu.config.schema import EvalConfig, GateConfig
from megablu.eval.harness import run_eval
from megablu.eval.prompts import EvalError

from .conftest import OracleModel, ruler_oracle, tiny_model


def test_oracle_scores_and_report(tmp_path, bpe_tok, haystack_docs):
    cfg = EvalConfig(lengths=[400, 800, 1600, 3200], tasks=["passkey", "needle", "multikey"], n=4, max_new=12, pad=64)
    model = OracleModel(bpe_tok, max_ok_len=1000)
    res = run_eval(
        model,
        bpe_tok,
        cfg,
        4096,
        step=7,
        out_dir=tmp_path / "armX" / "eval",
        rank=0,
        haystack=haystack_docs,
        prefill_chunk=300,
        batch_tokens=1600,
    )
    acc = {(c["task"], c["length"]): c["acc_pp"] for c in res["cells"]}
    for task in cfg.tasks:
        assert [acc[(task, L)] for L in cfg.lengths] == [100.0, 100.0, 0.0, 0.0]
        summ = res["summary"][task]
        assert summ["effective_length"] == 800
        # least squares on log2 length of (100, 100, 0, 0) at x = 0..3: slope -40 pp per doubling
        assert summ["slope"]["pp_per_doubling"] == pytest.approx(-40.0)
    assert res["arm"] == "armX" and res["step"] == 7 and res["tokenizer"] == bpe_tok.identity
    on_disk = json.loads((tmp_path / "armX" / "eval" / "step_7.json").read_text())
    assert on_disk["cells"] == res["cells"]
    assert (tmp_path / "armX" / "eval" / "step_7.md").read_text().startswith("### passkey")
    png = tmp_path / "armX" / "eval" / "step_7.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    c = res["cells"][0]
    assert c["padded_len"] == 448 and c["n"] == 4 and sum(b["n"] for b in c["by_depth"]) == 4
    assert len(res["samples"]) == 3 * 4 * 4


def test_tiny_model_same_prompts_every_arm(tmp_path, byte_tok):
    cfg = EvalConfig(lengths=[300, 480], tasks=["passkey"], n=3, max_new=6, pad=32)
    r1 = run_eval(tiny_model(seed=0), byte_tok, cfg, 512, step=1, out_dir=tmp_path / "a" / "eval", rank=0, plot=False)
    r2 = run_eval(tiny_model(seed=1), byte_tok, cfg, 512, step=1, out_dir=tmp_path / "b" / "eval", rank=1, plot=False)
    assert [c["digest"] for c in r1["cells"]] == [c["digest"] for c in r2["cells"]]
    assert all(c["acc_pp"] == 0.0 for c in r1["cells"])  # an untrained model retrieves nothing
    assert (tmp_path / "a" / "eval" / "step_1.json").exists()
    assert not (tmp_path / "b").exists()  # only rank 0 writes


def test_gate_inside_run_eval(tmp_path, bpe_tok):
    cfg = EvalConfig(
        lengths=[400, 1600],
        tasks=["passkey"],
        n=3,
        max_new=8,
        pad=64,
        gate=GateConfig(short_lengths=[400], margin_pp=5),
    )
    good = run_eval(
        OracleModel(bpe_tok), bpe_tok, cfg, 2048, step=1, out_dir=tmp_path / "p" / "eval", rank=0, plot=False
    )
    cfg2 = cfg.model_copy(update={"gate": GateConfig(parent=str(tmp_path / "p"), short_lengths=[400])})
    # an arm that lost the short length (oracle fails everywhere): the gate fails
    bad = run_eval(
        OracleModel(bpe_tok, max_ok_len=0),
        bpe_tok,
        cfg2,
        2048,
        step=2,
        out_dir=tmp_path / "c" / "eval",
        rank=0,
        plot=False,
    )
    assert bad["gate"]["passed"] is False and "passkey@400" in bad["gate"]["message"]
    ok = run_eval(
        OracleModel(bpe_tok), bpe_tok, cfg2, 2048, step=2, out_dir=tmp_path / "d" / "eval", rank=0, plot=False
    )
    assert ok["gate"]["passed"] is True
    assert good["gate"] is None
    # a parent that does not exist fails before any generation
    cfg3 = cfg.model_copy(update={"gate": GateConfig(parent=str(tmp_path / "nope"))})
    with pytest.raises(EvalError, match="no eval results"):
        run_eval(OracleModel(bpe_tok), bpe_tok, cfg3, 2048, step=2, out_dir=tmp_path / "e" / "eval", rank=0, plot=False)


def test_run_eval_refuses_meaningless_setups(tmp_path, byte_tok, bpe_tok):
    cfg = EvalConfig(lengths=[300], tasks=["passkey"], n=2, max_new=8, pad=64)
    m = tiny_model()
    with pytest.raises(EvalError, match="no tokenizer"):
        run_eval(m, None, cfg, 512, step=0, out_dir=tmp_path, rank=0, plot=False)
    with pytest.raises(EvalError, match="pads to 320 .* > window 300"):
        run_eval(m, byte_tok, cfg, 300, step=0, out_dir=tmp_path, rank=0, plot=False)
    with pytest.raises(EvalError, match="ids > model vocab"):
        run_eval(m, bpe_tok, cfg, 512, step=0, out_dir=tmp_path, rank=0)  # cl100k on a 257-token model
    with pytest.raises(EvalError, match="haystack"):
        run_eval(
            m, byte_tok, cfg.model_copy(update={"tasks": ["needle"]}), 512, step=0, out_dir=tmp_path, rank=0, plot=False
        )
    assert not list(tmp_path.iterdir())


def test_haystack_from_a_dataset_val_split(tmp_path, byte_tok, bpe_tok, haystack_docs):
    """eval.haystack names a dataset dir; its val documents (megablu.data.haystack) are the haystack."""
    import numpy as np

    from megablu.data.shards import DatasetWriter

    root = tmp_path / "ds"
    meta = {"identity": byte_tok.identity, "vocab_size": byte_tok.vocab_size, "eot_id": byte_tok.eot_id}
    with DatasetWriter(root, meta, edges=(1024, 1 << 20)) as w:
        for i, doc in enumerate(haystack_docs[:3]):
            w.add(
                np.asarray(byte_tok.encode(doc), dtype=np.int64),
                "val",
                {"source": "stdlib", "license": "PSF", "key": f"stdlib/{i}"},
            )
        w.finish()
    cfg = EvalConfig(lengths=[600], tasks=["needle"], n=2, max_new=8, pad=32, haystack=str(root))
    res = run_eval(
        OracleModel(byte_tok), byte_tok, cfg, 1024, step=0, out_dir=tmp_path / "a" / "eval", rank=0, plot=False
    )
    assert res["cells"][0]["acc_pp"] == 100.0
    with pytest.raises(EvalError, match="haystack data tokenized with"):
        run_eval(OracleModel(bpe_tok), bpe_tok, cfg, 1024, step=0, out_dir=tmp_path / "b" / "eval", rank=0)


class TurnOverModel(OracleModel):
    """What SmolLM2-135M-Instruct did on fwe: a wrong answer, the end of its turn (<|im_end|>), then another turn
    that states the right one ('1. 2.<|im_end|>\n<|im_start|>assistant\nThe text states ...'), then EOT."""

    def _answer(self, ids):
        ans = ruler_oracle(self.tok.decode(ids))
        if ans is None:  # an early prefill chunk
            return [self.tok.eot_id] * 200
        enc, (im_end, im_start) = self.tok.encode, self.tok.encode("<|im_end|><|im_start|>")
        return (
            enc(" 1. 2.")
            + [im_end]
            + enc("\n")
            + [im_start]
            + enc("assistant\nThe text states " + ans + ".")
            + [self.tok.eot_id] * 200
        )


def test_scoring_stops_at_the_end_of_turn(tmp_path, chat_tok):
    """An answer is what the model wrote up to its end of turn: the right words generated in the turn after
    <|im_end|> get no credit (string_match_all would find them), and the output kept stops there."""
    cfg = EvalConfig(lengths=[512], tasks=["fwe"], n=3, max_new=48, pad=64)
    res = run_eval(
        TurnOverModel(chat_tok), chat_tok, cfg, 1024, step=0, out_dir=tmp_path / "a" / "eval", rank=0, plot=False
    )
    assert [(s["output"], s["score"]) for s in res["samples"]] == [(" 1. 2.", 0.0)] * 3
    assert res["cells"][0]["acc_pp"] == 0.0


def test_eval_decode_reaches_the_generation_and_gives_the_same_answers(tmp_path, byte_tok, monkeypatch):
    import megablu.eval.harness as harness

    seen, real = [], harness.greedy_generate

    def spy(*a, **kw):
        seen.append(kw.get("decode"))
        return real(*a, **kw)

    monkeypatch.setattr(harness, "greedy_generate", spy)
    out = {}
    for mode in ("eager", "static"):
        cfg = EvalConfig(lengths=[300], tasks=["passkey"], n=3, max_new=6, pad=32, decode=mode)
        res = run_eval(tiny_model(seed=2), byte_tok, cfg, 512, step=1, out_dir=tmp_path / mode, rank=0, plot=False)
        out[mode] = json.loads((tmp_path / mode / "step_1.json").read_text())["samples"]
    assert seen and set(seen) == {"eager", "static"} and res["cells"]
    assert out["eager"] and out["eager"] == out["static"]
