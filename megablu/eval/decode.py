"""The decode loop of greedy generation: each row's last token fed back until max_new tokens or its stop.

A row is done once it has emitted any of stop_ids; from then on its output is stop_ids[0] (scoring cuts at a
row's first stop, generate.cut_at_stop, so nothing it reads changes). Three ways to run the steps, the same
tokens (tests/eval/test_decode.py):

- "eager": the model's forward over the cache as it grows (StaticKVCache views (B, n, Hkv, D), SDPA over the
  n keys). Rows that are done leave the batch (their cache rows too) and the loop ends when none is left;
  it reads `done` on the host every step. The only way under sequence parallelism. (A smaller batch runs
  its matrix products at another shape: on a GPU in bf16 a kernel chosen for that shape may round a
  remaining row's logits differently, so a near-tie could go the other way than in the full batch.)
- "static": every kernel but the attention has the same shapes at every step: the position, the fed token,
  the output and `done` live in device buffers that the step updates itself, and the cache writes each new
  key at the device position (StaticKVCache.begin_steps). The attention runs between them exactly as
  LocalAttention runs it (the same views of the n filled keys, the same SDPA call). Rows stay in the batch
  (a fixed B, so the kernels are the full batch's at every step); a done row is fed stop_ids[0] and its
  output stays it.
- "graph": static, the step captured once per batch after WARM uncaptured steps, as len(layers) + 1 CUDA
  graphs, one ending at each layer's attention, and replayed with the attentions between them (piecewise, as
  vLLM captures around attention); `done` read every CHECK_EVERY steps, so the host runs ahead of the GPU.
  A small model's eager step is bound by the host: SmolLM2-135M's is 30 layers x ~15 kernels of a few
  microseconds of work each, launched one by one, then a wait for `done`. Its KV cache, 30 layers x 2 x L
  x 3 kv heads x 64 x 2 bytes per row (0.75 GB at 32k), is what a step must read at HBM speed whatever
  the mode.

"auto" (what greedy_generate runs by default): graph on CUDA for a BluModel whose attention kernels are
LocalAttention (one rank, no STRING), with no forward hook and no ZeRO-3 partitioned parameter, when there
are at least MIN_STEPS steps to run; eager otherwise. A capture that fails (an op of the model that a graph
cannot hold) falls back to uncaptured static steps with a warning. The graph path's token equality with
eager is a GPU fact that CPU tests cannot show: the CUDA tests of tests/eval/test_decode.py check it, and
bench/eval_decode.py reports the agreement beside the speed (docs/BENCHMARKS.md). AUTO_GRAPH = False makes
auto eager again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Optional, cast

import torch
from torch import nn

from ..model.decoder import BluModel, LocalAttention
from ..model.string import installed

log = logging.getLogger(__name__)

MODES = ("auto", "eager", "static", "graph")
WARM = 2  # real steps run before the capture (cuBLAS/SDPA workspaces and lazy inits happen there)
CHECK_EVERY = 8  # graph replays between two host reads of `done` (each read waits for the GPU)
AUTO_GRAPH = True  # module doc: auto picks graph where it can run
MIN_STEPS = 16  # auto captures a graph only for this many decode steps or more: a capture costs a few steps
_warned: set = set()


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"greedy_generate: decode={mode!r} is not one of {MODES}")


def graph_problem(model, cache) -> Optional[str]:
    """Why a static or graph step cannot run this model and cache (None: it can)."""
    if not isinstance(model, BluModel):
        return f"the model is a {type(model).__name__}, not a BluModel"
    if not hasattr(cache, "begin_steps"):  # generate.StaticKVCache (which imports this module)
        return f"the cache is a {type(cache).__name__}, not a StaticKVCache with fixed-size buffers"
    if installed(model) is not None:
        return "STRING attention is installed (its shifted keys are indexed by position)"
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return "ZeRO-3 partitioned parameters (gathered by hooks at each forward)"
    hooked = [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    if hooked:  # a hook's work (or its host-side state) would be recorded once and replayed blindly
        return f"forward hooks on {', '.join(n or 'the model' for n in hooked[:3])}"
    for layer in model.layers:
        core = cast(Any, layer).self_attn.core
        if type(core) is not LocalAttention:
            return f"attention kernel {type(core).__name__} (a wrapped kernel, e.g. Ulysses)"
    return None


def resolve_mode(mode: str, model, cache, steps: int, one_rank: bool) -> str:
    """The mode `mode` runs as for this model, cache and number of decode steps (auto's rule: module doc)."""
    if mode == "eager" or (mode == "auto" and (not one_rank or steps < MIN_STEPS)):
        return "eager"
    if not one_rank:
        raise ValueError(f"decode={mode!r} runs on one rank; under sequence parallelism decode is eager")
    problem = graph_problem(model, cache)
    if mode == "auto":
        dev = next(model.parameters()).device
        return "graph" if AUTO_GRAPH and problem is None and dev.type == "cuda" else "eager"
    if problem is not None:
        raise ValueError(f"decode={mode!r} cannot run here: {problem}; use decode='eager'")
    if mode == "graph" and next(model.parameters()).device.type != "cuda":
        raise ValueError("decode='graph' captures a CUDA graph: the model is not on a GPU; use 'static' or 'eager'")
    return mode


def decode(
    model,
    tok: torch.Tensor,
    cache,
    max_new: int,
    stop_ids: Sequence[int],
    *,
    mode: str = "eager",
    positions: Optional[Callable] = None,
    agree: Optional[Callable] = None,
) -> torch.Tensor:
    """tok (B,): each row's first generated token (from the prefill) -> generated ids (B, max_new).

    positions(i, b) -> the (b, 1) position_ids of the i-th token fed back (None: the cache's length);
    agree(tok) -> the tokens every rank uses (sequence parallelism: the same tokens, the same `done`, the same
    rows dropped on every rank). mode: an already resolved one (resolve_mode)."""
    stops = torch.tensor(list(stop_ids), dtype=tok.dtype, device=tok.device)
    fill = int(stop_ids[0]) if len(stop_ids) else 0
    if mode == "eager":
        return _eager(model, tok, cache, max_new, stops, fill, positions or (lambda i, b: None), agree or (lambda t: t))
    step = _Step(model, tok, cache, max_new, stops, fill)
    n = max_new - 1
    try:
        taken = _graphed(step, n) if mode == "graph" else 0
        while taken < n and not step.all_done():
            step()
            taken += 1
    finally:
        step.close()
    return step.gen


def _is_stop(t: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """(B,) bool: t is one of stops (a broadcast compare: no host read, capturable)."""
    return (t[:, None] == stops).any(-1)


def _eager(model, tok, cache, max_new, stops, fill, positions, agree) -> torch.Tensor:
    B = tok.shape[0]
    gen = tok.new_full((B, max_new), fill)
    gen[:, 0] = tok
    rows = torch.arange(B, device=tok.device)  # the gen row of each row still decoding
    done = _is_stop(tok, stops)
    for i in range(1, max_new):
        if stops.numel():
            n_done = int(done.sum())
            if n_done == len(rows):
                break
            if n_done:  # drop the done rows: their output is fill from here on
                keep = (~done).nonzero().squeeze(1)
                rows, tok = rows[keep], tok[keep]
                cache.keep_rows(keep)
        logits = model(tok[:, None], position_ids=positions(i - 1, len(rows)), cache=cache)
        tok = agree(logits[:, -1].argmax(-1).contiguous())
        gen[rows, i] = tok
        done = _is_stop(tok, stops)
    return gen


class _Attend(nn.Module):
    """Stands in for a layer's LocalAttention while _Step runs (installed and removed by it, the way
    apply_ulysses swaps the kernel from outside): appends the token at the step's device position, then hands
    the attention to the step, which runs it over the filled part exactly as LocalAttention does."""

    def __init__(self, local: LocalAttention, step: _Step):
        super().__init__()
        self.local, self.step = local, step

    def forward(self, q, k, v, cache=None, docs=None):
        kb, vb = cache.append(self.local.layer_idx, k, v)  # the whole buffers (B, capacity, Hkv, D)
        return self.step.attend(self.local, q, kb, vb)


def _attend_now(local: LocalAttention, q, kb, vb, n: int):
    """LocalAttention.forward's cache path after its append: the same views (B, n, Hkv, D), the same call."""
    k, v = kb[:, :n], vb[:, :n]
    return local._windowed(q, k, v) if local.window is not None else local._plain(q, k, v)


class _Step:
    """One decode step whose every kernel but the attention has the same shapes at each step: its state lives in
    device buffers that the step itself updates (fed token, position, output column, done) and the cache writes
    each new key at the device position. The attention over the n filled keys (n known on the host) runs as
    LocalAttention runs it, so the tokens are today's. capture() records the rest as len(layers) + 1 CUDA graphs,
    one ending at each layer's attention; replay() runs them with each attention in between."""

    def __init__(self, model, tok, cache, max_new: int, stops: torch.Tensor, fill: int):
        dev, B = tok.device, tok.shape[0]
        self.model, self.cache, self.stops, self.fill = model, cache, stops, fill
        self.L = cache.length  # positions filled by the prefill
        self.n = self.L + 1  # keys the next step attends to
        self.tok = tok.clone()
        self.pos = torch.full((1,), self.L, dtype=torch.long, device=dev)
        self.col = torch.ones(1, dtype=torch.long, device=dev)  # the gen column the next token goes to
        self.gen = tok.new_full((B, max_new), fill)
        self.gen[:, 0] = tok
        self.done = _is_stop(tok, stops)
        self.capturing: Optional[list] = None  # during capture: (local, q, kb, vb, out)
        self.graphs: list = []
        self.pieces: list = []
        if cache.rope_len is not None and not isinstance(cache.rope_len, torch.Tensor):
            # the same lengths as a (B,) device tensor: the model reads it every step without a host copy
            cache.rope_len = torch.full((B,), int(cache.rope_len), dtype=torch.long, device=dev)
        cache.begin_steps(self.pos)
        self.locals = [layer.self_attn.core for layer in model.layers]
        for layer, local in zip(model.layers, self.locals, strict=True):
            layer.self_attn.core = _Attend(local, self)

    def close(self) -> None:
        """The model's own kernels back; the cache holds the prompt and the tokens fed back."""
        for layer, local in zip(self.model.layers, self.locals, strict=True):
            layer.self_attn.core = local
        self.graphs, self.pieces = [], []
        self.cache.end_steps(self.n - 1)

    def attend(self, local, q, kb, vb):
        if self.capturing is None:
            return _attend_now(local, q, kb, vb, self.n)
        # capturing: the segment that made q (and wrote k, v) ends here; replay() runs the attention after it
        self.graphs[-1].capture_end()
        out = q.new_empty(*q.shape[:3], vb.shape[-1])  # (B, 1, H, D), outside the graphs' pool
        self.capturing.append((local, q, kb, vb, out))
        self._begin()
        return out

    def __call__(self) -> None:
        B = self.tok.shape[0]
        logits = self.model(self.tok[:, None], position_ids=self.pos.view(1, 1).expand(B, 1), cache=self.cache)
        nxt = logits[:, -1].argmax(-1)
        if self.stops.numel():
            nxt = torch.where(self.done, self.fill, nxt)  # a done row's output stays fill
            self.done |= _is_stop(nxt, self.stops)
        self.gen.index_copy_(1, self.col, nxt[:, None])
        self.tok.copy_(nxt)
        self.pos += 1
        self.col += 1
        if self.capturing is None:
            self.n += 1

    def _begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (NCCL's watchdog under dp) do not break the capture
        g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self.graphs.append(g)

    def capture(self) -> None:
        """Record one step (nothing runs): the segments share one memory pool and replay in capture order, so a
        tensor one segment leaves for the next keeps its address. On an error the step stays uncaptured."""
        self.pool = torch.cuda.graph_pool_handle()
        self.capturing, self.graphs = [], []
        torch.cuda.synchronize()
        try:
            self._begin()
            self()
            self.graphs[-1].capture_end()
        except BaseException:
            try:
                self.graphs[-1].capture_end()  # close the open capture, if it is still open
            except Exception:
                pass
            self.graphs = []
            raise
        finally:
            self.pieces, self.capturing = self.capturing, None

    def replay(self) -> None:
        for g, piece in zip(self.graphs, self.pieces + [None], strict=False):
            g.replay()
            if piece is not None:
                local, q, kb, vb, out = piece
                out.copy_(_attend_now(local, q, kb, vb, self.n))
        self.n += 1

    def all_done(self) -> bool:
        return bool(self.stops.numel()) and bool(self.done.all())


def _graphed(step: _Step, n: int) -> int:
    """Run up to n steps: WARM uncaptured ones on a side stream, then the captured step replayed (`done` read
    every CHECK_EVERY). -> the steps taken; a capture that fails leaves the rest to the caller (uncaptured)."""
    taken = 0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up and capture off the default stream, which cannot capture
        while taken < min(WARM, n):
            step()
            taken += 1
        if taken < n and not step.all_done():
            try:
                step.capture()
            except Exception as e:  # an op the graph cannot hold: the same steps, uncaptured
                key = (type(e).__name__, str(e)[:200])
                if key not in _warned:
                    _warned.add(key)
                    log.warning("decode: CUDA graph capture failed (%s: %s); decoding uncaptured", type(e).__name__, e)
    torch.cuda.current_stream().wait_stream(side)
    if not step.graphs:
        return taken
    while taken < n:
        step.replay()
        taken += 1
        if taken % CHECK_EVERY == 0 and step.all_done():
            break
    torch.cuda.current_stream().synchronize()  # the last replay done before the graphs and their pool go
    return taken
