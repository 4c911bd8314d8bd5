#!/usr/bin/env bash
# Issue 8, the real replication, in ONE device call (<= 9.5 min):
#   1. pretrain rep_pretrain (55M BluModel, window 2048, demo corpus + recall docs)   ~3-4 min
#   2. at once on the same GPU: YaRN x4 -> 8192 on fitting documents (rep_ext_fit) and on
#      truncated longer ones (rep_ext_trunc, the control), same token budget, both init_from
#      the parent's newest verified checkpoint; and the evals of the parent (native rope)
#      and of the parent with YaRN x4 and no fine-tuning                               ~1-1.5 min
#   3. the evals of both arms (passkey + needle, 256..8168 tokens, n=300 per cell)     ~1 min
#   4. `megablu compare` (table with Newcombe CIs, pp/doubling, effective length, gate
#      against the parent, plot) and the report
# Each phase has a deadline (time guard), so a slow phase is cut and what finished still
# comes back. $OUT gets at most 3 files: report.md, compare.png, results.tar.gz (eval jsons,
# metrics.csv, resolved configs, probe.json, logs).
#
# Data first, here (git-ignored, ~37 MB): bash experiments/replication/data.sh
# On the H200 (the lead's call):
#   run(kind="nvidia-h200", timeout_s=600, carry=[".whl", "data_cache/rep"],
#       command="bash experiments/replication/run.sh")
# CPU rehearsal, same script at tiny scale (2-core box, ~10 min):
#   REP_SCALE=cpu OUT=/tmp/rep_out bash experiments/replication/run.sh
# Knobs: REP_BUDGET_S (whole script), REP_PRE_STEPS, REP_EXT_STEPS, REP_N (prompts per cell).
set -u
cd "$(dirname "$0")/../.."
SCALE=${REP_SCALE:-h200}
OUT=${OUT:-/tmp/rep_out}
WORK=${REP_WORK:-/tmp/rep_$SCALE}
mkdir -p "$OUT"
rm -rf "$WORK"
mkdir -p "$WORK/logs" "$WORK/eval" "$WORK/runs"
T0=$SECONDS

MODEL=()   # shape overrides (cpu scale): every train and eval command gets them
case $SCALE in
  h200)
    BUDGET=${REP_BUDGET_S:-555}
    source dev/device_env.sh || { echo "dev/device_env.sh failed" > "$OUT/report.md"; exit 1; }
    PY=python3
    PRE=(--set train.max_steps=${REP_PRE_STEPS:-1200})
    # the schedule's decay tail is the last 20% of whatever step count is used
    [ -n "${REP_PRE_STEPS:-}" ] && PRE+=(--set schedule.decay_start=$(( REP_PRE_STEPS * 4 / 5 )))
    EXT=()
    [ -n "${REP_EXT_STEPS:-}" ] && EXT+=(--set train.max_steps=$REP_EXT_STEPS
                                         --set schedule.decay_start=$(( REP_EXT_STEPS * 4 / 5 )))
    FIT=(); TRUNC=()
    WIN=8192
    LENGTHS=(256 512 1024 2024 4072 8168)
    SHORT=(512 2024)
    N=${REP_N:-300}
    BT=524288   # prompts per eval batch = this // length: 64 prompts at 8168 tokens
    ;;
  cpu)
    BUDGET=${REP_BUDGET_S:-1500}
    [ -f .venv/bin/activate ] && source .venv/bin/activate
    export DS_ACCELERATOR=cpu
    # DeepSpeed JIT-builds shm_comm at init_distributed on CPU: a private cache, so that a process
    # killed mid-build elsewhere (a stale lock) cannot hang the rehearsal (one ~40 s build on first use)
    export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/rep_torch_extensions}
    PY=python3
    MODEL=(--set model.n_layers=2 --set model.d_model=64 --set model.n_heads=4 --set model.n_kv_heads=4
           --set model.ffn_dim=176 --set train.dtype=fp32 --set train.device=cpu --set train.probe_steps=0)
    PRE=(--set data.window=256 --set train.max_steps=${REP_PRE_STEPS:-40} --set train.tokens_per_step=4096
         --set train.micro_batch=16 --set schedule.warmup_steps=4 --set schedule.decay_start=32
         --set checkpoint.every_steps=20 --set "eval.lengths=[128,232]")
    EXT=(--set rope.yarn.original_max_position=256 --set data.window=1024 --set train.max_steps=${REP_EXT_STEPS:-6}
         --set train.tokens_per_step=2048 --set train.micro_batch=2 --set schedule.warmup_steps=1
         --set schedule.decay_start=4 --set "eval.lengths=[128,232,488,1000]")
    FIT=(--set data.bucket=b0)   # at window 1024 no 4k-8k document fits; the 0-4k bucket has some that do
    TRUNC=()
    WIN=1024
    LENGTHS=(128 232 488 1000)
    SHORT=(128 232)
    N=${REP_N:-6}
    BT=16384
    ;;
  *) echo "REP_SCALE must be h200 or cpu, not $SCALE" >&2; exit 2 ;;
esac
PRE_END=$(( BUDGET * 68 / 100 ))    # pretrain must be done (h200: 377 s)
EXT_END=$(( BUDGET * 84 / 100 ))    # extension arms (h200: 466 s)
EVAL_END=$(( BUDGET * 96 / 100 ))   # every eval (h200: 532 s); then compare + report

source dev/guard.sh
finish() {   # the report and the tarball; called after every phase, so a cut call still returns them
  $PY dev/rep_tools.py report "$WORK" "$OUT/report.md" --scale "$SCALE" 2>> "$WORK/logs/report.err"
  tar czf "$OUT/results.tar.gz.tmp" --exclude=checkpoints --exclude=tb -C "$WORK" . 2>/dev/null \
    && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
}
PORT0=$(( 29500 + RANDOM % 400 ))
train() {   # train NAME DEADLINE PORT CONFIG args...   (runs at once get distinct master ports)
  local name=$1 dl=$2 port=$3 cfg=$4; shift 4
  guard "$name" "$dl" deepspeed --num_gpus 1 --master_port "$port" launch/ext32k.py --config "$cfg" \
    --set runs_dir="$WORK/runs" "${MODEL[@]}" "$@"
}
evaluate() {   # evaluate ARM CONFIG CKPT args...
  local arm=$1 cfg=$2 ck=$3; shift 3
  guard "eval_$arm" "$EVAL_END" $PY -m megablu.cli eval --config "$cfg" --ckpt "$ck" --arm "$arm" \
    --out "$WORK/eval/$arm" --lengths "${LENGTHS[@]}" --n "$N" --batch-tokens "$BT" --no-plot \
    --set data.window=$WIN --set "eval.lengths=[$(IFS=,; echo "${LENGTHS[*]}")]" "${MODEL[@]}" "$@"
}

$PY dev/rep_tools.py env "$WORK/env.txt" 2> "$WORK/logs/env.err"
echo "scale $SCALE, budget ${BUDGET}s: pretrain by ${PRE_END}s, arms by ${EXT_END}s, evals by ${EVAL_END}s" >> "$WORK/env.txt"
GPU_LOG=
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 > "$WORK/logs/gpu.csv" 2>&1 &
  GPU_LOG=$!
fi

# ---- 1. pretrain
train rep_pretrain "$PRE_END" $PORT0 experiments/replication/rep_pretrain.yaml "${PRE[@]}"
PARENT=$($PY dev/rep_tools.py newest "$WORK/runs" rep_pretrain 2>> "$WORK/logs/newest.err")
finish
if [ -z "$PARENT" ]; then
  echo "no parent checkpoint; see logs/rep_pretrain.err" >> "$OUT/report.md"
  [ -n "$GPU_LOG" ] && kill "$GPU_LOG"
  exit 1
fi

# ---- 2. both arms at once, and the parent's evals beside them
train rep_ext_fit "$EXT_END" $(( PORT0 + 1 )) experiments/replication/rep_ext_fit.yaml --set init_from="$PARENT" "${EXT[@]}" "${FIT[@]}" &
P_FIT=$!
train rep_ext_trunc "$EXT_END" $(( PORT0 + 2 )) experiments/replication/rep_ext_trunc.yaml --set init_from="$PARENT" "${EXT[@]}" "${TRUNC[@]}" &
P_TRUNC=$!
# the parent natively (beyond 2048 it extrapolates RoPE) and with YaRN x4 but no fine-tuning
evaluate parent experiments/replication/rep_pretrain.yaml "$PARENT" &
P_EV1=$!
evaluate parent_yarn4 experiments/replication/rep_ext_fit.yaml "$PARENT" "${EXT[@]}" --rope-override &
P_EV2=$!
wait $P_FIT $P_TRUNC
finish

# ---- 3. the arms' evals
EVALS=($P_EV1 $P_EV2)
for arm in fit trunc; do
  ck=$($PY dev/rep_tools.py newest "$WORK/runs" rep_ext_$arm 2>> "$WORK/logs/newest.err")
  if [ -n "$ck" ]; then
    evaluate ext_$arm experiments/replication/rep_ext_$arm.yaml "$ck" "${EXT[@]}" &
    EVALS+=($!)
  fi
done
wait "${EVALS[@]}"
finish

# ---- 4. compare (baseline and gate parent: the parent's native eval)
have=()
for arm in parent parent_yarn4 ext_fit ext_trunc; do
  ls "$WORK/eval/$arm"/step_*.json > /dev/null 2>&1 && have+=("$WORK/eval/$arm")
done
if [ ${#have[@]} -gt 0 ]; then
  gate=()
  [ -d "$WORK/eval/parent" ] && gate=(--gate-parent "$WORK/eval/parent" --short-lengths "${SHORT[@]}" --margin-pp 5)
  guard compare $(( BUDGET + 30 )) $PY -m megablu.cli compare "${have[@]}" --md "$WORK/compare.md" "${gate[@]}"
  # the plot apart: without matplotlib on the device only the picture is lost (redraw it from
  # results.tar.gz here: megablu compare <the eval dirs> --plot compare.png)
  guard plot $(( BUDGET + 40 )) $PY -m megablu.cli compare "${have[@]}" --plot "$OUT/compare.png"
fi
[ -n "$GPU_LOG" ] && kill "$GPU_LOG"
finish
echo "done in $(now) s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
