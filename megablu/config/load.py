"""YAML -> validated Config.

A YAML file may start with `inherit: other.yaml` (path relative to the file, one level:
the base may not inherit itself). Sections are merged key by key, the child winning.
`--set a.b.c=value` overrides are applied last; values are parsed as YAML scalars, so
`--set train.max_steps=10` is an int and `--set rope.yarn=null` removes YaRN.

YAML is data only: the safe loader (no `!!python/...` tags), UTF-8 text, and a key given
twice in one mapping is an error (YAML would let the last one win silently). Every
malformed input is a ConfigError naming the file, line and column, never a traceback.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

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


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given twice (first at line {first.line + 1}); YAML would keep the "
                    f"last one silently: remove one",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def _yaml_error(e: yaml.YAMLError, where: str) -> str:
    """'FILE:LINE:COL: what' for a parse error (PyYAML marks are 0-based)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    if "could not determine a constructor for the tag" in problem:
        m = re.search(r"'([^']*)'", problem)
        tag = (m.group(1) if m else problem).replace("tag:yaml.org,2002:", "!!")
        problem = (
            f"tag {tag} is not allowed: configs are data only "
            f"(no Python objects); write the value as a plain scalar, list or mapping"
        )
    ctx = getattr(e, "context", None)
    loc = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
    return f"{loc}: invalid YAML: {problem}" + (f" ({ctx})" if ctx and ctx not in problem else "")


def parse_yaml(text: str, where: str):
    """YAML text -> data with the strict loader; ConfigError naming where, line and column."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise ConfigError([_yaml_error(e, where)]) from None


def _read_yaml(path: Path) -> dict:
    if path.is_dir():
        raise ConfigError([f"{path} is a directory, not a config file (give configs/<arm>.yaml)"])
    if not path.is_file():
        raise ConfigError([f"config file not found: {path}"])
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise ConfigError([f"{path}: cannot read: {e.strerror or e}"]) from None
    nul = blob.find(b"\x00")
    if nul >= 0:
        raise ConfigError([f"{path}: binary file (NUL byte at offset {nul}), not a YAML config"])
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        line = blob[: e.start].count(b"\n") + 1
        raise ConfigError(
            [
                f"{path}:{line}: not UTF-8 text (byte 0x{blob[e.start]:02x} at offset {e.start}); "
                f"save the config as UTF-8"
            ]
        ) from None
    data = parse_yaml(text, str(path))
    if data is None:
        data = {}
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
    if not isinstance(parent, str) or not parent.strip():
        raise ConfigError([f"{path}: inherit={parent!r} must be a file name (a string, relative to {path.parent})"])
    base_path = (path.parent / parent).resolve()
    base = _read_yaml(base_path)
    if "inherit" in base:
        raise ConfigError(
            [
                f"{base_path}: 'inherit' is one level only ({path} inherits it, and it inherits "
                f"{base['inherit']}); flatten the base"
            ]
        )
    return _deep_merge(base, data)


def apply_overrides(data: dict, sets: Iterable[str]) -> dict:
    """`--set a.b=v` items applied in order; every malformed item is listed (ConfigError)."""
    data = copy.deepcopy(data)
    errs = []
    for item in sets or ():
        try:
            _apply_one(data, item)
        except ConfigError as e:
            errs += e.errors
    if errs:
        raise ConfigError(errs)
    return data


def _apply_one(data: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError([f"--set {item!r}: expected dotted.key=value (e.g. train.max_steps=10)"])
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if any(not p.strip() for p in parts):
        raise ConfigError(
            [
                f"--set {item!r}: the key {key.strip()!r} has an empty part; expected dotted.key=value "
                f"(e.g. train.max_steps=10)"
            ]
        )
    try:
        value = yaml.load(raw, Loader=_StrictLoader) if raw != "" else None
    except yaml.YAMLError as e:
        why = _yaml_error(e, "value").split(": invalid YAML: ", 1)[-1]
        hint = "" if "given twice" in why or "not allowed" in why else " (quote a string value: --set 'a.b=\"...\"')"
        raise ConfigError([f"--set {item!r}: the value does not parse as YAML: {why}{hint}"]) from None
    node = data
    for p in (x.strip() for x in parts[:-1]):
        if node.get(p) is None:
            node[p] = {}
        if not isinstance(node[p], dict):
            raise ConfigError([f"--set {key}: '{p}' is a value, not a section"])
        node = node[p]
    node[parts[-1].strip()] = value


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


def load_config(
    path: str | Path, sets: Iterable[str] = (), world_size: Optional[int] = None, device: Optional[str] = None
) -> Config:
    """Load, merge, override, validate fields, then check every cross-field invariant."""
    data = apply_overrides(load_raw(path), sets)
    cfg = build_config(data, str(path))
    errs = check_invariants(cfg, world_size=world_size, device=device)
    if errs:
        raise ConfigError(errs, str(path))
    return cfg


def load_for_command(
    path: str | Path, sets: Iterable[str] = (), world_size: Optional[int] = None, device: Optional[str] = None
) -> Optional[Config]:
    """load_config for a command line (megablu train/probe, eval, data mix, plan): on a ConfigError its text
    -- every problem, each with its field, values and fix -- goes to stderr and None comes back; the command
    then exits 2."""
    try:
        return load_config(path, sets, world_size=world_size, device=device)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return None


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# Fields that describe one invocation, not the run: a resume may change them freely.
_SESSION_FIELDS = {
    ("train", "stop_after"),
    ("train", "stop_after_s"),
    ("train", "probe_steps"),
    ("train", "log_every"),
    ("train", "profile_step"),
    ("train", "profile_trace_mib"),
    ("train", "fused_grad_check"),
    ("train", "tracker"),
    ("eval", "decode"),  # how the same tokens are generated
    ("runs_dir",),
}


# Fields added after runs were started, left out of the hash while unset (None, or a flag left False),
# so that those runs resume.
_LATER_FIELDS = {
    ("data", "mix"),
    ("rope", "allow_yarn_from_scratch"),
    ("eval", "string"),
    ("eval", "suite"),
    ("rope", "scaling"),
    ("model", "family"),
    ("model", "sliding_window"),
    ("rope", "local_theta"),
    ("memory", "fuse_qkv"),
    ("memory", "fuse_gate_up"),
    ("memory", "fuse_block_add"),
}
# ... and fields added with a default that is the behaviour before them, left out while at it
# (memory.loss's default became auto, hashed as itself; chunked keeps the hash of the runs
# from before the field, and a resume accepts a memory.loss change: train/resume.py)
_LATER_DEFAULTS = {
    ("memory", "loss"): "chunked",
    ("memory", "attention"): "sdpa",
    ("checkpoint", "keep_every"): 0,
    ("memory", "offload_keep"): 1,
    ("memory", "offload_fraction"): 1.0,
    ("eval", "string", "beyond"): 0,
    ("eval", "chat_template"): "auto",  # auto: only the ruler_* tasks (added with it) are wrapped
    # STRING's variants (the authors' default since): the fixed shift of the runs before keeps their hash
    ("eval", "string", "variant"): "fixed_shift",
    ("eval", "string", "shift_ratio"): None,
    ("eval", "string", "attention_factor"): 1.0,
    # no loss sets (eval.loss.data alone, as before); RULER's tasks also gated at the parent's
    # window (a stricter gate for a resumed run with ruler_* tasks; no other changes)
    ("eval", "loss", "sets"): {},
    ("eval", "gate", "ruler_at_window"): True,
    # model families: every switch off is the Llama/Qwen2 block of the runs before them
    ("model", "qk_norm"): "none",
    ("model", "norm_layout"): "pre",
    ("model", "nope_layers"): [],
    ("model", "norm_offset"): False,
    ("model", "embed_scale"): False,
    ("model", "activation"): "silu",
    ("model", "sliding_layers"): [],
}


def config_hash(cfg: Config) -> str:
    """Stable hash of the resolved config (recorded in checkpoints; a resume must match it)."""
    d = cfg.model_dump(mode="json")
    for path in _SESSION_FIELDS | _LATER_FIELDS:
        node = d
        for k in path[:-1]:
            node = node[k]
        if path in _SESSION_FIELDS or node.get(path[-1]) in (None, False):
            node.pop(path[-1], None)
    for (*parents, key), default in _LATER_DEFAULTS.items():
        at: Any = d
        for k in parents:
            at = at.get(k) if isinstance(at, dict) else None
        if isinstance(at, dict) and key in at and at[key] == default:  # a parent may be None (string off)
            at.pop(key)
    blob = json.dumps(d, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
