"""Fused SwiGLU vs silu(gate) * up: forward and backward, separate and packed inputs."""

import pytest
import torch
import torch.nn.functional as F

from megablu.ops.swiglu import swiglu, swiglu_backward_reference, swiglu_packed

from .helpers import assert_close, cuda


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [(2 * torch.randn(*shape, generator=g)).to(device, dtype) for _ in range(3)]  # gate, up, grad


def _truth(gate, up, grad):
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    out = F.silu(g64) * u64
    dg, du = torch.autograd.grad(out, (g64, u64), grad.double())
    return out.detach(), dg, du


# --------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_expression(dtype):
    gate, up, _ = _inputs((2, 37, 1536), dtype, "cpu")
    assert torch.equal(swiglu(gate, up, impl="torch"), F.silu(gate) * up)
    gu = torch.cat([gate, up], dim=-1)
    assert torch.equal(swiglu_packed(gu, impl="torch"), F.silu(gate) * up)


def test_backward_formula_matches_autograd():
    gate, up, grad = _inputs((3, 5, 40), torch.float64, "cpu")
    _, dg, du = _truth(gate, up, grad)
    fg, fu = swiglu_backward_reference(grad, gate, up)
    torch.testing.assert_close(fg, dg)
    torch.testing.assert_close(fu, du)


def test_packed_needs_even_width():
    with pytest.raises(ValueError, match="even"):
        swiglu_packed(torch.zeros(2, 5))


# --------------------------------------------------------------------------- GPU
SHAPES = [(2, 37, 1536), (1, 1000, 2816), (3, 129, 1001), (7, 6), (1, 33000, 2816)]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_fwd_bwd(shape, dtype):
    gate, up, grad = _inputs(shape, dtype, "cuda")
    tout, tdg, tdu = _truth(gate, up, grad)
    gc, uc = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = swiglu(gc, uc, impl="cuda")
    out.backward(grad)
    assert out.dtype == dtype
    assert_close(out, tout, dtype, what="out")
    assert_close(gc.grad, tdg, dtype, what="d gate")
    assert_close(uc.grad, tdu, dtype, what="d up")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 37, 1536), (3, 129, 1001)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_packed(shape, dtype):
    gate, up, grad = _inputs(shape, dtype, "cuda")
    tout, tdg, tdu = _truth(gate, up, grad)
    gu = torch.cat([gate, up], dim=-1).requires_grad_()
    out = swiglu_packed(gu, impl="cuda")
    out.backward(grad)
    f = shape[-1]
    assert_close(out, tout, dtype, what="out")
    assert_close(gu.grad[..., :f], tdg, dtype, what="d gate")
    assert_close(gu.grad[..., f:], tdu, dtype, what="d up")


@cuda
def test_cuda_matches_torch_bf16_closely():
    gate, up, grad = _inputs((1, 4096, 2816), torch.bfloat16, "cuda")
    same = (swiglu(gate, up, impl="cuda") == F.silu(gate) * up).float().mean().item()
    assert same > 0.99, f"only {same:.4f} of elements equal torch's bf16 result"


@cuda
def test_cuda_fp16_takes_the_torch_path():
    """fp16 kernels are not built: auto runs the reference, a forced 'cuda' says why."""
    gate, up, _ = _inputs((4, 64), torch.float16, "cuda")
    torch.testing.assert_close(swiglu(gate, up), F.silu(gate) * up)
    with pytest.raises(ValueError, match="cannot run"):
        swiglu(gate, up, impl="cuda")
