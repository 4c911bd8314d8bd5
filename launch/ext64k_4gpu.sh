#!/usr/bin/env bash
# 4 GPUs on one node: 16k -> 64k YaRN at sp=4 (dp 1); at 64k tokens/rank = 16k (the
# seed's handoff: 64k does not fit 2 GPUs, fits 4 x H200 at sp=4).
#   bash launch/ext64k_4gpu.sh --dry-run
#   bash launch/ext64k_4gpu.sh --set train.max_steps=10
#   bash launch/ext64k_4gpu.sh --config configs/ext32k.yaml   # 32k on 4 GPUs: dp 2 x sp 2
# Options: see `megablu train -h`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}   # NVLink multicast off (see ext32k_2gpu.sh)
exec "$PY" -m megablu.cli train --device cuda --num-gpus 4 --config configs/ext64k_4gpu.yaml \
    --master-port "${MASTER_PORT:-29500}" "$@"
