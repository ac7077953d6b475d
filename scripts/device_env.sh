# Source in a device script (`. scripts/device_env.sh DIR`): writes what the run ran on to
# DIR/env.txt (GPU, driver, memory, jax, commit, uncommitted changes) and prints it.
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import jax; print('jax', jax.__version__)"; git rev-parse HEAD 2>/dev/null
  git status --short 2>/dev/null; } > "$1/env.txt" 2>&1
cat "$1/env.txt"
