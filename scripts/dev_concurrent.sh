# Device (H100 or H200): issue 22 -- the B≈0.33 call's two short kernels (Mosaic GPU INT4 over the
# int4 pool, Triton over the BF16 pool and window) running beside each other instead of back to
# back, each of which alone ramps and tails at ~2.5 TB/s:
#   * XLA's command buffers (CUDA graphs) built from buffer dependencies
#     (--xla_gpu_command_buffer_scheduling_mode=CONCURRENT) instead of the schedule (LHS, the
#     default): independent kernels become parallel graph nodes, everywhere in the step;
#   * the knob stream_lo=1 (the two launches as async calls on XLA streams 1 and 2).
# Per flag setting, in one call: bench_kernels.py (4B-like and 0.5B shapes, B=8, 32K, chained
# calls, no CUPTI: concurrency shows in wall time only), then the whole step at the 0.5B shape
# (8K) and the Qwen3-4B shape (32K), each with its all-BF16 baseline.  No wheels needed.
#   LIMIT=540 bash scripts/dev_concurrent.sh
# Raw output: $OUT/concurrent.tgz (env.txt, {lhs,conc}_{kern,step05,step4b}.{log,jsonl}, kern_*/).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-540}
d=/tmp/concurrent && rm -rf $d && mkdir -p $d
. scripts/device_env.sh $d
left() { echo $((limit - SECONDS - 15)); }
run() {  # tag, cap, command...
  local tag=$1 cap=$2 t; shift 2; t=$(left)
  [ $t -gt 40 ] || { echo "no time for $tag"; return; }
  timeout -k 5 -s KILL $(( t < cap ? t : cap )) "$@" > $d/$tag.log 2>&1
  echo "$tag rc $?"
}
for part in ${PARTS:-kern step05 step4b}; do
  for mode in ${MODES:-LHS CONCURRENT}; do
    tag=$(echo $mode | tr A-Z a-z | cut -c1-4)_$part
    export XLA_FLAGS="--xla_gpu_command_buffer_scheduling_mode=$mode"
    case $part in
      kern) run $tag 110 python3 bench/bench_kernels.py --out $d/$tag --lo-page 128 \
              --lo-formats int4 --int4-kernels mosaic --shapes 0,3 --no-gqa \
              --mosaic-variants '[{}, {"stream_lo": 1}]'
            grep -E "^(4B|0.5B)" $d/$tag.log | cut -c1-160 ;;
      step05) run $tag 90 python3 bench/bench_pask_step.py --shape qwen2.5-0.5b --batch 8 \
              --context 8192 --layouts unrolled --no-full --lo-page 128 --lo-format int4 \
              --steps 16 --mixes 0.2,0.65,0.15 --json $d/$tag.jsonl
            grep -E "mix \(|all|Error" $d/$tag.log | cut -c1-200 ;;
      step4b) run $tag 160 python3 bench/bench_pask_step.py --shape qwen3-4b --batch 8 \
              --context 32768 --layouts unrolled --no-full --lo-page 128 --lo-format int4 \
              --steps 8 --mixes 0.2,0.65,0.15 --json $d/$tag.jsonl
            grep -E "mix \(|all|Error" $d/$tag.log | cut -c1-200 ;;
    esac
  done
done
unset XLA_FLAGS
tar czf $OUT/concurrent.tgz -C /tmp concurrent
