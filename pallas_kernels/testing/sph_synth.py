"""Random Spherical KV tier inputs that honour the contract of :mod:`pallas_kernels.sph_types`,
and a float64 numpy oracle over the decoded keys, for tests and (later) kernel comparisons.

Never zeros: keys are ``μ_h + N(0, 1)·mag`` with per-row magnitudes, values N(0, 1).  Everything
invisible is poisoned -- NaN fp16 radius and value scale in the side word, NaN BF16 values, 0xFF
INT4 values, random angle bytes, and garbage (out of range) page-table entries beyond a (sequence,
head)'s pages -- so a leak shows as NaN.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common
from pallas_kernels import int4
from pallas_kernels import spherical
from pallas_kernels.sph_types import SphConsts, SphInputs, SphMaps, SphPool
from pallas_kernels.testing import synth
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window

NAN_F16_BITS = 0x7E00


@functools.partial(jax.jit, static_argnums=3)
def _encode_pack(k, mu, rot, sp):
  codes, r = spherical.encode(spherical.to_code_space(k, mu, rot), sp)
  return spherical.pack(codes, sp), r


_quantize = jax.jit(int4.quantize_packed)


def unpack_numpy(packed: np.ndarray, sp: spherical.Spec) -> np.ndarray:
  """numpy twin of ``spherical.unpack`` (the layouts of ``spherical.pack``): ``uint8
  [..., NB]`` -> int64 tree-order codes ``[..., D]``."""
  p = np.asarray(packed).astype(np.int64)

  def split(x, bits):
    return np.concatenate([(x >> (bits * j)) & (2**bits - 1) for j in range(8 // bits)], -1)

  if sp.b1 == sp.bh:
    return split(p, sp.b1)
  n1 = sp.d // 2 * sp.b1 // 8
  return np.concatenate([split(p[..., :n1], sp.b1), split(p[..., n1:], sp.bh)], -1)


def make(tiers, lens, *, b: int, hkv: int, page: int, layers: int = 1, seed: int = 0,
         poison: bool = True, spare_pages: int = 2) -> SphInputs:
  """``tiers``: :class:`TierSpec` per tier; ``lens``: per tier an int array ``[B, Hkv]`` of
  entries.  Returns :class:`SphInputs` with a leading layer axis of ``layers`` on pools and
  constants (layers share the maps, as the layers of a group do)."""
  rng = np.random.default_rng(seed)
  d = tiers[0].d if tiers else 8
  signs = np.stack([spherical.rotation_signs(d, lyr, seed) for lyr in range(layers)])
  mu = rng.standard_normal((layers, hkv, d)) * rng.uniform(0.5, 2.0, (layers, hkv, 1))
  pools, tables, lengths = [], [], []
  for ts, ln in zip(tiers, lens):
    ln = np.broadcast_to(np.asarray(ln, np.int32), (b, hkv)).copy()
    n = max(1, -(-int(ln.max(initial=0)) // page))
    p_tot = b * hkv * n + spare_pages
    tbl = rng.permutation(p_tot)[: b * hkv * n].reshape(b, hkv, n).astype(np.int32)
    head = np.zeros(p_tot, np.int64)
    vis = np.zeros((p_tot, page), bool)
    for bb in range(b):
      for h in range(hkv):
        head[tbl[bb, h]] = h
        for j in range(int(ln[bb, h])):
          vis[tbl[bb, h, j // page], j % page] = True
        if poison:
          k = -(-int(ln[bb, h]) // page)
          tbl[bb, h, k:] = rng.integers(-5, p_tot + 50, size=n - k)
    ang, side, val = [], [], []
    for lyr in range(layers):
      rot = spherical.rotation(d, lyr, seed)
      mu_rows = mu[lyr][head][:, None, :]                            # [P, 1, D]
      k = mu_rows + rng.standard_normal((p_tot, page, d)) * rng.uniform(0.3, 2.0, (p_tot, page, 1))
      a, r = _encode_pack(jnp.asarray(k, jnp.float32), jnp.asarray(mu_rows, jnp.float32),
                          jnp.asarray(rot), ts.key)
      a = np.asarray(a)
      v = rng.standard_normal((p_tot, page, d)) * rng.uniform(0.5, 2.0, (p_tot, page, 1))
      if ts.values == "bf16":
        vs, vsc = np.asarray(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16)), None
      else:
        vp, vsc = _quantize(jnp.asarray(v, jnp.float32))
        vs = np.asarray(vp)
      sw = np.asarray(spherical.side_word(r, vsc))
      if poison:
        a = np.where(vis[..., None], a, rng.integers(0, 256, a.shape)).astype(np.uint8)
        sw = np.where(vis, sw, np.uint32(NAN_F16_BITS | NAN_F16_BITS << 16)).astype(np.uint32)
        if ts.values == "bf16":
          vs = np.where(vis[..., None], vs, np.asarray(jnp.bfloat16(np.nan)))
        else:
          vs = np.where(vis[..., None], vs, np.uint8(0xFF)).astype(np.uint8)
      ang.append(a)
      side.append(sw)
      val.append(vs)
    pools.append(SphPool(jnp.asarray(np.stack(ang)), jnp.asarray(np.stack(side)),
                         jnp.asarray(np.stack(val))))
    tables.append(jnp.asarray(tbl))
    lengths.append(jnp.asarray(ln))
  consts = SphConsts(jnp.asarray(signs, jnp.float32), jnp.asarray(mu, jnp.float32))
  return SphInputs(tuple(pools), SphMaps(tuple(tables), tuple(lengths)), consts, tuple(tiers))


def layer_of(sph: SphInputs, layer: int) -> SphInputs:
  """One layer's inputs (no leading layer axis) of a stacked :class:`SphInputs`."""
  pools = tuple(SphPool(*(x[layer] for x in p)) for p in sph.pools)
  consts = SphConsts(sph.consts.signs[layer], sph.consts.mu[layer])
  return SphInputs(pools, sph.maps, consts, sph.spec)


def decoded_rows(sph: SphInputs, b: int, h: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """float64 decoded (keys [S, D], values [S, D]) of (sequence b, KV head h) per tier, for one
  layer's inputs.  Codes come from the integer unpack; everything after is numpy float64."""
  out = []
  for pool, pages, length, ts in zip(sph.pools, sph.maps.pages, sph.maps.length, sph.spec):
    sp, d = ts.key, ts.d
    n = int(np.asarray(length)[b, h])
    tbl = np.asarray(pages)[b, h]
    rows = [(int(tbl[j // pool.ang.shape[1]]), j % pool.ang.shape[1]) for j in range(n)]
    if not rows:
      out.append((np.zeros((0, d)), np.zeros((0, d))))
      continue
    idx = tuple(np.asarray(rows).T)
    codes = unpack_numpy(np.asarray(pool.ang)[idx], sp)
    side = np.asarray(pool.side)[idx]
    r = (side & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    vsc = (side >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    lv = spherical.level_of_position(d)
    phi = np.zeros(codes.shape)
    for lvl in range(1, sp.levels + 1):
      phi[:, lv == lvl] = spherical.centers(sp, lvl)[codes[:, lv == lvl]]
    u = np.ones((n, 1))
    off = [0]
    w = d // 2
    while w >= 1:
      off.append(off[-1] + w)
      w //= 2
    for lvl in range(sp.levels, 0, -1):
      a = phi[:, off[lvl - 1]: off[lvl]]
      u = np.stack([u * np.cos(a), u * np.sin(a)], -1).reshape(n, -1)
    rot = spherical.hadamard(d) * np.asarray(sph.consts.signs, np.float64)[None, :] / math.sqrt(d)
    k = np.asarray(sph.consts.mu, np.float64)[h] + (r[:, None] * u) @ rot
    vals = np.asarray(pool.v)[idx]
    if ts.values == "bf16":
      v = np.asarray(jnp.asarray(vals).astype(jnp.float32), np.float64)
    else:
      x = vals.astype(np.int64)
      nib = np.concatenate([x & 0xF, x >> 4], -1)                 # half-split nibbles
      v = (nib - 16 * (nib >= 8)).astype(np.float64) * vsc[:, None]
    out.append((k, v))
  return out


def naive(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps, sph: SphInputs | None,
          *, scale=None):
  """float64 softmax over the union of every visible key (window, BF16 and INT4 pools, tiers),
  one layer's inputs -> (out [B, Hq, D], natural-log LSE [B, Hq]; -inf where nothing is
  visible)."""
  q = np.asarray(jnp.asarray(q).astype(jnp.float32), np.float64)
  nb, hq, d = q.shape
  hkv = window.k.shape[2]
  g = hq // hkv
  scale = 1 / np.sqrt(d) if scale is None else scale
  out, lse = np.zeros((nb, hq, d)), np.full((nb, hq), -np.inf)
  for b, (kc, vc) in enumerate(synth.visible_rows(window, hi, lo, maps)):
    for h in range(hkv):
      tk, tv = [kc[:, h]], [vc[:, h]]
      if sph is not None:
        for k, v in decoded_rows(sph, b, h):
          tk.append(k)
          tv.append(v)
      k, v = np.concatenate(tk), np.concatenate(tv)
      if not len(k):
        continue
      for i in range(h * g, (h + 1) * g):
        s = k @ q[b, i] * scale
        mx = s.max()
        p = np.exp(s - mx)
        out[b, i] = p @ v / p.sum()
        lse[b, i] = mx + np.log(p.sum())
  return out, lse


__all__ = ["NAN_F16_BITS", "decoded_rows", "layer_of", "make", "naive", "unpack_numpy"]


def zeros(tiers, *, b: int, hkv: int, page: int, n: int, layers: int | None = None) -> SphInputs:
  """Zero-filled SphInputs of the right shapes, stacked over ``layers`` when given: for
  ahead-of-time compiles and argument errors, which need shapes and no data."""
  lead = () if layers is None else (layers,)
  pools = tuple(SphPool(jnp.zeros(lead + (b * hkv * n, page, ts.code_bytes), jnp.uint8),
                        jnp.zeros(lead + (b * hkv * n, page), jnp.uint32),
                        jnp.zeros(lead + (b * hkv * n, page, ts.value_width),
                                  jnp.bfloat16 if ts.values == "bf16" else jnp.uint8))
                for ts in tiers)
  maps = SphMaps(tuple(jnp.zeros((b, hkv, n), jnp.int32) for _ in tiers),
                 tuple(jnp.full((b, hkv), n * page - 3, jnp.int32) for _ in tiers))
  d = tiers[0].d
  consts = SphConsts(jnp.ones(lead + (d,), jnp.float32), jnp.zeros(lead + (hkv, d), jnp.float32))
  return SphInputs(pools, maps, consts, tuple(tiers))


def tier_partial(o, m, l, k: int):
  """Tier k's partial of ``(o, m, l)`` with tiers on axis 2, normalized: [B, Hkv, g, D] (0
  where the tier is empty)."""
  return common.merge(o[:, :, k:k + 1], m[:, :, k:k + 1], l[:, :, k:k + 1], axis=2)[0]


def compare_tiers(got, want, *, logit_atol: float) -> float:
  """A tier kernel's partials against :func:`pallas_kernels.reference.sph_partials`, tier by
  tier -> the largest relative error norm.  Asserts what must hold exactly: the shapes, a tier
  empty exactly where the reference's is (and then its output all zero), finite outputs; and the
  max logits of live rows within ``logit_atol`` (log2 units)."""
  assert [x.shape for x in got] == [x.shape for x in want]
  errs = []
  for k in range(got[0].shape[2]):
    live = np.asarray(want[2][:, :, k]) > 0
    np.testing.assert_array_equal(np.asarray(got[2][:, :, k]) > 0, live)
    if not live.any():
      assert not np.asarray(got[0][:, :, k]).any()
      continue
    errs.append(synth.rel_err(tier_partial(*got, k), tier_partial(*want, k)))
    tier = lambda x: np.asarray(x[:, :, k])[live]  # noqa: E731
    np.testing.assert_allclose(tier(got[1]), tier(want[1]), rtol=1e-5, atol=logit_atol)
    errs.append(synth.rel_err(tier(got[2]), tier(want[2])))
  return max(errs)
