# Device: the all-BF16 step (an empty INT4 partition) of bench/bench_pask_step.py ended in
# CUDA_ERROR_ILLEGAL_ADDRESS on an H100 (scripts/h200_xla_flags.sh, 2026-12-05, 83bbe5f) where the
# same command ran at e1ce4c2.  Which configuration faults, and which kernel (compute-sanitizer)?
#   bash scripts/dev_allbf16.sh      (no wheels or model needed; ~4 minutes)
. scripts/h200_env.sh 2>/dev/null || export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
d=$OUT/allbf16 && mkdir -p $d
run() {  # tag, seconds, args...
  local tag=$1 t=$2; shift 2
  timeout -s KILL $t python3 bench/bench_pask_step.py --shape qwen2.5-0.5b --batch 8 \
    --layouts unrolled --no-full --steps 8 "$@" > $d/$tag.log 2>&1
  echo "$tag rc $? :: $(grep -E 'mix \(|Error' $d/$tag.log | cut -c1-150 | tr '\n' '|')"
}
run bytes_kernel 45 --context 8192 --mixes 0,0,1
run bytes_sets 45 --context 8192 --mixes 0,0,1 --kernel-knobs '{"merge": "sets"}'
run int4_kernel 45 --context 8192 --mixes 0,0,1 --lo-format int4 --lo-page 128
if command -v compute-sanitizer >/dev/null; then
  timeout -s KILL 110 compute-sanitizer --tool memcheck --print-limit 3 --log-file $d/sanitizer.txt \
    python3 bench/bench_pask_step.py --shape qwen2.5-0.5b --batch 8 --layouts unrolled --no-full \
    --steps 1 --context 8192 --mixes 0,0,1 > $d/sanitized.log 2>&1
  echo "sanitizer rc $?"; grep -m 12 -E "Invalid|at |by thread|Address|ERROR SUMMARY" $d/sanitizer.txt
fi
