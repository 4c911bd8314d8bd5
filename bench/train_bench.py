"""Training-step memory and speed of BluModel (and, side by side, HF transformers' Llama).

One fwd+bwd per measurement, bf16, batch 1, no optimizer (bench/alst_peer.py's peer is measured
the same way). For each (impl, mode, T):
peak GB, the planner's prediction of it (megablu/plan/, same setup), MB/token (peak minus
weights+grads, over T), step seconds, tokens/s, MFU, and for offloaded modes the bytes
copied to pinned host memory per step (host GB).
MFU counts model flops only (6 N per token + causal attention 6 L T H D), no recompute,
against the H200's dense bf16 peak (megablu/utils/device.py PEAK_BF16_TFLOPS).

A mode is `<recompute>[+tiles[N]][+offload[+keepN][+fracF]][+liger][+fa4][+lchunkN][+fuseqkv][+fusegu][+fuseadd]`:
recompute none|selective|full, the MLP over N sequence tiles (memory.mlp_tiles; N defaults to --mlp-tiles), saved
activations offloaded to pinned host memory (memory.offload_activations), the lm head's loss through Liger's fused
linear cross-entropy (memory.loss=liger; else megablu's chunked loss of --loss-chunk tokens), the
causal attention through FlashAttention-4 (memory.attention=fa4; else SDPA), the fusions: q/k/v as one GEMM
(memory.fuse_qkv), gate/up as one GEMM (memory.fuse_gate_up), the MLP residual add inside the next block's input
norm (memory.fuse_block_add; not with full).

  python bench/train_bench.py --T 16384,32768 --modes none,selective,full --loss-chunk 4096 --hf
  python bench/train_bench.py --T 32768,131072 --modes selective,selective+tiles,selective+offload,full+tiles+offload
  python bench/train_bench.py --T 32768 --modes selective+offload,selective+offload+liger+fa4
Writes $OUT/train_bench.json when OUT is set and prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megablu.config.schema import MemoryConfig, ModelConfig, RopeConfig, YarnConfig  # noqa: E402
from megablu.memory.apply import apply_memory  # noqa: E402
from megablu.model.decoder import BluModel  # noqa: E402
from megablu.plan import Setup, estimate  # noqa: E402
from megablu.utils.device import peak_bf16_tflops  # noqa: E402

PEAK_TFLOPS = peak_bf16_tflops("NVIDIA H200")  # the one table: megablu/utils/device.py
BLU05B = ModelConfig(n_layers=36, d_model=1024, n_heads=16, n_kv_heads=4, ffn_dim=2816, vocab_size=100352)


def flops_per_token(cfg: ModelConfig, T: int) -> float:
    n = cfg.n_params() - cfg.vocab_size * cfg.d_model * (0 if cfg.tie_embeddings else 1)  # input embedding is a lookup
    attn = 6 * cfg.n_layers * T * cfg.n_heads * cfg.resolved_head_dim  # causal: half of 12
    return 6 * n + attn


FUSE_FLAGS = {"fuseqkv": "fuse_qkv", "fusegu": "fuse_gate_up", "fuseadd": "fuse_block_add"}


def parse_mode(mode: str, default_tiles: int = 8) -> dict:
    """'selective+tiles16+offload+keep8+liger+fa4+lchunk2048+fuseqkv' -> MemoryConfig fields (recompute, mlp_tiles,
    offload_activations, offload_keep, offload_fraction, loss, attention, loss_chunk: lchunkN overrides
    --loss-chunk for that mode; lchunk0 = Liger's own chunks, or megablu's loss unchunked; fuse_qkv,
    fuse_gate_up, fuse_block_add: set only by their flags, so the MemoryConfig default (off) applies without)."""
    recompute, *flags = mode.split("+")
    out = {"recompute": recompute, "mlp_tiles": 1, "offload_activations": False, "loss": "chunked", "attention": "sdpa"}
    for f in flags:
        if f.startswith("tiles"):
            out["mlp_tiles"] = int(f[5:]) if f[5:] else default_tiles
        elif f == "offload":
            out["offload_activations"] = True
        elif f.startswith("keep") and f[4:].isdigit():
            out["offload_keep"] = int(f[4:])
        elif f.startswith("frac"):
            out["offload_fraction"] = float(f[4:])
        elif f == "liger":
            out["loss"] = "liger"
        elif f == "fa4":
            out["attention"] = "fa4"
        elif f.startswith("lchunk") and f[6:].isdigit():
            out["loss_chunk"] = int(f[6:])
        elif f in FUSE_FLAGS:
            out[FUSE_FLAGS[f]] = True
        else:
            raise ValueError(
                f"mode {mode!r}: unknown flag {f!r} (tiles[N], offload, keepN, fracF, liger, fa4, lchunkN, "
                f"{', '.join(FUSE_FLAGS)})"
            )
    if out.get("fuse_block_add") and out["recompute"] == "full":
        raise ValueError(f"mode {mode!r}: fuseadd with full recompute is refused (memory.fuse_block_add)")
    return out


def memory_fields(mode: str, loss_chunk: int, mlp_tiles: int = 8) -> dict:
    """The MemoryConfig fields of a mode, with --loss-chunk where the mode has no lchunkN."""
    return {"loss_chunk": loss_chunk, **parse_mode(mode, mlp_tiles)}


def build(impl: str, mode: str, T: int, loss_chunk: int, ops: str = "auto", mlp_tiles: int = 8, device: str = "cuda"):
    """device: "cuda" for every measurement; "cpu" only for bench/profile_step.py's CPU rehearsal."""
    rope = (
        RopeConfig(theta=500000.0, yarn=YarnConfig(factor=T / 16384, original_max_position=16384))
        if T > 16384
        else RopeConfig(theta=500000.0)
    )
    if impl == "megablu":
        m = apply_memory(BluModel(BLU05B, rope), MemoryConfig(ops=ops, **memory_fields(mode, loss_chunk, mlp_tiles)))
        return m.to(device, torch.bfloat16)
    if impl.startswith("alst"):  # the ALST-style peer (bench/alst_peer.py): "alst" (SDPA) or "alst+fa4"
        import alst_peer

        attention = alst_peer.attention_of(impl)
        return alst_peer.build(BLU05B, rope, "cuda", torch.bfloat16, max_position=T, attention=attention).train()
    import transformers

    from megablu.model.hf import hf_config_dict

    d = hf_config_dict(BLU05B, rope, T)
    d.pop("model_type"), d.pop("architectures")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**d, attn_implementation="sdpa"))
    if mode == "full":
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return hf.to("cuda", torch.bfloat16)


def step(model, impl: str, ids: torch.Tensor):
    if impl == "megablu":
        s, n = model(ids, labels=ids)
        loss = s / n
    elif impl.startswith("alst"):
        import alst_peer

        loss = alst_peer.tiled_loss(model, ids)
    else:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def measure(
    impl: str,
    mode: str,
    T: int,
    loss_chunk: int,
    iters: int,
    ops: str = "auto",
    mlp_tiles: int = 8,
    warmup: bool = True,
) -> dict:
    row = {
        "impl": f"megablu/{ops}" if impl == "megablu" else impl,
        "mode": mode,
        "T": T,
        "loss_chunk": memory_fields(mode, loss_chunk, mlp_tiles)["loss_chunk"] if impl == "megablu" else None,
        "n_layers": BLU05B.n_layers,
    }
    model = None
    try:
        model = build(impl, mode, T, loss_chunk, ops, mlp_tiles)
        static = sum(p.numel() * p.element_size() * 2 for p in model.parameters())  # weights + grads
        ids = torch.randint(0, BLU05B.vocab_size, (1, T), device="cuda")
        if warmup:
            step(model, impl, ids)  # warmup (cuDNN autotune, allocator)
        else:  # very long T: one step is minutes; its time includes the first-call costs
            row["warmup"] = False
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step(model, impl, ids)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated()
        dt = sorted(times)[len(times) // 2]
        off = getattr(model, "offload", None)
        if impl == "megablu":  # the planner's prediction for the same step (no optimizer, no ZeRO)
            # the fusions save what the unfused step saves (tests/memory/test_fusions.py): not the planner's
            fields = {
                k: v for k, v in memory_fields(mode, loss_chunk, mlp_tiles).items() if k not in FUSE_FLAGS.values()
            }
            s = Setup(BLU05B, T, zero_stage=0, optimizer=False, ops="torch" if ops == "torch" else "cuda", **fields)
            row["planned_gb"] = estimate(s).allocated_gb
        row.update(
            peak_gb=peak / 1e9,
            mb_per_token=(peak - static) / T / 1e6,
            step_s=dt,
            tokens_per_s=T / dt,
            mfu=flops_per_token(BLU05B, T) * T / dt / 1e12 / PEAK_TFLOPS,
            host_gb=off.host_bytes / 1e9 if off is not None else 0.0,
        )
    except torch.cuda.OutOfMemoryError:
        row.update(oom=True)
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--T", default="16384,32768")
    p.add_argument(
        "--modes",
        default="none,selective,full",
        help="comma list of <recompute>[+tiles[N]][+offload], e.g. selective+tiles,full+tiles16+offload",
    )
    p.add_argument("--mlp-tiles", type=int, default=8, help="N of a bare '+tiles'")
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--hf", action="store_true", help="also HF Llama (plain and gradient checkpointing)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--ops", default="cuda", help="megablu elementwise ops: cuda, torch or both (cuda,torch)")
    p.add_argument("--no-warmup", action="store_true", help="measure the first step (very long T: one step only)")
    p.add_argument("--json", default="train_bench.json", help="file name under $OUT for the rows")
    p.add_argument(
        "--layers",
        type=int,
        default=0,
        help="blu-0.5b with this many layers instead of 36: a depth-truncated step for windows "
        "whose full-depth step outlasts a device call (experiments/speed/capacity.sh)",
    )
    a = p.parse_args()
    if a.layers:
        global BLU05B
        BLU05B = BLU05B.model_copy(update={"n_layers": a.layers})
    rows = []
    for T in [int(x) for x in a.T.split(",")]:
        for mode in a.modes.split(","):
            for ops in a.ops.split(","):
                rows.append(measure("megablu", mode, T, a.loss_chunk, a.iters, ops, a.mlp_tiles, not a.no_warmup))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if a.hf:
            for mode in ("none", "full"):
                rows.append(measure("hf", mode, T, 0, a.iters))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| impl | mode | T | loss chunk | peak GB | planned GB | MB/token | step s | tokens/s | MFU | host GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if a.layers:
            r = dict(r, mode=f"{r['mode']} ({r['n_layers']} layers)")
        if r.get("oom"):
            print(f"| {r['impl']} | {r['mode']} | {r['T']} | {r['loss_chunk']} | OOM | | | | | | |")
        else:
            planned = f"{r['planned_gb']:.1f}" if "planned_gb" in r else ""
            print(
                f"| {r['impl']} | {r['mode']} | {r['T']} | {r['loss_chunk']} | {r['peak_gb']:.1f} | {planned} | "
                f"{r['mb_per_token']:.3f} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['mfu']:.0%} | "
                f"{r.get('host_gb', 0.0):.1f} |"
            )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
