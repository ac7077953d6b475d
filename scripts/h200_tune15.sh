# Device (H200): tune the baselines' knobs on Qwen2.5-Coder-1.5B's dev split at B 0.33 / 0.20 /
# 0.15 (paper C.3; one Full-KV run for the three), then run examples/campaign_15b_tuned.toml with
# them.  Resumable: /tmp/tune15 and /tmp/c15 survive between calls on a warm machine, and `pask-jax
# tune` measures only the grid points still missing, so call it again until it says "tuned".
#   LIMIT=585 bash scripts/h200_tune15.sh   (carry .whl; the model uploaded to /tmp/m beforehand)
# Results come back as $OUT/tune15.tgz (knobs.json + tune.csv per budget) and $OUT/c15t.tgz.
set -x
. scripts/h200_env.sh
limit=${LIMIT:-560}
timeout $((limit - 60)) python3 -m pask_jax.cli tune --model qwen2.5-coder-1.5b-instruct \
  --methods triaxial snapkv h2o streaming --budget 0.33 0.20 0.15 --grid small --split dev \
  --categories simple_python multiple --max-tokens 128 --batch 120 --key-center on \
  --out /tmp/tune15 >> $OUT/tune15.log 2>&1
# MiKV keeps every token at INT4 or better: tuned at 0.33 only, into the same folder (the other
# methods' knobs there stay).
t=$((limit - 60 - SECONDS))
[ $t -gt 60 ] && timeout $t python3 -m pask_jax.cli tune \
  --model qwen2.5-coder-1.5b-instruct --methods mikv --budget 0.33 --grid small --split dev \
  --categories simple_python multiple --max-tokens 128 --batch 120 --key-center on \
  --out /tmp/tune15/B0.33 >> $OUT/tune15.log 2>&1
tar czf $OUT/tune15.tgz -C /tmp tune15
python3 - <<'PY' || exit 0
import glob, json, sys
done = [json.load(open(f)).get("complete") for f in sorted(glob.glob("/tmp/tune15/B*/knobs.json"))]
mikv = "mikv" in {r["method"] for r in json.load(open("/tmp/tune15/B0.33/knobs.json"))["log"]}
print("tune:", done, "mikv:", mikv)
sys.exit(0 if len(done) == 3 and all(done) and mikv else 1)
PY
echo tuned
mkdir -p results/tune/qwen15-bfcl && cp -r /tmp/tune15/. results/tune/qwen15-bfcl/
mkdir -p /tmp/c15 && cp -rn results/campaign/qwen15-bfcl /tmp/c15/
left=$((limit - SECONDS - 60))
[ $left -gt 60 ] || exit 0
timeout $((left + 40)) python3 -m pask_jax.cli campaign examples/campaign_15b_tuned.toml \
  --time-limit $left --results /tmp/c15 --no-progress >> $OUT/campaign_tuned.log 2>&1
grep -E "accuracy|campaign|failed" $OUT/campaign_tuned.log | tail -40
tar czf $OUT/c15t.tgz -C /tmp c15
