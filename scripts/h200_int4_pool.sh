# Device (H200): the int4 pool with its scales read as stored (issue 22), in three places:
# the decode-attention call (CUPTI per kernel, both pool formats), the whole step, and serving at
# 32K in / 1024 out (TPOT and throughput vs our Full KV through the same engine, pages of 128).
#   LIMIT=560 bash scripts/h200_int4_pool.sh      (no wheels or model needed)
# Serving needs a tokenizer: make one here with `python bench/bench_serving.py --export-tokenizer
# bench/out/tok` (3.4 MB) and carry bench/out/tok; without it the serving part is left out.
# Raw output under $OUT: kern/, kern.log, step.jsonl, step.log, serving/.
. scripts/h200_env.sh 2>/dev/null || export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-560}
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt; git rev-parse HEAD >> $OUT/env.txt
timeout 150 python3 bench/bench_kernels.py --out $OUT/kern --lo-page 128 --lo-formats bytes,int4 \
  --int4-kernels triton,mosaic --shapes 0,3 --no-gqa --cupti > $OUT/kern.log 2>&1
tail -14 $OUT/kern.log
timeout 120 python3 bench/bench_pask_step.py --shape qwen3-4b --batch 8 --context 32768 \
  --mixes 0.2,0.65,0.15 0.5,0.4,0.1 --layouts unrolled --no-full --lo-page 128 --lo-format int4 \
  --json $OUT/step.jsonl > $OUT/step.log 2>&1
tail -5 $OUT/step.log
left=$((limit - SECONDS - 20))
[ $left -gt 120 ] || exit 0
tok=${TOKENIZER:-bench/out/tok}
[ -e "$tok" ] || { echo "no tokenizer at $tok: serving left out (see the header)"; exit 0; }
timeout $left python3 bench/bench_serving.py --tokenizer "$tok" --shape qwen3-4b --inputs 32768 --outputs 1024 \
  --concurrency 8 32 --methods pask full --kv-memory 64 --prefill-memo --page 128 \
  --lo-format int4 --time-limit $((left - 20)) --out $OUT/serving > $OUT/serving.log 2>&1
tail -8 $OUT/serving.log
