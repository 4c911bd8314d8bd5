#!/usr/bin/env bash
# Issue 15: the RULER-grade suite on SmolLM2-135M-Instruct, native (8192 positions) vs YaRN x4
# with no training, at 1k-32k, n prompts per cell, plus the held-out loss per length and on
# short documents; and the eval speed bench (bench/eval_bench.py). One arm per call fits a
# 10-minute call; the model comes as in bench/h200_smollm2.sh (two pieces over two calls on a
# warm machine, or /tmp/smollm2_blu already there from an earlier call):
#   call A: carry [".whl", "data_cache/smol_0"], any command (e.g. `ls`)
#   call B: carry ["data_cache/smol_1", "data_cache/smollm2/hf_tokenizer"],
#           command "ARM=native bash bench/h200_ruler.sh"          (~6-8 min)
#   call C: (warm) command "ARM=yarn4 bash bench/h200_ruler.sh"     (~6-8 min)
#   call D: (warm) command "ARM=bench bash bench/h200_ruler.sh"     (~5 min: eval_bench SmolLM2 + blu-0.5b)
# then here (results of one arm merge across the per-length dirs):
#   megablu compare B/eval/native_*/ C/eval/yarn4_*/ --md ruler.md --plot ruler.png --heatmap heat/smol \
#     --gate-parent B/eval/native_2048 --short-lengths 2048
# (the same compare runs on the device in call C when call B's results are still in $WORK).
# Real text (haystack of niah_single_2/3, multikey_1, multivalue, multiquery; the loss data):
# the device's Python stdlib sources, tokenized there with SmolLM2's tokenizer (val split 5%),
# so both arms see the same prompts. Knobs: N (100), LENGTHS, BUDGET_S (540), ARM.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ruler_out}
WORK=${RULER_WORK:-/tmp/ruler_work}
BUDGET=${BUDGET_S:-540}
N=${N:-100}
ARM=${ARM:-native}
LENGTHS=${LENGTHS:-"1024 2048 4096 8192 16384 32640"}
CWE_LENGTHS=${CWE_LENGTHS:-"4096 8192 16384 32640"}   # cwe's 300 common entries need ~2.2k SmolLM2 tokens (digits 1/token)
TASKS="passkey niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery vt fwe"
CFG=yaml_configs/rep_smollm2_32k.yaml
TOKJ=data_cache/smollm2/hf_tokenizer/tokenizer.json   # the config's tokenizer (dir) holds it
mkdir -p "$OUT" "$WORK/logs" "$WORK/eval"
source bench/guard.sh
source launch/device_env.sh || { echo "launch/device_env.sh failed" > "$OUT/ruler.md"; exit 1; }
PY=python3
finish() { cp -r "$WORK/eval" "$WORK/logs" "$WORK/timeline.tsv" "$OUT/" 2>/dev/null; }

if [ ! -f /tmp/smollm2_blu/model.safetensors ]; then
  guard join 60 $PY bench/smollm2_pieces.py join data_cache/smol --to /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    && guard convert 150 $PY bench/smollm2_pieces.py convert /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
         --to /tmp/smollm2_blu
fi
if [ "$ARM" != bench ] && [ ! -f /tmp/stdlib_smol/manifest.json ]; then
  STDLIB=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  guard data 200 $PY -m megablu.cli data build --input "$STDLIB" --include '*.py' --exclude 'site-packages/*' \
    --skip-bad-utf8 --tokenizer "hf:$TOKJ" --out /tmp/stdlib_smol --val-fraction 0.05 --max-bytes 12M
fi
common=(--config "$CFG" --ckpt /tmp/smollm2_blu --step 0 --set data.window=32768
        --set eval.haystack=/tmp/stdlib_smol --set eval.loss.data=/tmp/stdlib_smol --set eval.loss.n=8 --n "$N")
suite() {   # suite ARM OUTNAME TASKS LENGTHS [extra args]: one call per length, shortest first, so a
  local arm=$1 name=$2 tasks=$3 lens=$4 L; shift 4   # deadline costs only the longest cells
  for L in $lens; do
    guard "eval_${name}_$L" "$BUDGET" $PY -m megablu.cli eval "${common[@]}" --arm "smollm2-$arm" \
      --out "$WORK/eval/${name}_$L" --tasks $tasks --lengths "$L" --set "eval.lengths=[$L]" "$@"
    finish
  done
}
case "$ARM" in
  native)   # the weights' own rope: no override
    suite native native "$TASKS" "$LENGTHS" --set rope.yarn=null
    suite native native_cwe "cwe" "$CWE_LENGTHS" --set rope.yarn=null --set eval.loss.data=null ;;
  yarn4)    # YaRN 4 x 8192 the weights never trained with: an explicit override, recorded in the result
    suite yarn4 yarn4 "$TASKS" "$LENGTHS" --rope-override
    suite yarn4 yarn4_cwe "cwe" "$CWE_LENGTHS" --rope-override --set eval.loss.data=null
    if ls -d "$WORK"/eval/native_*/ > /dev/null 2>&1; then   # call B's results still on the warm machine
      guard compare $(( BUDGET + 30 )) $PY -m megablu.cli compare "$WORK"/eval/native_*/ "$WORK"/eval/yarn4_*/ \
        --md "$OUT/ruler.md" --plot "$OUT/ruler.png" --heatmap "$OUT/heat/smol" \
        --gate-parent "$WORK/eval/native_2048" --short-lengths 2048
    fi ;;
  bench)
    guard bench_smol 300 $PY bench/eval_bench.py --config "$CFG" --ckpt /tmp/smollm2_blu --arm smollm2-135m \
      --set data.window=32768 --set "tokenizer.path=$TOKJ" --budget-s 240
    guard bench_blu 590 $PY bench/eval_bench.py --config yaml_configs/base.yaml --random --arm blu-0.5b \
      --set data.window=32768 --set 'rope.yarn={factor: 2.0, original_max_position: 16384}' --budget-s 240 \
      --tasks passkey niah_single_1 niah_multikey_2 vt cwe fwe
    cp /tmp/eval_bench/eval_bench_*.md /tmp/eval_bench/eval_bench_*.json "$OUT/" 2>/dev/null ;;
esac
finish
echo "done in $(now) s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
