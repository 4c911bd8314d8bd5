"""Where the dp x sp grid lands on nodes: a pure description + every problem, before launch.

`resolve(world, ranks_per_node, sp)` needs no processes. Global ranks are numbered node by
node (DeepSpeed's hostfile order, torchrun's node_rank), and megablu's sp groups are
consecutive ranks (`groups.layout`: rank = dp_rank * sp + sp_rank). So an sp group stays on
one node exactly when the group's ranks do not straddle a node boundary, which for equal
nodes means sp divides the GPUs per node. Ulysses runs 4 all-to-alls per attention layer
forward (q, k, v in; output back) and 4 backward, so an sp group that spans nodes puts
every layer's activations through the inter-node network (tens of GB/s per GPU instead of
NVLink's hundreds): legal, and the user is told. An sp that does not divide the world
size is an error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

from .groups import layout


@dataclass(frozen=True)
class Topology:
    world: int
    sp: int
    dp: int
    node_ranks: list[list[int]]  # global ranks on each node, node by node
    sp_groups: list[list[int]] = field(default_factory=list)
    dp_groups: list[list[int]] = field(default_factory=list)
    crossing: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (sp group, nodes it spans)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def nodes(self) -> int:
        return len(self.node_ranks)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def sp_within_node(self) -> bool:
        return self.ok and not self.crossing

    def node_of(self, rank: int) -> int:
        for n, ranks in enumerate(self.node_ranks):
            if rank in ranks:
                return n
        raise ValueError(f"rank {rank} is not in the world of {self.world}")

    def format(self) -> str:
        slots = sorted({len(r) for r in self.node_ranks})
        per = f"{slots[0]} ranks" if len(slots) == 1 else f"{'/'.join(str(len(r)) for r in self.node_ranks)} ranks"
        head = f"topology: {self.nodes} node(s) x {per} = world {self.world}"
        lines = [head + (f" -> dp {self.dp} x sp {self.sp}" if self.ok else f", sp {self.sp}")]
        for n, ranks in enumerate(self.node_ranks):
            lines.append(f"  node {n}: ranks {_span(ranks)}")
        if self.ok:
            lines.append(
                "  sp groups (Ulysses all-to-all, every layer): "
                + "  ".join(
                    f"{_span(g)}@node{'+'.join(str(n) for n in sorted({self.node_of(r) for r in g}))}"
                    for g in self.sp_groups
                )
            )
            lines.append(
                "  dp groups (gradient reduction, once per step): " + "  ".join(_span(g) for g in self.dp_groups)
            )
            lines.append(f"  every sp group inside one node: {'yes' if self.sp_within_node else 'NO'}")
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  error: {e}" for e in self.errors]
        return "\n".join(lines)


def _span(ranks: Sequence[int]) -> str:
    r = list(ranks)
    if len(r) > 2 and r == list(range(r[0], r[-1] + 1)):
        return f"[{r[0]}-{r[-1]}]"
    return "[" + ",".join(str(x) for x in r) + "]"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve(world: int, ranks_per_node: Union[int, Sequence[int], None], sp: int) -> Topology:
    """Describe world ranks on nodes of `ranks_per_node` (an int for equal nodes, or one
    count per node as a hostfile gives; None = one node) running dp x sp."""
    errors: list[str] = []
    warnings: list[str] = []
    if ranks_per_node is None:
        slots = [world]
    elif isinstance(ranks_per_node, int):
        if ranks_per_node < 1:
            errors.append(f"ranks per node {ranks_per_node} must be >= 1")
            slots = [world]
        elif world % ranks_per_node:
            errors.append(f"world size {world} is not a multiple of {ranks_per_node} ranks per node")
            slots = [ranks_per_node] * (world // ranks_per_node) + [world % ranks_per_node]
        else:
            slots = [ranks_per_node] * (world // ranks_per_node)
    else:
        slots = list(ranks_per_node)
        if any(s < 1 for s in slots):
            errors.append(f"ranks per node {slots}: every node needs >= 1 rank")
        if sum(slots) != world:
            errors.append(f"ranks per node {slots} sum to {sum(slots)}, not the world size {world}")
    node_ranks, start = [], 0
    for s in slots:
        node_ranks.append(list(range(start, start + max(s, 0))))
        start += max(s, 0)

    if world < 1:
        errors.append(f"world size {world} must be >= 1")
    if sp < 1:
        errors.append(f"parallel.sp={sp} must be >= 1")
    elif sp > world:
        errors.append(f"parallel.sp={sp} > world size {world}: launch at least {sp} ranks or lower parallel.sp")
    elif world % sp:
        errors.append(f"parallel.sp={sp} does not divide world size {world}; use an sp in {_divisors(world)}")
    if errors:
        return Topology(world=world, sp=sp, dp=0, node_ranks=node_ranks, errors=errors, warnings=warnings)

    dp = world // sp
    sp_groups = layout(world, sp)
    dp_groups = [[d * sp + s for d in range(dp)] for s in range(sp)]
    node_of = {r: n for n, ranks in enumerate(node_ranks) for r in ranks}
    crossing = [(g, sorted({node_of[r] for r in g})) for g in sp_groups if len({node_of[r] for r in g}) > 1]
    if crossing:
        per = min(slots)
        fits = [d for d in _divisors(world) if all(s % d == 0 for s in slots)]
        what = "; ".join(f"sp group {_span(g)} spans nodes {ns}" for g, ns in crossing[:4])
        more = f" (and {len(crossing) - 4} more)" if len(crossing) > 4 else ""
        why = (
            f"sp={sp} > {per} ranks on a node, so no sp group fits in one node"
            if sp > per
            else f"sp={sp} does not divide the ranks per node {slots}, so groups of {sp} consecutive ranks "
            f"straddle node boundaries"
        )
        warnings.append(
            f"{why}: {what}{more}. Each of these runs Ulysses' all-to-all (4 forward + 4 backward per "
            f"attention layer, every layer) over the inter-node network instead of NVLink, typically a "
            f"5-20x slower link; expect it to dominate the step. An sp in {fits} keeps every group inside "
            f"a node (data parallel then crosses nodes, once per step)"
        )
    return Topology(
        world=world,
        sp=sp,
        dp=dp,
        node_ranks=node_ranks,
        sp_groups=sp_groups,
        dp_groups=dp_groups,
        crossing=crossing,
        errors=errors,
        warnings=warnings,
    )


def ranks_per_node_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Ranks on this node as the launcher says it: torchrun sets LOCAL_WORLD_SIZE, DeepSpeed's
    launch.py sets LOCAL_SIZE (and not LOCAL_WORLD_SIZE). None when neither is set."""
    env = os.environ if env is None else env
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        v = env.get(key)
        if v and int(v) > 0:
            return int(v)
    return None
