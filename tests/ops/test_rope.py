"""Fused RoPE vs the rotation the model runs (ops.rope.rope_reference): forward and backward,
awkward shapes, dtypes; that reference itself against an independent complex-number rotation."""

import pytest
import torch

from megablu.config.schema import RopeConfig, YarnConfig
from megablu.model.rope import RotaryEmbedding
from megablu.ops.rope import apply_rotary, rope_backward_reference, rope_reference

from .helpers import assert_close, cuda

YARN = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=4.0, original_max_position=512))


def _table(B, T, D, dtype, device, start=0, rope=YARN):
    rot = RotaryEmbedding(D, rope).to(device)
    pos = torch.arange(start, start + T, device=device).expand(B, T)
    return rot(pos, dtype)


def _qk(B, T, H, Hkv, D, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(B, T, Hkv, D, generator=g).to(device=device, dtype=dtype)
    return q, k


def _truth(q, k, cos, sin, gq, gk):
    """fp64 forward and grads of the expression the model runs (rope_reference)."""
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    oq, ok = rope_reference(q64, k64, cos.double(), sin.double())
    dq, dk = torch.autograd.grad((oq, ok), (q64, k64), (gq.double(), gk.double()))
    return oq, ok, dq, dk


# --------------------------------------------------------------------------- CPU
def _complex_rotation(x, cos, sin):
    """fp64 HF-layout RoPE as a complex product: pairs (x_i, x_{i+D/2}) times cos + i sin of the
    table's first half (the halves are equal), scaled by the table's norm (YaRN's factor)."""
    h = x.shape[-1] // 2
    z = torch.complex(x[..., :h].double(), x[..., h:].double())
    w = torch.complex(cos[..., :h].double(), sin[..., :h].double()).unsqueeze(2)  # (B, T, 1, D/2)
    r = z * w
    return torch.cat((r.real, r.imag), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_complex_rotation(dtype):
    """The torch path (what the model runs) against an independent formula, not against itself."""
    q, k = _qk(2, 37, 9, 3, 64, dtype, "cpu")
    cos, sin = _table(2, 37, 64, dtype, "cpu", start=1000)
    oq, ok = apply_rotary(q, k, cos, sin, impl="torch")
    assert_close(oq, _complex_rotation(q, cos, sin), dtype, what="q'")
    assert_close(ok, _complex_rotation(k, cos, sin), dtype, what="k'")


@pytest.mark.parametrize("shape", [(2, 37, 9, 3, 64), (1, 5, 4, 1, 6), (1, 130, 2, 2, 128)])
def test_backward_formula_matches_autograd(shape):
    """The kernel's closed-form backward (transposed rotation) equals autograd of the model."""
    B, T, H, Hkv, D = shape
    q, k = _qk(B, T, H, Hkv, D, torch.float64, "cpu")
    cos, sin = _table(B, T, D, torch.float64, "cpu", start=7)
    gq, gk = _qk(B, T, H, Hkv, D, torch.float64, "cpu", seed=1)
    _, _, dq, dk = _truth(q, k, cos, sin, gq, gk)
    fq, fk = rope_backward_reference(gq, gk, cos, sin)
    torch.testing.assert_close(fq, dq)
    torch.testing.assert_close(fk, dk)


def test_forced_cuda_on_cpu_raises():
    q, k = _qk(1, 4, 2, 1, 8, torch.float32, "cpu")
    cos, sin = _table(1, 4, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="CUDA tensors"):
        apply_rotary(q, k, cos, sin, impl="cuda")


# --------------------------------------------------------------------------- GPU
SHAPES = [
    (2, 37, 9, 3, 64),  # odd heads (SmolLM2: 9 / 3), T not a multiple of 128
    (1, 1000, 16, 4, 64),  # blu-0.5b heads
    (3, 129, 5, 5, 128),  # MHA, D=128
    (1, 17, 3, 1, 24),  # D/2 = 12: 4-wide vectors for bf16
    (1, 9, 2, 1, 6),  # D/2 = 3: scalar path
    (1, 33000, 16, 4, 64),  # long T
]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_fwd_bwd(shape, dtype):
    B, T, H, Hkv, D = shape
    q, k = _qk(B, T, H, Hkv, D, dtype, "cuda")
    cos, sin = _table(B, T, D, dtype, "cuda", start=3)
    gq, gk = _qk(B, T, H, Hkv, D, dtype, "cuda", seed=1)
    tq, tk, tdq, tdk = _truth(q, k, cos, sin, gq, gk)

    qc, kc = q.clone().requires_grad_(), k.clone().requires_grad_()
    oq, ok = apply_rotary(qc, kc, cos, sin, impl="cuda")
    assert oq.dtype == dtype and ok.dtype == dtype and oq.is_contiguous()
    torch.autograd.backward((oq, ok), (gq, gk))
    assert_close(oq, tq, dtype, what="q'")
    assert_close(ok, tk, dtype, what="k'")
    assert_close(qc.grad, tdq, dtype, what="dq")
    assert_close(kc.grad, tdk, dtype, what="dk")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_strided_qkv_views_and_broadcast_table(dtype):
    """q/k as slices of a fused qkv projection (strided T), cos/sin (1, T, D) broadcast over B."""
    B, T, H, Hkv, D = 2, 300, 9, 3, 64
    g = torch.Generator(device="cpu").manual_seed(3)
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g).to("cuda", dtype).requires_grad_()
    q = qkv[..., : H * D].view(B, T, H, D)
    k = qkv[..., H * D : (H + Hkv) * D].view(B, T, Hkv, D)
    cos, sin = _table(1, T, D, dtype, "cuda", start=100_000)
    gq, gk = _qk(B, T, H, Hkv, D, dtype, "cuda", seed=4)
    tq, tk, tdq, tdk = _truth(q.detach(), k.detach(), cos, sin, gq, gk)
    oq, ok = apply_rotary(q, k, cos, sin, impl="cuda")
    torch.autograd.backward((oq, ok), (gq, gk))
    assert_close(oq, tq, dtype, what="q'")
    assert_close(ok, tk, dtype, what="k'")
    assert_close(qkv.grad[..., : H * D].view(B, T, H, D), tdq, dtype, what="dq")
    assert_close(qkv.grad[..., H * D : (H + Hkv) * D].view(B, T, Hkv, D), tdk, dtype, what="dk")
    assert torch.all(qkv.grad[..., (H + Hkv) * D :] == 0)


@cuda
def test_cuda_fp32_table_with_bf16_qk():
    q, k = _qk(1, 200, 9, 3, 64, torch.bfloat16, "cuda")
    cos, sin = _table(1, 200, 64, torch.float32, "cuda", start=50)
    oq, ok = apply_rotary(q, k, cos, sin, impl="cuda")
    tq, tk = rope_reference(q.double(), k.double(), cos.double(), sin.double())
    assert oq.dtype == torch.bfloat16
    assert_close(oq, tq, torch.bfloat16, what="q'")
    assert_close(ok, tk, torch.bfloat16, what="k'")


@cuda
def test_cuda_only_q_used():
    """k' unused: its grad is None and the kernel treats it as zero."""
    q, k = _qk(1, 50, 4, 2, 32, torch.float32, "cuda")
    cos, sin = _table(1, 50, 32, torch.float32, "cuda")
    qc, kc = q.clone().requires_grad_(), k.clone().requires_grad_()
    oq, _ = apply_rotary(qc, kc, cos, sin, impl="cuda")
    oq.sum().backward()
    tq64 = q.double().requires_grad_()
    rope_reference(tq64, k.double(), cos.double(), sin.double())[0].sum().backward()
    assert_close(qc.grad, tq64.grad, torch.float32, what="dq")
    assert kc.grad is None or torch.all(kc.grad == 0)
