"""Spawn N CPU ranks (gloo) running a top-level function, collect rank 0's result."""

from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, out):
    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    import deepspeed

    from megablu.utils.dist import skip_cpu_shm_op

    skip_cpu_shm_op()  # the ranks train and evaluate; that op is DeepSpeed inference's only
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    result = fn(rank, world, *args)
    if rank == 0:
        torch.save(result, out)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def run_distributed(fn, world: int, *args):
    """fn(rank, world, *args) on `world` gloo ranks; returns what rank 0's fn returned."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.pt")
        mp.spawn(_entry, args=(world, free_port(), fn, args, out), nprocs=world, join=True)
        return torch.load(out, weights_only=False)
