"""megablu training entry point (the script `deepspeed` launches).

  # CPU, 2 ranks (gloo), the tiny arm:
  deepspeed --num_gpus 2 launch/ext32k.py --config yaml_configs/tiny_cpu_ext.yaml
  # 1 GPU:
  deepspeed --num_gpus 1 launch/ext32k.py --config yaml_configs/l2.yaml
  # 2 GPUs, 16k -> 32k YaRN extension, sp=2 (the seed's ext_32k):
  deepspeed --num_gpus 2 launch/ext32k.py --config yaml_configs/ext32k.yaml
  # 4 GPUs, 16k -> 64k, sp=4:
  deepspeed --num_gpus 4 launch/ext32k.py --config yaml_configs/ext64k_4gpu.yaml
  # multi-node (see launch/hostfile.example; sp groups stay inside a node):
  deepspeed --hostfile launch/hostfile.example --master_addr node0 --master_port 29500 \
      launch/ext32k.py --config yaml_configs/ext64k_4gpu.yaml
  # any of them: --set train.max_steps=10 --set checkpoint.every_steps=5 ; --resume RUN_ID

The config is validated against the launch's world size and device before any rank
initialises distributed state; every violation is listed and the exit code is 2.
Results (the run summary) go to stdout on rank 0; logs go to stderr.
"""
import argparse
import contextlib
import json
import logging
import os
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="megablu long-context training")
    p.add_argument("--config", required=True, help="yaml_configs/<arm>.yaml")
    p.add_argument("--set", action="append", default=[], metavar="a.b=v", help="override (repeatable)")
    p.add_argument("--resume", default=None, help="run id or run dir to resume from its newest verified checkpoint")
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = p.parse_args(argv)

    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")

    from megablu.config import ConfigError, apply_overrides, build_config, config_warnings, load_config, load_raw
    from megablu.parallel.topology import ranks_per_node_from_env, resolve
    from megablu.train.trainer import preflight

    world = int(os.environ.get("WORLD_SIZE", 1))
    try:
        # the device decides one invariant (bf16 on CPU), so resolve it from the raw config first
        want = build_config(apply_overrides(load_raw(args.config), args.set), args.config).train.device
        device = ("cuda" if torch.cuda.is_available() else "cpu") if want == "auto" else want
        cfg = load_config(args.config, args.set, world_size=world, device=device)
        problems = preflight(cfg, resume=args.resume)
        topo = resolve(world, ranks_per_node_from_env(), cfg.parallel.sp)
        problems += [f"parallel.sp: {e}" for e in topo.errors]
        if problems:
            raise ConfigError(problems, args.config)
    except ConfigError as e:
        if rank == 0:
            print(str(e), file=sys.stderr)
        return 2
    if rank == 0:
        print(topo.format(), file=sys.stderr)   # nodes, dp x sp, which ranks share a node
        for w in config_warnings(cfg):
            logging.warning("config: %s", w)
    if device == "cpu":
        # DeepSpeed picks its accelerator at import; on CPU it must be told before that
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:
        # started as plain `python launch/ext32k.py`: a world of one (else DeepSpeed looks for MPI)
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))

    from megablu.train.probe import ProbeOOM
    from megablu.train.trainer import GateFailed, Trainer

    try:
        # libraries print chatter on stdout (DeepSpeed's op builds); stdout is for the result only
        with contextlib.redirect_stdout(sys.stderr):
            summary = Trainer(cfg, resume=args.resume, local_rank=args.local_rank).train()
    except ProbeOOM as e:   # the numbers measured so far and the planner's way out
        print(str(e), file=sys.stderr)
        return 1
    except GateFailed as e:   # trained and saved, but worse at short context than the parent
        if rank == 0:
            print(json.dumps(e.summary))
            print(f"eval gate FAILED: {e}", file=sys.stderr)
        return 1
    if rank == 0:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
