# Device (H100 or H200): issue 24, after the recycled logits removed the per-step graph updates:
# a chained loop still waits ~2 ms per call, as if cuGraphLaunch waited for the previous launch
# of the same graph (profile: 1.1-1.5 ms in cuGraphLaunch while the previous step runs, session
# 30).  Two copies of the step (two executables, two graphs) launched in turn test that: if the
# launch no longer waits, the chained step falls to about the device time.  0.5B shape, B=8, 8K,
# mix .20/.65/.15 and all-BF16 in each process; each variant twice, alternated:
#   recycle        --recycle-logits
#   alternate      --recycle-logits --alternate
#   alternate_prof the same under the profiler (host calls per step)
#   LIMIT=300 bash scripts/dev_launch24g.sh
# Raw output: $OUT/launch24g.tgz.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-300}
d=/tmp/launch24g && rm -rf $d && mkdir -p $d
. scripts/device_env.sh $d
left() { echo $((limit - SECONDS - 10)); }
step() {  # tag, args...
  local tag=$1 t; shift; t=$(left)
  [ $t -gt 30 ] || { echo "no time for $tag"; return; }
  timeout -s KILL $(( t < 80 ? t : 80 )) python3 bench/bench_pask_step.py \
    --shape qwen2.5-0.5b --batch 8 --context 8192 --layouts unrolled --no-full \
    --steps 8 --mixes 0.2,0.65,0.15 --lo-page 128 --lo-format int4 --recycle-logits \
    --json $d/$tag.jsonl "$@" > $d/$tag.log 2>&1
  echo "$tag rc $?"; grep -E "mix \(|chained|Error|error|host calls|busy|host gap" $d/$tag.log | cut -c1-600
}
step recycle
step alternate --alternate
step recycle2
step alternate2 --alternate
step alternate_prof --alternate --profile $d/prof
rm -rf $d/prof
tar czf $OUT/launch24g.tgz -C /tmp launch24g
