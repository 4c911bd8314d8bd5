"""train.fused_grad_check (megablu/train/grad_check.py) against DeepSpeed's own checks: the same steps.

Two engines from the same weights on two gloo ranks, ZeRO-1 and ZeRO-2, fp32 and bf16, AdamW with a clip that
engages: one with DeepSpeed's per-tensor checks, one with the fused ones. Every step's grad norm and the
weights after the steps must agree; a step with one infinite or NaN gradient element (on one rank only) must
be skipped by both. A profile of the step says the fused check runs no per-tensor kernels.
"""

from __future__ import annotations

import math

import pytest
import torch

from megablu.config.schema import ModelConfig, RopeConfig
from megablu.model.decoder import BluModel
from megablu.train import grad_check
from tests.dist_utils import run_distributed

VOCAB = 64
STEPS = 4
BAD_STEP = 2  # 0-based: this step's gradient gets one bad element on rank 0


def _model(n_layers=2):
    m = BluModel(
        ModelConfig(n_layers=n_layers, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=40, vocab_size=VOCAB),
        RopeConfig(theta=10000.0),
    )
    m.reset_parameters(seed=0)
    return m


def _engine(model, stage, dtype, fused, clip=0.05, ga=1, extra=None):
    import deepspeed

    from megablu.train.trainer import param_groups

    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": clip,
        # no clip: no norm either, so the overflow check alone must catch a bad gradient
        "zero_optimization": {"stage": stage, **({} if clip else {"compute_grad_norm": False}), **(extra or {})},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }
    if dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    # the trainer's two groups (matrices with weight decay, norms without): the checks run per group
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    if fused:
        assert grad_check.install(engine.optimizer) is None
    return engine


def _run(c, fused, rank):
    """Per optimizer step (grad norm, whether the weights moved); the weights at the end."""
    ga = c.get("ga", 1)
    engine = _engine(_model(), c["stage"], c["dtype"], fused, c["clip"], ga, c.get("extra"))
    g = torch.Generator().manual_seed(100 + rank)
    # a matrix (first group) or a norm weight (second group, no weight decay) gets the bad element
    target = dict(engine.module.named_parameters())[c.get("target", "layers.1.mlp.down_proj.weight")]
    out = []
    for step in range(STEPS):
        before = [p.detach().float().clone() for p in engine.module.parameters()]
        for micro in range(ga):
            toks = torch.randint(0, VOCAB, (1, 17), generator=g)
            hook = None
            if c["bad"] is not None and step == BAD_STEP and rank == 0 and micro == ga - 1:

                def poison(grad):
                    grad = grad.clone()
                    grad.view(-1)[7] = c["bad"]
                    return grad

                hook = target.register_hook(poison)
            loss_sum, count = engine(toks[:, :-1], labels=toks[:, 1:])
            engine.backward(loss_sum / count)
            engine.step()
            if hook is not None:
                hook.remove()
        moved = any(not torch.equal(b, p.detach().float()) for b, p in zip(before, engine.module.parameters()))
        norm = engine.get_global_grad_norm()
        out.append((float(norm) if norm is not None else None, moved))
    # the fp32 master weights (bf16's module weights round a 1e-6 difference to 0 or 1 ulp)
    weights = {f"master{i}": t.detach().clone() for i, t in enumerate(engine.optimizer.single_partition_of_fp32_groups)}
    if c["dtype"] == "fp32":
        weights.update({n: p.detach().float().clone() for n, p in engine.module.named_parameters()})
    return out, weights


def _worker(rank, world, cases):
    return [(_run(c, fused=False, rank=rank), _run(c, fused=True, rank=rank)) for c in cases]


NORM = "layers.0.post_attention_layernorm.weight"
INF, NAN = float("inf"), float("nan")
# with no clip (and no norm) a bf16 step relies on the overflow check alone; ga: gradient accumulation (the
# 32k configs use 4); extra: ZeRO-2 with its comm overlap and contiguous gradient buffers
CASES = [
    dict(stage=1, dtype="fp32", bad=None, clip=0.05),
    dict(stage=2, dtype="fp32", bad=None, clip=0.05),
    dict(stage=1, dtype="bf16", bad=None, clip=0.05),
    dict(stage=2, dtype="bf16", bad=None, clip=0.05),
    dict(stage=1, dtype="fp32", bad=INF, clip=0.05),
    dict(stage=2, dtype="fp32", bad=NAN, clip=0.05),
    dict(stage=1, dtype="bf16", bad=NAN, clip=0.05),
    dict(stage=2, dtype="bf16", bad=-INF, clip=0.05),
    dict(stage=1, dtype="bf16", bad=NAN, clip=0.0),
    dict(stage=2, dtype="bf16", bad=INF, clip=0.0),
    dict(stage=1, dtype="bf16", bad=NAN, clip=0.0, target=NORM),
    dict(stage=2, dtype="bf16", bad=-INF, clip=0.0, target=NORM),
    dict(stage=1, dtype="bf16", bad=INF, clip=0.05, ga=2, target=NORM),
    dict(stage=2, dtype="bf16", bad=NAN, clip=0.05, ga=2, extra={"overlap_comm": True, "contiguous_gradients": True}),
]


def test_fused_check_takes_deepspeeds_steps():
    results = run_distributed(_worker, 2, CASES)
    for c, ((stock, w_stock), (fused, w_fused)) in zip(CASES, results):
        case, bad, clip = str(c), c["bad"], c["clip"]
        for step, ((n_s, moved_s), (n_f, moved_f)) in enumerate(zip(stock, fused)):
            if bad is not None and step == BAD_STEP:
                # both skip the step: the weights stay, and neither reports a finite norm
                assert not moved_s and not moved_f, case
                assert n_s is None or not math.isfinite(n_s), (case, n_s)
                assert n_f is None or not math.isfinite(n_f), (case, n_f)
                continue
            assert moved_s and moved_f, (case, step)
            if clip:
                assert n_s > clip, (case, step, n_s)  # the clip engaged
                assert n_f == pytest.approx(n_s, rel=1e-5), (case, step)
        assert set(w_fused) == set(w_stock) and any(n.startswith("master") for n in w_stock)
        for n in w_stock:
            torch.testing.assert_close(w_fused[n], w_stock[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {n}: {m}")


def _check_ops(stage, n_layers, fused):
    """How often Python called each check op in one engine step (a TorchFunctionMode sees each call once:
    on a GPU one call is one launch, where torch.profiler on the CPU also lists a fallback's inner loop)."""
    from torch.overrides import TorchFunctionMode

    names = ("amax", "amin", "isfinite", "linalg_vector_norm", "_foreach_norm")
    counts = {n: 0 for n in names}

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in counts:
                counts[name] += 1
            return func(*args, **(kwargs or {}))

    engine = _engine(_model(n_layers), stage, "bf16", fused)  # fp32: DeepSpeed runs no overflow check
    toks = torch.randint(0, VOCAB, (1, 17), generator=torch.Generator().manual_seed(0))
    loss_sum, count = engine(toks[:, :-1], labels=toks[:, 1:])
    engine.backward(loss_sum / count)
    with Count():
        engine.step()
    return counts, len(engine.optimizer.bit16_groups)


def _ops_worker(rank, world):
    return {
        (stage, n, fused): _check_ops(stage, n, fused) for stage in (1, 2) for n in (2, 6) for fused in (False, True)
    }


def test_fused_check_runs_no_per_tensor_kernels():
    r = run_distributed(_ops_worker, 1)
    for stage in (1, 2):
        (small, groups), (big, _) = r[(stage, 2, True)], r[(stage, 6, True)]
        # one max-abs pass for the overflow and one L2 pass per param group, whatever the tensor count
        assert small == big, (stage, small, big)
        # (one vector_norm: DeepSpeed combining the groups' norms)
        assert small["amax"] == small["amin"] == 0 and small["linalg_vector_norm"] <= 1, small
        assert small["_foreach_norm"] == 1 + groups, small
        # DeepSpeed's own: per tensor, so it grows with the layers (what the test would see if install failed)
        stock_small, stock_big = r[(stage, 2, False)][0], r[(stage, 6, False)][0]
        assert stock_big["amax"] > stock_small["amax"] > 0, (stock_small, stock_big)
        assert stock_big["linalg_vector_norm"] > stock_small["linalg_vector_norm"] > 0, (stock_small, stock_big)


def test_install_leaves_other_optimizers_alone(monkeypatch):
    assert "not ZeRO-1/2" in grad_check.install(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1))
    import deepspeed

    # another DeepSpeed: its methods may mean something else under the same names
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    why = grad_check.install(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1))
    assert "DeepSpeed 0.20.0" in why and "0.19.8" in why and "train.fused_grad_check=false" in why


def test_nonfinite_any_and_sum_of_squares():
    t = [torch.ones(3), torch.arange(4.0), torch.zeros(0)]
    assert not grad_check.nonfinite_any(t, "cpu").item()
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = [x.clone() for x in t]
        u[1][2] = bad
        assert grad_check.nonfinite_any(u, "cpu").item(), bad
    assert not grad_check.nonfinite_any([], "cpu").item()
    # a finite value whose square overflows float32 is still finite for the overflow check
    assert not grad_check.nonfinite_any([torch.tensor([3e38, -3e38])], "cpu").item()
    assert grad_check.sum_of_squares(t).item() == pytest.approx(3 + 0 + 1 + 4 + 9)
    # mixed kinds (one multi-tensor pass each): bf16, fp32 and a float64 that float32 norms would not take
    mixed = [torch.ones(3, dtype=torch.bfloat16), torch.arange(4.0), torch.full((2,), 1e200, dtype=torch.float64)]
    assert grad_check.sum_of_squares(mixed[:2]).item() == pytest.approx(3 + 14)
    assert grad_check.sum_of_squares(mixed).item() == math.inf  # 2e400 as the float32 DeepSpeed returns
    assert not grad_check.nonfinite_any(mixed, "cpu").item()
    for i in range(3):  # a bad value in each kind's pass
        u = [x.clone() for x in mixed]
        u[i][1] = float("nan")
        assert grad_check.nonfinite_any(u, "cpu").item(), i
    # NaN and inf reach the norm (DeepSpeed's masking then marks the step bad)
    assert math.isnan(grad_check.sum_of_squares([torch.tensor([1.0, float("nan")])]).item())
    assert grad_check.sum_of_squares([torch.tensor([1.0, float("inf")])]).item() == math.inf


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the CUDA multi-tensor kernels")
def test_nonfinite_any_on_cuda():
    """The CUDA _foreach_norm kernels: many tensors of mixed sizes (several launches), each bad value in turn."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) for n in [1, 7, 4096, 65537] * 100]
    assert not grad_check.nonfinite_any(ts, "cuda").item()
    for bad in (float("nan"), float("inf"), float("-inf")):
        for i in (0, 150, len(ts) - 1):
            u = list(ts)
            u[i] = ts[i].clone()
            u[i][-1] = bad
            assert grad_check.nonfinite_any(u, "cuda").item(), (bad, i)
    want = sum(float(t.double().pow(2).sum()) for t in ts)
    assert grad_check.sum_of_squares(ts).item() == pytest.approx(want, rel=1e-5)
    for bad, check in ((float("nan"), math.isnan), (float("inf"), math.isinf)):
        u = list(ts)
        u[150] = ts[150].clone()
        u[150][-1] = bad
        assert check(grad_check.sum_of_squares(u).item()), bad
