"""Planner vs probe on one GPU: blu-0.5b, fwd+bwd without optimizer (the BENCHMARKS method).

  python bench/probe_validate.py --T 16k,64k,128k --modes none,selective,full [--ops auto,torch]

One table row per (mode, T, ops) on stdout, JSON to $OUT/probe_validate.json; exit 1 when a
measured peak is off the planner by more than --tol (an OOM the planner foresaw, i.e.
predicted above the GPU, counts as agreement). The measurement is megablu's own probe
(megablu/train/probe.py run_probe); results are in experiments/speed/LOG.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megablu import plan  # noqa: E402
from megablu.config.schema import MemoryConfig, ModelConfig, RopeConfig, YarnConfig  # noqa: E402
from megablu.memory.apply import apply_memory  # noqa: E402
from megablu.model.decoder import BluModel  # noqa: E402
from megablu.train.probe import GB, ProbeOOM, run_probe  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/probe_validate.py")
    p.add_argument("--T", default="16k,64k,128k")
    p.add_argument("--modes", default="none,selective,full")
    p.add_argument("--ops", default="auto", help="comma list of memory.ops: auto, torch, cuda")
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tol", type=float, default=0.10)
    a = p.parse_args(argv)
    m = ModelConfig(n_layers=36, d_model=1024, n_heads=16, n_kv_heads=4, ffn_dim=2816, vocab_size=100352)
    total = torch.cuda.get_device_properties(0).total_memory / GB
    rows, bad = [], 0
    for T in plan.parse_tokens(a.T):
        rope = (
            RopeConfig(theta=500000.0, yarn=YarnConfig(factor=T / 16384, original_max_position=16384))
            if T > 16384
            else RopeConfig(theta=500000.0)
        )
        for mode in a.modes.split(","):
            for ops in a.ops.split(","):
                setup = {
                    "model": m.model_dump(),
                    "window": T,
                    "gpus": 1,
                    "sp": 1,
                    "zero_stage": 0,
                    "recompute": mode,
                    "loss_chunk": a.loss_chunk,
                    "micro_batch": 1,
                    "ops": "torch" if ops == "torch" else "cuda",
                    "ops_config": ops,
                    "optimizer": False,
                }
                model = apply_memory(BluModel(m, rope), MemoryConfig(recompute=mode, loss_chunk=a.loss_chunk, ops=ops))
                model = model.to("cuda", torch.bfloat16)
                ids = torch.randint(0, m.vocab_size, (1, T), device="cuda")

                def step(i):
                    s, n = model(ids, labels=ids)
                    (s / n).backward()

                row = {"T": T, "mode": mode, "ops_config": ops}
                try:
                    r = run_probe(
                        step,
                        steps=a.steps,
                        tokens_per_rank=T,
                        device="cuda",
                        setup=setup,
                        flops_per_token=plan.flops_per_token(m, T),
                    )
                except ProbeOOM as e:
                    r = e.measured
                    print(str(e), file=sys.stderr)
                est = plan.estimate(plan.Setup.from_json(setup))
                row.update(
                    ops=setup["ops"],
                    planned_gb=est.allocated_gb,
                    phase=est.phase,
                    peak_gb=r.get("peak_gb"),
                    static_gb=r.get("static_gb"),
                    oom=r.get("oom", False),
                    per_token_mb=r.get("per_token_mb"),
                    step_time_s=r.get("step_time_s"),
                    tokens_per_s=r.get("tokens_per_s"),
                    mfu=r.get("mfu"),
                )
                if row["oom"]:
                    row["ok"] = est.allocated_gb > total * 0.95
                else:
                    row["err"] = est.allocated_gb / row["peak_gb"] - 1
                    row["ok"] = abs(row["err"]) <= a.tol
                bad += not row["ok"]
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                model = ids = step = None  # freed before the next row (step holds them by name)
                gc.collect()
                torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name()} ({total:.1f} GB), torch {torch.__version__}")
    print("| T | recompute | ops | measured peak GB | planned GB | error | phase | MB/token | tokens/s | MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        meas = "OOM" if r["oom"] else f"{r['peak_gb']:.2f}"
        err = "" if r["oom"] else f"{r['err']:+.1%}"
        tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") and not r["oom"] else ""
        mfu = f"{r['mfu']:.0%}" if r.get("mfu") and not r["oom"] else ""
        mbt = f"{r['per_token_mb']:.3f}" if r.get("per_token_mb") is not None and not r["oom"] else ""
        print(
            f"| {r['T']} | {r['mode']} | {r['ops']} | {meas} | {r['planned_gb']:.2f} | {err} | {r['phase']} | "
            f"{mbt} | {tps} | {mfu} |"
        )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_validate.json").write_text(json.dumps(rows, indent=1))
    print(f"{len(rows) - bad}/{len(rows)} within {a.tol:.0%}")
    return 1 if bad else 0


if __name__ == "__main__":
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
