# Device (H100 or H200): issue 24, third pass at the per-step graph updates (0.5B shape, B=8, 8K,
# mix .20/.65/.15 and all-BF16, balances and ledger donated): does SKIP_TEMP pin the temp buffer
# (va-remap allocator log), which command kinds are skipped, and the separate temp color.
#   kinds      command_executor=3 ("Skip updating command <kind>"), command_buffer_thunk=3
#   skiptemp   --xla_gpu_command_buffer_update_mode=SKIP_TEMP, the va-remap allocator's log
#   color      --xla_gpu_temp_buffer_use_separate_color=true, updated_allocs per step
#   LIMIT=200 bash scripts/dev_launch24d.sh
# Raw output: $OUT/launch24d.tgz.
LIMIT=${LIMIT:-200} . scripts/step05.sh launch24d
step() { TF_CPP_MIN_LOG_LEVEL=0 STEPS=3 CAP=70 step05 "$@" --donate-state; }
TF_CPP_VMODULE=command_executor=3,command_buffer_thunk=3 step kinds
grep "Skip updating command" $d/kinds.log | sed 's/.*Skip updating command //' | sort | uniq -c
TF_CPP_VMODULE=gpu_executable_va_remap_allocator=3,command_buffer_thunk=3,command_executor=1,gpu_executable_buffer_allocator=3 \
  XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP step skiptemp
grep -E "allocation policy|VA remap|remapping" $d/skiptemp.log | sed 's/.*\] //' | sort | uniq -c | head
TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 \
  XLA_FLAGS=--xla_gpu_temp_buffer_use_separate_color=true step color
tar czf $OUT/launch24d.tgz -C /tmp launch24d
