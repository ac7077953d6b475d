# Device (H200): calibrate Qwen2.5-Coder-1.5B with Alg. 1 and total-B targets, then run the
# campaign examples/campaign_15b.toml into /tmp/c15 (cells already in results/ are kept); what
# the warm machine keeps in /tmp (the calibration's stages, the cells) is resumed by the next call.
#   bash scripts/h200_campaign15.sh    (carry .whl; the model uploaded to /tmp/m beforehand)
#   LIMIT   seconds this call may take (default 560); MAX_CASES  cases per category for
#   calibration (default: every calibration case); WINDOWS  recent windows the decode candidates
#   are also evaluated at, the selection over all (e.g. "8 16 32"; default: 16 only); OUT  where
#   the logs and tarballs go.
# Results come back as $OUT/cal15c.tgz (policy + calibration.json) and $OUT/c15.tgz (cells).
# A call that only resumes the campaign must copy the policy again: every call sends the
# committed tree, whose policies/ still hold the committed policy (cells are keyed by it).
set -x
. scripts/h200_env.sh
limit=${LIMIT:-560}
if [ ! -d /tmp/cal15c/policy ]; then
  mkdir -p /tmp/cal15c
  timeout $((limit - 15)) python3 -m pask_jax.cli calibrate --model qwen2.5-coder-1.5b-instruct \
    --out /tmp/cal15c ${MAX_CASES:+--max-cases $MAX_CASES} --rows 1024 --max-tokens 128 \
    --window 16 ${WINDOWS:+--windows $WINDOWS} --targets 0.15 0.20 0.25 0.33 --keep-within-se 0 \
    >> $OUT/cal15.log 2>&1 \
    || { tail -c 3000 $OUT/cal15.log; exit 1; }
  tail -c 2500 $OUT/cal15.log
fi
rm -rf policies/qwen2.5-coder-1.5b-instruct-bfcl && mkdir -p policies/qwen2.5-coder-1.5b-instruct-bfcl
cp -r /tmp/cal15c/policy/. policies/qwen2.5-coder-1.5b-instruct-bfcl/
cp /tmp/cal15c/calibration.json policies/qwen2.5-coder-1.5b-instruct-bfcl/
mkdir -p /tmp/c15 && cp -rn results/campaign/qwen15-bfcl /tmp/c15/
# The policy and calibration record come back even if the campaign is cut short.
tar czf $OUT/cal15c.tgz -C /tmp cal15c/policy cal15c/calibration.json
# A campaign cell can run past --time-limit (its estimate is a guess): leave 60 s for the tars.
timeout $((limit - SECONDS - 20)) python3 -m pask_jax.cli campaign examples/campaign_15b.toml \
  --time-limit $((limit - SECONDS - 60)) --results /tmp/c15 --no-progress >> $OUT/campaign.log 2>&1
grep -E "accuracy|campaign|failed" $OUT/campaign.log | tail -40
tar czf $OUT/c15.tgz -C /tmp c15
