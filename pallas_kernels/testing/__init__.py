"""Inputs for tests, benchmarks and ``pask-jax compare-kernels`` (not used by the kernels).

* :mod:`~pallas_kernels.testing.synth` — random kernel inputs that honour the cache contract,
  with everything invisible poisoned (NaN), and the float32 references to compare against.
* :mod:`~pallas_kernels.testing.quant` — rows that stress the INT4 quantizer's rounding.
* :mod:`~pallas_kernels.testing.mgpu` — checks the Mosaic GPU kernels' CPU tests share.
* :mod:`~pallas_kernels.testing.sph_synth` — Spherical KV tier pools with poisoned invisible rows,
  and the float64 oracle over the union of every stored key (base pools and tiers).

They live here rather than in :mod:`pask_jax.testing` because ``pallas_kernels`` imports nothing
of the method (``compare-kernels`` uses :mod:`synth` too).
"""
