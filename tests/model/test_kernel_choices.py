"""The whole tiny BluModel (tests/configs/tiny_cpu.yaml's model: 4 layers, d=128, 4/2 heads x 32,
vocab 4096, tied embeddings) with memory.loss=liger against chunked, and memory.attention=fa4
against sdpa: the summed loss, the labelled-token count, dh (the grad at the head's input, the
final norm's output), dW (the head weight's grad, which is the embedding's when tied) and every
parameter's grad, under bf16 on the GPU.

Skips cleanly without CUDA or without the library (liger-kernel, flash-attn-4): the H200 runs
it (experiments/speed/kernels.sh). The liger test also runs on a CPU in Triton's interpreter, in fp32,
when asked (never in CI: needs triton + liger-kernel importable, slow):
    MEGABLU_TRITON_INTERPRET_TESTS=1 TRITON_INTERPRET=1 PYTHONPATH=<triton+liger site> \\
        python -m pytest tests/model/test_kernel_choices.py -k liger
Tolerances (bf16; both paths see the same bf16 weights and inputs):
  loss: 1e-3 relative (Liger and chunked both form bf16 logits and sum fp32 losses; the bench
        measured both within 2e-6 of an fp32 reference at 32k, the rest is the rounding of
        the bf16 hidden states they receive, identical here);
  grads: relative Frobenius error ||a - b|| / ||b|| <= 2e-2 for dh, dW and every parameter
        (bf16 carries 2^-8 = 3.9e-3 per element; the bench measured dh 1.7e-3 and dW 1.7e-3
        for Liger with fp32 accumulation and 2.3e-3 for chunked, each against fp32, and the
        difference then passes through 4 layers' bf16 backward); fa4 vs sdpa the same bound.
In fp32 (the interpreter): loss 1e-5 relative, grads 1e-4 relative Frobenius.
"""

import os
from pathlib import Path

import pytest
import torch
import yaml

from megablu.config.schema import MemoryConfig, ModelConfig, RopeConfig
from megablu.memory.apply import apply_memory
from megablu.model.decoder import BluModel
from megablu.ops.cross_entropy import IGNORE_INDEX, liger_import_problem
from megablu.utils.liger import liger_mem_const
from tests.ops.test_attention import _fa4_ready

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelConfig(**yaml.safe_load((ROOT / "tests" / "configs" / "tiny_cpu.yaml").read_text())["model"])
ROPE = RopeConfig(theta=10000.0)
B, T = 2, 300  # T not a multiple of 128
TOL = {torch.bfloat16: (1e-3, 2e-2), torch.float32: (1e-5, 1e-4)}  # (loss rel, grad rel Frobenius)


def _where_liger_runs():
    """(device, dtype) for the liger test, or a reason to skip."""
    why = liger_import_problem()
    if why:
        return why
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16
    if os.environ.get("MEGABLU_TRITON_INTERPRET_TESTS") == "1" and os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu", torch.float32
    return "needs a CUDA GPU (or MEGABLU_TRITON_INTERPRET_TESTS=1 TRITON_INTERPRET=1 for Triton's CPU interpreter)"


def _batch(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY.vocab_size, (B, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :17] = IGNORE_INDEX  # ignored targets, unevenly placed
    labels[1, -5:] = IGNORE_INDEX
    return ids[:, :-1].to(device), labels.to(device)


def run_model(memory: MemoryConfig, device, dtype, model_cfg=TINY):
    """(loss sum, count, dh, {name: grad}) of one fwd+bwd of the tiny model (same init, same batch)."""
    model = apply_memory(BluModel(model_cfg, ROPE, seed=0), memory).to(device, dtype)
    ids, labels = _batch(device)
    seen = {}

    def keep(_mod, _inp, out):
        out.retain_grad()
        seen["h"] = out

    model.norm.register_forward_hook(keep)
    s, n = model(ids, labels=labels)
    (s / n).backward()  # megablu's reduction: sum / labelled-token count
    return (float(s.detach()), int(n), seen["h"].grad.float(), {k: p.grad.float() for k, p in model.named_parameters()})


def rel(a, b):
    return float((a - b).norm() / b.norm())


def assert_same(got, ref, dtype, what):
    (s1, n1, dh1, g1), (s2, n2, dh2, g2) = got, ref
    loss_tol, grad_tol = TOL[dtype]
    assert n1 == n2 == B * T - 22
    assert abs(s1 - s2) / abs(s2) <= loss_tol, f"{what}: loss sum {s1} vs {s2}"
    errs = {"dh": rel(dh1, dh2), **{k: rel(g1[k], g2[k]) for k in g2}}
    assert set(g1) == set(g2)
    bad = {k: f"{e:.2e}" for k, e in errs.items() if not e <= grad_tol}
    every = {k: f"{e:.1e}" for k, e in errs.items()}
    assert not bad, f"{what}: grads beyond {grad_tol} relative: {bad} (all: {every})"
    return errs


@pytest.mark.parametrize("liger_chunk", [0, 128])
@pytest.mark.parametrize("tied", [True, False])
def test_liger_loss_matches_chunked(tied, liger_chunk):
    """liger_chunk 0: Liger's own chunks (32 tokens here); 128: memory.loss_chunk widens them through
    chunk_mem_const (7 here: 5 chunks of 128 for the 600 tokens)."""
    where = _where_liger_runs()
    if isinstance(where, str):
        pytest.skip(where)
    device, dtype = where
    assert liger_mem_const(B * T, TINY.d_model, TINY.vocab_size, liger_chunk) == (7 if liger_chunk else 1)
    cfg = TINY.model_copy(update={"tie_embeddings": tied})
    got = run_model(MemoryConfig(loss="liger", loss_chunk=liger_chunk), device, dtype, cfg)
    ref = run_model(MemoryConfig(loss="chunked", loss_chunk=128), device, dtype, cfg)
    errs = assert_same(got, ref, dtype, f"liger (loss_chunk {liger_chunk}) vs chunked (tied={tied})")
    # dW: the head weight's grad; tied, the same parameter as the embedding (its grad sums both uses)
    assert ("embed_tokens.weight" in errs) and (("lm_head.weight" in errs) is not tied)


@pytest.mark.skipif(bool(_fa4_ready()), reason=_fa4_ready() or "ready")
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_fa4_attention_matches_sdpa(recompute):
    got = run_model(MemoryConfig(attention="fa4", recompute=recompute), "cuda", torch.bfloat16)
    ref = run_model(MemoryConfig(attention="sdpa", recompute=recompute), "cuda", torch.bfloat16)
    assert_same(got, ref, torch.bfloat16, f"fa4 vs sdpa ({recompute})")


@pytest.mark.skipif(bool(_fa4_ready()) or bool(liger_import_problem()), reason="needs CUDA, FA4 and Liger")
def test_both_new_kernels_together_match_todays_paths():
    got = run_model(MemoryConfig(attention="fa4", loss="liger", recompute="selective"), "cuda", torch.bfloat16)
    ref = run_model(MemoryConfig(recompute="selective", loss="chunked", loss_chunk=128), "cuda", torch.bfloat16)
    assert_same(got, ref, torch.bfloat16, "fa4+liger vs sdpa+chunked")


FUSIONS = dict(fuse_qkv=True, fuse_gate_up=True, fuse_block_add=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled ops)")
@pytest.mark.parametrize("recompute,offload", [("none", False), ("selective", True)])
def test_fusions_match_the_unfused_model_with_the_compiled_ops(recompute, offload):
    """memory.fuse_qkv/fuse_gate_up/fuse_block_add under bf16 with megablu's compiled CUDA ops (the packed
    SwiGLU, add+RMSNorm with the residual gradient), as bench/profile_step.py measures them; the fp32 CPU
    equality of every mode is tests/memory/test_fusions.py's."""
    base = dict(ops="cuda", recompute=recompute, offload_activations=offload)
    got = run_model(MemoryConfig(**base, **FUSIONS), "cuda", torch.bfloat16)
    ref = run_model(MemoryConfig(**base), "cuda", torch.bfloat16)
    assert_same(got, ref, torch.bfloat16, f"fusions vs unfused ({recompute}, offload={offload})")
