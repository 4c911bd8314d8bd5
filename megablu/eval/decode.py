"""The decode loop of greedy generation: each row's last token fed back until max_new tokens or its stop.

A row is done once it has emitted any of stop_ids; from then on its output is stop_ids[0] (scoring cuts at a
row's first stop, generate.cut_at_stop, so nothing it reads changes). Three ways to run the steps, the same
tokens (tests/eval/test_decode.py):

- "eager": the model's forward over the cache as it grows (StaticKVCache views (B, n, Hkv, D), SDPA over the
  n keys). Rows that are done leave the batch (their cache rows too) and the loop ends when none is left;
  it reads `done` on the host every step. The only way under sequence parallelism.
- "static": every step has the same shapes: the cache's whole buffers (B, capacity, Hkv, D) with a mask
  of the positions filled (KVCache.attn_mask), and the position, the fed token, the output and `done`
  in device buffers that the step updates itself. Rows stay in the batch (a fixed B); a done row is fed
  stop_ids[0] and its output stays stop_ids[0].
- "graph": static, captured once per batch as a CUDA graph after WARM real steps and replayed, `done`
  read every CHECK_EVERY steps. A small model's decode step is launch-bound: SmolLM2-135M's is ~30 layers
  x ~20 kernels of a few microseconds of work each, while its 32k KV cache (30 layers x 2 x 32k x 3 kv heads
  x 64 x 2 bytes = 0.75 GB) reads in ~0.3 ms at HBM speed; a replay launches the whole step at once.

"auto" (what greedy_generate runs by default): graph on CUDA for a plain BluModel (one rank, no STRING, no
sliding-window layer, LocalAttention kernels) when there are more than WARM steps to run, eager otherwise.
A capture that fails (an op of the model that a graph cannot hold) falls back to static steps with a warning.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from ..model.decoder import BluModel, LocalAttention
from ..model.string import installed

log = logging.getLogger(__name__)

MODES = ("auto", "eager", "static", "graph")
WARM = 2            # real steps run before the capture (cuBLAS/SDPA workspaces and lazy inits happen there)
CHECK_EVERY = 8     # graph replays between two host reads of `done` (each read waits for the GPU)
_warned: set = set()


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"greedy_generate: decode={mode!r} is not one of {MODES}")


def graph_problem(model, cache) -> Optional[str]:
    """Why a shape-stable step (static or graph) cannot run this model and cache (None: it can)."""
    if not isinstance(model, BluModel):
        return f"the model is a {type(model).__name__}, not a BluModel"
    if not hasattr(cache, "begin_steps"):     # generate.StaticKVCache (which imports this module)
        return f"the cache is a {type(cache).__name__}, not a StaticKVCache with fixed-size buffers"
    if installed(model) is not None:
        return "STRING attention is installed (its shifted keys are indexed by position)"
    for layer in model.layers:
        core = layer.self_attn.core
        if type(core) is not LocalAttention:
            return f"attention kernel {type(core).__name__} (a wrapped kernel, e.g. Ulysses)"
        if core.window is not None:
            return "a sliding-window layer (model.sliding_layers)"
    return None


def resolve_mode(mode: str, model, cache, steps: int, one_rank: bool) -> str:
    """The mode `mode` runs as for this model, cache and number of decode steps (auto's rule: module doc)."""
    if mode == "eager" or (mode == "auto" and (not one_rank or steps <= WARM)):
        return "eager"
    if not one_rank:
        raise ValueError(f"decode={mode!r} runs on one rank; under sequence parallelism decode is eager")
    problem = graph_problem(model, cache)
    if mode == "auto":
        dev = next(model.parameters()).device
        return "graph" if problem is None and dev.type == "cuda" else "eager"
    if problem is not None:
        raise ValueError(f"decode={mode!r} needs a shape-stable step: {problem}; use decode='eager'")
    if mode == "graph" and next(model.parameters()).device.type != "cuda":
        raise ValueError("decode='graph' captures a CUDA graph: the model is not on a GPU; use 'static' or 'eager'")
    return mode


def decode(model, tok: torch.Tensor, cache, max_new: int, stop_ids: Sequence[int], *, mode: str = "eager",
           positions: Optional[Callable] = None, agree: Optional[Callable] = None) -> torch.Tensor:
    """tok (B,): each row's first generated token (from the prefill) -> generated ids (B, max_new).

    positions(i, b) -> the (b, 1) position_ids of the i-th token fed back (None: the cache's length);
    agree(tok) -> the tokens every rank uses (sequence parallelism: the same tokens, the same `done`, the same
    rows dropped on every rank). mode: an already resolved one (resolve_mode)."""
    stops = torch.tensor(list(stop_ids), dtype=tok.dtype, device=tok.device)
    fill = int(stop_ids[0]) if len(stop_ids) else 0
    if mode == "eager":
        return _eager(model, tok, cache, max_new, stops, fill, positions or (lambda i, b: None),
                      agree or (lambda t: t))
    step = _Step(model, tok, cache, max_new, stops, fill)
    n = max_new - 1
    try:
        if mode == "graph":
            taken = _graphed(step, n)
        else:
            taken = 0
        while taken < n and not step.all_done():
            step()
            taken += 1
    finally:
        cache.end_steps(step.L + taken)
    return step.gen


def _is_stop(t: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """(B,) bool: t is one of stops (a broadcast compare: no host read, capturable)."""
    return (t[:, None] == stops).any(-1)


def _eager(model, tok, cache, max_new, stops, fill, positions, agree) -> torch.Tensor:
    B = tok.shape[0]
    gen = tok.new_full((B, max_new), fill)
    gen[:, 0] = tok
    rows = torch.arange(B, device=tok.device)       # the gen row of each row still decoding
    done = _is_stop(tok, stops)
    for i in range(1, max_new):
        if stops.numel():
            n_done = int(done.sum())
            if n_done == len(rows):
                break
            if n_done:                              # drop the done rows: their output is fill from here on
                keep = (~done).nonzero().squeeze(1)
                rows, tok = rows[keep], tok[keep]
                cache.keep_rows(keep)
        logits = model(tok[:, None], position_ids=positions(i - 1, len(rows)), cache=cache)
        tok = agree(logits[:, -1].argmax(-1).contiguous())
        gen[rows, i] = tok
        done = _is_stop(tok, stops)
    return gen


class _Step:
    """One decode step of fixed shapes over a StaticKVCache in step mode. Its state lives in device buffers
    that the step itself updates (fed token, position, output column, done), so replaying a captured graph
    of it is the whole step."""

    def __init__(self, model, tok, cache, max_new: int, stops: torch.Tensor, fill: int):
        dev, B = tok.device, tok.shape[0]
        self.model, self.cache, self.stops, self.fill = model, cache, stops, fill
        self.L = cache._n[0]                                          # positions filled by the prefill
        self.tok = tok.clone()
        self.pos = torch.full((1,), self.L, dtype=torch.long, device=dev)
        self.col = torch.ones(1, dtype=torch.long, device=dev)        # the gen column the next token goes to
        self.keys = torch.arange(cache.capacity, device=dev)
        self.gen = tok.new_full((B, max_new), fill)
        self.gen[:, 0] = tok
        self.done = _is_stop(tok, stops)
        if cache.rope_len is not None and not isinstance(cache.rope_len, torch.Tensor):
            # the same lengths as a (B,) device tensor: the model reads it every step without a host copy
            cache.rope_len = torch.full((B,), int(cache.rope_len), dtype=torch.long, device=dev)
        cache.begin_steps(self.pos)

    def __call__(self) -> None:
        B = self.tok.shape[0]
        self.cache.attn_mask = (self.keys <= self.pos).view(1, 1, 1, -1)   # positions 0..pos exist
        logits = self.model(self.tok[:, None], position_ids=self.pos.view(1, 1).expand(B, 1), cache=self.cache)
        nxt = logits[:, -1].argmax(-1)
        if self.stops.numel():
            nxt = torch.where(self.done, self.fill, nxt)             # a done row's output stays fill
            self.done |= _is_stop(nxt, self.stops)
        self.gen.index_copy_(1, self.col, nxt[:, None])
        self.tok.copy_(nxt)
        self.pos += 1
        self.col += 1

    def all_done(self) -> bool:
        return bool(self.stops.numel()) and bool(self.done.all())


def _graphed(step: _Step, n: int) -> int:
    """Run up to n steps: WARM real ones on a side stream, then a captured graph replayed (`done` read every
    CHECK_EVERY). -> the steps taken; a capture that fails leaves the rest to the caller (static steps)."""
    taken = 0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm-up off the capture stream, as torch.cuda.graphs asks
        while taken < min(WARM, n):
            step()
            taken += 1
    torch.cuda.current_stream().wait_stream(side)
    if taken >= n or step.all_done():
        return taken
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()                                # recorded, not run: the state is where the warm-up left it
    except Exception as e:   # an op the graph cannot hold: the same steps, uncaptured
        key = (type(e).__name__, str(e)[:200])
        if key not in _warned:
            _warned.add(key)
            log.warning("decode: CUDA graph capture failed (%s: %s); decoding with uncaptured static steps",
                        type(e).__name__, e)
        return taken
    while taken < n:
        graph.replay()
        taken += 1
        if taken % CHECK_EVERY == 0 and step.all_done():
            break
    torch.cuda.current_stream().synchronize()     # the last replay done before the graph and its pool go
    return taken
