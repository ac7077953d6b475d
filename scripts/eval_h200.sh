#!/usr/bin/env bash
# Issue #6 on one H200: all methods x B in {0.33, 0.40, 0.50, 0.60} (+ Full KV, INT4 once) on the
# BFCL non-live test split, knobs tuned on the dev split first.  See scripts/eval_h200.py.
# Usage: scripts/eval_h200.sh MODEL(.gguf or name) POLICY_DIR OUT_DIR [extra eval_h200.py flags]
set -euo pipefail
MODEL=${1:?model GGUF path or registered name}
POLICY=${2:?PASK policy directory}
OUT=${3:-runs/h200_bfcl}
shift $(( $# < 3 ? $# : 3 ))
PY=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" "$(dirname "$0")/eval_h200.py" --model "$MODEL" --policy "$POLICY" --out "$OUT" "$@"
