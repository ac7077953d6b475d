#!/usr/bin/env bash
# Device call F: the engine step's 7 ms dispatch: XLA command buffers (CUDA graphs) on / off.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
git log -1 --format=%H > $O/commit.txt 2>/dev/null; git status --short >> $O/commit.txt 2>/dev/null
for v in nocb default; do
  case $v in nocb) export XLA_FLAGS="--xla_gpu_enable_command_buffer=";; default) unset XLA_FLAGS;; esac
  timeout 150 python3 bench/bench_serving.py --shape qwen3-4b --tokenizer bench/out/tok \
    --inputs 32768 --outputs 128 --concurrency 8 --methods pask --real-model off \
    --kv-memory 64 --prefill-memo --time-limit 140 --compile-cache "" --out $O/$v 2>&1 \
    | grep -v "^W1201\|^E1201" > $O/$v.txt
  python3 -c "
import json,sys
for l in open('$O/$v/results.jsonl'):
  r=json.loads(l); print('$v', r['method'], 'step', round(r['step_ms_mean'],2), 'tpot', round(r['tpot_ms_median'],2), {k:round(x,2) for k,x in r['host_ms_per_step'].items()})"
done
