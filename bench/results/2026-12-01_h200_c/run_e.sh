#!/usr/bin/env bash
# Device call E: where the serving engine's step time goes (host timers + a device trace of
# 6 steady-state engine iterations per cell), 32K in / 128 out, c=8, the three methods.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
git log -1 --format=%H > $O/commit.txt 2>/dev/null; git status --short >> $O/commit.txt 2>/dev/null
timeout 330 python3 bench/bench_serving.py --shape qwen3-4b --tokenizer bench/out/tok \
  --inputs 32768 --outputs 128 --concurrency 8 --methods pask full xla --real-model off \
  --kv-memory 64 --prefill-memo --profile 6 --time-limit 310 --out $O/serving 2>&1 \
  | grep -v "^W1201\|^E1201" | tee $O/serving.txt | tail -80
rm -rf $O/serving/trace
