"""STRING at inference (megablu/model/string.py): the attention and the whole model against explicit
per-pair relative positions (each pair (m, n) at P(d) = d if d < S else d - S + W, d = m - n: q rotated
at m, k rotated at m - P), in fp64 at 1e-10; the switch is live (a small S changes the logits), inert
when S exceeds every distance, and the KV-cache path (chunked prefill, decode) equals one full forward,
also under YaRN with apply=beyond_original. Plus the refusals (document masking, a sequence-parallel
core or slice, positions out of order) and the plain path's kernel being untouched."""

import math

import pytest
import torch
import torch.nn as nn

from megablu.config.schema import ModelConfig, RopeConfig, StringConfig, YarnConfig
from megablu.eval.generate import greedy_generate, new_cache
from megablu.model import decoder
from megablu.model.decoder import BluModel, KVCache
from megablu.model.rope import RotaryEmbedding
from megablu.model.string import (
    StringSetting,
    StringStats,
    apply_string,
    installed,
    string_attend,
    string_attention,
    string_attention_flex,
)
from megablu.ops.rope import rope_reference

TOL = 1e-10  # fp64 throughout: the remapped and the explicit computation differ by rounding only
YARN_BO = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=4.0, original_max_position=16, apply="beyond_original"))


def P(d: int, S: int, W: int) -> int:
    return d if d < S else d - S + W


def _rot(x, rot, pos, rope_len=None):
    """x (B, T, H, D) rotated at positions pos (T,) with `rot`'s tables (rope_len: the sequence's length)."""
    p = torch.as_tensor(pos)[None]
    rl = None if rope_len is None else torch.full((1, 1), rope_len)
    c, s = rot(p, torch.float64, rl)
    return rope_reference(x, x, c, s)[1]


def reference_attention(q, k, v, rot, S, W, positions, rope_len=None):
    """Raw q (B, T, H, D) at `positions`, raw k/v (B, tk, Hkv, D) at 0..tk-1: softmax over the keys n <= m
    of q_m(m) . k_n(m - P(m - n)) / sqrt(D), one query at a time. -> (B, T, H, D)."""
    B, T, H, D = q.shape
    rep = H // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    out = torch.zeros_like(q)
    for t, m in enumerate(positions):
        qm = _rot(q[:, t : t + 1], rot, [m], rope_len)  # (B, 1, H, D)
        kp = _rot(k[:, : m + 1], rot, [m - P(m - n, S, W) for n in range(m + 1)], rope_len)  # (B, m+1, H, D)
        p = torch.softmax(torch.einsum("bhd,bnhd->bhn", qm[:, 0], kp) / math.sqrt(D), -1)
        out[:, t] = torch.einsum("bhn,bnhd->bhd", p, v[:, : m + 1])
    return out


# (kernel, its block): sdpa's query-row blocks (7 splits the queries the way a 32k forward is split), flex's tiles
# (8 and 16 make many tiles, with full and skipped ones, out of these short sequences)
KERNELS = [("sdpa", 4096), ("sdpa", 7), ("flex", 8), ("flex", 16), ("flex", 128)]


def _attend(kind, size, q, k, ks, v, S):
    if kind == "sdpa":
        return string_attention(q, k, ks, v, S, block=size, impl="sdpa")
    return string_attention_flex(q, k, ks, v, S, tile=size)  # eager on the CPU: full tiles skip mask_mod


@pytest.mark.parametrize("S,W", [(12, 3), (5, 0), (1, 0), (30, 29), (60, 5), (23, 4), (18, 1)])
@pytest.mark.parametrize("kind,size", KERNELS)
def test_attention_equals_explicit_positions(S, W, kind, size):
    """Whole sequence (T == tk), GQA (6 query heads on 2 kv heads), an odd T, batch 2 (flex: one block mask
    broadcast over the batch). S=60 > T: every distance is plain."""
    g = torch.Generator().manual_seed(S * 100 + W)
    T, H, Hk, D = 41, 6, 2, 16
    rot = RotaryEmbedding(D, RopeConfig(theta=10000.0))
    q, k, v = (torch.randn(2, T, h, D, generator=g, dtype=torch.float64) for h in (H, Hk, Hk))
    pos = list(range(T))
    qr, kr = _rot(q, rot, pos), _rot(k, rot, pos)
    ks = _rot(k, rot, [n + S - W for n in pos])
    got = _attend(kind, size, qr, kr, ks, v, S)
    ref = reference_attention(q, k, v, rot, S, W, pos)
    assert (got - ref).abs().max() < TOL


@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("kind,size", [("sdpa", 4), ("flex", 8)])
def test_attention_bottom_right_aligned(T, kind, size):
    """A decode step (T == 1) and a chunk of 9 new queries after a cached past of 32 keys."""
    g = torch.Generator().manual_seed(T)
    tk, H, Hk, D, S, W = 41, 4, 2, 8, 10, 2
    rot = RotaryEmbedding(D, RopeConfig(theta=500.0))
    q = torch.randn(1, T, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, tk, Hk, D, generator=g, dtype=torch.float64) for _ in range(2))
    pos = list(range(tk - T, tk))
    got = _attend(
        kind, size, _rot(q, rot, pos), _rot(k, rot, range(tk)), _rot(k, rot, [n + S - W for n in range(tk)]), v, S
    )
    assert (got - reference_attention(q, k, v, rot, S, W, pos)).abs().max() < TOL


def tiny(rope=None, seed=0, h=4, kv=2):
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=h, n_kv_heads=kv, ffn_dim=64, vocab_size=61)
    m = BluModel(cfg, rope or RopeConfig(theta=10000.0), seed=seed)
    return m.double().eval()


@torch.no_grad()
def reference_model(m: BluModel, ids, S, W, rope_len=None):
    """The whole model with explicit per-pair positions in every layer (no cache, no string_attention)."""
    B, T = ids.shape
    h = m.embed_tokens(ids)
    for layer in m.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_proj(x).view(B, T, a.n_heads, a.head_dim)
        k = a.k_proj(x).view(B, T, a.n_kv_heads, a.head_dim)
        v = a.v_proj(x).view(B, T, a.n_kv_heads, a.head_dim)
        o = reference_attention(q, k, v, m.rotary, S, W, list(range(T)), rope_len)
        h = h + a.o_proj(o.reshape(B, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return m.lm_head(m.norm(h))


def string_model(rope, kernel="auto"):
    """A tiny model with STRING (S 9, W 2; eval.string.kernel `kernel`) on, two 30-token rows, and its
    explicit-positions reference (computed before any forward of the model under test)."""
    m = tiny(rope, seed=1)
    ids = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(0))
    apply_string(m, StringConfig(variant="fixed_shift", shift=9, local=2, kernel=kernel))
    with torch.no_grad():
        return m, ids, reference_model(m, ids, 9, 2, rope_len=30 if rope else None)


@pytest.mark.parametrize("rope", [None, YARN_BO], ids=["rope", "yarn-beyond-original"])
def test_model_equals_explicit_positions(rope):
    """The model's remapped forward (shifted keys at position + S - W through BluModel.forward's rotary,
    same rope_len) equals explicit positions layer by layer. Under YaRN beyond_original, T = 30 > 16
    picks YaRN (frequencies and attention factor) for both the plain and the shifted keys."""
    m, ids, ref = string_model(rope)
    with torch.no_grad():
        got = m(ids)
    assert (got - ref).abs().max() < TOL


def test_switch_is_live_and_inert_beyond_every_distance():
    m = tiny(seed=2)
    ids = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = m(ids)
        apply_string(m, StringConfig(variant="fixed_shift", shift=40, local=3))  # every distance < 40: none remapped
        inert = m(ids)
        apply_string(m, StringConfig(variant="fixed_shift", shift=8, local=3))
        live = m(ids)
        prev = apply_string(m, None)
        back = m(ids)
    assert prev == StringSetting(8, 3) and installed(m) is None
    assert (inert - plain).abs().max() < TOL
    assert (live - plain).abs().max() > 1e-6  # 1e-6: 1e9 x the rounding the equalities allow
    # rows before the first remapped distance (position < S) are untouched
    assert (live[:, :8] - plain[:, :8]).abs().max() < TOL
    assert torch.equal(back, plain)


@pytest.mark.parametrize(
    "rope,total",
    [(None, 36), (YARN_BO, 36), (YARN_BO, 14)],
    ids=["rope", "yarn-beyond-original", "beyond-original-short"],
)
@pytest.mark.parametrize("static", [True, False], ids=["static-cache", "cat-cache"])
def test_cache_path_equals_full_forward(rope, total, static):
    """Prefill in chunks of 7 through the cache (k and the shifted keys), then decode one token at a
    time: the logits at every position equal one forward of the whole sequence with STRING on. Under
    beyond_original, the total length (36 > 16: YaRN; 14 <= 16: the original RoPE) picks the rope once."""
    m = tiny(rope, seed=3)
    S, W, new = 9, 2, 6
    L = total - new
    ids = torch.randint(0, 61, (1, L), generator=torch.Generator().manual_seed(2))
    apply_string(m, StringConfig(variant="fixed_shift", shift=S, local=W))
    with torch.no_grad():
        if static:
            cache = new_cache(m, total, rope_len=total)
        else:
            cache = KVCache(m.cfg.n_layers, rope_len=total)
        logits = [m(ids[:, s : s + 7], cache=cache) for s in range(0, L, 7)]
        seq = ids
        for _ in range(new):
            tok = logits[-1][:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, tok], 1)
            logits.append(m(tok, cache=cache))
        got = torch.cat(logits, 1)[:, : total - 1]
        full = m(seq, rope_len=total)[:, : total - 1]
        assert cache.ks[0].shape[1] == cache.k[0].shape[1] == total
        assert (got - full).abs().max() < TOL
        if total > S + 1:  # the remapping is exercised: the plain model differs
            apply_string(m, None)
            assert (m(seq, rope_len=total)[:, : total - 1] - full).abs().max() > 1e-6
            apply_string(m, StringConfig(variant="fixed_shift", shift=S, local=W))
        # greedy_generate through the cache equals its recompute path with STRING on
        ref = greedy_generate(m, ids, new, use_cache=False)
        for chunk in (0, 7, 1):
            assert torch.equal(greedy_generate(m, ids, new, prefill_chunk=chunk), ref), chunk


@pytest.mark.parametrize("static", [True, False], ids=["static-cache", "cat-cache"])
def test_truncate_keeps_the_shifted_keys_aligned(static):
    m = tiny(seed=4)
    apply_string(m, StringConfig(variant="fixed_shift", shift=5, local=1))
    ids = torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = new_cache(m, 24, rope_len=24) if static else KVCache(m.cfg.n_layers, rope_len=24)
        m(ids, cache=cache)
        cache.truncate(12)
        assert [t.shape[1] for t in cache.ks] == [t.shape[1] for t in cache.k] == [12, 12]
        # continuing after the truncation equals a forward of the first 12 tokens plus the new ones
        got = m(ids[:, 12:15], cache=cache)
        full = m(ids[:, :15], rope_len=24)[:, 12:15]
    assert (got - full).abs().max() < TOL


def test_string_never_runs_the_causal_kernel_where_a_distance_reaches_the_shift(monkeypatch):
    """memory.attention (fa4 / sdpa causal) is for the plain path; STRING runs string_attention wherever the
    keys exceed S (S = 6: the whole 12 tokens, prefill chunks of 7, decode steps; at most S keys is
    test_at_most_s_keys_run_the_plain_attention's case)."""
    m = tiny(seed=5)
    for mod in m.modules():
        if isinstance(mod, decoder.LocalAttention):
            mod.kernel = "fa4"

    def boom(*a, **k):
        raise AssertionError("the causal kernel ran with STRING on")

    monkeypatch.setattr(decoder, "causal_attention", boom)
    apply_string(m, StringConfig(variant="fixed_shift", shift=6, local=2))
    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        m(ids)
        greedy_generate(m, ids, 3, prefill_chunk=7)


def test_at_most_s_keys_run_the_plain_attention(monkeypatch):
    """With at most S keys no distance reaches the shift: the layer runs its plain attention (the configured
    kernel, no string_attention), so the logits are the plain model's bit for bit; one key more and
    string_attention runs."""
    from megablu.model import string as string_mod

    m = tiny(seed=2)
    ids = torch.randint(0, 61, (2, 41), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = m(ids[:, :40])
        apply_string(m, StringConfig(variant="fixed_shift", shift=40, local=3))
        string_mod.kernels_used(m, reset=True)
        same = m(ids[:, :40])
        assert torch.equal(same, plain)
        assert string_mod.kernels_used(m, reset=True) == {"plain": 2}  # one call per layer
        real = string_mod.string_attention
        monkeypatch.setattr(
            string_mod, "string_attention", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran"))
        )
        m(ids[:, :40])
        with pytest.raises(AssertionError, match="ran"):
            m(ids)  # 41 keys: distance 40 = S is remapped
        monkeypatch.setattr(string_mod, "string_attention", real)
        # a prefill chunk after a cached past: the keys, not the chunk's rows, decide
        string_mod.kernels_used(m, reset=True)
        cache = KVCache(m.cfg.n_layers, rope_len=41)
        got = torch.cat([m(ids[:, :30], cache=cache), m(ids[:, 30:], cache=cache)], 1)
    assert string_mod.kernels_used(m, reset=True) == {"plain": 2, "sdpa": 2}
    assert string_mod.kernels_used(tiny(seed=2)) == {}  # counted per model
    assert (got - m(ids, rope_len=41)).abs().max() < TOL


def test_flex_past_its_recompile_limit_goes_on_with_sdpa(monkeypatch, caplog):
    """The compiled flex kernel refusing one more shape (dynamo's recompile limit; an H100 eval met it on
    2026-12-06) is not the eval's end: the call and every later one with the same StringStats (one model's)
    run the sdpa kernel, with one warning, and the kernel counts say so."""
    from megablu.model import string as string_mod

    calls = []

    def limit(*a, **k):
        calls.append(a[0].shape)
        raise string_mod.flex_recompile_error()("recompile limit")

    monkeypatch.setattr(string_mod, "string_attention_flex", limit)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 20, 4, 8, generator=g)
    k, ks, v = (torch.randn(1, 20, 2, 8, generator=g) for _ in range(3))
    stats = StringStats()
    ref = string_attention(q, k, ks, v, 6, impl="sdpa", stats=stats)
    with caplog.at_level("WARNING", logger=string_mod.__name__):
        assert torch.equal(string_attention(q, k, ks, v, 6, impl="flex", stats=stats), ref)
        assert torch.equal(string_attention(q, k, ks, v, 6, impl="flex", stats=stats), ref)
        assert torch.equal(string_attention(q, k, ks, v, 6, impl="auto", stats=stats), ref)
    assert len(calls) == 1 and sum("recompile limit" in r.getMessage() for r in caplog.records) == 1
    assert string_mod.string_impl(torch.device("cuda"), 4096, flex_off=stats.flex_off is not None) == "sdpa"
    assert stats.used == {"sdpa": 4} and "recompile limit" in stats.flex_off
    # another model's stats (a fresh StringStats) tries flex again
    string_attention(q, k, ks, v, 6, impl="flex")
    assert len(calls) == 2
    # any other error of the kernel is not swallowed
    monkeypatch.setattr(string_mod, "string_attention_flex", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        string_attention(q, k, ks, v, 6, impl="flex")


def test_plain_path_unchanged(monkeypatch):
    """String off: the whole-sequence forward calls the configured causal kernel, as before."""
    m = tiny(seed=5)
    seen = []
    real = decoder.causal_attention
    monkeypatch.setattr(
        decoder, "causal_attention", lambda q, k, v, kernel: seen.append(kernel) or real(q, k, v, kernel)
    )
    with torch.no_grad():
        m(torch.zeros(1, 8, dtype=torch.long))
    assert seen == ["sdpa", "sdpa"]


def test_refusals():
    m = tiny(seed=6)
    apply_string(m, StringConfig(variant="fixed_shift", shift=6, local=2))
    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="document masking"):
        m(ids, doc_ids=torch.zeros(1, 12, dtype=torch.long))
    with pytest.raises(ValueError, match="parallel.sp=1"):
        m(ids, cache=KVCache(m.cfg.n_layers, seq_sharded=True))
    with pytest.raises(ValueError, match="in order"):
        m(ids, position_ids=torch.arange(12)[None] + 3)
    m(ids, position_ids=torch.arange(12)[None])  # the eval's own positions pass

    class Sharded(nn.Module):  # stands in for parallel/ulysses.py's UlyssesAttention
        def forward(self, q, k, v, cache=None, docs=None):
            return q

    m.layers[0].self_attn.core = Sharded()
    with pytest.raises(ValueError, match="parallel.sp=1"):
        m(ids)
    # a kernel name eval.string.kernel does not know is refused at install, before any forward
    with pytest.raises(ValueError, match="eval.string.kernel='flash'"):
        apply_string(tiny(seed=6), StringSetting(6, 2, kernel="flash"))


def test_removed_string_leaves_the_model_as_built(monkeypatch):
    """apply_string(model, None) takes every piece out again: no rotary hook, no Attention forward of its own,
    and logits bit for bit those of the model never touched; a model without STRING never calls into
    model/string.py (its attention functions raise here), and model/decoder.py does not import it."""
    import ast
    import inspect

    from megablu.model import string as string_mod

    def attention_forwards(m):
        return [layer.self_attn.__dict__.get("forward") for layer in m.layers]

    m, twin = tiny(seed=9), tiny(seed=9)
    ids = torch.randint(0, 61, (1, 24), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        plain = twin(ids)
        apply_string(m, StringConfig(variant="fixed_shift", shift=5, local=1))
        assert len(m.rotary._forward_hooks) == 1 and all(attention_forwards(m))
        assert not torch.equal(m(ids), plain)  # on: the logits move
        apply_string(m, None)
        assert installed(m) is None and not m.rotary._forward_hooks and not any(attention_forwards(m))
        for name in ("string_attend", "string_attention", "string_attention_flex"):
            monkeypatch.setattr(string_mod, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("STRING ran")))
        assert torch.equal(m(ids), plain)  # off again: the model as built
        assert torch.equal(twin(ids), plain)
    imported = {n.module for n in ast.walk(ast.parse(inspect.getsource(decoder))) if isinstance(n, ast.ImportFrom)}
    assert "string" not in imported and not any((mod or "").endswith(".string") for mod in imported), imported


# ---------------------------------------------------------------- the flex kernel (string_attention_flex)
def _explicit_mask(T: int, tk: int, S: int) -> torch.Tensor:
    """(T, 2 tk) bool over [plain keys ; shifted keys], one pair at a time (no tiles, no broadcasting)."""
    m = torch.zeros(T, 2 * tk, dtype=torch.bool)
    for r in range(T):
        i = r + tk - T
        for j in range(tk):
            m[r, j] = 0 <= i - j < S
            m[r, tk + j] = i - j >= S
    return m


@pytest.mark.parametrize(
    "T,tk,S,tile",
    [
        (41, 41, 12, 8),
        (41, 41, 1, 8),
        (64, 64, 16, 16),
        (9, 41, 10, 4),
        (1, 41, 10, 8),
        (37, 37, 60, 8),
        (33, 50, 7, 16),
        (128, 128, 40, 128),
        (64, 64, 23, 8),
        (64, 64, 18, 8),
        (60, 100, 41, 16),
        (50, 64, 41, 16),
    ],
)
def test_tile_classes_against_every_pair(T, tk, S, tile):
    """A skipped tile holds no visible pair, a full one only visible pairs (and is whole), and every tile
    with a visible pair is kept: checked against the explicit mask, pair by pair."""
    from megablu.model.string import tile_classes

    partial, full = tile_classes(T, tk, S, tile)
    m = _explicit_mask(T, tk, S)
    for a in range(partial.shape[0]):
        for b in range(partial.shape[1]):
            t = m[a * tile : (a + 1) * tile, b * tile : (b + 1) * tile]
            whole = t.shape == (tile, tile)
            assert bool(full[a, b]) == (whole and bool(t.all())), (a, b)
            assert bool(partial[a, b]) == (bool(t.any()) and not bool(full[a, b])), (a, b)
    assert not (partial & full).any()
    # the BlockMask the kernel gets lists exactly these tiles, partial as partial and full as full (an eager flex on
    # the CPU applies mask_mod to every pair, so only the compiled kernel would feel a tile listed in the wrong place)
    from megablu.model.string import _block_mask

    bm = _block_mask(T, tk, S, "cpu", tile)

    def listed(num, idx):
        got = torch.zeros_like(partial)
        for a in range(got.shape[0]):
            got[a, idx[0, 0, a, : num[0, 0, a]].long()] = True
        return got

    assert torch.equal(listed(bm.kv_num_blocks, bm.kv_indices), partial)
    assert torch.equal(listed(bm.full_kv_num_blocks, bm.full_kv_indices), full)


@pytest.mark.parametrize("rope", [None, YARN_BO], ids=["rope", "yarn-beyond-original"])
def test_model_and_cache_with_the_flex_kernel(rope, monkeypatch):
    """eval.string.kernel=flex through the model: the whole forward equals explicit positions, and the
    cache path (chunks of 7, then decode steps) equals the whole forward."""
    from megablu.model import string as string_mod

    seen = []
    real = string_mod.string_attention_flex
    monkeypatch.setattr(
        string_mod, "string_attention_flex", lambda *a, **kw: seen.append(a[0].shape[1]) or real(*a, **kw)
    )
    m, ids, ref = string_model(rope, kernel="flex")
    with torch.no_grad():
        full = m(ids)
        assert (full - ref).abs().max() < TOL
        cache = KVCache(m.cfg.n_layers, rope_len=30)
        got = torch.cat([m(ids[:, s : s + 7], cache=cache) for s in range(0, 30, 7)], 1)
    assert (got - full).abs().max() < TOL
    assert seen and set(seen) >= {30, 7, 2}, seen  # forced: whole forward, chunks, and the last chunk of 2


def test_impl_choice():
    from megablu.model.string import string_impl

    assert string_impl(torch.device("cpu"), 4096) == "sdpa"
    assert string_impl(torch.device("cuda"), 4096) == "flex" and string_impl(torch.device("cuda"), 1) == "sdpa"
    assert string_impl(torch.device("cuda"), 4096, flex_off=True) == "sdpa"
    assert string_impl(torch.device("cuda"), 4096, "sdpa") == "sdpa"
    assert string_impl(torch.device("cpu"), 1, "flex") == "flex"
    with pytest.raises(ValueError, match="eval.string.kernel='flash'"):
        string_impl(torch.device("cpu"), kernel="flash")
    x = torch.zeros(1, 3, 2, 8)
    with pytest.raises(ValueError, match="eval.string.kernel='dense'"):
        string_attention(x, x, x, x, 2, impl="dense")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled flex kernel needs CUDA (device runs)")
@pytest.mark.parametrize("T,tk", [(4096, 4096), (1000, 5000)])
def test_flex_matches_sdpa_on_cuda_bf16(T, tk):
    """On the GPU, compiled: flex and the masked-SDPA kernel agree in bf16 (SmolLM2's 9/3 heads, d 64),
    against an fp32 reference of the same inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, T, 9, 64, device="cuda", generator=g)
    k, ks, v = (torch.randn(1, tk, 3, 64, device="cuda", generator=g) for _ in range(3))
    S = 1500
    ref = string_attention(q, k, ks, v, S, impl="sdpa")  # fp32
    b = [x.bfloat16() for x in (q, k, ks, v)]
    got_flex = string_attention_flex(*b, S).float()
    got_sdpa = string_attention(*b, S, impl="sdpa").float()
    err_flex, err_sdpa = (got_flex - ref).abs().max().item(), (got_sdpa - ref).abs().max().item()
    assert err_flex < 2e-2 and err_flex < 2 * err_sdpa + 1e-3, (err_flex, err_sdpa)


# ---------------------------------------------------------------- against the authors' definition, written here
# HKUNLP/STRING string_for_llama.py, read for this test (docs/EVAL.md quotes it): RotaryEmbedding._set_cos_sin_cache
# multiplies the cos and sin tables by attention_factor = 0.1 * ln(2) + 1 (replace_with_string), and forward rotates
# the keys at their positions j, the "neighbor" queries at i and the "shifted" queries at i - diag_size + local_window.
AF = 0.1 * math.log(2) + 1


def authors_tables(D: int, theta: float, positions, af: float):
    """(len(positions), D) cos and sin as their RotaryEmbedding builds them (_compute_default_rope_parameters,
    _set_cos_sin_cache): emb = cat(freqs, freqs), cos and sin times af. In fp64 here (theirs: fp32 angles), so
    that a rotation at m against one at n is the rotation at m - n to fp64 rounding, whichever side turns."""
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    f = torch.outer(torch.as_tensor(list(positions), dtype=torch.float64), inv)
    emb = torch.cat([f, f], -1)
    return af * emb.cos(), af * emb.sin()


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


def authors_rot(x, D, theta, positions, af=1.0):
    """x (B, T, H, D) rotated at `positions` (T,) as their apply_rotary_pos_emb: x * cos + rotate_half(x) * sin."""
    c, s = authors_tables(D, theta, positions, af)
    return x * c[None, :, None] + _rotate_half(x) * s[None, :, None]


def dense_string(q, k, v, S, W, af, theta, positions):
    """The paper's relative-position matrix, dense: P[i, j] = i - j if i - j < S else i - j - S + W, masked where
    j > i; logit[i, j] = (q_i rotated at P[i, j]) . (k_j rotated at 0) / sqrt(D) with the tables times af, so
    af**2 on every logit; one masked softmax per row. Raw q (B, T, H, D) at `positions`, raw k, v (B, tk, Hkv, D)
    at 0 .. tk-1; GQA by repeating each kv head for its group (their repeat_kv). -> (B, T, H, D)."""
    B, T, H, D = q.shape
    tk = k.shape[1]
    rep = H // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    i = torch.as_tensor(positions)[:, None]
    d = i - torch.arange(tk)[None, :]  # (T, tk)
    P = torch.where(d < S, d, d - S + W).clamp(min=0)  # (T, tk); d < 0 is masked below
    qp = torch.stack([authors_rot(q, D, theta, [p] * T, af) for p in range(int(P.max()) + 1)])  # (npos, B, T, H, D)
    q_at = qp[P, :, torch.arange(T)[:, None]]  # (T, tk, B, H, D): q_i rotated at P[i, j]
    k0 = authors_rot(k, D, theta, [0] * tk, af)  # (B, tk, H, D)
    logits = torch.einsum("ijbhd,bjhd->bhij", q_at, k0) / math.sqrt(D)
    logits = logits.masked_fill((d < 0)[None, None], float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(logits, -1), v)


def authors_two_part(q, k, v, S, W, af, theta, prefill: bool):
    """string_for_llama.py's own algorithm, dense, on a whole sequence (queries at 0 .. T-1): the neighbor
    queries (at i) over keys j >= i - S (prefill: flash_attn_func window_size=[S, 0], inclusive, so d <= S) or
    j >= i - S + 1 (decode: flash decoding over key_cache[kv_len - S : kv_len], d <= S - 1); the shifted queries
    (at i - S + W) of rows i >= S over keys j <= i - S; the two merged by their log-sum-exps (their lse_gap)."""
    B, T, H, D = q.shape
    rep = H // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    pos = list(range(T))
    q1 = authors_rot(q, D, theta, pos, af)
    q2 = authors_rot(q, D, theta, [p - S + W for p in pos], af)
    kr = authors_rot(k, D, theta, pos, af)
    d = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    near = (d >= 0) & (d <= (S if prefill else S - 1))
    far = d >= S

    def part(qq, mask):
        lg = torch.einsum("bihd,bjhd->bhij", qq, kr) / math.sqrt(D)
        lg = lg.masked_fill(~mask[None, None], float("-inf"))
        lse = torch.logsumexp(lg, -1)  # (B, H, T)
        return torch.einsum("bhij,bjhd->bihd", torch.softmax(lg, -1).nan_to_num(), v), lse

    o1, l1 = part(q1, near)
    o2, l2 = part(q2, far)
    out = o1.clone()
    t = slice(S, T)  # their diag_out_tail / shifted_out rows
    g = torch.sigmoid(l2[..., t] - l1[..., t]).transpose(1, 2)[..., None]  # 1 / (1 + exp(lse_d - lse_s))
    out[:, t] = o1[:, t] * (1 - g) + o2[:, t] * g
    return out


@pytest.mark.parametrize("S,W,T", [(12, 3, 41), (1, 0, 37), (30, 29, 41), (23, 4, 64)])
def test_dense_position_matrix_equals_the_authors_two_part_decode_rule(S, W, T):
    """The two references agree with each other where they should: the dense position matrix is the authors'
    two-part merge with the decode rule (d < S plain, d >= S shifted); their prefill's inclusive window adds the
    key at d = S a second time (at its plain position) to every row from S on, and nothing to the rows before."""
    g = torch.Generator().manual_seed(S + T)
    q = torch.randn(2, T, 6, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, T, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    dense = dense_string(q, k, v, S, W, AF, 500.0, range(T))
    assert (authors_two_part(q, k, v, S, W, AF, 500.0, prefill=False) - dense).abs().max() < TOL
    pre = authors_two_part(q, k, v, S, W, AF, 500.0, prefill=True)
    assert (pre[:, :S] - dense[:, :S]).abs().max() < TOL
    assert (pre[:, S:] - dense[:, S:]).abs().amax(dim=(0, 2, 3)).min() > 1e-6  # every row from S on differs


VARIANTS = [("fixed_shift", 1.0), ("authors", AF)]


@pytest.mark.parametrize("variant,af", VARIANTS)
@pytest.mark.parametrize("S,W,T", [(12, 3, 41), (1, 0, 37), (30, 29, 41), (45, 4, 41)])
@pytest.mark.parametrize("impl", ["sdpa", "flex"])
def test_attention_fwd_bwd_against_the_dense_position_matrix(variant, af, S, W, T, impl):
    """string_attend with STRING's setting (shift S, factor af, kernel impl), fed keys and queries
    rotated here with the authors' tables (no af: megablu puts af**2 on q), equals dense_string in the output and
    in the gradients of the raw q, k, v: GQA 6/2, odd T, batch 2, fp64. S = 45 > T: every distance is plain
    (the plain-attention path, still scaled). Gradients with sdpa only: FlexAttention has no backward on a CPU
    (the eval never differentiates STRING; the sdpa kernel is the reference the flex one is compared with)."""
    theta, D, bwd = 500.0, 16, impl == "sdpa"
    g = torch.Generator().manual_seed(S * 7 + T)
    q = torch.randn(2, T, 6, D, generator=g, dtype=torch.float64, requires_grad=bwd)
    k, v = (torch.randn(2, T, 2, D, generator=g, dtype=torch.float64, requires_grad=bwd) for _ in range(2))
    w = torch.randn(2, T, 6, D, generator=g, dtype=torch.float64)
    pos = list(range(T))
    out = string_attend(
        decoder.LocalAttention(),
        authors_rot(q, D, theta, pos),
        authors_rot(k, D, theta, pos),
        authors_rot(k, D, theta, [p + S - W for p in pos]),
        v,
        StringSetting(S, W, af, impl),
    )
    ref_out = dense_string(q, k, v, S, W, af, theta, pos)
    got, ref = [out], [ref_out]
    if bwd:
        got += torch.autograd.grad((out * w).sum(), (q, k, v))
        ref += torch.autograd.grad((ref_out * w).sum(), (q, k, v))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert (a - b).abs().max() < TOL, name


@pytest.mark.parametrize("T", [1, 9])
def test_attention_decode_step_against_the_dense_position_matrix(T):
    """A decode step and a chunk of 9 queries after 32 cached keys (bottom-right aligned), authors' scale."""
    theta, D, S, W, tk = 500.0, 8, 10, 2, 41
    g = torch.Generator().manual_seed(T)
    q = torch.randn(1, T, 4, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, tk, 2, D, generator=g, dtype=torch.float64) for _ in range(2))
    pos = list(range(tk - T, tk))
    got = string_attend(
        decoder.LocalAttention(),
        authors_rot(q, D, theta, pos),
        authors_rot(k, D, theta, range(tk)),
        authors_rot(k, D, theta, [n + S - W for n in range(tk)]),
        v,
        StringSetting(S, W, AF),
    )
    assert (got - dense_string(q, k, v, S, W, AF, theta, pos)).abs().max() < TOL


@torch.no_grad()
def _dense_model(m: BluModel, ids, S, W, af, theta):
    """The tiny model with dense_string in every layer (its own weights, norms and MLPs; no megablu attention)."""
    B, T = ids.shape
    h = m.embed_tokens(ids)
    for layer in m.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_proj(x).view(B, T, a.n_heads, a.head_dim)
        k = a.k_proj(x).view(B, T, a.n_kv_heads, a.head_dim)
        v = a.v_proj(x).view(B, T, a.n_kv_heads, a.head_dim)
        h = h + a.o_proj(dense_string(q, k, v, S, W, af, theta, range(T)).reshape(B, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return m.lm_head(m.norm(h))


@pytest.mark.parametrize("T", [31, 47])
def test_model_with_each_variant_against_the_dense_reference(T):
    """BluModel with eval.string as a user sets it, for an input built to T tokens: variant authors
    (shift_ratio 0.3, local 2: S = int(0.3 T), the factor 1 + 0.1 ln 2 by default) and fixed_shift (S 9, W 2, no
    factor) equal the dense reference with that S and factor; the two variants differ from each other.
    At 1e-7: the model's rotary angles are fp32 (as transformers' and the authors'), 2-6e-9 from the fp64
    reference's here, while a wrong S (S + 1) or a missing factor moves the logits by 1e-4."""
    theta = 10000.0
    m = tiny(RopeConfig(theta=theta), seed=7)
    ids = torch.randint(0, 61, (2, T), generator=torch.Generator().manual_seed(T))
    outs = {}
    for cfg, S, af in (
        (StringConfig(shift_ratio=0.3, local=2), int(0.3 * T), AF),
        (StringConfig(variant="fixed_shift", shift=9, local=2), 9, 1.0),
    ):
        apply_string(m, cfg, T)
        with torch.no_grad():
            outs[cfg.variant] = m(ids)
        assert (outs[cfg.variant] - _dense_model(m, ids, S, 2, af, theta)).abs().max() < 1e-7, cfg.variant
    assert (outs["authors"] - outs["fixed_shift"]).abs().max() > 1e-6


def test_authors_variant_needs_the_input_length():
    m = tiny(seed=8)
    with pytest.raises(ValueError, match="pass the length"):
        apply_string(m, StringConfig())
    assert installed(m) is None
    with pytest.raises(ValueError, match="S = 3 <= local=128"):  # int(0.33 * 10) = 3
        apply_string(m, StringConfig(), 10)
    assert apply_string(m, StringConfig(), 1000) is None and installed(m) == StringSetting(330, 128, AF)
    assert apply_string(m, None) == StringSetting(330, 128, AF) and installed(m) is None
