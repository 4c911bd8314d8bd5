"""packed_linear (several projections of one input as one GEMM) against the separate linears: forward and every
gradient (input, weights, biases), in fp64 ground truth, over awkward shapes; what it saves for backward."""

import pytest
import torch
import torch.nn.functional as F

from megablu.ops.linear import packed_linear, packed_linear_reference

from .helpers import assert_close, cuda

# (input shape, output sizes): q/k/v of GQA (16/4 heads x 8), gate/up, odd sizes and a 2-D input
SHAPES = [
    ((2, 37, 64), (128, 32, 32)),
    ((1, 5, 24), (40, 40)),
    ((3, 7, 9), (5, 1, 11)),
    ((11, 16), (16, 8, 8)),
]


def _inputs(shape, sizes, dtype, device, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(device, dtype)
    ws = [(torch.randn(n, shape[-1], generator=g) / shape[-1] ** 0.5).to(device, dtype) for n in sizes]
    bs = [torch.randn(n, generator=g).to(device, dtype) for n in sizes] if bias else None
    gy = torch.randn(*shape[:-1], sum(sizes), generator=g).to(device, dtype)
    return x, ws, bs, gy


def _grads(fn, x, ws, bs, gy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, *ws, *(bs or []))]
    x_, ws_, bs_ = leaves[0], leaves[1 : 1 + len(ws)], (leaves[1 + len(ws) :] if bs else None)
    y = fn(x_, ws_, bs_)
    return y.detach(), torch.autograd.grad(y, leaves, gy)


def _truth(x, ws, bs, gy):
    """fp64 ground truth, written independently: one output column block per weight, x @ W^T + b."""

    def f(x_, ws_, bs_):
        outs = [x_ @ w.t() + (bs_[i] if bs_ else 0) for i, w in enumerate(ws_)]
        return torch.cat(outs, -1)

    return _grads(f, x.double(), [w.double() for w in ws], [b.double() for b in bs] if bs else None, gy.double())


def _check(x, ws, bs, gy, dtype):
    ty, tg = _truth(x, ws, bs, gy)
    for name, fn in (("packed", packed_linear), ("reference", packed_linear_reference)):
        y, g = _grads(fn, x, ws, bs, gy)
        assert y.dtype == dtype
        assert_close(y, ty, dtype, reduction=True, what=f"{name} y")
        names = ["dx"] + [f"dw{i}" for i in range(len(ws))] + [f"db{i}" for i in range(len(bs or []))]
        for n, a, t in zip(names, g, tg, strict=True):
            assert_close(a, t, dtype, reduction=True, what=f"{name} {n}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,sizes", SHAPES)
def test_matches_the_separate_linears(shape, sizes, dtype, bias):
    _check(*_inputs(shape, sizes, dtype, "cpu", bias), dtype)


def test_fp32_equals_the_reference_closely():
    """fp32: the one GEMM and the separate ones agree to GEMM rounding (no fp64 detour)."""
    x, ws, bs, gy = _inputs((2, 37, 64), (128, 32, 32), torch.float32, "cpu", True)
    y, g = _grads(packed_linear, x, ws, bs, gy)
    ry, rg = _grads(packed_linear_reference, x, ws, bs, gy)
    torch.testing.assert_close(y, ry)
    for a, b in zip(g, rg, strict=True):
        torch.testing.assert_close(a, b)


def test_only_the_wanted_gradients_and_the_parameters_saved():
    """A frozen weight gets no gradient and an input without grad none either; the Function saves x and the
    weights themselves (parameters by reference: no concatenated weight for the offload to copy)."""
    x, ws, bs, gy = _inputs((2, 9, 16), (16, 8, 8), torch.float32, "cpu", True)
    params = [torch.nn.Parameter(w) for w in ws]
    params[1].requires_grad_(False)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = packed_linear(x, params, bs)
    assert len(saved) == 1 + len(params)
    assert saved[0] is x and all(any(s is p for s in saved) for p in params)
    y.backward(gy)
    assert params[1].grad is None and params[0].grad is not None and params[2].grad is not None
    ref = F.linear(x, ws[2]).detach()
    torch.testing.assert_close(y.detach()[..., 24:], ref + bs[2])


def test_bad_arguments():
    x = torch.randn(2, 3, 8)
    w = [torch.randn(4, 8), torch.randn(4, 8)]
    with pytest.raises(ValueError, match="all tensors or all None"):
        packed_linear(x, w, [torch.zeros(4), None])
    with pytest.raises(ValueError, match="2 weights but 1 biases"):
        packed_linear(x, w, [torch.zeros(4)])
    with pytest.raises(ValueError, match=r"weight \(4, 7\)"):
        packed_linear(x, [torch.randn(4, 7)])
    with pytest.raises(ValueError, match="ZeRO-3 partition not gathered"):
        packed_linear(x, [torch.empty(0)])


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_the_separate_linears(dtype):
    _check(*_inputs((2, 300, 128), (256, 64, 64), dtype, "cuda", True), dtype)
