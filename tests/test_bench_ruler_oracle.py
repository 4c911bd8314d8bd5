"""bench/ruler_oracle.py end to end on CPU, offline: megablu's harness and lm-eval's RULER tasks (through
the megablu backend) on one model, two tasks, one short length. The model is an oracle that reads each
prompt's text and answers the asked needles' values (a perfect retriever), except on lm-eval's essay
prompts (niah_single_2 through lm-eval), where it answers a wrong number: niah_single_1 must come out
100% on both sides ("yes"), niah_single_2 100% for megablu and 0% for lm-eval ("NO")."""

import json
import math
import re
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval==0.4.13 wonderwords)")
pytest.importorskip("wonderwords", reason="lm-eval's RULER tasks need wonderwords")

from tests.eval.conftest import OracleModel  # noqa: E402

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def _needles(text):
    """The values of the asked keys, read from the prompt text (megablu's and lm-eval's NIAH questions)."""
    q = re.search(r"What (?:are all|is) the special magic \w+ for (.+?) mentioned in the provided text\?", text)
    if q is None:
        return None
    keys = re.split(r", and |, ", q.group(1))
    return [
        v
        for k in keys
        for v in re.findall(r"One of the special magic \w+ for " + re.escape(k) + r" is: ([\w-]+)\.", text)
    ]


class NiahOracle(OracleModel):
    def _answer(self, ids):
        text = self.tok.decode(ids)
        vals = _needles(text)
        if not vals:  # an early prefill chunk: the question has not been seen yet
            return [self.tok.eot_id] * 200
        lm_eval_essay = text.rstrip().endswith("mentioned in the provided text is") and "The grass is green" not in text
        ans = "1234567" if lm_eval_essay else ", ".join(vals)
        return self.tok.encode(" " + ans + ".") + [self.tok.eot_id] * 200


def _config(tmp_path):
    cfg_path = tmp_path / "oracle.yaml"
    cfg_path.write_text(
        yaml.safe_dump(
            {
                "name": "oracle",
                "model": {"n_layers": 1, "d_model": 8, "n_heads": 1, "n_kv_heads": 1, "ffn_dim": 8, "vocab_size": 257},
                "rope": {"theta": 10000.0},
                "tokenizer": {"kind": "byte"},
                "data": {"window": 1024},
                "train": {"max_steps": 1, "tokens_per_step": 1024, "dtype": "fp32", "device": "cpu"},
                "schedule": {"kind": "cosine", "lr": 1e-3, "warmup_steps": 0},
            }
        )
    )
    return cfg_path


def test_oracle_table(tmp_path, monkeypatch, capsys):
    import ruler_oracle

    from megablu.config import load_config
    from megablu.data.tokenizer import ByteTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg_path = _config(tmp_path)
    cfg = load_config(cfg_path)
    tok = ByteTokenizer()
    out = tmp_path / "cells.json"
    rc = ruler_oracle.main(
        [
            "--config",
            str(cfg_path),
            "--lengths",
            "512",
            "--n",
            "4",
            "--out",
            str(out),
            "niah_single_1",
            "niah_single_2",
        ],
        model=NiahOracle(tok),
        tok=tok,
        cfg=cfg,
    )
    text = capsys.readouterr().out
    assert rc == 0
    rows = json.loads(out.read_text())["cells"]
    got = {(r["task"], r["length"]): r for r in rows}
    one, two = got[("niah_single_1", 512)], got[("niah_single_2", 512)]
    assert one["megablu"][:2] == [4, 4] and one["lm_eval"][:2] == [4, 4] and one["agree"]
    assert two["megablu"][:2] == [4, 4] and two["lm_eval"][:2] == [0, 4] and not two["agree"]
    # 4 prompts: the smallest n whose 100% and 0% Wilson intervals do not overlap (4/(4+1.96^2) > 1/2)
    assert (
        "| niah_single_1 | niah_single_1 | 512 | 100.0 [51.0, 100.0] (n=4) | 100.0 [51.0, 100.0] (n=4) | "
        "+0.0 [-49.0, +49.0] | yes |" in text
    )
    # 4/4 against 0/4: Newcombe's interval for the difference excludes 0
    assert "| niah_single_2 | niah_single_2 | 512 | 100.0" in text and "| 0.0 [0.0, 49.0] (n=4) | +100.0 [+30.7" in text
    assert one["diff"][0] == 0 and two["diff"][1] > 0
    # the suite's verdict: the mean over the two tasks, 100 vs 50, its interval excluding 0 (two tasks of 4)
    (mean,) = json.loads(out.read_text())["means"]
    assert mean["tasks"] == 2 and mean["megablu"] == 1.0 and mean["lm_eval"] == 0.5 and not mean["agree"]
    # each side's variance of the mean: two cells of n = 4 at the Agresti-Coull estimate 6/8 or 2/8, each
    # (3/4)(1/4)/4, over 2^2; written out here, not read back from a (clipped) interval
    half = 1.959964 * math.sqrt(2 * (2 * (0.75 * 0.25 / 4) / 4))
    assert mean["diff"][1:] == pytest.approx([0.5 - half, 0.5 + half], abs=1e-5)
    assert "| **mean of 2** | | 512 | 100.0 | 50.0 | +50.0 [" in text
    # both sides read the faithful suite's shipped essay stand-in (pydoc_data.topics only where it is absent)
    assert "essay haystack: ruler/essays.txt.gz (megablu's RULER essay haystack)" in text
    assert "RULER-like presets" in text
    # lm-eval built the 4 samples it scored per task, not its 500 (the niah tasks share one generator)
    record = json.loads(out.read_text())
    assert record["lm_eval_samples_built"] == {"prepare_niah.generate_samples": 8}
    assert record["complete"] and sorted(map(tuple, record["megablu_cells"])) == [
        ("niah_single_1", 512, 4, 4),
        ("niah_single_2", 512, 4, 4),
    ]


def test_a_run_cut_short_keeps_the_cells_lm_eval_finished(tmp_path, monkeypatch):
    """--out is written after every lm-eval cell: killed in the second task, the first one's row is there."""
    import ruler_oracle

    from megablu.config import load_config
    from megablu.data.tokenizer import ByteTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg_path = _config(tmp_path)
    real = ruler_oracle.run_lm_eval

    def cut(*a, on_cell=None, **kw):
        def once(cells):
            on_cell(cells)
            raise KeyboardInterrupt  # the deadline's kill, after the first cell

        return real(*a, on_cell=once, **kw)

    monkeypatch.setattr(ruler_oracle, "run_lm_eval", cut)
    out = tmp_path / "cells.json"
    argv = ["--config", str(cfg_path), "--lengths", "512", "--n", "2", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        ruler_oracle.main(
            argv + ["niah_single_1", "niah_single_2"],
            model=NiahOracle(ByteTokenizer()),
            tok=ByteTokenizer(),
            cfg=load_config(cfg_path),
        )
    record = json.loads(out.read_text())
    assert not record["complete"] and [r["task"] for r in record["cells"]] == ["niah_single_1"]
    assert record["cells"][0]["lm_eval"][:2] == [2, 2] and len(record["megablu_cells"]) == 2


def test_help_and_bad_names(capsys):
    import ruler_oracle

    with pytest.raises(SystemExit) as e:
        ruler_oracle.main(["--help"])
    assert e.value.code == 0 and "lm-eval" in capsys.readouterr().out
    assert ruler_oracle.main(["nope", "--config", "x.yaml", "--lengths", "512"]) == 2
    assert "no lm-eval task mapped to ['nope']" in capsys.readouterr().err
    assert ruler_oracle.mapping(["ruler_vt=my_vt"])["ruler_vt"] == "my_vt"
    from megablu.config.eval_tasks import PRESETS

    # FAITHFUL once megablu has its ruler_* tasks, else the RULER-like presets
    want = ruler_oracle.FAITHFUL if "ruler_niah_single_1" in PRESETS else ruler_oracle.LIKE
    assert ruler_oracle.mapping([]) == want and ruler_oracle.FAITHFUL["niah_single_1"] == "ruler_niah_single_1"
    assert ruler_oracle.FAITHFUL["ruler_vt"] == "ruler_vt" and ruler_oracle.LIKE["ruler_vt"] == "vt"
    m = ruler_oracle.mapping([f"my_lm_vt={want['ruler_vt']}"])  # another lm-eval task for the same megablu task
    assert m["my_lm_vt"] == want["ruler_vt"] and "ruler_vt" not in m  # replaces ruler_vt's


def test_merge_joins_runs_that_each_did_some_cells(tmp_path, capsys):
    """Two --out files with disjoint cells: one table, the mean row over all of them; a cell in both is
    refused."""
    import ruler_oracle

    def cell(task, L, k1, k2, n=10):  # as the oracle writes it
        (row,) = ruler_oracle.compare({(task, L): (k1, n)}, {(task, L): (k2, n)}, [(task, task)], [L])
        return row

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"cells": [cell("ruler_niah_single_1", 4096, 10, 10), cell("ruler_vt", 8192, 1, 2)]}))
    b.write_text(json.dumps({"cells": [cell("ruler_cwe", 4096, 0, 10)]}))
    assert ruler_oracle.main(["merge", str(a), str(b), "--out", str(tmp_path / "m.json")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    assert [(r["task"], r["length"]) for r in merged["cells"]] == [
        ("ruler_niah_single_1", 4096),
        ("ruler_cwe", 4096),
        ("ruler_vt", 8192),
    ]
    m4096 = next(m for m in merged["means"] if m["length"] == 4096)
    assert m4096["tasks"] == 2 and m4096["megablu"] == 0.5 and m4096["lm_eval"] == 1.0
    assert "| **mean of 2** | | 4096 | 50.0 | 100.0 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="ruler_niah_single_1@4096 is in both"):
        ruler_oracle.merge([str(a), str(a)])
    # a cell measured again (after a fix to megablu's side) replaces the first one; the means follow it
    c = tmp_path / "c.json"
    c.write_text(json.dumps({"cells": [cell("ruler_cwe", 4096, 10, 10)]}))
    argv = ["merge", str(a), str(b), "--again", str(c), "--out", str(tmp_path / "m2.json")]
    assert ruler_oracle.main(argv) == 0
    m2 = json.loads((tmp_path / "m2.json").read_text())
    cwe = [r for r in m2["cells"] if r["task"] == "ruler_cwe"]
    assert len(cwe) == 1 and cwe[0]["megablu"][0] == 10 and m2["measured_again"] == ["ruler_cwe@4096"]
    assert next(m for m in m2["means"] if m["length"] == 4096)["megablu"] == 1.0


def test_lm_eval_cells_reused_from_an_earlier_run(tmp_path, monkeypatch):
    """--lm-eval-from: the cells an earlier --out holds are not run through lm-eval again (a megablu fix
    re-runs megablu's side only; a run cut short resumes), the others are; megablu's side always runs. A
    file scored with another n is refused."""
    import lm_eval
    import ruler_oracle

    from megablu.config import load_config
    from megablu.data.tokenizer import ByteTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg_path = _config(tmp_path)
    tok = ByteTokenizer()
    argv = ["--config", str(cfg_path), "--lengths", "512", "--n", "2"]
    first = tmp_path / "first.json"
    assert (
        ruler_oracle.main(
            argv + ["--out", str(first), "niah_single_2"], model=NiahOracle(tok), tok=tok, cfg=load_config(cfg_path)
        )
        == 0
    )
    ran = []
    real = lm_eval.simple_evaluate

    def spy(*a, tasks, **kw):
        ran.extend(tasks)
        return real(*a, tasks=tasks, **kw)

    monkeypatch.setattr(lm_eval, "simple_evaluate", spy)
    second = tmp_path / "second.json"
    rc = ruler_oracle.main(
        argv + ["--out", str(second), "--lm-eval-from", str(first), "niah_single_1", "niah_single_2"],
        model=NiahOracle(tok),
        tok=tok,
        cfg=load_config(cfg_path),
    )
    assert rc == 0 and ran == ["niah_single_1"]
    record = json.loads(second.read_text())
    got = {r["task"]: r for r in record["cells"]}
    assert got["niah_single_2"]["lm_eval"][:2] == [0, 2] and got["niah_single_1"]["lm_eval"][:2] == [2, 2]
    assert record["lm_eval_reused_from"] == {"niah_single_2@512": str(first)}
    assert "niah_single_2@512" in record["lm_eval_examples"]  # the earlier run's answers travel with its cell
    assert sorted(map(tuple, record["megablu_cells"])) == [("niah_single_1", 512, 2, 2), ("niah_single_2", 512, 2, 2)]
    # resuming from both files: the cell the second carried on from the first is one measurement, not two
    ran.clear()
    third = tmp_path / "third.json"
    argv3 = argv + ["--out", str(third), "--lm-eval-from", str(first), "--lm-eval-from", str(second)]
    assert ruler_oracle.main(argv3 + ["niah_single_2"], model=NiahOracle(tok), tok=tok, cfg=load_config(cfg_path)) == 0
    assert ran == [] and json.loads(third.read_text())["cells"][0]["lm_eval"][:2] == [0, 2]
    with pytest.raises(SystemExit, match=r"its lm-eval cells differ from this run: n 2 \(this run: 3\)"):
        ruler_oracle.main(
            ["--config", str(cfg_path), "--lengths", "512", "--n", "3", "--lm-eval-from", str(first), "niah_single_2"],
            model=NiahOracle(tok),
            tok=tok,
            cfg=load_config(cfg_path),
        )


class StartOracle(OracleModel):
    """Answers the asked needles' values only where the context opens with the essays' first words, as
    RULER's and lm-eval's essay haystack always does (haystack[:num_haystack]); elsewhere a wrong number."""

    def _answer(self, ids):
        text = self.tok.decode(ids)
        vals = _needles(text)
        if not vals:
            return [self.tok.eot_id] * 200
        opens = "A new release of Python, version 2.0" in text.split("afterwards.\n", 1)[1][:60]
        return self.tok.encode(" " + (", ".join(vals) if opens else "1234567") + ".") + [self.tok.eot_id] * 200


def test_aligned_column_lays_megablu_out_as_lm_eval(tmp_path, monkeypatch, capsys):
    """--aligned runs megablu's side a second time under lm_eval_layout(): a model that only answers on the
    essays' opening text fails megablu's drawn windows (NO) and passes the aligned prompts, as lm-eval's
    (yes): the difference is the design choice, measured; the implementation agrees."""
    import ruler_oracle

    from megablu.config import load_config
    from megablu.data.tokenizer import ByteTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg_path = _config(tmp_path)
    cfg_path.write_text(cfg_path.read_text().replace("window: 1024", "window: 8192"))
    tok = ByteTokenizer()
    out = tmp_path / "cells.json"
    argv = ["--config", str(cfg_path), "--lengths", "4096", "--n", "4", "--aligned", "--out", str(out)]
    assert (
        ruler_oracle.main(argv + ["ruler_niah_single_2"], model=StartOracle(tok), tok=tok, cfg=load_config(cfg_path))
        == 0
    )
    (row,) = json.loads(out.read_text())["cells"]
    assert row["megablu"][:2] == [0, 4] and row["lm_eval"][:2] == [4, 4] and not row["agree"]
    assert row["megablu_aligned"][:2] == [4, 4] and row["aligned_agree"]
    (mean,) = json.loads(out.read_text())["means"]
    assert mean["megablu_aligned"] == 1.0 and mean["aligned_agree"] and not mean["agree"]
    text = capsys.readouterr().out
    assert "| agree (aligned) |" in text and "| 100.0 [51.0, 100.0] (n=4) | +0.0 [-49.0, +49.0] | yes |" in text
