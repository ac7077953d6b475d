#!/usr/bin/env bash
# Device call B2: whole step at 32K, batch 8 (B~0.33 and B~0.20) and batch 16.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
timeout 290 python3 bench/bench_pask_step.py --shape qwen3-4b --batch 8 --context 32768 \
  --mixes 0.2,0.65,0.15 0.5,0.4,0.1 --layouts unrolled --steps 8 --time-limit 260 \
  --json $O/step_32k_b8.jsonl 2>&1 | tee $O/step_32k_b8.txt
timeout 270 python3 bench/bench_pask_step.py --shape qwen3-4b --batch 16 --context 32768 \
  --mixes 0.2,0.65,0.15 --layouts unrolled --steps 8 --time-limit 240 \
  --json $O/step_32k_b16.jsonl 2>&1 | tee $O/step_32k_b16.txt
