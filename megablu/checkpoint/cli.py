"""`megablu ckpt verify|list|export|import-gguf`.

Results go to stdout, logs to stderr; exit 0 ok, 2 for a bad checkpoint / failed
verification / bad input. DeepSpeed is never imported here (it prints on stdout).

  megablu ckpt verify runs/ext32k-0003                 # every step of the run (sha256)
  megablu ckpt verify runs/ext32k-0003/checkpoints/step_0000750
  megablu ckpt list runs/ext32k-0003                   # steps, status, tokens, topology
  megablu ckpt export runs/ext32k-0003 --out exports/ext32k   # newest verified step -> HF dir
  megablu ckpt import-gguf model.gguf --out models/m   # llama.cpp GGUF -> HF dir (init_from, eval --hf)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .layout import LATEST, PIN, CheckpointError, read_manifest, step_dirs, step_problems


def _cmd_verify(args) -> int:
    try:
        steps = step_dirs(Path(args.path))
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
    from ..train.runs import list_runs

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
            steps = step_dirs(run)
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
            rows.append(
                [
                    str(s),
                    "ok" if not problems else "BAD",
                    str(m.get("step", "?")),
                    str(m.get("client_state", {}).get("tokens_seen", "?")),
                    f"w{m.get('world_size', '?')}/dp{m.get('dp', '?')}/sp{m.get('sp', '?')}"
                    f"/z{m.get('zero_stage', '?')}",
                    f"{size / 1e6:.1f}MB",
                    flags.strip(),
                    "; ".join(problems)[:120],
                ]
            )
    rc = 2 if any(r[1] == "BAD" for r in rows) else 0  # like `ckpt verify`: a BAD row is exit 2
    if args.json:
        keys = ["path", "status", "step", "tokens_seen", "topology", "size", "flags", "problems"]
        print(json.dumps([dict(zip(keys, r, strict=True)) for r in rows], indent=1))
        return rc
    head = ["path", "status", "step", "tokens", "topology", "size", "flags", "problems"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    for r in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return rc


def _cmd_export(args) -> int:
    from .weights import export_checkpoint

    try:
        out, m, _ = export_checkpoint(args.src, args.out, force=args.force, rope_as_yarn=args.rope_as_yarn)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _cmd_import_gguf(args) -> int:
    from ..model.gguf import GGUFError, gguf_to_dir

    try:
        out = gguf_to_dir(args.src, args.out, force=args.force)
    except GGUFError as e:
        print(f"import failed: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def register(sub) -> None:
    ck = sub.add_parser("ckpt", help="checkpoint tools: verify, list, export, import-gguf").add_subparsers(
        dest="ckpt_cmd", required=True
    )
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
    ex.add_argument(
        "--force",
        action="store_true",
        help="replace the megablu export at --out (only a folder "
        "an earlier export wrote and nothing else; swapped in once the new one is complete)",
    )
    ex.add_argument(
        "--rope-as-yarn",
        action="store_true",
        help="export a rope.yarn.apply=beyond_original model as plain YaRN (no transformers rope "
        "reproduces beyond_original; plain YaRN is exact only beyond original_max_position)",
    )
    ex.set_defaults(func=_cmd_export)
    im = ck.add_parser(
        "import-gguf",
        help="a llama.cpp GGUF file (llama, qwen2, qwen3, gemma3; any quant type the "
        "gguf package dequantizes) -> an HF dir of fp32 safetensors + config.json (docs/MODELS.md)",
    )
    im.add_argument("src", help="the .gguf file")
    im.add_argument(
        "--out",
        required=True,
        help="new directory for model.safetensors, config.json and megablu_import.json (source sha256, licence)",
    )
    im.add_argument(
        "--force",
        action="store_true",
        help="replace a megablu GGUF import at --out (only a folder an "
        "earlier import wrote; swapped in once the new one is complete)",
    )
    im.set_defaults(func=_cmd_import_gguf)
