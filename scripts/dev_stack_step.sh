# Device (H100 or H200): issue 24, deliverable 2 -- where calibration's stacked decode step
# spends its device time (bench/stack_step.py): the 0.5B shape, the calibrate CLI's stacked
# shape at --rows 1024 (V 12 x N 80 = 960 rows) and the sequential baseline's (V 1 x N 80), every
# token BF16 and every decode token INT4, with the kernels by CUPTI.  Carry .whl.
#   LIMIT=300 bash scripts/dev_stack_step.sh
# Raw output: $OUT/stack_step.jsonl (a row per cell), $OUT/stack_step.log.
. scripts/h200_env.sh || exit 1
limit=${LIMIT:-300}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for cell in "12 all-high" "1 all-high" "12 int4" "1 int4"; do
  set -- $cell
  left=$((limit - SECONDS - 20))
  [ $left -gt 40 ] || break
  timeout -s KILL $left python3 bench/stack_step.py --shape qwen2.5-0.5b --policies $1 \
    --requests 80 --prompt 600 --capacity 1024 --policy $2 --cupti \
    --out $OUT/stack_step.jsonl >> $OUT/stack_step.log 2>&1
  echo "V=$1 $2 rc $?"
done
python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "stack_step.jsonl")):
  r = json.loads(line)
  print(r["V"], r["policy"], {k: r.get(k) for k in ("chained_ms", "forward_ms", "pick_ms",
        "forward_launch_ms", "forward_cupti_ms", "pick_cupti_ms", "forward_kernels")})
  for g in r.get("forward_groups", [])[:8] + r.get("pick_groups", [])[:4]:
    print("   ", g)
PY
