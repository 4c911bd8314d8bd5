"""Resolve a launch (GPUs, nodes, hostfile, sp from the config), check it, then run it.

The launch scripts (cpu.sh, ext32k_2gpu.sh, ext64k_4gpu.sh, multinode.sh) are thin
wrappers around this. In order: print the topology (nodes, dp x sp, which ranks share a
node, whether every sp group is inside one node), validate the config for that world size
with `megablu config check --world-size W --device D` (with --no-files on a dry run), print the
exact launcher command,
then exec it -- or, with --dry-run, stop after printing (exit 0 valid, 2 invalid; no GPU
needed). Dry-run output goes to stdout; on a real launch the same lines go to stderr.

  python launch/topology.py --config yaml_configs/ext32k.yaml --num-gpus 2 --device cuda --dry-run
  python launch/topology.py --config yaml_configs/ext64k_4gpu.yaml --hostfile launch/hostfile.example \
      --master-addr node0 --device cuda --dry-run
  python launch/topology.py --config yaml_configs/tiny_cpu_ext.yaml --launcher torchrun --num-nodes 2 \
      --num-gpus 2 --node-rank 0 --master-addr 127.0.0.1 --master-port 29500 --device cpu
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ENTRY = "launch/ext32k.py"


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """DeepSpeed hostfile lines '<host> slots=<n>' (comments and blank lines ignored)."""
    hosts = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots="):
            raise SystemExit(f"{path}:{i}: expected '<hostname> slots=<n>', got {line!r}")
        hosts.append((parts[0], int(parts[1].split("=", 1)[1])))
    if not hosts:
        raise SystemExit(f"{path}: no hosts")
    return hosts


def config_sp(config: str, sets: list[str]) -> int:
    from megablu.config.load import apply_overrides, load_raw

    raw = apply_overrides(load_raw(config), sets)
    return int((raw.get("parallel") or {}).get("sp", 1))


def build_command(a, slots: list[int]) -> tuple[list[str], dict]:
    entry = [ENTRY, "--config", a.config] + [x for s in a.set for x in ("--set", s)]
    if a.resume:
        entry += ["--resume", a.resume]
    env = {}
    if a.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    if a.launcher == "torchrun":
        # static rendezvous: node_rank fixes which global ranks a node gets (node by node)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(slots)),
               "--node_rank", str(a.node_rank), "--nproc-per-node", str(slots[0]),
               "--master_addr", a.master_addr, "--master_port", str(a.master_port)]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="a.b=v")
    p.add_argument("--resume", default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], required=True)
    p.add_argument("--num-gpus", type=int, default=1, help="ranks per node (processes on CPU)")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--hostfile", default=None, help="DeepSpeed hostfile ('<host> slots=<n>' per node)")
    p.add_argument("--launcher", choices=["deepspeed", "torchrun"], default="deepspeed")
    p.add_argument("--node-rank", type=int, default=0, help="torchrun: this node's index (0 runs the store)")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--dry-run", action="store_true", help="print topology + command, validate, exit")
    a = p.parse_args(argv)

    from megablu.parallel.topology import resolve

    if a.hostfile:
        hosts = read_hostfile(a.hostfile)
        slots = [n for _, n in hosts]
        if a.launcher == "torchrun" and len(set(slots)) > 1:
            raise SystemExit(f"torchrun needs equal ranks per node; {a.hostfile} has slots {slots}")
    else:
        hosts = None
        slots = [a.num_gpus] * a.num_nodes
        if a.num_nodes > 1 and a.launcher == "deepspeed":
            raise SystemExit("deepspeed across nodes needs --hostfile (or use --launcher torchrun per node)")
    out = sys.stdout if a.dry_run else sys.stderr
    world = sum(slots)
    topo = resolve(world, slots, config_sp(a.config, a.set))
    text = topo.format()
    if hosts:
        for n, (h, _) in enumerate(hosts):
            text = text.replace(f"  node {n}: ", f"  node {n} ({h}): ", 1)
    print(text, file=out)

    # a dry run is often made away from the cluster: the config alone (--no-files); a launch checks
    # everything it names here, as the entry will on every rank
    chk = [sys.executable, "-m", "megablu.cli", "config", "check", a.config, "--world-size", str(world),
           "--device", a.device] + (["--no-files"] if a.dry_run else []) + [x for s in a.set for x in ("--set", s)]
    r = subprocess.run(chk, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    print(f"config check (world {world}, {a.device}): {'ok' if r.returncode == 0 else 'INVALID'}", file=out)
    if r.stderr.strip():
        print(r.stderr.rstrip(), file=sys.stderr)

    cmd, env = build_command(a, slots)
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    nccl = " ".join(f"{k}={os.environ[k]}" for k in sorted(os.environ) if k.startswith("NCCL_"))
    if nccl and a.device == "cuda":
        print(f"nccl: {nccl}", file=out)
    print(f"command: {shown + ' ' if shown else ''}{shlex.join(cmd)}", file=out)
    if a.launcher == "torchrun" and len(slots) > 1:
        print(f"  (run on every node with its own --node_rank 0..{len(slots) - 1}; node 0 is "
              f"{a.master_addr}:{a.master_port})", file=out)
    if not topo.ok or r.returncode != 0:
        return 2
    if a.dry_run:
        return 0
    sys.stdout.flush(), sys.stderr.flush()
    os.chdir(ROOT)
    os.execvpe(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    sys.exit(main())
