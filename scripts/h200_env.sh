# Source at the start of a device call (`. scripts/h200_env.sh`): installs the wheels carried in
# .whl/ (see docs/DESIGN.md and scripts/setup.sh for the list) into /tmp/site, puts the repository on the path
# and keeps the model cache in /tmp/m, which a warm machine keeps between calls.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PASK_JAX_CACHE=/tmp/m
mkdir -p /tmp/m
# What comes back from a device call is $OUT's files, but not folders nested deeper than a level
# or two (campaign cells, policy arrays): tar them into $OUT at the end of the call.
