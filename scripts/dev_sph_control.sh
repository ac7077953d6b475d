# Device (H200; an H100 for a first look): issue 26's G6 -- Spherical KV's control plane against
# the work it steers (bench/sph_control.py): RDR solve + encode vs the prefill, the decode-time
# control vs a step, metadata vs resident bytes; the 1.5B shape at 32K and 8K, then the 0.5B
# shape at 32K, B = 8, the full method and the gated rule.  Carry .whl.
#   LIMIT=420 bash scripts/dev_sph_control.sh
# Raw output: $OUT/sph_control.jsonl (row by row), $OUT/sph_control.log.
. scripts/h200_env.sh || exit 1
limit=${LIMIT:-420}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
left() { echo $((limit - SECONDS - 15)); }
for args in "--shape qwen2.5-1.5b --context 32768 8192" "--shape qwen2.5-0.5b --context 32768"; do
  t=$(left); [ $t -gt 30 ] || break
  timeout -k 5 $t python3 bench/sph_control.py $args --batch ${BATCH:-8} --prefill ${PREFILL:-flash exact} --cupti \
    --out $OUT/sph_control.jsonl >> $OUT/sph_control.log 2>&1
  echo "$args rc $?"
done
grep -v "^E0000\|Source Location\|libtpu_init" $OUT/sph_control.log | tail -8 | cut -c1-600
