#!/usr/bin/env bash
# Issue 17's two kernel choices on ONE H200, in two warm calls: memory.loss=liger (Liger's fused
# linear cross-entropy, liger-kernel 0.8.5) and memory.attention=fa4 (FlashAttention-4 4.0.0b40).
# Checks them against today's paths (the GPU tests), then measures a blu-0.5b step at 32k and 128k
# with them against today's in the same call (bench/profile_step.py: train_bench's build and step).
#
# Here, once per checkout (git-ignored folders do not travel between sessions; ~110 MB download):
#   ../shared/device/wheels.sh liger-kernel==0.8.5      # .whl: deepspeed, pydantic ..., liger (~8.5 MB)
#   ../shared/device/fa4_wheels.sh                     # .fa4a (~50 MB), .fa4b (~45 MB + fa4_env.sh)
#   du -sh .whl .fa4a .fa4b                             # a call carries <= 64 MiB with the tree (~4.4 MB)
# The calls, back to back (a machine idle 30 s is given back, and /tmp/fa4 with it):
#   1. run(kind="nvidia-h200", carry=[".fa4a"], timeout_s=240, command="PHASE=1 bash experiments/speed/kernels.sh")
#        copies .fa4a to /tmp/fa4 and JIT-builds megablu's csrc ops into ~/.cache/torch_extensions
#        (25-60 s on a fresh machine; torch only, no .whl needed); $OUT/phase1.txt
#   2. run(kind="nvidia-h200", carry=[".fa4b", ".whl"], timeout_s=600,
#          command="PHASE=2 BUDGET_S=530 bash experiments/speed/kernels.sh")
#        within BUDGET_S seconds of its start, most valuable first, each part under dev/guard.sh:
#        a. .fa4b's fa4_env.sh (join + sha256 + unzip every FA4 wheel to /tmp/fa4site), /tmp/fa4/env.sh,
#           dev/device_env.sh (.whl); versions.txt (FA4_DISK_CACHE=1: FA4's on-disk kernel cache, so
#           that the bench processes load what the tests compiled; off by default)    (~20-30 s)
#        b. the GPU tests (deadline 200 s): tests/ops/test_attention.py (FA4 vs SDPA and an fp32
#           reference, fwd + dq/dk/dv, 7 shapes), tests/model/test_kernel_choices.py (tiny BluModel:
#           liger vs chunked and fa4 vs sdpa, loss/dh/dW/every grad, bf16), tests/ops/test_cross_entropy.py;
#           JUnit XML -> tests.xml; FA4 compiles one kernel pair per shape class at its first call
#           (the unknown of this call: budgeted ~10 s each, ~8 classes)                  (~60-170 s)
#        c. the step at T=32768, blu-0.5b, selective+offload (the issue's headline mode), in this order:
#           today's (chunked + sdpa), +liger+fa4, +fa4, +liger; 2 timed plain steps + 1 profiled each
#           (the warm-up step's time includes the first-call compiles; deadline BUDGET_S-150)  (~25 s each)
#        d. the step at T=131072: +liger+fa4, then today's; the profiled step is the timed one
#           (deadline BUDGET_S-45)                                                           (~40 s each)
#        e. loss bench at T=131072 (megablu chunk 4096 vs Liger accum fp32), never reached before
#           (deadline BUDGET_S-8), if time is left                                           (~40 s)
#        f. kernels.md: versions, the tests' outcome, the gains table (tokens/s vs today's at each T),
#           the side-by-side profile, the timeline
#   A call 2 that fails in (a) (the machine was not warm: /tmp/fa4 is gone) says so in kernels.md:
#   repeat call 1, then call 2 at once.
# $OUT (at most 8 files come back): kernels.md, tests.xml, versions.txt, profiles.tar.gz (every
# profile_<T>_<mode>.json), loss_bench.json, logs.tar.gz (every part's stdout/stderr, timeline.tsv,
# nvidia-smi); phase 1: phase1.txt.
# REHEARSE_CPU=1: the same sequence on this CPU at toy shapes (no wheels, the build is a sleep, the
# GPU tests skip, the benches' CPU modes): checks the order, deadlines, files and report here. With
# REHEARSE_SITE=<a site holding triton + liger-kernel> the liger cases run in Triton's interpreter;
# the fa4 cases end in their clear CPU error (recorded, the call goes on).
set -u
cd "$(dirname "$0")/../.."
T0=$SECONDS
PHASE=${PHASE:-2}
BUDGET_S=${BUDGET_S:-530}
OUT=${OUT:-/tmp/h200_kernels}
WORK=${WORK:-/tmp/h200_kernels_work}
FA4_DIR=${FA4_DIR:-/tmp/fa4}
REHEARSE=${REHEARSE_CPU:-0}
mkdir -p "$OUT" "$WORK/logs" "$WORK/prof"
source dev/guard.sh
min() { [ "$1" -lt "$2" ] && echo "$1" || echo "$2"; }
left_to() { local l=$(( $1 - $(now) - 3 )); [ "$l" -lt 1 ] && l=1; echo "$l"; }   # a part's own budget

if [ "$PHASE" = 1 ]; then
  : > "$WORK/timeline.tsv"
  mkdir -p "$FA4_DIR"
  if [ -d .fa4a ]; then cp .fa4a/* "$FA4_DIR"/; fi
  if [ "$REHEARSE" = 1 ]; then build=(sleep 1); else build=(python3 -m megablu.ops.builder --build); fi
  export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1     # what dev/device_env.sh sets (the image's 9.0a breaks it)
  guard build "$(min 200 $(( BUDGET_S - 5 )))" "${build[@]}"
  {
    echo "phase 1 ($(now) s): $FA4_DIR holds:"; ls -la "$FA4_DIR"
    echo; echo "csrc build (rc in the timeline):"; tail -5 "$WORK/logs/build.out" "$WORK/logs/build.err" 2>/dev/null
    echo; cat "$WORK/timeline.tsv"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1
  } > "$OUT/phase1.txt"
  cat "$OUT/phase1.txt"
  exit 0
fi

: > "$WORK/timeline.tsv"
# a. the environment
env_note=""
if [ "$REHEARSE" = 1 ]; then
  echo "REHEARSE_CPU=1: toy shapes on the CPU" > "$WORK/logs/nvidia-smi.txt"
  export DS_ACCELERATOR=cpu
  if [ -n "${REHEARSE_SITE:-}" ]; then export PYTHONPATH="$REHEARSE_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=1; fi
  p32=(--rehearse-cpu --T 256); p128=(--rehearse-cpu --T 384); loss=(--device cpu --T 96 --d 32 --V 200 --iters 1)
else
  start=$(now)
  if [ -f .fa4b/fa4_env.sh ] && [ -d "$FA4_DIR" ] && cp .fa4b/* "$FA4_DIR"/ && bash .fa4b/fa4_env.sh \
      && source "$FA4_DIR/env.sh"; then fa4_rc=0
  else fa4_rc=1; env_note="FA4 wheels NOT installed (was call 1 made just before, on this warm machine? .fa4b carried?): "
       env_note+="the fa4 cases will fail with memory.attention=fa4's import error"; fi
  printf 'fa4_env\t%d\t%d\t%d\n' "$start" "$(now)" "$fa4_rc" >> "$WORK/timeline.tsv"
  start=$(now)
  source dev/device_env.sh; env_rc=$?
  printf 'device_env\t%d\t%d\t%d\n' "$start" "$(now)" "$env_rc" >> "$WORK/timeline.tsv"
  [ "$env_rc" = 0 ] || env_note+=" dev/device_env.sh FAILED (is .whl carried?)"
  # FA4's on-disk kernel cache (opt-in, FA4_DISK_CACHE=1): later processes would load the kernels the
  # tests compiled instead of compiling again; off by default, since its load path is one more unknown
  if [ "${FA4_DISK_CACHE:-0}" = 1 ]; then
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$WORK/fa4_cache
  fi
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv \
    > "$WORK/logs/nvidia-smi.txt" 2>&1
  p32=(--T 32768); p128=(--T 131072); loss=(--T 131072 --iters 3)
fi
python3 - > "$OUT/versions.txt" 2>&1 <<'PY'
import importlib.metadata as md
for d in ("torch", "triton", "liger-kernel", "flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13",
          "quack-kernels", "apache-tvm-ffi", "deepspeed", "pydantic"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "not installed")
from megablu.ops.attention import import_problem
from megablu.ops.cross_entropy import liger_import_problem
print("flash_attn.cute:", import_problem() or "imports")
print("liger_kernel:", liger_import_problem() or "imports")
PY

# b. the GPU tests of both choices (skip cleanly where a library or the GPU is missing)
guard tests $(min 200 $(( BUDGET_S - 200 ))) python3 -m pytest -q -p no:cacheprovider -rs --durations=25 \
  --junitxml="$OUT/tests.xml" tests/ops/test_attention.py tests/model/test_kernel_choices.py \
  tests/ops/test_cross_entropy.py

# c. 32k: today's, both, each alone (selective+offload: the issue's headline mode)
base=selective+offload
dl=$(( BUDGET_S - 150 )); [ "$dl" -lt $(( $(now) + 60 )) ] && dl=$(min $(( $(now) + 60 )) "$BUDGET_S")
guard prof32k "$dl" python3 bench/profile_step.py "${p32[@]}" \
  --modes "$base,$base+liger+fa4,$base+fa4,$base+liger" --timed 2 --micro-reps 3 --out "$WORK/prof" \
  --budget-s "$(left_to "$dl")"
# d. 128k: both, then today's (today's was measured on 2026-12-04 too: 11532 tokens/s profiled)
dl=$(( BUDGET_S - 45 ))
guard prof128k "$dl" python3 bench/profile_step.py "${p128[@]}" --modes "$base+liger+fa4,$base" --timed 0 \
  --micro-reps 2 --out "$WORK/prof" --budget-s "$(left_to "$dl")"
# e. the loss alone at 128k, if time is left
dl=$(( BUDGET_S - 8 ))
[ $(( dl - $(now) )) -gt 30 ] && guard loss128k "$dl" python3 bench/loss_bench.py "${loss[@]}" \
  --impls megablu,liger_fp32acc --out "$OUT" --budget-s "$(left_to "$dl")"

# f. the report (CPU only, a few seconds: runs even when the budget is spent)
rm -f "$OUT"/*.tmp
{
  echo "# issue 17: memory.loss=liger and memory.attention=fa4 on the H200 ($(date -u '+%Y-%m-%d %H:%M UTC'), BUDGET_S=$BUDGET_S)"
  echo
  [ -n "$env_note" ] && { echo "**$env_note**"; echo; }
  cat "$WORK/logs/nvidia-smi.txt"; echo; echo '```'; cat "$OUT/versions.txt"; echo '```'
  echo
  echo "## GPU tests (tests.xml; pytest's summary)"
  echo; echo '```'; tail -45 "$WORK/logs/tests.out" 2>/dev/null; tail -5 "$WORK/logs/tests.err" 2>/dev/null; echo '```'
  echo
  echo "## The step with each choice against today's (bench/profile_step.py, blu-0.5b, bf16, batch 1, csrc ops)"
  echo
  timeout 30 python3 bench/profile_step.py --summarize "$WORK"/prof/profile_*.json --baseline "$base" 2>&1
  echo
  if [ -f "$OUT/loss_bench.json" ]; then
    echo "## Loss through the lm head at 128k (bench/loss_bench.py)"; echo
    timeout 30 python3 bench/loss_bench.py --render "$OUT/loss_bench.json" 2>&1; echo
  fi
  echo "## Each case"
  echo
  cat "$WORK/logs/prof32k.out" "$WORK/logs/prof128k.out" 2>/dev/null
  echo
  echo "## Timeline (part, start s, end s, exit code; 124 = stopped by its deadline)"
  echo; echo '```'; cat "$WORK/timeline.tsv"; echo '```'
} > "$OUT/kernels.md"
tar czf "$OUT/profiles.tar.gz" -C "$WORK" prof 2>/dev/null
tar czf "$OUT/logs.tar.gz" -C "$WORK" logs timeline.tsv
sed -n '/^## GPU tests/,/^## Each case/p' "$OUT/kernels.md"     # into the call's output tail
cat "$WORK/timeline.tsv"
ls -la "$OUT"
echo "h200_kernels.sh: $(now) s of BUDGET_S=$BUDGET_S"
