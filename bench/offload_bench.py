"""ZeRO-Offload on one GPU: the largest trainable window and the tokens/s each setting gives.

One (shape, setting) per process (a fresh CUDA context, so peaks do not leak between
settings). The step is the trainer's own: deepspeed_config() from megablu.train.trainer,
the same optimizer choice (torch fused AdamW, or DeepSpeed's CPU Adam when the optimizer is
offloaded), forward_backward() from megablu.train.step, random tokens, micro-batch 1, grad
accumulation 1, bf16, the config's memory section (base.yaml: selective recompute, loss
chunk 4096).

Largest window: the forward+backward peak is linear in T for this model (flash/SDPA
attention, chunked loss), so fb_peak(T) = a + b*T is fitted from two windows, T_max =
(budget - a)/b rounded down to 4096, and then VERIFIED by a real optimizer step at T_max.
The optimizer step's own peak (fp32 master/moments transients, T-independent) is measured
apart: fitting whole-step peaks mixes the two, and for the 1.5B shape at 8k the step peak
hid the activations, so the slope came out 0.52 MB/token instead of 0.70 and every
verification OOM'd (2026-12-03). On OOM the verification restarts in a FRESH process at
-10% (twice at most): an OOM in the middle of a ZeRO-2/3 backward leaves gradients
half-reduced, and the next backward in the same engine trips DeepSpeed's "gradient computed
twice" assertion. The row says which windows OOM'd.

  python bench/offload_bench.py --shape blu-0.5b --setting z2_opt      # prints one JSON line
Settings: z1 (no offload, base.yaml), z2_opt, z3_opt, z3_params (configs/zero*_offload*.yaml),
z3_opt_params (both offloads: zero3_offload_params + parallel.offload_optimizer=true).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = {
    "z1": ("base.yaml", ["parallel.sp=1"]),
    "z2_opt": ("zero2_offload_opt.yaml", []),
    "z3_opt": ("zero3_offload_opt.yaml", []),
    "z3_params": ("zero3_offload_params.yaml", []),
    "z3_opt_params": ("zero3_offload_params.yaml", ["parallel.offload_optimizer=true"]),
}
# blu-0.5b is base.yaml. The larger shape (stated, ~1.5B): Qwen2-1.5B-like depth with a
# Llama-style width: 28 layers, d=2048, 16 heads x 128, 8 kv heads, SwiGLU 5632, vocab 100352
# (cl100k padded), tied embeddings -> 1.53B parameters.
SHAPES = {
    "blu-0.5b": [],
    "blu-1.5b": [
        "model.n_layers=28",
        "model.d_model=2048",
        "model.n_heads=16",
        "model.n_kv_heads=8",
        "model.ffn_dim=5632",
        "model.tie_embeddings=true",
    ],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--setting", choices=sorted(SETTINGS), required=True)
    p.add_argument("--fit", default="16384,32768", help="two windows for the linear memory fit")
    p.add_argument("--verify", type=int, default=0, help="(internal) skip the fit, verify this window")
    p.add_argument("--row", default="{}", help="(internal) the row measured so far, as JSON")
    p.add_argument("--reserve-gb", type=float, default=6.0, help="kept free of the GPU's total (allocator slack)")
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")

    import deepspeed
    import torch

    from megablu.config import load_config
    from megablu.memory.apply import apply_memory
    from megablu.model.decoder import BluModel
    from megablu.parallel.groups import single_rank_groups
    from megablu.train.step import forward_backward
    from megablu.train.trainer import deepspeed_config, param_groups

    yml, sets = SETTINGS[a.setting]
    cfg = load_config(ROOT / "configs" / yml, sets + SHAPES[a.shape], world_size=1, device="cuda")
    row = {
        "shape": a.shape,
        "setting": a.setting,
        "zero_stage": cfg.parallel.zero_stage,
        "offload_optimizer": cfg.parallel.offload_optimizer,
        "offload_params": cfg.parallel.offload_params,
        "params_b": round(cfg.model.n_params() / 1e9, 3),
        "recompute": cfg.memory.recompute,
    }
    t_start = time.perf_counter()
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    model = apply_memory(BluModel(cfg.model, cfg.rope, seed=0), cfg.memory)
    ds = deepspeed_config(cfg, grad_accum=1, dp=1, device="cuda")
    opt = None
    if "optimizer" not in ds:
        opt = torch.optim.AdamW(param_groups(model, cfg.train.weight_decay), lr=1e-5, fused=True)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=opt,
        config=ds,
        model_parameters=None if opt is not None else param_groups(model, cfg.train.weight_decay),
    )
    groups = single_rank_groups()
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    budget = total_gb - a.reserve_gb
    row["setup_s"] = round(time.perf_counter() - t_start, 1)

    def step(T: int) -> tuple[float, float, float]:
        """One optimizer step at window T: (fwd+bwd peak GB, optimizer-step peak GB, seconds)."""
        ids = torch.randint(0, cfg.model.vocab_size, (1, T))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        forward_backward(
            engine,
            [{"input_ids": ids, "labels": ids.clone()}],
            groups,
            cfg.parallel.zero_stage,
            cfg.parallel.reduce_scatter,
            apply_step=False,
        )
        torch.cuda.synchronize()
        fb = torch.cuda.max_memory_allocated() / 1e9
        torch.cuda.reset_peak_memory_stats()
        engine.step()
        torch.cuda.synchronize()
        return fb, torch.cuda.max_memory_allocated() / 1e9, time.perf_counter() - t0

    if a.verify:
        row = json.loads(a.row)
        T = a.verify
    else:
        t1, t2 = (int(x) for x in a.fit.split(","))
        step(t1)  # warm-up (kernels, allocator, CPU Adam first call)
        m1, o1, _ = step(t1)
        m2, o2, s2 = step(t2)
        slope = (m2 - m1) / (t2 - t1)  # GB per token
        static = m1 - slope * t1
        row.update(
            fit_gb={t1: round(m1, 2), t2: round(m2, 2)},
            mb_per_token=round(slope * 1e3, 4),
            static_gb=round(static, 2),
            step_peak_gb=round(max(o1, o2), 2),
            tok_s_at_fit=round(t2 / s2),
            fit_T=t2,
            budget_gb=round(budget, 1),
        )
        T = int((budget - static) / slope) // 4096 * 4096
        row["predicted_T"] = T
        print(json.dumps(row), flush=True)  # the fit survives a verification that runs out of time
    try:
        fb, opt_peak, sec = step(T)
        row.update(max_T=T, verified=True, mem_at_max_gb=round(max(fb, opt_peak), 1), tok_s_at_max=round(T / sec))
    except (torch.OutOfMemoryError, RuntimeError) as e:  # DeepSpeed hooks may rewrap the OOM
        if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e):
            raise
        row.setdefault("oom_at", []).append(T)
        if len(row["oom_at"]) < 3:  # fresh process: this engine's ZeRO state is half-reduced
            row.pop("setup_s", None)
            print(json.dumps(row), flush=True)
            os.environ["MASTER_PORT"] = str(29511 + len(row["oom_at"]))  # the old store's port may linger
            os.execv(
                sys.executable,
                [
                    sys.executable,
                    __file__,
                    "--shape",
                    a.shape,
                    "--setting",
                    a.setting,
                    "--reserve-gb",
                    str(a.reserve_gb),
                    "--verify",
                    str(int(T * 0.9) // 4096 * 4096),
                    "--row",
                    json.dumps(row),
                ],
            )
        row.update(max_T=None, verified=False)
    row["total_s"] = round(time.perf_counter() - t_start, 1)  # this process only
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
