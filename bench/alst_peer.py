"""The ALST-style peer megablu must beat: HF transformers' Llama of the same shape + gradient
checkpointing + DeepSpeed's TiledMLP (ceil(T/8192) shards) + TiledFusedLogitsLoss (logits
shards of ~1 GiB fp32), DeepSpeed's Arctic Long Sequence Training (ALST) recipe.

Measured by bench/train_bench.py's own `measure` (impl "alst": one fwd+bwd, bf16, batch 1, no
optimizer, peak minus weights+grads over T, median of `iters` after a warm-up), so its rows
sit in the same table:
  python bench/alst_peer.py --T 32768,131072            # GPU: prints JSON rows + a markdown table
  python bench/alst_peer.py --check                     # CPU: the peer's loss/grads == plain HF
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


def build(cfg, rope, device: str, dtype: torch.dtype, max_position: int, alst: bool = True):
    import transformers
    from transformers.models.llama import modeling_llama

    from megablu.model.hf import hf_config_dict

    d = hf_config_dict(cfg, rope, max_position)  # positions only: the sequence length to build for
    d.pop("model_type", None), d.pop("architectures", None)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**d, attn_implementation="sdpa"))
    if alst:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for m in hf.modules():
            if isinstance(m, modeling_llama.LlamaMLP):
                m.forward = _tiled_mlp_forward.__get__(m)
    return hf.to(device, dtype)


def check_on_cpu() -> None:
    """The peer computes what plain HF computes: same loss and grads (fp32, tiny shape)."""
    import deepspeed.comm  # noqa: F401  (TiledMLP imports it)

    from megablu.config.schema import ModelConfig, RopeConfig

    global MLP_TOKENS_PER_SHARD, LOGITS_SHARD_BYTES
    MLP_TOKENS_PER_SHARD, LOGITS_SHARD_BYTES = 16, 16 * 97 * 4  # several shards at T=64
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97)
    rope = RopeConfig(theta=10000.0)
    torch.manual_seed(0)
    ref = build(cfg, rope, "cpu", torch.float32, 64, alst=False)
    peer = build(cfg, rope, "cpu", torch.float32, 64, alst=True)
    peer.load_state_dict(ref.state_dict())
    peer.train()
    ids = torch.randint(0, 97, (1, 64))
    a = ref(input_ids=ids, labels=ids).loss
    a.backward()
    b = tiled_loss(peer, ids)
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(ref.named_parameters(), peer.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    print(f"alst peer == plain HF: loss {float(a.detach()):.6f}, {sum(1 for _ in ref.parameters())} grads equal")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--T", default="32768,131072")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--check", action="store_true", help="CPU: peer loss/grads equal plain HF, then exit")
    a = p.parse_args()
    if a.check:
        check_on_cpu()
        return 0
    from train_bench import measure  # the same method as megablu's rows

    rows = []
    for T in (int(t) for t in a.T.split(",")):
        r = measure("alst", "full", T, 0, a.iters)
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
