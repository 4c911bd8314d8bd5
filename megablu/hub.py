"""Hugging Face Hub transfer that verifies instead of trusting the exit code.

`hf download --include PAT` exits 0 having matched nothing. Here
a download lists the repo first, matches every include pattern against the listing (the
same rule as huggingface_hub: fnmatchcase, a pattern ending in '/' means the folder),
refuses before fetching anything when a pattern matches no file, then fetches and checks
that every selected file is present with the listed size (and sha256 when the listing
has one: LFS files). Any problem is a HubError (exit 2 from the CLI).

The repo is reached through a small `Repo` interface (list_files / fetch / upload) so the
verification runs against `LocalRepo` (a directory standing in for the repo) in tests and
on offline clusters with a mirrored repo; `HfRepo` is the network implementation.

  megablu hub download me/long-docs --repo-type dataset \\
      --include "cp_data_by_length/b3_16384_32768/train_shard_0000[0-3].bin" --local-dir ./dl
  megablu hub upload runs/ext32k-0003 --repo me/blu-0.5b-32k
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Optional

from .utils.files import PathLike, sha256_file

log = logging.getLogger(__name__)


class HubError(Exception):
    """A transfer did not do what was asked (nothing matched, a file missing or short)."""


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: Optional[str] = None  # known for LFS files


def _norm(pattern: str) -> str:
    p = pattern.replace("\\", "/")
    return p + "*" if p.endswith("/") else p


def match_includes(files: Iterable[RemoteFile], patterns: list[str]) -> tuple[dict[str, RemoteFile], list[str]]:
    """(selected files by path, patterns that matched nothing)."""
    files = list(files)
    selected: dict[str, RemoteFile] = {}
    unmatched = []
    for pat in patterns:
        hits = [f for f in files if fnmatchcase(f.path, _norm(pat))]
        if not hits:
            unmatched.append(pat)
        for f in hits:
            selected[f.path] = f
    return selected, unmatched


def verify_local(local_dir: PathLike, expected: dict[str, RemoteFile]) -> list[str]:
    """Problems with the downloaded copy (empty = every file present, right size/checksum)."""
    root = Path(local_dir)
    problems = []
    for rel, f in sorted(expected.items()):
        p = root / rel
        if not p.is_file():
            problems.append(f"missing {rel}")
            continue
        size = p.stat().st_size
        if size != f.size:
            problems.append(f"size {rel}: {size} bytes, repo lists {f.size}")
        elif f.sha256 and sha256_file(p) != f.sha256:
            problems.append(f"checksum {rel}: sha256 differs from the repo's")
    return problems


# --------------------------------------------------------------------------- repos
class Repo:
    def list_files(self) -> list[RemoteFile]:
        raise NotImplementedError

    def fetch(self, path: str, local_dir: Path) -> None:
        raise NotImplementedError

    def upload(self, folder: Path, message: str) -> None:
        raise NotImplementedError


class LocalRepo(Repo):
    """A directory standing in for a hub repo (tests, offline mirrors)."""

    def __init__(self, root: PathLike):
        self.root = Path(root)

    def list_files(self) -> list[RemoteFile]:
        if not self.root.is_dir():
            raise HubError(f"repo {self.root} does not exist")
        return [
            RemoteFile(p.relative_to(self.root).as_posix(), p.stat().st_size)
            for p in sorted(self.root.rglob("*"))
            if p.is_file() and ".git" not in p.parts
        ]

    def fetch(self, path: str, local_dir: Path) -> None:
        dst = local_dir / path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.root / path, dst)

    def upload(self, folder: Path, message: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.copytree(folder, self.root, dirs_exist_ok=True)


@contextlib.contextmanager
def _hub_errors(what: str):
    """Network, auth and not-found failures of huggingface_hub as one HubError naming the call."""
    try:
        yield
    except HubError:
        raise
    except Exception as e:  # noqa: BLE001 - HfHubHTTPError, requests' and OS errors alike
        raise HubError(f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}") from e


class HfRepo(Repo):
    """huggingface_hub behind the Repo interface (its failures become HubError: exit 2)."""

    def __init__(self, repo_id: str, repo_type: str = "model", revision: Optional[str] = None, private: bool = True):
        from huggingface_hub import HfApi

        self.api = HfApi()
        self.repo_id, self.repo_type, self.revision, self.private = repo_id, repo_type, revision, private

    def list_files(self) -> list[RemoteFile]:
        from huggingface_hub.hf_api import RepoFile

        out = []
        with _hub_errors(f"listing {self.repo_type} repo {self.repo_id}"):
            for e in self.api.list_repo_tree(
                self.repo_id, recursive=True, revision=self.revision, repo_type=self.repo_type
            ):
                if isinstance(e, RepoFile):
                    lfs = getattr(e, "lfs", None)
                    sha = lfs.sha256 if lfs is not None else None
                    out.append(RemoteFile(e.path, int(e.size), sha))
        return out

    def fetch(self, path: str, local_dir: Path) -> None:
        from huggingface_hub import hf_hub_download

        with _hub_errors(f"downloading {path} from {self.repo_id}"):
            hf_hub_download(
                self.repo_id, path, repo_type=self.repo_type, revision=self.revision, local_dir=str(local_dir)
            )

    def upload(self, folder: Path, message: str) -> None:
        with _hub_errors(f"uploading {folder} to {self.repo_id}"):
            self.api.create_repo(self.repo_id, repo_type=self.repo_type, private=self.private, exist_ok=True)
            self.api.upload_folder(
                repo_id=self.repo_id, folder_path=str(folder), repo_type=self.repo_type, commit_message=message
            )


# --------------------------------------------------------------------------- operations
def download(repo: Repo, includes: list[str], local_dir: PathLike) -> dict[str, RemoteFile]:
    """Fetch every file matching the includes into local_dir and verify them all."""
    if not includes:
        raise HubError("give at least one --include pattern (a whole-repo download is never implied)")
    local = Path(local_dir)
    probe = local
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():  # checked before anything is listed or fetched
        raise HubError(f"--local-dir {local}: {probe} is a file, not a directory; give a directory (created if absent)")
    listing = repo.list_files()
    selected, unmatched = match_includes(listing, includes)
    if unmatched:
        raise HubError(
            f"include pattern(s) matched no file in the repo: {unmatched} "
            f"({len(listing)} files listed); nothing downloaded"
        )
    try:
        local.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HubError(f"--local-dir {local}: cannot create it: {e.strerror or e}") from None
    total = sum(f.size for f in selected.values())
    log.info("downloading %d files (%.1f MB) to %s", len(selected), total / 1e6, local)
    for rel in sorted(selected):
        repo.fetch(rel, local)
    problems = verify_local(local, selected)
    if problems:
        raise HubError(f"download incomplete in {local}: " + "; ".join(problems))
    return selected


def _eval_table(run_dir: Path, step: Optional[int]) -> str:
    """Markdown of the run's eval results of the uploaded `step`: the harness's eval/step_<N>.json as the arm x
    length table of `megablu compare` (accuracy, slope, effective length); results of other steps are named, not
    shown (they scored other weights); any other eval/*.json with rows of flat values as a plain table, under a
    heading that says it records no step (or its step, when its rows carry one and it is this one)."""
    from .eval.report import SCHEMA, markdown

    results: list = []
    rows: list = []
    other_steps: list = []
    for f in sorted((run_dir / "eval").glob("*.json")) if (run_dir / "eval").is_dir() else []:
        try:
            d = json.loads(f.read_text())
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("schema") == SCHEMA:
            if d.get("cells"):
                (results if d.get("step") == step else other_steps).append(d)
            continue
        items = d.get("rows") or d.get("results") if isinstance(d, dict) else d
        if isinstance(d, dict) and items is None:
            items = [d]
        for r in items if isinstance(items, list) else []:
            if isinstance(r, dict):
                rows.append({"file": f.name, **{k: v for k, v in r.items() if isinstance(v, (int, float, str, bool))}})
    parts = []
    if results:
        parts.append(markdown(sorted(results, key=lambda r: (str(r.get("arm")), r.get("step", 0)))))
    else:
        parts.append(f"_no eval of step {step} (the uploaded weights) recorded in this run_")
    if other_steps:
        parts.append(
            f"Evaluated at other steps, not shown (other weights): "
            f"{', '.join(sorted({str(r['step']) for r in other_steps}, key=int))}."
        )
    rows = [r for r in rows if r.get("step") in (None, step)]
    if rows:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
        stepped = all(r.get("step") == step for r in rows)
        parts.append(
            (
                ""
                if stepped
                else f"Other eval files of the run (they record no step: not necessarily step {step}'s weights):\n\n"
            )
            + "\n".join(lines)
        )
    return "\n\n".join(parts).rstrip() + "\n"


def model_card(run_dir: Path, manifest: dict, hf_config: dict) -> str:
    cfg_txt = (run_dir / "config.resolved.yaml").read_text() if (run_dir / "config.resolved.yaml").exists() else None
    cs = manifest.get("client_state", {})
    lines = [
        "---",
        "library_name: transformers",
        "tags: [megablu, long-context, yarn]",
        "---",
        "",
        f"# {manifest.get('run_id')} (step {manifest.get('step')})",
        "",
        "Trained with megablu (YaRN + DeepSpeed-Ulysses + ZeRO).",
        "",
        "| field | value |",
        "|---|---|",
        f"| run | {manifest.get('run_id')} |",
        f"| step | {manifest.get('step')} |",
        f"| tokens seen | {cs.get('tokens_seen', '?')} |",
        f"| config hash | {manifest.get('config_hash')} |",
        f"| tokenizer | {manifest.get('tokenizer')} |",
        f"| architecture | {hf_config.get('architectures', ['?'])[0]} |",
        f"| layers / d_model / heads / kv heads | {hf_config.get('num_hidden_layers')} / "
        f"{hf_config.get('hidden_size')} / {hf_config.get('num_attention_heads')} / "
        f"{hf_config.get('num_key_value_heads')} |",
        f"| rope | {json.dumps(hf_config.get('rope_parameters'))} |",
        f"| max position | {hf_config.get('max_position_embeddings')} |",
        f"| trained on | world {manifest.get('world_size')}, dp {manifest.get('dp')}, sp {manifest.get('sp')}, "
        f"ZeRO {manifest.get('zero_stage')} |",
        "",
        f"## Evaluation (step {manifest.get('step')})",
        "",
        _eval_table(run_dir, manifest.get("step")),
    ]
    if cfg_txt:
        lines += ["## Config", "", "```yaml", cfg_txt.rstrip(), "```", ""]
    return "\n".join(lines)


def upload_run(run_or_step: PathLike, repo: Repo, staging: Optional[PathLike] = None) -> list[str]:
    """Export the newest verified checkpoint of a run (or a given step) + model card, upload,
    then verify the repo lists every file with its size. Returns the uploaded paths."""
    from .checkpoint.weights import export_checkpoint  # the export used by `megablu ckpt export`

    own_tmp = staging is None
    stage_dir = Path(staging) if staging else Path(tempfile.mkdtemp(prefix="megablu-upload-"))
    try:
        out, manifest, run_dir = export_checkpoint(run_or_step, stage_dir / "export")
        hf_config = json.loads((out / "config.json").read_text())
        (out / "README.md").write_text(model_card(run_dir, manifest, hf_config))
        repo.upload(out, f"megablu {manifest['run_id']} step {manifest['step']}")
        local = {
            p.relative_to(out).as_posix(): RemoteFile(p.relative_to(out).as_posix(), p.stat().st_size)
            for p in out.rglob("*")
            if p.is_file()
        }
        remote = {f.path: f for f in repo.list_files()}
        problems = [f"missing in repo: {k}" for k in local if k not in remote]
        problems += [
            f"size in repo {k}: {remote[k].size} vs {v.size}"
            for k, v in local.items()
            if k in remote and remote[k].size != v.size
        ]
        if problems:
            raise HubError("upload not verified: " + "; ".join(problems))
        return sorted(local)
    finally:
        if own_tmp:
            shutil.rmtree(stage_dir, ignore_errors=True)


# --------------------------------------------------------------------------- commands
def _cmd_hub_download(args) -> int:
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
    hub = sub.add_parser("hub", help="Hugging Face Hub transfer, verified").add_subparsers(
        dest="hub_cmd", required=True
    )
    dl = hub.add_parser(
        "download",
        help="download files matching --include; exit 2 if a pattern matches "
        "nothing or a file is missing/short afterwards",
    )
    dl.add_argument("repo", help="Hub repo id, e.g. owner/name")
    dl.add_argument("--repo-type", default="model", choices=["model", "dataset", "space"], help="kind of Hub repo")
    dl.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    dl.add_argument("--include", action="append", required=True, metavar="PAT", help="glob (repeatable)")
    dl.add_argument("--local-dir", required=True, help="where the files go (the repo's paths kept)")
    dl.add_argument(
        "--from-local",
        default=None,
        metavar="DIR",
        help="a local mirror of the repo instead of the network (offline clusters, tests)",
    )
    dl.set_defaults(func=_cmd_hub_download)
    up = hub.add_parser("upload", help="export a run's newest verified checkpoint with a model card and push it")
    up.add_argument("run", help="run dir or step dir")
    up.add_argument("--repo", default=None, help="default: hub.repo of the run's config")
    up.add_argument("--public", action="store_true", help="create the repo public (default private)")
    up.add_argument("--staging", default=None, help="keep the staged export here")
    up.add_argument("--to-local", default=None, metavar="DIR", help="a local directory standing in for the repo")
    up.set_defaults(func=_cmd_hub_upload)
