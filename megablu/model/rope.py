"""Rotary position embedding: the parent's frequencies (default, linear or llama3) with optional YaRN.

The YaRN math follows transformers' `modeling_rope_utils._compute_yarn_parameters`
(Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models"):
per-frequency blend of interpolated (inv_freq / factor) and extrapolated (inv_freq)
frequencies over a linear ramp between the correction dims of beta_fast and beta_slow
rotations, and an attention factor 0.1 ln(factor) + 1 that scales both cos and sin.

rope.scaling (linear, llama3) gives the parent's own frequencies, exactly as transformers'
`_compute_linear_scaling_rope_parameters` / `_compute_llama3_parameters`. YaRN on top of them
blends the PARENT's frequencies: interpolated (parent / factor) and extrapolated (parent) over
the same ramp of dim indices transformers' YaRN computes from theta. With no scaling this is
transformers' YaRN exactly; with one, transformers has no rope_type for it (model/hf.py refuses
to export it).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..config.schema import RopeConfig, RopeScalingConfig


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    # (dim/2,) fp32: theta^(-2i/dim)
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def scaled_inv_freq(dim: int, theta: float, s: Optional[RopeScalingConfig]) -> torch.Tensor:
    """The parent's frequencies (dim/2,): default, linear (all / factor) or llama3 (Meta's Llama 3.1
    band scaling: wavelengths above original/low_freq_factor divided by factor, below
    original/high_freq_factor kept, a linear blend in between), as transformers computes them."""
    inv = default_inv_freq(dim, theta)
    if s is None:
        return inv
    if s.type == "linear":
        return inv / s.factor
    orig, lo, hi = s.original_max_position, s.low_freq_factor, s.high_freq_factor
    assert orig is not None and lo is not None and hi is not None  # llama3: RopeScalingConfig requires them
    low_wl = orig / lo
    high_wl = orig / hi
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > low_wl, inv / s.factor, inv)
    smooth = (orig / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / s.factor + smooth * out
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, out)


def yarn_inv_freq(
    dim: int,
    theta: float,
    factor: float,
    original_max_position: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
    attention_factor: Optional[float] = None,
    base: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, float]:
    """(inv_freq (dim/2,), attention_factor), equal to transformers' YaRN parameters.

    base: the parent's frequencies when it was trained with a scaled rope (scaled_inv_freq);
    None: theta's default ones, transformers' YaRN."""
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(n_rot: float) -> float:
        # the dim index whose wavelength completes n_rot rotations over the original length
        return (dim * math.log(original_max_position / (n_rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp

    if base is None:
        pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        inv_extra = 1.0 / pos_freqs  # high frequencies: keep (extrapolate)
        inv_inter = 1.0 / (factor * pos_freqs)  # low frequencies: interpolate
    else:
        inv_extra, inv_inter = base, base / factor
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra_weight = 1 - ramp
    inv_freq = inv_inter * (1 - extra_weight) + inv_extra * extra_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """position_ids (B, T) -> cos, sin (B, T, D), fp32 math, scaled by the YaRN attention factor.

    With rope.yarn.apply=beyond_original the table is chosen per token from `rope_len`, the
    length of the sequence the token belongs to (model/packing.py defines it): YaRN's
    frequencies and attention factor when rope_len > original_max_position, the original
    RoPE's (scale 1) otherwise. One select between two frequency vectors per token, once per
    forward (every layer shares cos/sin); a short sequence gets exactly the native table.
    """

    def __init__(self, head_dim: int, rope: RopeConfig):
        super().__init__()
        native = scaled_inv_freq(head_dim, rope.theta, rope.scaling)
        if rope.yarn is None:
            inv_freq, scale = native, 1.0
        else:
            y = rope.yarn
            inv_freq, scale = yarn_inv_freq(
                head_dim,
                rope.theta,
                y.factor,
                y.original_max_position,
                y.beta_fast,
                y.beta_slow,
                y.truncate,
                y.attention_factor,
                base=native if rope.scaling is not None else None,
            )
        # A plain attribute, not a buffer: module.bfloat16() (DeepSpeed does it) must not round
        # the frequencies, and a checkpoint must never carry a stale table.
        self.inv_freq = inv_freq
        self.attention_scaling = scale
        length_aware = rope.yarn is not None and rope.yarn.apply == "beyond_original"
        # the original RoPE for sequences of at most original_max_position tokens
        self.short_inv_freq: Optional[torch.Tensor] = native if length_aware else None
        self.original_max_position = rope.yarn.original_max_position if rope.yarn is not None and length_aware else None

    @property
    def length_aware(self) -> bool:
        return self.short_inv_freq is not None

    @torch.no_grad()
    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype, rope_len: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rope_len: (B, T) or (B, 1) sequence length per token; read only when length_aware."""
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        if not self.length_aware:
            # (B, T, 1) * (D/2,) -> (B, T, D/2), fp32 as in transformers
            freqs = position_ids[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
        if rope_len is None:
            raise ValueError(
                "rope.yarn.apply=beyond_original: the RoPE needs each token's sequence length "
                "(rope_len); BluModel.forward derives it or takes it from its caller"
            )
        short, orig = self.short_inv_freq, self.original_max_position
        assert short is not None and orig is not None  # length_aware
        if short.device != position_ids.device:
            self.short_inv_freq = short = short.to(position_ids.device)
        long = (rope_len > orig)[..., None]  # (B, T|1, 1)
        inv = torch.where(long, self.inv_freq, short)  # (B, T|1, D/2)
        freqs = position_ids[..., None].float() * inv  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        # the attention factor only where YaRN applies; the same fp32 products as the scalar path
        # (torch.full, not torch.tensor: no host-to-device copy, so a CUDA graph can capture the step)
        scale = torch.where(
            long,
            torch.full((), self.attention_scaling, dtype=torch.float32, device=long.device),
            torch.full((), 1.0, dtype=torch.float32, device=long.device),
        )
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
