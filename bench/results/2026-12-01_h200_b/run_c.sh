#!/usr/bin/env bash
# Device call C: the serving matrix (issue 13), then the batch-16 / 32K step row with the fixed bench.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
timeout 440 python3 bench/bench_serving.py --shape qwen3-4b --tokenizer bench/out/tok \
  --inputs 32768 8192 --outputs 1024 256 --concurrency 8 16 32 --methods pask full xla \
  --kv-memory 64 --prefill-memo --time-limit 420 --out $O/serving 2>&1 | grep -v "^W1201\|^E1201" | tail -60
timeout 140 python3 bench/bench_pask_step.py --shape qwen3-4b --batch 16 --context 32768 \
  --mixes 0.2,0.65,0.15 --layouts unrolled --steps 8 --time-limit 120 \
  --json $O/step_32k_b16.jsonl 2>&1 | grep -v "^W1201\|^E1201" | tee $O/step_32k_b16.txt | tail -8
