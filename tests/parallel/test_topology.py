"""Topology resolution: where the dp x sp grid lands on nodes (pure; no processes)."""

import pytest

from megablu.parallel.groups import layout
from megablu.parallel.topology import ranks_per_node_from_env, resolve


@pytest.mark.parametrize(
    "world,per_node,sp,sp_groups,dp_groups,nodes",
    [
        (2, 2, 2, [[0, 1]], [[0], [1]], [[0, 1]]),  # ext32k, 2 GPUs
        (4, 4, 4, [[0, 1, 2, 3]], [[0], [1], [2], [3]], [[0, 1, 2, 3]]),  # ext64k, 4 GPUs
        (4, 4, 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1, 2, 3]]),  # hybrid 2 x 2, one node
        (4, 2, 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1], [2, 3]]),  # 2 x 2 on two nodes
        (
            8,
            4,
            4,
            [[0, 1, 2, 3], [4, 5, 6, 7]],
            [[0, 4], [1, 5], [2, 6], [3, 7]],  # 2 x 4 on two nodes
            [[0, 1, 2, 3], [4, 5, 6, 7]],
        ),
    ],
)
def test_sp_groups_stay_inside_nodes_when_sp_divides_gpus_per_node(world, per_node, sp, sp_groups, dp_groups, nodes):
    t = resolve(world, per_node, sp)
    assert t.ok and t.sp_within_node and not t.warnings
    assert (t.dp, t.sp_groups, t.dp_groups, t.node_ranks) == (world // sp, sp_groups, dp_groups, nodes)
    # the same grid build_groups creates: rank = dp_rank * sp + sp_rank
    assert t.sp_groups == layout(world, sp)
    for r in range(world):
        assert r in t.sp_groups[r // sp] and r in t.dp_groups[r % sp]
        assert {t.node_of(x) for x in t.sp_groups[r // sp]} == {t.node_of(r)}
    assert "every sp group inside one node: yes" in t.format()


def test_sp_larger_than_a_node_warns_with_the_groups_and_the_cost():
    t = resolve(4, 2, 4)  # ext64k's sp=4 on two 2-GPU nodes
    assert t.ok and not t.sp_within_node
    assert t.crossing == [([0, 1, 2, 3], [0, 1])]
    (w,) = t.warnings
    assert "sp=4 > 2 ranks on a node" in w and "[0-3] spans nodes [0, 1]" in w
    assert "inter-node network" in w and "every layer" in w and "sp in [1, 2]" in w
    assert "every sp group inside one node: NO" in t.format()


def test_sp_not_dividing_gpus_per_node_names_each_straddling_group():
    t = resolve(12, 4, 3)  # 3 nodes x 4 GPUs, sp=3: [3,4,5] and [6,7,8] straddle
    assert t.ok and t.dp == 4
    assert t.crossing == [([3, 4, 5], [0, 1]), ([6, 7, 8], [1, 2])]
    (w,) = t.warnings
    assert "does not divide the ranks per node" in w and "sp in [1, 2, 4]" in w


def test_uneven_nodes_from_a_hostfile():
    assert resolve(6, [4, 2], 2).sp_within_node
    t = resolve(6, [4, 2], 3)  # [0,1,2] on node 0, [3,4,5] across nodes 0 and 1
    assert t.crossing == [([3, 4, 5], [0, 1])] and "sp in [1, 2]" in t.warnings[0]


@pytest.mark.parametrize(
    "world,per_node,sp,msg",
    [
        (6, 6, 4, "parallel.sp=4 does not divide world size 6; use an sp in [1, 2, 3, 6]"),
        (2, 2, 4, "parallel.sp=4 > world size 2"),
        (6, 4, 2, "world size 6 is not a multiple of 4 ranks per node"),
        (8, [4, 2], 2, "ranks per node [4, 2] sum to 6, not the world size 8"),
    ],
)
def test_errors(world, per_node, sp, msg):
    t = resolve(world, per_node, sp)
    assert not t.ok and any(msg in e for e in t.errors), t.errors
    assert "error: " in t.format()


def test_ranks_per_node_from_either_launcher():
    assert ranks_per_node_from_env({"LOCAL_WORLD_SIZE": "2"}) == 2  # torchrun
    assert ranks_per_node_from_env({"LOCAL_SIZE": "4"}) == 4  # deepspeed launch.py
    assert ranks_per_node_from_env({}) is None
