#!/usr/bin/env bash
# Device call B: step benches at 1K (issue 12 Full-KV goal), 0.5B shape 8K, 4B 32K batch 8.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
timeout 150 python3 bench/bench_pask_step.py --shape qwen3-4b --batch 8 --context 1024 \
  --mixes 0.2,0.65,0.15 --layouts unrolled --steps 32 --time-limit 120 --profile /tmp/prof \
  --json $O/step_1k.jsonl 2>&1 | tee $O/step_1k.txt
timeout 150 python3 bench/bench_pask_step.py --shape qwen2.5-0.5b --batch 8 --context 8192 \
  --mixes 0.2,0.65,0.15 --layouts stacked unrolled --steps 32 --time-limit 120 --profile /tmp/prof \
  --json $O/step_05b.jsonl 2>&1 | tee $O/step_05b.txt
timeout 280 python3 bench/bench_pask_step.py --shape qwen3-4b --batch 8 --context 32768 \
  --mixes 0.2,0.65,0.15 0.5,0.4,0.1 --layouts unrolled --steps 8 --time-limit 250 \
  --json $O/step_32k.jsonl 2>&1 | tee $O/step_32k.txt
