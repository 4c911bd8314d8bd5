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
- fuse_qkv / fuse_gate_up: each Attention / MLP projects with one GEMM (decoder.py's flags, ops/linear.py).
  ZeRO-3 gathers a parameter around its own module's call, and the fused projection reads q_proj's, k_proj's
  and v_proj's (gate_proj's, up_proj's) weights without calling them: they are registered as external
  parameters of the Attention (MLP) that reads them (deepspeed.zero.register_external_parameter: gathered
  with the module's own in its pre-forward and pre-backward fetch; outside ZeRO-3 the registration is an
  unused attribute). DeepSpeed 0.19.8 would also gather such a weight at its first read inside a forward
  and register it then (its ZeROOrderedDict getter, one gather per weight at that read); registering
  up front puts them in the module's batched fetch from the first call and does not rely on that fallback,
  which acts only on reads inside an eager module forward (tests/memory/test_memory_switches_zero.py runs
  ZeRO-3 with every weight partitioned);
- fuse_block_add (norm_layout pre): every block but the last returns (h, mlp branch) and the next adds them
  in its input norm (decoder.Block.defer_add); the recompute modes below carry the pair across the boundary;
- recompute and offload_activations: each block's forward is wrapped (`_BlockForward`):
    none       the plain forward;
    selective  attention's inputs and outputs stay saved (attention is never recomputed); the
               second norm, the MLP and its (B, T, ffn) intermediates are recomputed from h (with
               fuse_block_add the pending add runs before attention, in the saved part, and the
               checkpoint's output is the MLP branch, added by the next block);
    full       the whole block is recomputed from its input (a checkpoint per block; the config
               refuses fuse_block_add here: the checkpoint would save the input pair, twice the bytes);
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

    def __call__(self, x, cos, sin, cache=None, docs=None, pending=None):
        # read at call time: tests swap model.offload for one that copies on CPU
        off = self.model.offload if cache is None and torch.is_grad_enabled() else None
        if off is None:
            return self._run(x, cos, sin, cache, docs, pending, reentrant=False)
        n = len(self.model.layers)
        if self.index == 0:
            off.begin()
        if off.offloads(self.index, n):
            # cos/sin and the doc mask are shared by every layer: saved by reference, not copied per layer
            keep = (cos, sin, *(docs.tensors() if docs is not None else ()))
            with off.block(self.block, keep=keep):
                h = self._run(x, cos, sin, cache, docs, pending, reentrant=True)
        else:
            h = self._run(x, cos, sin, cache, docs, pending, reentrant=False)
        if self.index == n - 1:
            off.end()
        return h

    def _norm_mlp(self, h):
        """Row-wise: the MLP branch with the untiled MLP (the function tiled under selective)."""
        return self.block.ffn(h, self.dense)

    def _run(self, x, cos, sin, cache, docs, pending, reentrant: bool):
        """`docs`: document-causal attention (the same DocMask for every layer, also when recomputed).
        `pending`: the previous block's MLP branch for this block to add (memory.fuse_block_add)."""
        b = self.block
        train = cache is None and torch.is_grad_enabled()
        if self.recompute == "full" and train:
            if pending is None:
                return checkpoint(self.plain, x, cos, sin, None, docs, use_reentrant=reentrant)
            return checkpoint(self.plain, x, cos, sin, None, docs, pending, use_reentrant=reentrant)
        if self.recompute == "selective" and train:
            # attention's inputs/outputs stay saved (attention is never recomputed); the
            # second norm, the MLP and its (B, T, ffn) intermediates are recomputed from h.
            h = b.attend(x, cos, sin, None, docs, pending)
            if self.tiles > 1:
                # the tiled MLP already rebuilds its tiles from its saved input: tiling the
                # norm with it saves exactly h, with no checkpoint and no third MLP forward
                ps = (*(n.weight for n in b.ffn_norms), *b.mlp.parameters())
                m = tiled(self._norm_mlp, h, self.tiles, ps)
            else:
                m = checkpoint(b.ffn, h, use_reentrant=reentrant)
            return (h, m) if b.defer_add else h + m
        if pending is None:
            return self.plain(x, cos, sin, cache, docs)
        return self.plain(x, cos, sin, cache, docs, pending)


_Model = TypeVar("_Model", bound=nn.Module)


def _install_fusions(blu: Any, memory: MemoryConfig) -> None:
    """memory.fuse_qkv, fuse_gate_up, fuse_block_add on a BluModel's blocks (decoder.py reads the flags)."""
    layers = list(blu.layers)
    if memory.fuse_block_add and blu.cfg.norm_layout != "pre":
        raise ValueError(
            f"memory.fuse_block_add with model.norm_layout={blu.cfg.norm_layout}: the fusion is built for the pre "
            f"layout only; set memory.fuse_block_add=false for this model"
        )
    external: list[tuple[nn.Module, list[nn.Parameter]]] = []
    for i, block in enumerate(layers):
        attn, mlp = block.self_attn, block.mlp
        if memory.fuse_qkv:
            attn.fuse_qkv = True
            projs = (attn.q_proj, attn.k_proj, attn.v_proj)
            external.append((attn, [p for lin in projs for p in lin.parameters()]))
        if memory.fuse_gate_up:
            mlp.fuse_gate_up = True
            external.append((mlp, [mlp.gate_proj.weight, mlp.up_proj.weight]))
        # the last block adds its own branch: its output is what the final norm and the eval's hooks read
        block.defer_add = memory.fuse_block_add and i < len(layers) - 1
    if external:
        try:
            import deepspeed
        except ModuleNotFoundError:  # no DeepSpeed: no ZeRO-3 to gather for
            return
        for module, params in external:
            for p in params:
                # deepspeed.zero is an attribute of the package (deepspeed.runtime.zero), not an importable path
                deepspeed.zero.register_external_parameter(module, p)


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
    _install_fusions(blu, memory)
    for i, block in enumerate(blu.layers):
        if memory.mlp_tiles > 1:
            block.mlp.forward = _TiledForward(block.mlp, memory.mlp_tiles)
        if memory.recompute != "none" or memory.offload_activations:
            block.forward = _BlockForward(model, i, memory.recompute, memory.mlp_tiles)
    blu.memory = memory
    return model
