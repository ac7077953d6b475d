# Device (H100 or H200): issue 24, third pass at the per-step graph updates (0.5B shape, B=8, 8K,
# mix .20/.65/.15 and all-BF16, balances and ledger donated): does SKIP_TEMP pin the temp buffer
# (va-remap allocator log), which command kinds are skipped, and the separate temp color.
#   kinds      command_executor=3 ("Skip updating command <kind>"), command_buffer_thunk=3
#   skiptemp   --xla_gpu_command_buffer_update_mode=SKIP_TEMP, the va-remap allocator's log
#   color      --xla_gpu_temp_buffer_use_separate_color=true, updated_allocs per step
#   LIMIT=200 bash scripts/dev_launch24d.sh
# Raw output: $OUT/launch24d.tgz.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-200}
d=/tmp/launch24d && rm -rf $d && mkdir -p $d
. scripts/device_env.sh $d
left() { echo $((limit - SECONDS - 10)); }
step() {  # tag, args...
  local tag=$1 t; shift; t=$(left)
  [ $t -gt 30 ] || { echo "no time for $tag"; return; }
  TF_CPP_MIN_LOG_LEVEL=0 timeout -s KILL $(( t < 70 ? t : 70 )) python3 bench/bench_pask_step.py \
    --shape qwen2.5-0.5b --batch 8 --context 8192 --layouts unrolled --no-full --steps 3 \
    --mixes 0.2,0.65,0.15 --lo-page 128 --lo-format int4 --donate-state "$@" > $d/$tag.log 2>&1
  echo "$tag rc $?"; grep -E "mix \(|Error|error" $d/$tag.log | cut -c1-300
  grep -E "Updated [0-9]+ commands|updated_allocs" $d/$tag.log | sed 's/.*\] //' | tail -4 | cut -c1-200
}
TF_CPP_VMODULE=command_executor=3,command_buffer_thunk=3 step kinds
grep "Skip updating command" $d/kinds.log | sed 's/.*Skip updating command //' | sort | uniq -c
TF_CPP_VMODULE=gpu_executable_va_remap_allocator=3,command_buffer_thunk=3,command_executor=1,gpu_executable_buffer_allocator=3 \
  XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP step skiptemp
grep -E "allocation policy|VA remap|remapping" $d/skiptemp.log | sed 's/.*\] //' | sort | uniq -c | head
TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 \
  XLA_FLAGS=--xla_gpu_temp_buffer_use_separate_color=true step color
tar czf $OUT/launch24d.tgz -C /tmp launch24d
