# Device (H100 or H200): issue 24, with the graph no longer re-parameterized (logits recycled):
# does the host run ahead of the device in a chained loop (host time per call while earlier
# steps still run), and the host calls per step (profiler).  0.5B shape, B=8, 8K.
#   LIMIT=200 bash scripts/dev_launch24f.sh
# Raw output: $OUT/launch24f.tgz.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-200}
d=/tmp/launch24f && rm -rf $d && mkdir -p $d
. scripts/device_env.sh $d
left() { echo $((limit - SECONDS - 10)); }
step() {  # tag, args...
  local tag=$1 t; shift; t=$(left)
  [ $t -gt 30 ] || { echo "no time for $tag"; return; }
  timeout -s KILL $(( t < 80 ? t : 80 )) python3 bench/bench_pask_step.py \
    --shape qwen2.5-0.5b --batch 8 --context 8192 --layouts unrolled --no-full \
    --steps 8 --mixes 0.2,0.65,0.15 --lo-page 128 --lo-format int4 --donate-state \
    --json $d/$tag.jsonl "$@" > $d/$tag.log 2>&1
  echo "$tag rc $?"; grep -E "mix \(|chained|Error|error|host calls|busy|host gap" $d/$tag.log | cut -c1-600
}
step recycle --recycle-logits
step recycle_prof --recycle-logits --profile $d/prof
step donate
rm -rf $d/prof
tar czf $OUT/launch24f.tgz -C /tmp launch24f
