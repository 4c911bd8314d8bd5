#!/usr/bin/env bash
# ZeRO-Offload on ONE H200: largest trainable window + tokens/s per setting, blu-0.5b and a
# 1.53B shape (bench/offload_bench.py says how each number is measured). A row takes 100-135 s
# (35-70 s of it model init and DeepSpeed setup), so the ten rows take two or three device
# calls; a guard (BUDGET_S, default 450) skips what would not finish and says so. For example
# (bench/offload_table.py joins the calls' offload.jsonl into one table):
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="BUDGET_S=545 \
#       ROWS='blu-0.5b:z1 blu-0.5b:z2_opt blu-0.5b:z3_params blu-0.5b:z3_opt blu-0.5b:z3_opt_params' bash experiments/zero_offload/run.sh")
#   run(..., command="BUDGET_S=545 ROWS='blu-1.5b:z1 blu-1.5b:z2_opt blu-1.5b:z3_opt' bash experiments/zero_offload/run.sh")
#   run(..., command="BUDGET_S=545 ROWS='blu-1.5b:z3_params blu-1.5b:z3_opt_params' bash experiments/zero_offload/run.sh")
# ROWS='shape:setting ...' runs only those rows; ROW_S caps one row (default 240 s).
# Writes $OUT/offload.md (the table for experiments/zero_offload/README.md), $OUT/offload.jsonl (one row per
# run), $OUT/offload.err (stderr of every run).
set -u
cd "$(dirname "$0")/../.."
source dev/device_env.sh
OUT=${OUT:-/tmp/offload_out}; mkdir -p "$OUT"
deadline=$((SECONDS + ${BUDGET_S:-450}))
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
# CPU Adam JIT-builds on first use (~45 s on the 2-core box): build it on the host CPU while
# the no-offload baselines use the GPU.
python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
  > "$OUT/cpu_adam_build.log" 2>&1 &
build=$!
one() {  # shape setting   (ROWS="shape:setting ...": only those rows, e.g. the ones a guard skipped)
  if [ -n "${ROWS:-}" ] && [[ " $ROWS " != *" $1:$2 "* ]]; then return; fi
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 40 ]; then
    echo "{\"shape\": \"$1\", \"setting\": \"$2\", \"error\": \"not run: time budget\"}" >> "$OUT/offload.jsonl"; return
  fi
  local cap=${ROW_S:-240}   # a row takes 100-135 s; an OOM retry (fresh process) adds 60-100
  [ "$left" -gt "$cap" ] && left=$cap
  echo "=== $1 $2 ($(date +%T))" >> "$OUT/offload.err"
  timeout "$left" python bench/offload_bench.py --shape "$1" --setting "$2" >> "$OUT/offload.jsonl" 2>> "$OUT/offload.err"
  local rc=$?
  [ $rc -ne 0 ] && echo "{\"shape\": \"$1\", \"setting\": \"$2\", \"error\": \"exit $rc\"}" >> "$OUT/offload.jsonl"
}
one blu-0.5b z1
one blu-1.5b z1
wait $build; echo "cpu_adam build exit $?" >> "$OUT/cpu_adam_build.log"
for s in z2_opt z3_params z3_opt; do one blu-0.5b $s; done
for s in z2_opt z3_params z3_opt; do one blu-1.5b $s; done
one blu-1.5b z3_opt_params
one blu-0.5b z3_opt_params
{ echo "GPU: $(cat "$OUT/gpu.txt"). bf16, micro-batch 1, recompute selective, loss chunk 4096, one optimizer step per measurement."
  echo; python bench/offload_table.py "$OUT/offload.jsonl"; } > "$OUT/offload.md"
cat "$OUT/offload.md"
