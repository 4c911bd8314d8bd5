#!/usr/bin/env bash
# One device call: (1) blu-0.5b through the real entry at T=16384 (parent run, final
# checkpoint), (2) a YaRN 2x extension of that parent to T=32768 through the entry with
# init_from, (3) the model bench with the fused CUDA ops vs pure torch at 16k..128k.
# Repo root on the H200, carry [".whl", "data_cache/gpu_cl100k"]. Writes under $OUT.
set -u
source dev/device_env.sh
common=(--set data.path=data_cache/gpu_cl100k --set data.mode=pack --set data.bucket=all --set parallel.sp=1
        --set runs_dir=/tmp/runs --set checkpoint.every_steps=0 --set eval.final=false --set train.probe_steps=0)
timeout 200 deepspeed --num_gpus 1 launch/ext32k.py --config configs/l2.yaml "${common[@]}" \
  --set train.max_steps=6 --set train.tokens_per_step=65536 --set schedule.warmup_steps=2 \
  --set schedule.decay_start=3 > "$OUT/l2.out" 2> "$OUT/l2.err"
echo "l2 exit $?" >> "$OUT/l2.out"
parent=$(grep '^{' "$OUT/l2.out" | tail -1 | python -c 'import json,sys; print(json.load(sys.stdin)["run_dir"])')
cat "$parent/metrics.csv" >> "$OUT/l2.out"; ls -la "$parent/checkpoints"/* >> "$OUT/l2.out" 2>&1
timeout 200 deepspeed --num_gpus 1 launch/ext32k.py --config configs/ext32k.yaml "${common[@]}" \
  --set init_from="$parent" --set train.max_steps=4 --set train.tokens_per_step=65536 \
  --set schedule.warmup_steps=1 --set schedule.decay_start=2 > "$OUT/ext32k.out" 2> "$OUT/ext32k.err"
echo "ext32k exit $?" >> "$OUT/ext32k.out"
ext=$(grep '^{' "$OUT/ext32k.out" | tail -1 | python -c 'import json,sys; print(json.load(sys.stdin)["run_dir"])')
cat "$ext/metrics.csv" >> "$OUT/ext32k.out"
timeout 330 python bench/train_bench.py --T 16384,32768,65536,131072 --modes selective,full --ops cuda,torch \
  > "$OUT/train_bench.md" 2> "$OUT/train_bench.err"
echo done
