#!/usr/bin/env bash
# Device call D: the 32K/1024 serving cells of the goals, after the kernel's split spreading.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
timeout 330 python3 bench/bench_serving.py --shape qwen3-4b --tokenizer bench/out/tok \
  --inputs 32768 --outputs 1024 --concurrency 8 32 --methods pask full xla --real-model off \
  --kv-memory 64 --prefill-memo --time-limit 310 --out $O/serving 2>&1 | grep -v "^W1201\|^E1201" | tail -30
