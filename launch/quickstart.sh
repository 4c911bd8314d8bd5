#!/usr/bin/env bash
# megablu quick start on a fresh CPU machine (2 cores are enough, ~5 minutes after install):
#   1. set up .venv (torch 2.13.0 CPU first, then the pinned requirements, then megablu)
#   2. build a real dataset from the Python standard library sources (megablu data build)
#   3. pretrain a tiny BluModel at window 256 on 1 CPU rank            (yaml_configs/tiny_cpu.yaml)
#   4. YaRN-extend it x2 to window 512 with Ulysses sp=2 on 2 CPU ranks (yaml_configs/tiny_cpu_ext.yaml)
#   5. print a summary: losses, tokens/s, where the runs live
# usage: bash launch/quickstart.sh [--runs-dir DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=runs
[ "${1:-}" = "--runs-dir" ] && RUNS=$2
source launch/setup_env.sh
export DS_ACCELERATOR=cpu

STDLIB=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
if ! megablu data verify data_cache/stdlib --no-hash >/dev/null 2>&1; then
  megablu data build --input "$STDLIB" --include '*.py' --exclude '*/test/*' --exclude '*/site-packages/*' \
    --tokenizer tiktoken_file:megablu:stdlib4k --out data_cache/stdlib --max-bytes 4M --overwrite \
    --source-name python-stdlib --license PSF-2.0 --provenance "$STDLIB" --no-progress >&2
fi

last_json() { grep '^{' "$1" | tail -n 1; }
port=$((29500 + RANDOM % 400))
deepspeed --num_gpus 1 --master_port $port launch/ext32k.py --config yaml_configs/tiny_cpu.yaml \
  --set runs_dir="$RUNS" > "$RUNS.parent.json.tmp" || { echo "pretrain failed" >&2; exit 1; }
parent=$(last_json "$RUNS.parent.json.tmp" | python -c 'import json,sys; print(json.load(sys.stdin)["run_dir"])')
deepspeed --num_gpus 2 --master_port $((port + 1)) launch/ext32k.py --config yaml_configs/tiny_cpu_ext.yaml \
  --set runs_dir="$RUNS" --set init_from="$parent" > "$RUNS.ext.json.tmp" || { echo "extension failed" >&2; exit 1; }
ext=$(last_json "$RUNS.ext.json.tmp" | python -c 'import json,sys; print(json.load(sys.stdin)["run_dir"])')
python - "$parent" "$ext" <<'PY'
import json, sys
for name, d in zip(("pretrain (T=256, 1 rank)", "YaRN x2 extension (T=512, sp=2, 2 ranks)"), sys.argv[1:]):
    s = json.load(open(f"{d}/summary.json"))
    print(f"{name:44s} loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}  "
          f"{s['mean_tokens_per_s']:.0f} tokens/s  {s['steps']} steps  run: {d}")
PY
rm -f "$RUNS.parent.json.tmp" "$RUNS.ext.json.tmp"
