"""Inputs of the mixed-precision decode attention for ONE layer (kernel contract: docs/DESIGN.md).

All are plain NamedTuples, hence pytrees, so they pass through jit/vmap/scan unchanged.

Shapes (B = batch, W = recent-window slots, Hkv = KV heads, D = head dim, page = page size):

* ``Window``: the BF16 recent window of this layer, ring-indexed.  It already holds the current
  token's K/V (the decode step writes it before attention): "window + current" (docs/DESIGN.md) is
  one partition here.  Slot ``s`` of sequence ``b`` is visible iff ``s < length[b]``; the ring is
  filled in order, so the visible slots are always a prefix ``[0, min(count, W))``.
* ``HighPool``: BF16 pages of this layer.  Pages are shared by all sequences; which pages a
  sequence owns, in order, is in ``PageMaps.hi_pages``.
* ``LowPool``: INT4 pages of this layer with fp16 scales (a K and a V scale per row and head), in
  one of two storage formats (chosen when the cache is made, told apart by the codes' dtype:
  ``pallas_kernels.int4.format_of``):
  ``"bytes"``: ``k, v [P_lo, page, Hkv, D/2]`` uint8, half-split nibbles (``pallas_kernels.int4``),
  scales ``[P_lo, page, Hkv, 2]`` (``[..., 0]`` K, ``[..., 1]`` V);
  ``"int4"``: ``k [P_lo, Hkv, page, D]`` and ``v [P_lo, Hkv, D, page]`` jax int4 (head-major pages,
  V dim-major per page), scales ``[P_lo, Hkv, 2, page]`` (K and V planes per page and head).
  Same codes and the same bytes per row in both (``int4.pool_codes``/``pool_scales`` read either
  as token rows).  The reference reads
  both; the Triton and TPU kernels read "bytes" only (they refuse "int4" in one line); the GPU
  backend reads "int4" with the Mosaic GPU kernel.
* ``PageMaps``: the page tables and lengths of this layer's *group* (layers in a group share
  actions, hence maps).  Entry ``j`` of sequence ``b`` lives in page ``pages[b, j // page]`` at row
  ``j % page``; entries ``j >= len[b]`` are invisible (and may hold garbage).

Every visible key appears exactly once across the three partitions.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

from pallas_kernels import int4


class Window(NamedTuple):
  k: jax.Array       # [B, W, Hkv, D] bf16
  v: jax.Array       # [B, W, Hkv, D] bf16
  length: jax.Array  # [B] int32, number of visible slots (<= W)


class HighPool(NamedTuple):
  k: jax.Array  # [P_hi, page, Hkv, D] bf16
  v: jax.Array  # [P_hi, page, Hkv, D] bf16


class LowPool(NamedTuple):
  k: jax.Array      # "bytes": [P_lo, page, Hkv, D // 2] uint8, two signed nibbles per byte
                    # "int4":  [P_lo, Hkv, page, D] int4
  v: jax.Array      # "bytes": [P_lo, page, Hkv, D // 2] uint8; "int4": [P_lo, Hkv, D, page] int4
  scale: jax.Array  # "bytes": [P_lo, page, Hkv, 2] float16, (K scale, V scale) per row
                    # "int4":  [P_lo, Hkv, 2, page] float16, K and V planes per (page, head)

  @property
  def format(self) -> str:
    """The storage format, "bytes" or "int4" (from the codes' dtype)."""
    return int4.format_of(self.k)

  @property
  def page(self) -> int:
    """Rows per page (either format; also with a leading layer axis)."""
    return self.scale.shape[-3] if self.format == "bytes" else self.scale.shape[-1]


class PageMaps(NamedTuple):
  hi_pages: jax.Array  # [B, max_hi_pages] int32
  hi_len: jax.Array    # [B] int32, entries (not pages)
  lo_pages: jax.Array  # [B, max_lo_pages] int32
  lo_len: jax.Array    # [B] int32
