"""Rank helpers over torch.distributed that also work without it (a world of one).

The pattern they serve: rank 0 decides (reads the filesystem, allocates, verifies) and every
rank receives the same answer, so no two ranks act on two different views."""

from __future__ import annotations

import logging
from typing import Any

CLOSED = "process group closed on every rank"


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def get_rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def get_world_size() -> int:
    d = _dist()
    return d.get_world_size() if d else 1


def is_rank0() -> bool:
    return get_rank() == 0


def all_gather_object(obj: Any) -> list:
    """[obj of rank 0, obj of rank 1, ...]; [obj] without a process group. Collective."""
    d = _dist()
    if d is None:
        return [obj]
    out = [None] * d.get_world_size()
    d.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's obj on every rank (obj itself without a process group). Collective."""
    d = _dist()
    if d is None:
        return obj
    box = [obj]
    d.broadcast_object_list(box, src=0)
    return box[0]


def finish() -> None:
    """End a run's process group on every rank together: a barrier, then destroy_process_group.
    Without it a rank that reaches interpreter exit first tears its gloo group down while its peer
    is still connected, and it can abort there (SIGABRT, exit 250 through DeepSpeed's launcher)
    after a run that succeeded ("terminate called without an active exception": 8 of 40 two-rank
    gloo runs without this, 0 of 40 with it, on this machine; the rank that exited first aborted).
    Call on success paths only (a failing rank's peers may be gone)."""
    d = _dist()
    if d is None:
        return
    rank = d.get_rank()
    d.barrier()
    d.destroy_process_group()
    if rank == 0:
        logging.getLogger(__name__).info(CLOSED)


def skip_cpu_shm_op() -> None:
    """Keep deepspeed.init_distributed from JIT-building its CPU shared-memory all-reduce.

    DeepSpeed builds that op (~25 s of C++ on 2 cores, once per torch_extensions cache) in every
    init_distributed on CPU, for inference_all_reduce; training never calls it. A rank killed while
    the build runs leaves a lock in the shared cache that hangs every later DeepSpeed start on the
    machine. Patched through sys.modules: the attribute `deepspeed.comm.torch` is the torch package
    itself (deepspeed/comm imports it under that name), so setting it there does nothing."""
    import sys

    import deepspeed.comm.torch  # noqa: F401  (registers the module under its dotted name)

    ds_comm_torch: Any = sys.modules["deepspeed.comm.torch"]
    ds_comm_torch.build_shm_op = lambda: None
