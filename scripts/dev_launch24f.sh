# Device (H100 or H200): issue 24, with the graph no longer re-parameterized (logits recycled):
# does the host run ahead of the device in a chained loop (host time per call while earlier
# steps still run), and the host calls per step (profiler).  0.5B shape, B=8, 8K.
#   LIMIT=200 bash scripts/dev_launch24f.sh
# Raw output: $OUT/launch24f.tgz.
LIMIT=${LIMIT:-200} . scripts/step05.sh launch24f
step05 recycle --recycle-logits
step05 recycle_prof --recycle-logits --profile $d/prof
step05 donate --donate-state
rm -rf $d/prof
tar czf $OUT/launch24f.tgz -C /tmp launch24f
