# Device (H200): the warp-specialized INT4 kernel over the cache's int4 pool (issue 22:
# `mgpu_int4.partition_ws` with a page table; `decode_attention(..., wgs_lo=2|3)`), beside the
# one-warpgroup pool kernel in the same run, in three places:
#   1. the kernel alone over a pool with shuffled tables (bench_mgpu_int4.py --pool: rel err
#      against float32 attention with ragged lengths, CUPTI time at full length, TB/s of packed
#      bytes; 4B-like and 0.5B heads, B=8, 32K);
#   2. the decode-attention call, int4 format, pages of 128 (bench_kernels.py, CUPTI per kernel,
#      mosaic variants: page ids in global or shared memory (table_lo), wgs_lo 1 / 2 / 3);
#   3. the whole step, Qwen3-4B shape, B=8, 32K, two mixes + all-BF16: the default kernel, ids in
#      shared memory, and the warp-specialized kernel with them, as time allows.
#   LIMIT=560 bash scripts/h200_ws_pool.sh      (no wheels or model needed)
# Every part runs under `timeout -s KILL` (a kernel that hangs the GPU cannot hold the call).
# Raw output under $OUT: env.txt, pool.jsonl, pool.log, kern/, kern.log, step_*.jsonl, step_*.log.
. scripts/h200_env.sh 2>/dev/null || export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-560}
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt
git rev-parse HEAD >> $OUT/env.txt 2>/dev/null; git status --short >> $OUT/env.txt 2>/dev/null
left() { echo $((limit - SECONDS - 15)); }
timeout -s KILL 190 python3 bench/bench_mgpu_int4.py --pool --out $OUT/pool.jsonl \
  > $OUT/pool.log 2>&1
echo "pool rc $?"; grep -v '"how": "write"' $OUT/pool.jsonl | cut -c1-260
timeout -s KILL $(( $(left) < 200 ? $(left) : 200 )) python3 bench/bench_kernels.py \
  --out $OUT/kern --lo-page 128 --lo-formats int4 --int4-kernels mosaic --shapes 0,3 --no-gqa \
  --cupti --mosaic-variants '[{}, {"merge": "concat"}, {"table_lo": "smem"}, {"wgs_lo": 2}, {"wgs_lo": 2, "table_lo": "smem"}, {"wgs_lo": 2, "splits_lo": 4, "table_lo": "smem"}, {"wgs_lo": 3, "table_lo": "smem"}]' \
  > $OUT/kern.log 2>&1
echo "kern rc $?"; tail -16 $OUT/kern.log
for kn in '{}' '{"table_lo": "smem"}' '{"wgs_lo": 2, "table_lo": "smem"}'; do
  t=$(left); [ $t -gt 60 ] || { echo "no time for the step bench $kn"; break; }
  tag=$(echo "$kn" | tr -dc 'a-z0-9')
  timeout -s KILL $(( t < 110 ? t : 110 )) python3 bench/bench_pask_step.py --shape qwen3-4b \
    --batch 8 --context 32768 --mixes 0.2,0.65,0.15 0.5,0.4,0.1 --layouts unrolled --no-full \
    --lo-page 128 --lo-format int4 --kernel-knobs "$kn" --json $OUT/step_${tag:-base}.jsonl \
    > $OUT/step_${tag:-base}.log 2>&1
  echo "step $kn rc $?"; tail -4 $OUT/step_${tag:-base}.log
done
