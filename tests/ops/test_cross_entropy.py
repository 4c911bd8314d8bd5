"""memory.loss (megablu/ops/cross_entropy.py): the lm head's summed loss and its grads.

CPU (CI): megablu's chunked loss against the unchunked fp64 reference (fwd, dh, dW, ignored
labels, a chunk that does not divide N); the liger path's wiring through the model
(apply_memory -> LMHead.loss -> Liger's function with reduction="sum", ignore_index=-100,
accum_dtype=fp32) with a torch stand-in for Liger, tied embeddings included; the errors that
name the field and the fix. The real Liger kernel is tests/model/test_kernel_choices.py's (GPU,
or Triton's CPU interpreter when asked).
"""
import pytest
import torch

from megablu.config.schema import MemoryConfig, ModelConfig, RopeConfig
from megablu.memory.apply import apply_memory
from megablu.model.decoder import BluModel
from megablu.ops import cross_entropy as CE


def _inputs(N=45, d=16, V=37, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, d, generator=g, dtype=dtype) * 0.5).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    y[[0, 7, 8, 44]] = CE.IGNORE_INDEX
    return h, w, y


@pytest.mark.parametrize("chunk", [1, 8, 45, 100])
def test_chunked_matches_reference_fwd_and_grads(chunk):
    h, w, y = _inputs()
    loss, n = CE.linear_cross_entropy(h, w, y, chunk)
    gh, gw = torch.autograd.grad(loss * 0.25, (h, w))       # an upstream scale, as loss_sum / count
    ref, rn = CE.linear_cross_entropy_reference(h, w, y)
    rh, rw = torch.autograd.grad(ref * 0.25, (h, w))
    assert int(n) == int(rn) == 41
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)    # dW is summed over the chunks in fp32
    assert float(gh[[0, 7, 8, 44]].abs().max()) == 0.0       # ignored rows get no gradient


def test_unknown_loss_is_an_error():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match=r"memory.loss must be one of \('chunked', 'liger'\), got 'cce'"):
        CE.linear_cross_entropy(h, w, y, 8, "cce")


class FakeLiger:
    """liger_fused_linear_cross_entropy's signature, computed by the reference; records its kwargs."""

    def __init__(self):
        self.calls = []

    def __call__(self, h, w, y, **kw):
        self.calls.append({"shape": tuple(h.shape), **kw})
        assert kw["reduction"] == "sum"
        return torch.nn.functional.cross_entropy((h @ w.t()).float(), y, ignore_index=kw["ignore_index"],
                                                 reduction="sum")


@pytest.fixture
def fake_liger(monkeypatch):
    fake = FakeLiger()
    monkeypatch.setattr(CE, "_liger_func", lambda: fake)
    return fake


ROPE = RopeConfig(theta=10000.0)


@pytest.mark.parametrize("tied", [True, False])
def test_liger_through_the_model(fake_liger, tied):
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=61,
                      tie_embeddings=tied)
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :4] = CE.IGNORE_INDEX
    out = {}
    for loss in ("liger", "chunked"):
        m = apply_memory(BluModel(cfg, ROPE, seed=0), MemoryConfig(loss=loss, loss_chunk=7))
        assert m.lm_head.loss == loss
        s, n = m(ids, labels=labels)
        (s / n).backward()
        out[loss] = (float(s.detach()), int(n), {k: p.grad.clone() for k, p in m.named_parameters()})
    assert fake_liger.calls == [{"shape": (38, 32), "ignore_index": -100, "reduction": "sum",
                                 "accum_dtype": torch.float32}]
    (s1, n1, g1), (s2, n2, g2) = out["liger"], out["chunked"]
    assert n1 == n2 == 34 and s1 == pytest.approx(s2, rel=1e-6)
    for k in g2:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")
    # the head's grad reaches the embedding's weight when tied (one parameter, both uses summed)
    assert ("lm_head.weight" in g1) is not tied


def test_liger_without_the_library_names_the_fix(monkeypatch):
    def missing():
        raise ModuleNotFoundError("No module named 'liger_kernel'")

    monkeypatch.setattr(CE, "_liger_func", missing)
    h, w, y = _inputs()
    with pytest.raises(RuntimeError, match=r"memory.loss=liger: liger_kernel is not importable \(ModuleNotFoundError"
                                           r": No module named 'liger_kernel'\); install liger-kernel .* or set "
                                           r"memory.loss=chunked"):
        CE.linear_cross_entropy(h, w, y, 0, "liger")
