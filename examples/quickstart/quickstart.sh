#!/usr/bin/env bash
# megablu quick start: a parent trained from scratch, its YaRN extension (x4 on CPU, x8 on a GPU), and whether the
# extension works beyond the parent's window -- measured, with intervals. One command:
#   bash examples/quickstart/quickstart.sh            CPU (2 cores are enough): ~4 min after the one-time install
#   bash examples/quickstart/quickstart.sh --gpu      one GPU, offline: 6.8 min on an H100 (measured 2026-12-05)
# Steps (each command is printed on stderr as it starts, with the seconds elapsed):
#   1. set-up: .venv (launch/setup_env.sh), or on the H200 device the carried wheels
#      (dev/device_env.sh, when .whl/ is there)
#   2. data: this Python's stdlib sources tokenized (megablu data build) and passkey training
#      documents (python3 examples/quickstart/quickstart.py passkey-docs: the eval's template, other keys)
#   3. pretrain the parent         CPU: window 256, 1 rank        GPU: window 2048
#   4. YaRN extension from it      CPU: x4 to window 1024, Ulysses sp=2 on 2 ranks   GPU: x8 to window 16384
#   5. megablu eval of the parent, of the parent with the same YaRN and no training, and of the
#      extension, inside and beyond the parent's window: passkey retrieval with 95% intervals and
#      the held-out loss per length
#   6. megablu compare with the short-context gate; the summary on stdout (the runs' own output
#      goes to <runs>/quickstart/logs/)
# Options: --gpu, --runs-dir DIR (default runs), --out DIR (copy the summary, tables, plot, eval
# results and logs there), --dry-run (print the commands, run nothing).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # examples/quickstart/quickstart.py imports this checkout's megablu

GPU=0 DRY=0 RUNS=runs OUT=
while [ $# -gt 0 ]; do
  case $1 in
    --gpu) GPU=1 ;;
    --dry-run) DRY=1 ;;
    --runs-dir) RUNS=${2:?--runs-dir needs a directory}; shift ;;
    --out) OUT=${2:?--out needs a directory}; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "quickstart: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ $GPU = 1 ]; then
  DEV=GPU; NAME=qs_gpu; DATA=data_cache/qs_gpu; CFG=examples/quickstart/quickstart_gpu.yaml
  CFG_EXT=examples/quickstart/quickstart_gpu_ext.yaml; RANKS_EXT=1
  BUILD=(--val-fraction 0.05)                       # all of the stdlib's sources, its tests too
  PK_PARENT=(--lengths 512-2047 --docs 12000 --seed 11 --digits 5)
  PK_LONG=(--lengths 8192-16383 --docs 1000 --seed 12 --digits 5 --depth 0-0.6)
  SHORT=(256 1024 2024)                             # the gate's lengths: the parent's eval lengths
else
  DEV=CPU; NAME=qs; DATA=data_cache/qs; CFG=examples/quickstart/quickstart_cpu.yaml
  CFG_EXT=examples/quickstart/quickstart_cpu_ext.yaml; RANKS_EXT=2
  BUILD=(--val-fraction 0.3 --max-bytes 4M --exclude '*/test/*' --exclude 'test/*')
  PK_PARENT=(--lengths 90-255 --docs 6000 --seed 1 --digits 1)
  PK_LONG=(--lengths 600-1023 --docs 3000 --seed 3 --digits 1 --depth 0-0.6)
  SHORT=(128 240)
fi
WORK=$RUNS/quickstart
T0=$SECONDS

say() { echo "[quickstart $(( SECONDS - T0 ))s] $*" >&2; }
# step NAME cmd...: print it, run it (stdout to WORK/logs/NAME.out; stderr stays on the terminal)
step() {
  local name=$1; shift
  say "$name: $*"
  [ $DRY = 1 ] && return 0
  if ! "$@" > "$WORK/logs/$name.out"; then
    say "$name FAILED (its stdout: $WORK/logs/$name.out)"
    exit 1
  fi
}
run_dir() {   # the run dir from the entry's --json FILE (the launcher's own lines share stdout)
  if [ $DRY = 1 ]; then echo "<$1 run>"; return; fi
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["run_dir"])' "$WORK/$1.json"
}
port() { echo $(( 29500 + RANDOM % 400 )); }

say "megablu quick start on $DEV: runs in $RUNS, results in $WORK"
# ---- 1. set-up
if [ $DRY = 0 ]; then
  if [ $GPU = 1 ] && [ -d .whl ] && [ -f dev/device_env.sh ]; then
    source dev/device_env.sh            # the H200 device: no registry there, the wheels travel
  else
    source launch/setup_env.sh
  fi
  mkdir -p "$WORK/logs"
  rm -f "$WORK"/*.json
fi
[ $GPU = 0 ] && export DS_ACCELERATOR=cpu
STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
TOK=tiktoken_file:megablu:stdlib4k
MB=(python3 -m megablu.cli)

# ---- 2. data (kept in data_cache/ and reused while it verifies)
if [ $DRY = 1 ] || ! "${MB[@]}" data verify "$DATA/stdlib" --tokenizer $TOK --no-hash > /dev/null 2>&1; then
  step data_stdlib "${MB[@]}" data build --input "$STDLIB" --include '*.py' --exclude 'site-packages/*' \
    --exclude '*/site-packages/*' --skip-bad-utf8 "${BUILD[@]}" --tokenizer $TOK --out "$DATA/stdlib" --overwrite \
    --source-name python-stdlib --license PSF-2.0 --provenance "$STDLIB" --no-progress
fi
PK=(python3 examples/quickstart/quickstart.py passkey-docs --tokenizer $TOK)
if [ $GPU = 1 ]; then
  step data_passkey "${PK[@]}" --out "$DATA/passkey2048" "${PK_PARENT[@]}"      # the extension reuses them too
  step data_passkey_long "${PK[@]}" --out "$DATA/passkey16384" "${PK_LONG[@]}"
else
  step data_passkey "${PK[@]}" --out "$DATA/passkey256" "${PK_PARENT[@]}"     # the extension reuses them too
  step data_passkey_long "${PK[@]}" --out "$DATA/passkey1024" "${PK_LONG[@]}"
fi

# ---- 3. the parent, 4. its extension (--json: the summary, read here; `deepspeed` prints on stdout too)
step parent deepspeed --num_gpus 1 --master_port "$(port)" launch/ext32k.py --config $CFG \
  --set runs_dir="$RUNS" --json "$WORK/parent.json"
PARENT=$(run_dir parent)
step extension deepspeed --num_gpus $RANKS_EXT --master_port "$(port)" launch/ext32k.py --config $CFG_EXT \
  --set runs_dir="$RUNS" --set init_from="$PARENT" --json "$WORK/extension.json"
EXT=$(run_dir extension)

# ---- 5. the three evaluations (the same seeded prompts and val sequences for every arm); a run's
#         own results go to <run>/eval/ (megablu runs shows them), the untrained arm's to WORK
step eval_parent "${MB[@]}" eval --config $CFG --ckpt "$PARENT" --arm parent
step eval_untrained "${MB[@]}" eval --config $CFG_EXT --ckpt "$PARENT" --rope-override --arm parent+yarn_untrained \
  --out "$WORK/eval_untrained"
step eval_extension "${MB[@]}" eval --config $CFG_EXT --ckpt "$EXT" --arm extension

# ---- 6. compare (tables, plot, the gate against the parent at its lengths), then the summary
CMP=("${MB[@]}" compare "$PARENT" "$WORK/eval_untrained" "$EXT" --baseline 1)
say "compare: ${CMP[*]} --md $WORK/compare.md --gate-parent $PARENT --short-lengths ${SHORT[*]}"
if [ $DRY = 0 ]; then
  # exit 1 = an arm failed the gate: the summary reports it; not a failure of the quick start
  "${CMP[@]}" --md "$WORK/compare.md" --gate-parent "$PARENT" --short-lengths "${SHORT[@]}" \
    > "$WORK/logs/compare.out" 2> "$WORK/logs/compare.err" || true
  grep -i 'short-context gate' "$WORK/logs/compare.err" | grep -v '^parent@' > "$WORK/gate.txt" || true
  # the plot apart: without matplotlib only the picture is lost
  "${CMP[@]}" --plot "$WORK/compare.png" > /dev/null 2>> "$WORK/logs/compare.err" || say "no plot (see logs/compare.err)"
fi
step summary python3 examples/quickstart/quickstart.py summary --parent-run "$PARENT" --ext-run "$EXT" \
  --parent-eval "$PARENT" --untrained-eval "$WORK/eval_untrained" --ext-eval "$EXT" \
  --gate "$WORK/gate.txt" --device "$DEV" --json "$WORK/claims.json"
[ $DRY = 1 ] && exit 0
cp "$WORK/logs/summary.out" "$WORK/summary.txt"
if [ -n "$OUT" ]; then
  mkdir -p "$OUT"
  cp "$WORK/summary.txt" "$WORK/claims.json" "$WORK/compare.md" "$OUT/"
  [ -f "$WORK/compare.png" ] && cp "$WORK/compare.png" "$OUT/"
  tar czf "$OUT/quickstart_results.tar.gz" --exclude=checkpoints --exclude=tb -C "$RUNS" \
    quickstart "$(basename "$PARENT")" "$(basename "$EXT")"
fi
cat "$WORK/summary.txt"
say "done: $WORK/summary.txt, compare.md, compare.png; every run: ${MB[*]} runs $RUNS"
