import os

# The CUDA plugin and libtpu are installed for ahead-of-time compile tests; run everything else on
# the CPU unless the caller chose a platform.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# No persistent XLA compilation cache for the session: with one (a temporary directory), the
# fresh-clone suite hung at tests/test_step_metrics.py's overlapped engine after 731 of 773 tests
# had passed (2026-12-02), while the file passes alone; until that is understood, every test
# compiles its own programs.
