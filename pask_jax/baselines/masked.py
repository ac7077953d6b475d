"""A dense-cache runner with per-layer, per-KV-head keep / INT4 masks: H2O, SnapKV and MiKV.

These methods need attention statistics, which PASK's fused kernels do not emit.  They come from
the **reference attention path**: prefill and every decode step compute attention with jnp
einsums over the dense cache (as :mod:`pask_jax.kv_dense`, FP32 math), materializing the softmax
probabilities, and the probabilities each key receives are accumulated per (layer, KV head):

* prefill — column sums of the probabilities weighted by the query mask (all prompt queries for
  H2O/MiKV, the last ``obs`` ones for SnapKV), computed in blocks of :data:`QUERY_BLOCK` queries
  (:func:`_attend_blocks`): one [B, Hkv, G, QUERY_BLOCK, S] probability tensor at a time;
* decode — the [B, Hkv, G, S] probabilities of the step summed over G and added to an f32 score
  buffer ``[L, B, Hkv, S]``, then one argmin over S per (layer, sequence, head) and a scatter
  (plus, for MiKV, the quantize→dequantize of at most one K and one V row per head).

Cost: attention reads the whole dense capacity every step (no fused kernel, no skipping of evicted
slots), plus ~6 bytes per (layer, sequence, head, slot) of masks and scores; K/V are stored in
float32 so that INT4-simulated rows hold the dequantized values exactly.  Wall time of these runs
is therefore not comparable with PASK's kernels; accuracy and measured B are.

Evicted entries are masked out of attention (their slots stay allocated); INT4 entries hold
``dequant(quant(x))`` with :func:`pallas_kernels.int4.quantize` (per (token, head) row, fp16
scale).  The method and all its knobs are traced arrays (:class:`Rule`), so one compilation serves
every method, budget and tuning configuration of a run.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import int4
from pask_jax import mesh as tp
from pask_jax import recycle
from pask_jax.baselines import budget, h2o, mikv, rocketkv, snapkv
from pask_jax.decode import Runner
from pask_jax.traces import Traces

KINDS = {"h2o": 0, "snapkv": 1, "mikv": 2, "rocketkv": 3}
ROCKET_ONLY = ("read_frac", "top_r")   # Config fields only RocketKV reads
# Prompt queries per prefill attention block.  One chunk's [B, Hkv, G, T, S] float32 probabilities
# outweigh the whole cache at evaluation sizes (Qwen2.5-0.5B at B 100, S 3072, T 512: 8.2 GiB per
# layer, the cache 7 GiB), and a layer's column sums feed no later layer, so a scheduler may keep
# many layers' probabilities alive at once (XLA's GPU scheduler does, with per-layer weights:
# 122 GiB).  Inside a loop over query blocks only a few block-sized tensors exist, on any scheduler.
QUERY_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class Config:
  """A masked method with its knobs (host side).

  ``ratio``: H2O's capacity ratio r / MiKV's high ratio h / RocketKV's prompt ratio (see
  :func:`plan`); ``target``: the B SnapKV aims at; ``gen``: expected generated tokens (SnapKV's
  prompt capacity); ``read_frac`` / ``top_r``: RocketKV's decode read budget (a fraction of its
  prompt capacity) and scored key channels (a fraction of the head dimension).
  """
  method: str
  ratio: float = 1.0
  target: float = 1.0
  sink: int = 4
  recent: int = 32
  obs: int = 32
  kernel: int = 7
  pool: str = "max"
  gen: float = 48.0
  read_frac: float = rocketkv.READ_FRAC
  top_r: float = rocketkv.TOP_R

  def __post_init__(self):
    if self.method not in KINDS:
      raise ValueError(f"unknown masked method {self.method!r}; choose from {sorted(KINDS)}")
    if self.pool not in ("avg", "max"):
      raise ValueError(f"pool must be avg or max, got {self.pool!r}")
    if self.method == "rocketkv" and self.pool != "max":
      raise ValueError("rocketkv pools its votes by max only, got pool 'avg'")
    if not (0.0 < self.read_frac and 0.0 < self.top_r <= 1.0):
      raise ValueError(f"read_frac must be > 0 and top_r in (0, 1], got {self.read_frac} and "
                       f"{self.top_r}")
    top = snapkv.MAX_KERNEL if self.pool == "max" else snapkv.AVG_KERNEL
    if self.kernel % 2 == 0 or not 1 <= self.kernel <= top:
      raise ValueError(f"kernel must be odd and <= {top} with {self.pool} pooling, got "
                       f"{self.kernel}")


class Rule(NamedTuple):
  """Traced per-request knobs ([B] each, ``kind`` a scalar)."""
  kind: jax.Array
  sink: jax.Array
  recent: jax.Array
  ratio: jax.Array
  obs: jax.Array
  kernel: jax.Array
  is_max: jax.Array
  cap: jax.Array
  read: jax.Array      # RocketKV: entries a decode step reads per KV head
  top_r: jax.Array     # RocketKV: key channels its sketch scores


class State(NamedTuple):
  k: jax.Array         # [L, B, S, Hkv, D] float32
  v: jax.Array
  keep: jax.Array      # [L, B, Hkv, S] bool: entry retained (visible)
  low: jax.Array       # [L, B, Hkv, S] bool: entry holds INT4 (dequantized) values
  score: jax.Array     # [L, B, Hkv, S] float32: accumulated attention received
  length: jax.Array    # [B] int32: tokens written
  n_prompt: jax.Array  # [B] int32
  n_gen: jax.Array     # [B] int32: generated tokens whose K/V entered the cache
  rule: Rule


def qdq(x):
  """quantize -> dequantize with PASK's INT4 quantizer (float32 out)."""
  codes, s = int4.quantize(x)
  return codes.astype(jnp.float32) * s[..., None].astype(jnp.float32)


def _demote_rows(k, v, layer, j, dq):
  """k, v [L, B, S, Hkv, D]: row ``j [B, Hkv]`` of each (sequence, head) of ``layer`` replaced by
  its INT4 values where ``dq [B, Hkv]``."""
  B, Hkv = j.shape
  at = (layer, jnp.arange(B)[:, None], j, jnp.arange(Hkv)[None])
  krow, vrow = k[at], v[at]
  return (k.at[at].set(jnp.where(dq[..., None], qdq(krow), krow)),
          v.at[at].set(jnp.where(dq[..., None], qdq(vrow), vrow)))


def _probs(q, k, vis):
  """q [B, T, Hq, D], k [B, S, Hkv, D], vis bool [B, Hkv, T, S] -> p [B, Hkv, G, T, S] f32."""
  B, T, Hq, D = q.shape
  Hkv = k.shape[2]
  qg = q.reshape(B, T, Hkv, Hq // Hkv, D).astype(jnp.float32) * D ** -0.5
  s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32))
  s = jnp.where(vis[:, :, None], s, -jnp.inf)
  return jax.nn.softmax(s, axis=-1)


def _out(p, v, q):
  B, T, Hq, D = q.shape
  o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
  return o.reshape(B, T, Hq, D).astype(q.dtype)


def _attend_blocks(q, k, v, vis, wq):
  """Prefill attention over the cache, :data:`QUERY_BLOCK` queries at a time (a scan, so each
  block's probabilities are freed before the next).  q [B, T, Hq, D], k/v [B, S, Hkv, D],
  vis bool [B, T, S], wq [B, T] query weights -> (out [B, T, Hq, D], col [B, Hkv, S] f32 =
  sum over t and the group of wq[t] * p[t, s])."""
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  tb = QUERY_BLOCK if T % QUERY_BLOCK == 0 else T
  blocks = lambda x: jnp.swapaxes(x.reshape((B, T // tb, tb) + x.shape[2:]), 0, 1)

  def block(col, xs):
    qb, vb, wb = xs
    p = _probs(qb, k, jnp.broadcast_to(vb[:, None], (B, Hkv) + vb.shape[1:]))
    return col + jnp.einsum("bkgts,bt->bks", p, wb), _out(p, v, qb)

  col, o = jax.lax.scan(block, jnp.zeros((B, Hkv, S), jnp.float32),
                        (blocks(q), blocks(vis), blocks(wq)))
  return jnp.swapaxes(o, 0, 1).reshape(B, T, Hq, D), col


class MaskedRunner:
  """Session protocol of :func:`pask_jax.decode.generate` over the masked dense cache.

  Call :meth:`configure` with a :class:`Config` before each generation; :meth:`report` gives each
  request's measured B (end-of-request payload, see :mod:`pask_jax.baselines.budget`).
  """

  def __init__(self, model: nnx.Module, *, batch: int, capacity: int,
               mesh: jax.sharding.Mesh | None = None, shard_vocab: bool = True):
    """``mesh``: tensor parallelism over a 1-D ``model`` mesh (as :class:`Runner`): K/V, keep,
    INT4 and score arrays by KV head (every selection here is per (layer, sequence, KV head)),
    lengths and knobs replicated."""
    self.cfg = model.cfg
    self.tp_mesh, self.graphdef, self.params = tp.prepare(model, mesh, shard_vocab=shard_vocab)
    self.batch, self.capacity = batch, capacity
    self.config: Config | None = None
    self.h_bits, self.l_bits = budget.entry_bits(self.cfg.head_dim)
    self.traces = Traces()
    self.prefill, self.compress, self.step, self.select = tp.compressing_jits(
        (self._prefill, self._compress, self._step, self._select), self.tp_mesh, self.params,
        self.state_sharding, shard_vocab=shard_vocab, step_inputs=6,
        logits=recycle.logits_like(batch, self.cfg.vocab_size))

  _select = Runner._select   # the grammar mask (per vocabulary shard on a mesh), then sampling

  def state_sharding(self) -> State:
    """The state's shardings on the mesh (a pytree prefix: the rule's knobs all replicated)."""
    m = self.tp_mesh
    kv, mask, rep = tp.by_kv_head(m, 5, 3), tp.by_kv_head(m, 4, 2), tp.replicated(m)
    return State(kv, kv, mask, mask, mask, rep, rep, rep, rep)

  def configure(self, config: Config) -> "MaskedRunner":
    self.config = config
    return self

  # --- state -----------------------------------------------------------------------------------

  def rule(self, lengths: np.ndarray) -> Rule:
    c, B = self.config, self.batch
    if c is None:
      raise RuntimeError("MaskedRunner.configure(Config(...)) first")
    full = lambda x, dt: jnp.full((B,), x, dt)
    if c.method == "rocketkv":
      cap = [rocketkv.prompt_cap(c.ratio, int(n), c.obs) for n in lengths]
    else:
      cap = [snapkv.prompt_cap(c.target, int(n), c.obs, c.gen) for n in lengths]
    read = [rocketkv.read_budget(x, c.read_frac) for x in cap]
    top_r = max(1, int(round(c.top_r * self.cfg.head_dim)))
    return Rule(jnp.int32(KINDS[c.method]), full(c.sink, jnp.int32), full(c.recent, jnp.int32),
                full(c.ratio, jnp.float32), full(c.obs, jnp.int32), full(c.kernel, jnp.int32),
                full(c.pool == "max", bool), jnp.asarray(cap, jnp.int32),
                jnp.asarray(read, jnp.int32), full(top_r, jnp.int32))

  def new_state(self, lengths: np.ndarray) -> State:
    c, B, S = self.cfg, self.batch, self.capacity
    kv = (c.n_layers, B, S, c.n_kv_heads, c.head_dim)
    m = (c.n_layers, B, c.n_kv_heads, S)
    rule = self.rule(lengths)

    def make():
      z = jnp.zeros((B,), jnp.int32)
      return State(jnp.zeros(kv, jnp.float32), jnp.zeros(kv, jnp.float32), jnp.zeros(m, bool),
                   jnp.zeros(m, bool), jnp.zeros(m, jnp.float32), z, z, z, rule)
    if self.tp_mesh is None:
      return make()
    # each device makes its own KV heads' zeros (the full arrays never sit on one device)
    return jax.jit(make, out_shardings=self.state_sharding())()

  # --- prefill ---------------------------------------------------------------------------------

  def _prefill(self, params, st: State, tokens, start, lengths):
    """One prompt chunk at positions start + [0, Tc): full attention, K/V written, attention
    statistics accumulated with the method's query weights."""
    self.traces["prefill"] += 1
    model = nnx.merge(self.graphdef, params)
    B, T = tokens.shape
    pos = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
    n = lengths.astype(jnp.int32)
    r = st.rule
    obs_q = pos >= (n - r.obs)[:, None]
    prompt_only = (r.kind == KINDS["snapkv"]) | (r.kind == KINDS["rocketkv"])
    wq = ((pos < n[:, None]) & (~prompt_only | obs_q)).astype(jnp.float32)
    bi = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    slot = jnp.arange(self.capacity)
    vis = (slot[None, None, :] <= pos[:, :, None]) & (slot[None, None, :] < n[:, None, None])

    def attend(st, layer, q, k, v, positions):
      kc = st.k.at[layer, bi, positions].set(k.astype(jnp.float32), mode="drop")
      vc = st.v.at[layer, bi, positions].set(v.astype(jnp.float32), mode="drop")
      o, col = _attend_blocks(q, kc[layer], vc[layer], vis, wq)
      return o, st._replace(k=kc, v=vc, score=st.score.at[layer].add(col))

    last = jnp.clip(n - 1 - start, 0, T - 1)
    logits, st = model(tokens, pos, st, attend, last_only=last)
    return logits[:, 0], st._replace(length=n, n_prompt=n)

  def _compress(self, st: State) -> State:
    """After prefill: the method's selection over the prompt (evict / demote at once)."""
    self.traces["compress"] += 1
    r, n = st.rule, st.n_prompt
    L, B, Hkv, S = st.score.shape
    bc = lambda x: jnp.broadcast_to(x[None, :, None], (L, B, Hkv))
    ratio = h2o.capacity(r.ratio, n)
    hk = h2o.select(st.score, bc(n), bc(r.sink), bc(r.recent), bc(ratio))
    sk = snapkv.select(st.score, bc(n), bc(r.obs), bc(r.kernel), bc(r.is_max), bc(r.cap))
    valid = jnp.arange(S) < bc(n)[..., None]
    is_mikv = r.kind == KINDS["mikv"]
    prompt_only = (r.kind == KINDS["snapkv"]) | (r.kind == KINDS["rocketkv"])
    keep = jnp.where(prompt_only, sk, jnp.where(is_mikv, valid, hk))
    low = is_mikv & valid & ~hk
    lw = jnp.swapaxes(low, 2, 3)[..., None]                 # [L, B, S, Hkv, 1]
    k = jnp.where(lw, qdq(st.k), st.k)
    v = jnp.where(lw, qdq(st.v), st.v)
    return st._replace(k=k, v=v, keep=keep, low=low)

  prefill_chunks = Runner.prefill_chunks   # the Full-KV runner's chunk loop (calls self.prefill)

  def prefill_all(self, st: State, tokens: np.ndarray, lengths: np.ndarray):
    # The Full-KV runner's chunk loop (it only calls self.prefill), then the prompt compression.
    logits, st = Runner.prefill_all(self, st, tokens, lengths)
    return logits, self.compress(st)

  # --- decode ----------------------------------------------------------------------------------

  def _step(self, params, st: State, tokens, active, bits, key, temperature, top_p, how=None):
    """One token per sequence: write, attend over kept entries, accumulate, evict / demote; then
    the sampler (``how``, static: :meth:`pask_jax.decode.Runner._step`'s)."""
    self.traces["step"] += 1
    model = nnx.merge(self.graphdef, params)
    B, S = self.batch, self.capacity
    r = st.rule
    pos = st.length                                   # slot of the new token
    t = pos + 1                                       # tokens once it is written
    bi = jnp.arange(B)
    slot = jnp.arange(S)
    here = slot[None, :] == pos[:, None]              # [B, S]
    cap = h2o.capacity(r.ratio, t)                    # [B]
    prot = h2o.protected(slot, t, r.sink, r.recent)   # [B, S]
    is_rocket = r.kind == KINDS["rocketkv"]
    evicts = (r.kind != KINDS["snapkv"]) & ~is_rocket & active     # [B]
    is_mikv = r.kind == KINDS["mikv"]

    demote, sketch = _demote_rows, rocketkv.read_mask
    if self.tp_mesh is not None:   # per device: the rows of its own KV heads (no gather)
      kv, by_head = (tp.by_kv_head(self.tp_mesh, n, a).spec for n, a in ((5, 3), (2, 1)))
      rep = jax.sharding.PartitionSpec()
      demote = jax.shard_map(demote, mesh=self.tp_mesh, out_specs=(kv, kv),
                             in_specs=(kv, kv, rep, by_head, by_head))
      # RocketKV's read selection is per (sequence, KV head): each device its own heads'
      q_h, k_h, m_h = (tp.by_kv_head(self.tp_mesh, n, a).spec for n, a in ((4, 1), (4, 2), (3, 1)))
      sketch = jax.shard_map(sketch, mesh=self.tp_mesh, out_specs=m_h,
                             in_specs=(q_h, k_h, m_h, rep, rep, rep))

    def attend(st, layer, q, k, v, positions):
      kc = st.k.at[layer, bi, pos].set(
          jnp.where(active[:, None, None], k[:, 0], st.k[layer, bi, pos]).astype(jnp.float32),
          mode="drop")
      vc = st.v.at[layer, bi, pos].set(
          jnp.where(active[:, None, None], v[:, 0], st.v[layer, bi, pos]).astype(jnp.float32),
          mode="drop")
      keep = st.keep[layer] | (here & active[:, None])[:, None]        # [B, Hkv, S]
      low = st.low[layer]
      vis = (keep | here[:, None]) & (slot <= pos[:, None])[:, None]
      # RocketKV reads a sketch-selected part of what is stored (what it skips stays stored)
      Hkv = vis.shape[1]
      qg = q[:, 0].reshape(B, Hkv, q.shape[2] // Hkv, q.shape[3])
      read = jax.lax.cond(is_rocket, lambda: sketch(qg, kc[layer], vis, pos, r.read, r.top_r),
                          lambda: vis)
      p = _probs(q, kc[layer], read[:, :, None])                         # [B, Hkv, G, 1, S]
      o = _out(p, vc[layer], q)
      score = st.score[layer] + jnp.sum(p[:, :, :, 0], axis=2) * active[:, None, None]
      # One-in/one-out: the lowest-scoring unprotected high entry leaves (H2O) or drops to INT4.
      high = keep & ~low
      cand = high & ~prot[:, None]
      count = jnp.sum(high, axis=-1)                                     # [B, Hkv]
      need = evicts[:, None] & (count > cap[:, None]) & jnp.any(cand, axis=-1)
      j = jnp.argmin(jnp.where(cand, score, jnp.inf), axis=-1)           # [B, Hkv]
      hit = need[..., None] & (slot == j[..., None])                     # [B, Hkv, S]
      keep = keep & ~(hit & ~is_mikv)
      low = low | (hit & is_mikv)
      # MiKV: the demoted rows (one per head at most) get their INT4 values.
      kc, vc = demote(kc, vc, layer, j, need & is_mikv)
      st = st._replace(k=kc, v=vc, keep=st.keep.at[layer].set(keep), low=st.low.at[layer].set(low),
                       score=st.score.at[layer].set(score))
      return o, st

    logits, st = model(tokens[:, None], pos[:, None], st, attend)
    a = active.astype(jnp.int32)
    st = st._replace(length=st.length + a, n_gen=st.n_gen + a)
    logits = logits[:, 0]
    return self._select(logits, bits, key, temperature, top_p, how), logits, st

  # --- the session protocol used by generate() ------------------------------------------------

  def begin(self, tokens: np.ndarray, lengths: np.ndarray, prompt_tags=None):
    return self.prefill_all(self.new_state(lengths), tokens, lengths)

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
    return self.step(self.params, st, tokens, active, bits, key, temperature, top_p, how)

  def report(self, st: State) -> list[dict]:
    """Per request: retained entries (H and INT4) and measured B, prompt / generated / total."""
    keep, low = np.asarray(st.keep), np.asarray(st.low)
    npf, ngn = np.asarray(st.n_prompt), np.asarray(st.n_gen)
    L, B, Hkv, S = keep.shape
    per = L * Hkv * self.h_bits            # Full-KV bits of one token
    out = []
    for b in range(B):
      p, g = int(npf[b]), int(ngn[b])
      hi = (keep[:, b] & ~low[:, b]).sum(axis=(0, 1))   # [S] entries per position
      lo = (keep[:, b] & low[:, b]).sum(axis=(0, 1))
      bits = hi * self.h_bits + lo * self.l_bits
      pb, gb = float(bits[:p].sum()), float(bits[p:p + g].sum())
      ratio = lambda x, y: x / y if y else float("nan")
      out.append({"n_prompt": p, "n_gen": g, "prefill_bits": pb, "decode_bits": gb,
                  "full_kv_bits": (p + g) * per, "prefill_B": ratio(pb, p * per),
                  "decode_B": ratio(gb, g * per), "measured_B": ratio(pb + gb, (p + g) * per),
                  "high_entries": int(hi[:p + g].sum()), "low_entries": int(lo[:p + g].sum())})
    return out


def plan(method: str, target: float, lengths, *, sink: int = 4, recent: int = 32, q: float = 0.0,
         obs: int = 32, gen: float = 48.0) -> float:
  """The budget knob for ``target``: H2O's r / MiKV's h / RocketKV's prompt ratio solved by
  bisection so that the predicted mean B over ``lengths`` [(n_prompt, n_gen)] matches (protected
  sinks/recent, the observation window and rounding included); SnapKV needs none (its per-request
  capacity comes from the target) -> ``target``."""
  target = budget.check_target(target)
  held = f"{sink} sink + {recent} recent protected entries"   # what B 0 of the knob still keeps
  if method == "rocketkv":
    f = lambda r: rocketkv.predict_b(r, lengths, obs)
    held = f"{obs}-token observation window and the generated tokens"
  elif method == "h2o":
    f = lambda r: h2o.predict_b(r, lengths, sink, recent)
  elif method == "mikv":
    mikv.high_ratio(target, q)  # raises below q
    f = lambda r: mikv.predict_b(r, lengths, sink, recent, q)
  elif method == "snapkv":
    return target
  else:
    raise ValueError(f"unknown masked method {method!r}")
  floor = f(0.0)
  if target < floor - 1e-3:
    # what the knob cannot remove already costs more than the target on these lengths: the
    # closest reachable budget is the floor (knob 0), and the caller is told so
    warnings.warn(f"{method}: target B {target:.3f} is below the floor {floor:.3f} set by the "
                  f"{held} on these lengths; using knob 0 (B {floor:.3f})", stacklevel=2)
    return 0.0
  return budget.bisect(f, target)
