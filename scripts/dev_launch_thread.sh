# Device (H100 or H200): issue 24 -- the overlapped forward launched on a worker thread.
# The serving cell of dev_serving05.sh
# (8K in / 256 out, c=8, 0.5B shape; the real Qwen2.5-Coder-0.5B too when its GGUF is in
# /tmp/m) with the launch thread off / on and the pick's branches chosen on the device (lax.cond,
# as before) / on the host, on the same engines (an A/B in one process).
# Then bench/launch_overlap.py (does a launch release the GIL: a stand-in step of N small GEMMs
# on a worker thread against pure-Python work).  Carry .whl and .tok.
# EA="on off": also each forward's decided actions copied to the host right behind it (the
# default) vs when the host reads them.
#   LIMIT=300 bash scripts/dev_launch_thread.sh
#   LT=on PICK=host EA="on off" METHODS="pask full xla" LIMIT=300 bash scripts/dev_launch_thread.sh
# Raw output: $OUT/overlap.jsonl, $OUT/lt/ (results.jsonl row by row, summary.md, lt.log): a
# call cut short still returns the rows it finished.
. scripts/h200_env.sh || exit 1
limit=${LIMIT:-300}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p $OUT/lt
timeout -s KILL $((limit - 20)) python3 bench/bench_serving.py --shape qwen2.5-0.5b \
  --tokenizer .tok --inputs 8192 --outputs ${OUTPUTS:-256} --concurrency 8 \
  --methods ${METHODS:-pask full xla} \
  --kv-memory 16 --page 16 --lo-format int4 --prefill-memo --time-limit $((limit - 40)) \
  --launch-thread ${LT:-off on} --pick-branches ${PICK:-device host} \
  --early-actions ${EA:-on} --out $OUT/lt \
  > $OUT/lt/lt.log 2>&1
echo "serving rc $?"
OUT=$OUT python3 - <<'PY'
import json
import os
for line in open(os.path.join(os.environ["OUT"], "lt", "results.jsonl")):
  r = json.loads(line)
  if r.get("status") != "ok":
    print(r.get("model"), r.get("status"), r.get("reason")); continue
  print(r["model"][:24], r["method"], "thread", r.get("launch_thread"), "pick",
        r.get("pick_branches"), "early", r.get("early_actions"), "TPOT",
        round(r["tpot_ms_median"], 3), "host ms/step",
        {k: round(v, 3) for k, v in r.get("host_ms_per_step", {}).items()})
PY
rm -f $OUT/lt/*.png
if [ -z "$NO_PROBE" ]; then   # after the A/B: what is left of the call
  timeout 30 python3 bench/launch_overlap.py --kernels 400 --py-us 1000 --iters 100 2>&1 \
    | grep '^{' | tee -a $OUT/overlap.jsonl
fi
