"""Plain-jnp decode attention over {INT4 pool, BF16 pool, window}: the numerical reference.

Each partition is gathered densely through its page table, INT4 rows (either storage format of
``types.LowPool``) are dequantized as ``codes * fp16 scale`` in FP32, and a per-partition partial
(unnormalized value sum, score max, exponential sum; all FP32) is formed and merged with the
shared-normalization rule (Eq. 15).
Invisible entries (beyond a length) are masked *before* any arithmetic touches them, since the
contract lets them hold garbage, NaN included.  Memory is O(B * capacity), fine for tests and CPU.

The Spherical KV tiers (``sph_partials``; docs/SPHERICAL_KV.md §2.2) are further partitions
of the same kind: a tier's pages are gathered per (sequence, KV head), angles and radius decoded,
logits formed by CosFromAngles on the rotated query plus the centering term q·μ, and the partials
concatenated with the three above before the one Eq. 15 merge.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import int4
from pallas_kernels import common
from pallas_kernels import spherical
from pallas_kernels.sph_types import SphInputs, SphPool, TierSpec
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


def _gather_lo_codes(lo: LowPool, pages: jax.Array, layer=None):
  """The INT4 pool's K/V codes through the page table, either storage format ("bytes" uint8
  ``[P, page, Hkv, D/2]``, "int4" ``[P, Hkv, page, D]`` / ``[P, Hkv, D, page]``; a leading layer
  axis with ``layer``) -> token-major signed codes ``int32 [B, n*page, Hkv, D]`` each.  The
  pages are gathered first, so only the gathered rows are transposed."""
  pool = lo.k.shape if layer is None else lo.k.shape[1:]
  if pool[0] == 0 or pages.shape[1] == 0:
    d = pool[-1] * 2 if lo.format == "bytes" else pool[-1]      # K's last axis
    hkv = lo.k.shape[-2] if lo.format == "bytes" else lo.k.shape[-3]
    z = jnp.zeros((pages.shape[0], 0, hkv, d), jnp.int32)
    return z, z
  ids = jnp.clip(pages, 0, pool[0] - 1)
  take = lambda x: x[ids] if layer is None else x[layer, ids]     # [B, n, <page's shape>]
  kc, vc = int4.pool_codes(take(lo.k), take(lo.v))              # [B, n, page, Hkv, D]
  flat = lambda x: x.reshape(x.shape[0], -1, *x.shape[3:])
  return flat(kc), flat(vc)


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

  # INT4 pool (either storage format): dequantize (codes * fp16 scale) in FP32.
  klo, vlo = _gather_lo_codes(lo, maps.lo_pages, layer)         # [B, S_lo, Hkv, D] int32
  slo = _gather_pages(int4.pool_scales(lo.scale, lo.format), maps.lo_pages, layer)
  # [B, S_lo, Hkv, 2] f16 (an "int4" pool's head-major scales are transposed by the gather)
  vis_lo = jnp.arange(klo.shape[1])[None] < maps.lo_len[:, None]
  slo = jnp.where(vis_lo[..., None, None], slo, jnp.float16(0))  # garbage scales may be NaN
  klo = klo.astype(jnp.float32) * slo[..., 0:1].astype(jnp.float32)
  vlo = vlo.astype(jnp.float32) * slo[..., 1:2].astype(jnp.float32)

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


# --- Spherical KV tier partitions (docs/SPHERICAL_KV.md §2.2, §3 "Kernel contract") -------


def _layer_of(x: jax.Array, layer) -> jax.Array:
  return x if layer is None else x[layer]


def _gather_tier(x: jax.Array, pages: jax.Array, layer=None) -> jax.Array:
  """Tier stream ``x [P, page, ...]`` (or ``[L, P, page, ...]`` with ``layer``), per-head table
  ``pages [B, Hkv, n]`` -> ``[B, Hkv, n*page, ...]``; garbage ids clipped into range."""
  x_pool = x.shape if layer is None else x.shape[1:]
  b, h, n = pages.shape
  if x_pool[0] == 0 or n == 0:
    return jnp.zeros((b, h, 0, *x_pool[2:]), x.dtype)
  ids = jnp.clip(pages, 0, x_pool[0] - 1)
  g = x[ids] if layer is None else x[layer, ids]                # [B, Hkv, n, page, ...]
  return g.reshape(b, h, n * x_pool[1], *x_pool[2:])


def sph_rotation(signs: jax.Array) -> jax.Array:
  """Π = H_D·diag(s)/√D as f32 [D, D] from the signs ``[D]`` (traced or not)."""
  d = signs.shape[-1]
  h = jnp.asarray(spherical.hadamard(d) / math.sqrt(d), jnp.float32)
  return h * signs.astype(jnp.float32)[None, :]


def decoded_dot(q: jax.Array, packed: jax.Array, side: jax.Array, mu: jax.Array, rot: jax.Array,
                sp: spherical.Spec, scale: float | None = None) -> jax.Array:
  """The logit by the long way: decode the stored key to Cartesian ``k̃ = μ + r̃·Πᵀũ``
  (``spherical.decode_key``), then ``q·k̃·scale``; equal to :func:`pallas_kernels.spherical.scores`
  (CosFromAngles) up to f32 rounding.  Shapes broadcast as in ``scores``."""
  scale = 1.0 / math.sqrt(sp.d) if scale is None else scale
  k = spherical.decode_key(packed, side, mu, rot, sp)
  return jnp.sum(q.astype(jnp.float32) * k, axis=-1) * scale


def _tier_partial(qf, qr, beta, pool: SphPool, pages, length, ts: TierSpec, layer, c, logits):
  """One tier: qf, qr [B,Hkv,g,D] (query, rotated query), beta [B,Hkv,g] = q·μ ->
  o [B,Hkv,g,D], m, l [B,Hkv,g] (log2 units, as :func:`_partial`)."""
  sp = ts.key
  ang = _gather_tier(pool.ang, pages, layer)                    # [B, Hkv, S, NB] u8
  side = _gather_tier(pool.side, pages, layer)                  # [B, Hkv, S] u32
  val = _gather_tier(pool.v, pages, layer)                      # [B, Hkv, S, D or D/2]
  vis = jnp.arange(ang.shape[2])[None, None] < length[..., None]    # [B, Hkv, S]
  side = jnp.where(vis, side, jnp.uint32(0))                    # garbage radius/scale may be NaN
  r = spherical.side_radius(side)
  cos, sin = spherical.angle_trig(spherical.unpack(ang, sp), sp)     # [B, Hkv, S, D]
  if logits == "angles":
    dot = spherical.cos_from_angles(qr[:, :, :, None, :], cos[:, :, None], sin[:, :, None])
  else:  # "decoded": ũ in Cartesian (rotated frame), then the dot
    u = spherical.direction(cos, sin)
    dot = jnp.einsum("bhgd,bhsd->bhgs", qr, u, precision="highest")
  s = (beta[..., None] + r[:, :, None, :] * dot) * c               # [B, Hkv, g, S], log2 units
  s = jnp.where(vis[:, :, None, :], s, -jnp.inf)
  if ts.values == "bf16":
    v = val.astype(jnp.float32)
  else:
    v = int4.dequantize(val, spherical.side_value_scale(side))
  v = jnp.where(vis[..., None], v, 0.0)
  m = jnp.max(s, axis=-1, initial=common.NEG)
  p = jnp.exp2(s - m[..., None])
  l = jnp.sum(p, axis=-1)
  o = jnp.einsum("bhgs,bhsd->bhgd", p, v, precision="highest")
  return o, m, l


@functools.partial(jax.jit, static_argnames=("scale", "logits"))
def sph_partials(q, sph: SphInputs, layer=None, *, scale=None, logits="angles"):
  """The tier partials stacked on axis 2 in ``sph.spec`` order: o [B,Hkv,K,g,D], m, l
  [B,Hkv,K,g] (FP32, log2 units: they merge with :func:`partials` by ``common.merge``).

  Logits ``(q·μ + r̃·q'·ũ)·scale`` with ``q' = Π q`` (§2.2); ``logits="angles"`` forms ``q'·ũ``
  by CosFromAngles, ``"decoded"`` by decoding ũ first (the equality check).  An empty tier has
  l = 0 and contributes nothing to the merge."""
  if logits not in ("angles", "decoded"):
    raise ValueError(f"logits must be 'angles' or 'decoded', got {logits!r}")
  b, hq, d = q.shape
  hkv = sph.maps.pages[0].shape[1] if sph.spec else 1
  for ts in sph.spec:
    if ts.d != d:
      raise ValueError(f"tier spec has head dim {ts.d}, queries have {d}")
  g = hq // hkv
  c = common.default_scale(d, scale) * common.LOG2E
  qf = q.astype(jnp.float32).reshape(b, hkv, g, d)
  if not sph.spec:
    z = jnp.zeros((b, hkv, 0, g), jnp.float32)
    return jnp.zeros((b, hkv, 0, g, d), jnp.float32), z, z
  rot = sph_rotation(_layer_of(sph.consts.signs, layer))
  mu = _layer_of(sph.consts.mu, layer).astype(jnp.float32)             # [Hkv, D]
  qr = jnp.einsum("bhgd,ed->bhge", qf, rot, precision="highest")
  beta = jnp.einsum("bhgd,hd->bhg", qf, mu, precision="highest")
  parts = [_tier_partial(qf, qr, beta, pool, pages, length, ts, layer, c, logits)
           for pool, pages, length, ts in
           zip(sph.pools, sph.maps.pages, sph.maps.length, sph.spec)]
  o, m, l = (jnp.stack(x, axis=2) for x in zip(*parts))
  return o, m, l


def lse_of(m: jax.Array, l: jax.Array, axis: int) -> jax.Array:
  """Natural-log sum of exp of the (scaled) logits of all partials along ``axis``, from log2-unit
  partials (m, l); -inf where every partial is empty."""
  live = l > 0
  mm = jnp.where(live, m, -jnp.inf)
  v = jnp.max(mm, axis=axis, keepdims=True)
  vf = jnp.where(jnp.isfinite(v), v, 0.0)
  den = jnp.sum(jnp.where(live, l * jnp.exp2(mm - vf), 0.0), axis=axis)
  lse2 = jnp.squeeze(vf, axis) + jnp.log2(den)
  return lse2 / common.LOG2E


@functools.partial(jax.jit, static_argnames=("scale", "return_lse"))
def decode_attention_sph_reference(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps,
                                   sph: SphInputs, layer=None, *, scale: float | None = None,
                                   return_lse: bool = False):
  """:func:`decode_attention_reference` plus the Spherical KV tier partitions: q [B, Hq, D] ->
  out [B, Hq, D] bf16 (and, with ``return_lse``, the natural-log LSE of the scaled logits
  over every visible key, f32 [B, Hq])."""
  b, hq, d = q.shape
  o, m, l = partials(q, window, hi, lo, maps, layer, scale=scale)
  if sph is not None:
    so, sm, sl = sph_partials(q, sph, layer, scale=scale)
    o, m, l = (jnp.concatenate(x, axis=2) for x in ((o, so), (m, sm), (l, sl)))
  out, _ = common.merge(o, m, l, axis=2)
  out = out.reshape(b, hq, d).astype(jnp.bfloat16)
  if not return_lse:
    return out
  return out, lse_of(m, l, axis=2).reshape(b, hq)
