"""STRING at inference (An et al. 2024, "Why Does the Effective Context Length of LLMs Fall Short?",
arXiv 2410.18745): the largest relative distances, rare in training, reuse well-trained positions.

Every relative distance d = m - n >= S (shift) is attended as d - S + W (local); d < S is unchanged; q is
multiplied by attention_factor**2 (the authors multiply q and k by the factor: string_for_llama.py scales the
rotary cos and sin tables). One input's setting is a StringSetting (S, W, factor, kernel): eval.string's variant
`authors` takes S = int(shift_ratio * L) for an input built to L tokens, `fixed_shift` the same S at every
length (StringConfig.shift_for; docs/EVAL.md has what the authors' code does, file by file).
RoPE scores depend on the relative position only: q rotated at m dotted with k rotated at n depends on
m - n, so the pair (m, n) at relative position d - S + W is q rotated at m dotted with k rotated at
n + (S - W). The model therefore keeps two copies of each key: k_r (rotated at n, the plain key) and
k_s (the raw key rotated at n + S - W with the model's own rotary, the same rope_len, so YaRN's
attention factor and the beyond_original choice carry over), and one attention runs over
[k_r ; k_s] with values [v ; v] and a boolean mask: k_r where 0 <= d < S, k_s where d >= S.
Each query sees each earlier token exactly once, so the softmax is the one over the remapped
positions (tests/model/test_string.py checks it against explicit per-pair positions in fp64).

Two kernels compute the same attention (eval.string.kernel: auto | sdpa | flex):
  sdpa  per block of query rows, SDPA with a boolean mask over [k_r ; k_s] (any device; the memory-
        efficient kernel, which computes every (row, key) tile, masked or not, on repeated kv heads);
  flex  FlexAttention over [k_r ; k_s] with a BlockMask built here from tile bounds: a tile with no
        visible pair is skipped and one where every pair is visible runs unmasked, so the work is a
        causal attention's plus the tiles on the two diagonals (d = 0 and d = S); GQA without
        repeating kv heads; compiled on CUDA (one compile per shape and process).
auto is flex on CUDA for more than one query row (a prefill), sdpa for a decode step and on a CPU.
The two differ by the order of their float sums only (tests/model/test_string.py). flex compiles once per
shape; dynamo refuses more shapes than RECOMPILE_LIMIT per process (an eval that scores whole short
validation documents of every length meets many), and the model goes on with sdpa, logged once and
recorded in its StringStats (kernels_used).
Where no distance reaches S (keys <= S), the layer runs the plain attention of its LocalAttention instead of
either: the remapping is the identity there, so with attention_factor 1 those logits are the plain model's bit
for bit (the factor, as in the authors' code, still applies).

Installed from outside the model, like parallel/ulysses.py's apply_ulysses and memory/apply.py's switches:
`apply_string(model, cfg, length)` puts a forward hook on the model's rotary (it also makes the tables at
position + S - W: the same positions, dtype and rope_len) and sets a StringAttention as each Attention's
forward (the same projections and rotary op, then string_attend); `apply_string(model, None)` removes both,
leaving the model as built. Parameter names are unchanged: no module is added. The KV cache keeps the
shifted keys beside the keys (KVCache.append_shifted). Inference only: never applied to training forwards.
The model (model/decoder.py) never imports this module.

It lives in model/ (not eval/): it changes the model's attention for any caller that installs it (the eval's
generation and held-out loss, a test, an export check), and it needs only model/ and ops/ (the layering of
tests/test_imports.py: eval/ imports it, it imports nothing above model/).
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import torch
import torch.nn.functional as F

from .. import ops
from .decoder import Attention, Block, BluModel, KVCache, LocalAttention

# query rows per SDPA call: bounds the (rows, keys) boolean mask and any score tensor a backend
# materialises, whatever the prefill chunk (a 32k whole-sequence forward holds (4096, <=36k) masks)
QUERY_BLOCK = 4096


IMPLS = ("auto", "sdpa", "flex")
TILE = 128  # FlexAttention's sparse block (as ops/doc_attention.py)
RECOMPILE_LIMIT = 64  # compiled shapes of the flex kernel per process

log = logging.getLogger(__name__)


@dataclass
class StringStats:
    """One model's STRING attention calls per kernel since the last reset (flex, sdpa, and plain: keys <= S,
    the LocalAttention's own attention, STRING being the identity there), and why flex went off for the rest
    of this model's evals (None while on). apply_string keeps it on the model across installs, so an eval
    that installs STRING per cell counts all its cells (kernels_used)."""

    used: collections.Counter = field(default_factory=collections.Counter)
    flex_off: Optional[str] = None


def flex_recompile_error() -> type[Exception]:
    """dynamo's exception for a compile past the limit (torch >= 2.6), or a class nothing raises."""
    import torch._dynamo.exc as exc

    return getattr(exc, "FailOnRecompileLimitHit", type("NoFailOnRecompileLimitHit", (Exception,), {}))


def string_impl(device: torch.device, rows: int = 2, kernel: str = "auto", flex_off: bool = False) -> str:
    """The kernel STRING attention takes for `rows` query rows on `device`: `kernel` (eval.string.kernel)
    unless auto, which is flex on CUDA for a prefill (unless flex went off) and sdpa otherwise."""
    if kernel not in IMPLS:
        raise ValueError(
            f"eval.string.kernel={kernel!r}: must be one of {', '.join(IMPLS)} (auto: flex on CUDA "
            f"for a prefill, sdpa otherwise)"
        )
    if kernel == "auto":
        return "flex" if torch.device(device).type == "cuda" and rows > 1 and not flex_off else "sdpa"
    return kernel


def string_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    ks: torch.Tensor,
    v: torch.Tensor,
    shift: int,
    block: int = QUERY_BLOCK,
    impl: str = "auto",
    stats: Optional[StringStats] = None,
) -> torch.Tensor:
    """Causal GQA attention with STRING's remapped distances.

    q (B, T, H, D) rotated at the positions tk - T .. tk - 1 (bottom-right aligned: a whole sequence,
    a prefill chunk after a cached past, or a decode step T == 1); k, ks, v (B, tk, Hkv, D): the keys
    rotated at their positions 0 .. tk - 1 (k) and at position + S - W (ks). -> (B, T, H, D).
    `impl`: auto | sdpa | flex (string_impl); `stats` (a model's StringStats; None: a fresh one for this call)
    counts the call and remembers flex going off.

    Query rows [r0, r1) (positions [a, b)) need the plain keys of distances 0 <= d < S, positions
    [max(0, a - S + 1), b), and the shifted keys of d >= S, positions [0, b - S): each block attends
    to at most about tk + rows keys, not 2 tk."""
    stats = stats if stats is not None else StringStats()
    T, tk = q.shape[1], k.shape[1]
    if ks.shape != k.shape:
        raise ValueError(f"string attention: shifted keys {tuple(ks.shape)} != keys {tuple(k.shape)}")
    if tk < T:
        raise ValueError(f"string attention: {T} query rows but only {tk} keys (the keys include the queries' own)")
    impl = string_impl(q.device, T, impl, stats.flex_off is not None)
    if impl == "flex" and stats.flex_off:  # this model's flex met its recompile limit (below): sdpa from then on
        impl = "sdpa"
    if impl == "flex":
        try:
            out = string_attention_flex(q, k, ks, v, shift)
            stats.used["flex"] += 1
            return out
        except flex_recompile_error() as e:
            stats.flex_off = f"dynamo's recompile limit ({RECOMPILE_LIMIT} shapes) at T={T}, keys={tk}"
            log.warning(
                "STRING: the flex kernel hit dynamo's recompile limit (%d shapes in this process; %s); the "
                "rest of this model's STRING attention runs the sdpa kernel (the same attention, slower)",
                RECOMPILE_LIMIT,
                type(e).__name__,
            )
            impl = "sdpa"
    off = tk - T
    # GQA: each kv head repeated for its query heads. SDPA's enable_gqa runs only the flash and math
    # kernels on CUDA, and flash takes no mask: the math kernel would hold (B, H, rows, keys) scores.
    # Repeated heads let the memory-efficient kernel take the boolean mask.
    rep = q.shape[2] // k.shape[2]
    # (B, T, H, D) -> (B, H, T, D)
    qh, kh, ksh, vh = (x.transpose(1, 2) for x in (q, k, ks, v))
    outs = []
    for r0 in range(0, T, block):
        r1 = min(r0 + block, T)
        a, b = off + r0, off + r1  # absolute positions of these query rows
        lo, hi = max(0, a - shift + 1), max(0, b - shift)
        i = torch.arange(a, b, device=q.device)[:, None]
        d = i - torch.arange(lo, b, device=q.device)[None, :]
        near = (d >= 0) & (d < shift)  # (rows, b - lo): plain keys
        far = (i - torch.arange(0, hi, device=q.device)[None, :]) >= shift  # (rows, hi): shifted keys
        mask = torch.cat([near, far], dim=1)
        keys = torch.cat([kh[:, :, lo:b], ksh[:, :, :hi]], dim=2)  # (B, Hkv, b - lo + hi, D)
        vals = torch.cat([vh[:, :, lo:b], vh[:, :, :hi]], dim=2)
        if rep > 1:
            keys, vals = keys.repeat_interleave(rep, dim=1), vals.repeat_interleave(rep, dim=1)
        outs.append(F.scaled_dot_product_attention(qh[:, :, r0:r1], keys, vals, attn_mask=mask))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    stats.used["sdpa"] += 1
    return out.transpose(1, 2)


def tile_classes(
    T: int, tk: int, shift: int, tile: int = TILE, device: Optional[torch.device] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) booleans (n_q, n_kv) over the tiles of `tile` query rows x `tile` keys of
    [k_r ; k_s] (2 tk keys): full when every pair in the tile is visible (and the tile is whole, not cut
    by a length), partial when some are; neither: skipped.

    Query row r sits at position i = r + tk - T. Plain key j (< tk) is visible iff 0 <= i - j < S,
    shifted key tk + j iff i - j >= S. Over a tile's rows [qa, qb] and the key positions [a, b] of one
    part, the distance runs over [qa - b, qb - a]; a tile straddling the two parts is full only when both
    parts are."""
    off = tk - T
    nq, nk = -(-T // tile), -(-2 * tk // tile)
    r0 = torch.arange(nq, device=device) * tile
    r1 = torch.clamp(r0 + tile, max=T) - 1
    qa, qb = (r0 + off)[:, None], (r1 + off)[:, None]
    c0 = torch.arange(nk, device=device) * tile
    c1 = torch.clamp(c0 + tile, max=2 * tk) - 1
    has_p, pa, pb = c0 < tk, c0, torch.clamp(c1, max=tk - 1)  # the plain keys' positions
    has_s, sa, sb = c1 >= tk, torch.clamp(c0, min=tk) - tk, c1 - tk  # the shifted keys' positions
    p_any = has_p & (qb - pa >= 0) & (qa - pb <= shift - 1)
    p_all = ~has_p | ((qa - pb >= 0) & (qb - pa <= shift - 1))
    s_any = has_s & (qb - sa >= shift)
    s_all = ~has_s | (qa - sb >= shift)
    whole = ((r1 - r0 + 1) == tile)[:, None] & ((c1 - c0 + 1) == tile)[None, :]
    any_ = p_any | s_any
    full = whole & any_ & p_all & s_all
    return any_ & ~full, full


@functools.lru_cache(maxsize=8)
def _block_mask(T: int, tk: int, shift: int, device: str, tile: int):
    """The BlockMask of one (T, tk, S) on one device: shared by every layer of a forward."""
    from torch.nn.attention.flex_attention import BlockMask

    from ..ops.doc_attention import tile_lists

    partial, full = tile_classes(T, tk, shift, tile, torch.device(device))
    off = tk - T

    def mask_mod(b, h, q_idx, kv_idx):
        plain = kv_idx < tk
        d = q_idx + off - torch.where(plain, kv_idx, kv_idx - tk)
        return torch.where(plain, (d >= 0) & (d < shift), d >= shift)

    # one (1, 1, n_q, n_kv) map: broadcast over the batch and the heads
    kv_num, kv_idx = tile_lists(partial[None, None])
    full_num, full_idx = tile_lists(full[None, None])
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=(T, 2 * tk)
    )


def string_attention_flex(
    q: torch.Tensor, k: torch.Tensor, ks: torch.Tensor, v: torch.Tensor, shift: int, tile: int = TILE
) -> torch.Tensor:
    """string_attention's flex kernel: q (B, T, H, D), k/ks/v (B, tk, Hkv, D) -> (B, T, H, D)."""
    from torch.nn.attention.flex_attention import flex_attention

    from ..ops.doc_attention import _compiled_flex

    T, tk = q.shape[1], k.shape[1]
    bm = _block_mask(T, tk, int(shift), str(q.device), tile)
    qh = q.transpose(1, 2)  # (B, H, T, D)
    keys = torch.cat([k, ks], dim=1).transpose(1, 2)  # (B, Hkv, 2 tk, D)
    vals = torch.cat([v, v], dim=1).transpose(1, 2)
    gqa = q.shape[2] != k.shape[2]
    if not q.is_cuda:  # eager (the tests): materialises the (T, 2 tk) scores, so short sequences only
        return flex_attention(qh, keys, vals, block_mask=bm, enable_gqa=gqa).transpose(1, 2)
    # one compile per shape (an eval has a few: each length, the last batch); past the recompile limit dynamo
    # would run flex eagerly, whose (B, H, T, 2 tk) fp32 scores at 32k are tens of GB: fail loudly instead
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
        out = _compiled_flex()(qh, keys, vals, block_mask=bm, enable_gqa=gqa)
    return out.transpose(1, 2)


@dataclass(frozen=True)
class StringSetting:
    """STRING as one input runs it: distances d >= shift are attended as d - shift + local, and the logits are
    multiplied by attention_factor**2 (q and k each by the factor, as the authors' rotary tables do); `kernel`
    (eval.string.kernel) picks the attention's kernel (string_impl)."""

    shift: int
    local: int
    attention_factor: float = 1.0
    kernel: str = "auto"

    def __post_init__(self):
        if not 0 <= self.local < self.shift:
            raise ValueError(f"STRING: local={self.local}, shift={self.shift}: need 0 <= local < shift")
        string_impl("cpu", kernel=self.kernel)  # a kernel name it does not know is refused here, before a forward


def string_setting(string, length: Optional[int] = None) -> Optional[StringSetting]:
    """The StringSetting of eval.string (a StringConfig) for an input built to `length` tokens: the authors'
    variant's S follows the length (StringConfig.shift_for), so it needs one; a fixed_shift config or a
    StringSetting does not. None stays None."""
    if string is None or isinstance(string, StringSetting):
        return string
    if string.variant != "fixed_shift" and length is None:
        raise ValueError(
            f"eval.string variant {string.variant}: S = int(shift_ratio {string.shift_ratio} x the "
            f"input's length); pass the length the input was built to (apply_string(model, cfg, length))"
        )
    S = string.shift if string.variant == "fixed_shift" else string.shift_for(length)
    if S <= string.local:
        raise ValueError(
            f"eval.string ({string.variant}) at {length} tokens: S = {S} <= local={string.local}; STRING "
            f"moves distances d >= S to d - S + local, closer only when local < S (config check: "
            f"megablu.config.schema.string_problems)"
        )
    return StringSetting(S, string.local, string.attention_factor, string.kernel)


def string_attend(
    local: LocalAttention,
    q,
    k,
    ks,
    v,
    setting: StringSetting,
    cache: Optional[KVCache] = None,
    docs=None,
    stats: Optional[StringStats] = None,
) -> torch.Tensor:
    """One layer's STRING attention after the rotary: q (B, T, H, D), k/ks/v (B, T, Hkv, D) of the new tokens
    (ks: the raw keys rotated at position + shift - local); the cache keeps ks beside k. `local` is the layer's
    LocalAttention: its index in the cache and, where the keys are at most S, its plain attention (the same
    logits as STRING there, bit for bit at attention_factor 1); its causal kernel never runs otherwise, whole
    sequence, prefill chunk or decode step."""
    stats = stats if stats is not None else StringStats()
    if docs is not None:
        raise ValueError(
            "eval.string (STRING) with document masking (data.doc_mask): document masking is for "
            "training on packed rows and STRING for evaluation; run the eval without doc_ids"
        )
    if cache is not None:
        k, v = cache.append(local.layer_idx, k, v)
        ks = cache.append_shifted(local.layer_idx, ks)
        if ks.shape[1] != k.shape[1]:
            raise RuntimeError(
                f"KV cache layer {local.layer_idx}: {ks.shape[1]} shifted keys but {k.shape[1]} "
                f"keys (STRING switched on or off mid-sequence?)"
            )
    scale = setting.attention_factor**2
    if scale != 1.0:  # the authors' factor on q and k: the logits times its square, every distance
        q = q * scale
    if k.shape[1] <= setting.shift:  # no distance d = m - n <= tk - 1 reaches S: STRING is the identity
        stats.used["plain"] += 1
        return local._plain(q, k, v)
    return string_attention(q, k, ks, v, setting.shift, impl=setting.kernel, stats=stats)


class _State:
    """What one installation shares between the rotary hook and the layers: the setting, the model's stats,
    and per forward the shifted tables and the positions its first layer checks against the cache."""

    def __init__(self, setting: StringSetting, stats: StringStats):
        self.setting, self.stats = setting, stats
        self.tables: Optional[tuple] = None
        self.positions: Optional[torch.Tensor] = None  # set by the rotary hook, checked once per forward

    def rotary_hook(self, rotary, args, kwargs, out):
        """After the model's rotary (position_ids, dtype, rope_len): the same tables at position + S - W."""
        a = dict(zip(("position_ids", "dtype", "rope_len"), args, strict=False), **kwargs)
        s = self.setting
        self.positions = a["position_ids"]
        self.tables = rotary.forward(a["position_ids"] + (s.shift - s.local), a["dtype"], a.get("rope_len"))

    def check_positions(self, cache: Optional[KVCache]) -> None:
        """string_attention takes a key's index in the sequence (the cache's) as its position, so the positions
        must be 0, 1, ... in order: refused otherwise (a sequence-parallel slice, restarted document
        positions). Once per forward, at its first layer (before that layer appends to the cache)."""
        pos, self.positions = self.positions, None
        if pos is None:
            return
        if cache is not None and cache.seq_sharded:
            raise ValueError("eval.string (STRING) with a sequence-sharded prefill: run the eval with parallel.sp=1")
        B, T = pos.shape
        start = cache.length if cache is not None else 0
        want = torch.arange(start, start + T, device=pos.device).expand(B, T)
        if not torch.equal(pos, want):
            raise ValueError(
                f"eval.string (STRING) needs position_ids {start}..{start + T - 1} in order (a "
                f"key's index is its position); got others"
            )


class StringAttention:
    """An Attention's forward with STRING (apply_string sets it as that module's `forward`): the same
    projections and rotary op as Attention.forward, the raw keys also rotated at position + shift - local with
    the shifted tables, then string_attend on the layer's LocalAttention."""

    def __init__(self, attn: Attention, state: _State):
        self.attn, self.state = attn, state

    def __call__(self, x, cos, sin, cache: Optional[KVCache] = None, docs=None):
        a, st = self.attn, self.state
        st.check_positions(cache)
        if not isinstance(a.core, LocalAttention):
            raise ValueError(
                f"eval.string (STRING) runs on one rank's attention, not {type(a.core).__name__} "
                f"(sequence parallelism shards the keys it remaps): run the eval with parallel.sp=1"
            )
        B, T, _ = x.shape
        q = a.q_proj(x).view(B, T, a.n_heads, a.head_dim)
        k = a.k_proj(x).view(B, T, a.n_kv_heads, a.head_dim)
        v = a.v_proj(x).view(B, T, a.n_kv_heads, a.head_dim)
        # the raw keys rotated at position + shift - local, by the same op and tables as the plain ones
        tables = st.tables
        assert tables is not None  # the rotary hook made them for this forward
        _, ks = ops.apply_rotary(k, k, tables[0], tables[1], impl=a.impl)
        q, k = ops.apply_rotary(q, k, cos, sin, impl=a.impl)
        out = string_attend(a.core, q, k, ks, v, st.setting, cache, docs, st.stats)
        return a.o_proj(out.reshape(B, T, a.n_heads * a.head_dim))


class _Installed:
    """STRING on one model: its state and the rotary hook's handle (removed with it)."""

    def __init__(self, state: _State, handle):
        self.state, self.handle = state, handle


def stats_of(model) -> StringStats:
    """The model's StringStats (kept on it across installs; made at first use)."""
    if getattr(model, "_string_stats", None) is None:
        model._string_stats = StringStats()
    return model._string_stats


def installed(model) -> Optional[StringSetting]:
    """The StringSetting installed on `model`, or None (never installed, or removed)."""
    inst = getattr(model, "_string", None)
    return inst.state.setting if inst is not None else None


def kernels_used(model, reset: bool = False) -> dict:
    """{kernel: attention calls} of `model` since the last reset (one call per layer per forward), plus
    flex_off: why flex stopped, when it did; reset=True starts the count again (an eval does, before its
    prompts)."""
    stats = stats_of(model)
    used = {**dict(stats.used), **({"flex_off": stats.flex_off} if stats.flex_off else {})}
    if reset:
        stats.used.clear()
    return used


def _remove(model) -> None:
    model._string.handle.remove()
    for layer in model.layers:
        layer.self_attn.__dict__.pop("forward", None)  # the class's forward again
    model._string = None


def apply_string(model, string, length: Optional[int] = None) -> Optional[StringSetting]:
    """Install STRING on a BluModel in place: `string` is a StringConfig (with `length`, the length the input
    was built to, for the authors' variant), a StringSetting, or None to remove it. Returns the previous
    StringSetting, so a caller can restore it (run_eval does, after its eval).

    Installing puts a forward hook on model.rotary (the shifted tables) and a StringAttention as every
    Attention's forward; installing again only changes the setting; None removes the hook and the forwards."""
    setting: Optional[StringSetting] = string_setting(string, length)
    if not isinstance(model, BluModel):  # not a BluModel (a test's oracle): nothing to install or remove
        if setting is not None:
            raise ValueError(f"eval.string (STRING) needs a BluModel; {type(model).__name__} has no STRING path")
        return None
    c = model.cfg
    if setting is not None and (c.qk_norm != "none" or c.nope_layers or c.sliding_layers):
        raise ValueError(
            f"eval.string (STRING) remaps RoPE positions of a plain q/k projection in full attention; "
            f"this model has model.qk_norm={c.qk_norm!r}, model.nope_layers={c.nope_layers}, "
            f"model.sliding_layers={c.sliding_layers} (family {c.resolved_family}), which STRING's "
            f"attention does not compute: remove eval.string"
        )
    prev = installed(model)
    if setting is None:
        if prev is not None:
            _remove(model)
        return prev
    if prev is not None:
        cast(_Installed, model._string).state.setting = setting
        return prev
    state = _State(setting, stats_of(model))
    handle = model.rotary.register_forward_hook(state.rotary_hook, with_kwargs=True)
    # installed from outside: each Attention's `forward` and the model's `_string` are instance attributes
    for layer in cast("Iterable[Block]", model.layers):
        cast(Any, layer.self_attn).forward = StringAttention(layer.self_attn, state)
    cast(Any, model)._string = _Installed(state, handle)
    return prev
