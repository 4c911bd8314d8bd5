"""bench/profile_step.py's pure parts: the kernel classes (from H200-style kernel names and the
ops around a launch), the profiler events -> activities linking, the busy/idle/gap arithmetic
on a timeline whose answers are known, the report writers, argument checks, and the whole
path at a toy shape on CPU (the GPU run is one call; this is its rehearsal)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import profile_step as ps  # noqa: E402

pytestmark = pytest.mark.bench

CUDNN_F = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0"
CUDNN_B = "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x64x64_4x1x1_kernel0_0"
NVJET = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT"
XMMA = (
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off"
    "_kernel__5x_cublas"
)
EVAL = "autograd::engine::evaluate_function: "

CASES = [
    # copies: by kind first
    ("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", (), "copy_h2d"),
    ("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", (), "copy_d2h"),
    ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", (), "copy_d2d"),
    ("Memset (Device)", "gpu_memset", (), "copy_d2d"),
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)"
        "::{lambda()#1}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >",
        "kernel",
        (),
        "copy_d2d",
    ),
    (
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, "
        "unsigned int, 2, 64, 64>",
        "kernel",
        ("aten::cat",),
        "copy_d2d",
    ),
    # attention: the launching op decides, the innermost attention op says fwd or bwd
    (
        CUDNN_F,
        "kernel",
        ("aten::_scaled_dot_product_cudnn_attention", "aten::scaled_dot_product_attention"),
        "attn_fwd",
    ),
    (
        CUDNN_B,
        "kernel",
        (
            "aten::_scaled_dot_product_cudnn_attention_backward",
            "ScaledDotProductCudnnAttentionBackward0",
            EVAL + "ScaledDotProductCudnnAttentionBackward0",
        ),
        "attn_bwd",
    ),
    (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::func_wrapper_t<float, "
        "at::native::sum_functor<c10::BFloat16, float, c10::BFloat16>::operator()(at::TensorIterator&)",
        "kernel",
        ("aten::sum", "ScaledDotProductCudnnAttentionBackward0", EVAL + "ScaledDotProductCudnnAttentionBackward0"),
        "attn_bwd",
    ),  # the GQA dk/dv sum beside the backward op is attention's cost
    (
        CUDNN_F,
        "kernel",
        (
            "aten::_scaled_dot_product_cudnn_attention",
            "aten::scaled_dot_product_attention",
            "CheckpointFunctionBackward",
            EVAL + "CheckpointFunctionBackward",
        ),
        "attn_fwd",
    ),  # a forward recomputed inside a checkpoint's backward stays a forward
    # attention by name when no op is known (flash, efficient, FlashAttention-4 / CuTe DSL)
    (CUDNN_F, "kernel", (), "attn_fwd"),
    (CUDNN_B, "kernel", (), "attn_bwd"),
    (
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t,"
        " Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false>"
        "(pytorch_flash::Flash_fwd_params)",
        "kernel",
        (),
        "attn_fwd",
    ),
    (
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, 4, 4,"
        " 4, false, false, cutlass::bfloat16_t>>",
        "kernel",
        (),
        "attn_bwd",
    ),
    ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<64>>", "kernel", (), "attn_bwd"),
    (
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)",
        "kernel",
        (),
        "attn_fwd",
    ),
    (
        "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<...>::Params)",
        "kernel",
        (),
        "attn_bwd",
    ),
    (
        "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__Tensorgmemo11",
        "kernel",
        (),
        "attn_fwd",
    ),
    (
        "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at__Tensorgmemo1",
        "kernel",
        ("FlashAttnFuncBackward", EVAL + "FlashAttnFuncBackward"),
        "attn_bwd",
    ),
    # GEMMs: cuBLASLt (nvjet on Hopper), cuBLAS xmma, CUTLASS, split-K reduction, or launched by aten::mm
    (NVJET, "kernel", ("aten::addmm", "aten::linear"), "gemm"),
    (XMMA, "kernel", (), "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>", "kernel", (), "gemm"),
    (
        "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>",
        "kernel",
        (),
        "gemm",
    ),
    ("some_vendor_kernel_without_hints", "kernel", ("aten::mm", "MmBackward0"), "gemm"),
    # the loss: anything inside the lm head's range or the loss Function's backward, its GEMMs too
    (NVJET, "kernel", ("aten::mm", "aten::matmul", "megablu::loss", "megablu::step"), "loss"),
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda>",
        "kernel",
        ("aten::exp", "megablu::loss"),
        "loss",
    ),
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_mul<c10::BFloat16>>",
        "kernel",
        ("aten::mul", "_ChunkedLinearCEBackward", EVAL + "_ChunkedLinearCEBackward"),
        "loss",
    ),
    # elementwise: megablu's csrc kernels, torch's elementwise/reduce kernels, Triton
    (
        "void megablu::(anonymous namespace)::rmsnorm_bwd_kernel<__nv_bfloat16, 8, 4>(megablu::(anonymous namespace)::"
        "RmsNormBwdArgs)",
        "kernel",
        (),
        "elementwise",
    ),
    (
        "void megablu::(anonymous namespace)::rope_kernel<__nv_bfloat16, 8>(megablu::(anonymous namespace)::RopeArgs)",
        "kernel",
        ("_RopeFn",),
        "elementwise",
    ),
    (
        "void megablu::(anonymous namespace)::swiglu_fwd_kernel<__nv_bfloat16, 8>(megablu::(anonymous namespace)::"
        "SwigluFwdArgs)",
        "kernel",
        (),
        "elementwise",
    ),
    (
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, "
        "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)",
        "kernel",
        ("aten::add_", "torch::autograd::AccumulateGrad"),
        "elementwise",
    ),
    ("triton_poi_fused_add_mul_0", "kernel", (), "elementwise"),
    (
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<1>, at::native::(anonymous namespace)::ZeroFunctor<float, 1, 1>>",
        "kernel",
        ("aten::_foreach_zero_",),
        "elementwise",
    ),
    ("unknown_kernel", "kernel", ("aten::mul",), "elementwise"),
    # the embedding and anything unmatched: other; the optimizer's fused kernels
    (
        "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>",
        "kernel",
        ("aten::index_select", "aten::embedding"),
        "other",
    ),
    (
        "void at::native::(anonymous namespace)::embedding_backward_feature_kernel<c10::BFloat16, float, long>",
        "kernel",
        ("aten::embedding_dense_backward", "EmbeddingBackward0"),
        "other",
    ),
    (
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
        "(at::native::ADAM_MODE)1, false>>",
        "kernel",
        ("aten::_fused_adamw_", "Optimizer.step#AdamW.step"),
        "optimizer",
    ),
    ("unknown_kernel", "kernel", (), "other"),
]


@pytest.mark.parametrize("name,kind,scopes,expected", CASES)
def test_classify(name, kind, scopes, expected):
    assert ps.classify(name, kind, scopes) == expected


def test_every_class_has_a_label_and_a_case():
    assert {c for c, _ in ps.CLASSES} == {e for *_, e in CASES}


# ---------------------------------------------------------------- fake kineto events


class Ev:
    """Stands in for torch's _KinetoEvent (the accessors profile_step reads)."""

    def __init__(self, name, dev, act, s_us, e_us, corr=0, linked=0, thread=1, stream=7, annotation=False):
        self._v = dict(
            name=name,
            device_type=f"DeviceType.{dev}",
            activity_type=act,
            start_ns=int(s_us * 1000),
            end_ns=int(e_us * 1000),
            correlation_id=corr,
            linked_correlation_id=linked,
            start_thread_id=thread,
            device_resource_id=stream,
            is_user_annotation=annotation,
        )

    def __getattr__(self, k):
        if k.startswith("_"):
            raise AttributeError(k)
        return lambda: self._v[k]


def cpu(name, s, e, corr, thread=1, act="cpu_op"):
    return Ev(name, "CPU", act, s, e, corr=corr, thread=thread, annotation=act == "user_annotation")


def gpu(name, s, e, linked, act="kernel", stream=7):
    return Ev(name, "CUDA", act, s, e, linked=linked, stream=stream)


def timeline():
    """A step in [0, 1000] us whose answers are worked out by hand in test_summarize."""
    return [
        cpu("megablu::step", 0, 1000, 1, act="user_annotation"),
        cpu("aten::linear", 10, 50, 2),
        cpu("aten::addmm", 12, 48, 3),
        Ev("cudaLaunchKernel", "CPU", "cuda_runtime", 13, 14, corr=50, linked=3),
        cpu("aten::scaled_dot_product_attention", 60, 100, 4),
        cpu("aten::_scaled_dot_product_cudnn_attention", 62, 98, 5),
        cpu("megablu::loss", 110, 200, 6, act="user_annotation"),
        cpu("aten::mm", 120, 150, 7),
        # the autograd engine's thread
        cpu(EVAL + "ScaledDotProductCudnnAttentionBackward0", 300, 400, 8, thread=2),
        cpu("ScaledDotProductCudnnAttentionBackward0", 301, 399, 9, thread=2),
        cpu("aten::_scaled_dot_product_cudnn_attention_backward", 302, 350, 10, thread=2),
        cpu("aten::sum", 351, 390, 11, thread=2),
        cpu(EVAL + "MmBackward0", 410, 500, 12, thread=2),
        cpu("aten::mm", 412, 490, 13, thread=2),
        # the GPU: compute stream 7, copy stream 9
        gpu(NVJET, 100, 200, 3),
        gpu(CUDNN_F, 200, 400, 5),
        gpu(XMMA, 420, 470, 7),
        gpu(CUDNN_B, 600, 800, 10),
        gpu("void at::native::reduce_kernel<512, 1, sum>", 800, 820, 11),
        gpu(NVJET, 830, 900, 13),
        gpu("Memcpy DtoH (Device -> Pinned)", 150, 350, 0, act="gpu_memcpy", stream=9),
        gpu("Memcpy HtoD (Pinned -> Device)", 900, 950, 0, act="gpu_memcpy", stream=9),
        gpu("triton_per_fused_0", 955, 960, 999),
        gpu("megablu::step", 100, 950, 0, act="gpu_user_annotation"),
    ]


def test_records_link_kernels_to_their_ops():
    acts, ranges, spans, stats = ps.records(timeline())
    assert ranges["megablu::step"] == [(0.0, 1000.0)] and "megablu::loss" in ranges
    assert "megablu::step" in spans  # the GPU-side annotation is a span, not a kernel
    assert len(acts) == 9 and stats["skipped_device_events"] == 0
    by = {(a.name, a.start): a for a in acts}
    assert by[(CUDNN_F, 200.0)].scopes == (
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::scaled_dot_product_attention",
        "megablu::step",
    )
    assert by[(CUDNN_F, 200.0)].scope_ids == (5, 4, 1)
    assert by[(XMMA, 420.0)].cls == "loss"
    assert by[(CUDNN_B, 600.0)].backward and not by[(CUDNN_F, 200.0)].backward
    assert by[("void at::native::reduce_kernel<512, 1, sum>", 800.0)].cls == "attn_bwd"
    assert by[("triton_per_fused_0", 955.0)].scopes == ()
    assert stats["linked_pct"] == pytest.approx(100 * (895 - 250 - 5) / 895)


def test_unlinked_kernel_inside_the_loss_span_on_the_gpu_is_loss():
    evs = [
        cpu("megablu::step", 0, 100, 1, act="user_annotation"),
        gpu("megablu::loss", 40, 60, 0, act="gpu_user_annotation"),
        gpu(NVJET, 45, 55, 0),
        gpu(NVJET, 70, 80, 0),
    ]
    acts, *_ = ps.records(evs)
    assert [a.cls for a in sorted(acts, key=lambda a: a.start)] == ["loss", "gemm"]


def test_summarize_known_timeline():
    acts, ranges, _, _ = ps.records(timeline())
    r = ps.summarize(acts, ranges["megablu::step"][0], T=1024, heads=2, head_dim=8, n_layers=1)
    c = {k: v["ms"] * 1e3 for k, v in r["classes"].items()}  # back to us
    assert c == pytest.approx(
        {
            "attn_fwd": 200,
            "attn_bwd": 220,
            "gemm": 170,
            "elementwise": 5,
            "copy_h2d": 50,
            "copy_d2h": 200,
            "copy_d2d": 0,
            "loss": 50,
            "optimizer": 0,
            "other": 0,
        }
    )
    g = r["gpu"]
    assert g["busy_ms"] * 1e3 == pytest.approx(695) and g["idle_ms"] * 1e3 == pytest.approx(305)
    assert g["concurrency_ms"] * 1e3 == pytest.approx(200)  # the DtoH copy under compute
    assert g["copy_exposed_ms"]["copy_d2h"] == pytest.approx(0)
    assert g["copy_exposed_ms"]["copy_h2d"] * 1e3 == pytest.approx(50)
    assert r["classes"]["attn_fwd"]["pct_wall"] == pytest.approx(20.0)
    assert g["compute_idle_ms"] * 1e3 == pytest.approx(355)  # the HtoD copy runs alone in [900, 950)
    gaps = r["gaps"]  # gaps between non-copy kernels
    assert gaps["count"] == 6
    assert {k: round(v[1] * 1e3) for k, v in gaps["buckets"].items()} == {
        "< 10 us": 0,
        "10-100 us": 125,
        "0.1-1 ms": 230,
        ">= 1 ms": 0,
    }
    assert {k: round(v * 1e3) for k, v in gaps["by_phase_ms"].items()} == {
        "head (before the first kernel)": 100,
        "forward": 75,
        "backward": 140,
        "tail (after the last kernel)": 40,
    }
    top = gaps["largest"][0]
    assert top["ms"] * 1e3 == pytest.approx(130) and top["phase"] == "backward"
    assert top["before"].startswith("sm90_xmma") and top["after"].startswith("cudnn_generated")
    ph = r["phases"]
    assert ph["forward"]["span_ms"] * 1e3 == pytest.approx(600) and ph["forward"]["idle_ms"] * 1e3 == pytest.approx(250)
    assert ph["backward"]["idle_ms"] * 1e3 == pytest.approx(55)
    assert ph["backward"]["compute_idle_ms"] * 1e3 == pytest.approx(105)
    a = r["attention"]
    assert a["fwd_calls"] == 1 and a["bwd_calls"] == 1  # the GQA sum does not count as a second call
    fl = 2.0 * 1024 * 1024 * 2 * 8
    assert a["fwd_tflops"] == pytest.approx(fl / 200e-6 / 1e12)
    assert a["bwd_tflops"] == pytest.approx(2 * fl / 220e-6 / 1e12)
    assert a["fwd_bwd_tflops"] == pytest.approx(3 * fl / 420e-6 / 1e12)
    assert a["bwd_tflops_fa"] == pytest.approx(2.5 * fl / 220e-6 / 1e12)
    top = {k["name"]: (k["count"], round(k["ms"] * 1e3)) for k in r["top_kernels"]}
    assert len(top) == 8 and top[NVJET] == (2, 170) and top[CUDNN_F] == (1, 200)
    assert r["top_kernels"][0]["ms"] * 1e3 == pytest.approx(200) and r["top_kernels"][3]["name"] == NVJET


def test_window_clips_activity():
    acts = [ps.Act("k", -50, 50, cls="gemm"), ps.Act("k", 90, 150, cls="gemm")]
    r = ps.summarize(acts, (0, 100))
    assert r["classes"]["gemm"]["ms"] * 1e3 == pytest.approx(60)
    assert r["gpu"]["idle_ms"] * 1e3 == pytest.approx(40)


def test_interval_helpers():
    assert ps.union([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    assert ps.minus([(0, 10), (20, 30)], [(2, 4), (8, 22), (25, 26)]) == [(0, 2), (4, 8), (22, 25), (26, 30)]
    assert ps.overlap([(0, 10), (20, 30)], 5, 25) == 10
    assert ps.attention_flops(2048, 16, 64)["fwd"] == 2 * 2048**2 * 16 * 64


# ---------------------------------------------------------------- reports, arguments


def _case(T, mode, **kw):
    acts, ranges, _, stats = ps.records(timeline())
    r = {
        "T": T,
        "mode": mode,
        "ops": "cuda",
        "loss_chunk": 4096,
        "n_layers": 36,
        "profile_stats": stats,
        "step": {
            "timed_s": [1.0, 1.1],
            "timed_median_s": 1.0,
            "warmup_s": 2.0,
            "tokens_per_s": T / 1.0,
            "mfu": 0.36,
            "peak_gb": 8.0,
        },
        "profile": ps.summarize(acts, ranges["megablu::step"][0], T, 16, 64, 36),
        "micro": {
            "kernel_fwd_bwd_tflops": 400.0,
            "kernel_fwd_tflops": 500.0,
            "kernel_bwd_tflops": 350.0,
            "fwd_tflops": 480.0,
            "fwd_bwd_tflops": 390.0,
            "reps": 5,
            "kernels": [CUDNN_F, CUDNN_B],
        },
        "profiler_table": "----\nName  Self CUDA\n----",
    }
    r.update(kw)
    return r


def test_markdown_writers(tmp_path):
    ok = _case(32768, "selective+offload")
    md = ps.case_markdown(ok)
    for label in (
        "attention fwd",
        "copy HtoD (offload fetch)",
        "**GPU idle**",
        "In-model / microbenchmark",
        "Top 8 kernels",
        "largest gaps",
        "torch.profiler key_averages",
    ):
        assert label in md, label
    assert "| loss (lm head + chunked CE) | 0.1 |" in md
    skipped = {"T": 131072, "mode": "selective", "skipped": "budget: 3 s left, the case needs ~40 s"}
    failed = {"T": 131072, "mode": "selective+offload", "error": "OOM: OutOfMemoryError: CUDA out of memory"}
    assert "skipped: budget" in ps.case_markdown(skipped) and "FAILED: OOM" in ps.case_markdown(failed)
    files = []
    for r in (ok, _case(32768, "selective"), skipped, failed):
        p = ps.case_path(tmp_path, r["T"], r["mode"])
        ps.write_json(p, r)
        files.append(str(p))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "profile_131072_selective-offload.json",
        "profile_131072_selective.json",
        "profile_32768_selective-offload.json",
        "profile_32768_selective.json",
    ]
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/profile_step.py"), "--summarize", *files, str(tmp_path / "absent.json")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| ms (% of step wall) | T=32k selective | T=32k selective+offload |" in out.stdout
    assert "| **GPU idle** | 0.3 (30.5%) | 0.3 (30.5%) |" in out.stdout
    assert "T=131072 selective: budget" in out.stdout and "FAILED: OOM" in out.stdout
    assert ps.summary_markdown([skipped]).startswith("no profiled case completed")


def test_file_names_are_what_the_device_tool_returns():
    import re

    for mode in ("selective", "selective+offload", "full+tiles16+offload"):
        assert re.fullmatch(r"[A-Za-z0-9._-]+", ps.case_path(Path("."), 32768, mode).name)


@pytest.mark.parametrize(
    "argv", [["--modes", "selective+bogus"], ["--T", "0"], ["--modes", ","], ["--micro-reps", "0"], ["--timed", "-1"]]
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        ps.parse_args(argv)


def test_arguments():
    a = ps.parse_args(["--T", "131072", "--modes", "selective+offload,selective", "--timed", "0", "--budget-s", "90"])
    assert a.mode_list == ["selective+offload", "selective"] and a.timed == 0 and a.budget_s == 90
    assert ps.estimate_case_s(131072, 0) > ps.estimate_case_s(32768, 2)


FUSED = "selective+offload+fuseqkv+fusegu+fuseadd"


def test_cpu_rehearsal_of_the_whole_path(tmp_path):
    """The GPU path (train_bench's build and step, the SDPA micro, the profiler, the linking, the
    JSON and markdown) at 2 layers, d=64, T=256 on CPU, leaf CPU ops standing in for kernels; a mode with
    the fusions (memory.fuse_*) beside the plain one."""
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench/profile_step.py"),
            "--rehearse-cpu",
            "--out",
            str(tmp_path),
            "--micro-reps",
            "1",
            "--timed",
            "1",
            "--modes",
            f"selective+offload,selective,{FUSED}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {}
    for mode in ("selective-offload", "selective", ps.mode_fs(FUSED)):
        rows[mode] = row = json.loads((tmp_path / f"profile_256_{mode}.json").read_text())
        assert "error" not in row, row.get("error")
        p = row["profile"]
        assert row["profile_stats"]["linked_pct"] == pytest.approx(100)
        assert p["classes"]["gemm"]["count"] > 0 and p["classes"]["loss"]["count"] > 0
        assert p["classes"]["attn_fwd"]["count"] > 0 and p["classes"]["attn_bwd"]["count"] > 0
        assert p["attention"]["fwd_calls"] == 2 and p["attention"]["bwd_calls"] == 2  # 2 layers, selective
        assert p["gpu"]["busy_ms"] + p["gpu"]["idle_ms"] == pytest.approx(p["wall_ms"])
        assert row["micro"]["kernel_fwd_ms"] > 0
    assert "### T=256, selective+offload" in r.stdout and f"### T=256, {FUSED}" in r.stdout
    # the fusions ran: per layer q/k/v 2 GEMMs forward and backward fewer + 4 backward, gate/up 1 fewer in the
    # forward and in selective's recompute + 2 backward: 10 a layer, 2 layers
    gemms = {m: row["profile"]["classes"]["gemm"]["count"] for m, row in rows.items()}
    assert gemms["selective-offload"] - gemms[ps.mode_fs(FUSED)] == 20, gemms


def _this_python():
    """PATH for a device script's rehearsal: its `python`, `python3` and `deepspeed` are this test's
    interpreter and its environment's launcher, not whichever Python the shell finds first."""
    import os

    return {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("os").environ.get("MEGABLU_SLOW") != "1",
    reason="the device script's CPU rehearsal (~10-40 s): MEGABLU_SLOW=1",
)
def test_h200_speed_script_rehearsal(tmp_path):
    """experiments/speed/speed.sh with REHEARSE_CPU=1: the call's order, the build marker, the deadlines,
    and what comes back (at most 8 files, names the device tool returns, the report's sections)."""
    import os
    import re

    out, work = tmp_path / "out", tmp_path / "work"
    r = subprocess.run(
        ["bash", str(ROOT / "experiments/speed/speed.sh")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={
            **os.environ,
            "REHEARSE_CPU": "1",
            "OUT": str(out),
            "WORK": str(work),
            "DS_ACCELERATOR": "cpu",
            **_this_python(),
        },
    )
    assert r.returncode == 0, r.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert len(names) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names), names
    assert {
        "speed.md",
        "loss_bench.json",
        "logs.tar.gz",
        "profile_256_selective-offload.json",
        "profile_384_selective.json",
    } <= set(names)
    timeline = [ln.split("\t") for ln in (work / "timeline.tsv").read_text().splitlines()]
    assert [t[0] for t in timeline] == ["build", "loss", "prof32k", "prof128k"] or [t[0] for t in timeline] == [
        "loss",
        "build",
        "prof32k",
        "prof128k",
    ]
    assert all(t[3] == "0" for t in timeline), timeline
    md = (out / "speed.md").read_text()
    for section in (
        "## Where a step's time goes",
        "## Loss through the lm head",
        "ended).",
        "### T=384, selective",
        "## Timeline",
    ):
        assert section in md, section


def test_modes_name_the_kernel_choices():
    import train_bench as tb

    assert tb.parse_mode("selective+offload+liger+fa4") == {
        "recompute": "selective",
        "mlp_tiles": 1,
        "offload_activations": True,
        "loss": "liger",
        "attention": "fa4",
    }
    assert tb.parse_mode("full+tiles4")["loss"] == "chunked" and tb.parse_mode("none")["attention"] == "sdpa"
    assert tb.parse_mode("selective+offload+keep12+fa4")["offload_keep"] == 12
    assert tb.parse_mode("selective+offload+frac0.75+fa4")["offload_fraction"] == 0.75
    assert tb.parse_mode("selective+liger+lchunk2048")["loss_chunk"] == 2048
    assert "loss_chunk" not in tb.parse_mode("selective+liger")  # --loss-chunk applies
    assert tb.memory_fields("selective+liger", 4096)["loss_chunk"] == 4096
    assert tb.memory_fields("selective+liger+lchunk0", 4096)["loss_chunk"] == 0
    with pytest.raises(ValueError, match="unknown flag 'fa3'"):
        tb.parse_mode("selective+fa3")
    fused = tb.parse_mode("selective+offload+frac0.75+liger+fa4+lchunk4096+fuseqkv+fusegu+fuseadd")
    assert fused["fuse_qkv"] and fused["fuse_gate_up"] and fused["fuse_block_add"]
    assert tb.parse_mode("selective+fuseqkv").keys() == tb.parse_mode("selective").keys() | {"fuse_qkv"}
    assert tb.parse_mode("full+fuseqkv+fusegu")["fuse_gate_up"]
    with pytest.raises(ValueError, match="fuseadd with full recompute"):
        tb.parse_mode("full+fuseadd")
    assert ps.mode_fs("selective+offload+liger+fa4") == "selective-offload-liger-fa4"


def test_gains_against_the_baseline_mode():
    def row(T, mode, tps, **kw):
        return {
            "T": T,
            "mode": mode,
            "step": {"tokens_per_s": tps, "peak_gb": 20.0, "mfu": 0.36, "warmup_s": 3.0, **kw},
            "profile": {"attention": {"fwd_bwd_tflops": 480.0}, "classes": {"loss": {"ms": 45.0}}},
        }

    rows = [
        row(32768, "selective+offload+liger+fa4", 44000.0),
        row(32768, "selective+offload", 34000.0),
        {"T": 32768, "mode": "selective+offload+fa4", "error": "RuntimeError: memory.attention=fa4: x | y"},
        row(131072, "selective+offload+liger+fa4", 14000.0, profiled_only=True),
        {"T": 131072, "mode": "selective+offload", "skipped": "budget: 3 s left"},
    ]
    md = ps.gains_markdown(rows, "selective+offload").splitlines()
    assert md[2] == "| 32768 | selective+offload | 34000 | 1.00x | 20.0 | 36% | 3.0 | 480 | 45.0 |"
    assert md[3].startswith("| 32768 | selective+offload+fa4 | FAILED: RuntimeError: memory.attention=fa4: x / y |")
    assert md[4] == "| 32768 | selective+offload+liger+fa4 | 44000 | 1.29x | 20.0 | 36% | 3.0 | 480 | 45.0 |"
    assert md[5].startswith("| 131072 | selective+offload | budget: 3 s left |")
    assert md[6].startswith("| 131072 | selective+offload+liger+fa4 | 14000* | - |")  # no baseline at 128k


def test_h200_speed_script_rehearsal_needs_torch(tmp_path):
    """REHEARSE_CPU=1 under a `python` without torch stops at once with the fix, rather than running every
    part into its log and returning an empty report with exit 0."""
    import os

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text("#!/bin/sh\nexit 1\n")
    (fake / "python").chmod(0o755)
    out, work = tmp_path / "out", tmp_path / "work"
    r = subprocess.run(
        ["bash", str(ROOT / "experiments/speed/speed.sh")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "REHEARSE_CPU": "1", "OUT": str(out), "WORK": str(work), "PATH": f"{fake}:/usr/bin:/bin"},
        timeout=60,
    )
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert f"python ({fake / 'python'}) cannot import torch" in r.stderr and "PATH=.venv/bin:$PATH" in r.stderr
    assert (work / "timeline.tsv").read_text() == ""  # no part ran


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("os").environ.get("MEGABLU_SLOW") != "1",
    reason="the device script's CPU rehearsal (~30 s): MEGABLU_SLOW=1",
)
def test_h200_kernels_script_rehearsal(tmp_path):
    """experiments/speed/kernels.sh with REHEARSE_CPU=1, both phases: the order, the deadlines, what comes
    back (at most 8 files, names the device tool returns), the report's sections; the fa4 cases end
    in their clear CPU error and the call goes on."""
    import os
    import re

    env = {
        **os.environ,
        "REHEARSE_CPU": "1",
        "DS_ACCELERATOR": "cpu",
        "FA4_DIR": str(tmp_path / "fa4"),
        **_this_python(),
    }
    out1, out = tmp_path / "out1", tmp_path / "out"
    r = subprocess.run(
        ["bash", str(ROOT / "experiments/speed/kernels.sh")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "PHASE": "1", "OUT": str(out1), "WORK": str(tmp_path / "w1")},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p.name for p in out1.iterdir()] == ["phase1.txt"]
    r = subprocess.run(
        ["bash", str(ROOT / "experiments/speed/kernels.sh")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "PHASE": "2", "BUDGET_S": "400", "OUT": str(out), "WORK": str(tmp_path / "w")},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert len(names) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names), names
    assert {"kernels.md", "tests.xml", "versions.txt", "profiles.tar.gz", "logs.tar.gz"} <= set(names)
    timeline = [ln.split("\t") for ln in (tmp_path / "w" / "timeline.tsv").read_text().splitlines()]
    assert [t[0] for t in timeline][:3] == ["tests", "prof32k", "prof128k"]
    assert all(t[3] == "0" for t in timeline), timeline
    md = (out / "kernels.md").read_text()
    for section in (
        "## GPU tests",
        "| T | mode | tokens/s | x selective+offload |",
        "| 256 | selective+offload | ",
        "selective+offload+fa4 | FAILED: RuntimeError: memory.attention=fa4: the tensors are on cpu",
        "## Timeline",
    ):
        assert section in md, section
    assert re.search(r"\d+ passed", md) and " failed" not in md


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("os").environ.get("MEGABLU_SLOW") != "1",
    reason="the device script's CPU rehearsal (~25 s): MEGABLU_SLOW=1",
)
def test_h200_entry32k_script_rehearsal(tmp_path):
    """experiments/speed/entry32k.sh with REHEARSE_CPU=1: data build, the real entry with the switches' overrides,
    and the report line from metrics.csv and probe.json (what ran: loss and attention kernels)."""
    import os

    out, work = tmp_path / "out", tmp_path / "work"
    r = subprocess.run(
        ["bash", str(ROOT / "experiments/speed/entry32k.sh")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={
            **os.environ,
            **_this_python(),
            "REHEARSE_CPU": "1",
            "OUT": str(out),
            "WORK": str(work),
            "STEPS": "6",
            "PROFILE_STEP": "5",
        },
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    md = (out / "entry32k.md").read_text()
    assert "entry exit 0" in md, md
    assert (
        "entry: 6 steps, median tokens/s over 1 steps from step 4 (step 5 profiled; it and the steps after it "
        "left out):" in md
    )
    assert "after the profiled step: median tokens/s " in md and " over 1 steps" in md
    assert "| optimizer_step | 1 |" in (out / "step_5.md").read_text()  # train.profile_step's phase table
    assert "loss chunked (config auto), attention sdpa (config auto)" in md
    assert (out / "metrics.csv").read_text().count("\n") == 7 and (out / "probe.json").is_file()
    # ENTRY_SETS reach the entry (its resolved config), and the log line says which ran
    r = subprocess.run(
        ["bash", str(ROOT / "experiments/speed/entry32k.sh")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={
            **os.environ,
            **_this_python(),
            "REHEARSE_CPU": "1",
            "OUT": str(out / "stock"),
            "WORK": str(work / "stock"),
            "STEPS": "5",
            "PROFILE_STEP": "0",
            "ENTRY_SETS": "train.fused_grad_check=false",
            "NO_BENCH": "1",
        },
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "5 steps, train.fused_grad_check=false" in (out / "stock" / "entry32k.md").read_text()
    resolved = next((work / "stock" / "runs").glob("*/config.resolved.yaml")).read_text()
    assert "fused_grad_check: false" in resolved, resolved


def test_issue43_script_rehearsal(tmp_path):
    """experiments/speed/issue43.sh with REHEARSE_CPU=1: the tests, megablu's base with each fusion alone and all
    three at the first T, base and all at the second, the peer at each T with sdpa (its CPU equality check) and
    fa4 (stops with its reason here, the call goes on); what comes back (<= 8 files) and the report."""
    import os
    import re

    out, work = tmp_path / "out", tmp_path / "w"
    r = subprocess.run(
        ["bash", str(ROOT / "experiments/speed/issue43.sh")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={
            **os.environ,
            **_this_python(),
            "REHEARSE_CPU": "1",
            "BUDGET_S": "400",
            "OUT": str(out),
            "WORK": str(work),
        },
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["issue43.md", "logs.tar.gz", "profiles.tar.gz", "tests.xml", "versions.txt"], names
    timeline = [ln.split("\t") for ln in (work / "timeline.tsv").read_text().splitlines()]
    parts = ["tests", "prof32k", "peer32k_sdpa", "peer32k_fa4", "prof128k", "peer128k_sdpa", "peer128k_fa4"]
    assert [t[0] for t in timeline] == parts
    assert {t[0]: t[3] for t in timeline} == {**dict.fromkeys(parts, "0"), "peer32k_fa4": "2", "peer128k_fa4": "2"}
    md = (out / "issue43.md").read_text()
    for mode in ("fuseqkv", "fusegu", "fuseadd", "fuseqkv+fusegu+fuseadd"):
        assert re.search(rf"\| 256 \| selective\+offload\+{re.escape(mode)} \| \d", md), mode
    assert re.search(r"\| 384 \| selective\+fuseqkv\+fusegu\+fuseadd \| \d", md)
    assert md.count("alst peer == plain HF") == 2
    assert md.count("alst_peer.py --attention fa4:") == 2  # the reason, in place of a table
    assert "## megablu / peer, tokens/s" in md and "| 256 | selective+offload | " in md


def test_issue43_ratio_pairs_each_megablu_mode_with_each_peer_at_its_T(tmp_path):
    sys.path.insert(0, str(ROOT / "experiments" / "speed"))
    import issue43_ratio

    prof, logs = tmp_path / "prof", tmp_path / "logs"
    prof.mkdir(), logs.mkdir()
    for T, mode, tps in [(32768, "base", 40000.0), (32768, "base+fuseadd", 41000.0), (131072, "base", 14000.0)]:
        row = {"T": T, "mode": mode, "step": {"tokens_per_s": tps, "peak_gb": 8.0}}
        (prof / f"profile_{T}_{mode}.json").write_text(json.dumps(row))
    (prof / "profile_131072_broken.json").write_text(json.dumps({"T": 131072, "mode": "broken", "error": "OOM"}))
    peer = [{"impl": "alst+fa4", "T": 32768, "tokens_per_s": 25000.0, "peak_gb": 8.3}]
    (logs / "peer32k_fa4.err").write_text("a warning\n" + "\n".join(json.dumps(p) for p in peer) + "\n")
    md = issue43_ratio.table(issue43_ratio.megablu_rows(prof), issue43_ratio.peer_rows(logs))
    assert "| 32768 | base | 40,000 | 8.0 | alst+fa4 | 25,000 | 8.3 | **1.60x** |" in md
    assert "| 32768 | base+fuseadd | 41,000 | 8.0 | alst+fa4 | 25,000 | 8.3 | **1.64x** |" in md
    assert "| 131072 | base | 14,000 | 8.0 | (no peer row) | | | |" in md
    assert "broken" not in md
