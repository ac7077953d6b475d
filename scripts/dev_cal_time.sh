# Device (H200; H100 for a first look): issue 24's calibration goals on the record's command —
# Alg. 1 for the Qwen 0.5B (uncentered, as the committed policies/qwen2.5-coder-0.5b-instruct-bfcl,
# 40 + 40 cases per category) in <= 120 s of calibration proper with the same selected policy,
# and stacked vs sequential Runtime-V interventions >= 8x (--speedup 24; the record: 4.0x with
# --rows 2048). Run on a warm machine after the 0.5B upload (/tmp/m, see h200_bfcl05.sh); carry .whl.
#   LIMIT=560 bash scripts/dev_cal_time.sh
# Raw output under $OUT: cal.log, calibration.json, speedup.json, policy.tgz, diff.txt.
. scripts/h200_env.sh
limit=${LIMIT:-560}
left() { echo $((limit - SECONDS - 30)); }
rm -rf /tmp/caltime
t=$(left); [ $t -gt 60 ] || exit 0
timeout -k 10 $t python3 -m pask_jax.cli calibrate --model qwen2.5-coder-0.5b-instruct \
  --key-center off --out /tmp/caltime --max-cases 40 --rows ${ROWS:-2048} --max-tokens 128 \
  --speedup 24 > $OUT/cal.log 2>&1
echo "calibrate rc $?"
tr '\r' '\n' < $OUT/cal.log | grep -vE "gen/s\]|tensor/s\]|it/s\]" | tail -25
cp /tmp/caltime/calibration.json /tmp/caltime/speedup.json $OUT/ 2>/dev/null
[ -d /tmp/caltime/policy ] && tar czf $OUT/policy.tgz -C /tmp/caltime policy
# the selected policy against the committed one (its record says which command made it)
python3 - > $OUT/diff.txt 2>&1 <<'PY'
import json
import numpy as np
from pask_jax import policy as P
a, b = P.load("/tmp/caltime/policy"), P.load("policies/qwen2.5-coder-0.5b-instruct-bfcl")
for k in ("action", "floor", "prio", "b_d", "b_p"):
  print(k, "equal" if np.array_equal(np.asarray(getattr(a, k)), np.asarray(getattr(b, k)))
        else "differs")
print("committed record:", json.dumps(b.record)[:600])
c = json.load(open("/tmp/caltime/calibration.json"))
print("timings_s", json.dumps(c.get("timings_s")), "wall_s", c.get("wall_s"))
PY
cat $OUT/diff.txt
