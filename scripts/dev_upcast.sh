# Device: issue 22's INT4 tiles upcast by 32-bit loads (pallas_kernels/gpu/mgpu_upcast.py,
# k_upcast / v_upcast "bf16_perm"; decode_attention's upcast_lo for K) against the default byte
# loads, each pair in one process, most valuable first:
#   1. the int4 pool kernel alone, 4B-like and 0.5B, B=8, 32K, (K, V) upcasts (bf16, bf16),
#      (perm, bf16), (bf16, perm), (perm, perm), (perm_offset, perm) (rel err vs float32
#      attention, CUPTI µs, TB/s):
#      bench_mgpu_int4.py --pool --upcast-only;
#   2. one decode call per shape with CUPTI per kernel (bench_kernels.py --mosaic-variants: each
#      K upcast, one and three compute warpgroups);
#   3. the whole Qwen3-4B-shape step, B=8, 32K, both mixes and all-BF16, with each upcast;
#   4. Nsight Compute: instruction statistics and per-SASS-line counts of the kernel with both
#      operands permuted.
#   LIMIT=560 bash scripts/dev_upcast.sh       (no wheels or model)
# Raw output under $OUT (pool.*, kern_*/, step_*.{jsonl,log}, ncu*).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
limit=${LIMIT:-560}
left() { echo $((limit - SECONDS - 15)); }
cap() { local t; t=$(left); echo $(( t < $1 ? t : $1 )); }
. scripts/device_env.sh $OUT
timeout -s KILL $(cap 150) python3 bench/bench_mgpu_int4.py --pool --upcast-only \
  --out $OUT/pool.jsonl > $OUT/pool.log 2>&1
echo "pool rc $?"; grep -E '^\{' $OUT/pool.log | cut -c1-400
v='[{"upcast_lo": "bf16"}, {"upcast_lo": "bf16_perm"}, {"upcast_lo": "bf16_perm_offset"}, {"wgs_lo": 3, "upcast_lo": "bf16"},
   {"wgs_lo": 3, "upcast_lo": "bf16_perm"}]'
for s in 0 3; do
  [ $(left) -gt 45 ] || break
  timeout -k 5 -s KILL $(cap 110) python3 bench/bench_kernels.py --out $OUT/kern_$s \
    --lo-page 128 --lo-formats int4 --int4-kernels mosaic --shapes $s --no-gqa --cupti \
    --mosaic-variants "$v" > $OUT/kern_$s.log 2>&1
  echo "kern_$s rc $?"; grep -E '^\{' $OUT/kern_$s.log | cut -c1-300
done
i=0
for kn in '{"upcast_lo": "bf16"}' '{"upcast_lo": "bf16_perm"}' '{"upcast_lo": "bf16_perm_offset"}'; do
  [ $(left) -gt 60 ] || break
  timeout -s KILL $(cap 150) python3 bench/bench_pask_step.py --batch 8 --layouts unrolled \
    --no-full --lo-page 128 --lo-format int4 --steps 8 --shape qwen3-4b --context 32768 \
    --mixes 0.2,0.65,0.15 0.5,0.4,0.1 --kernel-knobs "$kn" --json $OUT/step_$i.jsonl \
    > $OUT/step_$i.log 2>&1
  echo "step $kn rc $?"; grep -E "mix \(|all|Error" $OUT/step_$i.log | cut -c1-200
  i=$((i + 1))
done
if [ $(left) -gt 60 ] && command -v ncu >/dev/null; then
  timeout -s KILL $(cap 90) ncu --clock-control none -k regex:mosaic --section SpeedOfLight \
    --section InstructionStats --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats --section SourceCounters \
    -o $OUT/ncu_perm python3 bench/profile_mgpu_int4.py --pool --upcast bf16_perm \
    --vupcast bf16_perm --reps 1 \
    > $OUT/ncu_perm.log 2>&1
  ncu --import $OUT/ncu_perm.ncu-rep > $OUT/ncu_perm.txt 2>&1
  ncu --import $OUT/ncu_perm.ncu-rep --page source --print-source sass --csv 2> /dev/null \
    | gzip > $OUT/ncu_perm_sass.csv.gz
  grep -E "Duration|Registers Per|Executed Instructions  |Issued Warp|Theoretical Occ" \
    $OUT/ncu_perm.txt
  # B x Hkv x keys = 8 x 8 x 32768 (key, KV head) pairs at the 4B shape
  python3 bench/sass_opcodes.py $OUT/ncu_perm_sass.csv.gz --per 2097152 --top 24
fi
