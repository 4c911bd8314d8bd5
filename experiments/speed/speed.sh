#!/usr/bin/env bash
# Issue 17 on ONE H200, one device call within BUDGET_S (default 240 s): where a blu-0.5b
# training step's GPU time goes (bench/profile_step.py), and megablu's chunked vocab loss
# against Liger's fused linear cross-entropy and Cut Cross-Entropy (bench/loss_bench.py).
#
#   here, once:  ../shared/device/wheels.sh liger-kernel==0.8.5 cut-cross-entropy==25.1.1
#   the call:    run(kind="nvidia-h200", carry=[".whl"], timeout_s=330,
#                    command="BUDGET_S=240 bash experiments/speed/speed.sh")
#
# Order, most valuable first; each part under dev/guard.sh's deadline (seconds since start):
#   0. megablu's csrc ops JIT build (`python -m megablu.ops.builder --build`, ~25-60 s on a fresh
#      machine, ~1 s when ~/.cache/torch_extensions holds it) runs in the BACKGROUND from t=0 and
#      fills that cache; every later process loads the extension from it. While it builds, the
#      loss bench does what needs no quiet GPU: imports, the fp32 references, each library's
#      first call (Triton/inductor compiles) and the exactness checks. Its timings start only
#      once the build's marker file exists (loss_bench --wait-for), so no timing overlaps nvcc.
#   1. loss bench at 32k then 128k (deadline min(110, BUDGET_S-120) s)
#   2. profile T=32768: selective+offload, selective (2 plain steps timed each; the first's
#      chrome trace kept, gzip'd, when under 15 MiB)
#   3. profile T=131072: selective+offload, selective (no plain step: the profiled one is
#      timed; a case that no longer fits the budget is recorded as skipped)
#   4. speed.md: the side-by-side profile table, the loss table, each case's tables, the timeline
# Expected on the H200 (estimates from BENCHMARKS.md's step times, not measured as a sequence):
# device_env ~10 s; build 25-60 s (background); loss ~70 s (exactness/compiles ~40 s, timings
# ~5 s at 32k and ~20 s at 128k); profile 32k ~45 s (2 cases, trace export ~5 s); profile 128k
# ~65 s (2 cases of warm-up + profiled step, ~11.5 s each); report ~3 s: ~200 s in all.
# $OUT (the device tool returns at most 8 files): speed.md, profile_<T>_<mode>.json (4),
# loss_bench.json, trace_32768_selective-offload.json.gz, logs.tar.gz (every part's stdout/stderr,
# timeline.tsv, nvidia-smi).
# REHEARSE_CPU=1: the same sequence on a CPU at toy shapes (no device_env, the build is a sleep,
# the benches' own CPU modes): checks the order, deadlines, marker, files and report here.
set -u
cd "$(dirname "$0")/../.."
T0=$SECONDS
BUDGET_S=${BUDGET_S:-240}
OUT=${OUT:-/tmp/h200_speed}
WORK=${WORK:-/tmp/h200_speed_work}
mkdir -p "$OUT" "$WORK/logs"
: > "$WORK/timeline.tsv"
rm -f "$WORK/build.done"
source dev/guard.sh
if [ "${REHEARSE_CPU:-0}" = 1 ]; then
  build=(sleep 3)
  loss=(--device cpu --T 64,96 --d 32 --V 200 --iters 2)
  p32=(--rehearse-cpu --T 256); p128=(--rehearse-cpu --T 384)
  echo "REHEARSE_CPU=1: toy shapes on the CPU" > "$WORK/logs/nvidia-smi.txt"
  python -c 'import torch' 2> /dev/null || {   # else every part fails in its log and the report is empty
    echo "REHEARSE_CPU=1: python ($(command -v python)) cannot import torch; put the venv's bin first:" \
      "PATH=.venv/bin:\$PATH" >&2; exit 1; }
else
  build=(python -m megablu.ops.builder --build)
  loss=(--T 32768,131072)
  p32=(--T 32768); p128=(--T 131072)
  env_ok=1
  source dev/device_env.sh || env_ok=0
  printf 'device_env\t0\t%d\t%s\n' "$(now)" "$([ $env_ok = 1 ] && echo 0 || echo 'FAILED: is .whl carried?')" \
    >> "$WORK/timeline.tsv"
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv \
    > "$WORK/logs/nvidia-smi.txt" 2>&1
fi
min() { [ "$1" -lt "$2" ] && echo "$1" || echo "$2"; }
left_to() { local l=$(( $1 - $(now) - 3 )); [ "$l" -lt 1 ] && l=1; echo "$l"; }   # a part's own budget

# 0. the ops build, in the background; its marker lets the loss bench's timings start
( guard build $(( BUDGET_S - 30 )) "${build[@]}"; echo $? > "$WORK/build.done" ) &
build_pid=$!

# 1. the loss bench (exactness while the build runs, timings after it)
dl=$(min 110 $(( BUDGET_S - 120 )))
guard loss "$dl" python bench/loss_bench.py "${loss[@]}" --out "$OUT" --wait-for "$WORK/build.done" \
  --wait-max 100 --budget-s "$(left_to "$dl")"
wait "$build_pid"

# 2. profile at 32k, then 3. at 128k
dl=$(( BUDGET_S - 90 )); [ "$dl" -lt $(( $(now) + 45 )) ] && dl=$(min $(( $(now) + 45 )) "$BUDGET_S")
guard prof32k "$dl" python bench/profile_step.py "${p32[@]}" --modes selective+offload,selective --timed 2 \
  --trace-mode selective+offload --out "$OUT" --budget-s "$(left_to "$dl")"
dl=$(( BUDGET_S - 4 ))
guard prof128k "$dl" python bench/profile_step.py "${p128[@]}" --modes selective+offload,selective --timed 0 \
  --micro-reps 3 --out "$OUT" --budget-s "$(left_to "$dl")"

# 4. the report (CPU only, a few seconds: runs even when the budget is spent)
rm -f "$OUT"/*.tmp
{
  echo "# issue 17: step profile and loss libraries ($(date -u '+%Y-%m-%d %H:%M UTC'), BUDGET_S=$BUDGET_S)"
  echo
  cat "$WORK/logs/nvidia-smi.txt"
  echo
  echo "## Where a step's time goes (bench/profile_step.py; per case below)"
  echo
  timeout 30 python bench/profile_step.py --summarize "$OUT"/profile_*.json 2>&1
  echo
  echo "## Loss through the lm head (bench/loss_bench.py)"
  echo
  if [ -f "$OUT/loss_bench.json" ]; then timeout 30 python bench/loss_bench.py --render "$OUT/loss_bench.json" 2>&1
  else echo "loss_bench.json missing (see logs/loss.err)"; fi
  echo
  echo "## Each case"
  echo
  cat "$WORK/logs/prof32k.out" "$WORK/logs/prof128k.out" 2>/dev/null
  echo
  echo "## Timeline (part, start s, end s, exit code; 124 = stopped by its deadline)"
  echo
  echo '```'
  cat "$WORK/timeline.tsv"
  echo '```'
} > "$OUT/speed.md"
tar czf "$OUT/logs.tar.gz" -C "$WORK" logs timeline.tsv
sed -n '/^## Where/,/^## Each case/p' "$OUT/speed.md"     # the tables, into the call's output tail
cat "$WORK/timeline.tsv"
ls -la "$OUT"
echo "h200_speed.sh: $(now) s of BUDGET_S=$BUDGET_S"
