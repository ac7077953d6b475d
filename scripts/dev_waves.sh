# Device: issue 22's wave test. The int4 pool's Mosaic GPU kernel runs 3 blocks per SM (168
# registers and its shared memory each allow 3), so the grid of 512 blocks (the default until
# 2026-12-06 (fifth), now mgpu_decode.wave_splits; mgpu_decode.BLOCKS: 8 splits x 64
# (sequence, KV head) at the 4B-like shape, 32 x 16 at the 0.5B) is 1.29 waves on 132 SMs
# (Nsight Compute: the SMs active 92% of the kernel's cycles with the byte upcast, session 21,
# and 71% with both operands permuted, session 22: bench/results/
# 2026-12-06_session2{1/int4_sass/ncu,2/upcast/ncu_perm}.txt). Does a grid of at most one wave
# (splits 6 / 24: 384 blocks) or of whole waves (12 / 48: 768 = 1.94) run faster? Most valuable
# first:
#   0. registers per knob set at cols=8 (bench/mgpu_regs.py, ptxas through a deviceless compile);
#   1. one decode call per shape (4B-like and 0.5B, B=8, 32K), CUPTI per kernel, context splits
#      swept (the default upcast, "bf16_perm"; "bf16" at the default splits for the baseline),
#      and at the 4B-like shape the warp-specialized kernel (2 / 3 compute warpgroups: one block
#      per SM, so 64 x splits blocks against 132 SMs; 3 x 2 splits was the best 4B kernel of
#      session 22, 88.5 µs); and early_v_lo (V's upcast while the scores' MMAs run: the kernel
#      is latency-bound, 0.73 eligible warps per scheduler);
#   2. Nsight Compute of the 4B pool kernel alone (profile_mgpu_int4.py --pool, full 32K): the
#      byte upcast and "bf16_perm" at 8 splits (same call: session 21's byte path had its SMs
#      active 92% of the cycles, session 22's perm/perm 71%), then "bf16_perm" at 6 and 12;
#   3. stage 1 at 8K keys (B=32 4B-like: 256 (sequence, KV head) pairs), if time is left.
# Stages 0-3 ran on an H100 on 2026-12-06 (fifth): 6 splits (0.97 waves) the fastest, now the
# default (mgpu_decode.wave_splits). Two more, not in the default PARTS:
#   hi: the rest of the B~0.33 call at the 4B-like shape: the Triton BF16 partition's grid
#       (chunk_hi: 8 splits + the window's = 576 programs by default) at fewer, longer chunks;
#   fused: the one-launch Mosaic GPU kernel over both pools (int4_kernel="fused") at split
#       counts near whole waves (its best so far, 10 + 6 splits x 64 = 1024 blocks, was not
#       faster than the two kernels back to back).
#   LIMIT=560 bash scripts/dev_waves.sh        (no wheels or model)
#   PARTS="hi fused" LIMIT=300 bash scripts/dev_waves.sh
# Raw output: $OUT/waves.tgz (env.txt, kern_*/ + logs, ncu_*.txt); the call returns few files.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
limit=${LIMIT:-560}
d=/tmp/waves && rm -rf $d && mkdir -p $d
trap 'tar czf $OUT/waves.tgz -C /tmp waves' EXIT
left() { echo $((limit - SECONDS - 20)); }
cap() { local t; t=$(left); echo $(( t < $1 ? t : $1 )); }
parts=" ${PARTS:-regs kern_4b kern_05 ncu kern_4b32} "
want() { [[ $parts == *" $1 "* ]]; }
. scripts/device_env.sh $d
kern() {  # tag, shape index, variants, cap seconds
  want $1 || return 0
  [ $(left) -gt 45 ] || { echo "no time for $1"; return; }
  timeout -k 5 -s KILL $(cap $4) python3 bench/bench_kernels.py --out $d/$1 --lo-page 128 \
    --lo-formats int4 --int4-kernels ${KERNELS:-mosaic} --shapes $2 --no-gqa --cupti \
    --hi-page ${HI_PAGE:-16} \
    --mosaic-variants "$3" ${FUSED:+--fused-variants "$FUSED"} > $d/$1.log 2>&1
  echo "$1 rc $?"
  grep -E '^FAILED' $d/$1.log | cut -c1-300
  grep -E '^\{' $d/$1.log | python3 -c '
import sys
nan = float("nan")
for l in sys.stdin:
    r = eval(l)
    body = [k[1] for k in r.get("kernels", []) if "mosaic" in k[0]]
    print(r["shape"], r["variant"], r["knobs"][:90], "call", round(r["time_us"], 1),
          "kernels", r.get("kernels_us"), "int4 body", body, "err", "%.1e" % r["err"])'
}
# registers at the device's jax (cols=8 needs jax >= 0.11): which knobs keep 3 blocks per SM
want regs && timeout -s KILL 90 python3 -m bench.mgpu_regs --cols 8 '{}' \
  '{"k_upcast": "bf16_perm"}' '{"k_upcast": "bf16_perm", "early_v": true}' \
  '{"k_upcast": "bf16_perm", "v_upcast": "bf16_perm"}' > $d/regs.md 2>&1
want regs && grep -E '^\|' $d/regs.md
kern kern_4b 0 '[{"upcast_lo": "bf16"}, {}, {"splits_lo": 4}, {"splits_lo": 5},
  {"splits_lo": 6}, {"splits_lo": 12}, {"splits_lo": 16}, {"wgs_lo": 3},
  {"wgs_lo": 3, "splits_lo": 3}, {"wgs_lo": 2, "splits_lo": 2}, {"wgs_lo": 2, "splits_lo": 3},
  {"early_v_lo": true}, {"early_v_lo": true, "splits_lo": 6}]' 210
kern kern_05 3 '[{"upcast_lo": "bf16"}, {}, {"splits_lo": 16}, {"splits_lo": 24},
  {"splits_lo": 48}, {"splits_lo": 64}, {"early_v_lo": true}]' 110
if want ncu && [ $(left) -gt 60 ] && command -v ncu >/dev/null; then
  for run in "bf16 8" "bf16_perm 8" "bf16_perm 6" "bf16_perm 12"; do
    set -- $run
    [ $(left) -gt 40 ] || break
    timeout -s KILL $(cap 60) ncu --clock-control none -k regex:mosaic --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section SchedulerStats \
      python3 bench/profile_mgpu_int4.py --pool --upcast $1 --splits $2 --reps 1 \
      > $d/ncu_$1_$2.txt 2>&1
    echo "ncu $1 splits $2"
    grep -E "Duration|SM Active|Elapsed Cycles|Grid Size|Waves Per SM|Achieved Occ|Issued Warp" \
      $d/ncu_$1_$2.txt | head -12
  done
fi
kern kern_4b32 2 '[{}, {"splits_lo": 1}, {"splits_lo": 2}, {"splits_lo": 3}]' 90
# hi: chunk_hi 1024 / 2048 give 4 / 2 BF16 splits (+ the window's): 320 / 192 programs
kern hi 0 '[{}, {"chunk_hi": 640}, {"chunk_hi": 1024}, {"chunk_hi": 1366}, {"chunk_hi": 2048},
  {"num_warps": 4}, {"num_warps": 4, "chunk_hi": 1024}]' 150
# fused: splits of the INT4 and BF16 pools per (sequence, KV head), 64 pairs at this shape;
# BF16 pages of 64 (the fused kernel's minimum; at 16 it refused every b_mix row on 2026-12-06)
KERNELS=mosaic,fused FUSED='[{"splits_lo": 10, "splits_hi": 6}, {"splits_lo": 4, "splits_hi": 2},
  {"splits_lo": 5, "splits_hi": 1}, {"splits_lo": 3, "splits_hi": 3}, {"splits_lo": 8,
  "splits_hi": 4}, {"splits_lo": 6, "splits_hi": 6}]' HI_PAGE=64 kern fused 0 '[{}]' 200
