"""Mixed-precision decode attention over the PASK cache: {INT4 pool, BF16 pool, window}.

One entry point, :func:`decode_attention`, picks a backend:

* ``"reference"`` -- plain jnp, FP32 (``reference.py``); what CPU runs.
* ``"gpu"`` -- Pallas Triton kernel (``gpu/decode.py``).
* ``"tpu"`` -- Pallas Mosaic kernel (``tpu/decode.py``; Spherical KV tiers ``tpu/spherical.py``).
  (GPU Spherical KV tiers: ``gpu/spherical.py``.)
* ``"auto"`` -- by ``jax.default_backend()``: gpu/cuda/rocm -> "gpu", tpu -> "tpu", else reference.

All backends compute the same function: softmax over the union of the visible entries of the three
partitions with INT4 rows dequantized in the kernel, FP32 scores / statistics / accumulation, the
partitions (and split-KV chunks) merged by the shared-normalization rule (paper Eq. 15), BF16 out.
The probabilities enter the ``p @ V`` MMA as BF16 in the kernels (FP32 accumulation), the usual
flash-attention trade; the reference keeps them in FP32.
"""
from __future__ import annotations

import jax

from pallas_kernels.reference import decode_attention_reference, decode_attention_sph_reference
from pallas_kernels.sph_types import SphConsts, SphInputs, SphMaps, SphPool, TierSpec
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window

BACKENDS = ("auto", "reference", "gpu", "tpu")


def resolve_backend(backend: str = "auto") -> str:
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend != "auto":
    return backend
  plat = jax.default_backend()
  if plat in ("gpu", "cuda", "rocm"):
    return "gpu"
  if plat == "tpu":
    return "tpu"
  return "reference"


def decode_attention(q: jax.Array, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps, *,
                     layer: jax.Array | int | None = None, scale: float | None = None,
                     backend: str = "auto", sph: SphInputs | None = None,
                     return_lse: bool = False, **knobs):
  """q [B, Hq, D] (RoPE applied) -> out [B, Hq, D] bf16 for ONE layer.

  ``layer=None``: window and pools are one layer's arrays (the shapes of ``types``).  Otherwise
  ``window.k/v`` and every pool array carry a leading layer axis (the cache's stacked
  ``[L, ...]`` arrays) and ``layer`` (an int or a traced int32 scalar) picks the layer inside the
  kernel, so a decode step never copies a layer's pools out of the stack.
  The INT4 pool ``lo`` may be in either storage format of :class:`LowPool` ("bytes" or
  "int4"); the "tpu" backend reads "bytes" only, "gpu" reads "int4" with its Mosaic GPU kernel.
  Hq must be a multiple of the KV head count; ``scale`` (a Python float) defaults to 1/sqrt(D).
  ``knobs`` are backend tuning parameters (block and chunk sizes, ``num_warps``/``num_stages`` on
  GPU, ``splits`` on TPU, ``interpret``); the defaults are the tuned ones.  Jittable.

  ``sph``: the Spherical KV tier partitions (:class:`SphInputs`, one partition per tier, merged
  with the others by Eq. 15; ``layer`` indexes their pools and constants too).  ``return_lse``:
  also return the natural-log LSE of the scaled logits, f32 [B, Hq] (the gated tier rule).  Both
  run on every backend: "tpu" by ``tpu/spherical.py``'s kernel, "gpu" by ``gpu/spherical.py``'s
  Triton kernel (one launch per tier, merged with the base partitions' partials; the tier kernel's
  own knobs go in ``sph_knobs={...}``, ``int4_kernel="fused"`` is refused with tiers).
  """
  hq, hkv = q.shape[1], window.k.shape[-2]
  if hq % hkv:
    raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
  which = resolve_backend(backend)
  if (sph is not None or return_lse) and which == "tpu":
    from pallas_kernels.tpu import decode_attention_sph_tpu
    return decode_attention_sph_tpu(q, window, hi, lo, maps, sph, layer, scale=scale,
                                    return_lse=return_lse, **knobs)
  if (sph is not None or return_lse) and which == "gpu":
    from pallas_kernels.gpu import decode_attention_sph_gpu
    return decode_attention_sph_gpu(q, window, hi, lo, maps, sph, layer, scale=scale,
                                    return_lse=return_lse, **knobs)
  if sph is not None or return_lse:
    return decode_attention_sph_reference(q, window, hi, lo, maps, sph, layer, scale=scale,
                                          return_lse=return_lse)
  if which == "reference":
    return decode_attention_reference(q, window, hi, lo, maps, layer, scale=scale)
  if which == "gpu":
    from pallas_kernels.gpu import decode_attention_gpu
    return decode_attention_gpu(q, window, hi, lo, maps, layer, scale=scale, **knobs)
  from pallas_kernels.tpu import decode_attention_tpu
  return decode_attention_tpu(q, window, hi, lo, maps, layer, scale=scale, **knobs)


__all__ = ["BACKENDS", "HighPool", "LowPool", "PageMaps", "SphConsts", "SphInputs", "SphMaps",
           "SphPool", "TierSpec", "Window", "decode_attention", "decode_attention_reference",
           "decode_attention_sph_reference", "resolve_backend"]
