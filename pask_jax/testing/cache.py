"""Cache updates and inspection for tests, over the public :mod:`pask_jax.cache` API.

:func:`write_layer` is the per-layer form of one decode-step update on a copy of that layer's
arrays (``layer_slice`` … ``set_layer``): simpler than the in-place ``write_step`` /
``evict_step`` the decode step runs, written independently of them, so tests compare the two
(for an INT4 pool of either storage format: it puts rows into the token-major codes of
``pallas_kernels.int4.pool_codes`` and converts back).
:func:`append` is a whole step for every layer's K/V at once (a scan of :func:`write_layer`).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import int4
from pask_jax.cache import Cache, LayerKV, StepPlan, begin_step, group_array, kernel_inputs


def _rows(x: jax.Array) -> jax.Array:
  """A pool ``[P, page, ...]`` as rows ``[P * page, ...]``."""
  return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def write_layer(lkv: LayerKV, plan: StepPlan, g, k: jax.Array, v: jax.Array) -> LayerKV:
  """One layer's K/V update for a step: materialize the evicted window token into this layer's
  pools (by group ``g``'s decision, ``g`` may be traced) and write the new ``k, v [B, Hkv, D]``
  into the window.  ``lkv`` is one layer's arrays (no layer axis)."""
  B, W = lkv.win_k.shape[:2]
  chex.assert_shape(k, (B,) + lkv.win_k.shape[2:])
  bi = jnp.arange(B)
  read = jnp.minimum(plan.slot, W - 1)
  old_k, old_v = lkv.win_k[bi, read], lkv.win_v[bi, read]            # [B, Hkv, D]
  dh, dl = plan.dest_hi[g], plan.dest_lo[g]                          # [B]

  def put(pool, rows, val):
    return _rows(pool).at[rows].set(val.astype(pool.dtype), mode="drop").reshape(pool.shape)

  kq, ks = int4.quantize(old_k)
  vq, vs = int4.quantize(old_v)
  # The INT4 pool in either format: as token-major codes, the row put, back to the format.
  kc, vc = int4.pool_codes(lkv.lo_k, lkv.lo_v)                      # [P, page, Hkv, D]
  fmt = int4.format_of(lkv.lo_k)
  lo_k, lo_v = int4.pool_arrays(put(kc, dl, kq), put(vc, dl, vq), fmt)
  lo_s = int4.scale_array(put(int4.pool_scales(lkv.lo_s, fmt), dl, jnp.stack([ks, vs], -1)), fmt)
  return LayerKV(
      win_k=lkv.win_k.at[bi, plan.slot].set(k.astype(lkv.win_k.dtype), mode="drop"),
      win_v=lkv.win_v.at[bi, plan.slot].set(v.astype(lkv.win_v.dtype), mode="drop"),
      hi_k=put(lkv.hi_k, dh, old_k), hi_v=put(lkv.hi_v, dh, old_v),
      lo_k=lo_k, lo_v=lo_v, lo_s=lo_s)


def layer_slice(cache: Cache, layer) -> LayerKV:
  """Layer ``layer``'s arrays (``layer`` may be traced)."""
  return jax.tree.map(lambda x: x[layer], cache.layers)


def set_layer(cache: Cache, layer, lkv: LayerKV) -> Cache:
  """``cache`` with layer ``layer``'s arrays replaced by ``lkv``."""
  return cache.replace(layers=jax.tree.map(lambda x, y: x.at[layer].set(y), cache.layers, lkv))


def layer_inputs(cache: Cache, layer: int):
  """``kernel_inputs`` for layer ``layer`` of a cache (static layer index)."""
  return kernel_inputs(layer_slice(cache, layer), cache, cache.group_of[layer])


def append(cache: Cache, k: jax.Array, v: jax.Array, actions: jax.Array,
           active: jax.Array | None = None) -> Cache:
  """A whole decode-step update from every layer's K/V ``[L, B, Hkv, D]`` (scan over layers)."""
  chex.assert_shape(k, (cache.n_layers, cache.batch) + cache.layers.win_k.shape[3:])
  cache, plan = begin_step(cache, actions, active)

  def body(_, xs):
    lkv, kl, vl, g = xs
    return None, write_layer(lkv, plan, g, kl, vl)

  _, layers = jax.lax.scan(body, None, (cache.layers, k, v, group_array(cache)))
  return cache.replace(layers=layers)


def lo_dequantized(cache: Cache) -> tuple[np.ndarray, np.ndarray]:
  """Every row of the INT4 pool, either format, dequantized (codes x fp16 scale, float32) and
  token-major: (k, v) ``[L, P_lo, lo_page, Hkv, D]`` numpy arrays.  Rows never written hold
  zero codes with scale 1 in both formats, so two caches that stored the same entries in the
  same rows compare equal here whatever their formats."""
  lay = cache.layers
  kc, vc = int4.pool_codes(lay.lo_k, lay.lo_v)
  s = np.asarray(int4.pool_scales(lay.lo_s, int4.format_of(lay.lo_k)), np.float32)
  return (np.asarray(kc, np.float32) * s[..., 0:1], np.asarray(vc, np.float32) * s[..., 1:2])


def stored_positions(cache: Cache, g: int, b: int) -> dict[str, list[int]]:
  """Absolute positions visible to group ``g`` of sequence ``b``: hi, lo (entry order), window."""
  hl, ll = int(cache.hi_len[g, b]), int(cache.lo_len[g, b])
  wl = int(cache.win_len[b])
  return {"hi": np.asarray(cache.hi_pos[g, b, :hl]).tolist(),
          "lo": np.asarray(cache.lo_pos[g, b, :ll]).tolist(),
          "win": np.asarray(cache.win_pos[b, :wl]).tolist()}
