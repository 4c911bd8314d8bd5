"""The launch scripts' --dry-run (`megablu train --dry-run` with each script's defaults): topology +
config check + the exact command, no GPU."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def dry(script, *args):
    r = subprocess.run(
        ["bash", str(ROOT / "launch" / script), "--dry-run", *args], capture_output=True, text=True, cwd=ROOT
    )
    return r.returncode, r.stdout, r.stderr


@pytest.mark.parametrize(
    "script,args,topo,cmd",
    [
        (
            "ext32k_2gpu.sh",
            [],
            "1 node(s) x 2 ranks = world 2 -> dp 1 x sp 2",
            "--num_gpus 2 --master_port 29500 --module megablu.train.entry --config configs/ext32k.yaml",
        ),
        (
            "ext64k_4gpu.sh",
            [],
            "1 node(s) x 4 ranks = world 4 -> dp 1 x sp 4",
            "--num_gpus 4 --master_port 29500 --module megablu.train.entry --config configs/ext64k_4gpu.yaml",
        ),
        # the same ext32k config on 4 GPUs: only the launch changes
        ("ext32k_2gpu.sh", ["--num-gpus", "4"], "world 4 -> dp 2 x sp 2", "--num_gpus 4"),
        (
            "cpu.sh",
            ["--set", "train.max_steps=20"],
            "1 node(s) x 2 ranks = world 2 -> dp 1 x sp 2",
            "DS_ACCELERATOR=cpu LOCAL_WORLD_SIZE=2 ",
        ),
        (
            "multinode.sh",
            [],
            "2 node(s) x 4 ranks = world 8 -> dp 2 x sp 4",
            "--hostfile launch/hostfile.example --master_addr node0 --master_port 29500 --module megablu.train.entry",
        ),
        (
            "multinode.sh",
            [
                "--launcher",
                "torchrun",
                "--num-nodes",
                "2",
                "--num-gpus",
                "2",
                "--node-rank",
                "1",
                "--config",
                "configs/ext32k.yaml",
            ],
            "2 node(s) x 2 ranks = world 4 -> dp 2 x sp 2",
            "--nnodes 2 --node_rank 1 --nproc-per-node 2 --master_addr node0",
        ),
    ],
)
def test_dry_run_prints_topology_check_and_command(script, args, topo, cmd):
    rc, out, err = dry(script, *args)
    assert rc == 0, out + err
    lines = out.splitlines()
    assert topo in lines[0]
    assert "every sp group inside one node: yes" in out
    assert any(ln.startswith("config check (world ") and ln.endswith(": ok") for ln in lines), out
    (command,) = [ln for ln in lines if ln.startswith("command: ")]
    assert cmd in command
    if script != "cpu.sh":
        assert "NCCL_NVLS_ENABLE=0" in out


def test_dry_run_refuses_a_world_the_config_cannot_use():
    rc, out, err = dry("ext64k_4gpu.sh", "--num-gpus", "2")
    assert rc == 2
    assert "error: parallel.sp=4 > world size 2" in out
    assert "config check (world 2, cuda): INVALID" in out and "parallel.sp=4 > world size 2" in err


def test_dry_run_names_sp_groups_that_cross_nodes(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu-a slots=2\ngpu-b slots=2\n")
    rc, out, _ = dry("multinode.sh", "--hostfile", str(hosts))  # ext64k (sp=4) on 2 x 2 GPUs
    assert rc == 0  # legal, but the user is told
    assert "node 0 (gpu-a): ranks [0,1]" in out and "node 1 (gpu-b): ranks [2,3]" in out
    assert "every sp group inside one node: NO" in out
    assert "warning: sp=4 > 2 ranks on a node" in out and "inter-node network" in out
