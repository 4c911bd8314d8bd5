"""memory.loss (megablu/ops/cross_entropy.py): the lm head's summed loss and its grads.

CPU (CI): megablu's chunked loss against the unchunked fp64 reference (fwd, dh, dW, ignored
labels, a chunk that does not divide N); the liger path's wiring through the model
(apply_memory -> LMHead.loss -> Liger's function with reduction="sum", ignore_index=-100,
accum_dtype=fp32) with a torch stand-in for Liger, tied embeddings included; memory.loss=auto
resolved once per model (liger on a CUDA run where liger_kernel imports, else chunked); the errors
that name the field and the fix. The real Liger kernel is tests/model/test_kernel_choices.py's (GPU,
or Triton's CPU interpreter when asked).
"""

import math

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
    gh, gw = torch.autograd.grad(loss * 0.25, (h, w))  # an upstream scale, as loss_sum / count
    ref, rn = CE.linear_cross_entropy_reference(h, w, y)
    rh, rw = torch.autograd.grad(ref * 0.25, (h, w))
    assert int(n) == int(rn) == 41
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)  # dW is summed over the chunks in fp32
    assert float(gh[[0, 7, 8, 44]].abs().max()) == 0.0  # ignored rows get no gradient


def test_unknown_loss_is_an_error():
    h, w, y = _inputs()
    with pytest.raises(
        ValueError,
        match=r"memory.loss must be one of \('chunked', 'liger'\) here \(auto resolves "
        r"before: resolve_loss\), got 'cce'",
    ):
        CE.linear_cross_entropy(h, w, y, 8, "cce")
    with pytest.raises(ValueError, match=r"got 'auto'"):  # auto never reaches the kernel call unresolved
        CE.linear_cross_entropy(h, w, y, 8, "auto")
    with pytest.raises(ValueError, match=r"memory.loss must be one of \('auto', 'chunked', 'liger'\), got 'cce'"):
        CE.resolve_loss("cce", "cpu")


class FakeLiger:
    """liger_fused_linear_cross_entropy's signature, computed by the reference; records its kwargs."""

    def __init__(self):
        self.calls = []

    def __call__(self, h, w, y, **kw):
        self.calls.append({"shape": tuple(h.shape), **kw})
        assert kw["reduction"] == "sum"
        return torch.nn.functional.cross_entropy(
            (h @ w.t()).float(), y, ignore_index=kw["ignore_index"], reduction="sum"
        )


@pytest.fixture
def fake_liger(monkeypatch):
    fake = FakeLiger()
    monkeypatch.setattr(CE, "_liger_func", lambda: fake)
    return fake


ROPE = RopeConfig(theta=10000.0)


@pytest.mark.parametrize("tied", [True, False])
def test_liger_through_the_model(fake_liger, tied):
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=61, tie_embeddings=tied)
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
    assert fake_liger.calls == [
        {"shape": (38, 32), "ignore_index": -100, "reduction": "sum", "accum_dtype": torch.float32}
    ]  # no chunk_mem_const: Liger's own chunks
    (s1, n1, g1), (s2, n2, g2) = out["liger"], out["chunked"]
    assert n1 == n2 == 34 and s1 == pytest.approx(s2, rel=1e-6)
    for k in g2:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")
    # the head's grad reaches the embedding's weight when tied (one parameter, both uses summed)
    assert ("lm_head.weight" in g1) is not tied


def _liger_chunk_reference(T, d, V, c):
    """liger-kernel 0.8.5 fused_linear_cross_entropy.py, written out: inc_factor = cdiv(V, c*d),
    chunk_size = min(next_power_of_2(cdiv(T, inc_factor)), T)."""
    return min(2 ** math.ceil(math.log2(math.ceil(T / math.ceil(V / (c * d))))), T)


@pytest.mark.parametrize("d,V", [(1024, 100352), (576, 49152), (16, 37)])
def test_liger_mem_const_is_the_largest_chunk_within_loss_chunk(d, V):
    from megablu.utils.liger import liger_chunk_tokens, liger_mem_const

    top = math.ceil(V / d)  # from here on Liger's chunk is all the tokens
    for T in (1, 45, 100, 1000, 32640, 32768, 131072):
        for c in range(1, top + 2):
            assert liger_chunk_tokens(T, d, V, c) == _liger_chunk_reference(T, d, V, c), (T, c)
        own = _liger_chunk_reference(T, d, V, 1)
        for chunk in (0, 1, 32, 512, 2048, 3000, 4096, 10**6):
            c = liger_mem_const(T, d, V, chunk)
            got = _liger_chunk_reference(T, d, V, c)
            if chunk <= 0 or own > chunk:
                assert c == 1, (T, chunk)  # Liger's own sizing
                continue
            assert got <= chunk, (T, chunk, c)
            # the largest: the next constant's chunk is over the budget, or none is larger
            assert c >= top or _liger_chunk_reference(T, d, V, c + 1) > chunk, (T, chunk, c)
    # blu-0.5b at 32k (experiments/speed/LOG.md, issue 17): 512 by itself, 2048 and 4096 on request
    if (d, V) == (1024, 100352):
        assert [liger_chunk_tokens(32768, d, V, liger_mem_const(32768, d, V, k)) for k in (0, 2048, 4096)] == [
            512,
            2048,
            4096,
        ]


def test_liger_gets_the_chunk_mem_const_for_loss_chunk(fake_liger, monkeypatch):
    monkeypatch.setattr(CE, "_liger_takes_chunk_mem_const", lambda: True)
    h, w, y = _inputs()  # N=45, d=16, V=37: constants 1, 2, 3 give chunks 16, 32, 45
    ref, _ = CE.linear_cross_entropy_reference(h, w, y)
    for chunk, const in ((0, 1), (16, 1), (32, 2), (44, 2), (45, 3), (4096, 3)):
        loss, n = CE.linear_cross_entropy(h, w, y, chunk, "liger")
        # passed only where it widens the chunks: at 1, Liger is called as before the constant existed
        assert fake_liger.calls[-1].get("chunk_mem_const", 1) == const, chunk
        assert ("chunk_mem_const" in fake_liger.calls[-1]) == (const > 1), chunk
        torch.testing.assert_close(loss.double(), ref.double())
    # a Liger whose functional would drop the constant: an error where it matters, not a silent own size
    monkeypatch.setattr(CE, "_liger_takes_chunk_mem_const", lambda: False)
    CE.linear_cross_entropy(h, w, y, 16, "liger")
    with pytest.raises(
        RuntimeError,
        match=r"memory.loss=liger with memory.loss_chunk=32: this liger_kernel does not "
        r"take chunk_mem_const or drops it .*LIGER_KERNEL_IMPL.* or set "
        r"memory.loss_chunk=0",
    ):
        CE.linear_cross_entropy(h, w, y, 32, "liger")


def test_chunk_mem_const_support_reads_the_functional_and_the_function(monkeypatch):
    """A Liger whose functional lacks the parameter, or whose Function drops it, does not take it."""
    import sys
    import types

    class Fn:
        supports_inner_impl_dispatch = True

    def with_param(h, w, y, chunk_mem_const=1, **kw):
        return None

    def without_param(h, w, y, **kw):
        return None

    mod = types.ModuleType("liger_kernel.transformers.functional")
    mod.LigerFusedLinearCrossEntropyFunction = Fn
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", types.ModuleType("liger_kernel.transformers"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", mod)
    takes = CE._liger_takes_chunk_mem_const.__wrapped__  # the answer, uncached (it is cached per process)
    monkeypatch.setattr(CE, "_liger_func", lambda: with_param)
    assert takes()
    monkeypatch.setattr(Fn, "supports_inner_impl_dispatch", False)  # another backend: dropped
    assert not takes()
    monkeypatch.setattr(Fn, "supports_inner_impl_dispatch", True)
    monkeypatch.setattr(CE, "_liger_func", lambda: without_param)  # an older functional
    assert not takes()


def test_liger_without_the_library_names_the_fix(monkeypatch):
    def missing():
        raise ModuleNotFoundError("No module named 'liger_kernel'")

    monkeypatch.setattr(CE, "_liger_func", missing)
    h, w, y = _inputs()
    with pytest.raises(
        RuntimeError,
        match=r"memory.loss=liger: liger_kernel is not importable \(ModuleNotFoundError"
        r": No module named 'liger_kernel'\); install liger-kernel .* or set "
        r"memory.loss=chunked",
    ):
        CE.linear_cross_entropy(h, w, y, 0, "liger")


# --------------------------------------------------------------------------- memory.loss=auto
@pytest.fixture
def fresh_log(monkeypatch):
    """dispatch logs each decision once per process: an earlier test may have logged this one."""
    from megablu.ops import dispatch

    monkeypatch.setattr(dispatch, "_logged", set())


def _tiny(tied=True):
    return ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=61, tie_embeddings=tied)


def test_auto_is_the_default_and_resolves_to_chunked_on_a_cpu_run(fake_liger, fresh_log, caplog):
    """Liger is importable here (the stand-in), but the run is on the CPU: chunked, said once with why."""
    assert MemoryConfig().loss == "auto"
    with caplog.at_level("INFO", logger="megablu.ops.dispatch"):
        m = apply_memory(BluModel(_tiny(), ROPE, seed=0), MemoryConfig(loss_chunk=7))  # parameters on the CPU
        apply_memory(BluModel(_tiny(), ROPE, seed=0), MemoryConfig(), device="cpu")
    assert m.lm_head.loss == "chunked"
    ids = torch.randint(0, 61, (1, 11), generator=torch.Generator().manual_seed(0))
    m(ids, labels=ids)
    assert fake_liger.calls == []
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory.loss=auto")]
    assert said == ["memory.loss=auto: chunked (a cpu run: Liger's fused linear cross-entropy is a Triton GPU kernel)"]


def test_auto_resolves_to_liger_on_a_cuda_run_with_liger(fake_liger, fresh_log, monkeypatch, caplog):
    """A CUDA run (the trainer's device) where liger_kernel imports: the head runs Liger's function
    (here the stand-in, on CPU tensors), and its loss and grads are chunked's."""
    monkeypatch.setattr(CE, "liger_import_problem", lambda: None)
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    with caplog.at_level("INFO", logger="megablu.ops.dispatch"):
        auto = apply_memory(BluModel(_tiny(), ROPE, seed=0), MemoryConfig(), device="cuda")
    assert auto.lm_head.loss == "liger"
    assert "memory.loss=auto: liger (a CUDA run and liger_kernel imports)" in caplog.messages
    ref = apply_memory(BluModel(_tiny(), ROPE, seed=0), MemoryConfig(loss="chunked"), device="cuda")
    assert ref.lm_head.loss == "chunked"  # explicit choices are kept as given
    out = []
    for m in (auto, ref):
        s, n = m(ids, labels=ids)
        (s / n).backward()
        out.append((float(s.detach()), {k: p.grad for k, p in m.named_parameters()}))
    assert len(fake_liger.calls) == 1 and fake_liger.calls[0]["shape"] == (26, 32)
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6)
    for k, g in out[1][1].items():
        torch.testing.assert_close(out[0][1][k], g, rtol=1e-5, atol=1e-7)


def test_auto_without_liger_resolves_to_chunked_on_a_cuda_run(monkeypatch):
    def missing():
        raise ModuleNotFoundError("No module named 'liger_kernel'")

    monkeypatch.setattr(CE, "_liger_func", missing)
    assert CE.auto_loss("cuda") == (
        "chunked",
        "a CUDA run, but liger_kernel is not importable (ModuleNotFoundError: No module named 'liger_kernel')",
    )
    assert CE.resolve_loss("auto", "cuda") == "chunked"
    assert CE.resolve_loss("liger", "cpu") == "liger"  # explicit liger on a CPU run: a config error, not here
