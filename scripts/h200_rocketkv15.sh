# Device: RocketKV (pask_jax/baselines/rocketkv.py) on Qwen2.5-Coder-1.5B — its knobs tuned on the
# dev split at B 0.33 / 0.20 / 0.15 (`pask-jax tune --methods rocketkv --grid small`, one Full-KV
# run for the three), then the test cells of examples/campaign_15b_rocketkv.toml.  Resumable on a
# warm machine (/tmp/tune15r, /tmp/c15r): call again until the campaign has nothing left.
#   LIMIT=560 bash scripts/h200_rocketkv15.sh   (carry .whl; the 1.5B uploaded to /tmp/m; the tree
#   may be held without results/: the plan's cells are RocketKV's only)
# Back: $OUT/tune15r.tgz (knobs.json + tune.csv per budget), $OUT/c15r.tgz (cells).
# Commit: results/tune/qwen15-bfcl-rocketkv/ from tune15r.tgz, the cells into
# results/campaign/qwen15-bfcl/.
set -x
. scripts/h200_env.sh
limit=${LIMIT:-560}
timeout $((limit - 60)) python3 -m pask_jax.cli tune --model qwen2.5-coder-1.5b-instruct \
  --methods rocketkv --budget 0.33 0.20 0.15 --grid ${GRID:-small} --split dev \
  --categories simple_python multiple --max-tokens 128 --batch 120 --key-center on \
  --out /tmp/tune15r >> $OUT/tune15r.log 2>&1
tar czf $OUT/tune15r.tgz -C /tmp tune15r
n=$(grep -l '"complete": true' /tmp/tune15r/B*/knobs.json 2>/dev/null | wc -l)
echo "tune: $n of 3 budgets complete"
[ "$n" = 3 ] || exit 0
echo tuned
mkdir -p results/tune/qwen15-bfcl-rocketkv && cp -r /tmp/tune15r/. results/tune/qwen15-bfcl-rocketkv/
mkdir -p /tmp/c15r
left=$((limit - SECONDS - 60))
[ $left -gt 60 ] || exit 0
timeout $((left + 40)) python3 -m pask_jax.cli campaign examples/campaign_15b_rocketkv.toml \
  --time-limit $left --results /tmp/c15r --no-progress >> $OUT/campaign_rocketkv.log 2>&1
grep -E "accuracy|campaign|failed" $OUT/campaign_rocketkv.log | tail -40
tar czf $OUT/c15r.tgz -C /tmp c15r
