"""mlp_tiles and offload_activations under DeepSpeed ZeRO 1/2/3 and Ulysses SP (gloo, CPU):
the reduced gradient equals a one-rank plain-path reference, as in test_sp_parity.

ZeRO-3 is the case that needs its own code: a partitioned weight has shape [0] outside its
module's call, so the tiled MLP accumulates into .grad with `ds_grad_is_ready` there
(memory/tiled.py `_backward_zero3`) instead of returning the weights' gradients.
"""

from __future__ import annotations

import pytest
import torch

from megablu.config.schema import MemoryConfig
from megablu.memory.apply import apply_memory
from megablu.memory.offload import ActivationOffload
from megablu.model.decoder import BluModel
from tests.dist_utils import run_distributed
from tests.parallel.test_sp_parity import ROPE, _model_cfg, _reference, engine_grads


def _worker(rank, world, cases):
    from megablu.parallel.groups import build_groups
    from megablu.parallel.ulysses import apply_ulysses

    results = []
    for c in cases:
        g = build_groups(c["sp"])
        model = BluModel(_model_cfg(4, 2), ROPE)
        model.reset_parameters(seed=0)
        apply_memory(model, MemoryConfig(**c["memory"]))
        if model.offload is not None:  # CPU: the copy path (every saved tensor through pack/unpack)
            model.offload = ActivationOffload(min_bytes=0, copy_cpu=True)
        apply_ulysses(model, g)
        results.append(engine_grads(model, g, c["stage"], c["T"], zero=c.get("zero")))
    return results


CASES = [
    dict(stage=1, sp=2, T=32, memory=dict(recompute="selective", mlp_tiles=3, offload_activations=True)),
    dict(stage=2, sp=1, T=31, memory=dict(recompute="full", mlp_tiles=2, offload_activations=True)),
    dict(stage=3, sp=2, T=32, memory=dict(recompute="none", mlp_tiles=3)),
    dict(stage=3, sp=1, T=32, memory=dict(recompute="selective", mlp_tiles=3, offload_activations=True)),
    # offload without tiles: the reentrant checkpoints (their inputs go to host) under ZeRO
    dict(stage=3, sp=2, T=32, memory=dict(recompute="full", offload_activations=True)),
    dict(stage=2, sp=2, T=31, memory=dict(recompute="selective", offload_activations=True)),
]
_FUSED = dict(fuse_qkv=True, fuse_gate_up=True, fuse_block_add=True)
_PROJ = dict(fuse_qkv=True, fuse_gate_up=True)
# the fusions (test_fusions.py): under ZeRO-3 the fused projections read q/k/v's and gate/up's weights without
# calling their modules, so apply_memory registers them as external parameters of the module that reads them.
# Persistence threshold 0: every weight partitioned (ZeRO-3 keeps ones under 1e5 elements whole by default)
_Z3 = dict(stage=3, zero=dict(stage3_param_persistence_threshold=0))
FUSED_CASES = [
    dict(**_Z3, sp=2, T=32, memory=dict(recompute="none", **_FUSED)),
    dict(**_Z3, sp=2, T=32, memory=dict(recompute="selective", mlp_tiles=3, offload_activations=True, **_FUSED)),
    dict(**_Z3, sp=1, T=31, memory=dict(recompute="none", mlp_tiles=3, **_FUSED)),  # the tiled ZeRO-3 backward
    dict(**_Z3, sp=2, T=32, memory=dict(recompute="full", offload_activations=True, **_PROJ)),
    dict(stage=1, sp=2, T=31, memory=dict(recompute="selective", offload_activations=True, **_FUSED)),
]


def _check(cases, results, world):
    for c, (loss, grads) in zip(cases, results):
        ref_loss, ref_grads = _reference(4, 2, c["T"], world // c["sp"])
        assert loss == pytest.approx(ref_loss, rel=1e-5), c
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=2e-4, atol=2e-6, msg=lambda m: f"{c} {n}: {m}")


def test_switches_under_zero_and_ulysses_match_one_rank():
    _check(CASES, run_distributed(_worker, 2, CASES), 2)


def test_fusions_under_zero3_and_ulysses_match_one_rank():
    """fuse_qkv, fuse_gate_up, fuse_block_add under ZeRO-3 (partitioned weights gathered per module) and sp=2,
    with the memory modes that wrap a block: the plain unfused one-rank model's loss and gradients."""
    _check(FUSED_CASES, run_distributed(_worker, 2, FUSED_CASES), 2)
