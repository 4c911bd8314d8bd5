#!/usr/bin/env bash
# ZeRO-Offload on ONE H200: largest trainable window + tokens/s per setting, blu-0.5b and a
# 1.53B shape (bench/offload_bench.py says how each number is measured). One device command,
# ~8 min (a 450 s guard skips what would not finish; skipped rows say so):
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600,
#       command="bash bench/offload_bench.sh")
# ROWS="blu-1.5b:z1 blu-0.5b:z3_params ..." runs only those rows.
# Writes $OUT/offload.md (the table for docs/EXPERIMENTS.md), $OUT/offload.jsonl (one row per
# run), $OUT/offload.err (stderr of every run).
set -u
cd "$(dirname "$0")/.."
source launch/device_env.sh
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
  [ "$left" -gt 150 ] && left=150
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
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
merged = {}   # a run prints its fit first and the verified row last; an error row adds to them
for line in open(f"{out}/offload.jsonl"):
    if line.startswith("{"):
        r = json.loads(line)
        merged.setdefault((r["shape"], r["setting"]), {}).update(r)
rows = list(merged.values())
gpu = open(f"{out}/gpu.txt").read().strip()
base = {r["shape"]: r for r in rows if r.get("setting") == "z1" and "tok_s_at_fit" in r}
name = {"z1": "ZeRO-1, no offload", "z2_opt": "ZeRO-2 + optimizer offload", "z3_opt": "ZeRO-3 + optimizer offload",
        "z3_params": "ZeRO-3 + param offload", "z3_opt_params": "ZeRO-3 + optimizer + param offload"}
L = [f"GPU: {gpu}. bf16, micro-batch 1, recompute selective, loss chunk 4096, one optimizer step per measurement.", "",
     "| shape | setting | params | static GB | MB/token | largest window | vs no offload | tok/s @16k | vs no offload | tok/s @largest |",
     "|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    if "error" in r and "tok_s_at_fit" not in r:
        L.append(f"| {r['shape']} | {name.get(r['setting'], r['setting'])} | | | | {r['error']} | | | | |")
        continue
    b = base.get(r["shape"])
    if r.get("max_T"):
        mx = f"{r['max_T']:,}" + (" (OOM at " + ", ".join(f"{x:,}" for x in r["oom_at"]) + ")" if r.get("oom_at") else "")
    elif r.get("oom_at"):
        mx = f"none verified (OOM at {r['oom_at']})"
    else:
        mx = f"{r['predicted_T']:,} predicted, not verified ({r.get('error', 'no verify row')})"
    rel_T = f"{r['max_T'] / b['max_T']:.2f}x" if b and b.get("max_T") and r.get("max_T") else ""
    rel_s = f"{r['tok_s_at_fit'] / b['tok_s_at_fit']:.2f}x" if b else ""
    at_max = f"{r['tok_s_at_max']:,}" if r.get("tok_s_at_max") else ""
    L.append(f"| {r['shape']} | {name[r['setting']]} | {r['params_b']}B | {r['static_gb']} | {r['mb_per_token']} | "
             f"{mx} | {rel_T} | {r['tok_s_at_fit']:,} | {rel_s} | {at_max} |")
open(f"{out}/offload.md", "w").write("\n".join(L) + "\n")
print("\n".join(L))
PY
