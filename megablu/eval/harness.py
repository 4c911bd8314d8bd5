"""run_eval: build the seeded prompts, generate, score, summarise, gate, write step_<N>.json.

The trainer's auto-eval and `megablu eval` both call `run_eval`. Under sequence parallelism
every rank of the sp group must call it (generation is collective); only global rank 0
writes. Everything that would make the result meaningless -- no tokenizer, no lengths, a
length that breaks the PAD rule, a needle task without a haystack, zero prompts, token ids
outside the model's vocabulary -- raises EvalError before any generation starts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..config.schema import EvalConfig, eval_padded_len, string_problems
from ..model.string import apply_string, kernels_used, string_impl
from . import plots, results
from .generate import cut_at_stop, greedy_generate
from .needle import HAYSTACK_TOKENS, Haystack
from .prompts import EvalError, HaystackSource, Prompt, TokenizerLike, check_ids, extract_answer, prompt_digest, score
from .tasks import make_builder, needs_text_haystack

log = logging.getLogger(__name__)

# eval.string on a GPU with the sdpa kernel (eval.string.kernel=sdpa): the prefill chunk when none is given,
# so each chunk's masked SDPA over [keys; shifted keys] stays small (model/string.py also blocks the queries).
# The flex kernel (auto on a GPU) prefills a whole prompt like the plain path: one shape, one compile.
STRING_PREFILL_CHUNK = 4096


def _beyond(eval_cfg: EvalConfig, task: str) -> int:
    """Tokens a task's sequence holds beyond its length: max_new (none for RULER's, whose length counts it)."""
    return eval_cfg.task_max_new(task) + eval_cfg.task_prompt_len(task, 0)


def check_lengths(eval_cfg: EvalConfig, window: int) -> None:
    """The PAD rule, per task (each has its own max_new): prompt + max_new rounded up to
    pad must fit the window."""
    if not eval_cfg.lengths:
        raise EvalError("eval.lengths is empty: nothing to evaluate")
    bad = []
    for task in dict.fromkeys(eval_cfg.tasks):
        mn = eval_cfg.task_max_new(task)
        for L in eval_cfg.lengths:
            padded = eval_padded_len(eval_cfg.task_prompt_len(task, L), mn, eval_cfg.pad)
            if padded > window:
                fit = (window // eval_cfg.pad) * eval_cfg.pad - _beyond(eval_cfg, task)
                bad.append(
                    f"{task}@{L} + max_new {mn} pads to {padded} at pad {eval_cfg.pad} > window {window} "
                    f"(the longest {task} length that fits is {fit})"
                )
    if bad:
        fit = (window // eval_cfg.pad) * eval_cfg.pad - max(_beyond(eval_cfg, t) for t in eval_cfg.tasks)
        raise EvalError("eval lengths do not fit the window: " + "; ".join(bad) + f"; the longest that fits is {fit}")


def _builders(eval_cfg: EvalConfig, tokenizer: TokenizerLike, haystack: Optional[HaystackSource]) -> dict:
    hay = None
    if any(needs_text_haystack(eval_cfg.spec(t)) for t in eval_cfg.tasks):
        if haystack is None:
            t = next(t for t in eval_cfg.tasks if needs_text_haystack(eval_cfg.spec(t)))
            raise EvalError(
                f"task {t!r} needs a real-text haystack: set eval.haystack (a dataset dir whose val "
                f"split is the haystack) or pass haystack="
            )
        # tokenized once, shared by every real-text task; 2x the longest length leaves room for
        # offsets; read to a fixed size so a job's other lengths never change task@L's prompts
        hay = Haystack(haystack, tokenizer, 2 * max(eval_cfg.lengths), target_tokens=HAYSTACK_TOKENS)
    return {
        t: make_builder(
            t, eval_cfg.spec(t), tokenizer, eval_cfg.seed, eval_cfg.n, hay, chat_template=eval_cfg.chat_template
        )
        for t in dict.fromkeys(eval_cfg.tasks)
    }


def preflight_problems(
    eval_cfg: EvalConfig, tokenizer: TokenizerLike, window: int, haystack: Optional[HaystackSource] = None
) -> list[str]:
    """What would make run_eval fail, found before any training or generation: the PAD rule per
    task, a missing or short haystack, a length shorter than a task's content in this tokenizer
    (exact: the longest fixed content of the task's n prompts), the loss data. [] = ok."""
    out = []
    try:
        check_lengths(eval_cfg, window)
    except EvalError as e:
        out.append(str(e))
    if haystack is None and eval_cfg.haystack and any(needs_text_haystack(eval_cfg.spec(t)) for t in eval_cfg.tasks):
        try:
            haystack = load_haystack(eval_cfg.haystack, tokenizer)
        except EvalError as e:
            return out + [str(e)]
    if not eval_cfg.lengths:
        return out
    try:
        builders = _builders(eval_cfg, tokenizer, haystack)
    except EvalError as e:
        return out + [str(e)]
    for task, b in builders.items():
        need = b.min_length()
        short = [L for L in eval_cfg.lengths if L < need]
        if short:
            out.append(
                f"eval.lengths {short} cannot hold task {task} (its prompts need at least {need} tokens in "
                f"tokenizer {tokenizer.identity}); drop those lengths or the task"
            )
        else:  # the longest length: a haystack or word list too small for it shows here
            try:
                b.build(max(eval_cfg.lengths), 0)
            except EvalError as e:
                out.append(str(e))
        fits = [L for L in eval_cfg.lengths if L >= need]
        if fits:
            out += answer_budget_problems(eval_cfg, task, b, tokenizer, min(fits))
    if eval_cfg.loss.data or eval_cfg.loss.sets:
        from .loss import loss_problems

        out += loss_problems(eval_cfg, tokenizer)
    return out


def answer_budget_problems(
    eval_cfg: EvalConfig, task: str, builder, tokenizer: TokenizerLike, length: int
) -> list[str]:
    """The task's generation budget (max_new) against its answers in this tokenizer: a budget shorter than an
    answer scores 0 whatever the model knows (a passkey at max_new 4 of a digit-per-token tokenizer: 100% ->
    0%). An answer's tokens are those of ' ' + its expected answers joined by ', ' (the prompt's last line
    ends before the answer's space), over the task's n prompts (a prompt's answers are the same at every
    length: built once, at `length`)."""
    mn = eval_cfg.task_max_new(task)
    need, worst = 0, ""
    for i in range(eval_cfg.n):
        try:
            p = builder.build(length, i)
        except EvalError:  # said by the length checks above
            return []
        text = " " + ", ".join(p.expected)
        k = len(tokenizer.encode(text))
        if k > need:
            need, worst = k, text
    if need <= mn:
        return []
    spec = eval_cfg.spec(task)
    if spec.max_new is not None:
        field = f"eval.task_defs.{task}.max_new" if task in eval_cfg.task_defs else f"task {task}'s max_new"
        fix = f"set {field} >= {need}"
    elif spec.family in ("passkey", "needle"):
        field, fix = "eval.max_new", f"set eval.max_new >= {need}"
    else:
        field = f"the {spec.family} family's budget max_new"
        fix = f"define the task under eval.task_defs with max_new >= {need}"
    what = "it" if len(p.expected) == 1 else "all its answers"
    return [
        f"{field}={mn}: task {task}'s answers take up to {need} tokens in tokenizer {tokenizer.identity} "
        f"({worst[:60]!r}, the space the prompt leaves included): a generation of {mn} tokens cannot hold "
        f"{what}, so the task scores 0 whatever the model knows; {fix}"
    ]


def build_prompts(
    eval_cfg: EvalConfig,
    tokenizer: TokenizerLike,
    *,
    haystack: Optional[HaystackSource] = None,
    vocab_size: Optional[int] = None,
) -> dict[tuple[str, int], list[Prompt]]:
    """{(task, length): [Prompt] * n}, identical for every arm that shares tokenizer and config.

    Every task of eval.tasks, built-in or from eval.task_defs; tasks with a real-text haystack
    need `haystack` (text, documents or a callable; run_eval loads eval.haystack)."""
    if tokenizer is None:
        raise EvalError(
            "no tokenizer: the eval cannot build prompts (an eval without them would "
            "'succeed' on no prompts); configure `tokenizer:` and check it loads"
        )
    lengths = sorted(set(eval_cfg.lengths))
    if not lengths:
        raise EvalError("eval.lengths is empty: nothing to evaluate")
    builders = _builders(eval_cfg, tokenizer, haystack)
    out = {}
    for task, b in builders.items():
        for L in lengths:
            ps = [b.build(L, i) for i in range(eval_cfg.n)]
            if vocab_size is not None:
                for p in ps[:1]:
                    check_ids(p.ids, vocab_size, f"{task}@{L}")
            out[(task, L)] = ps
    if not out or not any(out.values()):
        raise EvalError(
            f"zero prompts built (tasks {eval_cfg.tasks}, lengths {eval_cfg.lengths}, n {eval_cfg.n}); "
            f"refusing to write an empty report"
        )
    return out


def _model_info(model) -> dict:
    info = {}
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "model_dump"):
        info["model"] = cfg.model_dump(mode="json")
    rope = getattr(model, "rope_cfg", None)
    if rope is not None and hasattr(rope, "model_dump"):
        info["rope"] = rope.model_dump(mode="json")
    return info


def partial_path(out_dir: Path, step: int, key: str) -> Path:
    """Where `megablu eval` keeps the cells of one setup (`key`) finished so far: a name no step_*.json or *.json
    glob matches, one per setup, so a rerun with other settings never overwrites another's cells."""
    return Path(out_dir) / f"step_{step}.{key}.json.partial"


@torch.no_grad()
def weights_fingerprint(model) -> str:
    """A cheap digest of the weights: each tensor's name, shape, dtype, and its sum and sum of squares (float64,
    12 significant digits). Another checkpoint gives another digest; it is not a cryptographic hash."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if not torch.is_tensor(t) or not t.is_floating_point():
            continue
        s1 = float(torch.sum(t, dtype=torch.float64))
        s2 = float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{s1:.12g}:{s2:.12g};".encode())
    return h.hexdigest()[:16]


@functools.cache
def code_digest() -> str:
    """The sources that generate and score (megablu/eval, model, ops, memory; csrc): a kept cell of other code
    is not reused."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    files = [f for d in ("eval", "model", "ops", "memory") for f in (root / d).rglob("*.py")]
    files += [f for f in (root.parent / "csrc").rglob("*") if f.is_file()] if (root.parent / "csrc").is_dir() else []
    for f in sorted(files):
        h.update(str(f.relative_to(root.parent)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _kernels(model) -> dict:
    """What runs the model's layers: each module's ops impl and attention kernel (apply_memory sets them), and,
    where attention is auto, whether FlashAttention-4 imports here (auto's choice on an SM90 GPU)."""
    from ..ops.attention import import_problem

    ks = sorted(
        {
            f"{type(m).__name__}:{getattr(m, 'impl', '')}:{getattr(m, 'kernel', '')}"
            for m in model.modules()
            if hasattr(m, "impl") or hasattr(m, "kernel")
        }
    )
    auto = any(getattr(m, "kernel", None) == "auto" for m in model.modules())
    return {"modules": ks, **({"fa4_imports": import_problem() is None} if auto else {})}


def _resume_key(
    model,
    tokenizer,
    eval_cfg: EvalConfig,
    window: int,
    step: int,
    arm,
    batch_tokens: int,
    prefill_chunk,
    info,
    string_kernel,
) -> str:
    """Everything besides the prompts (each cell's digest) that decides a cell's outcome. The lengths and tasks
    asked for are left out, so a rerun with more of them reuses the cells it shares."""
    ev = eval_cfg.model_dump(mode="json")
    for k in ("lengths", "tasks", "at_steps", "final", "gate", "loss"):
        ev.pop(k, None)
    p = next(model.parameters(), None)
    dev = None if p is None else p.device
    key = {
        "step": step,
        "arm": arm,
        "window": window,
        "tokenizer": tokenizer.identity,
        "stop_ids": list(getattr(tokenizer, "stop_ids", ())),
        "eval": ev,
        "model": _model_info(model),
        "weights": weights_fingerprint(model),
        "info": info or {},
        "batch_tokens": batch_tokens,
        "prefill_chunk": prefill_chunk,
        "kernels": _kernels(model),
        "string_kernel": string_kernel,
        "device": None if dev is None else (torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type),
        "dtype": None if p is None else str(p.dtype),
        "code": code_digest(),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _previous_result(out_dir: Path, step: int, probe: dict) -> Optional[dict]:
    """The result already at out_dir/step_<step>.json, when this eval may add its cells to it: the same arm,
    model (results.identity) and prompt settings; EvalError (before any generation) when another one is there,
    whose cells writing this one would lose. None when there is none."""
    path = Path(out_dir) / f"step_{step}.json"
    if not path.exists():
        return None
    try:
        prev = results.load_result(path)
    except EvalError as e:
        raise EvalError(
            f"{path} exists and is not a readable eval result ({e}); this eval would replace it: move "
            f"it, or give another --out"
        ) from None
    diff = (["arm"] if prev.get("arm") != probe["arm"] else []) + results.identity_differences(prev, probe, True)
    if diff:
        raise EvalError(
            f"{path} holds the result of {prev.get('arm')}@{step}, which differs from this eval in "
            f"{', '.join(diff)}: writing this one would lose its cells; give another --out (or --arm), "
            f"or move it"
        )
    return prev


def merge_loss(loss: Optional[dict], old: Optional[dict]) -> Optional[dict]:
    """One held-out set's section: `loss`'s lengths and short documents, plus `old`'s at the lengths it lacks."""
    if not (old and loss):
        return loss or old
    have = {c["length"] for c in loss["by_length"]}
    by = loss["by_length"] + [c for c in old["by_length"] if c["length"] not in have]
    return {**loss, "by_length": sorted(by, key=lambda c: c["length"]), "short": loss.get("short") or old.get("short")}


def _merge_previous(
    prev: dict, cells: list, samples: list, loss: Optional[dict], sets: Optional[dict] = None
) -> tuple[list, list, Optional[dict], dict]:
    """This eval's cells, samples, loss and loss sets, plus the previous result's at the (task, length)s and loss
    lengths this eval did not measure (the same model and prompts: _previous_result checked)."""
    mine = {(c["task"], c["length"]) for c in cells}
    keep = [c for c in prev["cells"] if (c["task"], c["length"]) not in mine]
    kept = {(c["task"], c["length"]) for c in keep}
    samples = samples + [s for s in prev.get("samples", []) if (s.get("task"), s.get("length")) in kept]
    sets, old_sets = dict(sets or {}), prev.get("loss_sets") or {}
    sets = {k: merge_loss(sets.get(k), old_sets.get(k)) for k in dict.fromkeys([*sets, *old_sets])}
    return cells + keep, samples, merge_loss(loss, prev.get("loss")), sets


def _load_partial(path: Path) -> dict:
    """{(task, length): (cell, samples)} of a partial file; {} (with a warning) when it is unreadable."""
    others = sorted(p.name for p in path.parent.glob(path.name.split(".", 1)[0] + ".*.json.partial") if p != path)
    if others:
        log.warning(
            "eval: %s hold cells of another model, setup or megablu version: not used (delete them when done)",
            ", ".join(others),
        )
    if not path.exists():
        return {}
    try:
        part = json.loads(path.read_text())
        by = {}
        for c in part["cells"]:
            ss = [x for x in part["samples"] if (x.get("task"), x.get("length")) == (c["task"], c["length"])]
            by[(c["task"], c["length"])] = (c, ss)
        return by
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("eval: %s is unreadable (%s: %s); its cells run again", path, type(e).__name__, e)
        return {}


@dataclass
class _Resume:
    """run_eval's resume state (resume=True; else every field empty): the partial file of this setup (`key`,
    `path`), the cells found in it by (task, length), those this run does not ask for (`others`: they stay in
    the file), and the cells this run took from it (`resumed`)."""

    key: Optional[str] = None
    path: Optional[Path] = None
    kept: dict = field(default_factory=dict)
    others: list = field(default_factory=list)
    resumed: list = field(default_factory=list)

    def keep(self, task: str, L: int, ps: list) -> Optional[tuple]:
        """(cell, samples) kept for (task, L) when they hold these prompts, else None."""
        k = self.kept.get((task, L))
        if k is not None and k[0].get("digest") == prompt_digest(ps) and len(k[1]) == len(ps):
            return k
        return None

    def write(self, cells: list, samples: list) -> None:
        """The partial file: `cells` and `samples` plus the kept ones this run does not ask for."""
        assert self.path is not None, "a resumable eval has a partial file"
        results.write_result(
            {
                "key": self.key,
                "cells": cells + [c for c, _ in self.others],
                "samples": samples + [x for _, ss in self.others for x in ss],
            },
            self.path,
        )


def _vocab_checked(model, tokenizer) -> Optional[int]:
    """The model's vocabulary size (None: not known), after checking the tokenizer's ids fit it."""
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if tokenizer is not None and vocab is not None and tokenizer.vocab_size > vocab:
        raise EvalError(f"tokenizer {tokenizer.identity} has {tokenizer.vocab_size} ids > model vocab {vocab}")
    return vocab


def _string_checked(eval_cfg: EvalConfig, sp: int):
    """eval.string (None: off) after its checks against sp and the lengths (string_problems)."""
    string = eval_cfg.string
    if string is None:
        return None
    if sp > 1:
        raise EvalError(
            f"eval.string with sp={sp}: STRING attention runs on one rank (a sequence-parallel "
            f"prefill shards the keys it remaps); run the eval with parallel.sp=1"
        )
    bad = string_problems(eval_cfg)  # S inside each prompt it applies to, and above W
    if bad:
        raise EvalError("; ".join(bad))
    if string.beyond and all(L <= string.beyond for L in eval_cfg.lengths):
        log.warning(
            "eval.string.beyond=%d >= every length (%s): every cell is evaluated plain",
            string.beyond,
            ", ".join(map(str, eval_cfg.lengths)),
        )
    return string


def _chunk_for(prefill_chunk: Optional[int], device: torch.device, on: bool, kernel: str = "auto") -> int:
    """The prefill chunk of a cell (the caller's, if given): a GPU's flash kernel prefills a whole prompt
    fastest, STRING's sdpa kernel takes 4096-token chunks; a CPU prefills in chunks of 2048."""
    if prefill_chunk is not None:
        return prefill_chunk
    if device.type != "cuda":
        return 2048
    return STRING_PREFILL_CHUNK if on and string_impl(device, kernel=kernel) == "sdpa" else 0


def _resume_state(resume: bool, sp: int, dp_group, out_dir: Path, step: int, prompts: dict, key_of) -> _Resume:
    """The partial file of this setup and the cells in it (key_of(): _resume_key's digest), or an empty state."""
    sp_dp_one = sp == 1 and (dp_group is None or torch.distributed.get_world_size(dp_group) == 1)
    if resume and not sp_dp_one:
        raise EvalError("run_eval(resume=True) runs in one process (sp and dp 1): the partial file is rank 0's")
    if not resume:
        return _Resume()
    key = key_of()
    path = partial_path(out_dir, step, key)
    kept = _load_partial(path)
    # kept cells this run does not ask for stay in the file (a rerun with fewer lengths, cut again, keeps them)
    return _Resume(key, path, kept, [kept[k] for k in kept if k not in prompts])


def _generate_cell(
    model,
    tokenizer,
    eval_cfg: EvalConfig,
    task: str,
    L: int,
    ps: list,
    *,
    string,
    sp_group,
    dp_group,
    batch_tokens: int,
    prefill_chunk: Optional[int],
    device,
) -> tuple[dict, list]:
    """One (task, length): its prompts generated in batches of max(1, batch_tokens // L) (each dp group every
    dp-th prompt, gathered back in prompt order), scored, and its cell (with STRING's setting at L)."""
    dp = torch.distributed.get_world_size(dp_group) if dp_group is not None else 1
    dp_rank = torch.distributed.get_rank(dp_group) if dp_group is not None else 0
    t0 = time.perf_counter()
    on = string is not None and string.applies(L)  # eval.string.beyond: plain up to that length
    if string is not None:  # S for prompts built to L tokens (variant authors: int(shift_ratio * L))
        apply_string(model, string if on else None, L)
    bs = max(1, batch_tokens // L)
    max_new = eval_cfg.task_max_new(task)
    mine, done = ps[dp_rank::dp], []
    for s in range(0, len(mine), bs):
        batch = mine[s : s + bs]
        ids = torch.tensor([p.ids for p in batch], dtype=torch.long)
        gen = greedy_generate(
            model,
            ids,
            max_new,
            sp_group=sp_group,
            prefill_chunk=_chunk_for(prefill_chunk, device, on, string.kernel if on else "auto"),
            stop_ids=tokenizer.stop_ids,
            decode=eval_cfg.decode,
        ).tolist()
        for p, g in zip(batch, gen, strict=True):
            done.append(_sample(task, L, p, tokenizer.decode(cut_at_stop(g, tokenizer.stop_ids))))
    if dp > 1:  # every dp group's share, back in prompt order
        parts: list = [None] * dp
        torch.distributed.all_gather_object(parts, done, group=dp_group)
        order = {p.index: i for i, p in enumerate(ps)}
        done = sorted((x for part in parts for x in part), key=lambda x: order[x["index"]])
    c = results.cell(task, L, done, eval_cfg, ps, time.perf_counter() - t0)
    if string is not None:
        c["string"] = on
        if on:
            c["string_shift"] = string.shift_for(L)
    return c, done


def _run_cells(
    model, tokenizer, eval_cfg: EvalConfig, prompts: dict, state: _Resume, *, step: int, rank: int, **gen
) -> tuple[list, list]:
    """Every (task, length) of `prompts`: kept from the partial file when it holds them (state.keep), else
    generated (_generate_cell, gen = its keywords); with resume, rank 0 writes the partial file after each."""
    samples, cells = [], []
    for (task, L), ps in prompts.items():
        k = state.keep(task, L, ps)
        if k is not None:
            c, done = k
            cells.append(c)
            samples += done
            state.resumed.append(f"{task}@{L}")
            log.info("eval step %d %s@%d: %.1f%%, kept from %s", step, task, L, c["acc_pp"], state.path)
            continue
        c, done = _generate_cell(model, tokenizer, eval_cfg, task, L, ps, **gen)
        samples += done
        cells.append(c)
        if rank == 0:
            dt = c["seconds"]
            log.info(
                "eval step %d %s@%d: %.1f%% (%d/%d fully correct) in %.1fs, %.2f prompts/s",
                step,
                task,
                L,
                c["acc_pp"],
                c["all_correct"],
                len(ps),
                dt,
                len(ps) / max(dt, 1e-9),
            )
            if state.key is not None:  # every finished cell on disk: a kill loses at most the cell running
                try:
                    state.write(cells, samples)
                except OSError as e:  # a side feature never ends an eval
                    log.warning("eval: cannot keep the finished cells in %s (%s); going on", state.path, e)
    return cells, samples


def _run_losses(model, loss_data: dict, eval_cfg: EvalConfig, *, step: int, rank: int, sp_group, dp_group) -> dict:
    """{set name: run_loss's section} for every held-out set (None: eval.loss.data)."""
    from .loss import run_loss

    losses = {}
    for name, data in loss_data.items():
        t0 = time.perf_counter()
        losses[name] = lo = run_loss(model, data, eval_cfg, sp_group=sp_group, dp_group=dp_group)
        if rank == 0:
            log.info(
                "eval step %d held-out loss%s: %s%s in %.1fs",
                step,
                f" ({name})" if name else "",
                ", ".join(f"{c['length']}: {c['loss']:.3f}" for c in lo["by_length"]),
                f"; short docs {lo['short']['loss']:.3f}" if lo["short"] else "",
                time.perf_counter() - t0,
            )
    return losses


def _write(res: dict, out_dir: Path, step: int, plot: bool, state: _Resume) -> None:
    """Rank 0: step_<step>.json and its md/png, then the partial file kept (cells this run did not ask for) or
    removed."""
    path = results.write_result(res, out_dir / f"step_{step}.json")
    plots.write_artifacts(res, out_dir, step, plot=plot)
    if state.key is not None and state.others:  # the kept cells this run did not ask for stay for a later one
        state.write([], [])
    elif state.key is not None and state.path is not None:
        state.path.unlink(missing_ok=True)
    log.info(
        "eval results written to %s%s",
        path,
        f" ({len(state.resumed)} cells kept from an earlier run)" if state.resumed else "",
    )


def run_eval(
    model,
    tokenizer: TokenizerLike,
    eval_cfg: EvalConfig,
    window: int,
    *,
    sp_group=None,
    step: int,
    out_dir: Path,
    rank: int,
    dp_group=None,
    haystack: Optional[HaystackSource] = None,
    arm: Optional[str] = None,
    parent: Optional[dict] = None,
    batch_tokens: int = 16384,
    prefill_chunk: Optional[int] = None,
    plot: bool = True,
    info: Optional[dict] = None,
    resume: bool = False,
) -> dict:
    """Evaluate `model` (collective over sp_group when given); rank 0 writes out_dir/step_<step>.json.

    Also writes step_<step>.md and, when `plot`, step_<step>.png. Prompts of one length are
    batched max(1, batch_tokens // length) at a time; prefill runs in prefill_chunk-token
    chunks on one rank (None: the whole prompt at once on a GPU -- 4096-token chunks with eval.string's sdpa
    kernel --,
    2048-token chunks on a CPU), and
    decoding stops when every prompt of the batch has emitted EOT or another stop token (tokenizer.stop_ids: an
    instruct model's end of turn); the output is scored up to the first of them. With eval.loss.data the
    held-out loss per length and on short documents is measured too (result["loss"]), and with eval.loss.sets
    on each named set (result["loss_sets"][name]).
    Returns the result dict on every rank. When eval.gate.parent is set (or `parent`, a loaded
    result, is passed), result["gate"] holds the short-context gate; callers fail the run when
    result["gate"]["passed"] is False (`megablu eval` exits 1). With dp_group (the ranks that
    share this rank's sp position across data-parallel groups), each dp group generates every
    dp-th prompt and the samples are gathered: the same result, dp times sooner.
    With eval.string, STRING (model/string.py) is installed on the model for this eval only, per cell (S for
    the cell's length: string_problems refuses an S outside the prompt) and per held-out sequence, and the
    previous setting restored after; it needs one rank (sp == 1).
    With resume (`megablu eval`, one process), each finished cell is kept in step_<step>.<key>.json.partial,
    and a cell found there for the same model, setup and prompts (_resume_key, the cell's digest) is not run
    again: an eval cut short goes on where it stopped (docs/EVAL.md). The result lists such cells under
    "resumed"; the partial file is removed once step_<step>.json is written.
    """
    out_dir = Path(out_dir)
    check_lengths(eval_cfg, window)
    vocab = _vocab_checked(model, tokenizer)
    if haystack is None and eval_cfg.haystack and any(needs_text_haystack(eval_cfg.spec(t)) for t in eval_cfg.tasks):
        haystack = load_haystack(eval_cfg.haystack, tokenizer)
    gate_parent = parent
    if gate_parent is None and eval_cfg.gate.parent:
        gate_parent = results.load_result(eval_cfg.gate.parent)  # fail before hours of generation, not after
    prompts = build_prompts(eval_cfg, tokenizer, haystack=haystack, vocab_size=vocab)
    # a result already there is added to, never replaced by another model's (checked on every rank: the
    # run dir is shared, and all raise together)
    prev = _previous_result(
        out_dir,
        step,
        {
            "arm": arm or out_dir.parent.name,
            "eval": eval_cfg.model_dump(mode="json"),
            "tokenizer": tokenizer.identity,
            **_model_info(model),
            **(info or {}),
        },
    )
    from .loss import loss_inputs, loss_sets

    # every held-out set (eval.loss.data and eval.loss.sets), read and checked before any generation
    loss_data = {name: loss_inputs(eval_cfg, tokenizer, name, spec) for name, spec in loss_sets(eval_cfg).items()}
    sp = torch.distributed.get_world_size(sp_group) if sp_group is not None else 1
    string = _string_checked(eval_cfg, sp)
    device = next(model.parameters()).device
    # the STRING kernel asked for at the start (eval.string.kernel, resolved here, before the model is
    # touched); string_kernels_used says what ran (flex can fall back to sdpa)
    string_kernel = string_impl(device, 2, string.kernel) if string is not None else None
    state = _resume_state(
        resume,
        sp,
        dp_group,
        out_dir,
        step,
        prompts,
        lambda: _resume_key(
            model, tokenizer, eval_cfg, window, step, arm, batch_tokens, prefill_chunk, info, string_kernel
        ),
    )

    was_training = model.training
    model.eval()
    kernels_used(model, reset=True)
    prev_string = apply_string(model, None)  # installed per cell below: the authors' S follows the length
    try:
        cells, samples = _run_cells(
            model,
            tokenizer,
            eval_cfg,
            prompts,
            state,
            step=step,
            rank=rank,
            string=string,
            sp_group=sp_group,
            dp_group=dp_group,
            batch_tokens=batch_tokens,
            prefill_chunk=prefill_chunk,
            device=device,
        )
        losses = _run_losses(model, loss_data, eval_cfg, step=step, rank=rank, sp_group=sp_group, dp_group=dp_group)
        loss = losses.pop(None, None)
    finally:
        string_used = kernels_used(model, reset=True)  # attention calls per kernel (plain: no distance reached S)
        apply_string(model, prev_string)
        if was_training:
            model.train()

    if prev is not None:
        cells, samples, loss, losses = _merge_previous(prev, cells, samples, loss, losses)
        log.info(
            "eval: %s's cells at other lengths or tasks are kept in %s", prev.get("arm"), out_dir / f"step_{step}.json"
        )
    res = results.make_result(
        cells,
        samples,
        arm=arm or out_dir.parent.name,
        step=step,
        window=window,
        eval_cfg=eval_cfg,
        tokenizer_identity=tokenizer.identity,
        sp=sp,
        extra={
            **_model_info(model),
            **(info or {}),
            **({"loss": loss} if loss else {}),
            **({"loss_sets": losses} if losses else {}),
            **({"string_kernel": string_kernel, "string_kernels_used": string_used} if string is not None else {}),
            **({"resumed": state.resumed} if state.resumed else {}),
        },
    )
    if gate_parent is not None:
        from .gate import check_gate

        res["gate"] = check_gate(res, gate_parent, eval_cfg.gate).as_dict()
        if rank == 0:
            (log.info if res["gate"]["passed"] else log.error)("%s", res["gate"]["message"])
    if rank == 0:
        _write(res, out_dir, step, plot, state)
    return res


def _sample(task: str, L: int, p: Prompt, text: str) -> dict:
    sc, found = score(text, p)
    x = {
        "task": task,
        "length": L,
        "index": p.index,
        "answer": p.answer,
        "got": extract_answer(text) if p.scoring == "exact" else text.strip()[:200],
        "output": text,
        "correct": sc == 1.0,
        "score": sc,
        "depth": None if p.depth is None else round(p.depth, 4),
    }
    if p.answers:  # several answers: which were found, where each one was
        x.update(answers=list(p.expected), found=found, depths=list(p.answer_depths))
    return x


def load_haystack(path: str, tokenizer: TokenizerLike) -> HaystackSource:
    """The val documents of the dataset at `path` ('DIR' or 'DIR@b2'), via megablu.data.haystack.

    Checked now (tokenizer identity, non-empty bucket), read lazily by the needle builder."""
    from ..data.haystack import haystack_source
    from ..data.shards import DataError

    try:
        return haystack_source(path, tokenizer)
    except DataError as e:
        raise EvalError(f"eval.haystack={path!r}: {e}") from None
