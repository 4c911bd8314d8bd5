"""apply_memory(model, cfg.memory): the memory switches installed on a built BluModel, in place.

The model (model/decoder.py) is architecture only: a block's forward is the plain
attention + MLP computation. What this file installs, per switch:
- ops (auto | torch | cuda): the `impl` every module passes to megablu.ops;
- loss_chunk: the head's vocab chunk (ops/cross_entropy.py);
- loss (auto | chunked | liger): the head's loss implementation (ops/cross_entropy.py); auto is
  resolved here, once, for the run's device (resolve_loss: liger on CUDA when liger_kernel imports,
  else chunked), and the head holds the implementation that runs;
- attention (auto | sdpa | fa4): every LocalAttention's causal kernel (ops/attention.py), also one that
  Ulysses wraps (applied before or after apply_ulysses: the wrapper keeps the LocalAttention); auto
  picks per call, by the tensors (ops/attention.py auto_kernel);
- mlp_tiles = n: each MLP's forward runs over n sequence tiles (tiled.py);
- recompute and offload_activations: each block's forward is wrapped (`_BlockForward`):
    none       the plain forward;
    selective  attention's inputs and outputs stay saved (attention is never recomputed); the
               second norm, the MLP and its (B, T, ffn) intermediates are recomputed from h;
    full       the whole block is recomputed from its input (a checkpoint per block);
  with offload, every block but the last `keep_last` (memory.offload_keep), or an evenly spread
  memory.offload_fraction of them, runs inside the offload's saved-tensor
  hooks (offload.py), and its checkpoints are reentrant, which saves their inputs with
  save_for_backward where the hooks see them (the non-reentrant checkpoint holds them by
  Python reference, on the GPU).
Only training forwards (grad enabled, no KV cache) recompute or offload; inference runs the
plain forward (tiled when tiles > 1). Parameter names are unchanged: nothing is wrapped in a
new module, the switches are the forwards of the existing ones.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, TypeVar, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config.schema import MemoryConfig
from ..model.decoder import Block, LocalAttention
from ..ops.cross_entropy import resolve_loss
from .offload import ActivationOffload
from .tiled import tiled


class _TiledForward:
    """An MLP's forward over `tiles` sequence tiles: one (rows, ffn) tile alive at a time."""

    def __init__(self, mlp: nn.Module, tiles: int):
        self.mlp, self.tiles = mlp, tiles
        self.dense = functools.partial(type(mlp).forward, mlp)  # the untiled forward

    def __call__(self, x):
        return tiled(self.dense, x, self.tiles, self.mlp.parameters())


class _BlockForward:
    """A block's forward under the recompute mode and the model's activation offload."""

    def __init__(self, model: Any, index: int, recompute: str, tiles: int):
        # model: a BluModel with `offload` installed by apply_memory (not in its class)
        self.model, self.index, self.recompute, self.tiles = model, index, recompute, tiles
        block = cast(Block, model.layers[index])
        self.block = block
        self.plain = functools.partial(type(block).forward, block)
        self.dense = functools.partial(type(block.mlp).forward, block.mlp)  # the untiled MLP

    def __call__(self, x, cos, sin, cache=None, docs=None):
        # read at call time: tests swap model.offload for one that copies on CPU
        off = self.model.offload if cache is None and torch.is_grad_enabled() else None
        if off is None:
            return self._run(x, cos, sin, cache, docs, reentrant=False)
        n = len(self.model.layers)
        if self.index == 0:
            off.begin()
        if off.offloads(self.index, n):
            # cos/sin and the doc mask are shared by every layer: saved by reference, not copied per layer
            keep = (cos, sin, *(docs.tensors() if docs is not None else ()))
            with off.block(self.block, keep=keep):
                h = self._run(x, cos, sin, cache, docs, reentrant=True)
        else:
            h = self._run(x, cos, sin, cache, docs, reentrant=False)
        if self.index == n - 1:
            off.end()
        return h

    def _mlp_part(self, h):
        return h + self.block.ffn(h)

    def _norm_mlp(self, h):
        """Row-wise: the MLP branch with the untiled MLP (the function tiled under selective)."""
        return self.block.ffn(h, self.dense)

    def _run(self, x, cos, sin, cache, docs, reentrant: bool):
        """`docs`: document-causal attention (the same DocMask for every layer, also when recomputed)."""
        b = self.block
        train = cache is None and torch.is_grad_enabled()
        if self.recompute == "full" and train:
            return checkpoint(self.plain, x, cos, sin, None, docs, use_reentrant=reentrant)
        if self.recompute == "selective" and train:
            # attention's inputs/outputs stay saved (attention is never recomputed); the
            # second norm, the MLP and its (B, T, ffn) intermediates are recomputed from h.
            h = b.attend(x, cos, sin, None, docs)
            if self.tiles > 1:
                # the tiled MLP already rebuilds its tiles from its saved input: tiling the
                # norm with it saves exactly h, with no checkpoint and no third MLP forward
                ps = (*(n.weight for n in b.ffn_norms), *b.mlp.parameters())
                return h + tiled(self._norm_mlp, h, self.tiles, ps)
            return checkpoint(self._mlp_part, h, use_reentrant=reentrant)
        return self.plain(x, cos, sin, cache, docs)


_Model = TypeVar("_Model", bound=nn.Module)


def apply_memory(
    model: _Model,
    memory: Optional[MemoryConfig] = None,
    offload: Optional[ActivationOffload] = None,
    device: Optional[str] = None,
) -> _Model:
    """Install `memory` (a MemoryConfig; None = the defaults) on a BluModel, in place; returns it.

    offload: the ActivationOffload to use when memory.offload_activations (default: a new one);
    `model.offload` holds it (None when off) and is read at every forward.
    device: where the model will run ("cuda" | "cpu"), for memory.loss=auto; default: where its
    parameters are now (the trainer and the eval build on the CPU and move the model later: they pass it).
    `model.lm_head.loss` is the loss implementation that runs (auto resolved).
    """
    memory = memory or MemoryConfig()
    blu: Any = model  # a BluModel: what this installs on it (memory, offload, forwards) is not in its class
    if getattr(model, "memory", None) is not None:
        raise RuntimeError("apply_memory called twice on the same model")
    for m in model.modules():
        if hasattr(m, "impl"):  # auto: fused CUDA ops on GPU when built, pure torch otherwise
            cast(Any, m).impl = memory.ops
    blu.lm_head.chunk = memory.loss_chunk
    blu.lm_head.loss = resolve_loss(memory.loss, device or next(model.parameters()).device.type)
    for m in model.modules():
        if isinstance(m, LocalAttention):
            m.kernel = memory.attention
    # saved activations of every block to pinned host memory (training steps only)
    blu.offload = None
    if memory.offload_activations:
        blu.offload = offload or ActivationOffload(keep_last=memory.offload_keep, fraction=memory.offload_fraction)
    for i, block in enumerate(blu.layers):
        if memory.mlp_tiles > 1:
            block.mlp.forward = _TiledForward(block.mlp, memory.mlp_tiles)
        if memory.recompute != "none" or memory.offload_activations:
            block.forward = _BlockForward(model, i, memory.recompute, memory.mlp_tiles)
    blu.memory = memory
    return model
