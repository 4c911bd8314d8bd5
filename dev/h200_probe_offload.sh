#!/usr/bin/env bash
# One device call (~9.5 min): planner-vs-probe validation (blu-0.5b, 3 windows x 3 recompute
# modes, megablu ops) and then the ZeRO-Offload table, sharing the JIT builds:
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash dev/h200_probe_offload.sh")
# $OUT gets probe_validate.md/.json/.err and offload.md/.jsonl/.err (experiments/zero_offload/run.sh).
set -u
cd "$(dirname "$0")/.."
source dev/device_env.sh
OUT=${OUT:-/tmp/h200_out}; mkdir -p "$OUT"
t0=$SECONDS
# CPU Adam for the offload rows builds on the host CPUs while the GPU validates the planner.
python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
  > /tmp/cpu_adam_prebuild.log 2>&1 &
timeout "${PROBE_S:-230}" python bench/probe_validate.py --T 16k,64k,128k \
  --modes "${PROBE_MODES:-selective,full,none}" --ops auto > "$OUT/probe_validate.md" 2> "$OUT/probe_validate.err"
echo "probe validate exit $? after $((SECONDS - t0)) s" >> "$OUT/probe_validate.md"
wait
left=$(( ${TOTAL_S:-570} - (SECONDS - t0) ))
BUDGET_S=$left OUT=$OUT bash experiments/zero_offload/run.sh
echo "total $((SECONDS - t0)) s" >> "$OUT/offload.md"
