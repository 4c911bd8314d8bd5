"""The benchmark's ALST-style peer (HF + checkpointing + DeepSpeed TiledMLP + TiledFusedLogitsLoss)
computes the same loss and gradients as plain HF: the comparison in BENCHMARKS.md is fair. Its
FlashAttention-4 variant (`--attention fa4`, rows "alst+fa4") hands FA4 the tensors, layout, causality
and scale that HF's SDPA path uses: checked on CPU with FA4's kernel replaced by an independent
stand-in; without one, on CPU, it stops with the reason instead of measuring SDPA."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_alst_peer_equals_plain_hf():
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "alst_peer.py"), "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "alst peer == plain HF" in r.stdout


def _fa4_standin(calls):
    """flash_attn.cute.flash_attn_func's contract on (B, T, H, D) q and (B, T, Hkv, D) k/v, by another
    route than SDPA: kv heads repeated, an explicit masked softmax; returns (out, lse) as 4.0.0b40."""

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
        calls.append({"causal": causal, "scale": softmax_scale, "q": tuple(q.shape), "k": tuple(k.shape)})
        B, T, H, D = q.shape
        rep = H // k.shape[2]
        k, v = (x.repeat_interleave(rep, dim=2) for x in (k, v))  # query head h reads kv head h // rep
        scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(D)
        s = torch.einsum("bthd,bshd->bhts", q, k) * scale
        if causal:
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # (B, H, T)
        out = torch.einsum("bhts,bshd->bthd", torch.exp(s - lse[..., None]), v)
        return out, lse

    return flash_attn_func


def test_fa4_peer_equals_plain_hf_with_a_standin_kernel(monkeypatch, capsys):
    import alst_peer

    from megablu.ops import attention as mb

    calls = []
    monkeypatch.setattr(mb, "_fa4_func", lambda: _fa4_standin(calls))
    monkeypatch.setattr(mb, "fa4_problem", lambda q, k: None)  # the stand-in takes CPU fp32 tensors
    for name in ("MLP_TOKENS_PER_SHARD", "LOGITS_SHARD_BYTES"):  # check_on_cpu shrinks them; restored after
        monkeypatch.setattr(alst_peer, name, getattr(alst_peer, name))
    D = 64 // 4  # check_on_cpu's shape: d_model 64, 4 query heads, 2 kv heads, T 64
    scale = 0.7 / math.sqrt(D)  # not FA4's default: the module's scaling must reach the kernel
    alst_peer.check_on_cpu("fa4", softmax_scale=scale)
    assert "alst+fa4 peer == plain HF" in capsys.readouterr().out
    # 2 layers, each forward run again by checkpointing in the backward: the peer's attention is FA4's
    assert len(calls) == 2 * 2
    assert all(c == {"causal": True, "scale": scale, "q": (1, 64, 4, D), "k": (1, 64, 2, D)} for c in calls), calls


@pytest.mark.parametrize("args", [["--check"], ["--T", "64", "--iters", "1"]], ids=["check", "measure"])
def test_fa4_peer_without_fa4_stops_with_the_reason(args):
    if "--check" not in args and torch.cuda.is_available():
        pytest.skip("a CUDA machine may run FlashAttention-4: the refusal is checked on CPU")
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "alst_peer.py"), "--attention", "fa4", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "alst_peer.py --attention fa4: " in r.stderr and "FlashAttention-4" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "peer == plain HF" not in r.stdout and "| impl" not in r.stdout


def test_peer_impl_names_round_trip():
    import alst_peer

    assert [alst_peer.impl_name(a) for a in alst_peer.ATTENTIONS] == ["alst", "alst+fa4"]
    assert [alst_peer.attention_of(alst_peer.impl_name(a)) for a in alst_peer.ATTENTIONS] == ["sdpa", "fa4"]
    with pytest.raises(ValueError, match="alst\\+flex"):
        alst_peer.attention_of("alst+flex")
