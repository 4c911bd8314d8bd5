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
        results.append(engine_grads(model, g, c["stage"], c["T"]))
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


def test_switches_under_zero_and_ulysses_match_one_rank():
    world = 2
    results = run_distributed(_worker, world, CASES)
    for c, (loss, grads) in zip(CASES, results):
        ref_loss, ref_grads = _reference(4, 2, c["T"], world // c["sp"])
        assert loss == pytest.approx(ref_loss, rel=1e-5), c
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=2e-4, atol=2e-6, msg=lambda m: f"{c} {n}: {m}")
