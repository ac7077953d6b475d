#!/usr/bin/env bash
# Device call G1: the 32K/1024 serving cells with the overlapped engine (host work under the
# device step), the three methods, c = 8/16/32, 64 GB KV each.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
git log -1 --format=%H > $O/commit.txt 2>/dev/null; git status --short >> $O/commit.txt 2>/dev/null
timeout 570 python3 bench/bench_serving.py --shape qwen3-4b --tokenizer bench/out/tok \
  --inputs 32768 --outputs 1024 --concurrency 8 16 32 --methods pask full xla --real-model off \
  --kv-memory 64 --prefill-memo --time-limit 555 --compile-cache /tmp/xla --out $O/serving 2>&1 \
  | grep -v "^W1201\|^E1201" | tee $O/serving.txt | tail -30
