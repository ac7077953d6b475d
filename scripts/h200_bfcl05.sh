# Device (H200): Qwen2.5-Coder-0.5B with centered keys on BFCL (issue 23's 0.5B goals), in three
# resumable stages on a warm machine (/tmp/cal05c, /tmp/tune05, /tmp/c05 survive between calls):
#   1. Alg. 1 with total-B targets, the 1.5B's flags (scripts/h200_campaign15.sh);
#   2. the baselines' knobs tuned on the 0.5B's dev split at B 0.33 / 0.20 / 0.15 (MiKV at 0.33);
#   3. examples/campaign_05b.toml on the whole non-live test split of simple_python + multiple.
# Each stage runs only when the one before it is complete; call again until it prints "campaign
# done" (a plan with unreachable cells, e.g. TriAxialKV at 0.20, ends "failed N" instead).
# PLAN=examples/campaign_05b_decomp.toml runs that plan as stage 3 (the committed cells skipped).
#   LIMIT=560 bash scripts/h200_bfcl05.sh   (carry .whl; the model uploaded to /tmp/m:
# .chunks/q05_pNN, 13 pieces of 38 MB, sha256 1d961463...)
# Back under $OUT: cal05c.tgz (policy + calibration.json), tune05.tgz, c05.tgz, the logs; a
# calibration cut short leaves cal05c_work.tgz (its saved stages). To go on on another machine,
# copy cal05c_work.tgz / tune05.tgz to .cal05c_work.tgz / .tune05.tgz here and name them in
# carry (git-ignored).
# Commit: policy -> policies/qwen2.5-coder-0.5b-instruct-bfcl-centered/ (+ calibration.json),
# tune -> results/tune/qwen05c-bfcl/, cells -> results/campaign/qwen05c-bfcl/.
set -x
. scripts/h200_env.sh
limit=${LIMIT:-560}
m=qwen2.5-coder-0.5b-instruct
# The committed policies/$m-bfcl-centered/ was calibrated with --keep-within-se 0 (the
# paper's rule; calibrate's default is now 1, the -keep folder's). KEEP_SE=K: stage 1
# calibrates with --keep-within-se K instead (its own folders: /tmp/cal05k,
# policies/$m-bfcl-centered-keep/, cal05k*.tgz, .cal05k_work.tgz), e.g. with
# PLAN=examples/campaign_05b_keep.toml for its cells.
pol=policies/$m-bfcl-centered${KEEP_SE:+-keep}
[ -n "${KEEP_SE:-}" ] && cal=cal05k || cal=cal05c
left() { echo $((limit - SECONDS - 40)); }
if [ ! -f /tmp/$cal/calibration.json ] && [ ! -f $pol/calibration.json ]; then
  [ $(left) -gt 60 ] || exit 0
  mkdir -p /tmp/$cal
  # a calibration cut short resumes from its saved stages, on this machine or (carry
  # .${cal}_work.tgz, the tarball it left under $OUT) on the next one
  [ -f .${cal}_work.tgz ] && [ ! -d /tmp/$cal/work ] && tar xzf .${cal}_work.tgz -C /tmp
  timeout -k 10 $(left) python3 -m pask_jax.cli calibrate --model $m --out /tmp/$cal \
    ${MAX_CASES:+--max-cases $MAX_CASES} --rows 1024 --max-tokens 128 --window 16 \
    --targets 0.15 0.20 0.25 0.33 --keep-within-se ${KEEP_SE:-0} >> $OUT/$cal.log 2>&1 || {
      tail -c 3000 $OUT/$cal.log; tar czf $OUT/${cal}_work.tgz -C /tmp $cal/work; exit 0; }
  tail -c 2500 $OUT/$cal.log
  tar czf $OUT/$cal.tgz -C /tmp $cal/policy $cal/calibration.json
fi
if [ -f /tmp/$cal/calibration.json ]; then
  rm -rf $pol && mkdir -p $pol && cp -r /tmp/$cal/policy/. $pol/ && cp /tmp/$cal/calibration.json $pol/
fi
tuned() { python3 - <<'PY'
import glob, json, sys
done = [json.load(open(f)).get("complete") for f in sorted(glob.glob("/tmp/tune05/B*/knobs.json"))]
try:
  mikv = "mikv" in {r["method"] for r in json.load(open("/tmp/tune05/B0.33/knobs.json"))["log"]}
except (OSError, KeyError, ValueError):
  mikv = False
print("tune:", done, "mikv:", mikv)
sys.exit(0 if len(done) == 3 and all(done) and mikv else 1)
PY
}
# a tune cut short goes on where it stopped (tune measures only the points still missing), here
# or from a carried .tune05.tgz (the tune05.tgz a call left under $OUT)
[ -f .tune05.tgz ] && [ ! -d /tmp/tune05 ] && tar xzf .tune05.tgz -C /tmp
if [ ! -d results/tune/qwen05c-bfcl ] && ! tuned; then
  [ $(left) -gt 90 ] || exit 0
  timeout -k 10 $(left) python3 -m pask_jax.cli tune --model $m --methods triaxial snapkv h2o streaming \
    --budget 0.33 0.20 0.15 --grid small --split dev --categories simple_python multiple \
    --max-tokens 128 --batch 120 --key-center on --out /tmp/tune05 >> $OUT/tune05.log 2>&1
  [ $(left) -gt 60 ] && timeout -k 10 $(left) python3 -m pask_jax.cli tune --model $m --methods mikv \
    --budget 0.33 --grid small --split dev --categories simple_python multiple --max-tokens 128 \
    --batch 120 --key-center on --out /tmp/tune05/B0.33 >> $OUT/tune05.log 2>&1
  tar czf $OUT/tune05.tgz -C /tmp tune05
  tuned || exit 0
fi
[ -d results/tune/qwen05c-bfcl ] || { mkdir -p results/tune/qwen05c-bfcl && cp -r /tmp/tune05/. results/tune/qwen05c-bfcl/; }
t=$(left); [ $t -gt 60 ] || exit 0
mkdir -p /tmp/c05 && cp -rn results/campaign/qwen05c-bfcl /tmp/c05/ 2>/dev/null
timeout $((t + 20)) python3 -m pask_jax.cli campaign ${PLAN:-examples/campaign_05b.toml} --time-limit $t \
  --results /tmp/c05 --no-progress >> $OUT/campaign05.log 2>&1 && echo "campaign done"
grep -E "accuracy|campaign|failed" $OUT/campaign05.log | tail -40
tar czf $OUT/c05.tgz -C /tmp c05
