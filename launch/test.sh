#!/usr/bin/env bash
# Run megablu's tests on CPU (sets up .venv on first use). Two tiers (pytest.ini markers):
#   bash launch/test.sh                  # the fast tier: unit and CPU-distributed tests
#   bash launch/test.sh --all            # every tier, as CI (.ci/run) runs them: the fast tier plus
#                                        # the end-to-end runs (e2e) and bench rehearsals (bench)
#   bash launch/test.sh --rest           # only what the fast tier leaves out
#   bash launch/test.sh tests/model -x   # extra args go to pytest (after the tier's -m: a -m of
#                                        # yours replaces it, e.g. MEGABLU_SLOW=1 ... -m slow)
set -euo pipefail
cd "$(dirname "$0")/.."
FAST="not e2e and not bench and not slow"
case "${1:-}" in
  --all) shift; tier=() ;;
  --rest) shift; tier=(-m "not ($FAST)") ;;
  *) tier=(-m "$FAST") ;;
esac
source launch/setup_env.sh
export DS_ACCELERATOR=cpu
python -m pytest ${tier[@]+"${tier[@]}"} "$@"
