# Sourced by the device scripts (experiments/replication/run.sh, experiments/replication/smollm2.sh): phase deadlines.
# Needs WORK (logs go to WORK/logs, one row per phase to WORK/timeline.tsv); sets T0 if unset.
T0=${T0:-$SECONDS}
now() { echo $(( SECONDS - T0 )); }
# guard NAME DEADLINE cmd...: run cmd so that it ends by DEADLINE (s since T0); stdout and
# stderr to WORK/logs/NAME.{out,err}; one timeline row. timeout signals the whole process
# group, so the deepspeed launcher's ranks go too.
guard() {
  local name=$1 dl=$2 start rc; shift 2
  start=$(now)
  local s=$(( dl - start ))
  if [ "$s" -le 5 ]; then
    printf '%s\t%d\t%d\t%s\n' "$name" "$start" "$start" "skipped (no time left)" >> "$WORK/timeline.tsv"
    return 124
  fi
  timeout --kill-after=10 "$s" "$@" > "$WORK/logs/$name.out" 2> "$WORK/logs/$name.err"
  rc=$?
  printf '%s\t%d\t%d\t%d\n' "$name" "$start" "$(now)" "$rc" >> "$WORK/timeline.tsv"
  return $rc
}
