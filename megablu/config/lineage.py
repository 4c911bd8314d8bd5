"""What a child run may assume of its parent's RoPE: the costliest extension trap, checked.

A YaRN extension loses tens of points when its `original_max_position` was not the
length the parent had been trained at. `factor * original_max_position == window` (the
schema's invariant) cannot see that: 4 * 128 = 512 is as consistent as 2 * 256 = 512. Only
the parent's own record can, so every init_from is compared with what its checkpoint says
it was trained with (`ParentRecord`, read by `megablu.checkpoint.weights.parent_record`).

Rules (child rope C at window T, parent trained at window W with rope P):
- theta: C.theta == P.theta, unless `rope.allow_theta_change` (an ABF-style base raise
  is a recipe, but never an accident);
- scaling: C.scaling == P.scaling (linear / llama3: part of the frequencies the parent
  learned; YaRN applies on top of them, so a llama3 parent at W = max_position_embeddings
  takes C.yarn.original_max_position = W like any plain parent);
- P plain RoPE, C YaRN: C.yarn.original_max_position == W (the frequencies YaRN
  interpolates are the ones the parent learned at W);
- P YaRN (the parent is itself an extension), C YaRN: C keeps P's original_max_position
  and betas, with factor = T / original (YaRN's own 64k -> 128k step kept 4096 and raised
  the factor); an original set to the parent's window W re-bases frequencies the parent
  never saw;
- P YaRN, C without YaRN: refused (the child would compute other frequencies);
- P YaRN with an explicit attention_factor, C YaRN without one: refused (C would silently
  take 0.1 ln(factor) + 1, another attention temperature than the parent chose); an explicit
  value in C is a decision and is kept;
- no parent at all (init_from unset), C YaRN: refused unless `rope.allow_yarn_from_scratch`.
  YaRN re-scales frequencies a parent learned at original_max_position; random weights
  learned nothing at any length, and an empty `--set init_from=$PARENT` looks exactly like
  this (it trained a "YaRN extension" of random weights with exit 0).
`rope.yarn.apply` (always | beyond_original) is the child's recipe, not a property of the
parent's weights, and is not compared; `megablu eval` compares the whole rope, apply included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .schema import ModelConfig, RopeConfig


@dataclass(frozen=True)
class ParentRecord:
    """What a parent checkpoint records about how it was trained."""

    source: str  # where the record was read (manifest, config.json, ...)
    window: Optional[int]  # the sequence length it was trained at
    rope: Optional[RopeConfig]  # the RoPE it was trained with
    model: Optional[ModelConfig] = None  # the architecture its weights compute


# Every ModelConfig field that changes what the weights compute. Shapes alone cannot tell:
# 8 heads x 64 and 4 heads x 128 (or another kv-head split, another norm eps) load the same
# tensors and compute another function. init_std only shapes a random init.
ARCH_FIELDS = (
    "n_layers",
    "d_model",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "ffn_dim",
    "vocab_size",
    "tie_embeddings",
    "norm_eps",
    "qkv_bias",
    "qk_norm",
    "norm_layout",
    "nope_layers",
    "norm_offset",
    "embed_scale",
    "activation",
    "sliding_window",
    "sliding_layers",
)


def _arch_value(m: ModelConfig, field: str):
    return m.resolved_head_dim if field == "head_dim" else getattr(m, field)


def _same(a, b) -> bool:
    """Equal, floats at float32 precision: a norm eps that passed through a float32 field (a GGUF
    header, a transformers config read from one) is the same eps to the kernels, which add it in
    float32; 1e-5 against 1e-6 still differs."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def architecture_problems(recorded: Optional[ModelConfig], config: ModelConfig, source: str) -> list[str]:
    """Every field where the architecture a checkpoint records differs from the config's, as
    'model.field=config but source was trained with X; fix' (empty: identical or no record)."""
    if recorded is None:
        return []
    diff = [
        (f, _arch_value(config, f), _arch_value(recorded, f))
        for f in ARCH_FIELDS
        if not _same(_arch_value(config, f), _arch_value(recorded, f))
    ]
    if not diff:
        return []
    sets = " ".join(f"--set model.{f}={str(r).lower() if isinstance(r, bool) else r}" for f, _, r in diff)
    return [
        f"the config's model differs from the architecture {source} records: "
        + "; ".join(f"model.{f}={c} vs {r}" for f, c, r in diff)
        + f" (config vs checkpoint); its weights would load (the shapes can match) and compute another "
        f"function: use the checkpoint's architecture ({sets}) or its own config.resolved.yaml"
    ]


def _fmt_yarn(r: RopeConfig) -> str:
    y = r.yarn
    return "plain RoPE" if y is None else f"YaRN factor {y.factor:g} x original_max_position {y.original_max_position}"


def rope_lineage_problems(child: RopeConfig, window: int, parent: Optional[ParentRecord]) -> list[str]:
    """Every way the child's rope contradicts the parent's record, as 'field: values; fix'.

    parent None: the child has no parent (init_from unset)."""
    errs: list[str] = []
    if parent is None:
        y = child.yarn
        if y is not None and not child.allow_yarn_from_scratch:
            errs.append(
                f"init_from: not set, but rope.yarn is ({_fmt_yarn(child)}): YaRN re-scales the frequencies a parent "
                f"learned at original_max_position, and random weights were trained at no length (an empty "
                f"`--set init_from=$PARENT` gives this); set init_from=<the parent: a run dir, a step dir or an "
                f"exported model dir>, or rope.allow_yarn_from_scratch=true to train YaRN frequencies from random "
                f"weights on purpose"
            )
        return errs
    p, src = parent.rope, parent.source
    if p is None or parent.window is None:
        if child.yarn is not None:
            errs.append(
                f"init_from: {src} records no training window or rope, so rope.yarn.original_max_position="
                f"{child.yarn.original_max_position} cannot be checked against the length the parent was trained "
                f"at; give a megablu checkpoint, a `megablu ckpt export` dir, or a transformers dir whose "
                f"config.json has max_position_embeddings and the rope"
            )
        return errs
    W = parent.window
    return _base_rope_problems(child, p, src) + _yarn_lineage_problems(child, window, p, W, src)


def _base_rope_problems(child: RopeConfig, p: RopeConfig, src: str) -> list[str]:
    """theta, local_theta and scaling against the parent's."""
    errs: list[str] = []
    if child.theta != p.theta and not child.allow_theta_change:
        errs.append(
            f"rope.theta={child.theta:g} but the parent {src} was trained with rope.theta={p.theta:g}; set "
            f"rope.theta={p.theta:g} (or rope.allow_theta_change=true for a deliberate base change)"
        )
    if child.local_theta != p.local_theta:
        errs.append(
            f"rope.local_theta={child.local_theta} but the parent {src} was trained with rope.local_theta="
            f"{p.local_theta} (the sliding layers' RoPE base); set rope.local_theta={p.local_theta}"
        )
    if child.scaling != p.scaling:

        def fmt(r):
            return "none" if r.scaling is None else str(r.scaling.model_dump(exclude_none=True))

        errs.append(
            f"rope.scaling={fmt(child)} but the parent {src} was trained with rope.scaling={fmt(p)}; its "
            f"weights know those frequencies (rope.yarn is applied on top of them): set rope.scaling to "
            f"the parent's"
        )
    return errs


def _yarn_lineage_problems(child: RopeConfig, window: int, p: RopeConfig, W: int, src: str) -> list[str]:
    """rope.yarn against the parent's (p: its rope, W: its training window)."""
    errs: list[str] = []
    c, py = child.yarn, p.yarn
    if c is None:
        if py is not None:
            errs.append(
                f"rope.yarn: unset, but the parent {src} was trained with {_fmt_yarn(p)} at window {W}; "
                f"a child without it computes other frequencies: set rope.yarn.original_max_position="
                f"{py.original_max_position} and rope.yarn.factor={window / py.original_max_position:g}"
            )
        return errs
    if py is None:
        if c.original_max_position != W:
            errs.append(
                f"rope.yarn.original_max_position={c.original_max_position} but the parent {src} was trained at "
                f"window {W} (plain RoPE); YaRN must interpolate from the length the weights were actually trained "
                f"at: set rope.yarn.original_max_position={W} and rope.yarn.factor={window / W:g} "
                f"({window / W:g} * {W} = {window})"
            )
        return errs
    if c.original_max_position != py.original_max_position:
        errs.append(
            f"rope.yarn.original_max_position={c.original_max_position} but the parent {src} is itself "
            f"YaRN-extended ({_fmt_yarn(p)}, trained at window {W}): its frequencies are YaRN's of "
            f"{py.original_max_position}; keep them and raise the factor: set rope.yarn.original_max_position="
            f"{py.original_max_position} and rope.yarn.factor={window / py.original_max_position:g}"
        )
    for f in ("beta_fast", "beta_slow", "truncate"):
        if getattr(c, f) != getattr(py, f):
            errs.append(
                f"rope.yarn.{f}={getattr(c, f)} but the parent {src} was trained with rope.yarn.{f}="
                f"{getattr(py, f)}; set rope.yarn.{f}={getattr(py, f)}"
            )
    if py.attention_factor is not None and c.attention_factor is None:
        default = 0.1 * math.log(c.factor) + 1.0  # YaRN's, as model/rope.py computes it
        errs.append(
            f"rope.yarn.attention_factor: unset (so {default:.4g} = 0.1 ln({c.factor:g}) + 1), but the parent "
            f"{src} was trained with rope.yarn.attention_factor={py.attention_factor:g} set explicitly; "
            f"set rope.yarn.attention_factor={py.attention_factor:g} to keep the parent's attention "
            f"temperature, or the value you mean"
        )
    return errs


def rope_differences(a: RopeConfig, b: RopeConfig) -> list[str]:
    """Fields where two ropes differ, 'field: a vs b' (for eval against a checkpoint's own rope)."""
    da, db = a.model_dump(mode="json"), b.model_dump(mode="json")
    out = []
    for k in sorted(set(da) | set(db)):
        if k in ("allow_theta_change", "allow_yarn_from_scratch"):
            continue  # training permissions, not part of the rope a model computes
        if isinstance(da.get(k), dict) and isinstance(db.get(k), dict):
            out += [
                f"rope.{k}.{f}: {da[k].get(f)} vs {db[k].get(f)}"
                for f in sorted(set(da[k]) | set(db[k]))
                if da[k].get(f) != db[k].get(f)
            ]
        elif da.get(k) != db.get(k):
            out.append(f"rope.{k}: {da.get(k)} vs {db.get(k)}")
    return out
