"""The CUDA kernels' own code, run on the CPU: csrc/*/ *_kernel.cu compiled by g++ with a
small CUDA host shim (tests/ops/emulator), called through ctypes, compared with the torch
references (fp64 ground truth) forward and backward.

This checks what a GPU-less machine can: index math, strides, every vector width and
vectors-per-lane instantiation, the warp reductions, the shared-memory dw reduction and
the rounding order. Timing and the real compiler's code generation are checked on the GPU
(test_rope/test_rmsnorm/test_swiglu and bench/ops_bench.py).
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megablu.ops.rope import rope_reference

from .helpers import assert_close

ROOT = Path(__file__).resolve().parents[2]
EMU = Path(__file__).resolve().parent / "emulator"
F32, BF16 = 0, 2
DT = {torch.float32: F32, torch.bfloat16: BF16}
P = ctypes.c_void_p
I64 = ctypes.c_int64


def _cuda_include():
    for home in ("/usr/local/cuda",):
        if (Path(home) / "include" / "cuda_bf16.h").is_file():
            return Path(home) / "include"
    nvcc = shutil.which("nvcc")
    if nvcc:
        inc = Path(nvcc).resolve().parents[1] / "include"
        if (inc / "cuda_bf16.h").is_file():
            return inc
    return None


def _build_emu(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    inc = _cuda_include()
    if cxx is None or inc is None:
        pytest.skip("needs g++ and the CUDA headers (cuda_bf16.h)")
    probe = tmp_path_factory.mktemp("probe") / "p.cpp"
    probe.write_text(
        "#include <barrier>\n#include <atomic>\nint main(){float f=0; std::atomic_ref<float>(f).fetch_add(1);}\n"
    )
    if (
        subprocess.run(
            [cxx, "-std=c++20", "-pthread", str(probe), "-o", str(probe.with_suffix(""))], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip(f"{cxx} lacks C++20 <barrier>/atomic_ref (g++ >= 11 needed)")
    srcs = sorted([*(ROOT / "csrc").glob("*/*_kernel.cu"), *(ROOT / "csrc/includes").glob("*"), *EMU.glob("*")])
    tag = hashlib.sha256(b"".join(p.read_bytes() for p in srcs)).hexdigest()[:12]
    # a build artifact keyed by the sources' hash: reused across runs (5 s of g++ saved)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megablu" / "emulator"
    so = cache / f"megablu_emu_{tag}.so"
    if not so.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = tmp_path_factory.mktemp("emu") / so.name
        cmd = [
            cxx,
            "-std=c++20",
            "-O1",
            "-shared",
            "-fPIC",
            "-pthread",
            f"-I{ROOT / 'csrc/includes'}",
            f"-I{inc}",
            str(EMU / "emulator.cpp"),
            "-o",
            str(tmp),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        os.replace(tmp, so) if tmp.stat().st_dev == cache.stat().st_dev else shutil.copy(tmp, so)
    return ctypes.CDLL(str(so))


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return _build_emu(tmp_path_factory)


class RopeArgs(ctypes.Structure):
    _fields_ = (
        [(n, P) for n in ("q", "k", "out_q", "out_k", "cos", "sin")]
        + [
            (n, I64)
            for n in (
                "B",
                "T",
                "H",
                "Hkv",
                "D",
                "q_sb",
                "q_st",
                "q_sh",
                "k_sb",
                "k_st",
                "k_sh",
                "c_sb",
                "c_st",
                "s_sb",
                "s_st",
            )
        ]
        + [("dtype", ctypes.c_int), ("table_f32", ctypes.c_bool), ("vec", ctypes.c_int), ("backward", ctypes.c_bool)]
    )


class RmsFwdArgs(ctypes.Structure):
    _fields_ = [(n, P) for n in ("x", "residual", "weight", "y", "r_out", "rstd")] + [
        ("rows", I64),
        ("d", I64),
        ("eps", ctypes.c_float),
        ("dtype", ctypes.c_int),
        ("vec", ctypes.c_int),
        ("vpt", ctypes.c_int),
    ]


class RmsBwdArgs(ctypes.Structure):
    _fields_ = [(n, P) for n in ("gy", "g_res", "r", "weight", "rstd", "dr", "dw_partial")] + [
        ("rows", I64),
        ("d", I64),
        ("blocks", ctypes.c_int),
        ("dtype", ctypes.c_int),
        ("vec", ctypes.c_int),
        ("vpt", ctypes.c_int),
        ("async_stages", ctypes.c_bool),
    ]


class SwFwdArgs(ctypes.Structure):
    _fields_ = (
        [(n, P) for n in ("gate", "up", "out")]
        + [(n, I64) for n in ("rows", "cols", "gate_rs", "up_rs")]
        + [("dtype", ctypes.c_int), ("vec", ctypes.c_int)]
    )


class SwBwdArgs(ctypes.Structure):
    _fields_ = (
        [(n, P) for n in ("grad", "gate", "up", "d_gate", "d_up")]
        + [(n, I64) for n in ("rows", "cols", "grad_rs", "gate_rs", "up_rs", "dgate_rs", "dup_rs")]
        + [("dtype", ctypes.c_int), ("vec", ctypes.c_int)]
    )


def _rand(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def _st(t, i):
    return 0 if t.shape[i] == 1 else t.stride(i)


# --------------------------------------------------------------------------- RoPE
def _rope_emu(emu, q, k, cos, sin, vec, backward):
    oq, ok = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    a = RopeArgs(
        q.data_ptr(),
        k.data_ptr(),
        oq.data_ptr(),
        ok.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        *q.shape[:3],
        k.shape[2],
        q.shape[3],
        _st(q, 0),
        _st(q, 1),
        _st(q, 2),
        _st(k, 0),
        _st(k, 1),
        _st(k, 2),
        _st(cos, 0),
        _st(cos, 1),
        _st(sin, 0),
        _st(sin, 1),
        DT[q.dtype],
        cos.dtype == torch.float32 and q.dtype != torch.float32,
        vec,
        backward,
    )
    assert emu.emu_rope(ctypes.byref(a)) == 0
    return oq, ok


@pytest.mark.parametrize(
    "dtype,vec,table",
    [
        (torch.bfloat16, 8, "same"),
        (torch.bfloat16, 4, "same"),
        (torch.bfloat16, 2, "same"),
        (torch.bfloat16, 1, "same"),
        (torch.bfloat16, 8, "f32"),
        (torch.float32, 4, "same"),
        (torch.float32, 1, "same"),
    ],
)
def test_rope_kernel(emu, dtype, vec, table):
    B, T, H, Hkv, D = 2, 5, 9, 3, 64
    # q/k as strided slices of one qkv buffer; the table broadcast over B
    qkv = _rand(B, T, (H + 2 * Hkv) * D, dtype=dtype, seed=0)
    q = qkv[..., : H * D].view(B, T, H, D)
    k = qkv[..., H * D : (H + Hkv) * D].view(B, T, Hkv, D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * torch.rand(D // 2, dtype=torch.float64) * 3
    ang = torch.cat([ang, ang], -1)[None]
    tdt = torch.float32 if table == "f32" else dtype
    cos, sin = (1.1 * ang.cos()).to(tdt), (1.1 * ang.sin()).to(tdt)
    gq, gk = _rand(B, T, H, D, dtype=dtype, seed=1), _rand(B, T, Hkv, D, dtype=dtype, seed=2)

    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    tq, tk = rope_reference(q64, k64, cos.double(), sin.double())
    tdq, tdk = torch.autograd.grad((tq, tk), (q64, k64), (gq.double(), gk.double()))

    oq, ok = _rope_emu(emu, q, k, cos, sin, vec, False)
    dq, dk = _rope_emu(emu, gq, gk, cos, sin, vec, True)
    for got, want, what in ((oq, tq, "q'"), (ok, tk, "k'"), (dq, tdq, "dq"), (dk, tdk, "dk")):
        assert_close(got, want.detach(), dtype, what=f"{what} vec={vec}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_kernel_per_token_tables_of_beyond_original(emu, dtype):
    """rope.yarn.apply=beyond_original hands the kernel (B, T, D) tables that differ per row and
    per token (a packed row mixing original-RoPE and YaRN documents, restart positions): the
    kernel indexes them by batch and token stride, forward and backward."""
    from megablu.config.schema import RopeConfig, YarnConfig
    from megablu.model.packing import document_lengths, document_positions
    from megablu.model.rope import RotaryEmbedding

    B, T, H, Hkv, D = 2, 24, 9, 3, 64
    rot = RotaryEmbedding(
        D, RopeConfig(theta=1e4, yarn=YarnConfig(factor=2.0, original_max_position=8, apply="beyond_original"))
    )
    doc = torch.tensor([[0] * 5 + [1] * 12 + [2] * 7, [0] * 24])
    cos, sin = rot(document_positions(doc), torch.float32, document_lengths(doc))
    assert not torch.equal(cos[0], cos[1]) and cos.stride(0) == T * D
    cos, sin = cos.to(dtype), sin.to(dtype)
    q, k = _rand(B, T, H, D, dtype=dtype, seed=0), _rand(B, T, Hkv, D, dtype=dtype, seed=1)
    gq, gk = _rand(B, T, H, D, dtype=dtype, seed=2), _rand(B, T, Hkv, D, dtype=dtype, seed=3)
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    tq, tk = rope_reference(q64, k64, cos.double(), sin.double())
    tdq, tdk = torch.autograd.grad((tq, tk), (q64, k64), (gq.double(), gk.double()))
    oq, ok = _rope_emu(emu, q, k, cos, sin, 16 // q.element_size(), False)
    dq, dk = _rope_emu(emu, gq, gk, cos, sin, 16 // q.element_size(), True)
    for got, want, what in ((oq, tq, "q'"), (ok, tk, "k'"), (dq, tdq, "dq"), (dk, tdk, "dk")):
        assert_close(got, want.detach(), dtype, what=what)


# --------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize(
    "dtype,d,vpt",
    [
        (torch.bfloat16, 64, 1),
        (torch.bfloat16, 576, 3),
        (torch.bfloat16, 1024, 4),
        (torch.bfloat16, 1536, 6),
        (torch.bfloat16, 2048, 8),
        (torch.float32, 200, 2),
        (torch.float32, 1024, 8),
    ],
)
@pytest.mark.parametrize("with_res", [True, False])
def test_rmsnorm_kernels(emu, dtype, d, vpt, with_res):
    rows, eps, vec, blocks = 19, 1e-5, 16 // torch.tensor([], dtype=dtype).element_size(), 2
    x, res = _rand(rows, d, dtype=dtype, seed=0), _rand(rows, d, dtype=dtype, seed=1, scale=3.0)
    w = (1 + 0.5 * torch.randn(d, generator=torch.Generator().manual_seed(2))).to(dtype)
    gy, gr = _rand(rows, d, dtype=dtype, seed=3), _rand(rows, d, dtype=dtype, seed=4)

    y, r_out, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty(rows, dtype=torch.float32)
    a = RmsFwdArgs(
        x.data_ptr(),
        res.data_ptr() if with_res else None,
        w.data_ptr(),
        y.data_ptr(),
        r_out.data_ptr() if with_res else None,
        rstd.data_ptr(),
        rows,
        d,
        eps,
        DT[dtype],
        vec,
        vpt,
    )
    assert emu.emu_rmsnorm_fwd(ctypes.byref(a)) == 0
    r = r_out if with_res else x
    # blocks=2 < rows/8: each warp loops over several rows (the grid-stride path)
    dr, part = torch.empty_like(x), torch.empty(blocks, d, dtype=torch.float32)
    b = RmsBwdArgs(
        gy.data_ptr(),
        gr.data_ptr() if with_res else None,
        r.data_ptr(),
        w.data_ptr(),
        rstd.data_ptr(),
        dr.data_ptr(),
        part.data_ptr(),
        rows,
        d,
        blocks,
        DT[dtype],
        vec,
        vpt,
    )
    assert emu.emu_rmsnorm_bwd(ctypes.byref(b)) == 0
    # the block's warps add their dw sums in a fixed order (no atomics): bitwise repeatable
    dr2, part2 = torch.empty_like(x), torch.empty(blocks, d, dtype=torch.float32)
    b2 = RmsBwdArgs(
        gy.data_ptr(),
        gr.data_ptr() if with_res else None,
        r.data_ptr(),
        w.data_ptr(),
        rstd.data_ptr(),
        dr2.data_ptr(),
        part2.data_ptr(),
        rows,
        d,
        blocks,
        DT[dtype],
        vec,
        vpt,
    )
    assert emu.emu_rmsnorm_bwd(ctypes.byref(b2)) == 0
    assert torch.equal(part, part2) and torch.equal(dr, dr2)

    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    res64 = res.double().requires_grad_()
    r64 = x64 + res64 if with_res else x64
    y64 = w64 * (r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + eps))
    outs, grads = [y64], [gy.double()]
    if with_res:
        outs.append(r64)
        grads.append(gr.double())
    tdx, tdw = torch.autograd.grad(outs, (x64, w64), grads)
    if with_res:
        assert torch.equal(r_out, x + res)
    assert_close(y, y64.detach(), dtype, what="y")
    assert_close(rstd, torch.rsqrt(r.double().pow(2).mean(-1) + eps), torch.float32, what="rstd")
    assert_close(dr, tdx, dtype, what="dx")
    assert_close(part.sum(0), tdw, dtype, reduction=True, what="dw")


@pytest.mark.parametrize(
    "dtype,d,vpt",
    [(torch.bfloat16, 1024, 4), (torch.bfloat16, 576, 3), (torch.bfloat16, 2048, 8), (torch.float32, 1024, 8)],
)
def test_rmsnorm_backward_async_staging_changes_loads_not_results(emu, dtype, d, vpt):
    """The two backward paths of one build, chosen by the launch argument async_stages (rows
    staged through shared memory by cp.async, the default where the GPU has room, measured
    by bench/rmsnorm_bwd_variants.py; or kept in registers): where the kernel reads from
    changes, never what it computes. Bitwise the same dr and dw partials, on the grid-stride
    path (two stages in turn), with and without grad_r, at the largest row of each dtype."""
    rows, blocks, vec = 37, 2, 16 // torch.tensor([], dtype=dtype).element_size()
    gy, gr, r = (_rand(rows, d, dtype=dtype, seed=s) for s in (5, 6, 7))
    w = (1 + 0.5 * torch.randn(d, generator=torch.Generator().manual_seed(8))).to(dtype)
    rstd = torch.rand(rows, generator=torch.Generator().manual_seed(9)) + 0.5
    for with_res in (True, False):
        outs = []
        for async_stages in (False, True):
            dr, part = torch.full_like(gy, float("nan")), torch.full((blocks, d), float("nan"))
            b = RmsBwdArgs(
                gy.data_ptr(),
                gr.data_ptr() if with_res else None,
                r.data_ptr(),
                w.data_ptr(),
                rstd.data_ptr(),
                dr.data_ptr(),
                part.data_ptr(),
                rows,
                d,
                blocks,
                DT[dtype],
                vec,
                vpt,
                async_stages,
            )
            assert emu.emu_rmsnorm_bwd(ctypes.byref(b)) == 0
            outs.append((dr, part))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        assert outs[0][0].abs().sum() > 0 and outs[0][1].abs().sum() > 0


# the opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin) of three GPUs
H100, A100, SM75 = (9, 227 * 1024), (8, 163 * 1024), (7, 64 * 1024)


def _pick(emu, d, dtype, force, device):
    return emu.emu_rmsnorm_bwd_pick(I64(d), DT[dtype], force, *device)


def test_rmsnorm_backward_path_rule(emu):
    """Which backward path the binding launches (rmsnorm_bwd_pick, the kernel file's host code):
    the cp.async stages when their shared memory fits the device's opt-in limit per block and
    the device has cp.async (sm_80+), else registers; MEGABLU_RMS_BWD_ASYNC=0/1 forces either,
    and forcing the stages where they cannot run is an error (-1), not a launch that fails."""
    emu.emu_rmsnorm_bwd_smem.restype = ctypes.c_size_t
    smem = lambda d, dtype, a: emu.emu_rmsnorm_bwd_smem(I64(d), DT[dtype], a)  # noqa: E731
    # fp32 dw sums, plus 8 warps x 2 stages x (gy, r, grad_r) rows of d
    assert smem(1024, torch.bfloat16, False) == 4 * 1024
    assert smem(1024, torch.bfloat16, True) == 4 * 1024 + 8 * 2 * 3 * 1024 * 2 == 100 * 1024
    assert smem(2048, torch.bfloat16, True) == 200 * 1024
    assert smem(1024, torch.float32, True) == 4 * 1024 + 8 * 2 * 3 * 1024 * 4

    auto, regs, stages = -1, 0, 1
    need = smem(1024, torch.bfloat16, True)
    # auto: the limit decides, to the byte
    assert _pick(emu, 1024, torch.bfloat16, auto, (9, need)) == 1
    assert _pick(emu, 1024, torch.bfloat16, auto, (9, need - 1)) == 0
    assert _pick(emu, 1024, torch.bfloat16, auto, H100) == 1
    assert _pick(emu, 1024, torch.bfloat16, auto, A100) == 1
    assert _pick(emu, 2048, torch.bfloat16, auto, A100) == 0  # 200 KB > 163 KB
    assert _pick(emu, 2048, torch.bfloat16, auto, H100) == 1
    assert _pick(emu, 1024, torch.float32, auto, A100) == 0  # fp32 stages take twice the bytes
    assert _pick(emu, 64, torch.bfloat16, auto, SM75) == 0  # fits, but no cp.async below sm_80
    # forced
    assert _pick(emu, 1024, torch.bfloat16, regs, H100) == 0
    assert _pick(emu, 2048, torch.bfloat16, stages, H100) == 1
    assert _pick(emu, 2048, torch.bfloat16, stages, A100) == -1
    assert _pick(emu, 64, torch.bfloat16, stages, SM75) == -1


def _env_reads(emu, value, then=None):
    """emu_rmsnorm_bwd_async_env() in a fresh process with MEGABLU_RMS_BWD_ASYNC=value (None:
    unset), then again after the process sets it to `then`."""
    env = {k: v for k, v in os.environ.items() if k != "MEGABLU_RMS_BWD_ASYNC"}
    if value is not None:
        env["MEGABLU_RMS_BWD_ASYNC"] = value
    code = (
        "import ctypes, os, sys; lib = ctypes.CDLL(sys.argv[1]); a = lib.emu_rmsnorm_bwd_async_env()\n"
        "if len(sys.argv) > 2: os.environ['MEGABLU_RMS_BWD_ASYNC'] = sys.argv[2]\n"
        "print(a, lib.emu_rmsnorm_bwd_async_env())"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, emu._name, *([then] if then is not None else [])],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return tuple(int(x) for x in r.stdout.split())


def test_rmsnorm_backward_env_override(emu):
    """MEGABLU_RMS_BWD_ASYNC as the binding reads it: unset, empty or auto -> -1 (the rule
    chooses), 0 / 1 force, anything else -2 (the binding raises); read once per process."""
    for value, want in ((None, -1), ("", -1), ("auto", -1), ("0", 0), ("1", 1), ("yes", -2)):
        assert _env_reads(emu, value) == (want, want), value
    assert _env_reads(emu, "1", then="0") == (1, 1)
    assert _env_reads(emu, None, then="1") == (-1, -1)


# --------------------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize(
    "dtype,vec", [(torch.bfloat16, 8), (torch.bfloat16, 4), (torch.bfloat16, 1), (torch.float32, 4), (torch.float32, 2)]
)
@pytest.mark.parametrize("packed", [False, True])
def test_swiglu_kernels(emu, dtype, vec, packed):
    rows, cols = 7, 48
    if packed:
        gu = _rand(rows, 2 * cols, dtype=dtype, seed=0, scale=2.0)
        gate, up = gu[:, :cols], gu[:, cols:]
    else:
        gate, up = _rand(rows, cols, dtype=dtype, seed=0, scale=2.0), _rand(rows, cols, dtype=dtype, seed=1, scale=2.0)
    grad = _rand(rows, cols, dtype=dtype, seed=2, scale=2.0)
    out = torch.empty(rows, cols, dtype=dtype)
    a = SwFwdArgs(
        gate.data_ptr(), up.data_ptr(), out.data_ptr(), rows, cols, gate.stride(0), up.stride(0), DT[dtype], vec
    )
    assert emu.emu_swiglu_fwd(ctypes.byref(a)) == 0
    dgu = torch.empty(rows, 2 * cols, dtype=dtype)  # packed grads, as the binding writes them
    dg, du = (dgu[:, :cols], dgu[:, cols:]) if packed else (torch.empty_like(out), torch.empty_like(out))
    b = SwBwdArgs(
        grad.data_ptr(),
        gate.data_ptr(),
        up.data_ptr(),
        dg.data_ptr(),
        du.data_ptr(),
        rows,
        cols,
        grad.stride(0),
        gate.stride(0),
        up.stride(0),
        dg.stride(0),
        du.stride(0),
        DT[dtype],
        vec,
    )
    assert emu.emu_swiglu_bwd(ctypes.byref(b)) == 0

    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    t = F.silu(g64) * u64
    tdg, tdu = torch.autograd.grad(t, (g64, u64), grad.double())
    assert_close(out, t.detach(), dtype, what="out")
    assert_close(dg, tdg, dtype, what="d gate")
    assert_close(du, tdu, dtype, what="d up")
    if dtype == torch.bfloat16:
        # the kernel mirrors torch's roundings: bit-identical to the bf16 expression almost everywhere
        same = (out == F.silu(gate) * up).float().mean().item()
        assert same > 0.95, same


# --------------------------------------------------------------------------- autograd wrappers
class EmulatedExt:
    """The extension's Python API (csrc/megablu_ops.cpp) on CPU tensors, backed by the
    emulated kernels: lets the autograd Functions in megablu/ops run their CUDA-path code
    (saved tensors, missing grads, views, packed grads) without a GPU. Output allocation
    and vector-width choice follow the C++ bindings."""

    def __init__(self, lib):
        self.lib = lib

    @staticmethod
    def _vec(max_vec, divisible, ptrs):
        v = max_vec
        while v > 1:
            if all(x % v == 0 for x in divisible) and all(p % (v * es) == 0 for p, es in ptrs):
                return v
            v //= 2
        return 1

    def rope_apply(self, q, k, cos, sin, backward):
        es, ts = q.element_size(), cos.element_size()
        strides = [
            _st(q, 0),
            _st(q, 1),
            _st(q, 2),
            _st(k, 0),
            _st(k, 1),
            _st(k, 2),
            _st(cos, 0),
            _st(cos, 1),
            _st(sin, 0),
            _st(sin, 1),
        ]
        vec = self._vec(
            16 // es,
            [q.shape[3] // 2, *strides],
            [(q.data_ptr(), es), (k.data_ptr(), es), (cos.data_ptr(), ts), (sin.data_ptr(), ts)],
        )
        return list(_rope_emu(self.lib, q, k, cos, sin, vec, backward))

    @staticmethod
    def _plan(d, es):
        vec = 16 // es
        need = (d // vec + 31) // 32
        return vec, next(v for v in (1, 2, 3, 4, 6, 8) if need <= v)

    def rmsnorm_fwd(self, x, residual, weight, eps):
        rows, d = x.shape
        vec, vpt = self._plan(d, x.element_size())
        assert weight.data_ptr() % 16 == 0 and x.is_contiguous()
        y, rstd = torch.empty_like(x), torch.empty(rows, dtype=torch.float32)
        r = torch.empty_like(x) if residual is not None else x
        a = RmsFwdArgs(
            x.data_ptr(),
            residual.data_ptr() if residual is not None else None,
            weight.data_ptr(),
            y.data_ptr(),
            r.data_ptr() if residual is not None else None,
            rstd.data_ptr(),
            rows,
            d,
            eps,
            DT[x.dtype],
            vec,
            vpt,
        )
        assert self.lib.emu_rmsnorm_fwd(ctypes.byref(a)) == 0
        return [y, r, rstd]

    def rmsnorm_bwd(self, gy, g_res, r, weight, rstd, path=-1):
        rows, d = r.shape
        vec, vpt = self._plan(d, r.element_size())
        # the binding's choose_bwd_path, on an H100's limits: the cp.async stages unless forced off
        force = path if path >= 0 else self.lib.emu_rmsnorm_bwd_async_env()
        assert force >= -1, "MEGABLU_RMS_BWD_ASYNC must be 0, 1, auto or unset"
        pick = _pick(self.lib, d, r.dtype, force, H100)
        if pick < 0:
            raise RuntimeError(f"rmsnorm: the cp.async backward is forced but cannot run at d={d}")
        blocks = min((rows + 7) // 8, 3)
        dr, part = torch.empty_like(r), torch.zeros(max(blocks, 1), d, dtype=torch.float32)
        a = RmsBwdArgs(
            gy.data_ptr(),
            g_res.data_ptr() if g_res is not None else None,
            r.data_ptr(),
            weight.data_ptr(),
            rstd.data_ptr(),
            dr.data_ptr(),
            part.data_ptr(),
            rows,
            d,
            blocks,
            DT[r.dtype],
            vec,
            vpt,
            pick == 1,
        )
        assert self.lib.emu_rmsnorm_bwd(ctypes.byref(a)) == 0
        return [dr, part.sum(0).to(weight.dtype)]

    def swiglu_fwd(self, gate, up):
        rows, cols = gate.shape
        es = gate.element_size()
        grs, urs = (cols if rows == 1 else gate.stride(0)), (cols if rows == 1 else up.stride(0))
        vec = self._vec(16 // es, [cols, grs, urs], [(gate.data_ptr(), es), (up.data_ptr(), es)])
        out = torch.empty(rows, cols, dtype=gate.dtype)
        a = SwFwdArgs(gate.data_ptr(), up.data_ptr(), out.data_ptr(), rows, cols, grs, urs, DT[gate.dtype], vec)
        assert self.lib.emu_swiglu_fwd(ctypes.byref(a)) == 0
        return out

    def swiglu_bwd(self, grad, gate, up, packed):
        rows, cols = gate.shape
        es = gate.element_size()
        if packed:
            dgu = torch.empty(rows, 2 * cols, dtype=gate.dtype)
            dg, du = dgu[:, :cols], dgu[:, cols:]
        else:
            dg, du = torch.empty(rows, cols, dtype=gate.dtype), torch.empty(rows, cols, dtype=gate.dtype)
        rs = [grad.stride(0), gate.stride(0), up.stride(0), dg.stride(0)]
        vec = self._vec(16 // es, [cols, *rs], [(t.data_ptr(), es) for t in (grad, gate, up, dg, du)])
        a = SwBwdArgs(
            grad.data_ptr(),
            gate.data_ptr(),
            up.data_ptr(),
            dg.data_ptr(),
            du.data_ptr(),
            rows,
            cols,
            *rs,
            du.stride(0),
            DT[gate.dtype],
            vec,
        )
        assert self.lib.emu_swiglu_bwd(ctypes.byref(a)) == 0
        return [dgu] if packed else [dg, du]


@pytest.fixture
def emulated_ext(emu, monkeypatch):
    import importlib

    fake = EmulatedExt(emu)
    # importlib: megablu.ops re-exports functions named like their modules (ops.swiglu ...)
    for name in ("rope", "rmsnorm", "swiglu"):
        monkeypatch.setattr(importlib.import_module(f"megablu.ops.{name}"), "ext", lambda: fake)
    return fake


@pytest.mark.parametrize("use_k", [True, False])
def test_rope_function(emulated_ext, use_k):
    from megablu.ops.rope import _RopeFn

    B, T, H, Hkv, D = 1, 6, 4, 2, 32
    q, k = _rand(B, T, H, D, dtype=torch.float32, seed=0), _rand(B, T, Hkv, D, dtype=torch.float32, seed=1)
    ang = torch.arange(T, dtype=torch.float32)[:, None] * torch.rand(D // 2)
    cos, sin = torch.cat([ang, ang], -1)[None].cos(), torch.cat([ang, ang], -1)[None].sin()
    outs = {}
    for name in ("emulated", "reference"):
        qc, kc = q.clone().requires_grad_(), k.clone().requires_grad_()
        oq, ok = _RopeFn.apply(qc, kc, cos, sin) if name == "emulated" else rope_reference(qc, kc, cos, sin)
        (oq.square().sum() + (ok.square().sum() if use_k else 0)).backward()
        outs[name] = (oq, ok, qc.grad, kc.grad if kc.grad is not None else torch.zeros_like(kc))
    for a, b in zip(outs["emulated"], outs["reference"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["add", "add_y_only", "plain", "misaligned_weight"])
def test_rmsnorm_function(emulated_ext, mode):
    from megablu.ops.rmsnorm import _AddRmsNormFn, rms_norm_reference

    shape, eps = (2, 5, 64), 1e-5
    x, res = _rand(*shape, dtype=torch.float32, seed=0), _rand(*shape, dtype=torch.float32, seed=1)
    wbuf = 1 + 0.3 * _rand(65, dtype=torch.float32, seed=2)
    gy, gr = _rand(*shape, dtype=torch.float32, seed=3), _rand(*shape, dtype=torch.float32, seed=4)
    outs = {}
    for name in ("emulated", "reference"):
        wb = wbuf.clone().requires_grad_()
        w = wb[1:] if mode == "misaligned_weight" else wb[:64]
        xc, rc = x.clone().requires_grad_(), res.clone().requires_grad_()
        use_res = mode != "plain"
        if name == "emulated":
            o = _AddRmsNormFn.apply(xc, rc if use_res else None, w, eps)
            y, r = o if use_res else (o, xc)
        else:
            y, r = rms_norm_reference(xc, w, eps, rc if use_res else None)
        loss = (y * gy).sum() + ((r * gr).sum() if mode in ("add", "misaligned_weight") else 0)
        loss.backward()
        outs[name] = (y, xc.grad, wb.grad, rc.grad if use_res else torch.zeros(1))
    for a, b in zip(outs["emulated"], outs["reference"]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_swiglu_function(emulated_ext, packed):
    from megablu.ops.swiglu import _SwigluFn, _SwigluPackedFn

    gate, up = _rand(2, 3, 40, dtype=torch.float32, seed=0), _rand(2, 3, 40, dtype=torch.float32, seed=1)
    grad = _rand(2, 3, 40, dtype=torch.float32, seed=2)
    outs = {}
    for name in ("emulated", "reference"):
        if packed:
            gu = torch.cat([gate, up], -1).requires_grad_()
            o = _SwigluPackedFn.apply(gu) if name == "emulated" else F.silu(gu[..., :40]) * gu[..., 40:]
            o.backward(grad)
            outs[name] = (o, gu.grad)
        else:
            g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
            o = _SwigluFn.apply(g, u) if name == "emulated" else F.silu(g) * u
            o.backward(grad)
            outs[name] = (o, g.grad, u.grad)
    for a, b in zip(outs["emulated"], outs["reference"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
