"""memory.mlp_tiles / memory.offload_activations: YAML fields, one test per invariant
(rejected with the field, the values and the fix), the warning, and the combinations allowed."""
import pytest

from megablu.config import config_warnings, load_config
from megablu.config.schema import MemoryConfig

from .test_invariants import EXT, errors


def test_fields_from_yaml_and_defaults():
    assert MemoryConfig().mlp_tiles == 1 and MemoryConfig().offload_activations is False
    cfg = load_config(EXT, ["memory.mlp_tiles=8", "memory.offload_activations=true", "memory.recompute=full"],
                      world_size=2, device="cuda")
    assert cfg.memory.mlp_tiles == 8 and cfg.memory.offload_activations is True
    assert any(e.startswith("memory.mlp_tiles") for e in errors(["memory.mlp_tiles=0"]))


@pytest.mark.parametrize("sets", [
    ["memory.recompute=selective", "memory.mlp_tiles=16"],
    ["memory.recompute=selective", "memory.offload_activations=true"],
    # full + offload: the layer inputs (the checkpoints) go to host; ALST's recipe, kept
    ["memory.recompute=full", "memory.offload_activations=true", "memory.mlp_tiles=4"],
    ["memory.recompute=none", "memory.offload_activations=true", "memory.mlp_tiles=8"],
])
def test_combinations_allowed(sets):
    assert errors(sets) == []


def test_tiles_at_most_tokens_per_rank():
    # ext32k: window 32768, sp 2, micro_batch 1 -> 16384 tokens per rank
    assert errors(["memory.mlp_tiles=16384"]) == []
    errs = errors(["memory.mlp_tiles=16385"])
    assert len(errs) == 1
    assert "memory.mlp_tiles=16385 > tokens per rank 16384" in errs[0] and "1*ceil(32768/2)" in errs[0]
    assert "set memory.mlp_tiles <= 16384" in errs[0]


def test_offload_of_untiled_mlp_intermediates_rejected():
    errs = errors(["memory.recompute=none", "memory.offload_activations=true"])
    assert len(errs) == 1
    assert errs[0].startswith("memory.offload_activations with memory.recompute=none and memory.mlp_tiles=1")
    assert "set memory.recompute=selective (or full), or memory.mlp_tiles >= 2" in errs[0]


def test_offload_on_cpu_rejected():
    errs = errors(["memory.offload_activations=true", "memory.recompute=selective", "train.dtype=fp32"],
                  device="cpu")
    assert errs == ["memory.offload_activations on a CPU run has no effect (activations already live in host "
                    "memory); set it false"]


def test_tiles_without_recompute_warns():
    cfg = load_config(EXT, ["memory.recompute=none", "memory.mlp_tiles=4"], world_size=2, device="cuda")
    assert any(w.startswith("memory.mlp_tiles>1 with memory.recompute=none") for w in config_warnings(cfg))
    cfg = load_config(EXT, ["memory.recompute=selective", "memory.mlp_tiles=4"], world_size=2, device="cuda")
    assert not any("mlp_tiles" in w for w in config_warnings(cfg))
