"""Other KV retention policies in the same stack as PASK (same weights, tokenizer, prompts,
grammars, greedy decoding and payload cost model), one module per baseline:

* :mod:`~pask_jax.baselines.full` — Full KV (the dense :class:`~pask_jax.decode.Runner`).
* :mod:`~pask_jax.baselines.streaming` — StreamingLLM (Xiao et al. 2024): sinks + recent window,
  an all-R :class:`~pask_jax.policy.FrozenPolicy` on the real PASK cache and kernels.
* :mod:`~pask_jax.baselines.int4` — uniform INT4 beyond the window (KIVI-like, Liu et al. 2024),
  an all-L policy on the real PASK cache and kernels.
* :mod:`~pask_jax.baselines.h2o` — H2O (Zhang et al. 2023): accumulated-attention heavy hitters.
* :mod:`~pask_jax.baselines.snapkv` — SnapKV (Li et al. 2024): observation-window prompt selection.
* :mod:`~pask_jax.baselines.mikv` — MiKV (Yang et al. 2024): H2O importance → BF16, the rest INT4.
* :mod:`~pask_jax.baselines.rocketkv` — RocketKV (Behnam et al. 2025): SnapKV-style prompt
  eviction with wide max pooling, then sparse decode reads chosen by a chunked max/min key sketch.
* :mod:`~pask_jax.baselines.triaxial` — TriAxialKV (Shen et al. 2026): INT2/3/4/8 by semantic tag,
  allocated under the budget from per-tag attention-output distortion on the calibration split,
  protected prefix and recent tail in BF16 (quantizers: :mod:`~pask_jax.baselines.quant`).

* ``spherical`` — Spherical KV (docs/SPHERICAL_KV.md): angle-coded key tiers chosen per
  (token, layer group, KV head) by the RDR controller under the budget;
  :class:`pask_jax.spherical.runner.SphRunner` (reference attention over the tier pools).
  Its ablations and hybrids (``sphkv-rd``, ``sphkv-angle``, ``sphkv-retain``, ``sphkv-quant``,
  ``sphkv-gated``, ``sphkv-shared``, ``sphkv-compact``, ``sphkv-flat``, ``sphkv-recent4``,
  ``sphkv-retrieved``,
  ``rdr+tags``, ``pask+ada``) are configurations of the same runner:
  :mod:`pask_jax.spherical.variants`.

H2O, SnapKV, MiKV and RocketKV need attention statistics and run on :class:`MaskedRunner` (dense
cache with per-layer, per-head keep/INT4 masks, statistics from the reference attention path).
:mod:`~pask_jax.baselines.budget` holds the shared payload accounting and budget matching.
"""
from pask_jax.baselines import (budget, full, h2o, int4, mikv, quant, rocketkv, snapkv, streaming,
                                triaxial)
from pask_jax.baselines.masked import Config, MaskedRunner, plan
from pask_jax.spherical import variants as _sph

METHODS = ("full", "pask", "streaming", "h2o", "snapkv", "mikv", "int4", "triaxial", "rocketkv") + \
    _sph.METHODS
MASKED = ("h2o", "snapkv", "mikv", "rocketkv")

__all__ = ["METHODS", "MASKED", "Config", "MaskedRunner", "plan", "budget", "full", "h2o", "int4",
           "mikv", "quant", "rocketkv", "snapkv", "streaming", "triaxial"]
