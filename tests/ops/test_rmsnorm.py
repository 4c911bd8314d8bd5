"""Fused residual add + RMSNorm vs the model's RMSNorm: forward, backward (x, residual, weight)."""

import pytest
import torch

from megablu.model.decoder import RMSNorm
from megablu.ops.rmsnorm import add_rms_norm, rms_norm, rms_norm_backward_reference

from .helpers import assert_close, cuda

EPS = 1e-5


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(device, dtype)
    res = (3 * torch.randn(*shape, generator=g)).to(device, dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(device, dtype)
    gy = torch.randn(*shape, generator=g).to(device, dtype)
    gr = torch.randn(*shape, generator=g).to(device, dtype)
    return x, res, w, gy, gr


def _model_norm(w, eps=EPS):
    m = RMSNorm(w.shape[0], eps).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        m.weight.copy_(w)
    return m


def _truth(x, res, w, gy, gr):
    """fp64 ground truth: r = x + res, y = w * r * rsqrt(mean(r^2) + eps) (the model's math
    without its fp32 cast and rounding); grads of <y, gy> + <r, gr>."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    res64 = res.double().requires_grad_() if res is not None else None
    r = x64 + res64 if res is not None else x64
    y = w64 * (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS))
    outs, grads = [y], [gy.double()]
    if res is not None and gr is not None:
        outs.append(r)
        grads.append(gr.double())
    inputs = [x64, w64] + ([res64] if res is not None else [])
    g = torch.autograd.grad(outs, inputs, grads)
    return y.detach(), r.detach(), g[0], g[1], (g[2] if res is not None else None)


# --------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_fp64_truth(dtype):
    """The torch path (what the model's RMSNorm runs, here and through the module) against the
    independent fp64 formula, within the dtype's tolerance: not against itself."""
    x, res, w, gy, gr = _inputs((2, 37, 576), dtype, "cpu")
    y, r = add_rms_norm(x, res, w, EPS, impl="torch")
    ty, tr, *_ = _truth(x, res, w, gy, gr)
    assert torch.equal(r, x + res)
    assert_close(y, ty, dtype, what="add_rms_norm y")
    ty0, *_ = _truth(x, None, w, gy, None)
    assert_close(rms_norm(x, w, EPS, impl="torch"), ty0, dtype, what="rms_norm")
    assert_close(_model_norm(w)(x), ty0, dtype, what="model RMSNorm")


@pytest.mark.parametrize("with_gr", [True, False])
def test_backward_formula_matches_autograd(with_gr):
    """The kernel's closed-form backward equals autograd of the model (fp64)."""
    x, res, w, gy, gr = _inputs((3, 11, 64), torch.float64, "cpu")
    _, r, dx, dw, dres = _truth(x, res, w, gy, gr if with_gr else None)
    dr, dw_f = rms_norm_backward_reference(gy, gr if with_gr else None, r, w, EPS)
    torch.testing.assert_close(dr, dx)
    torch.testing.assert_close(dr, dres)
    torch.testing.assert_close(dw_f, dw)


def test_auto_falls_back_on_cpu_and_logs_once(caplog):
    from megablu.ops import dispatch

    dispatch._logged.clear()
    x, res, w, *_ = _inputs((4, 64), torch.float32, "cpu")
    with caplog.at_level("INFO", logger="megablu.ops.dispatch"):
        for _ in range(3):
            add_rms_norm(x, res, w, EPS)
    lines = [r.getMessage() for r in caplog.records if "megablu ops" in r.getMessage()]
    assert len(lines) == 1 and "torch reference" in lines[0] and "cpu" in lines[0]


# --------------------------------------------------------------------------- GPU
SHAPES = [(2, 37, 576), (1, 1000, 1024), (5, 64), (1, 4099, 2048), (1, 33000, 1024), (3, 7, 8)]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", ["add", "add_y_only", "plain"])
def test_cuda_fwd_bwd(shape, dtype, mode):
    if dtype == torch.float32 and shape[-1] > 1024:
        pytest.skip("fp32 rows > 1024 take the torch path (kernel limit)")
    x, res, w, gy, gr = _inputs(shape, dtype, "cuda")
    use_res = mode != "plain"
    use_gr = mode == "add"
    ty, tr, tdx, tdw, tdres = _truth(x, res if use_res else None, w, gy, gr if use_gr else None)

    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    resc = res.clone().requires_grad_() if use_res else None
    y, r = add_rms_norm(xc, resc, wc, EPS, impl="cuda")
    assert y.dtype == dtype and r.dtype == dtype
    outs, grads = [y], [gy]
    if use_gr:
        outs.append(r)
        grads.append(gr)
    torch.autograd.backward(outs, grads)
    assert_close(y, ty, dtype, what="y")
    if use_res:
        assert torch.equal(r, x + res), "residual sum must equal torch's add in the same dtype"
        assert_close(resc.grad, tdres, dtype, what="d residual")
    assert_close(xc.grad, tdx, dtype, what="dx")
    assert_close(wc.grad, tdw, dtype, reduction=True, what="dw")


@cuda
def test_cuda_unsupported_d_falls_back_in_auto():
    x, res, w, *_ = _inputs((3, 100), torch.bfloat16, "cuda")  # 100 % 8 != 0
    y, r = add_rms_norm(x, res, w, EPS)
    ty, _, *_ = _truth(x, res, w, x, None)
    assert_close(y, ty, torch.bfloat16, what="y")
    with pytest.raises(ValueError, match="cannot run"):
        add_rms_norm(x, res, w, EPS, impl="cuda")


@cuda
def test_cuda_matches_torch_bf16_closely():
    """bf16 outputs follow the reference's roundings: nearly all elements bit-identical."""
    x, res, w, *_ = _inputs((1, 4096, 1024), torch.bfloat16, "cuda")
    y, _ = add_rms_norm(x, res, w, EPS, impl="cuda")
    ty, _ = add_rms_norm(x, res, w, EPS, impl="torch")
    same = (y == ty).float().mean().item()
    assert same > 0.99, f"only {same:.4f} of elements equal torch's bf16 result"


@cuda
def test_cuda_misaligned_views():
    """Weight as a view into a flat buffer at an odd offset (ZeRO flattening) and x at an
    offset that breaks 16-byte alignment: still exact grads into the flat buffers."""
    dtype, (N, d) = torch.bfloat16, (37, 576)
    x, res, w, gy, gr = _inputs((N, d), dtype, "cuda")
    wflat = torch.cat([torch.zeros(1, device="cuda", dtype=dtype), w]).requires_grad_()
    xflat = torch.cat([torch.zeros(3, device="cuda", dtype=dtype), x.flatten()]).requires_grad_()
    wv, xv = wflat[1:], xflat[3:].view(N, d)
    assert wv.data_ptr() % 16 and xv.data_ptr() % 16
    y, r = add_rms_norm(xv, res, wv, EPS, impl="cuda")
    torch.autograd.backward((y, r), (gy, gr))
    ty, _, tdx, tdw, _ = _truth(x, res, w, gy, gr)
    assert_close(y, ty, dtype, what="y")
    assert_close(xflat.grad[3:].view(N, d), tdx, dtype, what="dx")
    assert_close(wflat.grad[1:], tdw, dtype, reduction=True, what="dw")


@cuda
def test_cuda_backward_is_bitwise_repeatable():
    """The weight grad is summed in a fixed order (per lane in registers, then warp by warp, then
    over blocks): two backward passes over the same inputs give the same bits, at a size that
    runs many rows per warp."""
    x, res, w, gy, gr = _inputs((1, 32768, 1024), torch.bfloat16, "cuda")
    grads = []
    for _ in range(2):
        xc, resc, wc = (t.clone().requires_grad_() for t in (x, res, w))
        y, r = add_rms_norm(xc, resc, wc, EPS, impl="cuda")
        grads.append(torch.autograd.grad((y, r), (xc, resc, wc), (gy, gr)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@cuda
@pytest.mark.parametrize(
    "dtype,d", [(torch.bfloat16, 1024), (torch.bfloat16, 576), (torch.bfloat16, 2048), (torch.float32, 1024)]
)
def test_cuda_backward_paths_bitwise_equal(dtype, d):
    """The backward's two paths, forced through the binding's `path` (0: registers; 1: rows
    staged through shared memory by cp.async, the default where the GPU has room), give the
    same bits at many rows per warp, and the default gives them too. Where this GPU cannot
    hold the stages, forcing them is an error that names the numbers, not a failed launch."""
    from megablu.ops import builder

    ext = builder.load()
    x, res, w, gy, gr = _inputs((16411, d), dtype, "cuda")
    _, r, rstd = ext.rmsnorm_fwd(x, res, w, EPS)
    regs = ext.rmsnorm_bwd(gy, gr, r, w, rstd, path=0)
    default = ext.rmsnorm_bwd(gy, gr, r, w, rstd)
    props = torch.cuda.get_device_properties(r.device)
    need = 4 * d + 8 * 2 * 3 * d * r.element_size()  # fp32 dw sums + 8 warps x 2 stages x 3 rows
    if props.major >= 8 and need <= props.shared_memory_per_block_optin:
        staged = ext.rmsnorm_bwd(gy, gr, r, w, rstd, path=1)
        assert torch.equal(regs[0], staged[0]) and torch.equal(regs[1], staged[1])
    else:
        with pytest.raises(RuntimeError, match="forces the cp.async backward"):
            ext.rmsnorm_bwd(gy, gr, r, w, rstd, path=1)
    assert torch.equal(regs[0], default[0]) and torch.equal(regs[1], default[1])
    # path=2 ("path must be") is checked in a process of its own: tests/ops/test_ext_errors.py
