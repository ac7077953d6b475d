# Sourced by the issue-24 device scripts (dev_launch24c.sh .. dev_launch24g.sh): the 0.5B step
# through bench/bench_pask_step.py (Qwen2.5-0.5B shape, B=8, 8K, mix .20/.65/.15 and all-BF16 in
# each process, INT4 pages of 128 in the int4 format).  `. scripts/step05.sh NAME` makes
# /tmp/NAME ($d, with env.txt) and defines `step05 TAG ARGS...`: one process within LIMIT
# seconds in all (default 300) and at most CAP (default 80), STEPS steps (default 8), output in
# $d/TAG.{log,jsonl}; it prints the timings, graph-update counts and profiler rows it finds.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-300}
d=/tmp/$1 && rm -rf $d && mkdir -p $d
. scripts/device_env.sh $d
step05() {  # tag, args...
  local tag=$1 t cap=${CAP:-80}; shift; t=$((limit - SECONDS - 10))
  [ $t -gt 30 ] || { echo "no time for $tag"; return; }
  timeout -s KILL $(( t < cap ? t : cap )) python3 bench/bench_pask_step.py \
    --shape qwen2.5-0.5b --batch 8 --context 8192 --layouts unrolled --no-full \
    --steps ${STEPS:-8} --mixes 0.2,0.65,0.15 --lo-page 128 --lo-format int4 \
    --json $d/$tag.jsonl "$@" > $d/$tag.log 2>&1
  echo "$tag rc $?"
  grep -E "mix \(|chained|Error|error|not usable|host calls|busy|host gap" $d/$tag.log | cut -c1-600
  grep -E "Updated [0-9]+ commands|updated_allocs" $d/$tag.log | sed 's/.*\] //' | tail -4 |
    cut -c1-200
}
