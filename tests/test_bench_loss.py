"""bench/loss_bench.py's CPU-checkable parts: the fp32 reference is the loss and the gradients
of the summed CE (against float64 autograd), the error measures and tolerances, megablu's
chunked loss through the bench's own path, a library that is not importable becomes a row,
the markdown table, and argument checks."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import loss_bench as lb  # noqa: E402

pytestmark = pytest.mark.bench


@pytest.mark.parametrize("chunk", [7, 4096])
def test_reference_is_the_summed_ce_and_its_gradients(chunk):
    h, W, y = lb.make_inputs(37, 16, 53, 2.0, "cpu", seed=3)
    y[5] = lb.IGNORE_INDEX
    h64, W64 = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    ref = F.cross_entropy(h64 @ W64.t(), y, ignore_index=lb.IGNORE_INDEX, reduction="sum")
    ref.backward()
    loss, dh, dW = lb.reference(h, W, y, chunk=chunk)
    assert float(loss) == pytest.approx(float(ref.detach()), rel=1e-6)
    assert torch.allclose(dh.double(), h64.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(dW.double(), W64.grad, rtol=1e-5, atol=1e-6)
    assert dh[5].abs().max() == 0  # an ignored token gets no gradient


def test_inputs_have_the_asked_logit_scale():
    h, W, y = lb.make_inputs(512, 256, 1000, 2.0, "cpu")
    assert h.dtype == W.dtype == torch.bfloat16 and h.requires_grad and W.requires_grad
    assert float((h.detach().float() @ W.detach().float().t()).std()) == pytest.approx(2.0, rel=0.05)
    assert 0 <= int(y.min()) and int(y.max()) < 1000


def test_errors_and_tolerances():
    ref = (torch.tensor(100.0, dtype=torch.float64), torch.ones(4, 3), torch.ones(5, 3))
    exact = lb.errors(torch.tensor(100.0), torch.ones(4, 3, dtype=torch.bfloat16), torch.ones(5, 3), ref)
    assert exact["loss_rel"] == 0 and exact["dh_rel_fro"] == 0 and exact["within_tol"]
    off = lb.errors(torch.tensor(100.0), torch.ones(4, 3) * 1.02, torch.ones(5, 3), ref)
    assert off["dh_rel_fro"] == pytest.approx(0.02, rel=1e-5) and off["dh_max_abs"] == pytest.approx(0.02, rel=1e-4)
    assert not off["within_tol"]  # 2% > TOL_GRAD_REL
    lossy = lb.errors(torch.tensor(100.0 * (1 + 2 * lb.TOL_LOSS_REL)), torch.ones(4, 3), torch.ones(5, 3), ref)
    assert not lossy["within_tol"]
    assert not lb.errors(torch.tensor(100.0), None, torch.ones(5, 3), ref)["within_tol"]


def test_megablu_row_through_the_bench_and_missing_libraries(tmp_path, monkeypatch):
    """The CPU run of the bench's own path (exactness, timing, JSON); a library that is absent
    here (CI has neither Liger nor CCE) is a row that says so."""
    real = lb.make_impl

    def no_libs(name, chunk):
        if name != "megablu":
            raise ImportError(f"No module named {name!r} (test)")
        return real(name, chunk)

    monkeypatch.setattr(lb, "make_impl", no_libs)
    assert (
        lb.main(
            [
                "--device",
                "cpu",
                "--T",
                "256,96",
                "--d",
                "32",
                "--V",
                "300",
                "--iters",
                "1",
                "--megablu-chunk",
                "64",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    res = json.loads((tmp_path / "loss_bench.json").read_text())
    rows = {(r["T"], r["impl"]): r for r in res["rows"]}
    assert set(rows) == {(T, i) for T in (256, 96) for i in lb.IMPLS}
    m = rows[(256, "megablu")]
    assert m["fwd_bwd_ms"] > 0 and m["within_tol"], m
    assert m["dh_rel_fro"] < 5e-3 and m["dW_rel_fro"] < 5e-3  # bf16 roundings, far inside 1e-2
    assert rows[(96, "cce")]["error"].startswith("not importable: ImportError")
    assert res["meta"]["tolerances"] == {"loss_rel": lb.TOL_LOSS_REL, "grad_rel_fro": lb.TOL_GRAD_REL}
    md = lb.render(res)
    assert "| 256 | megablu |" in md and "not importable" in md and "perf_counter" in md


def test_render_compares_with_megablu():
    res = {
        "meta": {"d": 1024, "V": 100352, "iters": 5, "wait": {"waited_s": 12.0, "marker_seen": True}},
        "rows": [
            {
                "T": 32768,
                "impl": "megablu",
                "fwd_ms": 30.0,
                "fwd_bwd_ms": 40.0,
                "loss_rel": 1e-6,
                "dh_rel_fro": 3e-3,
                "dW_rel_fro": 3e-3,
                "within_tol": True,
                "peak_gb_above_inputs": 2.5,
            },
            {
                "T": 32768,
                "impl": "cce",
                "fwd_ms": 10.0,
                "fwd_bwd_ms": 20.0,
                "loss_rel": 1e-7,
                "dh_rel_fro": 2e-2,
                "dW_rel_fro": 1e-3,
                "within_tol": False,
                "peak_gb_above_inputs": 0.3,
            },
            {"T": 131072, "impl": "liger", "skipped": "budget: 2 s left, T needs ~40 s"},
        ],
    }
    md = lb.render(res)
    assert "| 32768 | cce | 10.0 | 20.0 |" in md and "2.00x megablu's speed" in md and "**no**" in md
    assert "waited 12 s for the ops build" in md and "budget: 2 s left" in md


@pytest.mark.parametrize(
    "argv", [["--impls", "megablu,bogus"], ["--T", "32k"], ["--T", "0"], ["--iters", "0"], ["--V", "1"]]
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        lb.parse_args(argv)


def test_budget_skips_a_T_and_says_so(tmp_path):
    assert (
        lb.main(["--device", "cpu", "--T", "1048576", "--impls", "megablu", "--budget-s", "1", "--out", str(tmp_path)])
        == 0
    )
    rows = json.loads((tmp_path / "loss_bench.json").read_text())["rows"]
    assert rows == [{"T": 1048576, "impl": "megablu", "skipped": rows[0]["skipped"]}]
    assert rows[0]["skipped"].startswith("budget:")


def test_liger_through_the_bench_in_the_triton_interpreter(tmp_path):
    """Opt-in (MEGABLU_TRITON_INTERPRET_TESTS=1, with liger-kernel and triton importable; CI has
    neither): the bench's Liger calls run in Triton's CPU interpreter at a toy shape and agree
    with the fp32 reference. (Triton 3.6's interpreter needs numpy < 2 or a one-line fix of its
    tensor __index__ to run Liger's kernels.)"""
    import os

    if os.environ.get("MEGABLU_TRITON_INTERPRET_TESTS") != "1":
        pytest.skip("opt-in: MEGABLU_TRITON_INTERPRET_TESTS=1")
    pytest.importorskip("triton")
    pytest.importorskip("liger_kernel")
    import subprocess

    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench/loss_bench.py"),
            "--device",
            "cpu",
            "--T",
            "128",
            "--d",
            "32",
            "--V",
            "300",
            "--iters",
            "1",
            "--impls",
            "megablu,liger,liger_fp32acc",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "loss_bench.json").read_text())["rows"]
    for row in rows:
        assert "error" not in row and row["dh_rel_fro"] < 1e-2 and row["dW_rel_fro"] < 1e-2, row
