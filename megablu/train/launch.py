"""Resolve a launch (GPUs, nodes, hostfile, sp from the config), check it, then run it:
`megablu train` (and the launch/*.sh scripts, which call it with their defaults).

In order: print the topology (nodes, dp x sp, which ranks share a node, whether every sp
group is inside one node), check the config for that world size and device with the entry's
own preflight (train/preflight.py; the config alone on a dry run), print the exact launcher
command, then exec it -- or, with --dry-run, stop after printing (exit 0 valid, 2 invalid; no
GPU needed). Dry-run output goes to stdout; on a real launch the same lines go to stderr.
The launcher starts the entry as a module (`--module megablu.train.entry`), so the command
works from any directory.

  megablu train --config configs/ext32k.yaml --gpus 2 --device cuda --dry-run
  megablu train --config configs/ext64k_4gpu.yaml --hostfile launch/hostfile.example \\
      --master-addr node0 --device cuda --dry-run
  megablu train --config tests/configs/tiny_cpu_ext.yaml --launcher torchrun --nodes 2 \\
      --gpus 2 --node-rank 0 --master-addr 127.0.0.1 --master-port 29500 --device cpu
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

ENTRY_MODULE = "megablu.train.entry"


class LaunchError(Exception):
    """A launch that cannot be resolved (a bad hostfile, torchrun without equal nodes)."""


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """DeepSpeed hostfile lines '<host> slots=<n>' (comments and blank lines ignored)."""
    hosts = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots="):
            raise LaunchError(f"{path}:{i}: expected '<hostname> slots=<n>', got {line!r}")
        hosts.append((parts[0], int(parts[1].split("=", 1)[1])))
    if not hosts:
        raise LaunchError(f"{path}: no hosts")
    return hosts


def config_value(config: str, sets: list[str], section: str, key: str, default):
    """One field of the config as the YAML and the overrides give it (no validation)."""
    from ..config.load import apply_overrides, load_raw

    raw = apply_overrides(load_raw(config), sets)
    return (raw.get(section) or {}).get(key, default)


def build_command(a, slots: list[int]) -> tuple[list[str], dict]:
    """(launcher argv, environment) that start the entry module on `slots` ranks per node."""
    entry = ["--module", ENTRY_MODULE, "--config", a.config] + [x for s in a.set for x in ("--set", s)]
    if a.resume:
        entry += ["--resume", a.resume]
    env = {}
    if a.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    if a.launcher == "torchrun":
        # static rendezvous: node_rank fixes which global ranks a node gets (node by node)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(len(slots)),
            "--node_rank",
            str(a.node_rank),
            "--nproc-per-node",
            str(slots[0]),
            "--master_addr",
            a.master_addr,
            "--master_port",
            str(a.master_port),
        ]
        return cmd + entry, env
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if a.hostfile:
        cmd += ["--hostfile", a.hostfile, "--master_addr", a.master_addr]
    else:
        cmd += ["--num_gpus", str(slots[0])]
        # DeepSpeed's launch.py sets LOCAL_SIZE, not LOCAL_WORLD_SIZE which the trainer reads
        env["LOCAL_WORLD_SIZE"] = str(slots[0])
    cmd += ["--master_port", str(a.master_port)]
    return cmd + entry, env


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a count of GPUs, nodes, steps)."""
    import argparse

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def port(text: str) -> int:
    """argparse type: a TCP port, 1..65535 (a rendezvous on port 99999 fails only once every rank has started)."""
    import argparse

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{v} is not a port (1..65535; e.g. 29500)")
    return v


def add_arguments(p) -> None:
    """The launch options `megablu train` takes (launch/*.sh pass their defaults through them)."""
    p.add_argument("--config", required=True, help="configs/<arm>.yaml to train")
    p.add_argument("--set", action="append", default=[], metavar="a.b=v", help="override (repeatable)")
    p.add_argument("--resume", default=None, help="run id or run dir to resume from its newest verified checkpoint")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: the config's train.device, cuda when a GPU is visible",
    )
    p.add_argument(
        "--gpus",
        "--num-gpus",
        dest="gpus",
        type=positive_int,
        default=None,
        help="ranks per node (processes on CPU); default: parallel.sp",
    )
    p.add_argument(
        "--nodes",
        "--num-nodes",
        dest="nodes",
        type=positive_int,
        default=1,
        help="nodes in the job (with --hostfile: taken from it)",
    )
    p.add_argument("--hostfile", default=None, help="DeepSpeed hostfile ('<host> slots=<n>' per node)")
    p.add_argument(
        "--launcher",
        choices=["deepspeed", "torchrun"],
        default="deepspeed",
        help="which launcher starts the ranks (torchrun: run the same command on every node)",
    )
    p.add_argument("--node-rank", type=int, default=0, help="torchrun: this node's index (0 runs the store)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of rank 0's node (the rendezvous)")
    p.add_argument(
        "--master-port", type=port, default=29500, help="rendezvous port (change it when two jobs share a node)"
    )
    p.add_argument("--dry-run", action="store_true", help="print topology + command, check the config, exit")


def launch(a) -> int:
    """Print the topology, check the config, print the command; exec it unless a.dry_run."""
    from ..config import ConfigError
    from ..parallel.topology import resolve
    from ..utils.device import resolve_device
    from .preflight import check

    nodes = len(read_hostfile(a.hostfile)) if a.hostfile else a.nodes
    if not 0 <= a.node_rank < nodes:
        given = f"{a.hostfile}'s {nodes} hosts" if a.hostfile else f"--nodes {nodes}"
        raise LaunchError(
            f"--node-rank {a.node_rank} with {given}: a node's index is 0..{nodes - 1} (0 runs the rendezvous store)"
        )
    if a.device == "auto":
        a.device = resolve_device(config_value(a.config, a.set, "train", "device", "auto"))
    if a.gpus is None:
        a.gpus = int(config_value(a.config, a.set, "parallel", "sp", 1))
    if a.hostfile:
        hosts = read_hostfile(a.hostfile)
        slots = [n for _, n in hosts]
        if a.launcher == "torchrun" and len(set(slots)) > 1:
            raise LaunchError(f"torchrun needs equal ranks per node; {a.hostfile} has slots {slots}")
    else:
        hosts = None
        slots = [a.gpus] * a.nodes
        if a.nodes > 1 and a.launcher == "deepspeed":
            raise LaunchError("deepspeed across nodes needs --hostfile (or use --launcher torchrun per node)")
    out = sys.stdout if a.dry_run else sys.stderr
    world = sum(slots)
    topo = resolve(world, slots, int(config_value(a.config, a.set, "parallel", "sp", 1)))
    text = topo.format()
    if hosts:
        for n, (h, _) in enumerate(hosts):
            text = text.replace(f"  node {n}: ", f"  node {n} ({h}): ", 1)
    print(text, file=out)

    # a dry run is often made away from the cluster: the config alone (--no-files); a launch checks
    # everything it names here, as the entry will on every rank
    try:
        ok = check(a.config, a.set, world_size=world, device=a.device, resume=a.resume, files=not a.dry_run)
        valid, said = True, [f"warning: {w}" for w in ok.warnings]
    except ConfigError as e:
        valid, said = False, [str(e)]
    print(f"config check (world {world}, {a.device}): {'ok' if valid else 'INVALID'}", file=out)
    if said:
        print("\n".join(said), file=sys.stderr)

    cmd, env = build_command(a, slots)
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    nccl = " ".join(f"{k}={os.environ[k]}" for k in sorted(os.environ) if k.startswith("NCCL_"))
    if nccl and a.device == "cuda":
        print(f"nccl: {nccl}", file=out)
    print(f"command: {shown + ' ' if shown else ''}{shlex.join(cmd)}", file=out)
    if a.launcher == "torchrun" and len(slots) > 1:
        print(
            f"  (run on every node with its own --node_rank 0..{len(slots) - 1}; node 0 is "
            f"{a.master_addr}:{a.master_port})",
            file=out,
        )
    if not topo.ok or not valid:
        return 2
    if a.dry_run:
        return 0
    sys.stdout.flush(), sys.stderr.flush()
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
