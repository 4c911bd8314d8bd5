"""memory.fuse_qkv, fuse_gate_up and fuse_block_add (applied by megablu.memory.apply_memory): the same loss,
logits and every parameter's gradient as the plain unfused model, alone and under the memory switches that wrap
a block (selective and full recompute, the tiled MLP, activation offload), with q/k/v biases and q/k norms, on
both op paths; and they act: fewer GEMMs and activation-size adds, nothing more saved or offloaded, the same
state dict. ZeRO-3 and Ulysses: test_memory_switches_zero.py.

ops="cuda" runs the CUDA ops' autograd Functions with a torch stand-in for the compiled extension
(test_memory_switches.TorchExt), so the packed SwiGLU and the fused add+norm with a residual gradient run here.
"""

import pytest
import torch
from pydantic import ValidationError
from torch.utils._python_dispatch import TorchDispatchMode

from megablu.config.schema import MemoryConfig, ModelConfig, RopeConfig
from megablu.config.schema.model import FAMILIES
from megablu.memory.apply import apply_memory
from megablu.memory.offload import ActivationOffload
from megablu.model.decoder import BluModel, KVCache
from tests.config.test_invariants import errors
from tests.memory.test_memory_switches import TorchExt, assert_same, install_ext_as_cuda, step

ROPE = RopeConfig(theta=10000.0)
# head_dim 12: H*D = 48 != d_model = 64, so an activation-size (B, T, d) tensor is never a q/k/v one
CFG = ModelConfig(n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, head_dim=12, ffn_dim=96, vocab_size=97)
VARIANTS = {
    "llama": CFG,
    "qkv_bias": CFG.model_copy(update={"qkv_bias": True}),
    "qk_norm_proj": CFG.model_copy(update={"qk_norm": "proj", "qkv_bias": True}),
    "qk_norm_head": CFG.model_copy(update={"qk_norm": "head"}),
}
B, T = 2, 37
FUSIONS = {
    "qkv": dict(fuse_qkv=True),
    "gate_up": dict(fuse_gate_up=True),
    "block_add": dict(fuse_block_add=True),
    "projections": dict(fuse_qkv=True, fuse_gate_up=True),
    "all": dict(fuse_qkv=True, fuse_gate_up=True, fuse_block_add=True),
}
# the memory modes that wrap a block or an MLP (test_memory_switches.py checks each against the plain path)
MODES = {
    "plain": dict(),
    "selective": dict(recompute="selective"),
    "selective+tiles": dict(recompute="selective", mlp_tiles=3),
    "selective+offload": dict(recompute="selective", offload_activations=True),
    "selective+tiles+offload": dict(recompute="selective", mlp_tiles=3, offload_activations=True),
    "none+tiles+offload": dict(mlp_tiles=3, offload_activations=True),
    "full": dict(recompute="full"),
    "full+tiles+offload": dict(recompute="full", mlp_tiles=3, offload_activations=True),
}


class _Paused:
    """Whether an op counter looks (off while the stand-in extension runs: its ops are the kernel's inside)."""

    on = True


class PausingExt(TorchExt):
    """TorchExt whose kernels the op counter does not see (one kernel each on a GPU)."""

    def __getattribute__(self, name):
        f = super().__getattribute__(name)
        if not name.endswith(("_fwd", "_bwd", "_apply")):
            return f

        def run(*a, **k):
            was, _Paused.on = _Paused.on, False
            try:
                return f(*a, **k)
            finally:
                _Paused.on = was

        return run


@pytest.fixture
def cuda_ops(monkeypatch):
    """ops="cuda" on CPU tensors: the ops' autograd Functions with PausingExt as the extension."""
    return install_ext_as_cuda(monkeypatch, PausingExt())


def batch(cfg=CFG, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[1, :4] = -100
    return ids[:, :-1], labels


def build(cfg: ModelConfig, memory: MemoryConfig, offload_all=True):
    m = BluModel(cfg, ROPE)
    m.reset_parameters(seed=0)
    with torch.no_grad():  # biases and norm weights away from their init, so their grads and roles show
        for n, p in m.named_parameters():
            if n.endswith((".bias", "norm.weight")):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    m = apply_memory(m, memory)
    if m.offload is not None and offload_all:  # CPU: every saved tensor through the copy path
        m.offload = ActivationOffload(min_bytes=0, copy_cpu=True)
    return m


def _modes():
    """Every fusion alone in two modes, all of them in every mode (under full recompute the two projections:
    the config refuses the block add there, test_full_recompute_refuses_the_block_add)."""
    for mode in ("plain", "selective+tiles+offload"):
        for fusion in ("qkv", "gate_up", "block_add"):
            yield pytest.param(mode, fusion, id=f"{mode}-{fusion}")
    for mode, mem in MODES.items():
        fusion = "projections" if mem.get("recompute") == "full" else "all"
        yield pytest.param(mode, fusion, id=f"{mode}-{fusion}")


# --------------------------------------------------------------------------- equality
@pytest.mark.parametrize("ops", ["torch", "cuda"])
@pytest.mark.parametrize("mode,fusion", list(_modes()))
def test_fused_matches_the_plain_model(request, ops, mode, fusion):
    """Loss and every gradient of the fused model under a memory mode == the plain unfused model's."""
    if ops == "cuda":
        request.getfixturevalue("cuda_ops")
    cfg = VARIANTS["qkv_bias"]
    ids, labels = batch(cfg)
    ref = step(build(cfg, MemoryConfig(ops=ops)), ids, labels)
    got = step(build(cfg, MemoryConfig(ops=ops, **MODES[mode], **FUSIONS[fusion])), ids, labels)
    assert_same(got, ref, f"ops={ops} {mode} fuse={fusion}")


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", ["plain", "selective+offload"])
def test_fused_matches_per_family_variant(cuda_ops, variant, mode):
    cfg = VARIANTS[variant]
    ids, labels = batch(cfg, 1)
    ref = step(build(cfg, MemoryConfig(ops="cuda")), ids, labels)
    got = step(build(cfg, MemoryConfig(ops="cuda", **MODES[mode], **FUSIONS["all"])), ids, labels)
    assert_same(got, ref, f"{variant} {mode}")


@pytest.mark.parametrize("layout", ["post", "sandwich"])
def test_projection_fusions_on_the_other_layouts(layout):
    """fuse_qkv and fuse_gate_up do not depend on the norm layout (GeGLU, Gemma's activation, too)."""
    cfg = CFG.model_copy(update={"norm_layout": layout, "activation": "gelu_tanh"})
    ids, labels = batch(cfg, 2)
    ref = step(build(cfg, MemoryConfig()), ids, labels)
    got = step(build(cfg, MemoryConfig(recompute="selective", fuse_qkv=True, fuse_gate_up=True)), ids, labels)
    assert_same(got, ref, layout)


def test_inference_logits_and_a_kv_cache_decode_match():
    """No grad: the logits of a prefill and of decode steps through a KV cache are the plain model's."""
    ids, _ = batch(CFG, 3)
    plain, fused = build(CFG, MemoryConfig()), build(CFG, MemoryConfig(**FUSIONS["all"]))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), plain(ids))
        torch.testing.assert_close(fused(ids, logits_index=-1), plain(ids, logits_index=-1))
        caches = KVCache(CFG.n_layers), KVCache(CFG.n_layers)
        outs = [m(ids[:, :20], cache=c) for m, c in zip((plain, fused), caches)]
        for t in range(20, 23):
            outs = [m(ids[:, t : t + 1], cache=c) for m, c in zip((plain, fused), caches)]
            torch.testing.assert_close(outs[1], outs[0])


# --------------------------------------------------------------------------- they act
class _Count(TorchDispatchMode):
    """GEMMs, and adds whose output has the shape of the residual stream (B, T, d), forward and backward."""

    GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    ADDS = {torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor}

    def __init__(self, d):
        super().__init__()
        self.d, self.gemms, self.adds = d, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _Paused.on:
            if func in self.GEMMS:
                self.gemms += 1
            elif func in self.ADDS and isinstance(out, torch.Tensor) and out.shape == (B, T, self.d):
                self.adds += 1
        return out


def _counts(memory: MemoryConfig) -> tuple[int, int]:
    m = build(CFG, memory)
    ids, labels = batch(CFG)
    with _Count(CFG.d_model) as c:
        s, n = m(ids, labels=labels)
        (s / n).backward()
    return c.gemms, c.adds


def test_the_fusions_remove_the_gemms_and_the_adds(cuda_ops):
    """Per block (recompute none, the CUDA ops' Functions): fuse_qkv runs 1 GEMM instead of 3 forward and 2
    instead of 6 backward, and removes autograd's 2 adds of the q/k/v input gradients; fuse_gate_up 1 and 2
    instead of 2 and 4, one add fewer; fuse_block_add removes the forward residual add (not in the last block)
    and the add of the block input's two gradients (not in the first block: its input is the embedding)."""
    L = CFG.n_layers
    g0, a0 = _counts(MemoryConfig(ops="cuda"))
    # unfused: 7 linears a block, each 1 GEMM forward and 2 backward; 1 forward add and 4 backward adds a block
    # (the block input's two gradients, q/k/v's three, gate/up's two); the head's GEMMs besides
    assert a0 == L * (1 + 4)
    assert _counts(MemoryConfig(ops="cuda", fuse_qkv=True)) == (g0 - L * (2 + 4), a0 - 2 * L)
    assert _counts(MemoryConfig(ops="cuda", fuse_gate_up=True)) == (g0 - L * (1 + 2), a0 - L)
    assert _counts(MemoryConfig(ops="cuda", fuse_block_add=True)) == (g0, a0 - 2 * (L - 1))
    assert _counts(MemoryConfig(ops="cuda", **FUSIONS["all"])) == (g0 - 9 * L, 2)


def _saved(memory: MemoryConfig) -> tuple[int, int]:
    """(bytes autograd keeps for backward after a training forward, host bytes the offload copied)."""
    m = build(CFG, memory)
    ids, labels = batch(CFG)
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:  # a weight or a view of one (a transposed weight) is no activation
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        s, n = m(ids, labels=labels)
    host = m.offload.host_bytes if m.offload is not None else 0
    (s / n).backward()
    return sum(seen.values()), host


@pytest.mark.parametrize("ops", ["torch", "cuda"])
@pytest.mark.parametrize("mode", ["plain", "selective+offload", "selective+tiles+offload"])
def test_nothing_more_is_saved_or_offloaded(request, ops, mode):
    """The fusions keep what a step saves (a packed output's storage is never held for one of its pieces)
    and what the offload moves to host, to the byte."""
    if ops == "cuda":
        request.getfixturevalue("cuda_ops")
    base = _saved(MemoryConfig(ops=ops, **MODES[mode]))
    for fusion, fuse in FUSIONS.items():
        assert _saved(MemoryConfig(ops=ops, **MODES[mode], **fuse)) == base, fusion


def test_full_recompute_would_save_twice_the_input_with_the_block_add():
    """Why the config refuses fuse_block_add under full recompute: the checkpoint would keep the residual and
    the MLP branch apart (two (B, T, d) tensors a block) where it keeps their sum (one). The forward is still
    exact (the refusal is about memory, not correctness)."""
    full = MemoryConfig(recompute="full")
    forced = MemoryConfig.model_construct(**{**full.model_dump(), "fuse_block_add": True})  # past the validator
    (b_full, _), (b_forced, _) = _saved(full), _saved(forced)
    act = B * T * CFG.d_model * 4
    assert b_forced - b_full == (CFG.n_layers - 1) * act
    ids, labels = batch(CFG)
    assert_same(step(build(CFG, forced), ids, labels), step(build(CFG, MemoryConfig()), ids, labels), "forced")


def test_installed_flags_and_the_state_dict_unchanged():
    m = build(CFG, MemoryConfig(**FUSIONS["all"]))
    plain = build(CFG, MemoryConfig())
    assert all(layer.self_attn.fuse_qkv and layer.mlp.fuse_gate_up for layer in m.layers)
    assert [layer.defer_add for layer in m.layers] == [True] * (CFG.n_layers - 1) + [False]
    assert not any(layer.self_attn.fuse_qkv or layer.mlp.fuse_gate_up or layer.defer_add for layer in plain.layers)
    sd, ref = m.state_dict(), plain.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    calls = []
    m.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: calls.append("q"))
    m.layers[0].mlp.up_proj.register_forward_hook(lambda *a: calls.append("up"))
    with torch.no_grad():
        m(batch(CFG)[0])
    assert calls == []  # the projections ran as one GEMM, not through their modules
    # for ZeRO-3: the weights the fused projections read are gathered around the module that reads them
    a, mlp = m.layers[1].self_attn, m.layers[1].mlp
    qkv = [p for lin in (a.q_proj, a.k_proj, a.v_proj) for p in lin.parameters()]
    assert [p for _, p in a.ds_external_parameters()] == qkv and len(qkv) == 3  # no biases in CFG
    assert [p for _, p in mlp.ds_external_parameters()] == [mlp.gate_proj.weight, mlp.up_proj.weight]
    assert not hasattr(plain.layers[1].self_attn, "ds_external_parameters")


# --------------------------------------------------------------------------- refused combinations
def test_full_recompute_refuses_the_block_add():
    with pytest.raises(ValidationError, match=r"memory.fuse_block_add with memory.recompute=full.*recompute=selective"):
        MemoryConfig(recompute="full", fuse_block_add=True)
    MemoryConfig(recompute="full", fuse_qkv=True, fuse_gate_up=True)  # the projections are fine under full
    errs = errors(["memory.recompute=full", "memory.fuse_block_add=true"])
    assert len(errs) == 1 and "memory.fuse_block_add with memory.recompute=full" in errs[0], errs


def family_sets(family: str) -> list[str]:
    """--set overrides selecting a family with the switches it fixes (config/schema/model.py FAMILIES)."""
    yaml = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
    return [f"model.family={family}", *(f"model.{k}={yaml(v)}" for k, v in FAMILIES[family].items())]


# the families whose layout is not pre
FAMILY_SETS = {"post": family_sets("olmo2"), "sandwich": family_sets("gemma3")}


@pytest.mark.parametrize("layout", ["post", "sandwich"])
def test_the_block_add_needs_the_pre_layout(layout):
    cfg = CFG.model_copy(update={"norm_layout": layout})
    with pytest.raises(ValueError, match=f"fuse_block_add with model.norm_layout={layout}"):
        build(cfg, MemoryConfig(fuse_block_add=True))
    family = FAMILY_SETS[layout]
    assert errors(family) == []
    errs = errors([*family, "memory.fuse_block_add=true"])
    assert errs == [
        f"memory.fuse_block_add with model.norm_layout={layout}: the fusion is built for the pre layout (Llama's), "
        f"whose next input_layernorm reads the residual sum; set memory.fuse_block_add=false for this model"
    ]
    fused = ["memory.fuse_qkv=true", "memory.fuse_gate_up=true", "memory.recompute=selective"]
    assert errors([*family, *fused]) == []
    assert errors(["memory.fuse_block_add=true", *fused]) == []


def test_hash_of_runs_before_the_fusions_and_a_resume_may_toggle_them():
    """Off (their default), the fusions leave a run's config hash as it was before they existed (tiny_cpu's,
    test_config_hash_unchanged_by_the_kernel_fields_at_their_defaults); on, they hash as themselves; a resume
    accepts switching them either way (the same block over the same parameters), not another memory field."""
    from megablu.config import config_hash, load_config
    from megablu.train.resume import resume_problems

    def cfg(sets):
        return load_config("tests/configs/tiny_cpu.yaml", sets, world_size=1, device="cpu")

    before = ["memory.loss=chunked", "memory.attention=sdpa"]
    on = ["memory.fuse_qkv=true", "memory.fuse_gate_up=true", "memory.fuse_block_add=true"]
    assert config_hash(cfg(before)) == "786b2824aa40a632"
    assert config_hash(cfg([*before, *on])) != config_hash(cfg(before))
    saved = cfg(before).model_dump(mode="json")
    assert resume_problems(saved, cfg([*before, *on]), 1) == []
    assert resume_problems(cfg([*before, *on]).model_dump(mode="json"), cfg(before), 1) == []
    assert resume_problems(saved, cfg([*before, *on, "memory.mlp_tiles=2"]), 1) == ["memory.mlp_tiles: saved 1, now 2"]
