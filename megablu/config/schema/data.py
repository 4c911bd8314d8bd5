"""The data section: one dataset (path, bucket, split, mode) or a mixture of sources (data.mix), and the
mixture's own checks (mix_invariants; megablu.data.mix.mix_problems checks the datasets themselves)."""

from __future__ import annotations

import math
from typing import Literal, Optional

from pydantic import Field, field_validator

from .base import SEED_MAX, Section


def _bucket_spec(v: str, where: str) -> str:
    parts = [p.strip() for p in v.split(",")]
    if v.strip() == "all":
        return "all"
    if not parts or any(not p or p == "all" or any(c in p for c in "/\\ ") for p in parts):
        raise ValueError(f"{where}={v!r}: expected 'all', a bucket name like 'b3', or a comma list 'b2,b3'")
    return ",".join(parts)


Mode = Literal["fit", "truncate", "pack"]


class MixSource(Section):
    """One source of `data.mix`: a dataset's bucket(s) read in one mode, drawn by its share of loss tokens."""

    name: str = Field(description="label of the source in logs, errors and mixture.json; unique in data.mix")
    path: str = Field(description="dataset dir made by `megablu data build/import/synth`")
    bucket: str = Field(default="all", description="length bucket (b0..b6, several as 'b2,b3') or 'all'")
    split: Literal["train", "val"] = "train"
    mode: Mode = Field(description="fit | truncate | pack, as data.mode (no default: it decides what a row holds)")
    # inf/nan reach mix_invariants, whose message says what a weight is
    weight: float = Field(
        allow_inf_nan=True,
        description="share of the run's loss tokens (labels that are not "
        "padding) relative to the other sources' weights: 0.6/0.4 = 60%/40% of trained tokens; "
        "0 leaves it unused",
    )
    max_epochs: Optional[float] = Field(
        default=None,
        gt=0,
        allow_inf_nan=True,
        description="error if the run would cycle this source more; default data.max_epochs (.inf: no limit)",
    )

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, v: str) -> str:
        return _bucket_spec(v, "data.mix[].bucket")


class DataConfig(Section):
    window: int = Field(gt=0, description="training sequence length T in tokens")
    path: Optional[str] = Field(default=None, description="dataset dir made by `megablu data build/import`")
    bucket: str = Field(default="all", description="length bucket (b0..b6, several as 'b2,b3') or 'all'")
    split: Literal["train", "val"] = "train"
    mode: Mode = Field(
        default="pack",
        description="fit: only documents that fit, padded; truncate: longer "
        "documents cut to the window; pack: documents concatenated with EOT and cut into windows",
    )
    mix: Optional[list[MixSource]] = Field(
        default=None,
        description="several sources instead of path/bucket/split/mode: each sequence of the "
        "global order comes from one source, drawn (seeded) so that each source's share of loss tokens matches "
        "its weight (docs/DATA.md#mixtures)",
    )
    max_epochs: float = Field(
        default=2.0, gt=0, allow_inf_nan=True, description="error if the run would cycle the data more (.inf: no limit)"
    )
    doc_mask: bool = Field(
        default=False,
        description="packed sequences: a token attends only within its own "
        "document (the loader emits doc_ids; attention masks across document boundaries)",
    )
    doc_positions: Literal["restart", "continue"] = Field(
        default="restart",
        description="with doc_mask: position ids restart at 0 for every document (ProLong) "
        "or continue across the packed sequence",
    )
    prefetch: int = Field(default=4, ge=0, description="batches prepared ahead by a background thread; 0 = none")
    seed: int = Field(default=0, ge=0, le=SEED_MAX)
    verify: Literal["cache", "full"] = Field(
        default="cache",
        description="cache: a shard's sha256 is trusted while its size, mtime and inode are "
        "unchanged (a byte flipped in place keeps all three: `megablu data verify` finds it); full: the entry "
        "hashes every selected file before any rank starts",
    )

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, v: str) -> str:
        return _bucket_spec(v, "data.bucket")


def mix_invariants(d: DataConfig) -> list[str]:
    """data.mix without reading files: spelling, weights, names, doc_mask (megablu.data.mix.mix_problems
    checks the datasets themselves)."""
    errs: list[str] = []
    if d.path is not None:
        errs.append(
            f"data.path={d.path!r} together with data.mix: a mixture names each dataset in "
            f"data.mix[i].path; remove data.path (or data.mix, for one dataset)"
        )
    for f, default in (("bucket", "all"), ("split", "train"), ("mode", "pack")):
        v = getattr(d, f)
        if v != default:
            errs.append(
                f"data.{f}={v!r} has no effect with data.mix (each source has its own {f}); remove it "
                f"and set data.mix[i].{f}"
            )
    if not d.mix:
        errs.append(
            "data.mix is empty: list at least one source {name, path, bucket, mode, weight}, or remove "
            "data.mix and use data.path"
        )
        return errs
    ws = [s.weight for s in d.mix]
    bad = [
        f"data.mix[{i}] ({s.name}).weight={s.weight}"
        for i, s in enumerate(d.mix)
        if not (s.weight >= 0) or math.isinf(s.weight)
    ]
    if bad:
        errs.append(
            f"{', '.join(bad)}: a weight is a share of loss tokens, a finite number >= 0; set it >= 0 "
            f"(0 leaves the source unused)"
        )
    elif not sum(ws) > 0:
        errs.append(
            f"data.mix weights {ws} sum to {sum(ws):g}: nothing to sample; give at least one source a positive weight"
        )
    elif math.isinf(sum(ws)):  # shares w / sum would all read 0.0%
        errs.append(
            f"data.mix weights {ws} sum to inf (they overflow a float): a weight is relative to the others, "
            f"so scale them down, e.g. 0.6 and 0.4"
        )
    seen: dict[str, int] = {}
    for i, s in enumerate(d.mix):
        if not s.name or any(c in s.name for c in "/\\ \t\n"):
            errs.append(
                f"data.mix[{i}].name={s.name!r}: must be non-empty without slashes or spaces (it labels "
                f"the source in mixture.json and the loader state)"
            )
        if s.name in seen:
            errs.append(
                f"data.mix[{i}].name={s.name!r} is also data.mix[{seen[s.name]}].name: names must be "
                f"unique (the loader state keeps each source's position by name); rename one"
            )
        seen.setdefault(s.name, i)
    if d.doc_mask and not any(s.mode == "pack" and s.weight > 0 for s in d.mix):
        modes = ", ".join(f"{s.name}={s.mode}" for s in d.mix)
        errs.append(
            f"data.doc_mask=true but no source of data.mix with a positive weight is in mode pack "
            f"({modes}): a fit/truncate sequence holds one document, so there is nothing to mask; set "
            f"data.doc_mask=false or a source's mode to pack"
        )
    return errs
