"""memory.attention (megablu/ops/attention.py): the causal kernel LocalAttention runs.

CPU (CI): the sdpa kernel against an fp64 masked-softmax reference, fwd and every grad, odd
head counts and T not a multiple of 128; the fa4 checks that name the field and the fix; the
model's wiring of memory.attention (apply_memory sets every LocalAttention, fa4 is what the
forward calls, with the (B, T, H, D) layout and causal=True) through a stand-in for
flash_attn_func, and fa4 with document masking refused.

GPU (skip without CUDA, without SM90 or without flash-attn-4 importable): FlashAttention-4
against SDPA and an fp32 reference, fwd and dq/dk/dv, bf16 and fp16, GQA 16/4, odd heads 9/3,
MHA (what Ulysses' padded heads hand the local kernel), head_dim 64 and 128, T not a multiple
of 128, a non-contiguous input (the all-to-all's layout), and one long T. Tolerance (the
flash-attention tests' rule): FA4's max error against the fp32 reference at most 2x SDPA's
own in the same dtype, + ATOL[dtype].
"""

import pytest
import torch

from megablu.config.schema import MemoryConfig, ModelConfig, RopeConfig
from megablu.memory.apply import apply_memory
from megablu.model.decoder import BluModel, LocalAttention
from megablu.ops import attention as A


def _inputs(B, T, H, Hkv, D, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (
        torch.randn(B, T, h, D, generator=g, device=device, dtype=torch.float32).to(dtype).requires_grad_()
        for h in (H, Hkv, Hkv)
    )
    return q, k, v


def math_causal(q, k, v):
    """softmax(q k^T / sqrt(D) + causal mask) v with kv heads repeated per group: (B, T, H, D)."""
    H, Hkv, D, T = q.shape[2], k.shape[2], q.shape[3], q.shape[1]
    k, v = (x.repeat_interleave(H // Hkv, dim=2) for x in (k, v))
    s = torch.einsum("bthd,bshd->bhts", q, k) / D**0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v)


@pytest.mark.parametrize("B,T,H,Hkv,D", [(2, 37, 4, 2, 16), (1, 131, 9, 3, 8), (1, 20, 5, 5, 8)])
def test_sdpa_kernel_matches_math_fwd_and_grads(B, T, H, Hkv, D):
    q, k, v = _inputs(B, T, H, Hkv, D)
    go = torch.randn(B, T, H, D, dtype=torch.float64)
    out = A.causal_attention(q, k, v, "sdpa")
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref = math_causal(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10, msg=lambda m: f"d{name}: {m}")


def test_unknown_kernel_and_fa4_on_cpu_are_errors_that_name_the_field():
    q, k, v = _inputs(1, 8, 2, 1, 8, torch.float32)
    with pytest.raises(ValueError, match=r"memory.attention must be one of \('auto', 'sdpa', 'fa4'\), got 'flash'"):
        A.causal_attention(q, k, v, "flash")
    with pytest.raises(
        RuntimeError,
        match=r"memory.attention=fa4: the tensors are on cpu, FlashAttention-4 runs "
        r"on CUDA \(SM90\) only; set memory.attention=sdpa",
    ):
        A.causal_attention(q, k, v, "fa4")


@pytest.mark.parametrize(
    "cap,dtype,D,H,Hkv,expect",
    [
        ((9, 0), torch.bfloat16, 64, 16, 4, None),
        ((9, 0), torch.float16, 128, 9, 3, None),
        ((9, 0), torch.bfloat16, 8, 5, 5, None),
        ((8, 0), torch.bfloat16, 64, 16, 4, "this GPU is sm_80; FlashAttention-4 is used here on SM90"),
        ((10, 0), torch.bfloat16, 64, 16, 4, "this GPU is sm_100"),
        ((9, 0), torch.float32, 64, 16, 4, "dtype torch.float32/torch.float32: FlashAttention-4 takes bf16 or fp16"),
        ((9, 0), torch.bfloat16, 36, 16, 4, "head_dim 36: FlashAttention-4 takes 8..256, a multiple of 8"),
        ((9, 0), torch.bfloat16, 264, 16, 4, "head_dim 264"),
        ((9, 0), torch.bfloat16, 64, 9, 2, "9 query heads are not a multiple of 2 kv heads"),
    ],
)
def test_fa4_limits(cap, dtype, D, H, Hkv, expect):
    why = A.fa4_unsupported(cap, dtype, dtype, D, D, H, Hkv)
    assert why == expect if expect is None else why.startswith(expect), why


class FakeFA4:
    """flash_attn.cute.flash_attn_func's signature, computed by SDPA; records what it was given."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, causal=False, **kw):
        self.calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "causal": causal, "kw": kw})
        return A.sdpa_causal(q, k, v), torch.zeros(q.shape[0], q.shape[2], q.shape[1])


@pytest.fixture
def fake_fa4(monkeypatch):
    fake = FakeFA4()
    monkeypatch.setattr(A, "_fa4_func", lambda: fake)
    monkeypatch.setattr(A, "fa4_problem", lambda q, k: None)
    return fake


CFG = ModelConfig(n_layers=2, d_model=72, n_heads=9, n_kv_heads=3, ffn_dim=64, vocab_size=50)
ROPE = RopeConfig(theta=10000.0)


def _loss_and_grads(model, ids, **kw):
    s, n = model(ids, labels=ids, **kw)
    (s / n).backward()
    return float((s / n).detach()), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_apply_memory_puts_fa4_in_every_layer_and_the_forward_calls_it(fake_fa4):
    model = apply_memory(BluModel(CFG, ROPE, seed=0), MemoryConfig(attention="fa4", recompute="selective"))
    cores = [m for m in model.modules() if isinstance(m, LocalAttention)]
    assert len(cores) == CFG.n_layers and all(c.kernel == "fa4" for c in cores)
    ids = torch.randint(0, CFG.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    loss, grads = _loss_and_grads(model, ids)
    # one call per layer, (B, T, H, D) and (B, T, Hkv, D) as they are, causal, nothing else asked
    assert fake_fa4.calls == [{"q": (2, 37, 9, 8), "k": (2, 37, 3, 8), "causal": True, "kw": {}}] * CFG.n_layers
    ref = apply_memory(BluModel(CFG, ROPE, seed=0), MemoryConfig(recompute="selective"))
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], msg=lambda m: f"{k}: {m}")


def test_decode_steps_keep_sdpa_and_doc_mask_refuses_fa4(fake_fa4):
    from megablu.model.decoder import KVCache

    model = apply_memory(BluModel(CFG, ROPE, seed=0), MemoryConfig(attention="fa4")).eval()
    ids = torch.randint(0, CFG.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = KVCache(CFG.n_layers)
    with torch.no_grad():
        model(ids[:, :10], cache=cache)  # prefill: T == S, the fa4 kernel
        model(ids[:, 10:11], cache=cache)  # decode: T < S, SDPA
    assert len(fake_fa4.calls) == CFG.n_layers
    with pytest.raises(
        ValueError,
        match=r"memory.attention=fa4 runs plain causal attention; document masking "
        r"\(data.doc_mask\) runs on FlexAttention: set memory.attention=sdpa",
    ):
        model(ids, doc_ids=torch.zeros_like(ids))


@pytest.fixture
def fresh_auto(monkeypatch):
    """auto's log is once per process and its last pick is kept: each test starts with neither."""
    from megablu.ops import dispatch

    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.setattr(A, "AUTO_CHOICE", {})
    A._import_problem_once.cache_clear()
    yield
    A._import_problem_once.cache_clear()


def test_auto_is_the_default_and_runs_sdpa_on_cpu_saying_why(fresh_auto, caplog):
    """The default config's model on the CPU: auto runs SDPA (bit-equal to sdpa's forward and grads),
    logged once with the reason; FlashAttention-4 is never asked."""
    assert MemoryConfig().attention == "auto"
    ids = torch.randint(0, CFG.vocab_size, (2, 29), generator=torch.Generator().manual_seed(3))
    with caplog.at_level("INFO", logger="megablu.ops.dispatch"):
        auto = apply_memory(BluModel(CFG, ROPE, seed=0), MemoryConfig(recompute="selective"))
        assert {m.kernel for m in auto.modules() if isinstance(m, LocalAttention)} == {"auto"}
        loss, grads = _loss_and_grads(auto, ids)
    said = [m for m in caplog.messages if m.startswith("memory.attention=auto")]
    assert said == ["memory.attention=auto: sdpa (the tensors are on cpu, FlashAttention-4 runs on CUDA (SM90) only)"]
    assert A.AUTO_CHOICE["kernel"] == "sdpa"
    ref = apply_memory(BluModel(CFG, ROPE, seed=0), MemoryConfig(recompute="selective", attention="sdpa"))
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    assert loss == ref_loss
    for k in ref_grads:
        assert torch.equal(grads[k], ref_grads[k]), k


def test_auto_runs_fa4_where_it_can_take_the_tensors_and_imports(fake_fa4, fresh_auto, caplog):
    """Where FA4 takes the tensors and imports (here the stand-in), auto calls it for the causal case,
    with the loss and grads of sdpa; with document masking it keeps the masked path (no error, unlike
    an explicit fa4); where flash_attn.cute does not import, it runs sdpa and says why."""
    ids = torch.randint(0, CFG.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with caplog.at_level("INFO", logger="megablu.ops.dispatch"):
        model = apply_memory(BluModel(CFG, ROPE, seed=0), MemoryConfig(recompute="selective"))
        loss, grads = _loss_and_grads(model, ids)
    assert fake_fa4.calls == [{"q": (2, 37, 9, 8), "k": (2, 37, 3, 8), "causal": True, "kw": {}}] * CFG.n_layers
    assert (
        "memory.attention=auto: fa4 (CUDA SM90, bf16/fp16, a head size FlashAttention-4 takes, and "
        "flash_attn.cute imports)" in caplog.messages
    )
    ref_loss, ref_grads = _loss_and_grads(
        apply_memory(BluModel(CFG, ROPE, seed=0), MemoryConfig(recompute="selective", attention="sdpa")), ids
    )
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], msg=lambda m: f"{k}: {m}")
    fake_fa4.calls.clear()
    with torch.no_grad():
        model(ids, doc_ids=torch.zeros_like(ids))  # document-causal: FlexAttention's path
    assert fake_fa4.calls == []

    def missing():
        raise ModuleNotFoundError("No module named 'flash_attn'")

    A._import_problem_once.cache_clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(A, "_fa4_func", missing)
        q, k, v = _inputs(1, 8, 2, 1, 8, torch.float32)
        assert A.auto_kernel(q, k) == (
            "sdpa",
            "flash_attn.cute is not importable (ModuleNotFoundError: No module named 'flash_attn')",
        )
        torch.testing.assert_close(A.causal_attention(q, k, v, "auto"), A.sdpa_causal(q, k, v), rtol=0, atol=0)
    assert fake_fa4.calls == []


def test_auto_for_a_config_what_the_planner_shows(fresh_auto, monkeypatch):
    """Before any tensor exists (plan, probe.json's planned setup): fa4 on a CUDA run when the config
    allows it and flash_attn.cute imports; sdpa with doc_mask, another dtype, an odd head size, on CPU."""
    from megablu import plan
    from megablu.config import load_config

    monkeypatch.setattr(A, "_fa4_func", lambda: object())  # imports
    cfg = load_config("configs/l2.yaml", ["parallel.sp=1"])
    assert cfg.memory.attention == "auto"
    assert A.auto_for_config(cfg, "cuda")[0] == "fa4"
    assert plan.Setup.from_config(cfg, gpus=1).attention == "fa4"
    assert A.auto_for_config(cfg, "cpu") == ("sdpa", "a cpu run: FlashAttention-4 runs on SM90 GPUs only")
    masked = load_config("configs/l2.yaml", ["parallel.sp=1", "data.mode=pack", "data.doc_mask=true"])
    kind, why = A.auto_for_config(masked, "cuda")
    assert kind == "sdpa" and why.startswith("FlashAttention-4 runs plain causal attention here")
    assert plan.Setup.from_config(masked, gpus=1).attention == "sdpa"
    pinned = load_config("configs/l2.yaml", ["parallel.sp=1", "memory.attention=sdpa"])
    assert plan.Setup.from_config(pinned, gpus=1).attention == "sdpa"


def test_fa4_without_the_library_names_the_fix(monkeypatch):
    def missing():
        raise ModuleNotFoundError("No module named 'flash_attn'")

    monkeypatch.setattr(A, "_fa4_func", missing)
    monkeypatch.setattr(A, "fa4_problem", lambda q, k: None)
    q, k, v = _inputs(1, 8, 2, 1, 8, torch.float32)
    with pytest.raises(
        RuntimeError,
        match=r"memory.attention=fa4: flash_attn.cute is not importable "
        r"\(ModuleNotFoundError: No module named 'flash_attn'\); set "
        r"memory.attention=sdpa",
    ):
        A.causal_attention(q, k, v, "fa4")


# --------------------------------------------------------------------------- GPU: the real FA4
def _fa4_ready() -> str:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability()[0] != 9:
        return "FA4 is used on SM90 only"
    return A.import_problem() or ""


fa4_gpu = pytest.mark.skipif(bool(_fa4_ready()), reason=_fa4_ready() or "ready")
ATOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}

# FA4 compiles a kernel per (dtype, head_dim, query heads per kv head, ...) at its first call (seconds
# each): bf16 everywhere (megablu trains in bf16), fp16 on blu-0.5b's shape only
SHAPES = [
    # B, T, H, Hkv, D, layout, dtype
    (2, 1000, 16, 4, 64, "bthd", torch.bfloat16),  # blu-0.5b's heads, T % 128 != 0
    (2, 1000, 16, 4, 64, "bthd", torch.float16),
    (1, 777, 9, 3, 64, "bthd", torch.bfloat16),  # SmolLM2's 9/3
    (1, 1100, 5, 5, 64, "bthd", torch.bfloat16),  # MHA: Ulysses' padded heads per rank (9 heads, sp=2 -> 5/5)
    (1, 513, 8, 2, 128, "bthd", torch.bfloat16),  # head_dim 128
    (2, 640, 8, 2, 64, "bhtd", torch.bfloat16),  # a non-contiguous (B, T, H, D) view
    (1, 8192, 16, 4, 64, "bthd", torch.bfloat16),  # a long T
]


@fa4_gpu
@pytest.mark.parametrize("B,T,H,Hkv,D,layout,dtype", SHAPES)
def test_fa4_matches_sdpa_fwd_and_grads(B, T, H, Hkv, D, layout, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)

    def make(h):
        shape = (B, T, h, D) if layout == "bthd" else (B, h, T, D)
        x = torch.randn(shape, generator=g, device="cuda")
        return x if layout == "bthd" else x.transpose(1, 2)

    base = [make(h) for h in (H, Hkv, Hkv)]
    go = torch.randn(B, T, H, D, generator=g, device="cuda")
    results = {}
    for name, kern, dt in (("ref", "sdpa", torch.float32), ("sdpa", "sdpa", dtype), ("fa4", "fa4", dtype)):
        qkv = [x.to(dt).detach().requires_grad_() for x in base]
        out = A.causal_attention(*qkv, kern)
        assert out.shape == (B, T, H, D) and out.dtype == dt
        results[name] = (out, *torch.autograd.grad(out, qkv, go.to(dt)))
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        ref = results["ref"][i]
        err_sdpa = float((results["sdpa"][i].float() - ref).abs().max())
        err_fa4 = float((results["fa4"][i].float() - ref).abs().max())
        scale = max(1.0, float(ref.abs().max()))
        assert err_fa4 <= 2 * err_sdpa + ATOL[dtype] * scale, (
            f"{what}: FA4 max err {err_fa4:.3e} vs SDPA's {err_sdpa:.3e} (ref max {scale:.2f})"
        )
