"""YAML -> validated Config.

A YAML file may start with `inherit: other.yaml` (path relative to the file, one level:
the base may not inherit itself). Sections are merged key by key, the child winning.
`--set a.b.c=value` overrides are applied last; values are parsed as YAML scalars, so
`--set train.max_steps=10` is an int and `--set rope.yarn=null` removes YaRN.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml
from pydantic import ValidationError

from .schema import Config, check_invariants


class ConfigError(Exception):
    """Invalid configuration; `errors` lists every problem found."""

    def __init__(self, errors: list[str], source: str = ""):
        self.errors = errors
        head = f"invalid config {source}".strip()
        super().__init__(head + ":\n" + "\n".join(f"  - {e}" for e in errors))


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError([f"config file not found: {path}"])
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: top level must be a mapping, got {type(data).__name__}"])
    return data


def load_raw(path: str | Path) -> dict:
    """The merged (inherit applied) YAML mapping, before overrides and validation."""
    path = Path(path)
    data = _read_yaml(path)
    parent = data.pop("inherit", None)
    if parent is None:
        return data
    base_path = (path.parent / parent).resolve()
    base = _read_yaml(base_path)
    if "inherit" in base:
        raise ConfigError([f"{base_path}: 'inherit' is one level only ({path} inherits it, and it inherits "
                           f"{base['inherit']}); flatten the base"])
    return _deep_merge(base, data)


def apply_overrides(data: dict, sets: Iterable[str]) -> dict:
    data = copy.deepcopy(data)
    for item in sets or ():
        if "=" not in item:
            raise ConfigError([f"--set {item!r}: expected dotted.key=value"])
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else None
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            if node.get(p) is None:
                node[p] = {}
            if not isinstance(node[p], dict):
                raise ConfigError([f"--set {key}: '{p}' is a value, not a section"])
            node = node[p]
        node[parts[-1]] = value
    return data


def _format_pydantic(e: ValidationError) -> list[str]:
    out = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check spelling; unknown keys are errors)"
        elif err["type"] == "missing":
            msg = "required, no default (state it explicitly)"
        got = err.get("input")
        if err["type"] not in ("missing",) and not isinstance(got, dict):
            msg += f" (got {got!r})"
        out.append(f"{loc}: {msg}" if loc else msg)
    return out


def build_config(data: dict, source: str = "") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_pydantic(e), source) from None


def load_config(path: str | Path, sets: Iterable[str] = (), world_size: Optional[int] = None,
                device: Optional[str] = None) -> Config:
    """Load, merge, override, validate fields, then check every cross-field invariant."""
    data = apply_overrides(load_raw(path), sets)
    cfg = build_config(data, str(path))
    errs = check_invariants(cfg, world_size=world_size, device=device)
    if errs:
        raise ConfigError(errs, str(path))
    return cfg


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# Fields that describe one invocation, not the run: a resume may change them freely.
_SESSION_FIELDS = {("train", "stop_after"), ("train", "stop_after_s"), ("train", "probe_steps"), ("train", "log_every"), ("runs_dir",)}


# Fields added after runs were started, left out of the hash while unset, so that those runs resume.
_LATER_FIELDS = {("data", "mix")}


def config_hash(cfg: Config) -> str:
    """Stable hash of the resolved config (recorded in checkpoints; a resume must match it)."""
    d = cfg.model_dump(mode="json")
    for path in _SESSION_FIELDS | _LATER_FIELDS:
        node = d
        for k in path[:-1]:
            node = node[k]
        if path in _SESSION_FIELDS or node.get(path[-1]) is None:
            node.pop(path[-1], None)
    blob = json.dumps(d, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
