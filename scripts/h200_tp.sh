# Device (H200 x1 / x2 / x4): tensor-parallel scaling (issue 29; bench/bench_tp.py): the serving
# matrix at 32K in (Qwen3-4B shape, random weights) for pask / full / xla at every TP size the
# host's GPUs allow, the Qwen3-14B shape's largest concurrency per TP size (host arithmetic), and
# the stacked calibration step sharded over 1, 2, 4 GPUs.  One command for every kind:
#   LIMIT=560 bash scripts/h200_tp.sh          (kinds nvidia-h200, nvidia-h200-x2, nvidia-h200-x4)
# Knobs (environment): TP="1 2 4" (default: 1, 2, 4 as far as the GPUs go), PARTS="serving
# capacity calib", CONC="8 16 32", MAXTOK=1024 (output tokens), CONTEXT=32768, TRACE=0 (N engine
# iterations traced per cell: the collective share).  The whole matrix at three TP sizes does
# not fit one call's 10 minutes: give each call one TP size (TP=1, TP=2, TP=4, with PARTS
# narrowed) and merge the outputs here with `python bench/bench_tp.py --merge DIR... --out DIR`.
# A tokenizer: bench/out/tok if carried (`python bench/bench_serving.py --export-tokenizer
# bench/out/tok`), else the wheels'.  NVLink multicast stays off (bench_tp sets the variables
# too).  Raw output under $OUT: env.txt, tp.log, tp/ (results.jsonl, summary.json, summary.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. scripts/h200_env.sh 2>/dev/null || export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-560}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/env.txt
nvidia-smi topo -m >> $OUT/env.txt 2>&1; git rev-parse HEAD >> $OUT/env.txt
tok=${TOKENIZER:-bench/out/tok}
tokarg=""; [ -e "$tok" ] && tokarg="--tokenizer $tok"
tparg=""; [ -n "$TP" ] && tparg="--tp $TP"
timeout $((limit - 10)) python3 bench/bench_tp.py $tokarg $tparg --parts ${PARTS:-serving capacity calib} \
  --context ${CONTEXT:-32768} --max-tokens ${MAXTOK:-1024} --concurrency ${CONC:-8 16 32} \
  --trace ${TRACE:-0} --time-limit $((limit - 40)) --build-margin 45 --out $OUT/tp > $OUT/tp.log 2>&1
echo "exit $?" >> $OUT/tp.log
tail -25 $OUT/tp.log
