"""STRING at inference (An et al. 2024, "Why Does the Effective Context Length of LLMs Fall Short?",
arXiv 2410.18745): the largest relative distances, rare in training, reuse well-trained positions.

Every relative distance d = m - n >= S (shift) is attended as d - S + W (local); d < S is unchanged.
RoPE scores depend on the relative position only: q rotated at m dotted with k rotated at n depends on
m - n, so the pair (m, n) at relative position d - S + W is q rotated at m dotted with k rotated at
n + (S - W). The model therefore keeps two copies of each key: k_r (rotated at n, the plain key) and
k_s (the raw key rotated at n + S - W with the model's own rotary, the same rope_len, so YaRN's
attention factor and the beyond_original choice carry over), and one attention runs over
[k_r ; k_s] with values [v ; v] and a boolean mask: k_r where 0 <= d < S, k_s where d >= S.
Each query sees each earlier token exactly once, so the softmax is the one over the remapped
positions (tests/model/test_string.py checks it against explicit per-pair positions in fp64).

`apply_string(model, cfg)` installs it on a built BluModel from outside (the eval does, for the
eval only, like memory/apply.py installs the kernels); the KV cache then also stores k_s.
Inference only: it is never applied to training forwards.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# query rows per SDPA call: bounds the (rows, keys) boolean mask and any score tensor a backend
# materialises, whatever the prefill chunk (a 32k whole-sequence forward holds (4096, <=36k) masks)
QUERY_BLOCK = 4096


def string_attention(q: torch.Tensor, k: torch.Tensor, ks: torch.Tensor, v: torch.Tensor, shift: int,
                     block: int = QUERY_BLOCK) -> torch.Tensor:
    """Causal GQA attention with STRING's remapped distances.

    q (B, T, H, D) rotated at the positions tk - T .. tk - 1 (bottom-right aligned: a whole sequence,
    a prefill chunk after a cached past, or a decode step T == 1); k, ks, v (B, tk, Hkv, D): the keys
    rotated at their positions 0 .. tk - 1 (k) and at position + S - W (ks). -> (B, T, H, D).

    Query rows [r0, r1) (positions [a, b)) need the plain keys of distances 0 <= d < S, positions
    [max(0, a - S + 1), b), and the shifted keys of d >= S, positions [0, b - S): each block attends
    to at most about tk + rows keys, not 2 tk."""
    T, tk = q.shape[1], k.shape[1]
    if ks.shape != k.shape:
        raise ValueError(f"string attention: shifted keys {tuple(ks.shape)} != keys {tuple(k.shape)}")
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
        a, b = off + r0, off + r1                        # absolute positions of these query rows
        lo, hi = max(0, a - shift + 1), max(0, b - shift)
        i = torch.arange(a, b, device=q.device)[:, None]
        d = i - torch.arange(lo, b, device=q.device)[None, :]
        near = (d >= 0) & (d < shift)                    # (rows, b - lo): plain keys
        far = (i - torch.arange(0, hi, device=q.device)[None, :]) >= shift   # (rows, hi): shifted keys
        mask = torch.cat([near, far], dim=1)
        keys = torch.cat([kh[:, :, lo:b], ksh[:, :, :hi]], dim=2)       # (B, Hkv, b - lo + hi, D)
        vals = torch.cat([vh[:, :, lo:b], vh[:, :, :hi]], dim=2)
        if rep > 1:
            keys, vals = keys.repeat_interleave(rep, dim=1), vals.repeat_interleave(rep, dim=1)
        outs.append(F.scaled_dot_product_attention(qh[:, :, r0:r1], keys, vals, attn_mask=mask))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2)


def apply_string(model, string) -> Optional[object]:
    """Install STRING (a StringConfig, or None to remove it) on a BluModel in place; returns the
    previous setting, so a caller can restore it (run_eval does, after its eval).

    model.string holds the setting BluModel.forward reads (it rotates the shifted keys at position
    + shift - local); every LocalAttention holds the shift its mask uses."""
    if not hasattr(model, "string"):   # not a BluModel (a test's oracle): nothing to install or remove
        if string is not None:
            raise ValueError(f"eval.string (STRING) needs a BluModel; {type(model).__name__} has no STRING path")
        return None
    prev = model.string
    model.string = string
    for m in model.modules():   # decoder.LocalAttention (found by its field: decoder imports this module)
        if hasattr(m, "string_shift"):
            m.string_shift = None if string is None else string.shift
    return prev
