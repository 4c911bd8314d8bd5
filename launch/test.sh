#!/usr/bin/env bash
# Run megablu's test suite on CPU (sets up .venv on first use). Extra args go to pytest.
#   bash launch/test.sh            # everything but opt-in slow tests
#   bash launch/test.sh tests/model -x
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
export DS_ACCELERATOR=cpu
# compile-only check of the CUDA sources when nvcc is present (no GPU needed)
python -m pytest "$@"
