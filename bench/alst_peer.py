"""The ALST-style peer megablu must beat: HF transformers' Llama of the same shape + gradient
checkpointing + DeepSpeed's TiledMLP (ceil(T/8192) shards) + TiledFusedLogitsLoss (logits
shards of ~1 GiB fp32), DeepSpeed's Arctic Long Sequence Training (ALST) recipe.

Its attention (`--attention`): sdpa (transformers' own, the default) or fa4: FlashAttention-4
registered through transformers' AttentionInterface (`fa4_attention`), called as megablu calls it
(megablu/ops/attention.py: the same import, the same checks, `flash_attn_func(q, k, v, causal=True)`
on (B, T, H, D), GQA unrepeated) plus the module's softmax scale: the strongest peer a user of
transformers can assemble. fa4 never falls back to SDPA: where FlashAttention-4 cannot run, the
script stops with the reason.

Measured by bench/train_bench.py's own `measure` (impl "alst", or "alst+fa4": one fwd+bwd, bf16,
batch 1, no optimizer, peak minus weights+grads over T, median of `iters` after a warm-up), so its
rows sit in the same table:
  python bench/alst_peer.py --T 32768,131072                   # GPU: prints JSON rows + a markdown table
  python bench/alst_peer.py --T 32768,131072 --attention fa4   # GPU (SM90, flash-attn-4): rows "alst+fa4"
  python bench/alst_peer.py --check                            # CPU: the peer's loss/grads == plain HF
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MLP_TOKENS_PER_SHARD = 8192
LOGITS_SHARD_BYTES = 1 << 30
ATTENTIONS = ("sdpa", "fa4")
# the name fa4_attention is registered under: without "flash" in it transformers treats it as a plain
# custom function (no hub-kernel look-up, and no mask is built for it: causal, unpadded)
FA4_NAME = "alst_fa4"


class Fa4Unavailable(RuntimeError):
    """FlashAttention-4 cannot run here: the fa4 peer stops instead of measuring SDPA under its name."""


def impl_name(attention: str) -> str:
    """The `impl` of the peer's rows: "alst" (SDPA) or "alst+fa4"."""
    if attention not in ATTENTIONS:
        raise ValueError(f"--attention must be one of {ATTENTIONS}, got {attention!r}")
    return "alst" if attention == "sdpa" else f"alst+{attention}"


def attention_of(impl: str) -> str:
    """The attention of a peer impl name (impl_name's inverse)."""
    for a in ATTENTIONS:
        if impl_name(a) == impl:
            return a
    raise ValueError(f"unknown peer impl {impl!r}: one of {[impl_name(a) for a in ATTENTIONS]}")


def fa4_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention interface (integrations/sdpa_attention.py's signature) on FlashAttention-4:
    query (B, H, T, D), key/value (B, Hkv, T, D) in; (out (B, T, H, D), None) out, as SDPA's returns."""
    from megablu.ops import attention as mb  # module attributes: a test swaps the kernel

    if attention_mask is not None or dropout or is_causal is False or kwargs.get("softcap"):
        raise Fa4Unavailable(
            f"the fa4 peer is causal only, without mask, dropout or softcap (mask "
            f"{None if attention_mask is None else tuple(attention_mask.shape)}, dropout {dropout}, "
            f"is_causal {is_causal}, softcap {kwargs.get('softcap')})"
        )
    if query.shape[2] != key.shape[2]:
        raise Fa4Unavailable(f"query length {query.shape[2]} != key length {key.shape[2]}: training steps only")
    # (B, H, T, D) -> (B, T, H, D): views, the head dim stays contiguous (FA4 takes any other strides)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    why = mb.fa4_problem(q, k) or mb.import_problem()
    if why is not None:
        raise Fa4Unavailable(why)
    res = mb._fa4_func()(q, k, v, softmax_scale=scaling, causal=True)
    # 4.0.0b40 returns (out, lse); an `out`-only return is accepted too (as megablu's fa4_causal)
    return (res[0] if isinstance(res, tuple) else res), None


def fa4_preflight(cfg) -> None:
    """Raise Fa4Unavailable, with the reason, unless FlashAttention-4 can run the bf16 peer of `cfg` on
    this machine's GPU: before any model is built, so a run on the wrong machine stops at once."""
    from megablu.ops import attention as mb

    if not torch.cuda.is_available():
        raise Fa4Unavailable("torch.cuda is not available: FlashAttention-4 runs on CUDA (SM90) only")
    D = cfg.resolved_head_dim
    why = mb.fa4_unsupported(
        torch.cuda.get_device_capability(), torch.bfloat16, torch.bfloat16, D, D, cfg.n_heads, cfg.n_kv_heads
    )
    why = why or mb.import_problem()
    if why is not None:
        raise Fa4Unavailable(why)


def _attn_implementation(attention: str) -> str:
    impl_name(attention)  # validates
    if attention == "sdpa":
        return "sdpa"
    from transformers import AttentionInterface

    AttentionInterface.register(FA4_NAME, fa4_attention)
    return FA4_NAME


def _tiled_mlp_forward(self, x):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = max(1, math.ceil(x.shape[1] / MLP_TOKENS_PER_SHARD))

    def mlp(mod, h):
        return mod.down_proj(mod.act_fn(mod.gate_proj(h)) * mod.up_proj(h))

    return TiledMLP.apply(mlp, self, x, shards, [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight])


def tiled_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token CE over the sequence without materialising [T, V] logits."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    h = model.model(input_ids=ids).last_hidden_state  # (B, T, d)
    x, y = h[:, :-1], ids[:, 1:]
    V = model.config.vocab_size
    shards = max(1, math.ceil(x.shape[1] * V * 4 / LOGITS_SHARD_BYTES))

    n = y.numel()

    # the weight grads are made inside forward with an incoming grad of 1, so each shard
    # returns its share of the mean itself (a later `/ n` would scale x's grad only)
    def loss_fn(mod, xs, ys):
        logits = mod.lm_head(xs).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, V), ys.reshape(-1), reduction="sum") / n

    return TiledFusedLogitsLoss.apply(loss_fn, model, x, y, None, shards, [model.lm_head.weight], "sum")


def build(cfg, rope, device: str, dtype: torch.dtype, max_position: int, alst: bool = True, attention: str = "sdpa"):
    import transformers
    from transformers.models.llama import modeling_llama

    from megablu.model.hf import hf_config_dict

    d = hf_config_dict(cfg, rope, max_position)  # positions only: the sequence length to build for
    d.pop("model_type", None), d.pop("architectures", None)
    attn = _attn_implementation(attention)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**d, attn_implementation=attn))
    if alst:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for m in hf.modules():
            if isinstance(m, modeling_llama.LlamaMLP):
                m.forward = _tiled_mlp_forward.__get__(m)
    return hf.to(device, dtype)


def check_on_cpu(attention: str = "sdpa", softmax_scale: float | None = None) -> None:
    """The peer computes what plain HF (SDPA) computes: same loss and grads (fp32, tiny shape). With
    attention="fa4" the peer's attention is fa4_attention: on CPU only with FA4's kernel replaced by a
    stand-in (tests/test_bench_peer.py), else it stops with the reason. softmax_scale, when given, is set
    as every attention module's `scaling` in both models (a scale other than FA4's 1/sqrt(D) default
    shows that the peer passes the module's own)."""
    import deepspeed.comm  # noqa: F401  (TiledMLP imports it)

    from megablu.config.schema import ModelConfig, RopeConfig

    global MLP_TOKENS_PER_SHARD, LOGITS_SHARD_BYTES
    MLP_TOKENS_PER_SHARD, LOGITS_SHARD_BYTES = 16, 16 * 97 * 4  # several shards at T=64
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97)
    rope = RopeConfig(theta=10000.0)
    torch.manual_seed(0)
    ref = build(cfg, rope, "cpu", torch.float32, 64, alst=False)
    peer = build(cfg, rope, "cpu", torch.float32, 64, alst=True, attention=attention)
    peer.load_state_dict(ref.state_dict())
    if softmax_scale is not None:
        for m in (*ref.modules(), *peer.modules()):
            if hasattr(m, "scaling") and hasattr(m, "num_key_value_groups"):  # LlamaAttention
                m.scaling = softmax_scale
    peer.train()
    ids = torch.randint(0, 97, (1, 64))
    a = ref(input_ids=ids, labels=ids).loss
    a.backward()
    b = tiled_loss(peer, ids)
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(ref.named_parameters(), peer.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    n_grads = sum(1 for _ in ref.parameters())
    print(f"{impl_name(attention)} peer == plain HF: loss {float(a.detach()):.6f}, {n_grads} grads equal")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--T", default="32768,131072")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument(
        "--attention",
        default="sdpa",
        choices=ATTENTIONS,
        help="the peer's attention: transformers' sdpa, or FlashAttention-4 through its AttentionInterface "
        "(SM90 and flash-attn-4; stops with the reason where it cannot run)",
    )
    p.add_argument("--check", action="store_true", help="CPU: peer loss/grads equal plain HF, then exit")
    a = p.parse_args()
    try:
        if a.check:
            check_on_cpu(a.attention)
            return 0
        from train_bench import BLU05B, measure  # the same method and shape as megablu's rows

        if a.attention == "fa4":
            fa4_preflight(BLU05B)
    except Fa4Unavailable as e:
        print(f"alst_peer.py --attention fa4: {e}", file=sys.stderr)
        return 2
    rows = []
    for T in (int(t) for t in a.T.split(",")):
        r = measure(impl_name(a.attention), "full", T, 0, a.iters)
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    print("| impl | T | peak GB | MB/token | step s | tokens/s | MFU |\n|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("oom"):
            print(f"| {r['impl']} | {r['T']} | OOM | | | | |")
        else:
            print(
                f"| {r['impl']} | {r['T']} | {r['peak_gb']:.1f} | {r['mb_per_token']:.3f} | {r['step_s']:.3f} | "
                f"{r['tokens_per_s'] / 1e3:.1f}k | {r['mfu']:.0%} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
