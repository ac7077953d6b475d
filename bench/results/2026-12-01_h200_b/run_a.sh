#!/usr/bin/env bash
# Device call A (2026-12-01, session 11): kernels sweep, quantizer bits, step benches at 8K and 1K.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee $O/nvsmi.txt
git log --oneline -1 | tee $O/commit.txt; git status --short | head -5 | tee -a $O/commit.txt
python3 bench/check_int4_backend.py 2>&1 | tee $O/int4_bits.txt
timeout 200 python3 bench/bench_kernels.py --out $O/kern --int4-sweep --no-gqa 2>&1 | grep -v "^{" | tee $O/kernels_sweep.txt
timeout 300 python3 bench/bench_pask_step.py --shape qwen3-4b --batch 8 --context 8192 \
  --mixes 0.2,0.65,0.15 --layouts stacked unrolled --steps 16 --time-limit 240 \
  --profile /tmp/prof --json $O/step_8k.jsonl 2>&1 | tee $O/step_8k.txt
