#!/usr/bin/env bash
# Device call G2: the 8K/256 serving cells with the overlapped engine, then the serial engine
# (--overlap off) for pask and full at c=8 in the same call: the A/B of the overlap.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
git log -1 --format=%H > $O/commit.txt 2>/dev/null; git status --short >> $O/commit.txt 2>/dev/null
timeout 420 python3 bench/bench_serving.py --shape qwen3-4b --tokenizer bench/out/tok \
  --inputs 8192 --outputs 256 --concurrency 8 16 32 --methods pask full xla --real-model off \
  --kv-memory 64 --prefill-memo --time-limit 400 --compile-cache /tmp/xla --out $O/serving 2>&1 \
  | grep -v "^W1201\|^E1201" | tee $O/serving.txt | tail -12
timeout 150 python3 bench/bench_serving.py --shape qwen3-4b --tokenizer bench/out/tok \
  --inputs 8192 --outputs 256 --concurrency 8 --methods pask full --real-model off --overlap off \
  --kv-memory 64 --prefill-memo --time-limit 140 --compile-cache /tmp/xla --out $O/serial 2>&1 \
  | grep -v "^W1201\|^E1201" | tee $O/serial.txt | tail -4
