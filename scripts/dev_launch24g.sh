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
. scripts/step05.sh launch24g
step05 recycle --recycle-logits
step05 alternate --recycle-logits --alternate
step05 recycle2 --recycle-logits
step05 alternate2 --recycle-logits --alternate
step05 alternate_prof --recycle-logits --alternate --profile $d/prof
rm -rf $d/prof
tar czf $OUT/launch24g.tgz -C /tmp launch24g
