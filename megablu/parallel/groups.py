"""The dp x sp rank grid as an explicit object (no module-level process groups).

Layout: rank = dp_rank * sp + sp_rank, so the sp ranks of one group are consecutive and
therefore on one node whenever sp divides the GPUs per node (all-to-all over NVLink,
data parallel across nodes). `Groups` also implements the slice of Megatron's `mpu`
interface DeepSpeed reads (deepspeed.initialize(mpu=groups)): with it DeepSpeed reduces
gradients and shards ZeRO state over all dp*sp ranks and averages over dp only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Groups:
    world_size: int
    rank: int
    sp: int
    dp: int
    sp_rank: int
    dp_rank: int
    sp_group: Any = None  # the sp ranks sharing this rank's sequences
    dp_group: Any = None  # ranks with the same sp_rank (one per dp replica); megablu's own use
    world_group: Any = None  # every rank: ZeRO partitioning and gradient reduction
    ranks_per_node: Optional[int] = None
    sp_ranks: list = field(default_factory=list)

    # ---- the mpu interface DeepSpeed queries (deepspeed/utils/groups.py, engine.py)
    def get_sequence_parallel_group(self):
        return self.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.sp

    def get_sequence_parallel_rank(self) -> int:
        return self.sp_rank

    def get_sequence_data_parallel_group(self):
        return self.world_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.rank

    # checkpoint naming asks for the model-parallel layout: megablu has none
    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    # DeepSpeed recognises a sequence-parallel mpu (its own parallel_state_sp) by this
    # attribute; it then partitions ZeRO-3 parameters over the same dp*sp group it reduces
    # gradients over. Exposing get_data_parallel_group instead makes zero.Init partition
    # over dp only while gradients are reduced over dp*sp: silently wrong ZeRO-3 gradients
    # (caught by tests/parallel/test_sp_parity.py).
    def initialize_sequence_parallel(self, *_):
        raise RuntimeError("megablu builds its groups with megablu.parallel.groups.build_groups")

    def describe(self) -> str:
        node = f", {self.ranks_per_node} ranks/node" if self.ranks_per_node else ""
        return (
            f"world {self.world_size} = dp {self.dp} x sp {self.sp}{node}; rank {self.rank}: "
            f"dp_rank {self.dp_rank}, sp_rank {self.sp_rank}, sp group ranks {self.sp_ranks}"
        )


def layout(world_size: int, sp: int) -> list[list[int]]:
    """The sp groups as lists of global ranks: consecutive blocks of sp."""
    if sp < 1 or world_size % sp:
        raise ValueError(f"parallel.sp={sp} must divide the world size {world_size}")
    return [list(range(d * sp, (d + 1) * sp)) for d in range(world_size // sp)]


def build_groups(sp: int, ranks_per_node: Optional[int] = None) -> Groups:
    """Create the process groups (collective: every rank calls it, same order)."""
    # imported here: `layout` is what the launch checks need (parallel/topology.py), and they run
    # in commands that never start a process group (`megablu train --dry-run`, `config check`)
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    sp_layout = layout(world, sp)
    dp = world // sp
    g = Groups(
        world_size=world, rank=rank, sp=sp, dp=dp, sp_rank=rank % sp, dp_rank=rank // sp, ranks_per_node=ranks_per_node
    )
    # every rank must create every group, in the same order
    for ranks in sp_layout:
        pg = dist.new_group(ranks)
        if rank in ranks:
            g.sp_group, g.sp_ranks = pg, ranks
    for s in range(sp):
        ranks = [d * sp + s for d in range(dp)]
        pg = dist.new_group(ranks)
        if rank in ranks:
            g.dp_group = pg
    g.world_group = dist.new_group(list(range(world)))
    return g


def single_rank_groups() -> Groups:
    """A one-rank grid for code that runs without torch.distributed (tests, eval)."""
    return Groups(world_size=1, rank=0, sp=1, dp=1, sp_rank=0, dp_rank=0, sp_ranks=[0])
