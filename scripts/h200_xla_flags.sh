# Device (H200): the PASK decode step and the decode-attention call under XLA's command-buffer
# (CUDA graph) settings (issues 22 and 24).  The step's launch takes 5-7 ms of host time at 32K
# and more than the device's work on the 0.5B (bench/RESULTS.md): does capturing the step's
# ~1,000 kernels into graphs cut it, and do concurrent graph regions let the INT4 and BF16
# partitions (independent kernels) overlap?
#   LIMIT=560 bash scripts/h200_xla_flags.sh   (no wheels or model needed)
# Each set takes ~2.5 minutes on an H100 (two step compiles and a kernel sweep): the five do not
# fit one call.  Sets already in /tmp/flags (a warm machine) are skipped, SETS="a b" picks some;
# a set is started only with 170 s left.  Raw output: $OUT/flags.tgz (flags/<set>/{step4b,step05}
# .{jsonl,log}, kern.log, kern/), the logs' tails printed.
. scripts/h200_env.sh 2>/dev/null || export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
cb="FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
declare -A sets=(
  [default]=""
  [no_graphs]="--xla_gpu_enable_command_buffer="
  [min1]="--xla_gpu_graph_min_graph_size=1"
  [all_min1]="--xla_gpu_enable_command_buffer=$cb --xla_gpu_graph_min_graph_size=1"
  [all_min1_conc]="--xla_gpu_enable_command_buffer=$cb --xla_gpu_graph_min_graph_size=1 --xla_gpu_graph_enable_concurrent_region=true"
  # the step's two while loops (the unrolled layout's) captured too
  [all_while]="--xla_gpu_enable_command_buffer=$cb,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
)
limit=${LIMIT:-560}
for name in ${SETS:-default no_graphs min1 all_min1 all_min1_conc all_while}; do
  [ -f /tmp/flags/$name/done ] && continue
  [ $((limit - SECONDS)) -gt 170 ] || { echo "no time for $name"; break; }
  d=/tmp/flags/$name && rm -rf $d && mkdir -p $d
  export XLA_FLAGS="${sets[$name]}"
  echo "== $name: XLA_FLAGS=$XLA_FLAGS" | tee $d/flags.txt
  timeout 100 python3 bench/bench_pask_step.py --shape qwen3-4b --batch 8 --context 32768 \
    --mixes 0.2,0.65,0.15 --layouts unrolled --no-full --lo-page 128 --lo-format int4 \
    --steps 8 --json $d/step4b.jsonl > $d/step4b.log 2>&1; tail -3 $d/step4b.log
  timeout 60 python3 bench/bench_pask_step.py --shape qwen2.5-0.5b --batch 8 --context 8192 \
    --mixes 0.2,0.65,0.15 --layouts unrolled --steps 8 --json $d/step05.jsonl \
    > $d/step05.log 2>&1; tail -3 $d/step05.log
  timeout 60 python3 bench/bench_kernels.py --out $d/kern --lo-page 128 --lo-formats int4 \
    --shapes 0 --no-gqa > $d/kern.log 2>&1; grep -E "^4B" $d/kern.log
  touch $d/done
done
unset XLA_FLAGS
tar czf $OUT/flags.tgz -C /tmp flags
