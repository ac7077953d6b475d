"""The Spherical KV tier state (docs/SPHERICAL_KV.md §2.5, §3 "Cache"): tier-homogeneous
page pools, per-(group, sequence, KV head) page tables, and the pending route of each window
token.  Immutable pytree; every update is a pure, jittable function returning a new state.

Shapes (L layers, B sequences, W window slots, G layer groups, Hkv KV heads, D head dim, K tiers;
per tier t: P_t pages of ``page`` rows, NB_t packed angle bytes)::

  pools[t].ang   [L, P_t, page, NB_t] u8   packed angle codes (pallas_kernels.spherical)
  pools[t].side  [L, P_t, page]       u32  fp16 radius | fp16 INT4 value scale
  pools[t].v     [L, P_t, page, D] bf16 or [L, P_t, page, D/2] u8 (INT4 half-split)
  pages[t]       [G, B, Hkv, n_t]     i32  page table; an id outside [0, P_t) is unassigned
  length[t]      [G, B, Hkv]          i32  entries stored
  pos[t]         [G, B, Hkv, n_t·page] i32 absolute position of entry j (-1: none)
  flags[t]       [G, B, Hkv, n_t]     u32  bit r of page i: entry i·page + r is protected
  free[t]        [G, P_t]             i32  free-page stack of (tier, group); top at free_n − 1
  free_n[t]      [G]                  i32
  route          [B, W, G, Hkv]       i8   pending route of each window token
  prot           [B, W, G, Hkv]       bool pending protection flag
  balance, lam   [B, G]               f32  RDR's decode budget balance and λ (set by RDR)
  overflow       [B]                  bool an item did not fit its tier (it was dropped)
  win_att        [B, W, G, Hkv]       f32  attention mass each window token has received since it
                                           entered (the gated decode rule; else left at 0)
  consts         signs [L, D], mu [L, Hkv, D] (rotation Π_ℓ and centering μ)

Routes: 0 = drop, k ∈ 1..K = tier k (``spec[k − 1]``), K + 1 = the PASK cache's BF16 pool
(:func:`dense_route`), which stores every head of a (token, group): a route K + 1 on any head of a
(token, group) routes all its heads there, and sink positions always go there.  The base cache's
``win_act`` is H exactly where the route is K + 1 (:func:`base_actions`), else R, so every
visible (token, group, head) lives in exactly one place: the window, the BF16 pool or one tier.

A page holds rows of one tier and one (group, sequence, KV head); its id names that page in every
layer of the group, so groups (disjoint layer sets) can reuse ids: one free list per (tier,
group).  Pools are append-only; an open page has ``length`` below a page boundary.  Pages are
taken on demand (:func:`assign_pages`) from the free list, or pre-assigned (the dense default of
:func:`init`: (b, h) owns pages ``(b·Hkv + h)·n_t …`` of every tier and group).

Tensor parallelism (``pask_jax.mesh``, ``shards`` = N devices, N dividing Hkv): device i holds
the KV heads ``[i·Hkv/N, (i+1)·Hkv/N)`` and block i of every tier pool's page axis, and the
dense default numbers pages shard-major (``((i·B + b)·Hkv/N + h')·n_t …`` for head
``h = i·Hkv/N + h'``; N = 1 is the order above), so every page a device's heads name is in its
own block: the pools split on the page axis with nothing gathered, the writes (``mesh=`` of
:func:`write_prefill`, :func:`evict_step`) and the attention
(``pask_jax.mesh.attention_per_shard``) run per device on local page ids.  The maps, routes and
balances stay replicated (small; the decisions read every head).  Free lists (``pool_pages``)
are one per (tier, group) over the whole pool: refused with N > 1.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_kernels import common, int4
from pallas_kernels import spherical
from pallas_kernels.sph_types import SphConsts, SphInputs, SphMaps, SphPool, TierSpec
from pask_jax import actions as Act
from pask_jax import cache as pcache
from pask_jax import mesh as tp
from pask_jax import tags as T
from pask_jax.spherical import variants as V


@flax.struct.dataclass
class SphState:
  pools: tuple
  pages: tuple
  length: tuple
  pos: tuple
  flags: tuple
  free: tuple
  free_n: tuple
  route: jax.Array
  prot: jax.Array
  balance: jax.Array
  lam: jax.Array
  overflow: jax.Array
  win_att: jax.Array
  consts: SphConsts
  spec: tuple = flax.struct.field(pytree_node=False, default=())
  group_of: tuple = flax.struct.field(pytree_node=False, default=())
  sink: int = flax.struct.field(pytree_node=False, default=0)
  page: int = flax.struct.field(pytree_node=False, default=16)

  @property
  def n_tiers(self) -> int:
    return len(self.spec)

  @property
  def window(self) -> int:
    return self.route.shape[1]

  @property
  def n_groups(self) -> int:
    return self.route.shape[2]


class SphRows(NamedTuple):
  """Where a prefill's tokens go per tier (:func:`prefill_rows`), shared by every layer chunk."""
  dest: tuple  # per tier [G, B, Hkv, T] int32 flat pool row (P_t·page: not stored)


def dense_route(state: SphState) -> int:
  """The route value of the PASK cache's BF16 pool: K + 1."""
  return state.n_tiers + 1


def init(n_layers: int, batch: int, n_kv_heads: int, head_dim: int, *, tiers, capacity,
         window: int, n_groups: int = 3, page: int = 16, sink: int = 0, mu=None, seed: int = 0,
         pool_pages=None, shards: int = 1) -> SphState:
  """An empty state.  ``tiers``: :class:`TierSpec` per tier (head dim ``head_dim``);
  ``capacity``: entries per (group, sequence, KV head) table, an int or one per tier (rounded up
  to pages); ``mu [L, Hkv, D]``: centering means (default 0); rotation signs from ``seed``.
  ``pool_pages`` (an int or one per tier): pools of that many pages with empty tables and full
  free lists; None: the dense default (every table pre-assigned, free lists empty).
  ``shards``: the pages numbered for that many devices' blocks (see the module's text)."""
  tiers = tuple(tiers)
  if not tiers:
    raise ValueError("Spherical KV needs at least one tier")
  for ts in tiers:
    if not isinstance(ts, TierSpec) or ts.d != head_dim:
      raise ValueError(f"every tier must be a TierSpec of head dim {head_dim}, got {ts!r}")
  if window < 1 or page < 1 or page > 32:
    raise ValueError(f"need window >= 1 and 1 <= page <= 32 (flag bits), got {window}, {page}")
  per = lambda x: tuple(x) if isinstance(x, (tuple, list)) else (x,) * len(tiers)
  caps, npool = per(capacity), per(pool_pages)
  L, B, H, D, G = n_layers, batch, n_kv_heads, head_dim, n_groups
  if shards < 1 or H % shards:
    raise ValueError(f"{H} KV heads do not split over {shards} devices")
  if shards > 1 and any(x is not None for x in npool):
    raise ValueError(f"pool_pages (shared free lists) cannot split over {shards} devices: use "
                     "the dense default")
  pools, pages, length, pos, flags, free, free_n = [], [], [], [], [], [], []
  for ts, cap, npp in zip(tiers, caps, npool):
    n = max(1, math.ceil(cap / page))
    if npp is None:
      p_t = B * H * n
      tbl = jnp.arange(p_t, dtype=jnp.int32).reshape(shards, B, H // shards, n)
      tbl = jnp.transpose(tbl, (1, 0, 2, 3)).reshape(1, B, H, n)   # device-major (see above)
      fr, fn = jnp.zeros((G, p_t), jnp.int32), jnp.zeros((G,), jnp.int32)
    else:
      if npp < 1:
        raise ValueError(f"pool_pages must be >= 1, got {npp}")
      p_t = int(npp)
      tbl = jnp.full((1, B, H, n), p_t, jnp.int32)
      fr = jnp.broadcast_to(jnp.arange(p_t, dtype=jnp.int32)[::-1], (G, p_t))
      fn = jnp.full((G,), p_t, jnp.int32)
    pools.append(SphPool(jnp.zeros((L, p_t, page, ts.code_bytes), jnp.uint8),
                         jnp.zeros((L, p_t, page), jnp.uint32),
                         jnp.zeros((L, p_t, page, ts.value_width),
                                   jnp.bfloat16 if ts.values == "bf16" else jnp.uint8)))
    pages.append(jnp.broadcast_to(tbl, (G, B, H, n)))
    length.append(jnp.zeros((G, B, H), jnp.int32))
    pos.append(jnp.full((G, B, H, n * page), -1, jnp.int32))
    flags.append(jnp.zeros((G, B, H, n), jnp.uint32))
    free.append(fr)
    free_n.append(fn)
  signs = jnp.asarray([spherical.rotation_signs(D, lyr, seed) for lyr in range(L)], jnp.float32)
  mu = jnp.zeros((L, H, D), jnp.float32) if mu is None else jnp.asarray(mu, jnp.float32)
  if mu.shape != (L, H, D):
    raise ValueError(f"mu must be [L, Hkv, D] = {(L, H, D)}, got {mu.shape}")
  return SphState(
      pools=tuple(pools), pages=tuple(pages), length=tuple(length), pos=tuple(pos),
      flags=tuple(flags), free=tuple(free), free_n=tuple(free_n),
      route=jnp.zeros((B, window, G, H), jnp.int8), prot=jnp.zeros((B, window, G, H), bool),
      balance=jnp.zeros((B, G), jnp.float32), lam=jnp.zeros((B, G), jnp.float32),
      overflow=jnp.zeros((B,), bool), win_att=jnp.zeros((B, window, G, H), jnp.float32),
      consts=SphConsts(signs, mu), spec=tiers,
      group_of=tuple(T.group_of_layer(L, G)), sink=int(sink), page=int(page))


# ---- helpers ----------------------------------------------------------------------------------

def _take_pages(pages, free, free_n, new_len, page: int, n_pool: int):
  """Pop pages from each group's free list for every unassigned table entry below
  ``ceil(new_len / page)``, in (sequence, head, page) order; entries the list cannot cover stay
  unassigned.  pages [G, B, H, n], free [G, P], free_n [G], new_len [G, B, H]."""
  G, B, H, n = pages.shape
  need = -(-new_len // page)
  want = (jnp.arange(n) < need[..., None]) & ((pages < 0) | (pages >= n_pool))
  flat = want.reshape(G, -1)
  rank = jnp.cumsum(flat, axis=-1) - 1
  ok = flat & (rank < free_n[:, None])
  idx = jnp.clip(free_n[:, None] - 1 - rank, 0, free.shape[1] - 1)
  got = jnp.take_along_axis(free, idx, axis=1)
  pages = jnp.where(ok.reshape(pages.shape), got.reshape(pages.shape), pages)
  return pages, free_n - jnp.sum(ok, axis=-1, dtype=jnp.int32)


def _flat_row(pages, j, page: int, n_pool: int):
  """Entry ``j [G, B, H, ...]`` through ``pages [G, B, H, n]`` -> flat pool row, or
  ``n_pool·page`` (dropped by scatters) beyond the table or on an unassigned page."""
  G, B, H, n = pages.shape
  extra = (1,) * (j.ndim - 3)
  pi = j // page
  ix = lambda k, size: jnp.arange(size).reshape((1,) * k + (size,) + (1,) * (2 - k) + extra)
  pid = pages[ix(0, G), ix(1, B), ix(2, H), jnp.clip(pi, 0, n - 1)]
  ok = (j >= 0) & (pi < n) & (pid >= 0) & (pid < n_pool)
  return jnp.where(ok, pid * page + j % page, n_pool * page)


def _encode_rows(state: SphState, ts: TierSpec, k, v, layers):
  """K/V rows ``[Lc, ..., Hkv, D]`` of layers ``layers [Lc]`` -> (packed angles, side words,
  value stream) in tier ``ts``'s format; keys and values first rounded to BF16 (what the window
  held)."""
  kb = common.round_bf16(k)
  vb = v.astype(jnp.bfloat16)
  extra = (1,) * (k.ndim - 3)
  mu = state.consts.mu[layers].reshape((len(layers),) + extra + state.consts.mu.shape[1:])
  h = jnp.asarray(spherical.hadamard(ts.d) / math.sqrt(ts.d), jnp.float32)
  rot = h[None] * state.consts.signs[layers][:, None, :]                 # [Lc, D, D]
  x = jnp.einsum("l...d,led->l...e", kb - mu, rot, precision=jax.lax.Precision.HIGHEST)
  codes, r = spherical.encode(x, ts.key)
  ang = spherical.pack(codes, ts.key)
  if ts.values == "bf16":
    return ang, spherical.side_word(r), vb
  vq, vs = int4.quantize_packed(vb)
  return ang, spherical.side_word(r, vs), vq


def _scatter(x, li, rows, val):
  """x [L, P, page, ...] <- val at (layer li, flat row rows), rows out of range dropped."""
  flat = x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])
  val = val.astype(x.dtype)
  if x.dtype == jnp.bfloat16:   # an integer scatter on the bits (XLA CPU widens bf16 scatters)
    u = jax.lax.bitcast_convert_type(flat, jnp.uint16)
    u = u.at[li, rows].set(jax.lax.bitcast_convert_type(val, jnp.uint16), mode="drop")
    return jax.lax.bitcast_convert_type(u, x.dtype).reshape(x.shape)
  return flat.at[li, rows].set(val, mode="drop").reshape(x.shape)


def _scatter_pool(pool: SphPool, li, rows, ang, side, val, mesh=None) -> SphPool:
  """:func:`_scatter` of one tier's three arrays; on a ``mesh`` (``pask_jax.mesh``) per device:
  the pool by its page axis, ``rows`` and the values by KV head (the last axis of ``rows``),
  global rows made local (another device's rows, and the dropped ones, fall outside)."""
  if mesh is None:
    return SphPool(_scatter(pool.ang, li, rows, ang), _scatter(pool.side, li, rows, side),
                   _scatter(pool.v, li, rows, val))
  A = tp.AXIS
  head = rows.ndim - 1
  by_head = lambda x: P(*[A if i == head else None for i in range(x.ndim)])
  by_page = P(None, A)

  def body(pool, li, rows, ang, side, val):
    start = jax.lax.axis_index(A) * pool.ang.shape[1] * pool.ang.shape[2]
    local = rows - start
    local = jnp.where(local < 0, pool.ang.shape[1] * pool.ang.shape[2], local)
    return _scatter_pool(pool, li, local, ang, side, val)
  f = jax.shard_map(body, mesh=mesh, out_specs=SphPool(by_page, by_page, by_page),
                    in_specs=(SphPool(by_page, by_page, by_page), P(), by_head(rows),
                              by_head(ang), by_head(side), by_head(val)))
  return f(pool, li, rows, ang, side, val)


def _append(state: SphState, t: int, sel, pos_val, prot, n_pool: int):
  """Append the selected items ``sel [G, B, H, T]`` (in T order) to tier t's tables (of a pool
  of ``n_pool`` pages): pages taken as needed, positions ``pos_val`` and protection bits
  written.  Returns (new tier maps, destination rows [G, B, H, T], lost [B])."""
  page = state.page
  length = state.length[t]
  j = length[..., None] + jnp.cumsum(sel, axis=-1) - 1
  pages, free_n = _take_pages(state.pages[t], state.free[t], state.free_n[t],
                              length + jnp.sum(sel, axis=-1, dtype=jnp.int32), page, n_pool)
  dest = jnp.where(sel, _flat_row(pages, j, page, n_pool), n_pool * page)
  stored = sel & (dest < n_pool * page)
  G, B, H = length.shape
  gi = jnp.arange(G)[:, None, None, None]
  bi = jnp.arange(B)[None, :, None, None]
  hi = jnp.arange(H)[None, None, :, None]
  cap = state.pos[t].shape[-1]
  pos = state.pos[t].at[gi, bi, hi, jnp.where(stored, j, cap)].set(pos_val, mode="drop")
  n = pages.shape[-1]
  bit = jnp.left_shift(jnp.uint32(1), (j % page).astype(jnp.uint32))
  flags = state.flags[t].at[gi, bi, hi, jnp.where(stored & prot, j // page, n)].add(
      bit, mode="drop")
  new = dict(pages=pages, free_n=free_n, pos=pos, flags=flags,
             length=length + jnp.sum(stored, axis=-1, dtype=jnp.int32))
  return new, dest, jnp.any(sel & ~stored, axis=(0, 2, 3))


def _with_tier(state: SphState, t: int, new: dict) -> dict:
  """The per-tier tuples of ``state`` with tier t's entries replaced."""
  out = {}
  for name, val in new.items():
    xs = list(getattr(state, name))
    xs[t] = val
    out[name] = tuple(xs)
  return out


def normalize_route(state: SphState, route, pos):
  """Routes ``[..., G, Hkv]`` at positions ``pos [...]``: sinks and any (token, group) with a
  head routed to the BF16 pool go there with all heads."""
  route = route.astype(jnp.int8)
  k1 = jnp.int8(dense_route(state))
  dense = jnp.any(route == k1, axis=-1, keepdims=True) | (pos < state.sink)[..., None, None]
  return jnp.where(dense, k1, route)


def base_actions(state: SphState, route) -> jax.Array:
  """The PASK cache's actions ``int8 [..., G]`` for routes ``[..., G, Hkv]``: H where routed to
  the BF16 pool, else R (the tier partitions and drops are not the base cache's business)."""
  dense = jnp.any(route == dense_route(state), axis=-1)
  return jnp.where(dense, jnp.int8(Act.H), jnp.int8(Act.R))


# ---- prefill ----------------------------------------------------------------------------------

def prefill_rows(state: SphState, route, n_tokens: int, lengths=None, prot=None, *, mesh=None):
  """Every map, position and pending route of a prefill into a fresh state -> (state, SphRows).

  route: int ``[B, T, G, Hkv]`` (0 drop, k tier k, K + 1 BF16 pool); prot: bool, same shape
  (default none).  The last min(n, W) real tokens of each prompt stay in the window with their
  route pending; earlier ones are appended to their tier (in position order).  ``mesh``: the
  maps computed replicated on its devices (:func:`_maps_update`)."""
  B, W, G, H = state.route.shape
  if route.shape != (B, n_tokens, G, H):
    raise ValueError(f"route must be [B, T, G, Hkv] = {(B, n_tokens, G, H)}, got {route.shape}")
  maps = lambda st, *a, n_pools: _prefill_maps(st, *a, n_tokens=n_tokens, n_pools=n_pools)
  state, dests = _maps_update(maps, state, mesh, route, lengths, prot)
  return state, SphRows(dests)


def _maps_update(fn, state: SphState, mesh, *args):
  """``fn(state, *args, n_pools=) -> (state, extra)``, an update of the maps only (it reads
  the pools' page counts, never a pool) -> ``(state, extra)``.  On a ``mesh``
  (``pask_jax.mesh.on_every_device``) computed whole on every device from replicated inputs:
  the decisions are the same everywhere, and the SPMD partitioner does not split the maps by
  head only to gather them back (one small collective per map and tier)."""
  n_pools = tuple(p.ang.shape[1] for p in state.pools)
  f = lambda st, *a: fn(st, *a, n_pools=n_pools)
  if mesh is None:
    return f(state, *args)
  bare = state.replace(pools=(), consts=SphConsts(None, None))
  new, extra = tp.on_every_device(f, mesh)(bare, *args)
  return new.replace(pools=state.pools, consts=state.consts), extra


def _prefill_maps(state: SphState, route, lengths, prot, *, n_tokens: int, n_pools):
  """:func:`prefill_rows`' maps -> (state, per tier the destination rows)."""
  B, W, G, H = state.route.shape
  Tn = n_tokens
  n = jnp.full((B,), Tn, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
  prot = jnp.zeros(route.shape, bool) if prot is None else jnp.asarray(prot, bool)
  t = jnp.arange(Tn, dtype=jnp.int32)[None, :]
  real = t < n[:, None]
  in_win = real & (t >= n[:, None] - W)
  done = real & ~in_win
  route = normalize_route(state, route, jnp.broadcast_to(t, (B, Tn)))
  to_gbht = lambda x: jnp.transpose(x, (2, 0, 3, 1))              # [B, T, G, H] -> [G, B, H, T]
  pos_val = jnp.broadcast_to(t[None, :, None, :], (G, B, H, Tn))
  dests, lost = [], jnp.zeros((B,), bool)
  for ti in range(state.n_tiers):
    sel = to_gbht(done[..., None, None] & (route == ti + 1))
    new, dest, lt = _append(state, ti, sel, pos_val, to_gbht(prot), n_pools[ti])
    state = state.replace(**_with_tier(state, ti, new))
    dests.append(dest)
    lost = lost | lt
  slot = jnp.where(in_win, t % W, W)
  bj = jnp.arange(B)[:, None]
  state = state.replace(route=state.route.at[bj, slot].set(route, mode="drop"),
                        prot=state.prot.at[bj, slot].set(prot, mode="drop"),
                        overflow=state.overflow | lost)
  return state, tuple(dests)


def write_prefill(state: SphState, rows: SphRows, k, v, start: int = 0, *,
                  mesh=None) -> SphState:
  """Encode and write the K/V of layers ``[start, start + Lc)`` (k, v ``[Lc, B, T, Hkv, D]``,
  post-RoPE) of a prefill placed by :func:`prefill_rows` into every tier's pools (bounded
  temporaries: call it per chunk of layers, e.g. in a loop).  ``start`` may be traced (an int32
  scalar), and must then be in range itself: a traced start past ``L - Lc`` is not caught.
  ``mesh``: the pools split over its devices (a state of ``init(shards=mesh.size)``): written
  per device."""
  Lc = k.shape[0]
  if v.shape != k.shape:
    raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
  L = len(state.group_of)
  if isinstance(start, int) and not 0 <= start <= L - Lc:
    raise ValueError(f"layers [{start}, {start + Lc}) are not within the model's {L} layers")
  layers = start + jnp.arange(Lc)
  gl = jax.lax.dynamic_slice_in_dim(jnp.asarray(state.group_of, jnp.int32), start, Lc)
  li = layers[:, None, None, None]
  pools = []
  for ts, pool, dest in zip(state.spec, state.pools, rows.dest):
    d = jnp.transpose(dest[gl], (0, 1, 3, 2))                        # [Lc, B, T, H]
    ang, side, val = _encode_rows(state, ts, k, v, layers)
    pools.append(_scatter_pool(pool, li, d, ang, side, val, mesh))
  return state.replace(pools=tuple(pools))


# ---- decode -----------------------------------------------------------------------------------

def evict_step(state: SphState, slot, pos, k, v, new_route=None, new_prot=None, *,
               mesh=None) -> SphState:
  """The token leaving window slot ``slot [B]`` (W: none this step) at position ``pos [B]``
  (-1: the slot was empty), with its K/V of every layer ``k, v [L, B, Hkv, D]`` (read from the
  window before it is overwritten), is appended to the tier its pending route names and encoded
  for all layers at once (one scatter per tier array).  Then the slot takes the new token's
  ``new_route [B, G, Hkv]`` and ``new_prot``, normalized at the new token's position (``pos + W``,
  or ``slot`` when the slot was empty: the window fills in order).  ``mesh``: as for
  :func:`write_prefill`; the maps are updated replicated (:func:`_maps_update`), the pools per
  device."""
  new, dests = _maps_update(_evict_maps, state, mesh, slot, pos, new_route, new_prot)
  gl = jnp.asarray(state.group_of, jnp.int32)
  L = len(state.group_of)
  li = jnp.arange(L)[:, None, None]
  pools = []
  for ts, pool, dest in zip(state.spec, state.pools, dests):
    ang, side, val = _encode_rows(state, ts, k, v, jnp.arange(L))
    pools.append(_scatter_pool(pool, li, dest[..., 0][gl], ang, side, val, mesh))   # [L, B, H]
  return new.replace(pools=tuple(pools))


def _evict_maps(state: SphState, slot, pos, new_route, new_prot, *, n_pools):
  """:func:`evict_step`'s maps (no pool read or written) -> (state, per tier the destination
  rows ``[G, B, H, 1]``)."""
  B, W, G, H = state.route.shape
  slot = jnp.asarray(slot, jnp.int32)
  pos = jnp.asarray(pos, jnp.int32)
  bi = jnp.arange(B)
  read = jnp.minimum(slot, W - 1)
  evict = (slot < W) & (pos >= 0)
  route, prot = state.route[bi, read], state.prot[bi, read]              # [B, G, H]
  to_gbh = lambda x: jnp.transpose(x, (1, 0, 2))[..., None]             # -> [G, B, H, 1]
  pos_val = jnp.broadcast_to(pos[None, :, None, None], (G, B, H, 1))
  dests, lost = [], jnp.zeros((B,), bool)
  for ti in range(state.n_tiers):
    sel = to_gbh(evict[:, None, None] & (route == ti + 1))
    new, dest, lt = _append(state, ti, sel, pos_val, to_gbh(prot), n_pools[ti])
    state = state.replace(**_with_tier(state, ti, new))
    lost = lost | lt
    dests.append(dest)
  state = state.replace(overflow=state.overflow | lost)
  if new_route is None:
    return state, tuple(dests)
  wslot = jnp.where(slot < W, slot, W)
  r = normalize_route(state, jnp.asarray(new_route), jnp.where(pos >= 0, pos + W, slot))
  p = jnp.zeros(r.shape, bool) if new_prot is None else jnp.asarray(new_prot, bool)
  return state.replace(route=state.route.at[bi, wslot].set(r, mode="drop"),
                       prot=state.prot.at[bi, wslot].set(p, mode="drop")), tuple(dests)


def assign_pages(state: SphState, new_len) -> SphState:
  """Take pages from each (tier, group) free list so that the first ``new_len[t] [G, B, Hkv]``
  entries of every table have a page (entries the list cannot cover stay unassigned: appending
  there drops the item and sets ``overflow``).  :func:`prefill_rows` and :func:`evict_step` call
  it for what they append; an engine may call it ahead."""
  pages, free_n = [], []
  for t in range(state.n_tiers):
    p, f = _take_pages(state.pages[t], state.free[t], state.free_n[t],
                       jnp.asarray(new_len[t], jnp.int32), state.page,
                       state.pools[t].ang.shape[1])
    pages.append(p)
    free_n.append(f)
  return state.replace(pages=tuple(pages), free_n=tuple(free_n))


# ---- readers ----------------------------------------------------------------------------------

def sph_inputs(state: SphState, g) -> SphInputs:
  """The kernel inputs of the tiers of layer group ``g`` (may be traced), stacked on layers: pass
  to ``decode_attention(..., sph=..., layer=ℓ)``."""
  maps = SphMaps(tuple(p[g] for p in state.pages), tuple(n[g] for n in state.length))
  return SphInputs(state.pools, maps, state.consts, state.spec)


def rebuild_tier(state: SphState, t: int, g, layer):
  """The format-only read of tier ``t`` (ablation A1, §3): layer ``layer``'s visible entries of
  group ``g`` (both may be traced) decoded to dense BF16 keys ``k̃ = μ + r̃·Πᵀũ`` and values ->
  (k, v bf16 [B, Hkv, S, D], length int32 [B, Hkv]), S = the table's entries; entries at or past
  ``length`` are zeros.  A transient buffer of the reconstruct-then-dot path: the method's own
  read (:func:`sph_inputs`) never forms it."""
  ts, pool = state.spec[t], state.pools[t]
  pages, length = state.pages[t][g], state.length[t][g]                 # [B, H, n], [B, H]
  B, H, n = pages.shape
  ids = jnp.clip(pages, 0, pool.ang.shape[1] - 1)
  rows = lambda x: x[layer, ids].reshape((B, H, n * state.page) + x.shape[3:])
  ang, side, val = rows(pool.ang), rows(pool.side), rows(pool.v)
  vis = jnp.arange(n * state.page)[None, None] < length[..., None]      # [B, H, S]
  side = jnp.where(vis, side, jnp.uint32(0))
  h = jnp.asarray(spherical.hadamard(ts.d) / math.sqrt(ts.d), jnp.float32)
  rot = h * state.consts.signs[layer][None, :]
  mu = state.consts.mu[layer][None, :, None, :]                         # [1, H, 1, D]
  k = spherical.decode_key(ang, side, mu, rot, ts.key)
  if ts.values == "bf16":
    v = val.astype(jnp.float32)
  else:
    v = int4.dequantize(val, spherical.side_value_scale(side))
  k = jnp.where(vis[..., None], k, 0.0).astype(jnp.bfloat16)
  v = jnp.where(vis[..., None], v, 0.0).astype(jnp.bfloat16)
  return k, v, length


def resident_bytes(state: SphState) -> jax.Array:
  """Bytes the tiers hold per sequence, f32 [B]: every referenced page in full (partial-page
  slack included) in every layer of its group, plus :func:`tier_metadata_bytes` (§2.3's item
  cost, with slack)."""
  counts = [state.group_of.count(g) for g in range(state.n_groups)]
  n_layers = jnp.asarray(counts, jnp.float32)[:, None, None]
  total = tier_metadata_bytes(state)
  for ts, length in zip(state.spec, state.length):
    used = (-(-length // state.page)).astype(jnp.float32)
    total = total + jnp.sum(used * state.page * n_layers * ts.bytes, axis=(0, 2))
  return total


def tier_metadata_bytes(state: SphState) -> jax.Array:
  """The tiers' bytes that are not codes or values, per sequence, f32 [B]: per item a position
  (4 B) and a flag bit, per referenced page a 4-byte table entry."""
  total = jnp.zeros(state.route.shape[:1], jnp.float32)
  for length in state.length:
    used = (-(-length // state.page)).astype(jnp.float32)
    total = total + jnp.sum(length.astype(jnp.float32) * (spherical.POSITION_BYTES + 1 / 8)
                            + used * spherical.TABLE_ENTRY_BYTES, axis=(0, 2))
  return total


def tier_hbm_bytes(state: SphState, *, granularity: str = "row",
                   read: str = "angles") -> np.ndarray:
  """HBM bytes the tier partitions of one decode step read (and, for ``read="reconstruct"``,
  write) per sequence, float64 ``[B]``: over every layer, tier and KV head (each (group,
  sequence, KV head) has its own page table, read by each layer of the group).

  ``read="angles"`` (the method's own path, the tier kernels): per visible entry the packed
  codes, the u32 side word and the values (``TierSpec.bytes``), plus the table entries, at the
  ``granularity`` of :func:`pask_jax.cache.paged_read_bytes`.  ``read="reconstruct"`` (ablation
  A1 as built: :func:`rebuild_tier` in XLA, then a BF16 partition): the rebuild gathers the
  WHOLE table (``n_t·page`` rows of codes, side words and values, and its ``n_t`` entries) and
  writes dense BF16 K and V for every one of those rows (``4·D`` bytes each, zeros past the
  length), then the BF16 partition reads the visible rebuilt rows (``4·D`` each) through a table
  of ``n_t`` entries, plus, at "page", its empty one-slot window block (``4·D``).  Positions and
  flags are never read by a decode step's attention (keys carry RoPE already), so neither path
  counts them."""
  pcache.check_granularity(granularity)
  if read not in V.READS:
    raise ValueError(f"read must be one of {V.READS}, got {read!r}")
  per_layer = np.bincount(np.asarray(state.group_of, np.int64), minlength=state.n_groups)
  total = np.zeros(state.route.shape[:1], np.float64)
  page = state.page
  for ts, pages, length, pool in zip(state.spec, state.pages, state.length, state.pools):
    n_t = pages.shape[-1] if pool.ang.shape[1] else 0
    n = np.asarray(length, np.float64)                                   # [G, B, H]
    if read == "angles":
      b = pcache.paged_read_bytes(n, n_t, page, ts.bytes, granularity)
    else:
      dense_row = 4 * ts.d
      rebuild = n_t * page * (ts.bytes + dense_row) + n_t * pcache.TABLE_ENTRY_BYTES
      attend = pcache.paged_read_bytes(n, n_t, page, dense_row, granularity)
      b = rebuild + attend + (dense_row if granularity == "page" else 0.0)
    total += np.sum(per_layer[:, None, None] * b, axis=(0, 2))
  return total


def hbm_bytes(state: SphState, cache, *, param_bytes: float = 0.0, batch: int | None = None,
              granularity: str = "row", read: str = "angles") -> np.ndarray:
  """HBM bytes per generated token of one Spherical KV decode step over (``cache``, ``state``)
  as they stand, per sequence, float64 ``[B]`` (host side): the weights' share and the base
  cache's reads (:func:`pask_jax.cache.hbm_bytes`: window, BF16 pool for sinks and protected
  tokens, the INT4 pool, their tables) plus the tiers' (:func:`tier_hbm_bytes`).  Divide by
  :func:`pask_jax.cache.dense_hbm_bytes` of the same tokens for b_HBM."""
  base = pcache.hbm_bytes(cache, param_bytes=param_bytes, batch=batch, granularity=granularity)
  return base + tier_hbm_bytes(state, granularity=granularity, read=read)


__all__ = ["SphRows", "SphState", "assign_pages", "base_actions", "dense_route",
           "evict_step", "hbm_bytes", "init", "normalize_route", "prefill_rows", "rebuild_tier",
           "resident_bytes", "sph_inputs", "tier_hbm_bytes", "tier_metadata_bytes", "write_prefill"]
