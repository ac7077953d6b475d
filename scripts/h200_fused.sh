# Device (H200): the fused Mosaic GPU kernel for the whole mixed cache (int4_kernel="fused",
# pallas_kernels/gpu/mgpu_mixed.py; issue 22), safe against a kernel that hangs the GPU.
#   STAGE=smoke  LIMIT=200 bash scripts/h200_fused.sh   # the three smallest launches alone
#   STAGE=checks LIMIT=540 bash scripts/h200_fused.sh   # every correctness case, no bench
#   STAGE=bench  LIMIT=540 bash scripts/h200_fused.sh   # the CUPTI bench alone (checks passed)
#   LIMIT=540 bash scripts/h200_fused.sh                # STAGE=all: checks, then the bench
# (no wheels or model needed). Its first run (one process for every check under `timeout 170`,
# which sends TERM and waits for ever) ended with the machine no longer answering and nothing
# back. Now:
# * every check case (bench/check_fused.py --list: the kernel alone with the INT4 pipeline only,
#   the BF16 pipeline only, both; the synth cases per shape; the bench's size per knob variant)
#   runs in its own process under `timeout -s KILL` (CASE_S, default 40 s; three times that for
#   the synth cases, which compile ~10 kernels), smallest and least novel first;
# * every step of a case (inputs built, compiling, compiled, running, ran, each check's result)
#   is appended and flushed to $OUT/progress.log as it happens, and a Python stack dump of every
#   thread 5 s before the kill, so a killed case shows how far it got and where it waited;
# * a case killed at its timeout while compiling is TIMEOUT_COMPILING (the GPU's health is
#   probed, the next case runs); killed at any other step it is a HANG (a line in progress.log
#   and results.jsonl, with its knobs and last step), then: the GPU's health is probed (nvidia-smi and a one-op jax process, both under
#   KILL timeouts), the case is run again with auto_barriers=true (Pallas's barriers around
#   shared-memory loads and stores kept), and if that passes too the later cases run with
#   auto_barriers; if not (or the GPU is unwell), every later, riskier case is skipped (SKIP);
# * a process that outlives its KILL (stuck in the driver) is left behind, reported
#   UNKILLABLE, and everything after it is skipped, so this script still ends and $OUT returns;
# * the tiny cases run with MOSAIC_GPU_DUMP_PTX/PTXAS/SASS (the kernel's PTX, ptxas's
#   registers/spills and SASS, written at compile time, before the launch): $OUT/mosaic_dump.tgz;
# * the CUPTI bench (bench/bench_kernels.py, INT4 kernels mosaic and fused, fused knob variants,
#   pages of 128, 4B-like and 0.5B at B=8 32K) runs only if every check passed, under a KILL
#   timeout of the time left.
# The whole run stays within LIMIT seconds (default 540, under the device's 600 s a command).
# Back under $OUT (at most 8 files): progress.log (everything, in order), results.jsonl (one
# JSON line a case: PASS / FAIL / HANG / TIMEOUT_COMPILING / SKIP / UNKILLABLE), cases.log (the cases' stderr:
# tracebacks), mosaic_dump.tgz, kern.log, kern/kernels.{json,csv}; SANITIZE=...: sanitizer.log.
. scripts/h200_env.sh 2>/dev/null || export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fused_out}
mkdir -p $OUT
LIMIT=${LIMIT:-540}
CASE_S=${CASE_S:-40}
STAGE=${STAGE:-all}
CHECK_ARGS=${CHECK_ARGS:-}      # --dry: a CPU rehearsal (bench/check_fused.py's doc)
RESERVE=20                      # seconds kept for the end (tar, summary)
P=$OUT/progress.log
R=$OUT/results.jsonl
DUMP=/tmp/mgpu_dump
rm -rf $DUMP; mkdir -p $DUMP
log() { echo "[$(date -u +%T) +${SECONDS}s] $*" | tee -a $P; }
jline() { echo "$1" >> $R; }
STOP=""                         # set: skip everything after (a hang not cured, a stuck process)
FAILED=0
AB=${AB:-}                      # set (AB=1): later cases and the bench use auto_barriers=true

log "stage=$STAGE limit=${LIMIT}s case timeout=${CASE_S}s; $(git rev-parse --short HEAD 2>/dev/null)"
timeout -s KILL 20 nvidia-smi --query-gpu=name,driver_version,memory.used,temperature.gpu \
  --format=csv,noheader 2>&1 | tee -a $P
timeout -s KILL 30 python3 -c "import jax; print('jax', jax.__version__, jax.devices())" \
  2>&1 | tail -1 | tee -a $P

health() {                      # is the GPU still usable after a hang?
  timeout -s KILL 20 nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader \
    < /dev/null 2>&1 | sed 's/^/  nvidia-smi: /' | tee -a $P
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s KILL 40 python3 -c \
    "import jax.numpy as j; print('  gpu ok', float(j.ones(9).sum()))" < /dev/null \
    2>&1 | tail -1 | tee -a $P
  return ${PIPESTATUS[0]}
}

# run ID KNOBS TIMEOUT [dump]: one case in its own process -> 0 PASS, 1 FAIL, 2 HANG, 3 SKIP,
# 4 UNKILLABLE, 5 TIMEOUT_COMPILING (killed while its last step was a compile). The process
# runs in the background under `timeout -s KILL`; we wait for it ourselves, at most 15 s past
# its timeout, so a process the KILL cannot end does not hold us.
run() {
  local id=$1 knobs=$2 t=$3 dump=$4 left pid waited rc last out=/dev/null
  left=$((LIMIT - SECONDS - RESERVE))
  if [ -n "$STOP" ] || [ $left -lt $t ]; then
    log "SKIP $id $knobs (${STOP:-no time left: ${left}s})"
    jline "{\"case\": \"$id\", \"knobs\": $knobs, \"status\": \"SKIP\"}"
    return 3
  fi
  log "CASE $id $knobs (KILL after ${t}s)"
  local env=(XLA_PYTHON_CLIENT_PREALLOCATE=false)   # a left-over process holds less
  if [ -n "$dump" ]; then
    env+=(MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1)
    out=$DUMP/$id.txt
  fi
  env "${env[@]}" timeout -s KILL $t python3 bench/check_fused.py --case $id --knobs "$knobs" \
    --log $P --results $R --deadline $((t - 5)) $CHECK_ARGS < /dev/null > $out 2>> $OUT/cases.log &
  pid=$!
  waited=0
  while kill -0 $pid 2>/dev/null; do
    sleep 1; waited=$((waited + 1))
    if [ $waited -gt $((t + 15)) ]; then
      log "UNKILLABLE $id $knobs: pid $pid still there ${waited}s after its start (KILL at ${t}s)"
      jline "{\"case\": \"$id\", \"knobs\": $knobs, \"status\": \"UNKILLABLE\"}"
      STOP="a process outlived its KILL"
      return 4
    fi
  done
  wait $pid; rc=$?
  case $rc in
    0) log "PASS $id $knobs"; return 0 ;;
    124|137)                    # killed: a hang, unless it was still compiling or done
      last=$(grep -F "  [$id" $P | tail -1 | cut -c1-240)
      case $last in
        *"] PASS in "*) log "PASS $id $knobs (killed at its exit, after its result)"; return 0 ;;
        *"] FAIL in "*) log "FAIL $id $knobs (killed at its exit, after its result)"; return 1 ;;
      esac
      local st=HANG; [ "${last%: compiling}" != "$last" ] && st=TIMEOUT_COMPILING
      log "$st $id $knobs: killed after ${t}s; its last step: ${last# }"
      jline "$(python3 -c 'import json, sys; print(json.dumps(dict(case=sys.argv[1], knobs=json.loads(
        sys.argv[2]), status=sys.argv[5], timeout_s=int(sys.argv[3]), last=sys.argv[4].strip())))' \
        "$id" "$knobs" $t "$last" $st)"
      [ $st = HANG ] && return 2
      return 5 ;;
    *) log "FAIL $id $knobs (rc $rc; tracebacks in cases.log)"; return 1 ;;
  esac
}

# with_ab KNOBS: the knobs with auto_barriers=true added.
with_ab() { python3 -c "import json,sys; print(json.dumps({**json.loads(sys.argv[1]), 'auto_barriers': True}))" "$1"; }

checks() {
  local n=0 id knobs t rc dump line list
  mapfile -t list < <(python3 bench/check_fused.py --list < /dev/null)
  if [ ${#list[@]} = 0 ]; then log "FAIL: bench/check_fused.py --list gave no case"; FAILED=1; fi
  for line in "${list[@]}"; do
    id=${line%%$'\t'*}; knobs=${line#*$'\t'}
    n=$((n + 1))
    [ "$STAGE" = smoke ] && [ "${id#tiny_}" = "$id" ] && continue
    t=$CASE_S; [ "${id#synth_}" != "$id" ] && t=$((3 * CASE_S))
    [ -n "$AB" ] && knobs=$(with_ab "$knobs")
    dump=""; [ "${id#tiny_}" != "$id" ] && dump=1
    run "$id" "$knobs" $t $dump; rc=$?
    case $rc in
      1|4) FAILED=$((FAILED + 1)) ;;
      5) FAILED=$((FAILED + 1))     # slow compile: no rerun, but is the GPU still there?
         health || STOP="the GPU is unwell after $id timed out compiling" ;;
      2) if ! health; then
           FAILED=$((FAILED + 1)); STOP="the GPU is unwell after the hang of $id"
         elif [ -n "$AB" ]; then
           FAILED=$((FAILED + 1)); STOP="$id hangs with auto_barriers=true"
         else
           run "$id" "$(with_ab "$knobs")" $t; rc=$?
           if [ $rc = 0 ]; then
             AB=1; log "auto_barriers=true cures $id: the later cases (and the bench) run with it"
           else
             FAILED=$((FAILED + 1))
             [ $rc = 2 ] && health
             STOP="$id hangs (with auto_barriers=true: rc $rc)"
           fi
         fi ;;
    esac
  done
  log "checks: $n cases listed, $FAILED failed or hung${STOP:+; stopped: $STOP}"
  tar -czf $OUT/mosaic_dump.tgz -C $DUMP . 2>/dev/null
  [ "$(stat -c %s $OUT/mosaic_dump.tgz 2>/dev/null || echo 0)" -lt 15000000 ] || \
    { rm -f $OUT/mosaic_dump.tgz; log "mosaic dump over 15 MB: dropped"; }
  grep -h '"status"' $R 2>/dev/null | python3 -c "
import json, sys
for l in sys.stdin:
  r = json.loads(l)
  errs = {k: v for c in r.get('checks', []) for k, v in c.items() if 'err' in k}
  print(f\"  {r['status']:17s} {r['case']:11s} {json.dumps(r.get('knobs', {}))[:60]:60s} \"
        f\"{json.dumps(errs)[:150]}\")" | tee -a $P
}

# SANITIZE=memcheck|synccheck|racecheck (opt-in; Firecracker machines only: gVisor's refuses the
# device): one case (SANITIZE_CASE, default tiny_mix) under compute-sanitizer, KILL after 150 s,
# its report in $OUT/sanitizer.log (out-of-bounds or misaligned accesses, barrier misuse).
sanitize() {
  local cs id=${SANITIZE_CASE:-tiny_mix} left=$((LIMIT - SECONDS - RESERVE))
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -z "$cs" ] || [ $left -lt 60 ] || [ "$STOP" = "a process outlived its KILL" ]; then
    log "sanitize skipped (${cs:-no compute-sanitizer}, ${left}s left)"; return
  fi
  [ $left -gt 150 ] && left=150
  log "SANITIZE $SANITIZE on $id (KILL after ${left}s)"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s KILL $left $cs --tool $SANITIZE \
    --print-limit 50 python3 bench/check_fused.py --case $id --log $P --results $R \
    --deadline $((left - 5)) $CHECK_ARGS < /dev/null > $OUT/sanitizer.log 2>&1
  log "compute-sanitizer rc=$?; $(grep -c '^========= ' $OUT/sanitizer.log) report lines"
  grep -m 12 '^========= ' $OUT/sanitizer.log | cut -c1-200 | tee -a $P
}

bench() {
  local left=$((LIMIT - SECONDS - RESERVE)) variants
  if [ $left -lt 90 ]; then log "bench skipped: ${left}s left"; return; fi
  variants='[{}, {"tile_hi": 128}, {"stages_lo": 3}, {"splits_lo": 4, "splits_hi": 4}, {"splits_lo": 10, "splits_hi": 6}]'
  [ -n "$AB" ] && variants=$(python3 -c "import json,sys; print(json.dumps([{**v, 'auto_barriers': True} for v in json.loads(sys.argv[1])]))" "$variants")
  log "bench: bench_kernels.py (KILL after ${left}s) variants $variants"
  timeout -s KILL $left python3 bench/bench_kernels.py --out $OUT/kern --lo-page 128 \
    --hi-page 128 --lo-formats int4 --int4-kernels mosaic,fused --fused-variants "$variants" \
    --shapes 0,3 --no-gqa --cupti > $OUT/kern.log 2>&1
  log "bench_kernels rc=$? (124/137: killed at the limit)"
  grep -E "^FAILED|^CUPTI" $OUT/kern.log | cut -c1-300 | tee -a $P
  sed -n '/^copy /,$p' $OUT/kern.log | tee -a $P
  timeout -s KILL 30 python3 - "$OUT/kern/kernels.json" <<'EOF' 2>/dev/null | tee -a $P
# Per variant: the call's kernels under CUPTI (device µs) and the x all-BF16 ratio per shape.
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
a = {r["shape"]: r.get("kernels_us") for r in rows if r["variant"] == "pask a_bf16"
     and "fused" not in r["knobs"]}
for r in rows:
  k = r.get("kernels_us")
  ratio = f"{k / a[r['shape']]:.3f}x(a)" if k and a.get(r["shape"]) else ""
  print(f"{r['shape']:16s} {r['variant']:18s} kernels {k or float('nan'):8.1f} us {ratio:>10s} "
        f"err {r['err'] or 0:.1e} {r['knobs']}")
  for name, t in r.get("kernels", []):
    print(f"{'':20s}{t:8.2f} us  {name}")
EOF
}

case $STAGE in
  smoke|checks) checks; [ -n "${SANITIZE:-}" ] && sanitize ;;
  bench) bench ;;
  all) checks
       if [ $FAILED = 0 ] && [ -z "$STOP" ]; then bench
       else log "bench skipped: $FAILED case(s) failed or hung"; fi ;;
  *) log "unknown STAGE=$STAGE (smoke, checks, bench, all)"; exit 2 ;;
esac
log "done in ${SECONDS}s; files: $(cd $OUT && find . -type f | tr '\n' ' ')"
[ $FAILED = 0 ] && [ -z "$STOP" ]
