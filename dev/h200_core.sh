#!/usr/bin/env bash
# One device call: GPU op tests + op bench, a few blu-0.5b training steps at T=16384 through
# the real entry (deepspeed --num_gpus 1), and the model memory/speed bench. Writes under $OUT.
# run from the repo root on the H200 with carry [".whl", "data_cache/gpu_cl100k"].
set -u
source dev/device_env.sh
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import torch, deepspeed, transformers; print(torch.__version__, deepspeed.__version__, transformers.__version__)" >> "$OUT/gpu.txt" 2>&1
( time timeout 200 python -m pytest -q -p no:cacheprovider tests/ops ) > "$OUT/ops_tests.txt" 2>&1
timeout 120 python bench/ops_bench.py > "$OUT/ops_bench.md" 2> "$OUT/ops_bench.err"
timeout 240 deepspeed --num_gpus 1 launch/ext32k.py --config configs/l2.yaml \
  --set data.path=data_cache/gpu_cl100k --set data.mode=pack --set data.bucket=all --set parallel.sp=1 \
  --set train.max_steps=6 --set train.tokens_per_step=65536 --set runs_dir="$OUT/runs" \
  --set checkpoint.every_steps=0 --set checkpoint.save_final=false --set eval.final=false \
  --set schedule.warmup_steps=2 --set schedule.decay_start=3 > "$OUT/train16k.out" 2> "$OUT/train16k.err"
echo "train exit $?" >> "$OUT/train16k.out"
timeout 200 python bench/train_bench.py --T 16384,32768 --modes none,selective,full --hf > "$OUT/train_bench.md" 2> "$OUT/train_bench.err"
echo done
