"""The memory section: recompute, tiling, activation offload, the kernels of the loss and attention, and the
block's fusions (installed by megablu/memory/apply.py; their cross-field checks are checks.py's kernel_invariants
and memory_problems)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section


class MemoryConfig(Section):
    recompute: Literal["none", "selective", "full"] = "none"
    loss_chunk: int = Field(
        default=0,
        ge=0,
        description="tokens per vocab-loss chunk. chunked: 0 = unchunked "
        "(fp32 [T, V] logits); liger: its chunk is the largest power of two of at most "
        "loss_chunk tokens it can make, or all the rank's tokens (Liger's chunk_mem_const), "
        "never below its own sizing "
        "(~T*d/V tokens; 0 = that). Larger chunks hold more bf16 logits (2*V B per token of "
        "the chunk) and read-modify-write the fp32 (V, d) weight-gradient sum fewer times "
        "(experiments/speed/LOG.md has the trade-off measured)",
    )
    ops: Literal["auto", "torch", "cuda"] = "auto"
    mlp_tiles: int = Field(
        default=1,
        ge=1,
        description="sequence tiles of the SwiGLU MLP (one tile's "
        "(tokens, ffn) intermediates alive at a time, fwd and bwd); 1 = untiled",
    )
    offload_activations: bool = Field(
        default=False,
        description="each block's saved activations to pinned "
        "host memory in the forward, prefetched back one block ahead in the "
        "backward (CUDA side stream)",
    )
    offload_keep: int = Field(
        default=1,
        ge=1,
        description="with offload_activations: the last offload_keep "
        "blocks keep their saved activations on the GPU (the backward needs them first; "
        "each kept block gives the prefetch of the offloaded ones a block's backward of "
        "head start, for one block's saved set of GPU memory: megablu plan shows both)",
    )
    offload_fraction: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="with offload_activations: the share of "
        "the blocks before the last offload_keep that offload, spread evenly (0.75: "
        "three of every four); the kept ones stay on the GPU and their compute hides "
        "the others' copies, where the host link is slower than a block's forward "
        "(experiments/speed/LOG.md)",
    )
    loss: Literal["auto", "chunked", "liger"] = Field(
        default="auto",
        description="the lm head's vocab loss: chunked = megablu's own (ops/cross_entropy.py; "
        "loss_chunk tokens at a time, fp32 logits, dW summed in fp32); liger = Liger-Kernel's fused linear "
        "cross-entropy (optional package liger-kernel, CUDA only; dW accumulated in fp32: accum_dtype=fp32), "
        "same sum over labelled tokens, ignore_index -100 and tied-embedding grads; auto (the default) = liger "
        "when the run is on CUDA and liger_kernel imports, else chunked (chosen once per run, logged with its "
        "reason, recorded in probe.json's setup as loss, the configured value as loss_config; experiments/speed/LOG.md "
        "compares the two); loss_chunk sizes the chunks of both",
    )
    attention: Literal["auto", "sdpa", "fa4"] = Field(
        default="auto",
        description="the local causal attention kernel (also the one Ulysses wraps): sdpa = "
        "torch's scaled_dot_product_attention (cuDNN on Hopper GPUs); fa4 = FlashAttention-4 (optional package "
        "flash-attn-4, CuTe DSL; SM90 GPUs, bf16/fp16, head_dim a multiple of 8 in 8..256; not with "
        "data.doc_mask, whose FlexAttention path is unchanged); auto (the default) = fa4 where it can take the "
        "tensors (CUDA SM90, bf16/fp16, its head sizes) and flash_attn.cute imports, else sdpa, chosen at the "
        "first call and logged with its reason (probe.json's setup: attention, attention_config); with "
        "data.doc_mask the masked path runs as before (experiments/speed/LOG.md compares the kernels)",
    )
    fuse_qkv: bool = Field(
        default=False,
        description="the q, k and v projections as one GEMM over their weights concatenated at each call "
        "(ops/linear.py): the parameters, their names and checkpoints are unchanged, ZeRO-3 gathers them around "
        "the attention module; the input is read once and its gradient comes out of one GEMM instead of three "
        "summed by autograd, for a (tokens, q+k+v) concatenation of the output gradients in the backward. Same "
        "loss and gradients (tests/memory/test_fusions.py); off until a measured gain (bench/profile_step.py, "
        "mode flag fuseqkv; docs/BENCHMARKS.md)",
    )
    fuse_gate_up: bool = Field(
        default=False,
        description="the MLP's gate and up projections as one GEMM (as fuse_qkv), whose [gate | up] output "
        "the SwiGLU kernel takes whole (ops.swiglu_packed): one read of the input, one input-gradient GEMM "
        "instead of two summed. Mode flag fusegu of bench/profile_step.py",
    )
    fuse_block_add: bool = Field(
        default=False,
        description="the MLP residual add of each block done inside the next block's input RMSNorm "
        "(ops.add_rms_norm, as the attention residual add is inside a block), so its backward sums the residual "
        "gradient in the same kernel: one activation-size add fewer per block forward and per block backward. "
        "model.norm_layout=pre only; not with recompute=full, whose checkpoint at the block boundary would then "
        "save the residual and the MLP branch apart, twice the layer input it keeps. Mode flag fuseadd of "
        "bench/profile_step.py",
    )

    @model_validator(mode="after")
    def _fusions(self):
        if self.fuse_block_add and self.recompute == "full":
            raise ValueError(
                "memory.fuse_block_add with memory.recompute=full: the full checkpoint cuts at the block boundary, "
                "where the fused add leaves two tensors (the residual and the MLP branch) instead of their sum, so "
                "every block would save twice the layer input full recompute keeps; set memory.fuse_block_add=false, "
                "or memory.recompute=selective"
            )
        return self


# FlashAttention-4's SM90 head sizes (flash_attn/cute/interface.py `_validate_head_dims`, 4.0.0b40: 8..256,
# a multiple of 16 bytes / element size = 8 for bf16 and fp16)
FA4_HEAD_DIM = (8, 256, 8)
