"""Safetensors weights: init_from, what a parent records, and export to a transformers dir.

A step's `model.safetensors` holds the consolidated weights in BluModel names (tensors that
share storage stored once, with an alias), so init_from and export need neither DeepSpeed nor
the topology that saved them. `resolve_weights` takes a step dir, a run dir (its newest
verified step, layout.resolve_step), a transformers dir or a weights file.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from ..utils.files import PathLike, fsync_file, replace_problem, sha256_file, swap_in
from .layout import (
    CKPT_DIR,
    MANIFEST,
    WEIGHTS,
    CheckpointError,
    is_run_dir,
    read_manifest,
    resolve_step,
    step_dirs,
    verify_checkpoint,
)

log = logging.getLogger(__name__)


def save_weights(sd: dict, path: PathLike, extra_meta: Optional[dict] = None) -> None:
    """safetensors file of a state dict; tensors sharing storage are stored once + alias."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            continue
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype) if v.numel() else None
        if key is not None and key in seen:
            aliases[k] = seen[key]
            continue
        if key is not None:
            seen[key] = k
        tensors[k] = v.detach().to("cpu").contiguous()
    meta = {"format": "pt", "aliases": json.dumps(aliases)}
    meta.update({k: str(v) for k, v in (extra_meta or {}).items()})
    save_file(tensors, str(path), metadata=meta)
    fsync_file(path)


INDEX = "model.safetensors.index.json"
EXPORT_RECORD = "megablu_export.json"  # what an export came from, and its files
_PARENT_KINDS = (
    "a run dir, a checkpoint step dir, an exported or transformers model dir, a .safetensors file or "
    "a model.safetensors.index.json"
)


def resolve_parent(path: PathLike, deep: bool = True) -> Path:
    """What an init_from / eval path means: a run dir -> its newest verified step
    (layout.resolve_step, the rule resume and `ckpt` use too), anything else -> itself. The
    weights (`resolve_weights`) and the record (`parent_record`) are both read from this one
    path, so they cannot come from two different steps. deep=False checks the steps by size
    only. Raises CheckpointError."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"init_from {p}: no such file or directory")
    if is_run_dir(p):
        try:
            newest = resolve_step(p, deep=deep)
        except CheckpointError as e:
            raise CheckpointError(f"init_from {e}") from None
        log.info("init_from %s: newest verified step is %s", p, newest.name)
        return newest
    return p


def resolve_weights(path: PathLike, deep: bool = True) -> tuple[list[Path], Optional[dict]]:
    """safetensors files for a step dir, a run dir (newest verified), an export dir, a weights
    file or a sharded model's index file.

    Returns (files, manifest or None). Raises CheckpointError with what was looked for.
    deep=False checks a step's files by size only (the load itself hashes them).
    """
    p = resolve_parent(path, deep=deep)
    if p.is_file():
        if p.name.endswith(".safetensors"):
            return [p], None
        if p.name.endswith(".safetensors.index.json"):
            return _index_shards(p), None
        raise CheckpointError(f"init_from {p}: {p.name} is not safetensors weights; give {_PARENT_KINDS}")
    if not p.is_dir():
        raise CheckpointError(f"init_from {p}: no such file or directory")
    m = None
    if (p / MANIFEST).exists():
        problems = verify_checkpoint(p, deep=deep)
        if problems:
            raise CheckpointError(f"init_from {p}: not intact: " + "; ".join(problems))
        m = read_manifest(p)
    if (p / WEIGHTS).is_file():
        return [p / WEIGHTS], m
    if (p / INDEX).is_file():
        return _index_shards(p / INDEX), m
    raise CheckpointError(f"init_from {p}: no {WEIGHTS} or {INDEX} (expected {_PARENT_KINDS})")


def _index_shards(idx: Path) -> list[Path]:
    """The shard files a (transformers) model.safetensors.index.json names, beside it."""
    try:
        shards = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"init_from {idx}: not a readable safetensors index ({type(e).__name__}: {e})") from None
    missing = [s for s in shards if not (idx.parent / s).is_file()]
    if missing or not shards:
        raise CheckpointError(
            f"init_from {idx}: index names missing shards {missing}"
            if missing
            else f"init_from {idx}: index names no shard"
        )
    return [idx.parent / s for s in shards]


def _model_record(d: Path, m: Optional[dict]):
    """(ModelConfig the weights in dir d were trained as, where that was read) or (None, None).

    A step's manifest meta, else its run's config.resolved.yaml; an export's or a transformers
    dir's config.json. A record that exists but cannot be read raises CheckpointError: loading
    without it would check shapes only, which another head layout passes."""
    import yaml

    from ..config.schema import ModelConfig

    if m is not None:
        model, src = (m.get("meta") or {}).get("model"), f"{d}/{MANIFEST}"
        cfg_file = d.parent.parent / "config.resolved.yaml"
        if model is None and cfg_file.is_file():
            model, src = (yaml.safe_load(cfg_file.read_text()) or {}).get("model"), str(cfg_file)
        if model is None:
            return None, None
        try:
            return ModelConfig(**model), src
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{src}: unreadable model record {model!r}: {e}") from None
    cj = d / "config.json"
    if not cj.is_file():
        return None, None
    from ..model.hf import model_record_from_hf

    try:
        return model_record_from_hf(json.loads(cj.read_text())), str(cj)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{cj}: cannot read the architecture the weights were trained as: {e}") from None


def parent_record(path: PathLike, deep: bool = True):
    """What an init_from / eval checkpoint records about its training: a `ParentRecord` (window,
    rope, architecture, source).

    Read from the step `resolve_parent` gives (a run dir: its newest verified step, the one the
    weights are loaded from): its manifest, the run's config.resolved.yaml for manifests older
    than the meta, an export's or a transformers dir's config.json, or the same beside a weights
    file. A record that is absent gives window/rope/model None; a record that cannot be read raises
    CheckpointError. deep=False: the run's steps checked by size only.
    """
    import yaml

    from ..config.lineage import ParentRecord
    from ..config.schema import RopeConfig

    p = resolve_parent(path, deep=deep)
    d = p.parent if p.is_file() else p
    if (d / MANIFEST).exists():
        m = read_manifest(d)
        meta = m.get("meta", {})
        rope, window, src = meta.get("rope"), meta.get("window"), f"{d}/{MANIFEST}"
        cfg_file = d.parent.parent / "config.resolved.yaml"
        if (rope is None or window is None) and cfg_file.is_file():
            raw = yaml.safe_load(cfg_file.read_text()) or {}
            rope, window = rope or raw.get("rope"), window or (raw.get("data") or {}).get("window")
            src = str(cfg_file)
        try:
            rope = RopeConfig(**rope) if rope else None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"init_from {src}: unreadable rope record {rope!r}: {e}") from None
        return ParentRecord(src, int(window) if window else None, rope, _model_record(d, m)[0])
    cj = d / "config.json"
    if cj.is_file():
        from ..model.hf import rope_record_from_hf

        try:
            rope, window = rope_record_from_hf(json.loads(cj.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"init_from {cj}: cannot read the parent's rope: {e}") from None
        return ParentRecord(str(cj), window, rope, _model_record(d, None)[0])
    return ParentRecord(str(p), None, None)


def read_weights(path: PathLike) -> dict[str, torch.Tensor]:
    """State dict in BluModel names (HF `model.` prefix stripped, aliases restored)."""
    return read_weights_and_provenance(path)[0]


def _provenance(first: Path, m: Optional[dict]) -> dict:
    """tokenizer / run_id / step recorded beside the weights: the step's manifest, or an export's
    megablu_export.json (also for a weights file given inside such a dir); {} for foreign weights."""
    if m is None:
        d = first.parent
        if (d / MANIFEST).is_file():
            m = read_manifest(d)
        elif (d / EXPORT_RECORD).is_file():
            m = json.loads((d / EXPORT_RECORD).read_text())
    return {k: m.get(k) for k in ("tokenizer", "run_id", "step")} if m else {}


def _read_safetensors(files: list[Path], get) -> dict:
    """{BluModel name: get(handle, file key)} over the files; HF `model.` prefix stripped, aliases restored."""
    from safetensors import safe_open

    sd: dict = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            meta = h.metadata() or {}
            part = {k: get(h, k) for k in h.keys()}
        for alias, target in json.loads(meta.get("aliases", "{}")).items():
            part[alias] = part[target]
        sd.update(part)
    return {(k[len("model.") :] if k.startswith("model.") else k): v for k, v in sd.items()}


def read_weights_and_provenance(path: PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(read_weights(path), _provenance of those weights)."""
    files, m = resolve_weights(path)
    return _read_safetensors(files, lambda h, k: h.get_tensor(k)), _provenance(files[0], m)


def _architecture_problems(model_cfg, files: list[Path], m: Optional[dict], path: PathLike) -> list[str]:
    """model_cfg against the architecture recorded beside `files` (resolve_weights' result)."""
    from ..config.lineage import architecture_problems

    d = files[0].parent
    if m is None and (d / MANIFEST).is_file():  # a weights file given inside a step dir
        m = read_manifest(d)
    recorded, src = _model_record(d, m)
    return architecture_problems(recorded, model_cfg, src or str(path))


def architecture_check(model_cfg, path: PathLike, deep: bool = True) -> list[str]:
    """How `model_cfg` differs from the architecture the weights at `path` record (ARCH_FIELDS of
    config/lineage.py); empty when they agree or record none. Raises CheckpointError for a record
    that cannot be read."""
    files, m = resolve_weights(path, deep=deep)
    return _architecture_problems(model_cfg, files, m, path)


def read_weight_shapes(path: PathLike, deep: bool = True) -> tuple[dict[str, tuple], dict]:
    """({name: shape} from the safetensors headers only, provenance): what init_from would load."""
    files, m = resolve_weights(path, deep=deep)
    return _read_safetensors(files, lambda h, k: tuple(h.get_slice(k).get_shape())), _provenance(files[0], m)


def weights_mismatch(own: dict[str, tuple], theirs: dict[str, tuple], tied: set) -> list[str]:
    """How weights of shapes `theirs` fail to fit a model of shapes `own` (empty = they fit).

    Names and shapes must match exactly; a tied lm_head may be absent (HF exports omit it)."""
    missing = [k for k in own if k not in theirs and k not in tied]
    unexpected = [k for k in theirs if k not in own]
    shapes = [
        f"{k}: file {tuple(theirs[k])} vs model {tuple(own[k])}"
        for k in own
        if k in theirs and tuple(theirs[k]) != tuple(own[k])
    ]
    out = []
    emb = "embed_tokens.weight"
    if emb in own and emb in theirs and tuple(own[emb]) != tuple(theirs[emb]):
        (v, d), (v2, d2) = own[emb], theirs[emb]
        if v != v2:
            out.append(
                f"the weights were trained with vocab {v2}, model.vocab_size is {v}: set model.vocab_size={v2} "
                f"(the parent's tokenizer and vocabulary)"
            )
        if d != d2:
            out.append(f"the weights have d_model {d2}, model.d_model is {d}")
    if missing or unexpected or shapes:
        out.append(
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{'...' if len(unexpected) > 8 else ''}, shapes {shapes[:8]}{'...' if len(shapes) > 8 else ''}"
        )
    return out


def tied_keys(own: dict) -> set:
    """lm_head.weight when it is the embedding's tensor (tie_embeddings)."""
    return {
        k
        for k in own
        if k == "lm_head.weight"
        and "embed_tokens.weight" in own
        and own[k].data_ptr() == own["embed_tokens.weight"].data_ptr()
    }


@torch.no_grad()
def load_weights(model: torch.nn.Module, path: PathLike, tokenizer: Optional[str] = None) -> dict:
    """init_from: copy weights into model; names and shapes must match exactly.

    A tied lm_head may be absent from the file (HF exports omit it). `tokenizer` (an identity)
    must equal the one recorded with the weights, when they record one: embeddings trained
    with another tokenizer have the right shape and mean nothing. Returns the provenance
    {tokenizer, run_id, step} ({} for weights megablu did not write).
    """
    files, m = resolve_weights(path)
    cfg = getattr(model, "cfg", None)
    if cfg is not None:  # before the weights are read: shapes alone pass another head layout
        bad = _architecture_problems(cfg, files, m, path)
        if bad:
            raise CheckpointError(f"{path}: " + "; ".join(bad))
    sd, prov = _read_safetensors(files, lambda h, k: h.get_tensor(k)), _provenance(files[0], m)
    if tokenizer is not None and prov.get("tokenizer") not in (None, tokenizer):
        raise CheckpointError(
            f"{path}: weights trained with tokenizer {prov['tokenizer']!r}, but the tokenizer "
            f"here is {tokenizer!r}; configure the tokenizer the weights were trained with"
        )
    own = model.state_dict(keep_vars=True)
    bad = weights_mismatch(
        {k: tuple(t.shape) for k, t in own.items()}, {k: tuple(t.shape) for k, t in sd.items()}, tied_keys(own)
    )
    if bad:
        raise CheckpointError(f"init_from {path}: weights do not match the model: " + "; ".join(bad))
    for k, t in own.items():
        if k in sd:
            t.copy_(sd[k].to(t.dtype))
    return prov


# --------------------------------------------------------------------------- export
def _export_source(src: PathLike) -> Path:
    """The verified step an export reads: the given step dir, or a run's newest verified step."""
    p = Path(src)
    step_dirs(p)  # FileNotFoundError when p is neither a step dir nor a run dir
    step = resolve_step(p)
    if step == p:  # given directly: verify it here (a run's newest was verified by resolve_step)
        problems = verify_checkpoint(p)
        if problems:
            raise CheckpointError(f"{p}: not intact: " + "; ".join(problems))
    return step


def _model_configs(manifest: dict, run_dir: Path):
    """(ModelConfig, RopeConfig, window) from the manifest's meta, else the run's resolved config."""
    import yaml

    from ..config.schema import ModelConfig, RopeConfig

    meta = manifest.get("meta", {})
    model, rope, window = meta.get("model"), meta.get("rope"), meta.get("window")
    cfg_file = run_dir / "config.resolved.yaml"
    if (model is None or rope is None) and cfg_file.exists():
        d = yaml.safe_load(cfg_file.read_text())
        model, rope = model or d.get("model"), rope or d.get("rope")
        window = window or (d.get("data") or {}).get("window")
    if model is None or rope is None:
        raise CheckpointError(f"cannot export: the manifest has no model/rope config and {cfg_file} is absent")
    return ModelConfig(**model), RopeConfig(**rope), window


def _string_evals(run_dir: Path) -> list[str]:
    """Where this run's weights were evaluated with STRING: eval.string in its resolved config, an eval
    result under its eval/, or a line of eval/string_evals.jsonl (megablu eval writes one for every STRING
    eval of the run's checkpoints, wherever its --out). STRING is an inference change in megablu's
    attention that no transformers setting reproduces, so an export of these weights scores as the plain
    model does. A file that cannot be read or parsed is skipped: this only adds a note to an export."""
    import yaml

    def string_of(d) -> Optional[dict]:
        e = d.get("eval") if isinstance(d, dict) else None
        return e.get("string") if isinstance(e, dict) else None

    where = []
    cfg_file = run_dir / "config.resolved.yaml"
    try:
        s = string_of(yaml.safe_load(cfg_file.read_text())) if cfg_file.exists() else None
    except (OSError, yaml.YAMLError):
        s = None
    if s:
        where.append(f"{cfg_file.name} (eval.string={s})")
    for f in sorted((run_dir / "eval").glob("step_*.json")):
        try:
            s = string_of(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
        if s:
            where.append(f"eval/{f.name} (eval.string={s})")
    try:
        lines = (run_dir / "eval" / "string_evals.jsonl").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and r.get("string"):
            where.append(f"{r.get('out')} (step {r.get('step')}, eval.string={r['string']})")
    return where


def export_checkpoint(
    src: PathLike, out: PathLike, force: bool = False, rope_as_yarn: bool = False
) -> tuple[Path, dict, Path]:
    """HF-loadable dir (model.safetensors + config.json) from a step or a run's newest verified step.

    Returns (out dir, source manifest, run dir). Written into a temp dir, then renamed.
    A rope.yarn.apply=beyond_original model is refused (no transformers rope reproduces it,
    model/hf.py beyond_original_problem) unless rope_as_yarn: then plain YaRN, recorded in
    megablu_export.json as "rope_export". Where the run was evaluated with STRING (eval.string), a
    warning and megablu_export.json's "string_not_exported" say that the export scores as the plain model.
    """
    from ..model.hf import RopeExportError, beyond_original_problem, hf_config_dict

    step = _export_source(src)
    m = read_manifest(step)
    run_dir = step.parent.parent if step.parent.name == CKPT_DIR else step.parent
    model_cfg, rope_cfg, window = _model_configs(m, run_dir)
    if window is None and rope_cfg.yarn is None:
        raise CheckpointError(
            f"cannot export {step}: it records no training window (no meta.window in its manifest, "
            f"no data.window in {run_dir / 'config.resolved.yaml'}); config.json's "
            f"max_position_embeddings would be a guess, and a YaRN extension of the export is "
            f"checked against it"
        )
    try:  # refused before any file is written
        cfg = hf_config_dict(model_cfg, rope_cfg, window, rope_as_yarn)
    except RopeExportError as e:
        raise CheckpointError(f"cannot export {step}: {e}") from None
    strings = _string_evals(run_dir)
    string_note = (
        (
            f"this run was evaluated with STRING ({'; '.join(strings)}); transformers has no STRING, so "
            "the exported model computes plain attention and scores as the plain model (megablu eval "
            "without eval.string)"
        )
        if strings
        else None
    )
    out = Path(out)
    why = replace_problem(
        out, what="a megablu export", flag="--force", replace=force, owned=export_files, inputs=[src, step]
    )
    if why:
        raise CheckpointError(why)
    if string_note:
        log.warning("export of %s: %s", step, string_note)
    sd = read_weights(step)
    hf_sd = {}
    for k, v in sd.items():
        if k == "lm_head.weight":
            if model_cfg.tie_embeddings:
                continue  # HF ties it to model.embed_tokens.weight
            hf_sd[k] = v
        else:
            hf_sd[f"model.{k}"] = v
    dtypes = {v.dtype for v in hf_sd.values()}
    cfg["torch_dtype"] = str(next(iter(dtypes))).replace("torch.", "") if len(dtypes) == 1 else "float32"
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_weights(hf_sd, tmp / "model.safetensors", {"run_id": m["run_id"], "step": m["step"]})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    prov = {
        "source": str(step.resolve()),
        "run_id": m["run_id"],
        "step": m["step"],
        "source_manifest_sha256": m["manifest_sha256"],
        "config_hash": m.get("config_hash"),
        "tokenizer": m.get("tokenizer"),
        "exported_unix": time.time(),
        **(
            {
                "rope_export": "yarn (always) from rope.yarn.apply=beyond_original: exact only beyond "
                f"{rope_cfg.yarn.original_max_position} tokens"
            }
            if beyond_original_problem(rope_cfg)
            else {}
        ),
        **({"string_not_exported": string_note} if string_note else {}),
        "files": {
            p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir()) if p.is_file()
        },
    }
    (tmp / EXPORT_RECORD).write_text(json.dumps(prov, indent=1) + "\n")
    why = replace_problem(out, what="a megablu export", flag="--force", replace=force, owned=export_files)
    if why:  # the folder changed while this was exporting
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{why} (it changed during the export; nothing replaced)")
    out.parent.mkdir(parents=True, exist_ok=True)
    swap_in(tmp, out)
    return out, m, run_dir


def export_files(d: Path) -> Optional[set[str]]:
    """What `megablu ckpt export` wrote in d (its record and the files the record lists), or None when d
    holds no readable export record: what --force may replace."""
    try:
        rec = json.loads((d / EXPORT_RECORD).read_text())
    except (OSError, ValueError):
        return None
    files = rec.get("files") if isinstance(rec, dict) else None
    if not isinstance(files, dict):
        return None
    return {EXPORT_RECORD, *(k for k in files if isinstance(k, str))}
