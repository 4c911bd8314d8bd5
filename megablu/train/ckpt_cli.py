"""`megablu ckpt verify|list|export` and `megablu hub download|upload`.

Results go to stdout, logs to stderr; exit 0 ok, 2 for a bad checkpoint / failed
verification / bad input. DeepSpeed is never imported here (it prints on stdout).

  megablu ckpt verify runs/ext32k-0003                 # every step of the run (sha256)
  megablu ckpt verify runs/ext32k-0003/checkpoints/step_0000750
  megablu ckpt list runs/ext32k-0003                   # steps, status, tokens, topology
  megablu ckpt export runs/ext32k-0003 --out exports/ext32k   # newest verified step -> HF dir
  megablu hub download unparallelled/BluScriptCP-data --repo-type dataset \\
      --include "cp_data_by_length/b3_16384_32768/train_shard_0000[0-3].bin" --local-dir ./dl
  megablu hub upload runs/ext32k-0003 --repo me/blu-0.5b-32k
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Union

log = logging.getLogger(__name__)

PathLike = Union[str, Path]


# --------------------------------------------------------------------------- helpers
def _step_dirs(path: Path) -> list[Path]:
    """A step dir -> [it]; a run dir -> its published steps (oldest first)."""
    from .checkpoint import CKPT_DIR, MANIFEST, step_of

    if (path / MANIFEST).exists() or step_of(path) is not None:
        return [path]
    ck = path / CKPT_DIR
    if ck.is_dir():
        return sorted((p for p in ck.iterdir() if p.is_dir() and step_of(p) is not None), key=step_of)
    raise FileNotFoundError(f"{path}: neither a checkpoint step dir nor a run dir with {CKPT_DIR}/")


def _run_dir_of(step_dir: Path) -> Path:
    from .checkpoint import CKPT_DIR

    return step_dir.parent.parent if step_dir.parent.name == CKPT_DIR else step_dir.parent


def resolve_step(path: PathLike) -> Path:
    """A verified step dir: the given one, or a run's newest verified one."""
    from .checkpoint import MANIFEST, CheckpointError, newest_verified, verify_checkpoint

    p = Path(path)
    if (p / MANIFEST).exists():
        problems = verify_checkpoint(p)
        if problems:
            raise CheckpointError(f"{p}: not intact: " + "; ".join(problems))
        return p
    _step_dirs(p)  # raises when p is neither
    newest = newest_verified(p)
    if newest is None:
        raise CheckpointError(f"{p}: no verified checkpoint")
    return newest


def _model_configs(manifest: dict, run_dir: Path):
    """(ModelConfig, RopeConfig, window) from the manifest's meta, else the run's resolved config."""
    import yaml

    from ..config.schema import ModelConfig, RopeConfig
    from .checkpoint import CheckpointError

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


def export_checkpoint(src: PathLike, out: PathLike, force: bool = False,
                      rope_as_yarn: bool = False) -> tuple[Path, dict, Path]:
    """HF-loadable dir (model.safetensors + config.json) from a step or a run's newest verified step.

    Returns (out dir, source manifest, run dir). Written into a temp dir, then renamed.
    A rope.yarn.apply=beyond_original model is refused (no transformers rope reproduces it,
    model/hf.py beyond_original_problem) unless rope_as_yarn: then plain YaRN, recorded in
    megablu_export.json as "rope_export".
    """
    from ..model.hf import RopeExportError, beyond_original_problem, hf_config_dict
    from .checkpoint import CheckpointError, read_manifest, read_weights, save_weights, sha256_file

    step = resolve_step(src)
    m = read_manifest(step)
    run_dir = _run_dir_of(step)
    model_cfg, rope_cfg, window = _model_configs(m, run_dir)
    try:   # refused before any file is written
        cfg = hf_config_dict(model_cfg, rope_cfg, window, rope_as_yarn)
    except RopeExportError as e:
        raise CheckpointError(f"cannot export {step}: {e}") from None
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not force:
            raise CheckpointError(f"{out} exists and is not empty (use --force to replace it)")
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
    prov = {"source": str(step.resolve()), "run_id": m["run_id"], "step": m["step"],
            "source_manifest_sha256": m["manifest_sha256"], "config_hash": m.get("config_hash"),
            "tokenizer": m.get("tokenizer"), "exported_unix": time.time(),
            **({"rope_export": "yarn (always) from rope.yarn.apply=beyond_original: exact only beyond "
                               f"{rope_cfg.yarn.original_max_position} tokens"}
               if beyond_original_problem(rope_cfg) else {}),
            "files": {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
                      for p in sorted(tmp.iterdir()) if p.is_file()}}
    (tmp / "megablu_export.json").write_text(json.dumps(prov, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out, m, run_dir


# --------------------------------------------------------------------------- commands
def _cmd_verify(args) -> int:
    from .checkpoint import step_problems

    try:
        steps = _step_dirs(Path(args.path))
    except FileNotFoundError as e:
        print(str(e), file=sys.stderr)
        return 2
    if not steps:
        print(f"{args.path}: no checkpoints", file=sys.stderr)
        return 2
    bad = 0
    for s in steps:
        # the rule resume applies: intact, and (inside a run) saved by this run
        problems = step_problems(s, deep=not args.fast)
        if problems:
            bad += 1
            print(f"BAD {s}: " + "; ".join(problems))
        else:
            print(f"OK  {s}")
    return 2 if bad else 0


def _cmd_list(args) -> int:
    from .checkpoint import LATEST, PIN, CheckpointError, read_manifest, step_problems
    from .runs import list_runs

    p = Path(args.path)
    try:
        runs = [p] if (p / "checkpoints").is_dir() or (p / "manifest.json").exists() else list_runs(p)
    except OSError as e:
        print(str(e), file=sys.stderr)
        return 2
    if not runs:
        print(f"{p}: no runs or checkpoints", file=sys.stderr)
        return 2
    rows = []
    for run in runs:
        try:
            steps = _step_dirs(run)
        except FileNotFoundError:
            continue
        latest = (run / "checkpoints" / LATEST).read_text().strip() if (run / "checkpoints" / LATEST).exists() else ""
        for s in steps:
            problems = step_problems(s, deep=args.verify)
            try:
                m = read_manifest(s)
            except CheckpointError:
                m = {}
            size = sum(f.stat().st_size for f in s.rglob("*") if f.is_file())
            flags = ("pinned " if (s / PIN).exists() else "") + ("latest" if s.name == latest else "")
            rows.append([str(s), "ok" if not problems else "BAD", str(m.get("step", "?")),
                         str(m.get("client_state", {}).get("tokens_seen", "?")),
                         f"w{m.get('world_size', '?')}/dp{m.get('dp', '?')}/sp{m.get('sp', '?')}/z{m.get('zero_stage', '?')}",
                         f"{size / 1e6:.1f}MB", flags.strip(), "; ".join(problems)[:120]])
    rc = 2 if any(r[1] == "BAD" for r in rows) else 0   # like `ckpt verify`: a BAD row is exit 2
    if args.json:
        keys = ["path", "status", "step", "tokens_seen", "topology", "size", "flags", "problems"]
        print(json.dumps([dict(zip(keys, r)) for r in rows], indent=1))
        return rc
    head = ["path", "status", "step", "tokens", "topology", "size", "flags", "problems"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    for r in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return rc


def _cmd_export(args) -> int:
    from .checkpoint import CheckpointError

    try:
        out, m, _ = export_checkpoint(args.src, args.out, force=args.force, rope_as_yarn=args.rope_as_yarn)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _cmd_hub_download(args) -> int:
    from ..hub import HfRepo, HubError, LocalRepo, download

    repo = LocalRepo(args.from_local) if args.from_local else HfRepo(args.repo, args.repo_type, args.revision)
    try:
        got = download(repo, args.include, args.local_dir)
    except HubError as e:
        print(f"hub download {args.repo}: {e}", file=sys.stderr)
        return 2
    for rel in sorted(got):
        print(Path(args.local_dir) / rel)
    return 0


def _cmd_hub_upload(args) -> int:
    from ..hub import HfRepo, HubError, LocalRepo, upload_run
    from .checkpoint import CheckpointError

    repo_id = args.repo
    if repo_id is None and not args.to_local:
        cfg = Path(args.run) / "config.resolved.yaml"
        if cfg.exists():
            import yaml
            repo_id = ((yaml.safe_load(cfg.read_text()) or {}).get("hub") or {}).get("repo")
        if repo_id is None:
            print("hub upload: no --repo and no hub.repo in the run's config.resolved.yaml", file=sys.stderr)
            return 2
    repo = LocalRepo(args.to_local) if args.to_local else HfRepo(repo_id, "model", private=not args.public)
    try:
        files = upload_run(args.run, repo, staging=args.staging)
    except (HubError, CheckpointError, FileNotFoundError) as e:
        print(f"hub upload: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    return 0


def register(sub) -> None:
    ck = sub.add_parser("ckpt", help="checkpoint tools: verify, list, export").add_subparsers(
        dest="ckpt_cmd", required=True)
    v = ck.add_parser("verify", help="check every file of a step (or every step of a run) against its manifest")
    v.add_argument("path", help="step dir or run dir")
    v.add_argument("--fast", action="store_true", help="sizes only, no sha256")
    v.set_defaults(func=_cmd_verify)
    ls = ck.add_parser("list", help="checkpoints of a run (or of every run in a runs dir); exit 2 if a row is BAD")
    ls.add_argument("path", help="run dir or runs dir")
    ls.add_argument("--verify", action="store_true", help="also check sha256 (slow for big checkpoints)")
    ls.add_argument("--json", action="store_true", help="the rows as JSON instead of the table")
    ls.set_defaults(func=_cmd_list)
    ex = ck.add_parser("export", help="HF-loadable safetensors + config.json from a step or a run's newest step")
    ex.add_argument("src", help="run dir (newest verified step) or step dir")
    ex.add_argument("--out", required=True, help="directory for model.safetensors, config.json and megablu_export.json")
    ex.add_argument("--force", action="store_true", help="replace a non-empty --out")
    ex.add_argument("--rope-as-yarn", action="store_true",
                    help="export a rope.yarn.apply=beyond_original model as plain YaRN (no transformers rope "
                         "reproduces beyond_original; plain YaRN is exact only beyond original_max_position)")
    ex.set_defaults(func=_cmd_export)

    hub = sub.add_parser("hub", help="Hugging Face Hub transfer, verified").add_subparsers(
        dest="hub_cmd", required=True)
    dl = hub.add_parser("download", help="download files matching --include; exit 2 if a pattern matches "
                                         "nothing or a file is missing/short afterwards")
    dl.add_argument("repo", help="Hub repo id, e.g. owner/name")
    dl.add_argument("--repo-type", default="model", choices=["model", "dataset", "space"], help="kind of Hub repo")
    dl.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    dl.add_argument("--include", action="append", required=True, metavar="PAT", help="glob (repeatable)")
    dl.add_argument("--local-dir", required=True, help="where the files go (the repo's paths kept)")
    dl.add_argument("--from-local", default=None, metavar="DIR",
                    help="a local mirror of the repo instead of the network (offline clusters, tests)")
    dl.set_defaults(func=_cmd_hub_download)
    up = hub.add_parser("upload", help="export a run's newest verified checkpoint with a model card and push it")
    up.add_argument("run", help="run dir or step dir")
    up.add_argument("--repo", default=None, help="default: hub.repo of the run's config")
    up.add_argument("--public", action="store_true", help="create the repo public (default private)")
    up.add_argument("--staging", default=None, help="keep the staged export here")
    up.add_argument("--to-local", default=None, metavar="DIR", help="a local directory standing in for the repo")
    up.set_defaults(func=_cmd_hub_upload)
