# Device: the all-BF16 step (every token evicted into the BF16 pool) of bench/bench_pask_step.py
# ended in CUDA_ERROR_ILLEGAL_ADDRESS on an H100 (scripts/h200_xla_flags.sh at 83bbe5f, --steps 8):
# the bench sized its pools for S + 1 steps and ran 2 S + 1, and an overflowed pool's length
# kept growing past its pages, so the kernels read past the page table.  Both fixed; this reruns
# the commands that faulted and the 0.5B step under compute-sanitizer's memcheck.
#   bash scripts/dev_allbf16.sh      (no wheels or model needed; ~4 minutes)
. scripts/h200_env.sh 2>/dev/null || export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
d=$OUT/allbf16 && mkdir -p $d
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $d/env.txt; git rev-parse HEAD >> $d/env.txt
run() {  # tag, seconds, args...
  local tag=$1 t=$2; shift 2
  timeout -s KILL $t python3 bench/bench_pask_step.py --layouts unrolled --no-full --batch 8 \
    --mixes 0.2,0.65,0.15 "$@" > $d/$tag.log 2>&1
  echo "$tag rc $? :: $(grep -E 'mix \(|Error|overflow' $d/$tag.log | cut -c1-150 | tr '\n' '|')"
}
run step05 50 --shape qwen2.5-0.5b --context 8192 --steps 8
if command -v compute-sanitizer >/dev/null; then
  timeout -s KILL 110 compute-sanitizer --tool memcheck --print-limit 3 --log-file $d/sanitizer.txt \
    python3 bench/bench_pask_step.py --shape qwen2.5-0.5b --batch 2 --layouts unrolled --no-full \
    --steps 2 --context 2048 --mixes 0.2,0.65,0.15 > $d/sanitized.log 2>&1
  echo "sanitizer rc $?"; grep -m 12 -E "Invalid|by thread|Address|ERROR SUMMARY" $d/sanitizer.txt
  grep -E "mix \(" $d/sanitized.log
fi
run step4b 110 --shape qwen3-4b --context 32768 --steps 8 --lo-page 128 --lo-format int4
