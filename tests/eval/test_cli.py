"""`megablu compare` and `megablu eval` as a user runs them: stdout is the table, logs on stderr,
exit 1 on a failed gate, 2 on invalid input; a real --ckpt and an HF --hf directory."""

import json
import re

import yaml

from megablu.cli import main
from megablu.config.schema import EvalConfig
from megablu.eval import cli as cli_module
from megablu.eval.report import make_result, write_result

from .conftest import tiny_model


def _res(arm, step, acc, n=50):
    cells = []
    for L, a in acc.items():
        k = round(a * n / 100)
        cells.append(
            {
                "task": "passkey",
                "length": L,
                "n": n,
                "correct": k,
                "acc_pp": 100 * k / n,
                "ci_pp": [0, 100],
                "padded_len": L,
                "digest": "d",
                "seconds": 0,
                "by_depth": [],
            }
        )
    samples = [{"task": "passkey", "length": L, "correct": True} for L in acc]
    return make_result(
        cells,
        samples,
        arm=arm,
        step=step,
        window=32768,
        eval_cfg=EvalConfig(lengths=list(acc)),
        tokenizer_identity="t",
        sp=1,
    )


def test_compare_table_plot_and_gate(tmp_path, capsys):
    write_result(_res("l2", 400, {1024: 90, 4096: 80, 16360: 36}), tmp_path / "l2" / "eval" / "step_400.json")
    write_result(_res("l2", 100, {1024: 10, 4096: 10, 16360: 10}), tmp_path / "l2" / "eval" / "step_100.json")
    write_result(_res("ext", 750, {1024: 90, 4096: 20, 16360: 60}), tmp_path / "ext.json")
    png = tmp_path / "cmp.png"
    rc = main(
        [
            "compare",
            str(tmp_path / "l2"),
            str(tmp_path / "ext.json"),
            "--plot",
            str(png),
            "--gate-parent",
            str(tmp_path / "l2@400"),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 1  # ext collapsed at 4096
    assert "| l2@400 | 90.0 | 80.0 | 36.0 |" in out  # a run dir means its latest step
    assert "| ext@750 | 90.0 | 20.0 | 60.0 |" in out
    # the samples carry no per-prompt index, so the cells are unpaired ('indep.'): Fisher's exact p, Holm over 3.
    # -60 (10/50 vs 40/50, p 2.2e-09) is starred; +24 (30/50 vs 18/50) has an interval that excludes 0 but
    # p = 0.027, 0.054 after Holm: no star
    assert "-60.0* [" in out and "+24.0 [+4.4, +41.2] p 0.027 adj 0.054 indep." in out
    assert "SHORT-CONTEXT GATE FAILED" in err and "passkey@4096" in err
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["compare", str(tmp_path / "l2@100"), str(tmp_path / "l2@400")]) == 0
    assert main(["compare", str(tmp_path / "missing")]) == 2


def _config(tmp_path, extra_eval=None):
    cfg = {
        "name": "tiny",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "vocab_size": 257},
        "rope": {"theta": 10000.0},
        "tokenizer": {"kind": "byte"},
        "data": {"window": 512},
        "train": {"max_steps": 10, "tokens_per_step": 512, "dtype": "fp32", "device": "cpu"},
        "schedule": {"kind": "cosine", "lr": 1e-3, "warmup_steps": 1},
        "eval": {"lengths": [300, 480], "n": 2, "max_new": 6, "pad": 32, **(extra_eval or {})},
    }
    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_eval_from_checkpoint_file(tmp_path, capsys):
    from safetensors.torch import save_file

    cfg = _config(tmp_path)
    ck = tmp_path / "step_5" / "model.safetensors"
    ck.parent.mkdir()
    save_file({k: v.contiguous() for k, v in tiny_model(seed=3).state_dict().items()}, str(ck))
    # a bare weights file records no rope: evaluating it with the config's is an explicit choice
    assert main(["eval", "--config", str(cfg), "--ckpt", str(ck)]) == 2
    assert "records no rope" in capsys.readouterr().err
    rc = main(["eval", "--config", str(cfg), "--ckpt", str(ck), "--rope-override"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "| tiny@5 | 0.0 | 0.0 |" in out
    res = json.loads((tmp_path / "runs" / "tiny" / "eval" / "step_5.json").read_text())
    assert res["step"] == 5 and [c["length"] for c in res["cells"]] == [300, 480]
    assert res["rope_override"]["differences"] == ["rope: not recorded"]


def test_eval_hf_dir_and_invalid_inputs(tmp_path, capsys):
    from megablu.model.hf import to_hf

    hf_dir = tmp_path / "hf"
    to_hf(tiny_model(seed=4), max_position=512).save_pretrained(str(hf_dir))
    cfg = _config(tmp_path)
    assert (
        main(
            [
                "eval",
                "--config",
                str(cfg),
                "--hf",
                str(hf_dir),
                "--step",
                "0",
                "--arm",
                "parent",
                "--out",
                str(tmp_path / "o"),
                "--no-plot",
            ]
        )
        == 0
    )
    assert (tmp_path / "o" / "step_0.json").exists()
    # gate against a parent that collapsed nothing: the arm (same weights) passes
    assert (
        main(
            [
                "eval",
                "--config",
                str(cfg),
                "--hf",
                str(hf_dir),
                "--step",
                "1",
                "--out",
                str(tmp_path / "o"),
                "--gate-parent",
                str(tmp_path / "o" / "step_0.json"),
                "--set",
                "eval.gate.short_lengths=[300]",
                "--no-plot",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["eval", "--config", str(cfg), "--ckpt", str(tmp_path / "nope.safetensors"), "--step", "1"]) == 2
    assert "cannot load weights" in capsys.readouterr().err
    assert main(["eval", "--config", str(cfg), "--hf", str(hf_dir), "--step", "1", "--lengths", "600"]) == 2
    assert "do not fit the window" in capsys.readouterr().err


def test_eval_applies_the_configs_memory_switches(tmp_path, capsys, monkeypatch):
    """memory.ops and memory.attention reach the evaluated model (megablu/eval/cli.py _eval_memory), and
    switches that cannot run on this device are refused before any weight loads (exit 2, the field and the
    fix): ops=cuda and attention=fa4 on CPU. ops=torch runs, on every module of the model; the
    training-only switches do not reach it."""
    from megablu.model.hf import to_hf

    hf_dir = tmp_path / "hf"
    to_hf(tiny_model(seed=4), max_position=512).save_pretrained(str(hf_dir))
    cfg = _config(tmp_path)
    run = ["eval", "--config", str(cfg), "--hf", str(hf_dir), "--step", "0", "--out", str(tmp_path / "o"), "--no-plot"]
    capsys.readouterr()
    assert main(run + ["--set", "memory.ops=cuda"]) == 2
    assert "memory.ops=cuda on a cpu eval" in capsys.readouterr().err
    assert main(run + ["--set", "memory.attention=fa4", "--set", "train.dtype=bf16"]) == 2
    assert "memory.attention=fa4 on a CPU run" in capsys.readouterr().err
    seen = {}
    real = cli_module._eval_memory

    def spy(memory):
        seen["memory"] = out = real(memory)
        return out

    import megablu.memory.apply as apply_module

    real_apply = apply_module.apply_memory

    def spy_apply(model, *a, **kw):
        out = real_apply(model, *a, **kw)
        seen["impls"] = {m.impl for m in out.modules() if hasattr(m, "impl")}
        return out

    monkeypatch.setattr(cli_module, "_eval_memory", spy)
    monkeypatch.setattr(apply_module, "apply_memory", spy_apply)
    assert (
        main(
            run
            + [
                "--set",
                "memory.ops=torch",
                "--set",
                "memory.recompute=full",
                "--set",
                "memory.mlp_tiles=2",
                "--set",
                "memory.offload_activations=true",
            ]
        )
        == 0
    ), capsys.readouterr().err
    m = seen["memory"]
    assert (m.ops, m.recompute, m.mlp_tiles, m.offload_activations) == ("torch", "none", 1, False)
    assert seen["impls"] == {"torch"}


def test_compare_joins_cells_measured_separately(tmp_path, capsys):
    write_result(_res("a", 1, {1024: 90}), tmp_path / "a1024.json")
    write_result(_res("a", 1, {4096: 70}), tmp_path / "a4096.json")
    write_result(_res("a", 1, {4096: 10}), tmp_path / "clash.json")
    assert main(["compare", str(tmp_path / "a1024.json"), str(tmp_path / "a4096.json")]) == 0
    assert "| a@1 | 90.0 | 70.0 | -10.0 [" in capsys.readouterr().out
    assert main(["compare", str(tmp_path / "a4096.json"), str(tmp_path / "clash.json")]) == 2
    assert "two different results for passkey@4096" in capsys.readouterr().err


def _ckpt_step(run, step, tokenizer):
    """A published checkpoint step as the trainer writes it (weights + self-checksummed manifest)."""
    from megablu.checkpoint import save_weights
    from megablu.checkpoint.layout import _manifest_digest
    from megablu.utils.files import sha256_file

    d = run / "checkpoints" / f"step_{step:07d}"
    d.mkdir(parents=True)
    save_weights({k: v.contiguous() for k, v in tiny_model(seed=3).state_dict().items()}, d / "model.safetensors")
    f = d / "model.safetensors"
    m = {
        "format": 1,
        "run_id": run.name,
        "step": step,
        "tokenizer": tokenizer,
        "zero_partitions": 0,
        "meta": {"rope": {"theta": 10000.0, "yarn": None}, "window": 512},
        "files": {"model.safetensors": {"size": f.stat().st_size, "sha256": sha256_file(f)}},
    }
    m["manifest_sha256"] = _manifest_digest(m)
    (d / "manifest.json").write_text(json.dumps(m))
    return d


def test_eval_of_a_run_checkpoint_checks_tokenizer_and_writes_into_the_run(tmp_path, capsys):
    """`megablu eval --ckpt runs/<id>/checkpoints/step_N`: results land in runs/<id>/eval/step_N.json
    under the run id (where the trainer's auto-eval writes, so compare merges them), and weights
    recorded with another tokenizer are refused (exit 2) instead of scoring garbage."""
    from megablu.data.tokenizer import ByteTokenizer

    cfg = _config(tmp_path)
    run = tmp_path / "runs" / "tiny-0003"
    step = _ckpt_step(run, 5, ByteTokenizer().identity)
    assert main(["eval", "--config", str(cfg), "--ckpt", str(step), "--no-plot"]) == 0
    assert "| tiny-0003@5 |" in capsys.readouterr().out
    assert json.loads((run / "eval" / "step_5.json").read_text())["arm"] == "tiny-0003"
    other = _ckpt_step(tmp_path / "runs" / "tiny-0004", 7, "tiktoken:cl100k_base:223921b76ee99bde")
    for path in (other, other / "model.safetensors", other.parents[1]):  # step dir, its file, the run dir
        assert main(["eval", "--config", str(cfg), "--ckpt", str(path), "--no-plot"]) == 2
        err = capsys.readouterr().err
        assert "weights trained with tokenizer 'tiktoken:cl100k_base:223921b76ee99bde'" in err
        assert ByteTokenizer().identity in err
    assert not (tmp_path / "runs" / "tiny-0004" / "eval").exists()


def test_eval_refuses_a_gate_parent_without_the_short_lengths(tmp_path, capsys):
    write_result(_res("l2", 400, {4096: 80, 8192: 62}), tmp_path / "l2.json")
    cfg = _config(tmp_path, {"gate": {"parent": str(tmp_path / "l2.json"), "short_lengths": [300]}})
    ck = tmp_path / "step_5" / "model.safetensors"
    ck.parent.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tiny_model(seed=3).state_dict().items()}, str(ck))
    assert main(["eval", "--config", str(cfg), "--ckpt", str(ck), "--no-plot", "--rope-override"]) == 2
    assert "has no result for passkey@300" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "tiny" / "eval" / "step_5.json").exists()  # nothing was generated


def test_eval_suite_per_length_runs_merge_in_compare_and_bad_input_exits_2(tmp_path, capsys, haystack_docs):
    """How experiments/ruler_baselines/run.sh runs it: `megablu eval --tasks ... --lengths L` once per length into
    its own dir (with the held-out loss), then `megablu compare` over the dirs joins the lengths
    of one arm, cells and loss alike. Bad input exits 2 before any weight is loaded."""
    import numpy as np

    from megablu.data.shards import DatasetWriter
    from megablu.data.tokenizer import ByteTokenizer
    from megablu.model.hf import to_hf

    tok = ByteTokenizer()
    ds = tmp_path / "ds"
    meta = {"identity": tok.identity, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id}
    text = "\n".join(haystack_docs)
    with DatasetWriter(ds, meta, edges=(1024, 1 << 20)) as w:
        for i in range(6):
            w.add(
                np.asarray(tok.encode(text[i * 9000 : i * 9000 + (8000 if i < 3 else 700)]), dtype=np.int64),
                "val",
                {"source": "stdlib", "license": "PSF", "key": f"s/{i}"},
            )
        w.finish()
    hf_dir = tmp_path / "hf"
    to_hf(tiny_model(seed=4), max_position=512).save_pretrained(str(hf_dir))
    cfg = _config(tmp_path)
    base = [
        "eval",
        "--config",
        str(cfg),
        "--hf",
        str(hf_dir),
        "--step",
        "0",
        "--arm",
        "a",
        "--no-plot",
        "--set",
        "data.window=2048",
        "--set",
        f"eval.loss.data={ds}",
        "--set",
        "eval.loss.n=1",
        "--set",
        "eval.loss.short_min=500",
        "--set",
        "eval.loss.short_max=900",
        "--set",
        f"eval.haystack={ds}",
        "--tasks",
        "niah_single_1",
        "niah_single_2",
        "--n",
        "2",
    ]
    for L in (1100, 1500):
        assert main(base + ["--lengths", str(L), "--out", str(tmp_path / f"a_{L}")]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a_1100"), str(tmp_path / "a_1500")]) == 0
    out = capsys.readouterr().out
    assert "### niah_single_2" in out and "| a@0 | 0.0 | 0.0 |" in out
    assert "### held-out loss" in out
    assert re.search(r"\| a@0 \| [\d.]+ \([\d.]+\) \| [\d.]+ \([\d.]+\) \| [\d.]+ \(3 docs\) \|", out), out
    # bad input: exit 2 naming the task and the fix, before the (missing) weights are touched
    bad = [
        "eval",
        "--config",
        str(cfg),
        "--ckpt",
        str(tmp_path / "none.safetensors"),
        "--step",
        "1",
        "--set",
        "data.window=2048",
    ]
    assert main(bad + ["--tasks", "niah_single_7"]) == 2
    assert "unknown task(s) ['niah_single_7']; known tasks:" in capsys.readouterr().err
    assert main(bad + ["--tasks", "cwe", "--lengths", "900"]) == 2
    err = capsys.readouterr().err
    assert "[900] cannot hold task cwe" in err and "cannot load weights" not in err
    assert main(bad + ["--tasks", "niah_single_2", "--lengths", "900"]) == 2
    assert "needs a real-text haystack" in capsys.readouterr().err


def test_eval_cut_short_goes_on_where_it_stopped_unless_no_resume(tmp_path, monkeypatch):
    """`megablu eval` keeps each finished cell (step_<N>.<key>.json.partial): rerun after a kill, it runs only
    the cells left; --no-resume runs them all and leaves the partial be."""
    import pytest

    import megablu.eval.harness as harness
    from megablu.model.hf import to_hf

    hf_dir = tmp_path / "hf"
    to_hf(tiny_model(seed=4), max_position=512).save_pretrained(str(hf_dir))
    out = tmp_path / "o"
    run = [
        "eval",
        "--config",
        str(_config(tmp_path)),
        "--hf",
        str(hf_dir),
        "--step",
        "0",
        "--out",
        str(out),
        "--no-plot",
    ]
    real, calls = harness.greedy_generate, []

    def gen(*a, **kw):
        calls.append(a[1].shape[1])
        if calls == [300, 480] and die:
            raise KeyboardInterrupt("killed")
        return real(*a, **kw)

    monkeypatch.setattr(harness, "greedy_generate", gen)
    for flags, kept in (([], ["passkey@300"]), (["--no-resume"], None)):
        die = True
        with pytest.raises(KeyboardInterrupt):
            main(run)
        assert list(out.glob("step_0.*.json.partial")) and not (out / "step_0.json").exists()
        die, calls[:] = False, []
        assert main(run + flags) == 0
        res = json.loads((out / "step_0.json").read_text())
        assert res.get("resumed") == kept and calls == ([480] if kept else [300, 480])
        assert bool(list(out.glob("step_0.*.json.partial"))) == (kept is None)  # --no-resume leaves it be
        (out / "step_0.json").unlink()
        calls[:] = []
