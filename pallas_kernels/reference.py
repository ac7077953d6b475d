"""Plain-jnp decode attention over {INT4 pool, BF16 pool, window}: the numerical reference.

Each partition is gathered densely through its page table, INT4 rows are dequantized with
``pallas_kernels.int4.dequantize``, and a per-partition partial (unnormalized value sum, score max,
exponential sum; all FP32) is formed and merged with the shared-normalization rule (Eq. 15).
Invisible entries (beyond a length) are masked *before* any arithmetic touches them, since the
contract lets them hold garbage, NaN included.  Memory is O(B * capacity), fine for tests and CPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import int4
from pallas_kernels import common
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window


def _gather_pages(x: jax.Array, pages: jax.Array, layer=None) -> jax.Array:
  """x [P, page, ...] (or [L, P, page, ...] with ``layer``), pages [B, n] -> [B, n*page, ...];
  garbage ids clipped into range.  The stacked form gathers straight from layer ``layer``'s pages
  (no copy of the layer's pool)."""
  x_pool = x.shape if layer is None else x.shape[1:]
  if x_pool[0] == 0 or pages.shape[1] == 0:
    return jnp.zeros((pages.shape[0], 0, *x_pool[2:]), x.dtype)
  ids = jnp.clip(pages, 0, x_pool[0] - 1)
  g = x[ids] if layer is None else x[layer, ids]                # [B, n, page, ...]
  return g.reshape(g.shape[0], -1, *g.shape[3:])


def _partial(q, k, v, valid, c):
  """q [B,Hkv,g,D] f32; k, v [B,S,Hkv,D] f32; valid [B,S] -> o [B,Hkv,g,D], m, l [B,Hkv,g]."""
  k = jnp.where(valid[:, :, None, None], k, 0.0)
  v = jnp.where(valid[:, :, None, None], v, 0.0)
  s = jnp.einsum("bhgd,bshd->bhgs", q, k, precision="highest") * c   # log2 units
  s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, initial=common.NEG)
  p = jnp.exp2(s - m[..., None])
  l = jnp.sum(p, axis=-1)
  o = jnp.einsum("bhgs,bshd->bhgd", p, v, precision="highest")
  return o, m, l


@functools.partial(jax.jit, static_argnames=("scale",))
def partials(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps, layer=None, *,
             scale=None):
  """The three per-partition partials stacked on axis 2: o [B,Hkv,3,g,D], m, l [B,Hkv,3,g].

  ``layer``: None, or the (traced) index into pools and window stacked on a leading layer axis.
  """
  b, hq, d = q.shape
  hkv = window.k.shape[-2]
  g = hq // hkv
  c = common.default_scale(d, scale) * common.LOG2E
  qf = q.astype(jnp.float32).reshape(b, hkv, g, d)

  # INT4 pool: dequantize (codes * fp16 scale) in FP32.
  klo = _gather_pages(lo.k, maps.lo_pages, layer)               # [B, S_lo, Hkv, D/2] u8
  vlo = _gather_pages(lo.v, maps.lo_pages, layer)
  slo = _gather_pages(lo.scale, maps.lo_pages, layer)           # [B, S_lo, Hkv, 2] f16
  vis_lo = jnp.arange(klo.shape[1])[None] < maps.lo_len[:, None]
  slo = jnp.where(vis_lo[..., None, None], slo, jnp.float16(0))  # garbage scales may be NaN
  klo = int4.dequantize(klo, slo[..., 0])
  vlo = int4.dequantize(vlo, slo[..., 1])

  khi = _gather_pages(hi.k, maps.hi_pages, layer).astype(jnp.float32)  # [B, S_hi, Hkv, D]
  vhi = _gather_pages(hi.v, maps.hi_pages, layer).astype(jnp.float32)
  vis_hi = jnp.arange(khi.shape[1])[None] < maps.hi_len[:, None]

  kw, vw = (window.k, window.v) if layer is None else (window.k[layer], window.v[layer])
  kw, vw = kw.astype(jnp.float32), vw.astype(jnp.float32)
  vis_w = jnp.arange(kw.shape[1])[None] < window.length[:, None]

  parts = [_partial(qf, k, v, vis, c) for k, v, vis in
           ((klo, vlo, vis_lo), (khi, vhi, vis_hi), (kw, vw, vis_w))]
  o, m, l = (jnp.stack(x, axis=2) for x in zip(*parts))
  return o, m, l


@functools.partial(jax.jit, static_argnames=("scale",))
def decode_attention_reference(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps,
                               layer=None, *, scale: float | None = None) -> jax.Array:
  """q [B, Hq, D] -> out [B, Hq, D] bf16; FP32 math throughout, Eq. 15 merge of the partitions."""
  b, hq, d = q.shape
  o, m, l = partials(q, window, hi, lo, maps, layer, scale=scale)
  out, _ = common.merge(o, m, l, axis=2)                        # [B, Hkv, g, D]
  return out.reshape(b, hq, d).astype(jnp.bfloat16)
