# Device (H100 or H200): issue 24, which buffers make XLA re-parameterize ~260 of the 0.5B step's
# 373 CUDA-graph nodes on every step ("Updated 373 commands in ~0.7 ms (skipped 109)").  The 0.5B
# shape, B=8, 8K, mix .20/.65/.15 and all-BF16 in each process (bench_pask_step.py):
#   addr      each execution's buffer addresses (gpu_executable=3), the update counts, the
#             copy-protection notes, and the buffer assignment (which allocation is what)
#   donate    --donate-state (balances and ledger donated with the cache), update counts
#   base, donate_t   the same two without logging, for time
#   LIMIT=300 bash scripts/dev_launch24c.sh
# Raw output: $OUT/launch24c.tgz.
. scripts/step05.sh launch24c
V=gpu_executable=3,command_buffer_thunk=3,command_executor=1,gpu_executable_buffer_allocator=3
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=$V STEPS=4 CAP=90 \
  XLA_FLAGS="--xla_dump_to=$d/dump --xla_dump_hlo_module_re=decode" step05 addr
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_executor=1 STEPS=4 CAP=90 step05 donate --donate-state
CAP=90 step05 base
CAP=90 step05 donate_t --donate-state
mkdir -p $d/ba && cp $d/dump/*buffer-assignment* $d/ba/ 2>/dev/null; rm -rf $d/dump
ls $d/ba | head
tar czf $OUT/launch24c.tgz -C /tmp launch24c
