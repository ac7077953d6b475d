"""Inputs for tests, benchmarks and ``pask-jax compare-kernels`` (not used by the kernels).

* :mod:`~pallas_kernels.testing.synth` — random kernel inputs that honour the cache contract,
  with everything invisible poisoned (NaN), and the float32 references to compare against.
* :mod:`~pallas_kernels.testing.quant` — rows that stress the INT4 quantizer's rounding.

They live here rather than in :mod:`pask_jax.testing` because ``pallas_kernels`` imports nothing
of the method (``compare-kernels`` uses :mod:`synth` too).
"""
