# Device (H100 or H200): issue 24, the fix for the per-step graph updates: the step's logits are
# a fresh output buffer each step, and XLA's buffer assignment places ~97 of the step's
# intermediates in that buffer, so every command touching them is re-parameterized.  Donating
# the previous logits (``--recycle-logits``) keeps that buffer's address.  0.5B shape, B=8, 8K,
# mix .20/.65/.15 and all-BF16 in each process, balances and ledger donated in every variant:
#   donate / recycle            timings (8 steps), alternated twice
#   recycle_log                 the update counts with the logits recycled
#   LIMIT=300 bash scripts/dev_launch24e.sh
# Raw output: $OUT/launch24e.tgz.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-300}
d=/tmp/launch24e && rm -rf $d && mkdir -p $d
. scripts/device_env.sh $d
left() { echo $((limit - SECONDS - 10)); }
step() {  # tag, args...
  local tag=$1 t; shift; t=$(left)
  [ $t -gt 30 ] || { echo "no time for $tag"; return; }
  timeout -s KILL $(( t < 70 ? t : 70 )) python3 bench/bench_pask_step.py \
    --shape qwen2.5-0.5b --batch 8 --context 8192 --layouts unrolled --no-full \
    --steps ${STEPS:-8} --mixes 0.2,0.65,0.15 --lo-page 128 --lo-format int4 --donate-state \
    --json $d/$tag.jsonl "$@" > $d/$tag.log 2>&1
  echo "$tag rc $?"; grep -E "mix \(|Error|error|not usable" $d/$tag.log | cut -c1-300
  grep -E "Updated [0-9]+ commands|updated_allocs" $d/$tag.log | sed 's/.*\] //' | tail -4 | cut -c1-200
}
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 STEPS=3 \
  step recycle_log --recycle-logits
step donate
step recycle --recycle-logits
step donate2
step recycle2 --recycle-logits
tar czf $OUT/launch24e.tgz -C /tmp launch24e
