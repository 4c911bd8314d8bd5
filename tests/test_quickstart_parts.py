"""The quick start's parts that need no training: its passkey training documents, the claims and
the one-line verdict from eval results, and `examples/quickstart/quickstart.sh` argument handling and dry run
(the --gpu path's commands, checked here; the H200 runs them)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
from scipy import stats as sps

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart" / "quickstart.py")
quickstart = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quickstart)
claims, main, verdict = quickstart.claims, quickstart.main, quickstart.verdict
paired_loss_diff, passkey_docs = quickstart.paired_loss_diff, quickstart.passkey_docs
SCRIPT = ROOT / "examples" / "quickstart" / "quickstart.sh"
TOK = "tiktoken_file:megablu:stdlib4k"


def _docs(path: Path):
    from megablu.data.shards import DocTable, read_manifest, select_shards

    m = read_manifest(path)
    return m, DocTable.open(path, select_shards(m, "all", "train", path), m["dtype"])


def test_passkey_docs_are_the_eval_template_with_their_answer(tmp_path):
    from megablu.config.eval_tasks import PasskeySpec
    from megablu.data.tokenizer import load_tokenizer, parse_tokenizer_spec
    from megablu.eval.passkey import FILLER, INSTRUCTION, QUESTION
    from megablu.eval.tasks import make_builder

    tok = load_tokenizer(parse_tokenizer_spec(TOK))
    out = tmp_path / "pk"
    m = passkey_docs(out, TOK, lengths=(120, 200), docs=40, seed=5, digits=1, depth=(0.0, 0.5))
    assert m["passkey_docs"] == {"seed": 5, "docs": 40, "lengths": [120, 200], "digits": 1, "depth": [0.0, 0.5]}
    _, table = _docs(out)
    texts = [tok.decode(table.doc(i).tolist()) for i in range(len(table))]
    assert len(texts) == 40 and all(120 <= len(table.doc(i)) <= 200 for i in range(40))
    for t in texts:
        q = t.rindex(QUESTION)
        key = t[q + len(QUESTION) :].strip().rstrip(".")
        assert len(key) == 1 and key.isdigit()
        assert t.startswith(INSTRUCTION)
        needle = t.index(f"The pass key is {key}. Remember it.") - len(INSTRUCTION)
        # depth 0-0.5: the needle in the first half of the filler (snapped to a filler sentence)
        assert needle <= 0.5 * (q - len(INSTRUCTION)) + len(FILLER)
    # 1-digit keys: 10 keys x 81 lengths x a few filler positions, so a pair may repeat by chance
    # (the expected number of equal pairs among 40 is ~0.5); each document is its own draw
    assert len(set(texts)) >= 36
    # keys and depths of their own: with 5-digit keys no training document starts with an eval prompt
    # (a 1-digit key at a short length has only ~10 x a few filler positions: prompts repeat by design)
    passkey_docs(tmp_path / "pk5", TOK, lengths=(129, 170), docs=300, seed=5, digits=5)
    _, t5 = _docs(tmp_path / "pk5")
    assert len({tuple(t5.doc(i).tolist()) for i in range(300)}) == 300
    b = make_builder("passkey", PasskeySpec(), tok, 0, 100, None)
    prompts = {tuple(b.build(L, i).ids) for L in range(120, 165, 4) for i in range(100)}
    heads = {tuple(t5.doc(i).tolist()[:L]) for i in range(300) for L in range(120, 165, 4)}
    assert not prompts & heads


def test_passkey_docs_kept_when_the_recipe_is_the_same_replaced_otherwise(tmp_path):
    out = tmp_path / "pk"
    passkey_docs(out, TOK, lengths=(120, 200), docs=10, seed=1, digits=1)
    mtime = (out / "manifest.json").stat().st_mtime_ns
    passkey_docs(out, TOK, lengths=(120, 200), docs=10, seed=1, digits=1)
    assert (out / "manifest.json").stat().st_mtime_ns == mtime  # up to date: not rewritten
    m = passkey_docs(out, TOK, lengths=(120, 200), docs=12, seed=1, digits=1)
    assert m["passkey_docs"]["docs"] == 12 and _docs(out)[0]["counts"]["b0"]["train"]["documents"] == 12
    with pytest.raises(ValueError, match="needs at least"):
        passkey_docs(tmp_path / "short", TOK, lengths=(20, 40), docs=3, seed=1)


def _res(window, cells, loss):
    """An eval result: at length L the first k of the same 100 prompts right (arms pair: equal digests, every
    prompt's outcome kept), and the loss of the same val sequences."""
    return {
        "window": window,
        "cells": [
            {
                "task": "passkey_1digit",
                "length": L,
                "n": 100,
                "correct": k,
                "acc_pp": float(k),
                "ci_pp": [0.0, 100.0],
                "digest": f"p{L}",
            }
            for L, k in cells
        ],
        "samples": [
            {"task": "passkey_1digit", "length": L, "index": i, "correct": i < k} for L, k in cells for i in range(100)
        ],
        "loss": {
            "by_length": [
                {"length": L, "n": len(s), "loss": sum(s) / len(s), "per_seq": s, "digest": L} for L, s in loss
            ]
        },
    }


def test_claims_and_verdict():
    par = _res(256, [(240, 96)], [(240, [6.0, 6.1, 6.2])])
    un = _res(
        1024,
        [(240, 95), (480, 70), (992, 20)],
        [(240, [6.0, 6.1, 6.2]), (480, [6.0, 6.1, 6.2]), (992, [6.0, 6.1, 6.2])],
    )
    ext = _res(
        1024,
        [(240, 97), (480, 72), (992, 60)],
        [(240, [5.9, 6.0, 6.1]), (480, [6.01, 6.0, 6.3]), (992, [5.7, 5.8, 5.9])],
    )
    c = claims(par, un, ext, 256)
    assert {(b["what"], b["length"]) for b in c["better_beyond"]} == {("passkey_1digit", 992), ("loss", 992)}
    assert c["retrieval"]["passkey_1digit"][480]["resolvable"] is False  # 72 vs 70 at n = 100
    assert c["loss"][480]["resolvable"] is False and c["loss"][992]["resolvable"] is True
    # the stars: Holm over the six tests (exact McNemar on the discordant prompts, paired t on the sequences)
    r, lo = c["retrieval"]["passkey_1digit"], c["loss"]
    p = [r[240]["p"], r[480]["p"], r[992]["p"], lo[480]["p"]]
    assert p == pytest.approx(
        [
            sps.binomtest(2, 2).pvalue,
            sps.binomtest(2, 2).pvalue,
            sps.binomtest(40, 40).pvalue,
            sps.ttest_rel([6.01, 6.0, 6.3], [6.0, 6.1, 6.2]).pvalue,
        ],
        rel=1e-9,
    )
    assert lo[992]["p"] == 0.0 and lo[240]["p"] < 1e-12  # equal differences: a point interval
    assert [x["star"] for x in (r[240], r[480], r[992], lo[240], lo[480], lo[992])] == [
        False,
        False,
        True,
        True,
        False,
        True,
    ]
    assert r[992]["p_adj"] == pytest.approx(min(1.0, 4 * r[992]["p"]), rel=1e-9)  # third smallest of six
    # a gain whose interval excludes 0 and whose p < 0.05 (6 prompts flipped to right, none to wrong: 0.031),
    # but not after Holm over six tests (6 x 0.031 = 0.19), is not claimed
    same = [(240, [6.0, 6.1, 6.2]), (480, [6.0, 6.1, 6.2]), (992, [6.0, 6.1, 6.2])]
    c6 = claims(
        par,
        _res(1024, [(240, 95), (480, 70), (992, 20)], same),
        _res(1024, [(240, 95), (480, 76), (992, 20)], same),
        256,
    )
    y = c6["retrieval"]["passkey_1digit"][480]
    assert y["resolvable"] and y["p"] == pytest.approx(sps.binomtest(6, 6).pvalue) and y["p"] < 0.05
    assert y["p_adj"] == pytest.approx(6 * y["p"]) and not y["star"] and c6["better_beyond"] == []
    assert "passkey_1digit@480 76% vs 70%" in verdict(c6, 4.0).split("; not resolved or worse: ")[1]
    assert all(b["long_context"] for b in c["better_beyond"])  # +40 pp > +2 inside; -0.3 < -0.1 inside
    v = verdict(c, 4.0)
    good, rest = v.split("; not resolved or worse: ")
    assert "is resolvably better than the parent with untrained YaRN, by more than inside the window" in good
    assert "passkey_1digit@992 60% vs 20% (+40 pp" in good
    assert "loss@992 -0.300 nats/token" in good and "@480" not in good and "extra training" not in good
    assert "passkey_1digit@480 72% vs 70%" in rest
    assert "inside the window the same comparison gives loss@240 -0.100" in rest
    # the same loss gain inside the window: extra training, not a long-context gain
    ext3 = _res(
        1024,
        [(240, 97), (480, 72), (992, 60)],
        [(240, [5.6, 5.7, 5.8]), (480, [6.01, 6.0, 6.3]), (992, [5.7, 5.8, 5.9])],
    )
    c3 = claims(par, un, ext3, 256)
    assert {(b["what"], b["length"], b["long_context"]) for b in c3["better_beyond"]} == {
        ("passkey_1digit", 992, True),
        ("loss", 992, False),
    }
    good3 = verdict(c3, 4.0).split("; not resolved or worse: ")[0]
    assert "by more than inside the window (a long-context gain), on passkey_1digit@992" in good3
    assert "by no more than inside the window (extra training, not longer context): loss@992 -0.300" in good3
    ext4 = _res(
        1024,
        [(240, 95), (480, 70), (992, 20)],  # retrieval as untrained, loss as ext3
        [(240, [5.6, 5.7, 5.8]), (480, [6.0, 6.1, 6.2]), (992, [5.7, 5.8, 5.9])],
    )
    only = verdict(claims(par, un, ext4, 256), 4.0)
    assert "only by as much as inside the window (extra training, not longer context), on loss@992" in only
    # nothing better beyond the window: said so
    c2 = claims(par, un, un, 256)
    assert c2["better_beyond"] == [] and "is NOT resolvably better" in verdict(c2, 4.0)
    # a paired interval needs the same sequences
    a = {"per_seq": [1.0, 2.0], "digest": "x"}
    assert paired_loss_diff(a, {"per_seq": [1.0, 2.0], "digest": "y"}) is None


def _sh(*args, cwd=ROOT):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_quickstart_gpu_dry_run_prints_every_step_and_runs_nothing(tmp_path):
    runs = tmp_path / "runs"
    r = _sh("--gpu", "--dry-run", "--runs-dir", str(runs), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and not runs.exists() and not (tmp_path / "out").exists()
    steps = [ln.split("] ", 1)[1] for ln in r.stderr.splitlines() if ln.startswith("[quickstart")]
    names = [s.split(":", 1)[0] for s in steps[1:]]
    assert names == [
        "data_stdlib",
        "data_passkey",
        "data_passkey_long",
        "parent",
        "extension",
        "eval_parent",
        "eval_untrained",
        "eval_extension",
        "compare",
        "summary",
    ], names
    cmd = dict(s.split(": ", 1) for s in steps[1:])
    assert "--val-fraction 0.05" in cmd["data_stdlib"] and "--max-bytes" not in cmd["data_stdlib"]
    assert "--digits 5" in cmd["data_passkey"] and "passkey16384" in cmd["data_passkey_long"]
    assert cmd["parent"].startswith("deepspeed --num_gpus 1 ")
    assert "examples/quickstart/quickstart_gpu.yaml" in cmd["parent"]
    assert "--json" in cmd["parent"] and "init_from=<parent run>" in cmd["extension"]
    assert "quickstart_gpu_ext.yaml" in cmd["extension"] and "--rope-override" in cmd["eval_untrained"]
    assert "--gate-parent <parent run> --short-lengths 256 1024 2024" in cmd["compare"]
    assert "<parent run> " + str(runs / "quickstart" / "eval_untrained") + " <extension run>" in cmd["compare"]
    # every config the GPU path names passes the config check for one GPU
    for cfg in ("examples/quickstart/quickstart_gpu.yaml", "examples/quickstart/quickstart_gpu_ext.yaml"):
        assert cfg in r.stderr
        assert main_check(cfg) == 0, cfg


def main_check(cfg: str) -> int:
    from megablu.cli import main as cli

    return cli(["config", "check", str(ROOT / cfg), "--world-size", "1", "--device", "cuda", "--no-files"])


def test_quickstart_cpu_dry_run_and_bad_options(tmp_path, capsys):
    r = _sh("--dry-run", "--runs-dir", str(tmp_path / "runs"))
    assert r.returncode == 0, r.stderr
    assert "deepspeed --num_gpus 2 " in r.stderr and "quickstart_cpu_ext.yaml" in r.stderr
    assert "--digits 1" in r.stderr and "--short-lengths 128 240" in r.stderr
    r = _sh("--gpus")
    assert r.returncode == 2 and "unknown option --gpus" in r.stderr
    r = _sh("--runs-dir")
    assert r.returncode != 0 and "--runs-dir needs a directory" in r.stderr
    r = _sh("--help")
    assert r.returncode == 0 and "set -euo" not in r.stdout
    assert "bash examples/quickstart/quickstart.sh --gpu" in r.stdout
    # the cpu configs check for their worlds (1 rank, 2 ranks)
    from megablu.cli import main as cli

    assert (
        cli(
            [
                "config",
                "check",
                str(ROOT / "examples/quickstart/quickstart_cpu.yaml"),
                "--world-size",
                "1",
                "--device",
                "cpu",
                "--no-files",
            ]
        )
        == 0
    )
    assert (
        cli(
            [
                "config",
                "check",
                str(ROOT / "examples/quickstart/quickstart_cpu_ext.yaml"),
                "--world-size",
                "2",
                "--device",
                "cpu",
                "--no-files",
            ]
        )
        == 0
    )


def test_summary_cli_writes_claims(tmp_path, capsys):
    """`python3 examples/quickstart/quickstart.py summary` on results as the quick start leaves them."""
    from megablu.eval.report import SCHEMA

    def write(d: Path, res: dict, step: int):
        d.mkdir(parents=True)
        res = {**res, "schema": SCHEMA, "arm": d.name, "step": step, "samples": [], "gate": None}
        for c in res["cells"]:
            c.setdefault("digest", "p")
        (d / f"step_{step}.json").write_text(json.dumps(res))

    par = _res(256, [(240, 96)], [(240, [6.0, 6.1, 6.2])])
    un = _res(1024, [(240, 95), (992, 20)], [(240, [6.0, 6.1, 6.2]), (992, [6.0, 6.1, 6.2])])
    ext = _res(1024, [(240, 97), (992, 60)], [(240, [5.9, 6.0, 6.1]), (992, [5.7, 5.8, 5.9])])
    write(tmp_path / "p" / "eval", par, 800)
    write(tmp_path / "u", un, 800)
    write(tmp_path / "e" / "eval", ext, 240)
    s = {
        "run_dir": "r",
        "steps": 1,
        "tokens_seen": 2,
        "first_loss": 3.0,
        "last_loss": 2.0,
        "mean_tokens_per_s": 9.0,
        "world": "world 1 = dp 1 x sp 1, x",
    }
    for d in ("p", "e"):
        (tmp_path / d / "summary.json").write_text(json.dumps(s))
    (tmp_path / "gate.txt").write_text("e@240: short-context gate passed against p@800\n")
    assert (
        main(
            [
                "summary",
                "--parent-run",
                str(tmp_path / "p"),
                "--ext-run",
                str(tmp_path / "e"),
                "--parent-eval",
                str(tmp_path / "p"),
                "--untrained-eval",
                str(tmp_path / "u"),
                "--ext-eval",
                str(tmp_path / "e"),
                "--gate",
                str(tmp_path / "gate.txt"),
                "--json",
                str(tmp_path / "claims.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("megablu quick start (CPU): a parent at window 256, its YaRN x4 extension to window 1024")
    assert "  e@240: short-context gate passed" in out and out.rstrip().splitlines()[-1].startswith("In one line:")
    assert json.loads((tmp_path / "claims.json").read_text())["better_beyond"][0]["length"] == 992


def test_passkey_digits_variant():
    """`{family: passkey, digits: 1}`: 1-digit keys (0-9), seeded by its own task name; the built-in
    passkey keeps its 5-digit keys and prompts."""
    from megablu.config.eval_tasks import PRESETS, PasskeySpec
    from megablu.data.tokenizer import load_tokenizer, parse_tokenizer_spec
    from megablu.eval.passkey import PasskeyBuilder
    from megablu.eval.tasks import make_builder

    tok = load_tokenizer(parse_tokenizer_spec(TOK))
    one = make_builder("passkey_1digit", PasskeySpec(digits=1), tok, 0, 200, None)
    keys = [one.build(128, i).answer for i in range(200)]
    assert set(keys) == set("0123456789") and one.build(128, 0).task == "passkey_1digit"
    assert one.min_length() == PasskeyBuilder(tok, 0, 1).min_length() - 8  # the needle has the key twice
    five = make_builder("passkey", PRESETS["passkey"], tok, 0, 20, None)
    assert [five.build(200, i) for i in range(20)] == [PasskeyBuilder(tok, 0, 20).build(200, i) for i in range(20)]
    assert all(len(five.build(200, i).answer) == 5 for i in range(20))
    with pytest.raises(ValueError, match="digits"):  # pydantic's ValidationError
        PasskeySpec(digits=0)
