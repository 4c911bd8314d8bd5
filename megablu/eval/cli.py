"""`megablu eval` and `megablu compare`. Tables go to stdout, logs to stderr.

    megablu eval --ckpt runs/ext32k/checkpoints/step_750 --config configs/ext32k.yaml
    megablu eval --hf path/to/hf_model_dir --config configs/<arm>.yaml --step 0 --arm parent
    megablu compare runs/l2 runs/l3@400 runs/ext32k/eval/step_750.json --plot cmp.png

Exit codes: 0 ok; 2 invalid input (config, tokenizer, checkpoint, eval setup); 1 the
short-context gate failed (or anything else).
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def _device_and_dtype(cfg):
    import torch

    from ..utils.device import resolve_device

    dev = resolve_device(cfg.train.device)
    dtype = torch.bfloat16 if (dev == "cuda" and cfg.train.dtype == "bf16") else torch.float32
    return torch.device(dev), dtype


def _eval_memory(memory):
    """The config's memory switches an eval's forwards use, as a MemoryConfig for apply_memory:
    ops (the CUDA extension or the torch reference: `ops: torch` must not build the extension),
    attention (the causal kernel of sequence_nll's forward and of a generation's first prefill chunk;
    decode steps run SDPA whatever it is), loss and loss_chunk (the head's loss with labels, installed
    as in training; the eval's held-out loss runs the head without labels, eval/loss.py, so they do not
    change its numbers). recompute and offload_activations act on training forwards only (grad enabled),
    and mlp_tiles bounds a training step's (T, ffn) saved tensors; an eval runs without grad and sizes
    its own forwards (--batch-tokens, --prefill-chunk), so these stay at their defaults here."""
    from ..config.schema import MemoryConfig

    return MemoryConfig(ops=memory.ops, attention=memory.attention, loss=memory.loss, loss_chunk=memory.loss_chunk)


def _memory_problems(cfg, device: str) -> list[str]:
    """The memory switches an eval applies (_eval_memory) that cannot run on `device`: the kernels'
    config checks (liger / fa4 on a CPU run, fa4's head_dim and dtype) and ops=cuda without CUDA."""
    from ..config.schema import kernel_invariants

    problems = kernel_invariants(cfg, device)
    if cfg.memory.ops == "cuda" and device != "cuda":
        problems.append(
            f"memory.ops=cuda on a {device} eval: the CUDA ops need a GPU; set memory.ops=auto "
            "(CUDA when there is one) or torch"
        )
    return problems


def _step_from_path(path: str):
    m = re.search(r"step[_-]?(\d+)", Path(path).name) or re.search(r"step[_-]?(\d+)", str(path))
    return int(m.group(1)) if m else None


def _eval_settings(args, eval_cfg):
    """(eval_cfg with --lengths/--n/--tasks applied, None) or (None, why): the overrides are validated like the
    config's own values (--n 0 is an error, not a silent eval.n)."""
    over = {k: v for k, v in (("lengths", args.lengths), ("n", args.n), ("tasks", args.tasks)) if v is not None}
    if over:
        from pydantic import ValidationError

        from ..config.load import _format_pydantic

        try:
            eval_cfg = type(eval_cfg).model_validate({**eval_cfg.model_dump(), **over})
        except ValidationError as e:
            return None, "; ".join(f"--{m}" for m in _format_pydantic(e))
    if args.batch_tokens is not None and args.batch_tokens < 1:  # 0 would mean the default in _eval
        return None, f"--batch-tokens {args.batch_tokens} must be >= 1"
    return eval_cfg, None


def _eval_tokenizer(cfg):
    """(the config's tokenizer, None) or (None, why it cannot be loaded)."""
    try:
        from ..data.tokenizer import TokenizerError, load_tokenizer
    except ImportError as e:
        return None, f"tokenizer support unavailable ({e})"
    try:
        return load_tokenizer(cfg.tokenizer), None
    except TokenizerError as e:
        return None, f"tokenizer: {e}"


def _eval_step(args, prov: dict):
    """(the step the result is named after, None) or (None, why): --step, else the path's, else the
    weights' own; a named step the loaded weights are not is refused."""
    step = args.step if args.step is not None else _step_from_path(args.ckpt or args.hf or "")
    step = prov.get("step") if step is None else step
    if step is None:
        return None, "cannot tell the step from the checkpoint path; pass --step"
    if prov.get("step") is not None and int(prov["step"]) != step:
        from ..checkpoint import step_name

        src = args.ckpt or args.hf
        return None, (
            f"{'--step' if args.step is not None else 'the path says step'} {step}, but the weights "
            f"loaded from {src} are step {prov['step']} (a run dir loads its newest verified step): the "
            f"result would carry another step's name; evaluate step {step} with --ckpt <run>/checkpoints/"
            f"{step_name(step)}, or drop --step"
        )
    return step, None


def _eval(args) -> int:
    from ..config import load_for_command
    from .compare import markdown
    from .harness import run_eval
    from .prompts import EvalError
    from .results import load_result

    cfg = load_for_command(args.config, args.set)
    if cfg is None:
        return 2
    eval_cfg, why = _eval_settings(args, cfg.eval)
    tok, why = (None, why) if why else _eval_tokenizer(cfg)
    if why or eval_cfg is None or tok is None:
        print(f"megablu eval: {why}", file=sys.stderr)
        return 2

    device, dtype = _device_and_dtype(cfg)
    from ..config.schema import eval_problems
    from .harness import preflight_problems

    # every task at every length, the haystack, the loss data, the memory switches on this device:
    # before any weight is loaded
    problems = (
        preflight_problems(eval_cfg, tok, cfg.data.window)
        or eval_problems(eval_cfg, cfg.data.window)
        or _memory_problems(cfg, device.type)
    )
    if problems:
        print("megablu eval: invalid eval setup:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    try:
        info = _rope_against_checkpoint(args, cfg)
    except EvalError as e:
        print(f"megablu eval: {e}", file=sys.stderr)
        return 2
    # where the result goes: checked now (the last check before the weights load), not after every cell ran
    run = _run_dir_of(Path(args.ckpt)) if args.ckpt else None
    out = Path(args.out) if args.out else (run / "eval" if run else Path(cfg.runs_dir) / cfg.name / "eval")
    from ..utils.files import new_name_problem, writable_problem

    flag = "--out" if args.out else "the result folder"
    why = (new_name_problem(out, flag) if not out.is_dir() else None) or writable_problem(out, flag)
    if why:
        print(f"megablu eval: {why}", file=sys.stderr)
        return 2
    try:
        model, prov = _load_model(args, cfg, tok.identity)
    except Exception as e:  # CLI boundary: any failure to build the model is invalid input, reported
        print(f"megablu eval: cannot load weights: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from ..memory.apply import apply_memory
    from .harness import weights_fingerprint

    info = {**info, "weights": weights_fingerprint(model)}  # the result's identity (results.identity)
    step, why = _eval_step(args, prov)
    if why or step is None:
        print(f"megablu eval: {why}", file=sys.stderr)
        return 2
    model = apply_memory(model, _eval_memory(cfg.memory), device=device.type)
    model = model.to(device=device, dtype=dtype).eval()
    # a checkpoint of a run: results go where the trainer's auto-eval puts them, under the run's id
    arm = args.arm or (run.name if run else cfg.name)
    try:
        gate_src = args.gate_parent or eval_cfg.gate.parent
        parent = load_result(gate_src) if gate_src else None
        if parent is not None:  # a parent the gate cannot use is found now, not after the generation
            from .gate import parent_problems

            problems = parent_problems(
                parent,
                eval_cfg.gate,
                eval_cfg.tasks,
                loss=bool(eval_cfg.loss.data),
                lengths=eval_cfg.lengths,
                loss_sets=list(eval_cfg.loss.sets),
            )
            if problems:
                raise EvalError("; ".join(problems))
        res = run_eval(
            model,
            tok,
            eval_cfg,
            cfg.data.window,
            step=step,
            out_dir=out,
            rank=0,
            arm=arm,
            parent=parent,
            batch_tokens=args.batch_tokens or (262144 if device.type == "cuda" else 16384),
            prefill_chunk=args.prefill_chunk,
            plot=not args.no_plot,
            info=info,
            resume=not args.no_resume,
        )
    except EvalError as e:
        print(f"megablu eval: {e}", file=sys.stderr)
        return 2
    if run is not None and eval_cfg.string is not None:
        _record_string_eval(run, out, step, arm, eval_cfg.string.model_dump(mode="json"))
    print(markdown([res]))
    gate = res.get("gate")
    if gate is not None:
        print(gate["message"], file=sys.stderr)
        if not gate["passed"]:
            return 1
    return 0


def _rope_against_checkpoint(args, cfg) -> dict:
    """The config's rope must be the one the weights were trained with, or an explicit override.

    Evaluating a checkpoint with another rope (theta, YaRN removed or another factor) is a
    legitimate experiment (a parent + YaRN without training), never an accident: it needs
    --rope-override, and the result records both ropes. Returns what the result records."""
    from ..checkpoint import CheckpointError, parent_record
    from ..config.lineage import rope_differences
    from .prompts import EvalError

    src = args.ckpt or args.hf
    if not src or not Path(src).exists():
        return {}  # _load_model reports the missing weights
    try:
        rec = parent_record(src)
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    if rec.rope is None:
        if not args.rope_override:
            raise EvalError(
                f"{src} records no rope, so the config's rope cannot be checked against the one the "
                f"weights were trained with; pass --rope-override to evaluate with the config's rope "
                f"(recorded in the result)"
            )
        return {"rope_override": {"checkpoint": None, "source": rec.source, "differences": ["rope: not recorded"]}}
    diff = rope_differences(rec.rope, cfg.rope)
    if not diff:
        return {}
    if not args.rope_override:
        raise EvalError(
            f"the config's rope differs from the one {src} was trained with ({rec.source}): "
            f"{'; '.join(diff)} (checkpoint vs config); evaluate with the checkpoint's rope, or pass "
            f"--rope-override to evaluate with the config's on purpose (recorded in the result)"
        )
    log.warning("rope override: %s (checkpoint vs config)", "; ".join(diff))
    return {
        "rope_override": {"checkpoint": rec.rope.model_dump(mode="json"), "source": rec.source, "differences": diff}
    }


STRING_EVALS = "string_evals.jsonl"  # <run>/eval/: every STRING eval of the run's checkpoints, wherever its out


def _record_string_eval(run: Path, out: Path, step: int, arm: str, string: dict) -> None:
    """A line in <run>/eval/string_evals.jsonl: this run's weights were scored with STRING, which no
    export reproduces (`megablu ckpt export` reads it and says so). Never fails the eval."""
    import json
    import time

    rec = {"out": str(out.resolve()), "step": step, "arm": arm, "string": string, "unix": time.time()}
    try:
        (run / "eval").mkdir(parents=True, exist_ok=True)
        with open(run / "eval" / STRING_EVALS, "a") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError as e:
        log.warning("could not record the STRING eval in %s: %s", run / "eval" / STRING_EVALS, e)


def _run_dir_of(ckpt: Path):
    """The run dir holding a checkpoint (a run dir, runs/<id>/checkpoints/step_N, or a file in it), else None."""
    d = ckpt if ckpt.is_dir() else ckpt.parent
    if (d / "checkpoints").is_dir() and not (d / "manifest.json").exists():
        return d
    return d.parent.parent if d.parent.name == "checkpoints" else None


def _load_model(args, cfg, tokenizer: str):
    """(BluModel with the weights, their provenance {tokenizer, run_id, step} or {})."""
    from ..model.decoder import BluModel

    if bool(args.ckpt) == bool(args.hf):
        raise ValueError("give exactly one of --ckpt (a megablu checkpoint) or --hf (a transformers model dir)")
    if args.hf:
        from transformers import AutoModelForCausalLM

        from ..config.lineage import architecture_problems
        from ..model.hf import configs_from_hf, from_hf

        hf = AutoModelForCausalLM.from_pretrained(args.hf, dtype="float32")
        m_cfg, _ = configs_from_hf(hf.config)
        bad = architecture_problems(m_cfg, cfg.model, f"{args.hf}/config.json")
        if bad:
            raise ValueError("--hf: " + "; ".join(bad))
        model = BluModel(cfg.model, cfg.rope)  # the config's rope (e.g. YaRN) over the HF weights
        model.load_state_dict(from_hf(hf).state_dict())
        return model, {}
    from ..checkpoint import load_weights

    model = BluModel(cfg.model, cfg.rope)
    prov = load_weights(model, args.ckpt, tokenizer=tokenizer)  # refuses weights of another tokenizer
    return model, prov


def _warn_unpaired(results) -> None:
    """A warning for each (task, length) whose arms were scored on different prompts."""
    digests: dict = {}
    for r in results:
        for c in r["cells"]:
            digests.setdefault((c["task"], c["length"]), set()).add(c["digest"])
    for (task, L), ds in digests.items():
        if len(ds) > 1:
            log.warning(
                "%s@%d: arms were evaluated on different prompts (seed, n or tokenizer differ); "
                "differences there are not paired",
                task,
                L,
            )


def _gate_against(results, parent: dict, args) -> tuple[list[str], int]:
    """Every result but the parent itself gated against it: (the gate's markdown, exit code 0 or 1); each
    verdict on stderr."""
    from ..config.schema import GateConfig
    from .gate import check_gate, gate_markdown
    from .results import _label, identity_differences

    gcfg = GateConfig(
        parent=args.gate_parent,
        short_lengths=args.short_lengths,
        margin_pp=args.margin_pp,
        loss_margin_rel=args.loss_margin_rel,
        ruler_at_window=not args.no_ruler_at_window,
    )
    gated, rc = [], 0
    for r in results:
        if (
            (r["arm"], r["step"]) == (parent["arm"], parent["step"])
            and not identity_differences(r, parent)
            and r.get("_path") == parent.get("_path")
        ):
            continue  # the parent itself
        gated.append((_label(r), check_gate(r, parent, gcfg)))
    for label, g in gated:
        print(f"{label}: {g.message}", file=sys.stderr)
        rc = rc or (0 if g.passed else 1)
    return gate_markdown(gated, _label(parent), gcfg), rc


def _compare(args) -> int:
    from .compare import markdown
    from .controls import controls_markdown, find_controls, missing_controls
    from .plots import heatmaps, plot
    from .prompts import EvalError
    from .results import load_result, merge_results

    try:
        results = merge_results([load_result(s) for s in args.runs])
        parent = load_result(args.gate_parent) if args.gate_parent else None
    except EvalError as e:
        print(f"megablu compare: {e}", file=sys.stderr)
        return 2
    if not 0 <= args.baseline < len(results):
        print(f"megablu compare: --baseline {args.baseline} out of range 0..{len(results) - 1}", file=sys.stderr)
        return 2
    controls = find_controls(results)
    missing = missing_controls(controls)
    if missing and args.require_controls:
        print(
            "megablu compare: --require-controls: every inference-time change needs the same change on the "
            "untrained parent + YaRN among the inputs (docs/EVAL.md, controls):\n  " + "\n  ".join(missing),
            file=sys.stderr,
        )
        return 2
    for m in missing:
        log.warning("%s", m)
    _warn_unpaired(results)
    text = "\n".join(
        [markdown(results, baseline=args.baseline, threshold=args.threshold), *controls_markdown(controls)]
    )
    rc = 0
    if parent is not None:
        gate_lines, rc = _gate_against(results, parent, args)
        text = "\n".join([text, *gate_lines])
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.plot:
        try:
            plot(results, Path(args.plot))
        except EvalError as e:
            print(f"megablu compare: {e}", file=sys.stderr)
            return 2
        log.info("plot written to %s", args.plot)
    if args.heatmap:
        try:
            paths = heatmaps(results, Path(args.heatmap))
        except EvalError as e:
            print(f"megablu compare: {e}", file=sys.stderr)
            return 2
        log.info("depth x length heatmaps: %s", ", ".join(map(str, paths)) or "none (no task with needle depths)")
    return rc


def _non_negative(text: str) -> float:
    """argparse type: a finite number >= 0 (a gate's allowed drop; a negative one fails every arm)."""
    import argparse
    import math

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{v:g} must be >= 0 (the drop allowed below the parent; 0 = none)")
    return v


def register(sub) -> None:
    e = sub.add_parser(
        "eval",
        help="evaluate a checkpoint: the eval tasks (passkey ... the RULER suite) per length, "
        "held-out loss, gate, report",
    )
    e.add_argument("--config", required=True, help="the run's YAML (model, rope, tokenizer, eval, data.window)")
    e.add_argument("--ckpt", help="megablu checkpoint (weights are loaded with checkpoint.load_weights)")
    e.add_argument("--hf", help="a transformers Llama/Qwen2 directory instead of --ckpt (imported with from_hf)")
    e.add_argument("--set", action="append", default=[], metavar="a.b=v", help="config override (repeatable)")
    e.add_argument("--step", type=int, help="step recorded in the result (default: parsed from --ckpt)")
    e.add_argument("--arm", help="arm name in reports (default: the checkpoint's run id, else the config name)")
    e.add_argument("--out", help="output dir (default: the checkpoint's <run>/eval, else <runs_dir>/<name>/eval)")
    e.add_argument("--lengths", type=int, nargs="+", help="override eval.lengths")
    e.add_argument("--n", type=int, help="override eval.n")
    e.add_argument("--gate-parent", help="parent result (json, run dir, or RUN@STEP); default eval.gate.parent")
    e.add_argument(
        "--rope-override",
        action="store_true",
        help="evaluate with the config's rope although the checkpoint was trained with another "
        "(e.g. a parent + YaRN without training); the result records both",
    )
    e.add_argument("--tasks", nargs="+", help="override eval.tasks (built-in names or eval.task_defs names)")
    e.add_argument(
        "--batch-tokens",
        type=int,
        help="prompts per batch = max(1, this // length); default 262144 on a GPU, 16384 on a CPU",
    )
    e.add_argument(
        "--prefill-chunk",
        type=int,
        help="prefill in chunks of this many tokens through the KV cache; "
        "0 = the whole prompt at once; default: whole on a GPU (4096 with eval.string's sdpa kernel), "
        "2048 on a CPU",
    )
    e.add_argument("--no-plot", action="store_true", help="skip step_<N>.png (json and md are always written)")
    e.add_argument(
        "--no-resume",
        action="store_true",
        help="run every cell even if step_<N>.json.partial in --out holds some for the same model, setup "
        "and prompts (an eval cut short goes on where it stopped without this)",
    )
    e.set_defaults(func=_eval)

    c = sub.add_parser("compare", help="compare eval results of several arms: table, differences, plot, gate")
    c.add_argument("runs", nargs="+", metavar="RUN_OR_JSON", help="step_<N>.json, a run dir (latest step), or RUN@STEP")
    c.add_argument("--baseline", type=int, default=0, help="index of the arm differences are taken against")
    c.add_argument("--plot", help="write a PNG: accuracy vs log2 length, one line per arm, 95%% bands")
    c.add_argument("--md", help="also write the markdown tables to this file")
    c.add_argument("--threshold", type=float, default=85.6, help="effective-length threshold in %% (RULER: 85.6)")
    c.add_argument("--gate-parent", help="gate every arm against this parent result; exit 1 if any fails")
    c.add_argument(
        "--short-lengths",
        type=int,
        nargs="+",
        default=[1024, 4096],
        help="with --gate-parent: the lengths where an arm may not drop below the parent (eval.gate)",
    )
    c.add_argument(
        "--margin-pp",
        type=_non_negative,
        default=5.0,
        help="with --gate-parent: the drop in pp allowed per task at a short length",
    )
    c.add_argument(
        "--loss-margin-rel",
        type=_non_negative,
        default=0.02,
        help="short-document loss may rise this fraction above the parent's, on every held-out set "
        "(eval.loss.data and eval.loss.sets) the arm measured",
    )
    c.add_argument(
        "--no-ruler-at-window",
        action="store_true",
        help="with --gate-parent: gate RULER's tasks at --short-lengths only, not also at the parent's "
        "window (eval.gate.ruler_at_window=false)",
    )
    c.add_argument(
        "--require-controls",
        action="store_true",
        help="exit 2 when a result ran an inference-time change (eval.string, --rope-override) on a "
        "trained arm and the inputs lack the same change on the untrained parent + YaRN "
        "(otherwise the table says so and compare goes on)",
    )
    c.add_argument(
        "--heatmap",
        metavar="PREFIX",
        help="write PREFIX_<task>.png: needle depth x length, one panel per arm, for every task with needles",
    )
    c.set_defaults(func=_compare)
