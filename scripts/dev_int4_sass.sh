# Device: the instruction stream of the Mosaic GPU INT4 kernel as decode_attention runs it (the
# int4 pool, pages of 128, cols 8, 4B-like B=8 32K): its PTX, ptxas report and SASS, then Nsight
# Compute's instruction statistics, warp states and per-SASS-line counts, all under $OUT.
#   bash scripts/dev_int4_sass.sh    (no wheels, no model)
set -x
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt
python3 -c "import jax; print(jax.__version__)" >> $OUT/env.txt
MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 timeout 120 \
  python3 bench/profile_mgpu_int4.py --pool --reps 1 > $OUT/dump.txt 2> $OUT/dump.err
ls -la $OUT; which ncu
timeout 150 ncu --clock-control none -k regex:mosaic --section SpeedOfLight \
  --section InstructionStats --section WarpStateStats --section Occupancy \
  --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  python3 bench/profile_mgpu_int4.py --pool --reps 1 > $OUT/ncu.txt 2>&1
timeout 150 ncu --clock-control none -k regex:mosaic --section SourceCounters \
  --section InstructionStats -o $OUT/ncu_src python3 bench/profile_mgpu_int4.py --pool --reps 1 \
  > $OUT/ncu_src.log 2>&1
timeout 60 ncu --import $OUT/ncu_src.ncu-rep --page source --print-source sass --csv \
  > $OUT/ncu_sass.csv 2> $OUT/ncu_sass.err
gzip -f $OUT/ncu_sass.csv
ls -la $OUT
