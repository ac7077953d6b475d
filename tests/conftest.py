import os

# The CUDA plugin and libtpu are installed for ahead-of-time compile tests; run everything else on
# the CPU unless the caller chose a platform.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
