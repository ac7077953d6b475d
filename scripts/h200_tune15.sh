# Device (H200): tune the baselines' knobs on Qwen2.5-Coder-1.5B's dev split at B 0.33 / 0.20 /
# 0.15 (paper C.3; one Full-KV run for the three), then run a campaign plan with them.
# Resumable: /tmp/tune15<TAG> and /tmp/c15<TAG> survive between calls on a warm machine (a
# committed results/tune/qwen15-bfcl<TAG> seeds a fresh one), and `pask-jax tune` measures only
# the grid points still missing, so call it again until it says "tuned"; the campaign skips the
# cells committed under results/campaign/qwen15-bfcl/.
#   LIMIT=585 bash scripts/h200_tune15.sh   (carry .whl; the model uploaded to /tmp/m beforehand)
#   METHODS  the methods tuned at the three budgets (default: triaxial snapkv h2o streaming, then
#            MiKV at 0.33 only, into the same folder, and examples/campaign_15b_tuned.toml)
#   TAG      suffix of the tune and cells folders and of results/tune/qwen15-bfcl<TAG>
#   PLAN     the campaign plan run once tuned
#   RocketKV: METHODS=rocketkv TAG=-rocketkv PLAN=examples/campaign_15b_rocketkv.toml
# Results come back as $OUT/tune15<TAG>.tgz (knobs.json + tune.csv per budget) and
# $OUT/c15<TAG>.tgz; commit results/tune/qwen15-bfcl<TAG>/ and the cells into
# results/campaign/qwen15-bfcl/.
set -x
. scripts/h200_env.sh
limit=${LIMIT:-560}
tag=${TAG:-}
tune=/tmp/tune15$tag cells=/tmp/c15$tag
plan=${PLAN:-examples/campaign_15b_tuned.toml}
# A tune committed by an earlier call (results/tune/qwen15-bfcl<TAG>) seeds this one: a fresh
# machine measures only the grid points still missing (none once it is complete) and goes on to
# the plan's cells.
[ -d results/tune/qwen15-bfcl$tag ] && mkdir -p $tune && cp -rn results/tune/qwen15-bfcl$tag/. $tune/
timeout $((limit - 60)) python3 -m pask_jax.cli tune --model qwen2.5-coder-1.5b-instruct \
  --methods ${METHODS:-triaxial snapkv h2o streaming} --budget 0.33 0.20 0.15 --grid small \
  --split dev --categories simple_python multiple --max-tokens 128 --batch 120 --key-center on \
  --out $tune >> $OUT/tune15$tag.log 2>&1
# MiKV keeps every token at INT4 or better: tuned at 0.33 only, into the same folder (the other
# methods' knobs there stay).
t=$((limit - 60 - SECONDS))
[ -z "$METHODS" ] && [ $t -gt 60 ] && timeout $t python3 -m pask_jax.cli tune \
  --model qwen2.5-coder-1.5b-instruct --methods mikv --budget 0.33 --grid small --split dev \
  --categories simple_python multiple --max-tokens 128 --batch 120 --key-center on \
  --out $tune/B0.33 >> $OUT/tune15$tag.log 2>&1
tar czf $OUT/tune15$tag.tgz -C /tmp tune15$tag
n=$(grep -l '"complete": true' $tune/B*/knobs.json 2>/dev/null | wc -l)
mikv=$(grep -c '"method": "mikv"' $tune/B0.33/knobs.json 2>/dev/null)
echo "tune: $n of 3 budgets complete; mikv points ${mikv:-0}"
[ "$n" = 3 ] && { [ -n "$METHODS" ] || [ "${mikv:-0}" -gt 0 ]; } || exit 0
echo tuned
mkdir -p results/tune/qwen15-bfcl$tag && cp -r $tune/. results/tune/qwen15-bfcl$tag/
mkdir -p $cells && [ -d results/campaign/qwen15-bfcl ] && cp -rn results/campaign/qwen15-bfcl $cells/
left=$((limit - SECONDS - 60))
[ $left -gt 60 ] || exit 0
timeout $((left + 40)) python3 -m pask_jax.cli campaign $plan \
  --time-limit $left --results $cells --no-progress >> $OUT/campaign_tuned$tag.log 2>&1
grep -E "accuracy|campaign|failed" $OUT/campaign_tuned$tag.log | tail -40
tar czf $OUT/c15${tag:-t}.tgz -C /tmp c15$tag
