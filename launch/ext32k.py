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
    from megablu.train.trainer import preflight

    world = int(os.environ.get("WORLD_SIZE", 1))
    try:
        # the device decides one invariant (bf16 on CPU), so resolve it from the raw config first
        want = build_config(apply_overrides(load_raw(args.config), args.set), args.config).train.device
        device = ("cuda" if torch.cuda.is_available() else "cpu") if want == "auto" else want
        cfg = load_config(args.config, args.set, world_size=world, device=device)
        problems = preflight(cfg, resume=args.resume)
        if problems:
            raise ConfigError(problems, args.config)
    except ConfigError as e:
        if rank == 0:
            print(str(e), file=sys.stderr)
        return 2
    if rank == 0:
        for w in config_warnings(cfg):
            logging.warning("config: %s", w)
    if device == "cpu":
        # DeepSpeed picks its accelerator at import; on CPU it must be told before that
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from megablu.train.trainer import Trainer

    summary = Trainer(cfg, resume=args.resume, local_rank=args.local_rank).train()
    if rank == 0:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
