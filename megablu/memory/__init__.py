"""Memory switches (config `memory:`), applied to a BluModel from outside, as Ulysses is
(torchtitan applies activation checkpointing from `parallelize.py` the same way):

    model = apply_memory(BluModel(cfg.model, cfg.rope), cfg.memory)   # megablu.memory.apply

  apply.py      apply_memory: recompute none | selective | full around each block, the tiled
                MLP, activation offload, the loss (auto | chunked | liger) and its chunk, the attention
                kernel (sdpa | fa4), the ops implementation and the fusions (fuse_qkv, fuse_gate_up,
                fuse_block_add)
  tiled.py      sequence-tiled compute of a row-wise function (the SwiGLU MLP)
  offload.py    saved activations to pinned host memory on a side stream, one block prefetched
  constants.py  numbers the offload and the planner share (no torch)

Every switch is exact: the same loss and gradients as the plain model (tests/model/
test_memory_switches*.py); loss and attention change the kernels, which agree to their dtype's
rounding (tests/ops/test_attention.py, tests/ops/test_cross_entropy.py, tests/model/
test_kernel_choices.py); the fusions compute the same function (tests/memory/test_fusions.py).
This package's __init__ imports nothing, so the planner can read constants.py without torch.
"""
