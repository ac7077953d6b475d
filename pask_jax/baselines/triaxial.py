"""TriAxialKV (Shen et al., 2026) as the PASK paper reproduces it text-only (C.3): precision by
semantic tag under a KV budget, with a protected prefix and a protected recent tail.

* **Axes.**  Every stored (token, layer, KV head) entry has one precision: BF16, or the ``high`` /
  ``low`` width of the knob pair (INT2/3/4/8, :mod:`pask_jax.baselines.quant`).  The first
  ``prefix`` tokens and the last ``window`` tokens stay BF16; every older token is stored at the
  width its semantic tag was allocated in its layer group.  Tags are the parser's: a prompt token
  carries its prompt-span labels (the PASK prefill stage's), a generated token the FC adapter's
  structural tag candidates (:mod:`pask_jax.tags`).  A token with several candidates takes the
  widest of their widths (Eq. 12's max, conservative); an id never seen in calibration falls back
  along the parent chain to the widest width among the observed ids under that parent, and to
  ``high`` when none is.
* **Calibration** (``calibrate.triaxial``, calibration split only): Full-KV reference trajectories;
  per unit = (tag id, layer group) and width, the attention-output distortion of storing that
  tag's tokens at that width (:func:`distortion`: Runtime-D's Eq. 7 numerator, decode queries,
  the storage rule above per query).  **Allocation** (:func:`allocate`): every unit starts at
  ``high``; units move to ``low`` in increasing order of distortion added per bit saved until the
  predicted B of the references is within the target.  The allocation is a small JSON (kept in
  knobs.json by ``pask-jax tune``) frozen before test evaluation.
* **Runner** (:class:`TriaxialRunner`): a dense float32 cache holding quantize→dequantize values
  (as MiKV's masked runner) and a per-layer, per-KV-head, per-token width map.  After prefill the
  prompt is stored by the map; at every decode step the token leaving the tail takes its width.
  Measured B = Σ entry bits (codes + fp16 scales, :func:`quant.entry_bits`) / Full-KV bits at the
  end of the request; for the INT4 width this is exactly PASK's m(L).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pask_jax import kv_dense
from pask_jax import mesh as tp
from pask_jax import recycle
from pask_jax.traces import Traces
from pask_jax import tags as T
from pask_jax.baselines import quant as Q
from pask_jax.decode import Runner

# Paper Table 8.
GRID = {"prefix": [4, 8, 16, 32], "bits": [[2, 4], [3, 4], [4, 4], [2, 8]],
        "window": [32, 128, 256]}
KNOB_NAMES = ("prefix", "bits", "window")
# Also accepted in the method's knobs: what tune adds, and the reference-set size.
EXTRA_KEYS = ("gen", "allocation", "cal_cases")
TOL = 0.01   # a target the all-low floor misses by more than this is refused


@dataclasses.dataclass(frozen=True)
class Knobs:
  prefix: int = 4
  low: int = 2
  high: int = 4
  window: int = 32

  def __post_init__(self):
    isint = lambda x: isinstance(x, (int, np.integer)) and not isinstance(x, bool)
    if not isint(self.prefix) or self.prefix < 0:
      raise ValueError(f"triaxial prefix must be an integer >= 0, got {self.prefix!r}")
    if not isint(self.window) or self.window < 1:
      raise ValueError(f"triaxial window must be an integer >= 1, got {self.window!r}")
    for w in (self.low, self.high):
      if w not in Q.WIDTHS or not isint(w):
        raise ValueError(f"triaxial bits must be a (low, high) pair from {Q.WIDTHS}, "
                         f"got ({self.low!r}, {self.high!r})")
    if self.low > self.high:
      raise ValueError(f"triaxial bits (low, high) need low <= high, got ({self.low}, {self.high})")

  @classmethod
  def parse(cls, d: dict | None) -> "Knobs":
    """From a knobs dict ``{"prefix": P, "bits": [low, high], "window": W}`` (missing: defaults)."""
    d = dict(d or {})
    bad = sorted(set(d) - set(KNOB_NAMES) - set(EXTRA_KEYS))
    if bad:
      raise ValueError(f"unknown triaxial knob(s) {', '.join(bad)}; known: "
                       f"{', '.join(KNOB_NAMES + EXTRA_KEYS)}")
    bits = d.get("bits", [cls.low, cls.high])
    if not (isinstance(bits, (list, tuple)) and len(bits) == 2):
      raise ValueError(f"triaxial bits must be a (low, high) pair, got {bits!r}")
    return cls(d.get("prefix", cls.prefix), bits[0], bits[1], d.get("window", cls.window))

  def asdict(self) -> dict:
    return {"prefix": self.prefix, "bits": [self.low, self.high], "window": self.window}


# --- costs ---------------------------------------------------------------------------------------

def group_costs(n_layers: int, n_kv_heads: int, head_dim: int, n_groups: int = 3) -> np.ndarray:
  """``float64[17, G]``: bits of one token in layer group g stored at width w (index w; 0 = not
  stored), over the group's layers and KV heads."""
  per = np.array([len(range(lo, hi)) for lo, hi in T.layer_groups(n_layers, n_groups)], float)
  out = np.zeros((Q.BF16 + 1, n_groups))
  for w in Q.WIDTHS + (Q.BF16,):
    out[w] = Q.entry_bits(w, head_dim) * n_kv_heads * per
  return out


def entry_costs(head_dim: int) -> np.ndarray:
  """``float64[17]``: bits of one (token, layer, KV head) entry at width w (0 = not stored)."""
  out = np.zeros(Q.BF16 + 1)
  for w in Q.WIDTHS + (Q.BF16,):
    out[w] = Q.entry_bits(w, head_dim)
  return out


# --- tag table -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _chains() -> dict[int, list[int]]:
  return {i: T.parents(i) for i in T.all_ids()}


def table(units: dict[int, list[int]], high: int, n_groups: int) -> np.ndarray:
  """``int8[N_IDS, G]`` width per tag id and group: an allocated id its own widths; another id the
  widest width among allocated ids under its nearest parent that has any; else ``high``."""
  out = np.full((T.N_IDS, n_groups), high, np.int8)
  agg: dict[int, np.ndarray] = {}
  for i, w in units.items():
    for a in T.parents(int(i)):
      agg[a] = np.maximum(agg.get(a, np.zeros(n_groups, np.int8)), np.asarray(w, np.int8))
  for i, chain in _chains().items():
    for a in chain:
      if a in agg:
        out[i] = agg[a]
        break
  for i, w in units.items():
    out[int(i)] = w
  return out


def resolve(tab, cands, high: int):
  """Widths ``[..., G]`` of tokens with candidates ``cands int[..., N_CAND]``: the widest over
  valid (>= 0) candidates, ``high`` where none is valid.  numpy or jnp."""
  xp = jnp if isinstance(tab, jax.Array) or isinstance(cands, jax.Array) else np
  valid = cands >= 0
  w = tab[xp.clip(cands, 0, T.N_IDS - 1)]                        # [..., N_CAND, G]
  w = xp.where(valid[..., None], w, 0).max(axis=-2)
  return xp.where(valid.any(axis=-1)[..., None], w, high).astype(np.int8)


# --- allocation ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Refs:
  """The calibration references as the cost prediction sees them: the distinct tag-candidate rows
  of the tokens stored at their tag's width at the end of their request and how many tokens have
  each, and the count of all tokens and of those stored BF16 (the protected prefix and tail)."""
  cands: np.ndarray        # int32[N, N_CAND], distinct rows
  weight: np.ndarray       # int64[N]: tokens per row
  n_tokens: int
  n_protected: int

  @classmethod
  def of(cls, seqs: list[np.ndarray], prefix: int, window: int) -> "Refs":
    """``seqs``: per reference request, the candidates ``int32[n, N_CAND]`` of all its tokens."""
    keep, prot, n_all = [], 0, 0
    for c in seqs:
      n = len(c)
      t = np.arange(n)
      p = (t < prefix) | (t >= n - window)
      keep.append(np.asarray(c, np.int32)[~p])
      prot += int(p.sum())
      n_all += n
    cands = np.concatenate(keep) if keep else np.zeros((0, T.N_CAND), np.int32)
    rows, weight = np.unique(cands, axis=0, return_counts=True)
    return cls(rows.reshape(-1, T.N_CAND).astype(np.int32), weight.astype(np.int64), n_all, prot)


def predict_b(tab: np.ndarray, refs: Refs, costs: np.ndarray, high: int) -> float:
  """End-of-request B of the references under the width table ``tab [N_IDS, G]``."""
  full = costs[Q.BF16].sum()
  w = resolve(tab, refs.cands, high)                            # [N, G]
  bits = (costs[w, np.arange(costs.shape[1])].sum(axis=1) * refs.weight).sum()
  return float((refs.n_protected * full + bits) / (refs.n_tokens * full))


def single(cands: np.ndarray) -> np.ndarray:
  """The only valid candidate of each token, or -1 (none, or several distinct ones)."""
  c = np.asarray(cands)
  valid = c >= 0
  first = np.where(valid, c, np.iinfo(np.int32).max).min(axis=-1)
  last = np.where(valid, c, -1).max(axis=-1)
  return np.where(valid.any(axis=-1) & (first == last), first, -1).astype(np.int32)


def allocate(d: dict, refs: Refs, knobs: Knobs, budget: float, costs: np.ndarray) -> dict:
  """Greedy budget-constrained allocation.

  ``d[(tag id, group, width)]``: distortion of storing that tag's tokens at that width (summed over
  the references; only ``low`` and ``high`` are read).  Units (tag, group) start at ``high`` and
  move to ``low`` in increasing order of Δdistortion / bits saved (ties: tag id, group) until the
  predicted B of ``refs`` is at most ``budget``.  A budget that even all-``low`` misses by more
  than :data:`TOL` is a ValueError.  Returns the allocation record (JSON-able)."""
  lo, hi = knobs.low, knobs.high
  G = costs.shape[1]
  ids = sorted({i for i, _, _ in d})
  units = {i: [hi] * G for i in ids}
  n_single = collections.Counter()
  for u, c in zip(single(refs.cands).tolist(), refs.weight.tolist()):
    n_single[u] += c
  pred = lambda: predict_b(table(units, hi, G), refs, costs, hi)
  top = b = pred()
  floor = predict_b(table({i: [lo] * G for i in ids}, hi, G), refs, costs, hi)
  if floor > budget + TOL:
    raise ValueError(
        f"triaxial cannot reach B={budget:g}: the {knobs.prefix}-token prefix and {knobs.window}-"
        f"token tail in BF16 with every tag at INT{lo} already cost B={floor:.3f} on the "
        f"calibration references; use a smaller prefix/window or lower bits")
  order = []
  for i in ids:
    for g in range(G):
      saved = n_single[i] * (costs[hi, g] - costs[lo, g])
      if saved > 0:
        order.append(((d[(i, g, lo)] - d[(i, g, hi)]) / saved, i, g))
  order.sort()
  steps = 0
  for _, i, g in order:
    if b <= budget:
      break
    units[i][g] = lo
    b = pred()
    steps += 1
  # element-weighted average stored precision (code bits; a group's elements ∝ its BF16 cost)
  elems = costs[Q.BF16] / Q.BF16
  w = resolve(table(units, hi, G), refs.cands, hi).astype(float)
  bits = ((w * elems).sum(axis=1) * refs.weight).sum() + refs.n_protected * Q.BF16 * elems.sum()
  return {"knobs": knobs.asdict(), "budget": float(budget), "n_groups": G,
          "units": {str(i): [int(x) for x in units[i]] for i in ids},
          "tags": {str(i): T.describe(i) for i in ids},
          "demoted": steps, "predicted_B": float(b), "floor_B": float(floor), "top_B": float(top),
          "avg_bits": float(bits / (refs.n_tokens * elems.sum())) if refs.n_tokens else
          float("nan"),
          "distortion": {f"{i}/{g}/{w}": float(v) for (i, g, w), v in sorted(d.items())}}


def matches(alloc: dict | None, knobs: Knobs, budget: float) -> bool:
  """Whether a frozen allocation was made for these knobs and this target B."""
  return (isinstance(alloc, dict) and alloc.get("knobs") == knobs.asdict()
          and abs(float(alloc.get("budget", -1)) - budget) < 1e-9)


def layer_table(alloc: dict, n_layers: int) -> np.ndarray:
  """``int8[N_IDS, L]`` width per tag id and layer of an allocation record."""
  kn = Knobs.parse(alloc["knobs"])
  G = int(alloc["n_groups"])
  tab = table({int(i): w for i, w in alloc["units"].items()}, kn.high, G)
  return tab[:, list(T.group_of_layer(n_layers, G))]


# --- Runtime-D for widths ------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("widths", "group_of", "n_groups", "U"))
def _distortion(q, k, v, unit_of, unit, wi, u_lo, u_hi, n, prefix, window, *, widths, group_of,
                n_groups, U):
  """q [L, T, Hq, D], k/v [L, T, Hkv, D], unit_of int [T] (a token's unit, -1 none), unit/wi int
  [A] (intervention: that unit's tokens at ``widths[wi]``) -> D [A, G] float32."""
  L, Tn, Hq, D = q.shape
  Hkv = k.shape[2]
  g = Hq // Hkv
  t = jnp.arange(Tn)
  u = u_lo + jnp.arange(U)
  q = jax.lax.dynamic_slice_in_dim(q, u_lo, U, axis=1)
  qmask = u < u_hi
  vis = (t[None, :] <= u[:, None]) & (t[None, :] < n)
  old = vis & (t[None, :] >= prefix) & (t[None, :] <= u[:, None] - window)
  gl = jnp.asarray(group_of, jnp.int32)

  def layer(acc, xs):
    ql, kl, vl, gi = xs
    qf = ql.astype(jnp.float32).reshape(U, Hkv, g, D) * D ** -0.5
    kf, vf = kl.astype(jnp.float32), vl.astype(jnp.float32)
    kq = jnp.stack([Q.qdq(kf, w) for w in widths])                    # [W, T, Hkv, D]
    vq = jnp.stack([Q.qdq(vf, w) for w in widths])
    se = jnp.einsum("ukgd,tkd->kgut", qf, kf)
    sq = jnp.einsum("ukgd,wtkd->wkgut", qf, kq)

    def out(hit, w):                                                   # hit [U, T]
      s = jnp.where(hit, sq[w], se)
      s = jnp.where(vis, s, -jnp.inf)
      p = jax.nn.softmax(s, axis=-1)
      p = jnp.where(jnp.isnan(p), 0.0, p)
      ph = jnp.where(hit, p, 0.0)
      o = jnp.einsum("kgut,tkd->ukgd", p - ph, vf) + jnp.einsum("kgut,tkd->ukgd", ph, vq[w])
      return o.reshape(U, Hq, D)

    ref = out(jnp.zeros((U, Tn), bool), 0)
    hits = old[None] & (unit_of[None, None, :] == unit[:, None, None])   # [A, U, T]
    o = jax.vmap(out)(hits, wi)
    dd = jnp.max(jnp.sum((o - ref[None]) ** 2, axis=-1), axis=-1)        # [A, U]
    dd = jnp.sum(jnp.where(qmask[None], dd, 0.0), axis=-1)
    return acc.at[:, gi].add(dd), None

  acc = jnp.zeros((unit.shape[0], n_groups), jnp.float32)
  acc, _ = jax.lax.scan(layer, acc, (q, k, v, gl))
  return acc


def distortion(q, k, v, unit_of: np.ndarray, n_prompt: int, *, prefix: int, window: int,
               widths: tuple[int, ...], n_units: int, group_of: tuple[int, ...], n_groups: int,
               U: int | None = None, chunk: int = 32) -> np.ndarray:
  """``D [n_units, len(widths), G]`` for one reference request: Eq. 7's numerator (Σ over decode
  queries u >= ``n_prompt`` and the layers of each group of max over query heads of
  ‖o_exact − o‖²) when the tokens of one unit (``unit_of [n]``) older than the query's
  ``window``-token tail and not in the ``prefix`` are stored at one width, all else exact.
  ``U``: decode queries per call (default: this request's, rounded up to 32); the key axis is
  padded to a power of two, so a reference set compiles a handful of shapes."""
  n = q.shape[1]
  n_dec = n - n_prompt
  out = np.zeros((n_units, len(widths), n_groups), np.float32)
  if n_dec <= 0 or n_units == 0:
    return out
  U = max(U or 0, -(-n_dec // 32) * 32, 32)
  Tn = 1 << max(7, (max(n, n_prompt + U) - 1).bit_length())
  pad = lambda x: jnp.pad(x, ((0, 0), (0, Tn - n)) + ((0, 0),) * (x.ndim - 2))
  uo = np.full(Tn, -1, np.int32)
  uo[:n] = unit_of
  pairs = [(a, w) for a in range(n_units) for w in range(len(widths))]
  qp, kp, vp = pad(q), pad(k), pad(v)
  for s in range(0, len(pairs), chunk):
    part = pairs[s:s + chunk]
    unit = np.full(chunk, -2, np.int32)
    wi = np.zeros(chunk, np.int32)
    unit[:len(part)] = [a for a, _ in part]
    wi[:len(part)] = [w for _, w in part]
    d = np.asarray(_distortion(qp, kp, vp, jnp.asarray(uo), jnp.asarray(unit), jnp.asarray(wi),
                               n_prompt, n, n, prefix, window, widths=tuple(widths),
                               group_of=tuple(group_of), n_groups=n_groups, U=U))
    for j, (a, w) in enumerate(part):
      out[a, w] = d[j]
  return out


# --- runner --------------------------------------------------------------------------------------

class State(NamedTuple):
  cache: kv_dense.DenseCache   # float32 K/V (quantized entries hold their dequantized values)
  width: jax.Array             # [L, B, Hkv, S] int8: stored width per entry (16 BF16, 0 none)
  tags: jax.Array              # [B, S, N_CAND] int32: each position's tag candidates
  table: jax.Array             # [N_IDS, L] int8: width per tag id and layer
  prefix: jax.Array            # [] int32
  window: jax.Array            # [] int32
  high: jax.Array              # [] int8
  n_prompt: jax.Array          # [B] int32
  n_gen: jax.Array             # [B] int32


def _store(x, w):
  """x [..., D] float32 with per-row widths w [...] -> the stored (dequantized) rows."""
  out = x
  for b in Q.WIDTHS:
    out = jnp.where((w == b)[..., None], Q.qdq(x, b), out)
  return out


class TriaxialRunner:
  """Session protocol of :func:`pask_jax.decode.generate` with tag-allocated precision; call
  :meth:`configure` with the knobs and a frozen allocation first."""

  def __init__(self, model: nnx.Module, *, batch: int, capacity: int,
               mesh: jax.sharding.Mesh | None = None, shard_vocab: bool = True):
    """``mesh``: tensor parallelism over a 1-D ``model`` mesh (as :class:`Runner`): the K/V and
    the width map by KV head (widths are per tag and layer, the same for every head), tags,
    table and counters replicated."""
    self.cfg = model.cfg
    self.tp_mesh, self.graphdef, self.params = tp.prepare(model, mesh, shard_vocab=shard_vocab)
    self.batch, self.capacity = batch, capacity
    self.knobs: Knobs | None = None
    self.tab: np.ndarray | None = None
    self.costs = entry_costs(self.cfg.head_dim)
    self.traces = Traces()
    self.prefill, self.compress, self.step, self.select = tp.compressing_jits(
        (self._prefill, self._compress, self._step, self._select), self.tp_mesh, self.params,
        self.state_sharding, shard_vocab=shard_vocab, step_inputs=7,
        logits=recycle.logits_like(batch, self.cfg.vocab_size))

  _select = Runner._select   # the grammar mask (per vocabulary shard on a mesh), then sampling

  def state_sharding(self) -> State:
    """The state's shardings on the mesh (K/V and widths by KV head, the rest replicated)."""
    m = self.tp_mesh
    kv, rep = tp.by_kv_head(m, 5, 3), tp.replicated(m)
    return State(kv_dense.DenseCache(kv, kv, rep), tp.by_kv_head(m, 4, 2), *(rep,) * 7)

  def configure(self, knobs: Knobs, alloc: dict) -> "TriaxialRunner":
    if Knobs.parse(alloc["knobs"]) != knobs:
      raise ValueError(f"allocation made for {alloc['knobs']}, not {knobs.asdict()}")
    self.knobs, self.tab = knobs, layer_table(alloc, self.cfg.n_layers)
    return self

  def new_state(self, prompt_tags, lengths) -> State:
    if self.knobs is None:
      raise RuntimeError("TriaxialRunner.configure(knobs, allocation) first")
    c, B, S = self.cfg, self.batch, self.capacity
    tags = np.full((B, S, T.N_CAND), T.PAD, np.int32)
    for b, t in enumerate(prompt_tags or []):
      if t is not None:
        n = min(len(t), int(lengths[b]))
        tags[b, :n] = np.asarray(t, np.int32)[:n]
    kn = self.knobs

    def make(tags, tab):
      cache = kv_dense.init(c.n_layers, B, S, c.n_kv_heads, c.head_dim, jnp.float32)
      z = jnp.zeros((B,), jnp.int32)
      return State(cache, jnp.zeros((c.n_layers, B, c.n_kv_heads, S), jnp.int8), tags, tab,
                   jnp.int32(kn.prefix), jnp.int32(kn.window), jnp.int8(kn.high), z, z)
    if self.tp_mesh is None:
      return make(jnp.asarray(tags), jnp.asarray(self.tab))
    # each device makes its own KV heads' zeros (the full arrays never sit on one device)
    return jax.jit(make, out_shardings=self.state_sharding())(tags, self.tab)

  def _prefill(self, params, st: State, tokens, start, lengths):
    self.traces["prefill"] += 1
    model = nnx.merge(self.graphdef, params)
    B, Tc = tokens.shape
    pos = jnp.broadcast_to(start + jnp.arange(Tc, dtype=jnp.int32), (B, Tc))
    n = lengths.astype(jnp.int32)
    last = jnp.clip(n - 1 - start, 0, Tc - 1)
    logits, cache = model(tokens, pos, st.cache._replace(length=n), kv_dense.attend,
                          last_only=last)
    return logits[:, 0], st._replace(cache=cache, n_prompt=n)

  def _compress(self, st: State) -> State:
    """After prefill: the prompt stored by the width map (prefix and tail BF16)."""
    self.traces["compress"] += 1
    L, B, Hkv, S = st.width.shape
    n = st.n_prompt
    slot = jnp.arange(S)
    w = resolve(st.table, st.tags, st.high)                           # [B, S, L]
    prot = (slot[None] < st.prefix) | (slot[None] >= n[:, None] - st.window)
    w = jnp.where(prot[..., None], jnp.int8(Q.BF16), w)
    w = jnp.where((slot[None] < n[:, None])[..., None], w, jnp.int8(0))
    width = jnp.broadcast_to(jnp.transpose(w, (2, 0, 1))[:, :, None], (L, B, Hkv, S))
    ws = jnp.swapaxes(width, 2, 3)                                     # [L, B, S, Hkv]
    cache = st.cache._replace(k=_store(st.cache.k, ws), v=_store(st.cache.v, ws))
    return st._replace(cache=cache, width=width)

  prefill_chunks = Runner.prefill_chunks   # the Full-KV runner's chunk loop (calls self.prefill)

  def prefill_all(self, st: State, tokens: np.ndarray, lengths: np.ndarray):
    logits, st = Runner.prefill_all(self, st, tokens, lengths)
    return logits, self.compress(st)

  def _step(self, params, st: State, tokens, tag_ids, active, bits, key, temperature, top_p,
            how=None):
    """One token per sequence: record its tags, store it BF16, move the token leaving the tail to
    its width, attend over everything stored; then the sampler (``how``, static:
    :meth:`pask_jax.decode.Runner._step`'s)."""
    self.traces["step"] += 1
    model = nnx.merge(self.graphdef, params)
    B = self.batch
    bi = jnp.arange(B)
    pos = st.n_prompt + st.n_gen                                       # slot of the new token
    tags = st.tags.at[bi, pos].set(jnp.where(active[:, None], tag_ids, st.tags[bi, pos]),
                                   mode="drop")
    j = pos - st.window                                                # leaves the tail now
    demote = active & (j >= st.prefix) & (j >= 0)
    jc = jnp.maximum(j, 0)
    wj = resolve(st.table, tags[bi, jc], st.high)                      # [B, L]

    def attend(st, layer, q, k, v, positions):
      c = st.cache
      rw = jnp.where(demote, wj[:, layer], jnp.int8(Q.BF16))[:, None]  # [B, 1]

      def write(x, new):                  # x [L, B, S, Hkv, D]: the new row, then the demoted one
        x = x.at[layer, bi, pos].set(
            jnp.where(active[:, None, None], new[:, 0].astype(jnp.float32), x[layer, bi, pos]),
            mode="drop")
        row = x[layer, bi, jc]
        return x.at[layer, bi, jc].set(jnp.where(demote[:, None, None], _store(row, rw), row))

      kc, vc = write(c.k, k), write(c.v, v)
      wl = st.width[layer]
      wl = wl.at[bi, :, pos].set(jnp.where(active[:, None], jnp.int8(Q.BF16), wl[bi, :, pos]),
                                 mode="drop")
      wl = wl.at[bi, :, jc].set(jnp.where(demote[:, None], rw, wl[bi, :, jc]))
      o = kv_dense.attention(q, kc[layer], vc[layer], pos[:, None], pos + 1)
      return o.astype(q.dtype), st._replace(cache=c._replace(k=kc, v=vc),
                                           width=st.width.at[layer].set(wl))

    logits, st = model(tokens[:, None], pos[:, None], st._replace(tags=tags), attend)
    st = st._replace(n_gen=st.n_gen + active.astype(jnp.int32))
    logits = logits[:, 0]
    return self._select(logits, bits, key, temperature, top_p, how), logits, st

  # --- the session protocol used by generate() ------------------------------------------------

  def begin(self, tokens: np.ndarray, lengths: np.ndarray, prompt_tags=None):
    return self.prefill_all(self.new_state(prompt_tags, lengths), tokens, lengths)

  def advance(self, st, tokens, tag_ids, state_ids, active, bits, key, temperature, top_p,
              how=None):
    nxt, _, st = self.advance_logits(st, tokens, tag_ids, state_ids, active, bits, key,
                                     temperature, top_p, how)
    return nxt, st

  def advance_logits(self, st, tokens, tag_ids, state_ids, active, bits, key, temperature,
                     top_p, how=None):
    """:meth:`advance` that also returns the step's logits ``[B, V]`` -> (next, logits, state):
    the forced-token path (feed given tokens, score them: W1 of :mod:`calibrate.longctx`).
    On one GPU the logits are valid until the next step (:mod:`pask_jax.recycle`).  ``how``:
    the sampler's static branches, :func:`pask_jax.sample.how_of` of ``temperature`` and
    ``top_p`` (None: chosen on the device, :func:`pask_jax.sample.sample`)."""
    return self.step(self.params, st, tokens, tag_ids, active, bits, key, temperature, top_p,
                     how)

  def report(self, st: State) -> list[dict]:
    """Per request: stored bits by the width map (end of request), measured B and the
    element-weighted average stored precision."""
    width = np.asarray(st.width)
    npf, ngn = np.asarray(st.n_prompt), np.asarray(st.n_gen)
    L, B, Hkv, S = width.shape
    full = self.costs[Q.BF16]
    out = []
    for b in range(B):
      p, g = int(npf[b]), int(ngn[b])
      w = width[:, b, :, :p + g]
      per_pos = self.costs[w].sum(axis=(0, 1))
      pb, gb = float(per_pos[:p].sum()), float(per_pos[p:].sum())
      ratio = lambda x, y: x / y if y else float("nan")
      per = L * Hkv * full
      out.append({"n_prompt": p, "n_gen": g, "prefill_bits": pb, "decode_bits": gb,
                  "full_kv_bits": (p + g) * per, "prefill_B": ratio(pb, p * per),
                  "decode_B": ratio(gb, g * per), "measured_B": ratio(pb + gb, (p + g) * per),
                  "avg_bits": ratio(float(w.astype(np.float64).sum()), w.size),
                  "widths": {str(k): int((w == k).sum()) for k in (Q.BF16,) + Q.WIDTHS}})
    return out

