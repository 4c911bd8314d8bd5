"""run_eval: build the seeded prompts, generate, score, summarise, gate, write step_<N>.json.

The trainer's auto-eval and `megablu eval` both call `run_eval`. Under sequence parallelism
every rank of the sp group must call it (generation is collective); only global rank 0
writes. Everything that would make the result meaningless -- no tokenizer, no lengths, a
length that breaks the PAD rule, a needle task without a haystack, zero prompts, token ids
outside the model's vocabulary -- raises EvalError before any generation starts.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import torch

from ..config.schema import EvalConfig, eval_padded_len
from .generate import cut_at_eot, greedy_generate
from .needle import Haystack, NeedleBuilder
from .passkey import PasskeyBuilder
from .prompts import EvalError, HaystackSource, Prompt, TokenizerLike, check_ids, is_correct, extract_answer
from . import report

log = logging.getLogger(__name__)


def check_lengths(eval_cfg: EvalConfig, window: int) -> None:
    """The seed's PAD rule: prompt + max_new rounded up to pad must fit the window."""
    if not eval_cfg.lengths:
        raise EvalError("eval.lengths is empty: nothing to evaluate")
    bad = []
    for L in eval_cfg.lengths:
        padded = eval_padded_len(L, eval_cfg.max_new, eval_cfg.pad)
        if padded > window:
            bad.append(f"{L} + max_new {eval_cfg.max_new} pads to {padded} at pad {eval_cfg.pad} > window {window}")
    if bad:
        fit = (window // eval_cfg.pad) * eval_cfg.pad - eval_cfg.max_new
        raise EvalError("eval lengths do not fit the window: " + "; ".join(bad) + f"; the longest that fits is {fit}")


def min_lengths(eval_cfg: EvalConfig, tokenizer: TokenizerLike) -> dict[str, int]:
    """{task: the shortest eval length its prompts fit in with this tokenizer} (the prompt without
    filler or haystack); a shorter length raises EvalError in `build_prompts`. No haystack needed."""
    out = {}
    for task in dict.fromkeys(eval_cfg.tasks):
        b = (PasskeyBuilder(tokenizer, eval_cfg.seed, eval_cfg.n) if task == "passkey" else
             NeedleBuilder(task, tokenizer, eval_cfg.seed, eval_cfg.n, haystack=None))
        out[task] = b.min_length()
    return out


def build_prompts(eval_cfg: EvalConfig, tokenizer: TokenizerLike, *, haystack: Optional[HaystackSource] = None,
                  vocab_size: Optional[int] = None) -> dict[tuple[str, int], list[Prompt]]:
    """{(task, length): [Prompt] * n}, identical for every arm that shares tokenizer and config."""
    if tokenizer is None:
        raise EvalError("no tokenizer: the eval cannot build prompts (the seed's eval 'succeeded' with no prompts "
                        "when its tokenizer was missing); configure `tokenizer:` and check it loads")
    lengths = sorted(set(eval_cfg.lengths))
    builders, hay = {}, None
    for task in dict.fromkeys(eval_cfg.tasks):
        if task == "passkey":
            builders[task] = PasskeyBuilder(tokenizer, eval_cfg.seed, eval_cfg.n)
        else:
            if haystack is None:
                raise EvalError(f"task {task!r} needs a real-text haystack: set eval.haystack (a dataset dir whose "
                                f"val split is the haystack) or pass haystack=")
            if hay is None:  # tokenized once, shared by needle and multikey; 2x the longest length
                hay = Haystack(haystack, tokenizer, 2 * max(lengths))  # leaves room for distinct offsets
            builders[task] = NeedleBuilder(task, tokenizer, eval_cfg.seed, eval_cfg.n, hay)
    out = {}
    for task, b in builders.items():
        for L in lengths:
            ps = [b.build(L, i) for i in range(eval_cfg.n)]
            if vocab_size is not None:
                for p in ps[:1]:
                    check_ids(p.ids, vocab_size, f"{task}@{L}")
            out[(task, L)] = ps
    if not out or not any(out.values()):
        raise EvalError(f"zero prompts built (tasks {eval_cfg.tasks}, lengths {eval_cfg.lengths}, n {eval_cfg.n}); "
                        f"refusing to write an empty report")
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


def run_eval(model, tokenizer: TokenizerLike, eval_cfg: EvalConfig, window: int, *, sp_group=None, step: int,
             out_dir: Path, rank: int, dp_group=None, haystack: Optional[HaystackSource] = None, arm: Optional[str] = None,
             parent: Optional[dict] = None, batch_tokens: int = 16384, prefill_chunk: int = 2048,
             plot: bool = True, info: Optional[dict] = None) -> dict:
    """Evaluate `model` (collective over sp_group when given); rank 0 writes out_dir/step_<step>.json.

    Also writes step_<step>.md and, when `plot`, step_<step>.png. Prompts of one length are
    batched max(1, batch_tokens // length) at a time; prefill runs in prefill_chunk-token
    chunks on one rank. Returns the result dict on every rank. When eval.gate.parent is set (or `parent`, a loaded
    result, is passed), result["gate"] holds the short-context gate; callers fail the run when
    result["gate"]["passed"] is False (`megablu eval` exits 1). With dp_group (the ranks that
    share this rank's sp position across data-parallel groups), each dp group generates every
    dp-th prompt and the samples are gathered: the same result, dp times sooner.
    """
    out_dir = Path(out_dir)
    check_lengths(eval_cfg, window)
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if tokenizer is not None and vocab is not None and tokenizer.vocab_size > vocab:
        raise EvalError(f"tokenizer {tokenizer.identity} has {tokenizer.vocab_size} ids > model vocab {vocab}")
    if haystack is None and eval_cfg.haystack and any(t != "passkey" for t in eval_cfg.tasks):
        haystack = load_haystack(eval_cfg.haystack, tokenizer)
    gate_parent = parent
    if gate_parent is None and eval_cfg.gate.parent:
        gate_parent = report.load_result(eval_cfg.gate.parent)   # fail before hours of generation, not after
    prompts = build_prompts(eval_cfg, tokenizer, haystack=haystack, vocab_size=vocab)
    sp = torch.distributed.get_world_size(sp_group) if sp_group is not None else 1

    was_training = model.training
    model.eval()
    samples, cells = [], []
    try:
        dp = torch.distributed.get_world_size(dp_group) if dp_group is not None else 1
        dp_rank = torch.distributed.get_rank(dp_group) if dp_group is not None else 0
        for (task, L), ps in prompts.items():
            t0 = time.perf_counter()
            bs = max(1, batch_tokens // L)
            mine, done = ps[dp_rank::dp], []
            for s in range(0, len(mine), bs):
                batch = mine[s:s + bs]
                ids = torch.tensor([p.ids for p in batch], dtype=torch.long)
                gen = greedy_generate(model, ids, eval_cfg.max_new, sp_group=sp_group,
                                      prefill_chunk=prefill_chunk).tolist()
                for p, g in zip(batch, gen):
                    text = tokenizer.decode(cut_at_eot(g, tokenizer.eot_id))
                    ok = is_correct(text, p.answer)
                    done.append({"task": task, "length": L, "index": p.index, "answer": p.answer,
                                 "got": extract_answer(text), "output": text, "correct": bool(ok),
                                 "depth": round(p.depth, 4)})
            if dp > 1:   # every dp group's share, back in prompt order
                parts = [None] * dp
                torch.distributed.all_gather_object(parts, done, group=dp_group)
                order = {p.index: i for i, p in enumerate(ps)}
                done = sorted((x for part in parts for x in part), key=lambda x: order[x["index"]])
            samples += done
            n_ok = sum(x["correct"] for x in done)
            dt = time.perf_counter() - t0
            cells.append(report.cell(task, L, done, eval_cfg, ps, dt))
            if rank == 0:
                log.info("eval step %d %s@%d: %d/%d correct (%.1f%%) in %.1fs", step, task, L, n_ok, len(ps),
                         100 * n_ok / len(ps), dt)
    finally:
        if was_training:
            model.train()

    res = report.make_result(cells, samples, arm=arm or out_dir.parent.name, step=step, window=window,
                             eval_cfg=eval_cfg, tokenizer_identity=tokenizer.identity, sp=sp,
                             extra={**_model_info(model), **(info or {})})
    if gate_parent is not None:
        from .gate import check_gate

        res["gate"] = check_gate(res, gate_parent, eval_cfg.gate).as_dict()
        if rank == 0:
            (log.info if res["gate"]["passed"] else log.error)("%s", res["gate"]["message"])
    if rank == 0:
        path = report.write_result(res, out_dir / f"step_{step}.json")
        report.write_artifacts(res, out_dir, step, plot=plot)
        log.info("eval results written to %s", path)
    return res


def load_haystack(path: str, tokenizer: TokenizerLike) -> HaystackSource:
    """The val documents of the dataset at `path` ('DIR' or 'DIR@b2'), via megablu.data.haystack.

    Checked now (tokenizer identity, non-empty bucket), read lazily by the needle builder."""
    from ..data.haystack import haystack_source
    from ..data.shards import DataError

    try:
        return haystack_source(path, tokenizer)
    except DataError as e:
        raise EvalError(f"eval.haystack={path!r}: {e}") from None
