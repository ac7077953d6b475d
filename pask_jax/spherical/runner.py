"""Spherical KV end to end (docs/SPHERICAL_KV.md §2.4, §3): prefill with observation-window
statistics, the RDR prefill plan under a traced budget, the tier pools, and a decode step whose
attention is the reference partition over {window, BF16 pool, tiers}.  The session protocol of
:func:`pask_jax.decode.generate` (``begin`` / ``advance`` / ``select`` / ``report``).

What each piece reuses:

* prefill — :class:`pask_jax.baselines.masked.MaskedRunner` configured as SnapKV (full-precision
  attention over a dense scratch cache; column sums of the last ``obs`` prompt queries' attention
  probabilities per (layer, KV head)): its K/V and statistics feed the controller;
* the cache — the unchanged PASK :class:`pask_jax.cache.Cache` (window, BF16 pool for the sinks,
  INT4 pool unused) composed with :class:`pask_jax.spherical.cache.SphState` (the tier pools);
  every visible (token, group, head) lives in exactly one of window, BF16 pool or one tier;
* the plan — :func:`pask_jax.spherical.rdr.solve_batch` with the budget ``rho [B]`` traced (one
  compiled commit and one compiled step serve every budget);
* decode — :func:`pallas_kernels.decode_attention` with ``sph=`` (the "reference" backend by
  default, the GPU or TPU tier kernel with ``backend=``: the tiers' logits by CosFromAngles,
  never a dense key).

Features of the distortion model (§2.4), and what is simplified [ours, this runner]:
``â_i`` = attention mass from the observation window, mean over the group's layers and the KV
head's query heads, max-pooled over ±3 positions; ``ε^θ``, ``ε^r`` measured by encoding every
prompt item at every tier (drop: ``‖·‖² = 2``, ``(r − r̃)² = r²``); the reuse proxy ``û`` and the
stability proxy ``ŝ`` are constants (û = 1, ŝ = 0); the segments are recent (the last 64 prompt
tokens), retrieved (the tokens a workload marks as retrieved evidence: ``prefill(segments=)``,
W2's document) and prefix (the rest), recent winning where both hold; μ (centering) is an
optional argument, 0 by default (no calibration yet).

**Decode rule** ("fixed" with the balance of §2.4): per (sequence, group) a balance gains
``rho · Hkv · dense_g`` per generated token; the new token takes the highest tier whose item cost
(all heads) fits the balance, else it is dropped (down-tier before drop), and the balance pays it.
``decode="gated"`` (§2.4's ``gated`` rule, ablation A5; plan "rdr" only): that choice is only a
reservation while the token is in the window.  Each step the attention mass every window token
receives is accumulated (``SphState.win_att``: the window logits ``q·k/√D`` in XLA against the
kernel's LSE, mean over the group's layers and the KV head's query heads); when a generated token
leaves the window its reservation is refunded and :func:`rdr.gate` places each of its items at
``argmin_t D_i(t) + λ_g C(t)`` — ``â_i`` the mean mass per step in the window (the sum over its
W steps / W), the tier errors measured by encoding the token at every tier as at prefill, the
"recent" weight ω = 2, λ_g the prefill plan's cut — capped so that the (token, group) fits the
balance (down-tier before drop).  Prompt tokens keep the plan's route, and so do protected and
BF16-pool ones.  The new token's reservation is made before the leaving token is gated.

**Variants** (:mod:`pask_jax.spherical.variants`; docs/SPHERICAL_KV.md §4): the ablations and
the hybrids with PASK are settings of this runner — ``plan`` ("rdr", "fixed", "pask"), ``read``
("angles", "reconstruct"), ``tags`` — built by :meth:`SphRunner.for_method`.

**Measured B** (:meth:`SphRunner.report`, PASK's ledger convention): every (token, group, head)
charged by where it is scheduled to live — a tier at its item cost C(t) of the format module
(:func:`pallas_kernels.spherical.item_bytes`: codes, side word, values, and the metadata: a 4-byte
position, a flag bit, a page-table entry per page), the BF16 pool at dense K+V plus a position and
a table share, a drop at 0; window tokens by their pending route — over dense BF16 K+V of the
same tokens.  ``resident_B`` adds what is really held at the end: whole pages (slack included,
:func:`pask_jax.spherical.cache.resident_bytes`) and the window at dense.  ``b_HBM``
(:meth:`SphRunner.hbm`): the HBM bytes one decode step reads over the final cache per generated
token (weights shared by the batch, window, BF16 pool, tiers, tables, A1's rebuild traffic) over
paged dense BF16's for the same tokens (docs/SPHERICAL_KV.md §4 "b_HBM as built").
"""
from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from pallas_kernels import common, spherical
from pallas_kernels.sph_types import TierSpec
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window
from pask_jax import cache as pcache
from pask_jax import controller, kv_dense
from pask_jax import mesh as tp
from pask_jax import policy as P
from pask_jax import recycle
from pask_jax import tags as T
from pask_jax.baselines import budget as BU
from pask_jax.baselines import snapkv
from pask_jax.baselines.masked import Config, MaskedRunner
from pask_jax.decode import Runner, hbm_rows, param_bytes, prompt_candidates
from pask_jax.sample import apply_bitmask, sample
from pask_jax.spherical import cache as scache
from pask_jax.spherical import hybrid, rdr
from pask_jax.spherical import variants as V
from pask_jax.traces import Traces

PAPER_LADDER = ("A2", "A42", "A4")   # §2.3's paper ladder, BF16 values, ascending cost
PREFILLS = ("exact", "flash")        # SphRunner(prefill=): how the prompt and its votes are made
RECENT = 64                          # prompt tokens of the "recent" segment (§2.4)


def retrieved_mask(segments, lengths, Tn: int, batch: int) -> np.ndarray | None:
  """Per-prompt retrieved-evidence marks (``bool [n]`` each, or None) -> ``bool [batch, Tn]``
  (False past a prompt's length and on padding rows), or None when no prompt marks any."""
  if segments is None or all(s is None for s in segments):
    return None
  segments = list(segments)
  if len(segments) > batch:
    raise ValueError(f"got segments for {len(segments)} prompts, the runner's batch is {batch}")
  out = np.zeros((batch, Tn), bool)
  for b, s in enumerate(segments):
    if s is None:
      continue
    s = np.asarray(s, bool).reshape(-1)
    if s.shape[0] != int(lengths[b]):
      raise ValueError(f"prompt {b}'s segment marks cover {s.shape[0]} tokens, its length is "
                       f"{int(lengths[b])}")
    out[b, :s.shape[0]] = s
  return out


def ladder(head_dim: int, layouts=PAPER_LADDER, values="bf16") -> tuple[TierSpec, ...]:
  """The tiers of ``layouts`` at ``head_dim``; ``values`` one value format for every tier or one
  per tier."""
  vals = (values,) * len(layouts) if isinstance(values, str) else tuple(values)
  if len(vals) != len(layouts):
    raise ValueError(f"one value format per tier: {len(layouts)} layouts, {len(vals)} formats")
  return tuple(TierSpec(lay, v, head_dim) for lay, v in zip(layouts, vals))


def _fp16(x):
  return jnp.minimum(x, spherical.FP16_MAX).astype(jnp.float16).astype(jnp.float32)


# ``how``: the sampler's static branches (pask_jax.sample.sample)
_select = jax.jit(lambda lg, bits, key, t, p, how=None: sample(apply_bitmask(lg, bits), key, t, p,
                                                               how=how), static_argnames=("how",))


def _control_state_bytes(sph) -> int:
  """Bytes of one sequence's control state: route, protection and received attention of each
  window item, balance and λ per group, the overflow flag."""
  return sum(int(np.prod(x.shape[1:])) * x.dtype.itemsize
             for x in (sph.route, sph.prot, sph.win_att, sph.balance, sph.lam, sph.overflow))


class SphRunner:
  """Spherical KV over the tiny-to-small models (the reference attention by default).

  ``configure(budget, policy=None)`` sets the requested B (a host float, checked; it reaches the
  device as a traced ``[B]`` array) and, with ``tags``, the PASK policy whose floors protect.
  ``window``/``sink``/``page``/``n_groups``/tiers are static, and so are the ablation settings
  (:mod:`pask_jax.spherical.variants`; :meth:`for_method` builds a harness method's runner):
  ``plan`` "rdr" (RDR under the budget), "fixed" (every item at the one tier of ``tiers``, no
  drop) or "pask" (PASK+ADA: the PASK policy's controller at prefill and decode, H to the BF16
  pool, L to the one tier of ``tiers``, R dropped; the balance is PASK's R_t in bits, held in
  every column of the tier state's ``balance``); ``read`` "angles" (logits from the codes) or
  "reconstruct" (each step the tiers' visible keys decoded to a transient dense BF16 K, then a
  BF16 partition: A1); ``tags`` (RDR+tags: a (token, group) whose PASK floor is H joins P on
  every head, at prefill from the prompt's labels and at decode from the tracker's tags, charged
  like any protected item); ``heads`` "own" (each KV head's items routed on their own) or
  "shared" (every head of a (token, group) takes one route: RDR on the heads' summed
  distortion at H times the item cost, prefill and gate alike; storage and tables unchanged);
  ``omega`` the segment weights ω (prefix, retrieved, recent) of §2.4's distortion (default
  (1, 1, 2); the gate's generated tokens are "recent").
  ``stats``: the full-precision prefill with observation statistics, a
  :class:`~pask_jax.baselines.masked.MaskedRunner` of this batch and capacity that several
  runners of one model may share (one compile); configured here as SnapKV with ``obs``.
  ``prefill``: "exact" (default) that runner — f32 attention over a dense f32 scratch cache of
  the whole capacity, probabilities materialized, O(T · capacity) per layer; "flash" the prompt
  in one chunk through :func:`pask_jax.kv_dense.causal_attention` (cuDNN's flash attention on a
  GPU) with the window's votes from the last ``obs`` queries alone
  (:func:`pask_jax.baselines.snapkv.window_votes`, O(obs · T)), K/V kept for the prompt only:
  the prefill at the hardware's pace (G6's denominator), same statistics up to bf16 rounding of
  the attention (one device)."""
  reads_segments = True   # begin(..., segments=): retrieved evidence priced by ω (decode.generate)

  def __init__(self, model: nnx.Module, *, batch: int, capacity: int,
               window: int = P.DEFAULT_WINDOW, sink: int = P.DEFAULT_SINK, page: int = 16,
               n_groups: int = 3, tiers=None, mu=None, obs: int = 32, kappa_drop: float = 1.0,
               protect_top: float = 0.02, plan: str = "rdr", read: str = "angles",
               tags: bool = False, decode: str = "fixed", heads: str = "own",
               omega=V.OMEGA, stats: MaskedRunner | None = None,
               mesh: jax.sharding.Mesh | None = None, backend: str = "reference",
               kernel_knobs: dict | None = None, prefill: str = "exact"):
    """``mesh``: tensor parallelism over a 1-D ``model`` mesh (:mod:`pask_jax.mesh`; see
    :meth:`state_sharding`): the weights, the window and BF16 pool (by KV head) as
    :class:`~pask_jax.decode.PaskRunner`'s, each tier pool split on its page axis (device i
    holds its KV heads' pages: :func:`pask_jax.spherical.cache.init` with ``shards``); the tier
    writes and the attention (any backend) per device (``shard_map``); the RDR plan, the gated
    rule, the routes, balances and page tables computed whole on every device
    (:func:`pask_jax.mesh.on_every_device`: the per-head features they read gathered first),
    so every device takes the same decisions.  ``read="reconstruct"`` (ablation A1) is refused
    on a mesh.  ``backend``: the attention
    backend of :func:`pallas_kernels.decode_attention` ("reference", "gpu", "tpu" or "auto"; the
    tier partitions through the backend's tier kernel), ``kernel_knobs`` its knobs (e.g.
    ``interpret=True`` to run a Pallas backend on the CPU, ``sph_knobs={...}``)."""
    if backend not in ("reference", "gpu", "tpu", "auto"):
      raise ValueError(f"backend must be one of reference, gpu, tpu, auto; got {backend!r}")
    self.backend, self.kernel_knobs = backend, dict(kernel_knobs or {})
    if plan not in V.PLANS or read not in V.READS:
      raise ValueError(f"plan must be one of {V.PLANS} and read one of {V.READS}, got "
                       f"{plan!r}, {read!r}")
    if mesh is not None and mesh.size > 1 and read == "reconstruct":
      raise ValueError(f"read 'reconstruct' (ablation A1) does not run on a mesh of {mesh.size} "
                       "devices: its dense rebuild of the tiers reads global page ids")
    self.plan, self.read, self.tags = plan, read, bool(tags)
    self.cfg = c = model.cfg
    self.tp_mesh, self.graphdef, self.params = tp.prepare(model, mesh)
    self.param_bytes = param_bytes(self.params)
    self.batch, self.capacity = batch, capacity
    self.window, self.sink, self.page = int(window), int(sink), int(page)
    self.n_groups = min(int(n_groups), c.n_layers)
    self.tiers = ladder(c.head_dim) if tiers is None else tuple(tiers)
    if plan in ("fixed", "pask") and len(self.tiers) != 1:
      raise ValueError(f"plan {plan!r} needs a ladder of one tier, got "
                       f"{[t.layout for t in self.tiers]}")
    if self.tags and plan != "rdr":
      raise ValueError("tags join RDR's protected set: they need plan 'rdr'")
    if decode not in V.DECODES:
      raise ValueError(f"decode must be one of {V.DECODES}, got {decode!r}")
    if decode == "gated" and plan != "rdr":
      raise ValueError("the gated decode rule prices tiers with RDR's λ: it needs plan 'rdr'")
    if heads not in V.HEADS:
      raise ValueError(f"heads must be one of {V.HEADS}, got {heads!r}")
    if heads == "shared" and plan != "rdr":
      raise ValueError("shared tiers are an RDR decision: they need plan 'rdr'")
    self.decode, self.heads = decode, heads
    self.omega = V.check_omega(omega)
    self.mu = mu
    self.obs, self.kappa_drop, self.protect_top = int(obs), float(kappa_drop), float(protect_top)
    self.group_of = T.group_of_layer(c.n_layers, self.n_groups)
    self.layers_per_group = [self.group_of.count(g) for g in range(self.n_groups)]
    cost, dense = rdr.costs(self.tiers, self.layers_per_group, self.page)
    self.cost, self.dense = cost, dense          # [G, K+1] (drop 0), [G]
    self.rho: float | None = None
    self.tag_policy = None
    self.traces = Traces()
    self._control_jit = None
    if prefill not in PREFILLS:
      raise ValueError(f"prefill must be one of {PREFILLS}, got {prefill!r}")
    self.prefill_mode = prefill
    if prefill == "flash":
      if self.tp_mesh is not None:
        raise ValueError("prefill 'flash' runs on one device; on a mesh use prefill 'exact'")
      if stats is not None:
        raise ValueError("stats is the exact prefill's runner; prefill 'flash' takes none")
      self._stats = None
      self._flash = jax.jit(self._prefill_flash)
    else:
      if stats is None:
        stats = MaskedRunner(model, batch=batch, capacity=capacity, mesh=self.tp_mesh)
      elif stats.batch != batch or stats.capacity != capacity:
        raise ValueError(f"the statistics runner has batch {stats.batch} and capacity "
                         f"{stats.capacity}, this runner {batch} and {capacity}")
      elif stats.tp_mesh != self.tp_mesh:
        raise ValueError("the statistics runner runs on another mesh than this runner: make it "
                         "with MaskedRunner(..., mesh=) of this runner's mesh")
      self._stats = stats.configure(Config("snapkv", obs=self.obs))
      self._stats.params = self.params
    if self.tp_mesh is None:
      self.commit = jax.jit(self._commit)
      self.step = recycle.step_jit(self._step, recycle.logits_like(batch, self.cfg.vocab_size),
                                   donate_argnums=(2,))
      self.select = _select
    else:
      m = self.tp_mesh
      ps, rep = jax.tree.map(lambda x: x.sharding, self.params), tp.replicated(m)
      cs, ss = self.state_sharding()
      kv, score = tp.by_kv_head(m, 5, 3), tp.by_kv_head(m, 4, 2)
      state = (cs, ss, rep, rep, rep)
      self.commit = jax.jit(self._commit, in_shardings=(kv, kv, score) + (rep,) * 5,
                            out_shardings=(cs, ss, rep))
      self.step = jax.jit(self._step, donate_argnums=(2,),
                          in_shardings=(ps, rep, state) + (rep,) * 8,
                          out_shardings=(rep, tp.logits_sharding(m), state),
                          static_argnames=("how",))
      self.select = self._stats.select   # the mask per vocabulary shard, then one gather

  @classmethod
  def for_method(cls, model: nnx.Module, method: str, **kw) -> "SphRunner":
    """The runner of harness method ``method`` (:data:`pask_jax.spherical.variants.VARIANTS`),
    ``kw`` as for the constructor (batch, capacity, sink, window, ...)."""
    v = V.variant(method)
    return cls(model, tiers=ladder(model.cfg.head_dim, v.layouts, v.values), plan=v.plan,
               read=v.read, tags=v.tags, decode=v.decode, heads=v.heads, omega=v.omega, **kw)

  @property
  def needs_policy(self) -> bool:
    """Whether :meth:`configure` takes a PASK policy (RDR+tags, PASK+ADA)."""
    return self.tags or self.plan == "pask"

  def configure(self, budget: float, policy=None) -> "SphRunner":
    """The requested B; with ``tags`` or plan "pask", the PASK policy (a
    :class:`pask_jax.policy.FrozenPolicy` of this runner's layer groups) whose floor-H tags join
    P, or whose controller decides (its own budgets B_D, B_P: ``budget`` is then the label)."""
    rho = BU.check_target(budget)
    if self.needs_policy:
      if policy is None or not hasattr(policy, "floor"):
        raise ValueError("RDR+tags and PASK+ADA need a PASK policy (its floors / controller)")
      if policy.n_groups != self.n_groups:
        raise ValueError(f"the policy has {policy.n_groups} layer groups, the runner "
                         f"{self.n_groups}")
      if P.position_bins(policy) is not None:
        raise ValueError("a no-transition policy (position bins, not tags) cannot drive "
                         "Spherical KV")
      pol = P.lean(policy)
      if self.plan == "pask":
        pol = hybrid.with_tier_cost(pol, self.tiers[0], self.layers_per_group,
                                    self.cfg.n_kv_heads)
      self.tag_policy = pol
    elif policy is not None:
      raise ValueError("a policy only configures RDR+tags and PASK+ADA")
    self.rho = rho
    return self

  # --- prefill ---------------------------------------------------------------------------------

  def _tier_errors(self, k, layers=None):
    """Keys ``[L, ..., H, D]`` (post-RoPE, rounded to BF16 as the window holds them) -> per
    layer and item the direction and radius errors of drop and of every tier (two lists of K+1
    arrays ``[L, ..., H]``: ``r²‖x̂ − ũ(t)‖²/D``, ``(r − r̃(t))²/D``; drop: ``2r²/D``, ``r²/D``)
    and the radius ``r`` (after centering and rotation).  ``layers`` (int32 ``[L]``, may be
    traced): the model layers of k's leading axis (default: all of them, in order)."""
    L, D = k.shape[0], k.shape[-1]
    H = k.shape[-2]
    n_layers = self.cfg.n_layers
    layers = jnp.arange(n_layers) if layers is None else layers
    kb = common.round_bf16(k)
    mu = (jnp.zeros((n_layers, H, D), jnp.float32) if self.mu is None
          else jnp.asarray(self.mu, jnp.float32))[layers]
    mu = mu.reshape((L,) + (1,) * (k.ndim - 3) + (H, D))
    h = jnp.asarray(spherical.hadamard(D) / math.sqrt(D), jnp.float32)
    signs = jnp.asarray([spherical.rotation_signs(D, lyr, 0) for lyr in range(n_layers)],
                        jnp.float32)[layers]
    rot = h[None] * signs[:, None, :]
    x = jnp.einsum("l...d,led->l...e", kb - mu, rot, precision=jax.lax.Precision.HIGHEST)
    r = jnp.sqrt(jnp.sum(x * x, axis=-1))
    xhat = x / jnp.maximum(r, 1e-30)[..., None]
    th, rr = [2.0 * r * r / D], [r * r / D]                                        # drop
    for ts in self.tiers:
      codes, rq = spherical.encode(x, ts.key)
      u = spherical.direction(*spherical.angle_trig(codes, ts.key))
      th.append(r * r * jnp.sum((xhat - u) ** 2, axis=-1) / D)
      rr.append((r - _fp16(rq)) ** 2 / D)
    return th, rr, r

  def _gate_leaving(self, sph, slot, old_pos, old_k, n_prompt, active, leaving):
    """The gated rule for the token leaving window slot ``slot [B]`` (``old_k [L, B, H, D]``):
    refund its reservation, place its items by :func:`rdr.gate`, write the route into the slot
    (read by :func:`scache.evict_step`).  Only generated tokens (``old_pos >= n_prompt``) whose
    pending route is a tier or a drop on every head and that are not protected are gated."""
    B, H, G, W = self.batch, self.cfg.n_kv_heads, self.n_groups, self.window
    K = len(self.tiers)
    bi = jnp.arange(B)
    pending = sph.route[bi, slot].astype(jnp.int32)                           # [B, G, H]
    elig = (active & leaving & (old_pos >= n_prompt))[:, None] \
        & ~jnp.any(pending > K, axis=-1) & ~jnp.any(sph.prot[bi, slot], axis=-1)   # [B, G]
    cost = jnp.asarray(self.cost)                                             # [G, K+1]
    held = jnp.take_along_axis(jnp.broadcast_to(cost[None, :, None, :], (B, G, H, K + 1)),
                               jnp.clip(pending, 0, K)[..., None], -1)[..., 0]
    bal = sph.balance + jnp.where(elig, jnp.sum(held, axis=-1), 0.0)
    onehot = jax.nn.one_hot(jnp.asarray(self.group_of), G, dtype=jnp.float32)      # [L, G]
    th, rr, _ = self._tier_errors(old_k)                                      # [L, B, H] each
    to_g = lambda e: jnp.einsum("lbh,lg->bgh", e, onehot)
    a = (sph.win_att[bi, slot] / W)[..., None]                                # [B, G, H, 1]
    eps_t = jnp.stack([to_g(e) for e in th], -1) * a
    eps_r = jnp.stack([to_g(e) for e in rr], -1) * a
    dist = self.omega[2] * (eps_t + eps_r)                                    # recent, û=1, ŝ=0
    dist = dist.at[..., 0].multiply(self.kappa_drop)
    shared = self.heads == "shared"
    route, _, bal = self._everywhere(
        lambda d, lam, b, e: rdr.gate(d, cost, lam, b, e, shared=shared))(
        dist, sph.lam, bal, elig)
    route = jnp.where(elig[..., None], route, pending).astype(jnp.int8)
    return sph.replace(route=sph.route.at[bi, slot].set(route), balance=bal)

  def _features(self, k, score, n):
    """Per-item errors of every tier.  k [L, B, T, H, D] (post-RoPE), score [L, B, H, T] (obs
    attention column sums), n [B] -> (eps_theta, eps_r [B, T, G, H, K+1], att, radius
    [B, T, G, H])."""
    c, G = self.cfg, self.n_groups
    L, B, Tn, H, D = k.shape
    onehot = jax.nn.one_hot(jnp.asarray(self.group_of), G, dtype=jnp.float32)      # [L, G]
    per_g = jnp.asarray(self.layers_per_group, jnp.float32)
    mass = score / float(self.obs * (c.n_heads // c.n_kv_heads))                   # [L, B, H, T]
    att = jnp.einsum("lbht,lg->bhgt", mass, onehot) / per_g[:, None]              # [B, H, G, T]
    valid = jnp.arange(Tn)[None, :] < n[:, None]                                   # [B, T]
    pv = jnp.broadcast_to(valid[:, None, None], att.shape)
    att = snapkv.pool(att, pv, jnp.full(att.shape[:-1], 7, jnp.int32),
                      jnp.ones(att.shape[:-1], bool))
    att = jnp.where(pv, att, 0.0)
    att = jnp.transpose(att, (0, 3, 2, 1))                                         # [B, T, G, H]
    # One layer at a time (a loop, not L independent slices a scheduler may keep alive at
    # once): the per-element temporaries (the rotated keys, codes, directions: [B, T, H, D] f32
    # and wider) exist for one layer only; at the 1.5B shape, B 8, 32K over all layers at once
    # they were ~51 GiB of the commit's temporaries.  Only [L, B, T, H] errors are kept.  The
    # same values on one device; under a KV-head mesh the per-layer reductions may round
    # differently (λ moved by an ulp in one entry on 2 CPU devices).
    th, rr, r = jax.lax.map(
        lambda l: jax.tree.map(lambda x: x[0], self._tier_errors(
            jax.lax.dynamic_index_in_dim(k, l, 0), l[None])),
        jnp.arange(L))                                                            # [L, B, T, H]
    to_g = lambda e: jnp.einsum("lbth,lg->btgh", e, onehot)                       # sum over ℓ∈g
    a = att[..., None]
    eps_t = jnp.stack([to_g(e) for e in th], -1) * a
    eps_r = jnp.stack([to_g(e) for e in rr], -1) * a
    radius = jnp.einsum("lbth,lg->btgh", r, onehot) / per_g[:, None]
    return eps_t, eps_r, att, radius

  def _commit(self, k, v, score, lengths, rho, tpol=None, cands=None, retrieved=None):
    """Dense prefill K/V [L, B, T, H, D] + statistics (+ with ``tags`` the PASK policy and the
    prompt's tag candidates [B, T, N_CAND]; + ``retrieved`` bool [B, T], the tokens in the
    retrieved segment) -> (plan, base cache, tier state)."""
    self.traces["commit"] += 1
    W, G = self.window, self.n_groups
    B, Tn, H = k.shape[1], k.shape[2], k.shape[3]
    n = lengths.astype(jnp.int32)
    if self.plan == "fixed":
      plan = rdr.fixed(self.cost, self.dense, n, rho, Tn, H, tier=1, sink=self.sink)
    elif self.plan == "pask":   # PASK+ADA: PASK's prefill plan, L at the tier
      act, excess = controller.plan_prefill(tpol, cands, n)                      # [B, T, G]
      route = hybrid.routes(act, H)
      valid = (jnp.arange(Tn)[None, :] < n[:, None])[..., None, None]
      route = jnp.where(valid, route, 0).astype(jnp.int8)
      dense = jnp.asarray(self.dense)
      budget = tpol.b_p * n.astype(jnp.float32)[:, None] * H * dense
      per = jnp.stack([jnp.zeros_like(dense), jnp.asarray(self.cost)[:, 1], dense], -1)  # [G, 3]
      spent = jnp.sum(per[jnp.arange(G)[None, None, :], route[..., 0]], axis=1) * H   # [B, G]
      zeros = jnp.zeros((B, G), jnp.float32)
      deficit = zeros.at[:, 0].set(excess / 8.0)           # PASK's floor excess, bits -> bytes
      plan = rdr.Plan(route, jnp.zeros(route.shape, bool), zeros, spent, budget, deficit)
    else:
      eps_t, eps_r, att, radius = self._features(k, score, n)
      seg = jnp.zeros((B, Tn), jnp.int32) if retrieved is None else retrieved.astype(jnp.int32)
      seg = jnp.where(jnp.arange(Tn)[None, :] >= n[:, None] - RECENT, 2, seg)     # [B, T]
      one = jnp.ones((G, H), jnp.float32)
      dist = jax.vmap(lambda et, er, sg: rdr.distortion(
          et, er, one, 0.0 * one, sg, omega=self.omega, kappa_drop=self.kappa_drop))(
              eps_t, eps_r, seg)
      prot = jax.vmap(lambda a, r, m: rdr.protect_mask(
          a, r, m, sink=self.sink, window=W, top=self.protect_top))(att, radius, n)
      if self.tags:   # RDR+tags: floor-H (token, group)s join P on every head
        prot = prot | hybrid.floor_h(tpol, cands)[..., None]
      solve = lambda d, p, n, r: rdr.solve_batch(d, self.cost, self.dense, n, r, p, window=W,
                                                 sink=self.sink,
                                                 shared=self.heads == "shared")
      plan = self._everywhere(solve)(dist, prot, n, rho)   # ranks every head's items
    cache, sph = self._new_states()
    sph, rows = scache.prefill_rows(sph, plan.route, Tn, n, plan.prot, mesh=self.tp_mesh)
    # The tier encode one layer at a time in a loop (bounded temporaries, as for the features)
    sph = jax.lax.fori_loop(0, k.shape[0], lambda l, s: scache.write_prefill(
        s, rows, jax.lax.dynamic_index_in_dim(k, l, 0), jax.lax.dynamic_index_in_dim(v, l, 0),
        l, mesh=self.tp_mesh), sph)
    pos = jnp.broadcast_to(jnp.arange(Tn, dtype=jnp.int32), (B, Tn))
    actions = scache.base_actions(sph, scache.normalize_route(sph, plan.route, pos))
    cache = pcache.materialize_prefill(cache, k, v, actions, n)
    sph = sph.replace(lam=plan.lam)
    if self.plan == "pask":   # R_1 = b = B_D·C_full (bits), in every group's column
      sph = sph.replace(balance=jnp.broadcast_to(controller.initial_balance(tpol),
                                                 (B, G)).astype(jnp.float32))
    return cache, sph, plan

  def _new_states(self):
    """An empty base cache (window, BF16 pool for the sinks and H routes, an unused INT4 pool of
    one page) and an empty tier state, its pages numbered for the mesh's devices."""
    c = self.cfg
    L, H, D = c.n_layers, c.n_kv_heads, c.head_dim
    sph = scache.init(L, self.batch, H, D, tiers=self.tiers, capacity=self.capacity,
                      window=self.window, n_groups=self.n_groups, page=self.page, sink=self.sink,
                      mu=self.mu, shards=1 if self.tp_mesh is None else self.tp_mesh.size)
    cache = pcache.init(L, self.batch, H, D, capacity=self.capacity, window=self.window,
                        sink=self.sink, n_groups=self.n_groups, page=self.page,
                        lo_capacity=self.page)
    return cache, sph

  def state_sharding(self):
    """(base cache, tier state) shardings on the mesh: the base cache as PaskRunner's (window
    and pools by KV head, maps replicated); every tier pool on its page axis (block i: device
    i's KV heads' pages) and the centering means by KV head; page tables, positions, routes,
    balances and the rest replicated."""
    m = self.tp_mesh
    cache, sph = jax.eval_shape(self._new_states)
    rep, page = tp.replicated(m), lambda x: tp.by_kv_head(m, x.ndim, 1)
    ss = jax.tree.map(lambda _: rep, sph).replace(
        pools=tuple(type(p)(*(page(a) for a in p)) for p in sph.pools),
        consts=type(sph.consts)(rep, tp.by_kv_head(m, 3, 1)))
    return tp.pask_cache_sharding(m, cache), ss

  def prefill(self, tokens: np.ndarray, lengths: np.ndarray, prompt_tags=None, segments=None,
              timers: dict | None = None):
    """Prefill and commit -> (logits, base cache, tier state, plan, rho [B]).  ``prompt_tags``:
    per prompt ``int32 [n, N_CAND]`` label candidates or None (read with ``tags`` only);
    ``segments``: per prompt ``bool [n]``, True on its retrieved evidence, or None (priced by
    ω's middle weight in RDR's distortion; the fixed and PASK plans do not read it).
    ``timers`` (optional dict): adds the seconds of the full-precision prefill (``prefill_s``;
    "exact": with the prompt's K/V and statistics sliced out of the scratch cache) and of the
    commit (``commit_s``: features, the RDR plan, the tier encode and the cache
    writes; G6's control-plane share), each waited for, so only pass it when timing."""
    if self.rho is None:
      raise RuntimeError("SphRunner.configure(budget) first")
    t0 = time.perf_counter()
    Tn = tokens.shape[1]
    if self._stats is None:   # prefill "flash": one chunk, K/V and votes of the prompt only
      logits, (k, v, score) = self._flash(self.params, jnp.asarray(tokens),
                                          jnp.asarray(lengths, jnp.int32))
    else:
      self._stats.configure(Config("snapkv", obs=self.obs))   # a shared runner: ours again
      st = self._stats.new_state(lengths)
      logits, st = Runner.prefill_all(self._stats, st, tokens, lengths)
      k, v, score = st.k[:, :, :Tn], st.v[:, :, :Tn], st.score[..., :Tn]
    if timers is not None:
      jax.block_until_ready((logits, k, v, score))
      t1 = time.perf_counter()
      timers["prefill_s"] = timers.get("prefill_s", 0.0) + t1 - t0
    rho = self._put(np.full((self.batch,), self.rho, np.float32))
    tpol = cands = None
    if self.needs_policy:
      cands = jnp.asarray(prompt_candidates(prompt_tags, lengths, Tn))
      tpol = self.tag_policy
    retrieved = retrieved_mask(segments, lengths, Tn, self.batch)
    if retrieved is not None:
      retrieved = self._put(retrieved)
    if timers is not None:   # the commit's other inputs are not its work
      jax.block_until_ready((rho, retrieved))
      t1 = time.perf_counter()
    cache, sph, plan = self.commit(k, v, score, jnp.asarray(lengths), rho, tpol, cands,
                                   retrieved)
    if timers is not None:
      jax.block_until_ready((cache, sph, plan))
      timers["commit_s"] = timers.get("commit_s", 0.0) + time.perf_counter() - t1
    return logits, cache, sph, plan, rho

  def _prefill_flash(self, params, tokens, lengths):
    """Prefill "flash": tokens [B, T] (right-padded prompts of ``lengths`` [B]) in one chunk ->
    (last-prompt-token logits [B, V], (k, v [L, B, T, Hkv, D] bf16 post-RoPE, score [L, B, Hkv,
    T] the observation window's votes))."""
    self.traces["prefill"] += 1
    model = nnx.merge(self.graphdef, params)
    c = self.cfg
    B, Tn = tokens.shape
    n = lengths.astype(jnp.int32)
    kv = jnp.zeros((c.n_layers, B, Tn, c.n_kv_heads, c.head_dim), jnp.bfloat16)
    carry = (kv, kv, jnp.zeros((c.n_layers, B, c.n_kv_heads, Tn), jnp.float32))

    def attend(carry, layer, q, k, v, positions):
      ks, vs, score = carry
      o = kv_dense.causal_attention(q, k.astype(q.dtype), v.astype(q.dtype))
      vote = snapkv.window_votes(q, k, n, self.obs)
      return o, (ks.at[layer].set(k.astype(ks.dtype)), vs.at[layer].set(v.astype(vs.dtype)),
                 score.at[layer].set(vote))

    pos = jnp.broadcast_to(jnp.arange(Tn, dtype=jnp.int32), (B, Tn))
    logits, carry = model(tokens, pos, carry, attend, last_only=jnp.clip(n - 1, 0, Tn - 1))
    return logits[:, 0], carry

  def begin(self, tokens: np.ndarray, lengths: np.ndarray, prompt_tags=None, segments=None,
            timers: dict | None = None):
    logits, cache, sph, plan, rho = self.prefill(tokens, lengths, prompt_tags, segments, timers)
    n_prompt = self._put(np.asarray(lengths, np.int32))
    return logits, (cache, sph, rho, n_prompt, plan.deficit)

  def _everywhere(self, fn):
    """``fn``, a decision that reads every KV head's features; on a mesh computed whole on every
    device (:func:`pask_jax.mesh.on_every_device`: the features gathered once, the decision
    the same on each device)."""
    return fn if self.tp_mesh is None else tp.on_every_device(fn, self.tp_mesh)

  def _put(self, x):
    """A host array where the step keeps it (on a mesh: replicated, as the step returns it, so
    the first step compiles the program every later one runs)."""
    return jnp.asarray(x) if self.tp_mesh is None else jax.device_put(x, tp.replicated(
        self.tp_mesh))

  # --- decode ----------------------------------------------------------------------------------

  def _route_new(self, sph, rho, active, protect=None):
    """The new token's route [B, G, H] by the balance rule (``protect [B, G]``: tier K, charged
    as debt; plan "fixed": the one tier, no balance); the balance updated."""
    H, G = self.cfg.n_kv_heads, self.n_groups
    if self.plan == "fixed":
      tier = jnp.broadcast_to(jnp.where(active, 1, 0)[:, None], (self.batch, G))
      return jnp.broadcast_to(tier[..., None], tier.shape + (H,)).astype(jnp.int8), sph
    cost = jnp.asarray(self.cost) * H                                   # [G, K+1] all heads
    bal = sph.balance + jnp.where(active, rho, 0.0)[:, None] * (H * jnp.asarray(self.dense))
    fits = cost[None, :, 1:] <= bal[..., None]                          # [B, G, K]
    K = len(self.tiers)
    tier = jnp.max(jnp.where(fits, jnp.arange(1, K + 1), 0), axis=-1)   # 0: drop
    if protect is not None:
      tier = jnp.where(protect, K, tier)
    tier = jnp.where(active[:, None], tier, 0)
    paid = jnp.take_along_axis(jnp.broadcast_to(cost, bal.shape + (K + 1,)), tier[..., None],
                               -1)[..., 0]
    route = jnp.broadcast_to(tier[..., None], tier.shape + (H,)).astype(jnp.int8)
    return route, sph.replace(balance=bal - paid)

  def _control(self, tpol, state, tag_ids, state_ids, active):
    """The decode step's control plane (G6): the new token's route and protection, the
    balance, and with the gated rule the route of the token leaving the window -> (route
    [B, G, H] i8, new_prot or None, tier state)."""
    cache, sph, rho, n_prompt, _ = state
    B, W, H = self.batch, self.window, self.cfg.n_kv_heads
    protect = new_prot = None
    if self.tags:   # the new token's floor-H groups (a stop or padding row is inactive)
      protect = hybrid.floor_h(tpol, tag_ids) & active[:, None]             # [B, G]
      new_prot = jnp.broadcast_to(protect[..., None], protect.shape + (H,))
    if self.plan == "pask":   # PASK's controller (Alg. 2) on PASK's balance
      act, bal = controller.control_batch(tpol, tag_ids, state_ids, sph.balance[:, 0], ~active)
      route = jnp.where(active[:, None, None], hybrid.routes(act, H), 0).astype(jnp.int8)
      sph = sph.replace(balance=jnp.broadcast_to(bal[:, None], sph.balance.shape))
    else:
      route, sph = self._route_new(sph, rho, active, protect)
    if self.decode == "gated":
      p = cache.count
      bi = jnp.arange(B)
      slot = p % W
      old_k = cache.layers.win_k[:, bi, slot]                              # [L, B, H, D]
      sph = self._gate_leaving(sph, slot, cache.win_pos[bi, slot], old_k, n_prompt, active,
                               p >= W)
    return route, new_prot, sph

  def control_only(self, state, tag_ids, state_ids, active):
    """The decode step's control plane alone (:meth:`_control`, jitted on first use) on a state
    of :meth:`begin` -> (route [B, G, H] of the new token, balance [B, G], pending routes
    [B, W, G, H] with the gated rule's placement of the leaving token): what G6's "decode-time
    control ≤ 2 % of a step" times (``bench/sph_control.py``); the step runs it fused.  Only
    what the control writes comes back (returning the tier state would copy its pools)."""
    if self._control_jit is None:
      def outputs(*a):
        route, _, sph = self._control(*a)
        return route, sph.balance, sph.route
      self._control_jit = jax.jit(outputs)
    return self._control_jit(self.tag_policy, state, tag_ids, state_ids, active)

  def _step(self, params, tpol, state, tokens, tag_ids, state_ids, active, bits, key,
            temperature, top_p, how=None):
    """One token per request, then the sampler (``how``, static:
    :meth:`pask_jax.decode.Runner._step`'s) -> (next tokens [B], logits [B, V], state)."""
    self.traces["step"] += 1
    cache, sph, rho, n_prompt, deficit = state
    model = nnx.merge(self.graphdef, params)
    B, W = self.batch, self.window
    route, new_prot, sph = self._control(tpol, state, tag_ids, state_ids, active)
    p = cache.count
    bi = jnp.arange(B)
    slot = p % W
    old_pos = cache.win_pos[bi, slot]
    lay = cache.layers
    old_k, old_v = lay.win_k[:, bi, slot], lay.win_v[:, bi, slot]        # [L, B, H, D]
    gated = self.decode == "gated"
    sph = scache.evict_step(sph, jnp.where(active, slot, W),
                            jnp.where(active & (p >= W), old_pos, -1), old_k, old_v, route,
                            new_prot, mesh=self.tp_mesh)
    if gated:   # the slot's new token starts with no attention received
      sph = sph.replace(win_att=sph.win_att.at[bi, slot].set(
          jnp.where(active[:, None, None], 0.0, sph.win_att[bi, slot])))
    actions = scache.base_actions(sph, scache.normalize_route(sph, route, p))
    cache, plan = pcache.begin_step(cache, actions, active)
    cache = pcache.evict_step(cache, plan)
    gl = pcache.group_array(cache)
    per_g = jnp.asarray(self.layers_per_group, jnp.float32)

    def attend(carry, layer, q, k, v, positions):
      cache, att = carry
      cache = pcache.write_step(cache, plan, layer, k[:, 0], v[:, 0], evict=False)
      g = gl[layer]
      window, hi, lo, maps = pcache.kernel_inputs(cache.layers, cache, g)
      if self.read == "angles":
        attn = functools.partial(pallas_kernels.decode_attention, backend=self.backend,
                                 **self.kernel_knobs)
        if self.tp_mesh is not None:   # per device: its KV heads, their pages (local ids)
          attn = tp.attention_per_shard(attn, self.tp_mesh)
        res = attn(q[:, 0], window, hi, lo, maps, layer=layer, sph=scache.sph_inputs(sph, g),
                   return_lse=gated)
      else:
        res = self.attend_reconstructed(q[:, 0], window, hi, lo, maps, layer, sph, g,
                                        return_lse=gated)
      out = res[0] if gated else res
      if gated:   # the attention mass each window token receives (§2.4: O(W) in XLA)
        att = att + self._window_mass(q[:, 0], window, layer, res[1])[:, :, None, :] * (
            jax.nn.one_hot(g, self.n_groups) / per_g[g])[None, None, :, None]
      return out[:, None].astype(q.dtype), (cache, att)

    logits, (cache, att) = model(tokens[:, None], p[:, None], (cache, sph.win_att), attend)
    if gated:
      sph = sph.replace(win_att=jnp.where(active[:, None, None, None], att, sph.win_att))
    logits = logits[:, 0]
    masked = apply_bitmask(logits, bits)
    if self.tp_mesh is not None:   # the mask on each vocabulary shard, then one gather to sample
      masked = jax.lax.with_sharding_constraint(masked, tp.replicated(self.tp_mesh))
    nxt = sample(masked, key, temperature, top_p, how=how)
    return nxt, logits, (cache, sph, rho, n_prompt, deficit)

  def _window_mass(self, q, window, layer, lse):
    """Probability mass each window slot receives this step, mean over each KV head's query
    heads -> ``[B, W, H]`` (0 on empty slots); ``lse [B, Hq]`` of the whole attention."""
    B, Hq, D = q.shape
    H = self.cfg.n_kv_heads
    wk = window.k[layer].astype(jnp.float32)                                  # [B, W, H, D]
    qg = q.astype(jnp.float32).reshape(B, H, Hq // H, D)
    s = jnp.einsum("bhqd,bwhd->bhqw", qg, wk, precision=jax.lax.Precision.HIGHEST)
    s = s / math.sqrt(D)
    prob = jnp.exp(s - lse.reshape(B, H, Hq // H)[..., None])
    vis = jnp.arange(wk.shape[1])[None, :] < window.length[:, None]          # [B, W]
    mass = jnp.where(vis[:, None, :], jnp.mean(prob, axis=2), 0.0)            # [B, H, W]
    return jnp.transpose(mass, (0, 2, 1))

  def attend_reconstructed(self, q, window, hi, lo, maps, layer, sph, g, return_lse=False):
    """Reconstruct-then-dot (A1): the base partitions (window, BF16 pool) and, per tier, a BF16
    partition over the tier's keys rebuilt densely (:func:`scache.rebuild_tier`; each (sequence,
    KV head) as a sequence of one KV head), merged by their LSEs.  The partitions' outputs meet
    as BF16 (as separate launches would), one rounding the fused path does not have."""
    B, Hq, D = q.shape
    H = self.cfg.n_kv_heads
    gq = Hq // H
    out, lse = pallas_kernels.decode_attention(q, window, hi, lo, maps, layer=layer,
                                               return_lse=True, backend=self.backend,
                                               **self.kernel_knobs)
    outs, lses = [out.astype(jnp.float32)], [lse]
    empty_k = jnp.zeros((B * H, 1, 1, D), jnp.bfloat16)
    win = Window(empty_k, empty_k, jnp.zeros((B * H,), jnp.int32))
    codes = jnp.zeros((0, self.page, 1, D // 2), jnp.uint8)
    no_lo = LowPool(codes, codes, jnp.zeros((0, self.page, 1, 2), jnp.float16))
    qf = q.reshape(B * H, gq, D)
    for t in range(len(self.tiers)):
      k, v, length = scache.rebuild_tier(sph, t, g, layer)                  # [B, H, S, D]
      S = k.shape[2]
      n = S // self.page
      pool = HighPool(k.reshape(B * H * n, self.page, 1, D), v.reshape(B * H * n, self.page, 1, D))
      m = PageMaps(jnp.arange(B * H * n, dtype=jnp.int32).reshape(B * H, n), length.reshape(-1),
                   jnp.zeros((B * H, 0), jnp.int32), jnp.zeros((B * H,), jnp.int32))
      o, ls = pallas_kernels.decode_attention(qf, win, pool, no_lo, m, return_lse=True,
                                              backend=self.backend, **self.kernel_knobs)
      outs.append(o.reshape(B, Hq, D).astype(jnp.float32))
      lses.append(ls.reshape(B, Hq))
    lse = jnp.stack(lses)                                                    # [K+1, B, Hq]
    top = jnp.max(lse, axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - top), 0.0)
    num = jnp.sum(w[..., None] * jnp.stack(outs), axis=0)
    den = jnp.sum(w, axis=0)
    out = (num / jnp.where(den > 0, den, 1.0)[..., None]).astype(jnp.bfloat16)
    if return_lse:
      return out, top + jnp.log(jnp.where(den > 0, den, 1.0))
    return out

  def advance(self, state, tokens, tag_ids, state_ids, active, bits, key, temperature, top_p,
              how=None):
    nxt, _, state = self.advance_logits(state, tokens, tag_ids, state_ids, active, bits, key,
                                        temperature, top_p, how)
    return nxt, state

  def advance_logits(self, state, tokens, tag_ids, state_ids, active, bits, key, temperature,
                     top_p, how=None):
    """:meth:`advance` that also returns the step's logits ``[B, V]`` -> (next, logits, state):
    the forced-token path (feed given tokens, score them: W1 of :mod:`calibrate.longctx`).
    On one GPU the logits are valid until the next step (:mod:`pask_jax.recycle`).  ``how``:
    the sampler's static branches, :func:`pask_jax.sample.how_of` of ``temperature`` and
    ``top_p`` (None: chosen on the device, :func:`pask_jax.sample.sample`)."""
    tpol = self.tag_policy if self.needs_policy else None
    tags = tag_ids if self.needs_policy else None
    sids = state_ids if self.plan == "pask" else None
    return self.step(self.params, tpol, state, tokens, tags, sids, active, bits, key,
                     temperature, top_p, how)

  # --- accounting ------------------------------------------------------------------------------

  def hbm(self, state) -> list[dict]:
    """Per request the decode step's HBM bytes over the cache as it stands
    (:func:`pask_jax.spherical.cache.hbm_bytes`: the weights' share, window, BF16 pool, tiers by
    this runner's read path — A1's rebuild traffic included —, tables) and b_HBM against paged
    dense BF16 over the same tokens (:func:`pask_jax.decode.hbm_rows`), at the granularity of
    this runner's attention backend (:func:`pask_jax.cache.granularity_of`)."""
    cache, sph = state[0], state[1]
    gran = pcache.granularity_of(pallas_kernels.resolve_backend(self.backend))
    return hbm_rows(scache.hbm_bytes(sph, cache, granularity=gran, read=self.read),
                    pcache.dense_hbm_bytes_of(cache, granularity=gran), self.param_bytes,
                    self.batch, gran)

  def metadata_bytes(self, state) -> np.ndarray:
    """Per request the resident bytes that are not keys or values, float64 ``[B]`` (G6: ≤ 3 %
    of the resident bytes): per tier item its position (4 B) and protection bit, per tier page
    its table entry (4 B), per (token, group) of the BF16 pool its position and its share of a
    table entry, and the sequence's control state (route, protection and received attention of
    each window item, balance and λ per group, the overflow flag)."""
    cache, sph = state[0], state[1]
    hi = np.sum(np.asarray(cache.hi_len, np.float64), axis=0)              # [B]
    return (np.asarray(scache.tier_metadata_bytes(sph), np.float64)
            + hi * (spherical.POSITION_BYTES + spherical.TABLE_ENTRY_BYTES / self.page)
            + _control_state_bytes(sph))

  def report(self, state) -> list[dict]:
    """Per request: measured B (scheduled, metadata counted), prefill / decode split,
    resident_B, tokens per route, the prefill plan's deficit and overflow, the metadata
    (:meth:`metadata_bytes`; ``metadata_share`` of the resident bytes and control state), and
    the decode step's HBM bytes (:meth:`hbm`: ``hbm_bytes_per_token``, ``hbm_kv_bytes``, ``b_HBM``,
    ``hbm_granularity``)."""
    cache, sph, rho, n_prompt, deficit = state
    H, G, K = self.cfg.n_kv_heads, self.n_groups, len(self.tiers)
    cost, dense = np.asarray(self.cost, np.float64), np.asarray(self.dense, np.float64)
    bf16_item = dense * H + spherical.POSITION_BYTES + spherical.TABLE_ENTRY_BYTES / self.page
    npr, count = np.asarray(n_prompt), np.asarray(cache.count)
    lens = [np.asarray(x) for x in sph.length]
    poss = [np.asarray(x) for x in sph.pos]
    hi_len, hi_pos = np.asarray(cache.hi_len), np.asarray(cache.hi_pos)
    win_pos, route = np.asarray(cache.win_pos), np.asarray(sph.route)
    resident = np.asarray(scache.resident_bytes(sph), np.float64)
    deficit, overflow = np.asarray(deficit), np.asarray(sph.overflow | cache.overflow)
    full_tok = float(np.sum(dense) * H)
    hbm = self.hbm(state)
    meta, ctrl = self.metadata_bytes(state), _control_state_bytes(sph)
    out = []
    for b in range(self.batch):
      n0, n = int(npr[b]), int(count[b])
      pre = dec = 0.0
      held = resident[b]
      counts = np.zeros(K + 2, np.int64)
      for t in range(K):
        for g in range(G):
          for h in range(H):
            ps = poss[t][g, b, h, :lens[t][g, b, h]]
            pre += cost[g, t + 1] * np.sum(ps < n0)
            dec += cost[g, t + 1] * np.sum(ps >= n0)
            counts[t + 1] += len(ps)
      for g in range(G):
        ps = hi_pos[g, b, :hi_len[g, b]]
        pre += bf16_item[g] * np.sum(ps < n0)
        dec += bf16_item[g] * np.sum(ps >= n0)
        held += bf16_item[g] * len(ps)
        counts[K + 1] += len(ps) * H
      for w in range(self.window):
        p = int(win_pos[b, w])
        if p < 0:
          continue
        held += full_tok
        for g in range(G):
          for h in range(H):
            r = int(route[b, w, g, h])
            c = bf16_item[g] / H if r == K + 1 else cost[g, r]
            counts[r] += 1
            if p < n0:
              pre += c
            else:
              dec += c
      counts[0] = n * G * H - counts[1:].sum()   # everything not held anywhere was dropped
      ratio = lambda x, m: float(x / (m * full_tok)) if m else float("nan")
      out.append({"n_prompt": n0, "n_gen": n - n0, "prefill_bytes": float(pre),
                  "decode_bytes": float(dec), "full_kv_bytes": n * full_tok,
                  "prefill_B": ratio(pre, n0),
                  "decode_B": ratio(dec, n - n0), "measured_B": ratio(pre + dec, n),
                  "resident_B": ratio(held, n), "budget": float(np.asarray(rho)[b]),
                  "metadata_bytes": float(meta[b]),
                  "metadata_share": float(meta[b] / (held + ctrl)) if held else float("nan"),
                  "deficit_bytes": float(np.sum(deficit[b])), "overflow": bool(overflow[b]),
                  "plan": self.plan, "read": self.read, "tags": self.tags,
                  "decode": self.decode, "heads": self.heads, "omega": list(self.omega),
                  "items": {"drop": int(counts[0]),
                            **{self.tiers[t].name: int(counts[t + 1]) for t in range(K)},
                            "bf16": int(counts[K + 1])},
                  **hbm[b]})
    return out


__all__ = ["PAPER_LADDER", "SphRunner", "ladder"]
