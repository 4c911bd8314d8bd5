#!/usr/bin/env bash
# Issue 44 (experiments/recipe_4x/README.md): the plan's device commands as one script. A device call runs
# one or more STEPs in order; everything lives under data_cache/r4x, which a warm machine keeps between the
# calls of one session, and every step can be called again (what is done is skipped).
#
#   STEP=prep      call A: unpack the carried corpus and tokenizer, verify, the arm's synthetic set for K,
#                  `megablu data mix` of the arm (mixture_<tag>.txt comes back)
#   STEP=parent    join + convert the parent from data_cache/smol_{0,1,2}; only once every piece the pieces'
#                  manifest names is there (a call that carries part of them says which are missing, no error)
#   STEP=train     call B/C: the README's deepspeed command, train.stop_after_s = the call's remaining seconds
#                  - TRAIN_MARGIN_S (30); resumes the run r4x_<arm>_s<K> from its checkpoint when there is one;
#                  skipped once the run's final checkpoint (train.max_steps) is there
#   STEP=eval      call C/D: the final checkpoint's cells, one `megablu eval` per cell, in the plan's priority
#                  order ("Session budget and order", item 3); a cell whose step_*.json exists is skipped, a cell
#                  cut by the deadline goes on from its step_<N>.json.partial in the next call
#   STEP=controls  the controls session: native (long_only.yaml, rope.yarn=null, its own 8192 positions), then
#                  yarn_untrained static and length-aware (--rope-override), same cells, same order
#   Several in one call: STEP="parent train", STEP="train eval".
#
# Calls (command "STEP=... ARM=... K=... bash experiments/recipe_4x/run.sh", timeout_s 600; back to back: a
# machine idle for a while is gone, and data_cache/r4x with it):
#   controls session: A carry [".whl", "data_cache/carry_r4x", "data_cache/smol_0"]  STEP="prep parent"
#                     B carry ["data_cache/smol_1", "data_cache/smol_2"]            STEP="parent controls"
#                     C, D (warm)                                                    STEP=controls
#   a training k:     A carry [".whl", "data_cache/carry_r4x", "data_cache/smol_0"]  STEP="prep parent" ARM=x K=k
#                     B carry ["data_cache/smol_1", "data_cache/smol_2"]            STEP="parent train" ARM=x K=k
#                     C (warm)                                                       STEP="train eval" ARM=x K=k
#                     D (warm)                                                       STEP=eval ARM=x K=k
# $OUT (a handful of files): report_<tag>.md (this call's timeline, the cells so far, the training's last
# metrics), results_<tag>.tar.gz (eval jsons and md, the run's metrics.csv, mixture.json, summary, logs; never a
# checkpoint or weights), mixture_<tag>.txt (prep). <tag> = <arm>_s<K> for a trained arm, the control's name or
# `controls`. Both are rewritten after every step and cell (and every SNAP_S s while training), so a call cut
# short still returns what finished.
#
# Knobs: STEP (required), ARM (long_only|recipe|recipe_evallike: the trained arms, K required; native|
# yarn_untrained: a control, STEP=controls or eval; unset: every control), K (0|1|2: data.seed=K,
# train.seed=1234+K, the synthetic set's --seed K), DEADLINE_S (570: seconds of the call the script may use,
# counted from its start; every phase ends by then), N (100 prompts per cell), LENGTHS (the suite lengths to
# run, of 1024 4096 8192 16384 32768; each brings its passkey/needle length L - 24 (1024: 1024); set but empty:
# no cells), SNAP_S (30), TRAIN_MARGIN_S (30: the seconds of the launch before the Trainer's clock starts, kept
# out of train.stop_after_s; raise it if a call's train log shows a slower start).
# REHEARSE_CPU=1 (tests/experiments/test_recipe_4x_run.py): no wheels; the test puts a `timeout` on PATH that
# logs each guarded command instead of running it, so the control flow runs on CPU in seconds; R4X_DEV, R4X_CARRY
# and R4X_PIECES move data_cache/r4x, data_cache/carry_r4x and data_cache/smol there (on the device they stay:
# the arms' YAMLs name data_cache/r4x).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/r4x_out}
DEV=${R4X_DEV:-data_cache/r4x}
CARRY=${R4X_CARRY:-data_cache/carry_r4x}
PIECES=${R4X_PIECES:-data_cache/smol}
DEADLINE=${DEADLINE_S:-570}
N=${N:-100}
SNAP_S=${SNAP_S:-30}
MARGIN=${TRAIN_MARGIN_S:-30}   # the README's: train.stop_after_s = the call's remaining seconds - 30
SUITE_LENGTHS="1024 4096 8192 16384 32768"   # the plan's; passkey/needle at L - max_new 24 (1024 itself)
declare -A PK=([1024]=1024 [4096]=4072 [8192]=8168 [16384]=16360 [32768]=32744)
NATIVE_LENGTHS="1024 4096 8192"              # native's own window
TRAINED="long_only recipe recipe_evallike"
CONTROLS="native yarn_untrained"
STEPS="prep parent train eval controls"
PY=python3

# the knobs, before anything runs: a wrong one names itself, its value and the values it may take (exit 2)
bad() { echo "run.sh: $1" >&2; exit 2; }
in_words() { [[ " $2 " == *" $1 "* ]]; }
STEP=${STEP:-}; STEP=${STEP//,/ }
[ -n "${STEP// /}" ] || bad "STEP is not set; one or more of: $STEPS (e.g. STEP=\"train eval\")"
for s in $STEP; do in_words "$s" "$STEPS" || bad "STEP=$s is not a step; the steps: $STEPS"; done
ARM=${ARM:-}
if [ -n "$ARM" ] && ! in_words "$ARM" "$TRAINED $CONTROLS"; then
  bad "ARM=$ARM is not an arm; one of: ${TRAINED// /, }, ${CONTROLS// /, } (README \"The arms\")"
fi
K=${K:-}
if [ -n "$K" ] && ! in_words "$K" "0 1 2"; then
  bad "K=$K is not a training index; one of: 0, 1, 2 (README \"The trainings and their seeds\")"
fi
if in_words "$ARM" "$TRAINED"; then
  [ -n "$K" ] || bad "K is not set; ARM=$ARM is trained three times: K=0, 1 or 2"
  in_words controls "$STEP" && bad "STEP=controls with ARM=$ARM: the controls are ${CONTROLS// /, } (ARM unset: both)"
else
  for s in train eval; do
    in_words "$s" "$STEP" && [ "$s" = train -o -z "$ARM" ] \
      && bad "STEP=$s needs a trained ARM (ARM=${ARM:-unset}); one of: ${TRAINED// /, } (the controls: STEP=controls)"
  done
fi
[[ $N =~ ^[1-9][0-9]*$ ]] || bad "N=$N is not a number of prompts; a whole number >= 1 (the plan: 100)"
[[ $DEADLINE =~ ^[1-9][0-9]*$ ]] \
  || bad "DEADLINE_S=$DEADLINE is not a number of seconds; a whole number >= 1 (at most the call's timeout_s)"
[[ $SNAP_S =~ ^[1-9][0-9]*$ ]] || bad "SNAP_S=$SNAP_S is not a number of seconds; a whole number >= 1"
[[ $MARGIN =~ ^[0-9]+$ ]] || bad "TRAIN_MARGIN_S=$MARGIN is not a number of seconds; a whole number >= 0 (plan: 30)"
LENGTHS=${LENGTHS-$SUITE_LENGTHS}
for L in $LENGTHS; do
  in_words "$L" "$SUITE_LENGTHS" || bad "LENGTHS holds $L; the plan's suite lengths: $SUITE_LENGTHS"
done
if [ "$DEV" != data_cache/r4x ] && [ "${REHEARSE_CPU:-0}" != 1 ]; then
  bad "R4X_DEV=$DEV: the arms' YAMLs read data_cache/r4x; another place only with REHEARSE_CPU=1"
fi

if in_words "$ARM" "$TRAINED"; then TAG=${ARM}_s$K; else TAG=${ARM:-controls}; fi
CFG=experiments/recipe_4x/${ARM:-long_only}.yaml
NAME=r4x_${ARM}_s$K   # the run's name (trained arms)
RUNS=$DEV/runs
MODEL=$DEV/smollm2
WORK=$DEV/work_$TAG
mkdir -p "$OUT" "$WORK/logs" "$DEV/eval"
source dev/guard.sh
if [ "${REHEARSE_CPU:-0}" != 1 ]; then
  source dev/device_env.sh || { echo "dev/device_env.sh failed" > "$OUT/report_$TAG.md"; exit 1; }
fi
printf 'call STEP=%s ARM=%s K=%s DEADLINE_S=%s\t0\t0\t-\n' "$STEP" "$ARM" "$K" "$DEADLINE" >> "$WORK/timeline.tsv"

# the eval dirs of this tag: <arm>_s<K>_<job>_<L>, or <control>_<job>_<L> (yarn_untrained_ holds _beyond_)
eval_prefixes() {
  if in_words "$ARM" "$TRAINED"; then echo "${ARM}_s${K}_"
  elif [ -n "$ARM" ]; then echo "${ARM}_"
  else echo "native_ yarn_untrained_"; fi
}
run_dir() {   # the newest run dir r4x_<arm>_s<K>-NNNN (run ids are zero-padded: the last in glob order)
  local d run=
  for d in "$RUNS/$NAME"-[0-9][0-9][0-9][0-9]*; do [ -d "$d" ] && run=$d; done
  echo "$run"
}

finish() {   # after every step and cell: a call cut short still returns what finished
  local p f run tmp="$OUT/results_$TAG.tar.gz.tmp$BASHPID" dirs=()
  run=$(in_words "$ARM" "$TRAINED" && run_dir)
  {
    echo "# issue 44 recipe_4x, $TAG ($(now) s of DEADLINE_S $DEADLINE)"
    echo; echo '| step | start s | end s | rc |'; echo '|---|---|---|---|'
    awk -F'\t' '{printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4}' "$WORK/timeline.tsv" 2> /dev/null
    if [ -n "$run" ]; then
      echo; echo "## training $(basename "$run")"
      echo; echo '```'; head -1 "$run/metrics.csv" 2> /dev/null; tail -n 3 "$run/metrics.csv" 2> /dev/null
      ls -d "$run"/checkpoints/step_* 2> /dev/null; cat "$run/summary.json" 2> /dev/null; echo '```'
    fi
    for p in $(eval_prefixes); do
      for f in "$DEV"/eval/"$p"*/step_*.md; do
        [ -f "$f" ] && { echo; echo "## $(basename "$(dirname "$f")")"; cat "$f"; }
      done
    done
  } > "$OUT/report_$TAG.md" 2> /dev/null
  for p in $(eval_prefixes); do
    for f in "$DEV"/eval/"$p"*/; do [ -d "$f" ] && dirs+=("eval/$(basename "$f")"); done
  done
  [ -n "$run" ] && dirs+=("runs/$(basename "$run")")
  # results only: never a checkpoint (270 MB of weights, DeepSpeed's states) nor any weights file
  tar czf "$tmp" --exclude=checkpoints --exclude=tb --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
    --exclude='*.gguf' -C "$DEV" "work_$TAG" ${dirs[@]+"${dirs[@]}"} 2> /dev/null
  mv "$tmp" "$OUT/results_$TAG.tar.gz" 2> /dev/null
}

fail() { finish; echo "$1" | tee -a "$OUT/report_$TAG.md" >&2; exit 1; }

stamp() { [ -f "$DEV/.stamp_$1" ] && [ "$(cat "$DEV/.stamp_$1")" = "${2:-ok}" ]; }

prep() {   # call A: the corpus and its tokenizer (carried), verified; the arm's synthetic set; its mixture
  if ! stamp corpus; then
    guard unpack "$DEADLINE" $PY dev/carry_data.py unpack "$CARRY" --to "$DEV" \
      && guard tokenizer "$DEADLINE" tar xJf "$CARRY/hf_tokenizer.tar.xz" -C "$DEV" \
      && guard verify "$DEADLINE" $PY -m megablu.cli data verify "$DEV/corpus" \
      && echo ok > "$DEV/.stamp_corpus"
    finish
    stamp corpus || fail "prep: the corpus did not unpack or verify (logs/unpack.err, tokenizer.err, verify.err)"
  fi
  local tokz="hf:$DEV/hf_tokenizer/tokenizer.json" set= args=()
  case "$ARM" in
    recipe)            # the disjoint set
      set=synth_disjoint
      args=(--profile disjoint --tokenizer "$tokz" --out "$DEV/$set" --seed "$K"
        --tasks lookups,lookups,collect --query-every 512 --lengths 24k-32700 --docs 800 --window 32768
        --distances 10k-20k --distance-share 0.5 --filler-data "$DEV/corpus"
        --filler-exclude megablu/eval/assets/ruler/essays.txt.gz --no-progress) ;;
    recipe_evallike)   # smol32k_far's set (the default profile), same seed
      set=synth_evallike
      args=(--tokenizer "$tokz" --out "$DEV/$set" --seed "$K"
        --tasks manyq,manyq,manyq,multikv --query-every 512 --lengths 24k-32700 --docs 800 --window 32768
        --filler kv,text,repeat --filler-data "$DEV/corpus" --distances 10k-20k --distance-share 0.5 --no-progress) ;;
  esac
  if [ -n "$set" ] && ! stamp "$set" "seed $K"; then
    # another training's set on this machine: megablu replaces it once the new one is complete
    [ -f "$DEV/$set/manifest.json" ] && args+=(--overwrite)
    rm -f "$DEV/.stamp_$set"
    guard "$set" "$DEADLINE" $PY -m megablu.cli data synth "${args[@]}" && echo "seed $K" > "$DEV/.stamp_$set"
    finish
    stamp "$set" "seed $K" || fail "prep: the synthetic set $set (--seed $K) was not built (logs/$set.err)"
  fi
  if in_words "$ARM" "$TRAINED" && [ ! -s "$WORK/mixture.txt" ]; then   # epochs per source, loss tokens
    guard mixture "$DEADLINE" $PY -m megablu.cli data mix "$CFG" && cp "$WORK/logs/mixture.out" "$WORK/mixture.txt"
  fi
  cp "$WORK/mixture.txt" "$OUT/mixture_$TAG.txt" 2> /dev/null
  finish
}

parent() {   # the parent's pieces (carried in different calls) joined and converted, once all are here
  [ -f "$MODEL/model.safetensors" ] && return 0
  local missing
  if ! missing=$($PY dev/smollm2_pieces.py missing "$PIECES" 2>&1); then
    printf 'parent: waiting for %s\t%d\t%d\t-\n' "$(echo $missing)" "$(now)" "$(now)" >> "$WORK/timeline.tsv"
    finish
    return 0
  fi
  guard join "$DEADLINE" $PY dev/smollm2_pieces.py join "$PIECES" --to "$DEV/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" \
    && guard convert "$DEADLINE" $PY dev/smollm2_pieces.py convert "$DEV/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" \
         --to "$MODEL"
  finish
  [ -f "$MODEL/model.safetensors" ] || fail "parent: no model (logs/join.err, logs/convert.err)"
}

needs() {   # needs WHAT...: what a step reads, made by an earlier step (or an earlier call)
  local w
  for w in "$@"; do
    case $w in
      corpus) stamp corpus || fail "no verified corpus in $DEV: STEP=prep first (call A carries $CARRY)" ;;
      model) [ -f "$MODEL/model.safetensors" ] \
        || fail "no parent in $MODEL: STEP=parent once ${PIECES}_0, _1 and _2 have arrived (calls A and B)" ;;
      synth)
        case $ARM in recipe) stamp synth_disjoint "seed $K" ;; recipe_evallike) stamp synth_evallike "seed $K" ;; esac \
          || fail "no synthetic set of seed $K for ARM=$ARM: STEP=prep ARM=$ARM K=$K first" ;;
    esac
  done
}

max_steps() { $PY -c "from megablu.config import load_config; print(load_config('$CFG').train.max_steps)"; }

train() {   # call B/C: the README's launch, stopping with a checkpoint before the call ends; resumed when it can
  needs corpus model synth
  local run final stop resume=() p i=0
  run=$(run_dir)
  final=$(printf 'step_%07d' "$(max_steps)")
  if [ -n "$run" ] && [ -f "$run/checkpoints/$final/model.safetensors" ]; then
    printf 'train: %s finished (%s)\t%d\t%d\t-\n' "$(basename "$run")" "$final" "$(now)" "$(now)" \
      >> "$WORK/timeline.tsv"
    return 0
  fi
  # a run with a checkpoint goes on from its newest verified one; a run cut before its first is started anew
  [ -n "$run" ] && ls "$run"/checkpoints/step_*/model.safetensors > /dev/null 2>&1 && resume=(--resume "$run")
  stop=$(( DEADLINE - $(now) - MARGIN ))   # the launch and the Trainer's start come before its clock
  if [ "$stop" -lt 60 ]; then
    printf 'train\t%d\t%d\tskipped (stop_after_s %d: no time left)\n' "$(now)" "$(now)" "$stop" >> "$WORK/timeline.tsv"
    return 0
  fi
  guard train "$DEADLINE" deepspeed --num_gpus 1 launch/ext32k.py --config "$CFG" \
    --set runs_dir="$RUNS" --set name="$NAME" --set data.seed="$K" --set train.seed=$((1234 + K)) \
    --set train.stop_after_s="$stop" ${resume[@]+"${resume[@]}"} &
  p=$!
  while kill -0 "$p" 2> /dev/null; do   # snapshots while it trains: its metrics come back however the call ends
    sleep 1; i=$(( i + 1 ))
    [ $(( i % SNAP_S )) = 0 ] && finish
  done
  wait "$p"
  finish
}

# cells TAG ARM_NAME CKPT "SUITE_LENGTHS" [megablu eval args]: one `megablu eval` per cell, in the plan's priority
# order (README "Session budget and order", item 3), the arm's longest length standing for 32768 (native: 8192):
# suite at the longest, passkey there, suite 1024 and 4096, passkey 1024 and 4072, then the other suite lengths,
# needle (longest first), the other passkey lengths. The held-out losses (both sets) ride with each suite cell at
# its length, as in the README's suite job. A cell whose step_*.json exists is skipped.
cells() {
  local tag=$1 arm=$2 ck=$3 lens=($4) L job out; shift 4
  local want=() order=() max
  for L in "${lens[@]}"; do in_words "$L" "$LENGTHS" && want+=("$L"); done
  [ "${#want[@]}" -gt 0 ] || return 0
  max=${want[-1]}
  order=("suite $max" "passkey $max")
  for L in 1024 4096; do [ "$L" != "$max" ] && in_words "$L" "${want[*]}" && order+=("suite $L"); done
  for L in 1024 4096; do [ "$L" != "$max" ] && in_words "$L" "${want[*]}" && order+=("passkey $L"); done
  for L in "${want[@]}"; do in_words "$L" "1024 4096 $max" || order+=("suite $L"); done
  order+=("needle $max")
  for L in "${want[@]}"; do [ "$L" != "$max" ] && order+=("needle $L"); done
  for L in "${want[@]}"; do in_words "$L" "1024 4096 $max" || order+=("passkey $L"); done
  local cell job_args
  for cell in "${order[@]}"; do
    job=${cell% *}; L=${cell#* }
    if [ "$job" = suite ]; then   # the YAML's eval: RULER's 11 tasks, both held-out losses
      job_args=(--lengths "$L" --set "eval.lengths=[$L]")
    else                          # the passkey/needle job: its own task, L - max_new, no loss
      L=${PK[$L]}
      job_args=(--tasks "$job" --set eval.suite=null --lengths "$L" --set "eval.lengths=[$L]"
        --set eval.loss.data=null --set "eval.loss.sets={}")
    fi
    out=$DEV/eval/${tag}_${job}_$L
    ls "$out"/step_*.json > /dev/null 2>&1 && continue
    guard "eval_${tag}_${job}_$L" "$DEADLINE" $PY -m megablu.cli eval --config "$CFG" --ckpt "$ck" --arm "$arm" \
      --out "$out" --n "$N" "${job_args[@]}" --no-plot "$@"
    finish
  done
}

evaluate() {   # call C/D: the trained run's final checkpoint
  needs corpus
  local run final
  run=$(run_dir)
  final=$(printf 'step_%07d' "$(max_steps)")
  [ -n "$run" ] && [ -f "$run/checkpoints/$final/model.safetensors" ] \
    || fail "eval: no final checkpoint ($final) of $NAME in $RUNS: the training is not finished (STEP=train)"
  cells "${ARM}_s$K" "$NAME" "$run/checkpoints/$final" "$SUITE_LENGTHS"
}

controls() {   # the parent: native in its own 8192 positions, then untrained YaRN x4 static and length-aware
  needs corpus model
  local CFG
  if [ -z "$ARM" ] || [ "$ARM" = native ]; then
    CFG=experiments/recipe_4x/long_only.yaml
    cells native r4x_native "$MODEL" "$NATIVE_LENGTHS" --step 0 --set rope.yarn=null --set data.window=8192
  fi
  if [ -z "$ARM" ] || [ "$ARM" = yarn_untrained ]; then
    CFG=experiments/recipe_4x/yarn_untrained.yaml
    cells yarn_untrained r4x_yarn_untrained "$MODEL" "$SUITE_LENGTHS" --step 0 --rope-override
    cells yarn_untrained_beyond r4x_yarn_untrained_beyond "$MODEL" "$SUITE_LENGTHS" --step 0 --rope-override \
      --set rope.yarn.apply=beyond_original
  fi
}

for s in $STEP; do
  case $s in
    prep) prep ;;
    parent) parent ;;
    train) train ;;
    eval) if in_words "$ARM" "$TRAINED"; then evaluate; else controls; fi ;;
    controls) controls ;;
  esac
done
finish
echo "STEP=$STEP ($TAG) done in $(now) s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
