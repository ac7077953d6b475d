# Device (H100 or H200): issue 24, the fix for the per-step graph updates: the step's logits are
# a fresh output buffer each step, and XLA's buffer assignment places ~97 of the step's
# intermediates in that buffer, so every command touching them is re-parameterized.  Donating
# the previous logits (``--recycle-logits``) keeps that buffer's address.  0.5B shape, B=8, 8K,
# mix .20/.65/.15 and all-BF16 in each process, balances and ledger donated in every variant:
#   donate / recycle            timings (8 steps), alternated twice
#   recycle_log                 the update counts with the logits recycled
#   LIMIT=300 bash scripts/dev_launch24e.sh
# Raw output: $OUT/launch24e.tgz.
. scripts/step05.sh launch24e
step() { CAP=70 step05 "$@" --donate-state; }
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 STEPS=3 \
  step recycle_log --recycle-logits
step donate
step recycle --recycle-logits
step donate2
step recycle2 --recycle-logits
tar czf $OUT/launch24e.tgz -C /tmp launch24e
