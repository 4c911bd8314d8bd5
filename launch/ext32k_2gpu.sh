#!/usr/bin/env bash
# 2 GPUs on one node: the seed's ext_32k, 16k -> 32k YaRN at sp=2 (dp 1).
#   bash launch/ext32k_2gpu.sh --dry-run                  # topology + command + config check; no GPU
#   bash launch/ext32k_2gpu.sh --set train.max_steps=10   # train (prints the topology first)
#   bash launch/ext32k_2gpu.sh --num-gpus 4               # same config on 4 GPUs: dp 2 x sp 2
#   bash launch/ext32k_2gpu.sh --config configs/l2.yaml   # another arm, same launch
# Options: see `megablu train -h` (--set, --resume, --master-port, --dry-run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
# NVLink SHARP (multicast) off: the lent H200 machines forbid it, and Ulysses' all-to-all
# over 2-8 GPUs gains nothing from it.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
exec "$PY" -m megablu.cli train --device cuda --num-gpus 2 --config configs/ext32k.yaml \
    --master-port "${MASTER_PORT:-29500}" "$@"
