#!/usr/bin/env bash
# The CPU form (gloo, DS_ACCELERATOR=cpu): N processes on this machine, the tiny arm.
#   bash launch/cpu.sh --dry-run                          # 2 ranks, tiny_cpu_ext (sp=2)
#   bash launch/cpu.sh --set init_from=runs/<tiny parent> # train
#   bash launch/cpu.sh --num-gpus 4                       # 4 ranks: dp 2 x sp 2, same config
#   bash launch/cpu.sh --config tests/configs/tiny_cpu.yaml --num-gpus 1
# (--num-gpus counts processes here.) Options: see `megablu train -h`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export DS_ACCELERATOR=cpu
exec "$PY" -m megablu.cli train --device cpu --num-gpus 2 --config tests/configs/tiny_cpu_ext.yaml \
    --master-port "${MASTER_PORT:-29500}" "$@"
