import atexit
import os
import shutil
import tempfile

# The CUDA plugin and libtpu are installed for ahead-of-time compile tests; run everything else on
# the CPU unless the caller chose a platform.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One XLA compilation cache for the session (and the CLI subprocesses it starts), empty at the
# start and removed at exit: runners, engines and sessions built in different tests jit fresh
# function objects, but with the same config they lower to the same program, which XLA then
# compiles once instead of once per object.  A caller's own cache directory is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _xla_cache = tempfile.mkdtemp(prefix="pask-jax-tests-xla-")
  atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
# Cache what takes a noticeable compile; the many tiny programs cost more to write than to redo.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
