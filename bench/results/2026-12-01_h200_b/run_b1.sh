#!/usr/bin/env bash
# Device call B1: whole step at 8K (both layouts), 1K (issue 12 Full-KV goal), 0.5B shape 8K.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
S="python3 bench/bench_pask_step.py --mixes 0.2,0.65,0.15 --profile /tmp/prof"
timeout 200 $S --shape qwen3-4b --batch 8 --context 8192 --layouts stacked unrolled --steps 16 \
  --time-limit 170 --json $O/step_8k.jsonl 2>&1 | grep -v "^  top" | tee $O/step_8k.txt
timeout 110 $S --shape qwen3-4b --batch 8 --context 1024 --layouts unrolled --steps 32 \
  --time-limit 90 --json $O/step_1k.jsonl 2>&1 | grep -v "^  top" | tee $O/step_1k.txt
timeout 150 $S --shape qwen2.5-0.5b --batch 8 --context 8192 --layouts stacked unrolled --steps 32 \
  --time-limit 120 --json $O/step_05b.jsonl 2>&1 | grep -v "^  top" | tee $O/step_05b.txt
