#!/usr/bin/env bash
# Device call I: the batch-16 32K step rows (PASK mix, all-BF16 PASK, plain-XLA Full KV) in one
# process (issue 11 deliverable 3); --chunk-layers 1: the synthetic K/V of 4 layers at once (2^31
# elements) made jax.random allocate 36 GiB.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
git log -1 --format=%H > $O/commit.txt 2>/dev/null
timeout 250 python3 bench/bench_pask_step.py --shape qwen3-4b --batch 16 --context 32768 \
  --mixes 0.2,0.65,0.15 --layouts unrolled --steps 8 --time-limit 230 --chunk-layers 1 \
  --json $O/step_32k_b16.jsonl 2>&1 | grep -v "^W1201\|^E1201" | tee $O/step_32k_b16.txt | tail -8
