"""The fused ops composed the way the decoder block uses them equal the block itself.

This is the integration recipe for megablu/model/decoder.py (norm -> attention with RoPE ->
residual add + norm -> SwiGLU MLP -> residual add), checked forward and backward against
`Block.forward`: exactly on CPU (torch path), within bf16 tolerance on GPU (CUDA kernels).
"""

import pytest
import torch

from megablu.config.schema import ModelConfig, RopeConfig, YarnConfig
from megablu.model.decoder import Block
from megablu.model.rope import RotaryEmbedding
from megablu.ops import add_rms_norm, apply_rotary, rms_norm, swiglu

from .helpers import cuda

# SmolLM2's head layout (9 heads / 3 kv heads) at a small width so the CPU run is quick
CFG = ModelConfig(n_layers=1, d_model=144, n_heads=9, n_kv_heads=3, ffn_dim=384, vocab_size=64)
ROPE = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=2.0, original_max_position=256))


def fused_block(blk: Block, x, cos, sin, impl):
    """Block.forward written with the fused ops (what the decoder should do)."""
    B, T, _ = x.shape
    n1, n2, attn, mlp = blk.input_layernorm, blk.post_attention_layernorm, blk.self_attn, blk.mlp
    y1 = rms_norm(x, n1.weight, n1.eps, impl=impl)
    q = attn.q_proj(y1).view(B, T, attn.n_heads, attn.head_dim)
    k = attn.k_proj(y1).view(B, T, attn.n_kv_heads, attn.head_dim)
    v = attn.v_proj(y1).view(B, T, attn.n_kv_heads, attn.head_dim)
    q, k = apply_rotary(q, k, cos, sin, impl=impl)
    a = attn.o_proj(attn.core(q, k, v).reshape(B, T, attn.n_heads * attn.head_dim))
    y2, h = add_rms_norm(a, x, n2.weight, n2.eps, impl=impl)  # h = x + a, y2 = norm(h)
    return h + mlp.down_proj(swiglu(mlp.gate_proj(y2), mlp.up_proj(y2), impl=impl))


def _run(device, dtype, T, impl):
    torch.manual_seed(0)
    blk = Block(CFG, 0).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    rot = RotaryEmbedding(CFG.resolved_head_dim, ROPE).to(device)
    cos, sin = rot(torch.arange(T, device=device).expand(2, T), dtype)
    x = torch.randn(2, T, CFG.d_model, device=device, dtype=dtype)
    g = torch.randn_like(x)
    outs = {}
    for name, fn in (
        ("block", lambda x_: blk(x_, cos, sin)),
        ("fused", lambda x_: fused_block(blk, x_, cos, sin, impl)),
    ):
        blk.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = fn(xi)
        out.backward(g)
        outs[name] = [out.detach(), xi.grad] + [p.grad for p in blk.parameters()]
    return outs


def test_cpu_torch_path_equals_block():
    outs = _run("cpu", torch.float32, 37, "torch")
    for a, b in zip(outs["fused"], outs["block"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_block(dtype):
    outs = _run("cuda", dtype, 300, "cuda")
    names = ["out", "dx"] + [n for n, _ in Block(CFG, 0).named_parameters()]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for name, a, b in zip(names, outs["fused"], outs["block"]):
        # relative to the tensor's scale: bf16 grads are sums over 600 tokens
        err = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))
        assert err < tol, f"{name} ({dtype}): max error {err:.2e} of its scale"
