"""megablu training entry point (the script `deepspeed` launches).

  # CPU, 2 ranks (gloo), the tiny arm:
  deepspeed --num_gpus 2 launch/ext32k.py --config tests/configs/tiny_cpu_ext.yaml
  # 1 GPU (the 16k arms are written for sp=2 on 2 GPUs):
  deepspeed --num_gpus 1 launch/ext32k.py --config configs/l2.yaml --set parallel.sp=1
  # 2 GPUs, 16k -> 32k YaRN extension, sp=2 (the seed's ext_32k):
  deepspeed --num_gpus 2 launch/ext32k.py --config configs/ext32k.yaml
  # 4 GPUs, 16k -> 64k, sp=4:
  deepspeed --num_gpus 4 launch/ext32k.py --config configs/ext64k_4gpu.yaml
  # multi-node (see launch/hostfile.example; sp groups stay inside a node):
  deepspeed --hostfile launch/hostfile.example --master_addr node0 --master_port 29500 \
      launch/ext32k.py --config configs/ext64k_4gpu.yaml
  # any of them: --set train.max_steps=10 --set checkpoint.every_steps=5 ; --resume RUN_ID

The config is validated against the launch's world size and device, and every input is
checked (train/preflight.py, the same checks as `megablu config check`), before any rank
initialises distributed state; every problem is listed and the exit code is 2. Results (the
run summary) go to stdout on rank 0 as one JSON line, and with `--json FILE` to FILE too (under
`deepspeed` the launcher prints its own INFO lines on stdout); logs go to stderr. A rank that
fails prints one line (its traceback goes to runs/<id>/logs/) and, last, the command that
resumes the run; a rank whose launcher dies stops within a second.

This file is a shim: the entry is megablu/train/entry.py (`deepspeed --module
megablu.train.entry`, or `megablu train`, which resolves the launch first).
"""

import sys
from pathlib import Path

# the megablu beside this script, whatever is installed (a checkout next to an editable install)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megablu.train.entry import main, run  # noqa: E402, F401 - main: the in-process call tests make

if __name__ == "__main__":
    run()
