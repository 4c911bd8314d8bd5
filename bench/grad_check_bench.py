"""DeepSpeed's ZeRO-1 optimizer step with its own gradient checks against train.fused_grad_check (issue 17).

    python bench/grad_check_bench.py                       # CPU: 36 layers at width 64 (host cost, per tensor)
    source dev/device_env.sh && python bench/grad_check_bench.py --model l2 --out $OUT   # GPU: blu-0.5b

One process, one rank (gloo), bf16, ZeRO-1, torch AdamW (fused on CUDA), gradient clipping 1.0: the setup of
launch/ext32k.py on one GPU. A forward and backward on a short sequence fills the gradients (random tokens;
their values do not change the step's cost), then `engine.step()` is timed, --iters times per variant, the
variants interleaved (a forward and backward, untimed, before each). Per variant: the median step time (wall,
the GPU synchronised around each step), and the torch calls one step makes from Python, by name (a
TorchFunctionMode counts each call once: on a GPU each that computes is at least one kernel launch). The
step's cost does not depend on the sequence length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _dist_init():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29700 + os.getpid() % 200))
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)


def model_config(name: str):
    """blu-0.5b (configs/l2.yaml's model) or `small36`: the same 327 tensors (36 layers, untied head), small."""
    from megablu.config.schema import ModelConfig

    if name == "l2":
        from megablu.config import load_config

        path = Path(__file__).resolve().parents[1] / "configs/l2.yaml"
        return load_config(path, ["parallel.sp=1"], world_size=1).model
    return ModelConfig(n_layers=36, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=512)


def _model(name: str, device: str):
    from megablu.config.schema import RopeConfig
    from megablu.model.decoder import BluModel

    mc = model_config(name)
    m = BluModel(mc, RopeConfig(theta=10000.0))
    m.reset_parameters(seed=0)
    return m, mc


def _engine(model, fused: bool, device: str):
    import deepspeed

    from megablu.train import grad_check
    from megablu.train.trainer import param_groups

    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, **({"fused": True} if device == "cuda" else {}))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    if fused:
        why = grad_check.install(engine.optimizer)
        assert why is None, why
    return engine


def _calls(engine) -> Counter:
    from torch.overrides import TorchFunctionMode

    seen: Counter = Counter()

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen[getattr(func, "__name__", str(func))] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        engine.step()
    return seen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("small36", "l2"), default="small36")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--T", type=int, default=256, help="tokens of the one forward that fills the gradients")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    _dist_init()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    engines, calls = {}, {}
    toks = None

    def backward(e):  # DeepSpeed drops the gradients at each step: a forward and backward before each
        loss_sum, count = e(toks[:, :-1], labels=toks[:, 1:])
        e.backward(loss_sum / count)

    for fused in (False, True):
        model, mc = _model(a.model, device)
        e = _engine(model, fused, device)
        toks = torch.randint(0, mc.vocab_size, (1, a.T + 1), generator=torch.Generator().manual_seed(0)).to(device)
        backward(e)
        calls[fused] = _calls(e)  # also the warm-up step
        engines[fused] = e
    times = {False: [], True: []}
    for _ in range(a.iters):
        for fused, e in engines.items():
            backward(e)
            sync()
            t0 = time.perf_counter()
            e.step()
            sync()
            times[fused].append(time.perf_counter() - t0)
    n_tensors = sum(1 for _ in engines[True].module.parameters())
    rows = []
    for fused in (False, True):
        c = calls[fused]
        rows.append(
            {
                "variant": "fused" if fused else "deepspeed",
                "model": a.model,
                "device": device,
                "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                "tensors": n_tensors,
                "step_ms": 1e3 * statistics.median(times[fused]),
                "torch_calls": sum(c.values()),
                "top_calls": dict(c.most_common(8)),
                "torch": torch.__version__,
                "check_calls": {
                    n: c[n] for n in ("amax", "amin", "isfinite", "linalg_vector_norm", "to", "_foreach_norm")
                },
            }
        )
    md = [
        f"ZeRO-1 bf16 optimizer step, {a.model} ({n_tensors} parameter tensors), {device}"
        f"{' ' + rows[0]['gpu'] if rows[0]['gpu'] else ''}, median of {a.iters}",
        "",
        "| gradient checks | step ms | torch calls per step | most frequent |",
        "|---|---|---|---|",
    ]
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in list(r["top_calls"].items())[:5])
        md.append(f"| {r['variant']} | {r['step_ms']:.2f} | {r['torch_calls']} | {top} |")
    print("\n".join(md))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "grad_check_bench.json").write_text(json.dumps(rows, indent=1))
        (Path(a.out) / "grad_check_bench.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
