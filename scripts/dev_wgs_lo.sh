# Device (H100 or H200): the warp-specialized INT4 pool kernel behind decode_attention (issue 22,
# `wgs_lo`) against the one-warpgroup default, where the first run (scripts/h200_ws_pool.sh,
# 2026-12-05 on an H100) ran out of time: the decode call's mosaic variants at the 4B-like shape
# (wgs_lo=3 without shared-memory ids, context splits 12 / 16; CUPTI per kernel), the whole
# Qwen3-4B-shape step (B=8, 32K, two mixes + all-BF16 in the same process) with wgs_lo=3, then
# the 0.5B shape's variants.
#   LIMIT=300 bash scripts/dev_wgs_lo.sh      (no wheels or model needed)
# Raw output under $OUT: env.txt, kern05/, kern05.log, kern4b/, kern4b.log, step_*.jsonl/log.
. scripts/h200_env.sh 2>/dev/null || export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-480}
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt
git rev-parse HEAD >> $OUT/env.txt 2>/dev/null; git status --short >> $OUT/env.txt 2>/dev/null
left() { echo $((limit - SECONDS - 15)); }
t=$(left); [ $t -gt 40 ] && timeout -s KILL $(( t < 130 ? t : 130 )) python3 bench/bench_kernels.py \
  --out $OUT/kern4b --lo-page 128 --lo-formats int4 --int4-kernels mosaic --shapes 0 --no-gqa \
  --cupti --mosaic-variants '[{}, {"wgs_lo": 3}, {"splits_lo": 12}, {"splits_lo": 16}, {"wgs_lo": 3, "splits_lo": 6, "table_lo": "smem"}]' \
  > $OUT/kern4b.log 2>&1
echo "kern4b rc $?"; grep -E "^\{" $OUT/kern4b.log | cut -c1-230
for kn in '{"wgs_lo": 3, "table_lo": "smem"}' '{"wgs_lo": 3}'; do
  t=$(left); [ $t -gt 60 ] || { echo "no time for the step bench $kn"; break; }
  tag=$(echo "$kn" | tr -dc 'a-z0-9')
  timeout -s KILL $(( t < 110 ? t : 110 )) python3 bench/bench_pask_step.py --shape qwen3-4b \
    --batch 8 --context 32768 --mixes 0.2,0.65,0.15 0.5,0.4,0.1 --layouts unrolled --no-full \
    --lo-page 128 --lo-format int4 --kernel-knobs "$kn" --json $OUT/step_${tag}.jsonl \
    > $OUT/step_${tag}.log 2>&1
  echo "step $kn rc $?"; tail -4 $OUT/step_${tag}.log
done
t=$(left); [ $t -gt 40 ] && timeout -s KILL $(( t < 150 ? t : 150 )) python3 bench/bench_kernels.py \
  --out $OUT/kern05 --lo-page 128 --lo-formats int4 --int4-kernels mosaic --shapes 3 --no-gqa \
  --cupti --mosaic-variants '[{}, {"wgs_lo": 2}, {"wgs_lo": 3}, {"wgs_lo": 3, "table_lo": "smem"}, {"table_lo": "smem"}]' \
  > $OUT/kern05.log 2>&1
echo "kern05 rc $?"; grep -E "^\{" $OUT/kern05.log | cut -c1-230
