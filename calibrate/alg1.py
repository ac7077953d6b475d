"""PASK offline calibration, Algorithm 1 (paper §3.4, §3.6, A.4, B.4, B.6, E.2, E.4).

Stages (each saved under ``work/`` as it completes, so an interrupted run resumes):

Each stage file is keyed by a fingerprint of the model, the tokenizer, the split's task and the
arguments that change its numbers (:mod:`calibrate.stages`; no pickles); resuming with anything
different is refused, naming what differs.  ``rows`` (the stacked chunk size) and the kernel
backend are not part of it: stacked and sequential interventions give the same outcomes.

1. **Reference** — π_ref (all-high, B_D = 1) generates the calibration split; its trajectories
   (tokens, structural tag candidates, parser states) are the fixed reference of Runtime-D, the
   bucket counts N̄_q, the nominal costs and the reserve.
2. **Buckets** — q = (tag id, layer group) for every tag id observed on a reference token with a
   single candidate (decode tags from the FC adapter; prompt labels for the prefill companion).
   Tokens with several candidates resolve online by Eq. 12 (max over candidates); unobserved ids
   fall back along the parent chain to an aggregate entry (componentwise max of the observed
   children: conservative), and ids with nothing compatible are H.
3. **Runtime-V** — for every bucket and a ∈ {R, L}, π_{q,a} applies a to every occurrence of q
   (others H, B_D = B_P = 1) during complete generation on the calibration split;
   V = R̂_cal(π_{q,a}) − R̂_cal(π_ref) with R̂ = error rate; monotone envelope (Eq. 5).  All
   interventions of a chunk run in one jitted generation loop (:mod:`calibrate.stack`).
4. **Runtime-D** — D(q, a) (Eq. 7) on the reference trajectories (:mod:`calibrate.distortion`),
   mean counts N̄_q, priorities ρ_D (Eq. 8).
5. **Decode candidates** — per threshold pair τ: floors (Eq. 6); the greedy path from the floors
   (largest ρ_D first; ties: ascending tag id, then group; zero scores stay eligible up to all-high;
   Prop. 2); per candidate the nominal reference cost ratio B_D and the reserve Γ (Eq. 16, K, β,
   left empirical quantile per parser state, pooled fallback).  ``path_points`` candidates per
   path are evaluated (evenly spaced in nominal cost, both ends kept; 0 = every step).  With
   ``Config.windows`` every candidate is also evaluated at each other recent window W (one
   stacked dev run per W, stage ``dev_windows``) and competes in the selection like the others.
6. **Selection** — complete controllers and π_ref on the development split; Eq. 9 with α_D on the
   measured decode cost (actual generated lengths); π_ref is the fallback.
7. **Prefill companion** (§3.6, B.4) — floors from the prompt-label V_P per τ, priorities from D_P,
   candidates over (τ, B_P); selection with α_P on the measured prefill cost (decode all-high).
8. **Compose and pack** — decode + prefill policy, evaluated end to end on dev (accuracy and
   measured total B), saved with :func:`pask_jax.policy.save` plus ``calibration.json``.
9. **Total-B variants** (only with ``Config.targets``) — per target t, ``policy/B<t>/``: the most
   dev-accurate composition of a decode and a prefill candidate whose dev-measured total B is
   <= t (:func:`pick_within`; ties: lower B), among everything measured on dev.  Compositions
   not yet measured are evaluated in one stacked dev run: estimated pairs that fit, and prefill
   candidates aimed at t (B_P solved from the measured decode share) over each τ — over relaxed
   floors, down to none, only where nothing else reaches t; a second run re-aims what overshot
   where nothing fits, or where what overshot beat everything that fits
   (:meth:`Calibration.variants`).  The decode stages aimed with: the selected one, the cheapest,
   and one that releases nothing (every generated token INT4, measured alone first).  Stages
   ``dev_keep``, ``dev_targets``, ``dev_targets_more``.

Error rates and thresholds are fractions (0.01 = 1 pp).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from calibrate import distortion as dist
from calibrate import distributed as mp
from calibrate import stack as S
from calibrate import stages
from pask_jax import controller
from pask_jax import policy as P
from pask_jax import tags as T
from pask_jax import actions as Act

DEFAULT_THRESHOLDS = ((0.0, 0.0), (0.005, 0.01), (0.01, 0.02), (0.02, 0.05))


@dataclasses.dataclass
class Config:
  thresholds: Sequence[tuple[float, float]] = DEFAULT_THRESHOLDS
  prefill_thresholds: Sequence[tuple[float, float]] = DEFAULT_THRESHOLDS
  alpha_d: float = 0.05
  alpha_p: float = 0.02
  b_p_grid: Sequence[float] = (0.25, 0.33, 0.4, 0.5, 0.6, 0.75)
  path_points: int = 8
  reserve_k: int = 8
  reserve_beta: float = 0.8
  min_count: int = 1
  rows: int = 256
  max_tokens: int = 128
  sink: int = P.DEFAULT_SINK
  window: int = P.DEFAULT_WINDOW
  n_groups: int = 3
  targets: Sequence[float] = ()      # total-B targets: one variant policy each (B<t>/)
  windows: Sequence[int] = ()        # more recent windows W to evaluate decode candidates at
  ablation: str | None = None        # a Fig. 5 ablation (pask_jax.tags.ABLATIONS; see ABLATION)
  # The variant rule's tie band (pick_within): among the fits within keep_se binomial standard
  # errors of the most dev-accurate one, a composition that releases no prompt token wins.
  # 0: off (the paper's rule, the most accurate fit).  1 by default: on the 0.5B's test split the
  # band's pick at B 0.33 scored 77.8 against 71.7 for the releasing composition one dev case
  # ahead (Full KV 79.2); on the 1.5B's record it moves no pick (bench/RESULTS.md).
  keep_se: float = 1.0
  # Whether the target variants may compose the decode stage that releases nothing (every
  # generated token at L, target rule 3) besides the calibrated decode candidates.  False for
  # ablation comparisons: wherever keep-at-L wins, the variant's decode keys never act, and on
  # the 1.5B at B 0.20 the full method and no-transition became the same policy that way
  # (bench/RESULTS.md 2026-12-06, fourth).  False leaves keep-at-L out of both rounds (not only
  # the pick: a fitting keep-at-L row would stop the re-aiming of the variant's own overshooting
  # compositions), so the target stages are keyed by it.
  decode_keep: bool = True
  # A matched decode budget (the paper's ablations compare variants at one decode B): each
  # decode threshold's greedy path also offers the step whose nominal cost is nearest it, and
  # every target variant composes the decode candidate whose dev-measured decode B is nearest it
  # (keep-at-L left out).  None: each variant's own Alg. 1 composition.  Keys the dev stage
  # onwards (the candidate set changes) only where given.
  decode_b: float | None = None


# A prefill threshold pair under which every floor is R (V̄ are error-rate differences, <= 1):
# the floors no longer bound the prefill cost from below.
NO_FLOOR = (1.0, 1.0)
# How target candidates are made (part of the stages' fingerprint, so a stage saved under an older
# rule is not resumed under a new one).  2: H floors are lifted to L (release kept as strict as
# configured) before any floor is allowed to release.  3: also a decode stage that releases
# nothing (every generated token at L or above, :data:`KEEP`) to aim the prefill with.  4: also
# re-aims, for a reached target, the aimed compositions that overshot it yet beat every fit, and
# lifts the prefill floors as far as :data:`KEEP` (nothing of the prompt released).
TARGET_RULE = 4
# Decode thresholds under which every floor is L: V̄(q,R) >= V̄(q,L) >= 0 > -1 (no R floor) and
# V̄(q,L) <= 1 (no H floor).  Step 0 of its greedy path stores every generated token at INT4.
KEEP = (-1.0, 1.0)
MATCH_TOL = 0.005       # Config.decode_b: a decode candidate measured this near it is matched
MATCH_ROUNDS = 3        # re-aimed decode candidates evaluated at most (one dev run of 1 each)
MATCH_RULE = 1          # how they are re-aimed (match_decode), in the stages' keys with the above
PAIRS_PER_TARGET = 4     # estimated (decode, prefill) compositions evaluated per target
REAIM_MARGIN = 0.01      # re-aimed B_P lands this far under the target (estimate noise)


# What each ablation of the paper's Fig. 5 (§4.3, C.5) changes here, for the record.  Structural
# variants rebuild their buckets over the ablated keys (pask_jax.tags.coarsen; no-layer: one bucket
# per key for every layer group) and recalibrate Runtime-V and Runtime-D over them with the same
# split and single-bucket interventions; the component variants drop what they ablate.
ABLATION = {
    "no-floors": "no Runtime-V protection floors: every floor R (Runtime-V not run), one greedy "
                 "path from all-R by the D-ranking; the prefill likewise",
    "fixed-order": "floors kept; the D-ranking replaced by a fixed order (fixed_order: every "
                   "R->L before any L->H, layer-group round-robin within each, tags ascending) in "
                   "the greedy path, the stored priorities and the prefill (Runtime-D not run)",
    "no-class": "decode key without the token class (merged into a stand-in class)",
    "no-role": "decode key without the structural role (merged into a stand-in role)",
    "no-state": "decode key without the parser state and the lookahead (and so without Crit "
                "promotions); the reserve stays per parser-state id",
    "no-layer": "actions tied across the layer groups: one bucket per key for every group "
                "(interventions act on all groups; D summed over groups, costs too); the online "
                "budget still demotes and promotes per group",
    "no-transition": "decode tags replaced by request-local position bins (position_bins: ten "
                     "from the reference's completion lengths, each reached by 75% of every "
                     "category, the last absorbing the tail; pask_jax.tracker.PositionTracker "
                     "emits them with the unseen parser state, so the pooled reserve and no Crit); "
                     "prompt labels kept",
}
N_POSITION_BINS = 10
POSITION_REACH = 0.75


# ---- small pure pieces (unit-tested) ----------------------------------------------------------

def envelope(v_l: float, v_r: float) -> tuple[float, float]:
  """Eq. 5: (V̄(q,L), V̄(q,R))."""
  vl = max(0.0, v_l)
  return vl, max(vl, v_r)


def floor_of(vbar_l: float, vbar_r: float, tau: tuple[float, float]) -> int:
  """Eq. 6."""
  lo, hi = tau
  if vbar_l > hi:
    return Act.H
  if vbar_r <= lo:
    return Act.R
  return Act.L


def priorities(d: dict, nbar: dict, cost: np.ndarray, buckets: Sequence[tuple[int, int]]) -> dict:
  """Eq. 8: ρ[(id, g)] = (ρ(R→L), ρ(L→H)); ``d[(id, g, a)]`` with D(·, H) = 0."""
  out = {}
  for i, g in buckets:
    dr, dl = d[(i, g, Act.R)], d[(i, g, Act.L)]
    n = max(nbar[i], 1e-12)
    r2l = max(dr - dl, 0.0) / (n * (cost[Act.L, g] - cost[Act.R, g]))
    l2h = max(dl, 0.0) / (n * (cost[Act.H, g] - cost[Act.L, g]))
    out[(i, g)] = (r2l, l2h)
  return out


def fixed_order(buckets: Sequence[tuple[int, int]]) -> dict:
  """The fixed-order ablation's stand-in for Eq. 8: bucket k of the order ascending (tag id,
  group) — a layer-group round-robin over the tags — gets ρ = (2 − k/n, 1 − k/n), so every R→L
  upgrade ranks before any L→H one and each level goes round the groups tag by tag.  No
  distortion enters."""
  order = sorted(buckets)
  n = max(len(order), 1)
  return {b: (2.0 - k / n, 1.0 - k / n) for k, b in enumerate(order)}


def position_bins(lengths: dict[str, Sequence[int]], n_bins: int = 10,
                  reach: float = 0.75) -> list[int]:
  """The no-transition ablation's keys (C.5; :class:`pask_jax.tracker.PositionTracker`): ``n_bins``
  contiguous request-local position bins from Full-KV calibration completion lengths (per
  category), each reached by at least ``reach`` of the requests of every category, the last
  absorbing the tail.  Returns the bins' first positions (0-based decode index; position p is
  reached by a completion of n tokens when n > p), equal widths up to the start of the last bin,
  which is the largest position so reached; a ValueError if the completions are too short to
  give ``n_bins`` distinct bins."""
  if n_bins < 1 or not lengths or any(len(v) == 0 for v in lengths.values()):
    raise ValueError("position bins need n_bins >= 1 and completion lengths in every category")
  last = []
  for cat, ns in lengths.items():
    ns = np.sort(np.asarray(ns, np.int64))
    # The largest p with #{n > p} >= ⌈reach·N⌉: one less than the ⌈reach·N⌉-th largest n.
    k = len(ns) - math.ceil(reach * len(ns) - 1e-9)
    last.append(int(ns[k]) - 1)
  top = min(last)
  if top < n_bins - 1:
    raise ValueError(f"{n_bins} position bins each reached by {reach:.0%} of every category need "
                     f"completions of at least {n_bins} tokens there; the shortest category "
                     f"reaches position {top}")
  return [(j * top) // (n_bins - 1) for j in range(n_bins)]


def greedy_path(floors: dict, rho: dict) -> list[dict]:
  """Prop. 2: maps Θ_0 = floors ⪯ Θ_1 ⪯ … ⪯ all-high, one adjacent upgrade per step, the largest
  ρ_D first; ties by ascending (tag id, group), then R→L before L→H (one per bucket anyway)."""
  cur = dict(floors)
  path = [dict(cur)]
  while True:
    best = None
    for (i, g), a in sorted(cur.items()):
      if a >= Act.H:
        continue
      key = (-rho[(i, g)][a], i, g)
      if best is None or key < best[0]:
        best = (key, (i, g))
    if best is None:
      return path
    cur[best[1]] += 1
    path.append(dict(cur))


def check_targets(targets: Sequence[float]) -> tuple[float, ...]:
  """Total-B targets as given, each in (0, 1] and distinct at two decimals (they name ``B<t>``
  directories); anything else is a ValueError naming the bad value."""
  out, seen = [], set()
  for t in targets:
    if isinstance(t, bool) or not isinstance(t, (int, float, np.floating)) or not 0.0 < t <= 1.0:
      raise ValueError(f"target total B must be in (0, 1], got {t!r}")
    if f"{t:.2f}" in seen:
      raise ValueError(f"targets repeat B{t:.2f} (variants are named by two decimals)")
    seen.add(f"{t:.2f}")
    out.append(float(t))
  return tuple(out)


def check_windows(windows: Sequence[int]) -> tuple[int, ...]:
  """Recent windows as given: distinct integers >= 1 (else a ValueError naming the value)."""
  for w in windows:
    if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1:
      raise ValueError(f"recent window W must be an integer >= 1, got {w!r}")
  if len(set(windows)) != len(windows):
    raise ValueError(f"windows repeat: {list(windows)}")
  return tuple(int(w) for w in windows)


def pick_within(rows: Sequence[dict], target: float, *, keeps: Sequence[bool] | None = None,
                band: float = 0.0, n: int = 0) -> int | None:
  """The variant rule: among ``rows`` (each with dev ``acc`` and measured total B ``total``), the
  most accurate whose measured total is <= ``target``; ties go to the lower total, then to the
  earlier row.  None when no row fits.

  With ``band`` > 0 (``Config.keep_se``), ``keeps`` (per row: it releases no prompt token) and
  ``n`` dev cases: if a keeping row fits within ``band`` binomial standard errors
  (sqrt(a(1-a)/n) of the best accuracy a) of the most accurate fit, the most accurate such row
  wins instead.  A composition that releases prompt tokens then has to beat keeping them at INT4
  or better by more than the dev split's noise (one case of 120 is 0.8 pp): on the 0.5B's test
  split a releasing composition one dev case ahead lost 7 pp to uniform INT4."""
  ok = [j for j, r in enumerate(rows) if r["total"] <= target]
  if not ok:
    return None
  key = lambda j: (-rows[j]["acc"], rows[j]["total"], j)
  best = min(ok, key=key)
  if band > 0 and keeps is not None and n > 0:
    a = rows[best]["acc"]
    tol = band * math.sqrt(max(a * (1.0 - a), 0.0) / n) + 1e-12
    kept = [j for j in ok if keeps[j] and rows[j]["acc"] >= a - tol]
    if kept:
      return min(kept, key=key)
  return best


def keeps_prompt(p: dict | None) -> bool:
  """Whether a prefill stage (a composition's ``p``: its ``floors`` per (label, group); None:
  all-high) releases no prompt token: no floor R (the plan never goes below its floors).  By the
  floors, not the threshold's name: :meth:`Calibration.target_taus` drops a threshold whose
  floors repeat an earlier one's, so KEEP's floors may come under a configured pair."""
  return p is None or all(a != Act.R for a in p["floors"].values())


def to_reaim(measured: Sequence[dict], aimed: Sequence[dict], target: float
             ) -> tuple[list[int], bool]:
  """Round 2 of the variants for one target: which of the ``aimed`` rows (dev ``acc``, measured
  ``total``) to re-aim, and whether nothing ``measured`` fits under ``target`` yet.  Unreached:
  every aimed row.  Reached: the aimed rows that overshot yet are more accurate than everything
  that fits (they overshoot by measurement noise, often by less than 0.002 of B)."""
  best = max((r["acc"] for r in measured if r["total"] <= target), default=None)
  if best is None:
    return list(range(len(aimed))), True
  return [j for j, r in enumerate(aimed) if r["total"] > target and r["acc"] > best], False


def aim_prefill(target: float, prompt_share: float, decode_b: float) -> float:
  """B_P that puts the measured total at ``target`` when a share ``prompt_share`` of the tokens is
  prompt and the decode stage measures ``decode_b``:
  target = s · B_P + (1 − s) · B_D.  May be <= 0 (out of reach with that decode stage) or > 1."""
  return (target - (1.0 - prompt_share) * decode_b) / max(prompt_share, 1e-12)


def left_quantile(x: np.ndarray, beta: float) -> float:
  """The value at rank ⌈βN⌉ (1-based) of the sorted sample (Eq. 24, left empirical quantile)."""
  x = np.sort(np.asarray(x, np.float64))
  return float(x[max(1, math.ceil(beta * len(x))) - 1])


def deficits(f: np.ndarray, b: float, k: int) -> np.ndarray:
  """Eq. 16 for one reference trajectory (0-based u; h = 0 gives 0):
  S[u] = max_{0<=h<=min(K, T-1-u)} [Σ_{j=1..h} f[u+j] − h·b]_+"""
  n = len(f)
  out = np.zeros(n, np.float64)
  for u in range(n):
    acc, best = 0.0, 0.0
    for h in range(1, min(k, n - 1 - u) + 1):
      acc += f[u + h] - b
      best = max(best, acc)
    out[u] = best
  return out


def reserve(floor_costs: Sequence[np.ndarray], states: Sequence[np.ndarray], b: float,
            c_full: float,
            k: int, beta: float) -> tuple[dict[int, float], float, dict]:
  """Eq. 10 / 16 -> (Γ per state id, pooled Γ, samples per state) in units of C_full."""
  per: dict[int, list[float]] = {}
  pooled: list[float] = []
  for f, s in zip(floor_costs, states):
    d = deficits(np.asarray(f, np.float64), b, k)
    for u, x in enumerate(d):
      per.setdefault(int(s[u]), []).append(x)
      pooled.append(x)
  gam = {sid: left_quantile(v, beta) / c_full for sid, v in per.items() if sid >= 0}
  pool = left_quantile(pooled, beta) / c_full if pooled else 0.0
  return gam, pool, per


# ---- policies ---------------------------------------------------------------------------------

def policy_entries(maps: dict, floors: dict, rho: dict | None, G: int) -> dict[int, P.Entry]:
  """Per-bucket maps {(id, g): action} -> Entry per id, plus parent aggregates (max of children)."""
  ids = sorted({i for i, _ in maps})
  ent = {}
  for i in ids:
    a = [maps.get((i, g), Act.H) for g in range(G)]
    f = [floors.get((i, g), Act.H) for g in range(G)]
    pr = None
    if rho is not None:
      pr = [[rho.get((i, g), (math.nan, math.nan))[0], rho.get((i, g), (math.nan, math.nan))[1]]
            for g in range(G)]
    ent[i] = P.Entry(a, f, pr)
  agg: dict[int, tuple[list[int], list[int]]] = {}
  for i in ids:
    for p in T.parents(i)[1:]:
      if p in ent:
        continue
      a, f = agg.get(p, ([Act.R] * G, [Act.R] * G))
      agg[p] = ([max(x, y) for x, y in zip(a, ent[i].action)],
                [max(x, y) for x, y in zip(f, ent[i].floor)])
  for p, (a, f) in agg.items():
    ent[p] = P.Entry(a, f, None)
  return ent


def intervention(model_ident, tmpl: Config, i: int, g: int, a: int, others: Sequence[int],
                 tokenizer_hash=None, position_bins=None) -> P.FrozenPolicy:
  """π_{q,a} for q = (i, g): action = floor = a on q, H on every other observed id and group."""
  G, abl = tmpl.n_groups, tmpl.ablation
  ent = {o: P.Entry([Act.H] * G, [Act.H] * G) for o in others}
  # no-layer: a bucket is a key over every group, so its intervention acts on all of them.
  acts = [a if gg == g or abl == "no-layer" else Act.H for gg in range(G)]
  ent[i] = P.Entry(acts, acts)
  where = "all groups" if abl == "no-layer" else f"g{g}"
  return P.build(ent, model_ident, n_groups=G, b_d=1.0, b_p=1.0, sink=tmpl.sink,
                 window=tmpl.window, tokenizer_hash=tokenizer_hash, adapter="fc",
                 extra={"name": f"intervention {T.describe(i, abl)} {where} {Act.NAMES[a]}"},
                 ablation=abl, position_bins=position_bins)


@functools.partial(jax.jit)
def _resolve_all(pol, cands):
  a0, fl, _, _, _ = jax.vmap(lambda c: controller.resolve(pol, c))(cands)
  return jnp.maximum(a0, fl), fl


def resolve_rows(pol: P.FrozenPolicy, cands: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per token candidates int32[n, 4] -> (initial action max(a0, floor) [n, G], floor [n, G])."""
  if len(cands) == 0:
    G = pol.n_groups
    return np.zeros((0, G), np.int32), np.zeros((0, G), np.int32)
  n = len(cands)
  m = 1 << max(10, (n - 1).bit_length())          # padded (PAD rows) so shapes repeat: few compiles
  c = np.full((m, T.N_CAND), T.PAD, np.int32)
  c[:n] = cands
  # The record is static pytree metadata that differs per policy: dropped, so every policy of
  # the same shape reuses one compiled function.
  a, f = _resolve_all(pol.replace(record_json="{}"), jnp.asarray(c))
  return np.asarray(a)[:n], np.asarray(f)[:n]


# ---- the pipeline -----------------------------------------------------------------------------

class Calibration:
  """Algorithm 1 over a task's calibration and development requests.  See the module docstring.

  ``model``: a flax Decoder (``model.cfg``); ``cal`` / ``dev``: tasks (:mod:`calibrate.tasks`)
  sharing one parser-state vocabulary; ``out``: the output directory (``work/`` inside keeps the
  resumable stages).  ``runner_for(V, N)`` defaults to :func:`calibrate.stack.runner_factory`.
  """

  def __init__(self, model, tokenizer_hash: str | None, cal, dev, out: str, cfg: Config = Config(),
               *, capacity: int, backend: str = "auto", runner_for=None, progress=None,
               log: Callable[[str], None] = print, devices=None):
    self.model, self.cfg, self.cal, self.dev = model, cfg, cal, dev
    check_targets(cfg.targets)
    if cfg.decode_b is not None and not (isinstance(cfg.decode_b, (int, float)) and
                                         0.0 < cfg.decode_b <= 1.0):
      raise ValueError(f"decode_b must be in (0, 1], got {cfg.decode_b!r}")
    check_windows(cfg.windows)
    self.ablation = T.check_ablation(cfg.ablation)
    # no-layer: one bucket (i, 0) per key stands for every group; bcost is the bucket cost model.
    self.tied = self.ablation == "no-layer"
    self.bins = None      # no-transition: the position bins (set from the reference)
    self.ident = P.identity_of(model.cfg, tokenizer_hash)
    self.thash = tokenizer_hash
    self.out = out
    self.work = os.path.join(out, "work")
    # Across processes (calibrate.distributed) only process 0 reads and writes OUT; the stages
    # it loads are handed to the others, so every process resumes from the same state.
    self.main = mp.is_main()
    if self.main:
      os.makedirs(self.work, exist_ok=True)
    self.ref_policy = P.all_high(model.cfg, n_groups=cfg.n_groups, sink=cfg.sink,
                                 window=cfg.window, tokenizer_hash=tokenizer_hash)
    self.cost = np.asarray(self.ref_policy.cost, np.float64)
    self.c_full = float(self.cost[Act.H].sum())
    self.bcost = self.cost.sum(1, keepdims=True) if self.tied else self.cost
    self.runner_for = runner_for or S.runner_factory(model, self.ref_policy, capacity,
                                                     backend=backend, devices=devices)
    self._runner_args = (capacity, backend, devices)
    self._runners = {cfg.window: self.runner_for}   # per recent window (a stack shares one)
    self.progress = progress
    self.log = log
    self.timings: dict[str, float] = {}
    self.host: dict[str, float] = {}   # generate loops' host seconds (stack.generate_overlapped)
    self.keys = self._fingerprints()
    # Same model, tokenizer, cases and arguments on every process, before any shared step.
    mp.check_same("the calibration's inputs (model, tokenizer, cases, arguments)",
                  np.frombuffer(json.dumps(self.keys, sort_keys=True, default=str).encode(),
                                np.uint8))
    mp.from_main(self._check_work)

  # --- the ablation's policies (Config.ablation) ---
  def build(self, entries, *args, **kw) -> P.FrozenPolicy:
    """:func:`pask_jax.policy.build` under this run's ablation (entries keyed by ablated keys)."""
    return P.build(entries, *args, ablation=self.ablation, position_bins=self.bins, **kw)

  def expand(self, m: dict | None) -> dict | None:
    """Per-bucket values -> per (key, group): no-layer's bucket (i, 0) stands for every group."""
    if m is None or not self.tied:
      return m
    return {(i, g): v for (i, _), v in m.items() for g in range(self.cfg.n_groups)}

  def entries(self, maps: dict, floors: dict, rho: dict | None, G: int) -> dict[int, P.Entry]:
    """:func:`policy_entries` of per-bucket maps (expanded over the groups under no-layer)."""
    return policy_entries(self.expand(maps), self.expand(floors), self.expand(rho), G)

  def describe(self, i: int) -> str:
    return T.describe(i, self.ablation)

  def group_name(self, g: int) -> str:
    return "gall" if self.tied else f"g{g}"

  # --- persistence (calibrate.stages: fingerprinted .npz, no pickles) ---
  STAGES = ("reference", "runtime_v", "runtime_d", "dev", "dev_composed")
  # Written only with ``Config.windows`` (decode candidates at the other windows) and
  # ``Config.targets`` (compositions for the targets).
  OPTIONAL_STAGES = ("dev_windows", "dev_decode_matched", "dev_keep", "dev_targets",
                     "dev_targets_more")

  def _fingerprints(self) -> dict[str, dict]:
    """Per stage, what its saved numbers depend on (each later stage adds to the earlier)."""
    from models import fingerprint
    from pask_jax.grammar.frontier import xgrammar_version
    c = dataclasses.asdict(self.cfg)
    arg = lambda *names: {n: (list(map(list, c[n])) if n.endswith("thresholds") else
                              list(c[n]) if isinstance(c[n], (tuple, list)) else c[n])
                          for n in names}
    ref = {"model": fingerprint(self.model), "tokenizer": self.thash,
           "xgrammar": xgrammar_version(), "calibration_split": stages.task_fingerprint(self.cal),
           "args": arg("max_tokens", "sink", "window", "n_groups")}
    # The ablation only where given (full-method runs resume from earlier runs' stages) and only
    # in what it changes: never the reference (a variant may start from another's), Runtime-V
    # under the structural ablations, Runtime-D under those that change the keys (it measures
    # every group of a key at once, so no-layer's is the full method's; the component ablations
    # measure the same buckets).
    abl = arg("ablation") if c["ablation"] else {}
    runtime = {**ref, "args": {**ref["args"], **arg("min_count")}}
    runtime_v = {**runtime, "args": {**runtime["args"], **(
        abl if c["ablation"] not in T.COMPONENT_ABLATIONS else {})}}
    runtime_d = {**runtime, "args": {**runtime["args"], **(
        abl if c["ablation"] in T.KEY_ABLATIONS + ("no-transition",) else {})}}
    dev = {**runtime_v, "development_split": stages.task_fingerprint(self.dev),
           "args": {**runtime_v["args"], **arg("thresholds", "prefill_thresholds", "b_p_grid",
                                             "path_points", "reserve_k", "reserve_beta"), **abl,
                    **(arg("decode_b") if c["decode_b"] is not None else {})}}
    # Windows only where given, so that runs without them resume from earlier runs' stages.
    win = arg("windows") if c["windows"] else {}
    windows = {**dev, "args": {**dev["args"], **arg("windows")}}
    # The re-aim rule of a matched decode budget (match_decode) decides which candidates exist
    # after dev: it keys them and everything composed from them, where decode_b is given.
    match = ({"decode_match": [MATCH_TOL, MATCH_ROUNDS, MATCH_RULE]}
             if c["decode_b"] is not None else {})
    matched = {**windows, "args": {**windows["args"], **match}}
    composed = {**dev, "args": {**dev["args"], **arg("alpha_d", "alpha_p"), **win, **match}}
    # decode_keep only where off, so that runs with it resume from earlier runs' stages
    nokeep = {} if c["decode_keep"] else arg("decode_keep")
    targets = {**composed, "args": {**composed["args"], **arg("targets"), **nokeep,
                                    "target_rule": TARGET_RULE}}
    return {"reference": ref, "runtime_v": runtime_v, "runtime_d": runtime_d, "dev": dev,
            "dev_windows": windows, "dev_decode_matched": matched, "dev_composed": composed,
            "dev_keep": targets, "dev_targets": targets, "dev_targets_more": targets}

  def _check_work(self) -> None:
    """Before any work: refuse unkeyed pickles of older versions and every saved stage whose
    fingerprint differs from this run's."""
    old = sorted(f for f in os.listdir(self.work) if f.endswith(".pkl"))
    if old:
      raise stages.StageMismatch(
          f"{self.work} holds unkeyed stage pickles of an older pask-jax ({', '.join(old)}): "
          f"they cannot be checked against this model and task; delete {self.work} or use "
          "another --out")
    for name in self.STAGES + self.OPTIONAL_STAGES:
      f = stages.path(self.work, name)
      if os.path.exists(f):
        stages.check(f, name, self.keys[name])

  def _path(self, name):
    return os.path.join(self.work, name)

  def _load(self, name):
    blob = mp.from_main(lambda: stages.read(self.work, name, self.keys[name]))
    return None if blob is None else stages.decode(blob)

  def _save(self, name, obj):
    if self.main:
      stages.save(self.work, name, self.keys[name], obj)

  def runner_of(self, window: int | None):
    """The ``runner_for`` of policies with recent window ``window`` (None: Config.window)."""
    w = self.cfg.window if window is None else window
    if w not in self._runners:
      capacity, backend, devices = self._runner_args
      tmpl = P.all_high(self.model.cfg, n_groups=self.cfg.n_groups, sink=self.cfg.sink,
                        window=w, tokenizer_hash=self.thash)
      self._runners[w] = S.runner_factory(self.model, tmpl, capacity, backend=backend,
                                          devices=devices)
    return self._runners[w]

  def windows(self) -> list[int]:
    """The recent windows decode candidates are evaluated at: Config.window, then the others."""
    return [self.cfg.window] + [w for w in self.cfg.windows if w != self.cfg.window]

  def _run(self, task, policies, label, window=None):
    bar = self.progress(label, len(policies) * len(task.requests)) if self.progress else None
    t0 = time.perf_counter()
    res = S.run_stack(self.runner_of(window), task, policies, rows=self.cfg.rows,
                      max_tokens=self.cfg.max_tokens, progress=bar.update if bar else None,
                      timers=self.host)
    if bar:
      bar.close()
    self.timings[label] = self.timings.get(label, 0.0) + time.perf_counter() - t0
    return res

  @staticmethod
  def error(outcomes) -> float:
    return 1.0 - float(np.mean([o.passed for o in outcomes]))

  # --- stage 1: reference (saved with the parser-state vocabulary it grew) ---
  def reference(self):
    got = self._load("reference")
    if got is None:
      ref = self._run(self.cal, [self.ref_policy], "reference (cal)")[0]
      self._save("reference", {"outcomes": ref, "state_vocab": self.cal.vocab.keys()})
    else:
      ref = got["outcomes"]
      for k in got["state_vocab"]:
        self.cal.vocab(k)
    if self.ablation == "no-transition":
      ref = self._to_positions(ref)
    self.ref = ref
    return ref

  def _to_positions(self, ref):
    """no-transition: the position bins from the reference's completion lengths per category,
    and the reference's decode tags as those bins (stop tokens kept), states unseen (-1)."""
    by: dict[str, list[int]] = {}
    for r, o in enumerate(ref):
      by.setdefault(str(self.cal.category(r)), []).append(len(o.tokens))
    self.bins = tuple(position_bins(by, N_POSITION_BINS, POSITION_REACH))
    self.log(f"position bins (no-transition): first positions {list(self.bins)}")
    out = []
    for o in ref:
      n = len(o.tokens)
      tags = np.asarray(o.tags, np.int32)[:n].copy()
      for j in range(n):
        if not (tags[j] == T.STOP).any():
          tags[j] = T.candidates(T.position_id(T.position_bin(j, self.bins)))
      out.append(dataclasses.replace(o, tags=tags, states=np.full(n, -1, np.int32)))
    return out

  def _seq_cands(self, r: int, o) -> tuple[np.ndarray, np.ndarray]:
    """Reference request r: (prompt candidates [n_prompt, 4], decode candidates [n_dec, 4])."""
    req = self.cal.requests[r]
    pt = np.asarray(req.tags, np.int32)[:len(req.ids)]
    return pt, o.tags[:len(o.tokens)]

  # --- stage 2: buckets ---
  def buckets(self):
    dec: dict[int, int] = {}
    pre: dict[int, int] = {}
    key = T.key_table(self.ablation)      # tag id -> its (ablated) policy key
    for r, o in enumerate(self.ref):
      pt, dt = self._seq_cands(r, o)
      for cands, acc in ((pt[self.cfg.sink:], pre), (dt, dec)):
        valid = cands >= 0
        one = valid.sum(1) == 1
        for i in cands[one].max(axis=1):
          k = key[int(i)] if 0 <= i < T.N_IDS else int(i)
          acc[k] = acc.get(k, 0) + 1
    n = len(self.ref)
    keep = lambda c: {i: k / n for i, k in sorted(c.items()) if k >= self.cfg.min_count}
    self.nbar_dec, self.nbar_pre = keep(dec), keep(pre)
    G = self.cfg.n_groups
    gs = range(1 if self.tied else G)
    self.dec_buckets = [(i, g) for i in self.nbar_dec for g in gs]
    self.pre_buckets = [(i, g) for i in self.nbar_pre for g in gs]
    self.log(f"buckets: {len(self.nbar_dec)} decode tags, {len(self.nbar_pre)} prompt labels "
             f"x {len(gs)} groups" + (f" (ablation {self.ablation})" if self.ablation else ""))
    return self.dec_buckets, self.pre_buckets

  def interventions(self) -> list[tuple[str, int, int, int]]:
    out = []
    for kind, bk in (("decode", self.dec_buckets), ("prefill", self.pre_buckets)):
      for i, g in bk:
        for a in (Act.R, Act.L):
          out.append((kind, i, g, a))
    return out

  def intervention_policy(self, kind, i, g, a):
    others = [o for o in (self.nbar_dec if kind == "decode" else self.nbar_pre) if o != i]
    return intervention(self.ident, self.cfg, i, g, a, others, self.thash, self.bins)

  # --- stage 3: Runtime-V ---
  def runtime_v(self):
    if self.ablation == "no-floors":    # V only sets the floors, and there are none
      self.log("Runtime-V: not run (ablation no-floors)")
      self.V = {}
      return self.V
    done = self._load("runtime_v") or {}
    todo = [k for k in self.interventions() if k not in done]
    if todo:
      pols = [self.intervention_policy(*k) for k in todo]
      bar = self.progress("Runtime-V",
                          len(todo) * len(self.cal.requests)) if self.progress else None
      t0 = time.perf_counter()

      def save(idx, outs):
        for j, o in zip(idx, outs):
          done[todo[j]] = [x.passed for x in o]
        self._save("runtime_v", done)

      S.run_stack(self.runner_for, self.cal, pols, rows=self.cfg.rows,
                  max_tokens=self.cfg.max_tokens, progress=bar.update if bar else None,
                  on_chunk=save, timers=self.host)
      if bar:
        bar.close()
      self.timings["Runtime-V"] = time.perf_counter() - t0
    e_ref = self.error(self.ref)
    self.V = {k: (1.0 - float(np.mean(v))) - e_ref for k, v in done.items()}
    return self.V

  def vbar(self, kind, i, g):
    return envelope(self.V[(kind, i, g, Act.L)], self.V[(kind, i, g, Act.R)])

  # --- stage 4: Runtime-D ---
  def runtime_d(self):
    if self.ablation == "fixed-order":  # D only ranks the allocation, and the order is fixed
      self.log("Runtime-D: not run (ablation fixed-order)")
      self.D = {}
      self.rho_dec = fixed_order(self.dec_buckets)
      self.rho_pre = fixed_order(self.pre_buckets)
      return self.D
    got = self._load("runtime_d")
    if got is None:
      t0 = time.perf_counter()
      keys = [(kind, i, a) for kind, nb in (("decode", self.nbar_dec), ("prefill", self.nbar_pre))
              for i in nb for a in (Act.R, Act.L)]
      # One intervention per (tag, action) with every layer group at once; Eq. 7 sums per group.
      G = self.cfg.n_groups
      pols = []
      for kind, i, a in keys:
        others = [o for o in (self.nbar_dec if kind == "decode" else self.nbar_pre) if o != i]
        ent = {o: P.Entry([Act.H] * G, [Act.H] * G) for o in others}
        ent[i] = P.Entry([a] * G, [a] * G)
        pols.append(self.build(ent, self.ident, n_groups=G, sink=self.cfg.sink,
                               window=self.cfg.window))
      seqs = [list(self.cal.requests[r].ids) + list(o.tokens) for r, o in enumerate(self.ref)]
      total = np.zeros((len(keys), G))
      bar = self.progress("Runtime-D", len(seqs)) if self.progress else None
      gof = T.group_of_layer(self.model.cfg.n_layers, G)
      parts = [self._seq_cands(r, o) for r, o in enumerate(self.ref)]
      allp = np.concatenate([p for p, _ in parts], 0)
      alld = np.concatenate([d for _, d in parts], 0)
      cut_p = np.cumsum([len(p) for p, _ in parts])[:-1]
      cut_d = np.cumsum([len(d) for _, d in parts])[:-1]
      # acts[A][r]: [n_r, G] actions of request r's tokens (prompt: plan = floor; decode: Eq. 11)
      acts = []
      for pol in pols:
        fp = np.split(resolve_rows(pol, allp)[1], cut_p)
        ad = np.split(resolve_rows(pol, alld)[0], cut_d)
        acts.append([np.concatenate([x, y], 0) for x, y in zip(fp, ad)])
      # one padded size for every request and capture batch (T holds every sequence): each
      # compiles once
      n_q = [max(len(o.tokens) - 1, 0) for o in self.ref]
      padded = dist.size((len(s), len(p), d) for s, (p, _), d in zip(seqs, parts, n_q))
      for r in range(0, len(seqs), 8):
        chunk = seqs[r:r + 8]
        caps = dist.capture(self.model, chunk + chunk[:1] * (8 - len(chunk)), length=padded[0])
        caps = caps[:len(chunk)]
        for j, (q, k, v) in enumerate(caps):
          pt, _ = parts[r + j]
          act = np.stack([a[r + j] for a in acts])                     # [A, n, G]
          total += dist.distortion(q, k, v, act, len(pt), n_q[r + j], sink=self.cfg.sink,
                                   window=self.cfg.window, group_of=gof, n_groups=G,
                                   padded=padded)
          if bar:
            bar.update(1)
      if bar:
        bar.close()
      total /= len(seqs)
      got = {}
      for (kind, i, a), row in zip(keys, total):
        for g in range(G):
          got[(kind, i, g, a)] = float(row[g])
      self._save("runtime_d", got)
      self.timings["Runtime-D"] = time.perf_counter() - t0
    self.D = got
    # Per bucket (no-layer: summed over the groups, as Eq. 7 sums over the layers of a bucket).
    gs = range(self.cfg.n_groups) if self.tied else None
    dsum = lambda kind, i, g, a: (sum(got[(kind, i, h, a)] for h in gs) if self.tied
                                  else got[(kind, i, g, a)])
    dd = {(i, g, a): dsum("decode", i, g, a)
          for (i, g) in self.dec_buckets for a in (Act.R, Act.L)}
    dp = {(i, g, a): dsum("prefill", i, g, a)
          for (i, g) in self.pre_buckets for a in (Act.R, Act.L)}
    self.rho_dec = priorities(dd, self.nbar_dec, self.bcost, self.dec_buckets)
    self.rho_pre = priorities(dp, self.nbar_pre, self.bcost, self.pre_buckets)
    return got

  # --- stage 5: decode candidates ---
  def floors(self, kind, tau) -> dict:
    bk = self.dec_buckets if kind == "decode" else self.pre_buckets
    if self.ablation == "no-floors":
      return {b: Act.R for b in bk}
    return {(i, g): floor_of(*self.vbar(kind, i, g), tau) for i, g in bk}

  def thresholds(self, kind: str) -> list[tuple[float, float]]:
    """The configured threshold pairs; no-floors: one (:data:`NO_FLOOR`; its floors are all R,
    so the others would repeat its path)."""
    if self.ablation == "no-floors":
      return [NO_FLOOR]
    return [tuple(t) for t in (self.cfg.thresholds if kind == "decode"
                               else self.cfg.prefill_thresholds)]

  def _ref_decode(self):
    c = [self._seq_cands(r, o)[1] for r, o in enumerate(self.ref)]
    s = [o.states[:len(o.tokens)] for o in self.ref]
    return c, s

  def nominal(self, pol, cands_list) -> float:
    """Nominal reference-trajectory decode cost ratio of a policy's initial actions (Prop. 2)."""
    allc = np.concatenate(cands_list, 0)
    a, _ = resolve_rows(pol, allc)
    G = self.cfg.n_groups
    bits = self.cost[a, np.arange(G)[None]].sum()
    return float(bits / (self.c_full * max(len(allc), 1)))

  def decode_candidates(self):
    cands, states = self._ref_decode()
    out = []
    for tau in self.thresholds("decode"):
      out += self._decode_path(tau, cands, states)
    # The same candidates at the other recent windows (Config.windows), after these.
    out += [{**c, "window": w, "policy": self._decode_policy(c, w)}
            for w in self.windows()[1:] for c in list(out)]
    self.dec_cands = out
    return out

  def _decode_path(self, tau, cands, states, steps: Sequence[int] | None = None) -> list[dict]:
    """Decode candidates on the greedy path from the floors of ``tau``: ``path_points`` steps
    evenly spaced in nominal cost, or the given ``steps``; each with its reserve Γ and policy."""
    G = self.cfg.n_groups
    f = self.floors("decode", tau)
    path = greedy_path(f, self.rho_dec)

    def nominal(m) -> float:
      pol = self.build(self.entries(m, f, None, G), self.ident, n_groups=G, sink=self.cfg.sink,
                       window=self.cfg.window)
      return self.nominal(pol, cands)

    if steps is None:
      noms = [nominal(m) for m in path]
      steps = pick_points(noms, self.cfg.path_points)
      if self.cfg.decode_b is not None:   # the step nearest the matched decode budget too
        near = int(np.argmin([abs(x - self.cfg.decode_b) for x in noms]))
        steps = sorted(set(steps) | {near})
    else:
      noms = {j: nominal(path[j]) for j in steps}
    fpol = self.build(self.entries(f, f, None, G), self.ident, n_groups=G)
    fcost = []
    for c in cands:
      _, fl = resolve_rows(fpol, c)
      fcost.append(self.cost[fl, np.arange(G)[None]].sum(1) if len(c) else np.zeros(0))
    out = []
    for j in steps:
      b_d = noms[j]
      gam, pooled, _ = reserve(fcost, states, b_d * self.c_full, self.c_full,
                               self.cfg.reserve_k, self.cfg.reserve_beta)
      c = {"tau": tuple(tau), "step": j, "path_len": len(path), "nominal_b": b_d,
           "path_nominal": noms if isinstance(noms, list) else [noms[j]], "floors": f,
           "map": path[j], "gamma": gam, "pooled": pooled, "window": self.cfg.window}
      out.append({**c, "policy": self._decode_policy(c, self.cfg.window)})
    return out

  def decode_keep(self) -> tuple[int, list]:
    """(index in ``dec_cands``, dev outcomes) of the decode stage that releases nothing: step 0
    of the path from the :data:`KEEP` floors, every generated token at L (sinks and the recent
    window H), with the prefill all-high (stage ``dev_keep``).  Where INT4 is nearly lossless,
    aiming the prefill with it beats a decode stage that releases (target rule 3)."""
    c = self._decode_path(KEEP, *self._ref_decode(), steps=[0])[0]
    self.dec_cands.append(c)
    pol = self.compose(c, None, {"name": "decode kept at L"})
    return len(self.dec_cands) - 1, self._dev_eval("dev_keep", [pol], [pol.window])[0]

  def _decode_policy(self, c: dict, window: int) -> P.FrozenPolicy:
    G, cfg = self.cfg.n_groups, self.cfg
    name = f"decode tau={c['tau']} step {c['step']}/{c['path_len'] - 1}"
    return self.build(self.entries(c["map"], c["floors"], self.rho_dec, G), self.ident, n_groups=G,
                      b_d=c["nominal_b"], b_p=1.0, reserve=c["gamma"], pooled=c["pooled"],
                      sink=cfg.sink, window=window, tokenizer_hash=self.thash, adapter="fc",
                      thresholds={"decode": list(c["tau"])}, reserve_k=cfg.reserve_k,
                      reserve_beta=cfg.reserve_beta,
                      extra={"name": name + ("" if window == cfg.window else f" W={window}")})

  def _dev_eval(self, name, policies, windows=None):
    """Dev outcomes of ``policies`` (saved as stage ``name``); ``windows``: each policy's recent
    window where they differ (one stacked run per window, the stage saved after each)."""
    done = self._load(name) or {}
    windows = windows or [self.cfg.window] * len(policies)
    for w in dict.fromkeys(windows):
      todo = [j for j in range(len(policies)) if j not in done and windows[j] == w]
      if todo:
        res = self._run(self.dev, [policies[j] for j in todo], name, window=w)
        for j, r in zip(todo, res):
          done[j] = [dataclasses.replace(o, tags=None, states=None) for o in r]
        self._save(name, done)
    return [done[j] for j in range(len(policies))]

  @staticmethod
  def stage_cost(outcomes, stage: str) -> float:
    """Measured cost ratio over requests (actual lengths): Σ bits / Σ Full-KV bits."""
    bits = sum(o.ledger[f"{stage}_bits"] for o in outcomes)
    n = "n_gen" if stage == "decode" else "n_prompt"
    full = sum(o.ledger[n] for o in outcomes)
    c_full = outcomes[0].ledger["full_kv_bits"] / max(outcomes[0].ledger["n_prompt"] +
                                                      outcomes[0].ledger["n_gen"], 1)
    return bits / (full * c_full) if full else float("nan")

  def select(self, stage, cands, results, ref_res, alpha):
    e_ref = self.error(ref_res)
    rows = []
    for c, r in zip(cands, results):
      rows.append({"err": self.error(r), "cost": self.stage_cost(r, stage),
                   "total": total_b(r), "acc": 1 - self.error(r)})
    ok = [j for j, r in enumerate(rows) if r["err"] - e_ref <= alpha + 1e-12]
    best = min(ok, key=lambda j: (rows[j]["cost"], j)) if ok else None
    return best, rows, e_ref

  # --- stage 7: prefill candidates ---
  def prefill_candidates(self):
    G = self.cfg.n_groups
    out = []
    for tau in self.thresholds("prefill"):
      f = self.floors("prefill", tau)
      for b_p in self.cfg.b_p_grid:
        pol = self.build(self.entries(f, f, self.rho_pre, G), self.ident, n_groups=G, b_d=1.0,
                         b_p=b_p,
                         sink=self.cfg.sink, window=self.cfg.window, tokenizer_hash=self.thash,
                         adapter="prompt", thresholds={"prefill": list(tau)},
                         extra={"name": f"prefill tau={tau} B_P={b_p}"})
        out.append({"tau": tuple(tau), "b_p": b_p, "policy": pol, "floors": f})
    self.pre_cands = out
    return out

  # --- everything ---
  def run(self) -> dict:
    t_all = time.perf_counter()
    cfg = self.cfg
    self.reference()
    self.log(f"reference: cal accuracy {1 - self.error(self.ref):.3f} on {len(self.ref)} requests")
    self.buckets()
    self.runtime_v()
    self.runtime_d()
    dec = self.decode_candidates()
    pre = self.prefill_candidates()
    # Development: π_ref, decode candidates, prefill candidates (one stacked evaluation); the
    # decode candidates at other windows in one more per window.
    n = len(dec) // len(self.windows())
    pols = [self.ref_policy] + [c["policy"] for c in dec[:n]] + [c["policy"] for c in pre]
    res = self._dev_eval("dev", pols)
    ref_dev, dec_res, pre_res = res[0], res[1:1 + n], res[1 + n:]
    if len(dec) > n:
      dec_res = dec_res + self._dev_eval("dev_windows", [c["policy"] for c in dec[n:]],
                                         [c["window"] for c in dec[n:]])
    dec_res = self.match_decode(dec, dec_res)
    di, drows, e_ref = self.select("decode", dec, dec_res, ref_dev, cfg.alpha_d)
    pi, prows, _ = self.select("prefill", pre, pre_res, ref_dev, cfg.alpha_p)
    self.log(f"dev: reference accuracy {1 - e_ref:.3f}; decode pick {di}, prefill pick {pi}")
    d_pick = None if di is None else dec[di]
    p_pick = None if pi is None else pre[pi]
    record = self.record(dec, drows, di, pre, prows, pi, e_ref)
    final = self.compose(d_pick, p_pick, {"name": "calibrated"})
    b_d = 1.0 if d_pick is None else float(d_pick["policy"].b_d)
    b_p = 1.0 if p_pick is None else p_pick["b_p"]
    comp = self._dev_eval("dev_composed", [final], [final.window])[0]
    record["composed"] = {"dev_accuracy": 1 - self.error(comp),
                          "dev_reference_accuracy": 1 - e_ref,
                          "measured_B_total": total_b(comp),
                          "measured_B_prefill": self.stage_cost(comp, "prefill"),
                          "measured_B_decode": self.stage_cost(comp, "decode"),
                          "b_d": b_d, "b_p": b_p, "window": int(final.window)}
    variants = []
    if cfg.targets:
      pool = self._measured_pool(dec, dec_res, pre, pre_res, ref_dev, di, pi, comp)
      variants, evaluated = self.variants(pool, dec, dec_res, pre, pre_res, ref_dev, di, e_ref)
      record["variants"] = [v["record"] for v in variants]
      record["target_candidates"] = evaluated
    self.timings["total"] = time.perf_counter() - t_all
    record["timings_s"] = dict(self.timings)
    record["generate_host_s"] = dict(self.host)   # launch / wait / host seconds, steps
    mp.check_same("the selected policy", [final] + [v["policy"] for v in variants
                                                    if "policy" in v])
    if mp.count() > 1:
      record["processes"] = mp.count()
    if self.main:
      P.save(final, os.path.join(self.out, "policy"))
      self._write_variants(variants)
      with open(os.path.join(self.out, "calibration.json"), "w") as f:
        json.dump(record, f, indent=1, sort_keys=True, default=float)
    self.final, self.record_ = final, record
    return record

  def composed_entries(self, d: dict | None, p: dict | None) -> dict[int, P.Entry]:
    """The entries :meth:`compose` packs: decode candidate ``d``'s then prefill candidate
    ``p``'s (None: none of that stage)."""
    G = self.cfg.n_groups
    d_ent = {} if d is None else self.entries(d["map"], d["floors"], self.rho_dec, G)
    p_ent = {} if p is None else self.entries(p["floors"], p["floors"], self.rho_pre, G)
    return {**d_ent, **p_ent}

  def compose(self, d: dict | None, p: dict | None, extra: dict) -> P.FrozenPolicy:
    """One policy from decode candidate ``d`` (None: all-high decode) and prefill candidate ``p``
    (``floors``, ``b_p``, ``tau``; None: all-high prefill), packed as the selection is."""
    cfg, G = self.cfg, self.cfg.n_groups
    window = cfg.window if d is None else d["window"]
    if d is None:
      b_d, gam, pooled, tau_d = 1.0, {}, 0.0, None
    else:
      pol = d["policy"]
      b_d, tau_d = float(pol.b_d), list(d["tau"])
      gam = {i: float(x) for i, x in enumerate(np.asarray(pol.reserve))}
      pooled = float(pol.pooled)
    if p is None:
      b_p, tau_p = 1.0, None
    else:
      b_p, tau_p = p["b_p"], list(p["tau"])
    return self.build(self.composed_entries(d, p), self.ident, n_groups=G, b_d=b_d, b_p=b_p,
                      reserve=gam,
                      pooled=pooled, sink=cfg.sink, window=window, tokenizer_hash=self.thash,
                      adapter="fc+prompt", thresholds={"decode": tau_d, "prefill": tau_p},
                      reserve_k=cfg.reserve_k, reserve_beta=cfg.reserve_beta,
                      extra={"state_vocab": self.cal.vocab.keys(), "alpha_d": cfg.alpha_d,
                             "alpha_p": cfg.alpha_p, **extra})

  # --- total-B variants (Config.targets) ---
  def dev_row(self, outcomes) -> dict:
    """Dev accuracy and measured B (total, prefill, decode) of one evaluated policy."""
    return {"acc": 1 - self.error(outcomes), "total": total_b(outcomes),
            "prefill": self.stage_cost(outcomes, "prefill"),
            "decode": self.stage_cost(outcomes, "decode")}

  def _source(self, kind, stage, dj, p, pk=None, relaxed=False) -> dict:
    """How a composition was made, for the record (decode candidate index / prefill candidate)."""
    dec = "all-high" if dj is None else {
        "index": dj, "tau": list(self.dec_cands[dj]["tau"]), "step": self.dec_cands[dj]["step"],
        "b_d": float(self.dec_cands[dj]["nominal_b"]), "window": self.dec_cands[dj]["window"]}
    pre = "all-high" if p is None else {"index": pk, "tau": list(p["tau"]),
                                        "b_p": float(p["b_p"]), "keeps_prompt": keeps_prompt(p)}
    return {"kind": kind, "stage": stage, "decode": dec, "prefill": pre, "floors_relaxed": relaxed}

  def _measured_pool(self, dec, dec_res, pre, pre_res, ref_dev, di, pi, comp) -> list[dict]:
    """Every composition already measured on dev: π_ref, each decode candidate (prefill
    all-high), each prefill candidate (decode all-high) and the calibrated policy."""
    pool = [{"d": None, "p": None, "dev": self.dev_row(ref_dev),
             "source": self._source("reference", "dev", None, None)}]
    for j, r in enumerate(dec_res):
      pool.append({"d": j, "p": None, "dev": self.dev_row(r),
                   "source": self._source("decode candidate", "dev", j, None)})
    for k, r in enumerate(pre_res):
      pool.append({"d": None, "p": pre[k], "dev": self.dev_row(r),
                   "source": self._source("prefill candidate", "dev", None, pre[k], k)})
    pool.append({"d": di, "p": None if pi is None else pre[pi], "dev": self.dev_row(comp),
                 "source": self._source("calibrated", "dev_composed", di,
                                        None if pi is None else pre[pi], pi)})
    return pool

  def target_taus(self) -> list[tuple[tuple[float, float], str]]:
    """Prefill thresholds for candidates aimed at a target: the configured ones, then relaxed ones
    in two steps.  First the H floors are lifted to L while release stays as strict as the
    strictest configured threshold: (lo, q) at the quartiles of the prefill V̄(q, L) and (lo, 1)
    (no H floor) — a stored INT4 token costs about a quarter of an H one, and where INT4 is
    nearly lossless (centered keys) keeping every prompt token at L or above beats releasing
    some; last :data:`KEEP` (every floor L: uniform INT4 of the prompt, the budget above its
    cost spent on H by priority).  Then floors that may release: (q, q) at the quartiles of the
    prefill V̄(q, R), and :data:`NO_FLOOR`.  Each with its step ("configured", "lift" or
    "release"); thresholds whose floors repeat earlier ones are left out.  no-floors: the one
    threshold of :meth:`thresholds` (there are no floors to relax)."""
    if self.ablation == "no-floors":
      return [(NO_FLOOR, "configured")]
    vb = [self.vbar("prefill", i, g) for i, g in self.pre_buckets]
    vl, vr = sorted(v[0] for v in vb), sorted(v[1] for v in vb)
    lo = min((float(t[0]) for t in self.cfg.prefill_thresholds), default=0.0)
    lift = ([(lo, max(lo, float(np.quantile(vl, q)))) for q in (0.5, 0.75)] if vl else [])
    lift += [(lo, 1.0), KEEP]
    loose = [(float(np.quantile(vr, q)),) * 2 for q in (0.25, 0.5, 0.75)] if vr else []
    out, seen = [], []
    for tau, step in ([(tuple(t), "configured") for t in self.cfg.prefill_thresholds] +
                      [(t, "lift") for t in lift] +
                      [(t, "release") for t in loose + [NO_FLOOR]]):
      f = self.floors("prefill", tau)
      if f in seen:
        continue
      seen.append(f)
      out.append((tau, step))
    return out

  def prefill_floor_cost(self, floors: dict) -> float:
    """Nominal dev prefill cost ratio with every prompt token at its floor (sinks H): the least
    any B_P reaches under these floors."""
    G = self.cfg.n_groups
    pol = self.build(self.entries(floors, floors, None, G), self.ident, n_groups=G,
                     sink=self.cfg.sink, window=self.cfg.window)
    parts = [np.asarray(r.tags, np.int32)[:len(r.ids)] for r in self.dev.requests
             if r.tags is not None]
    if not parts:
      return 1.0
    fl = np.split(resolve_rows(pol, np.concatenate(parts, 0))[1], np.cumsum(
        [len(x) for x in parts])[:-1])
    bits = 0.0
    for f in fl:
      f = f.copy()
      f[:self.cfg.sink] = Act.H
      bits += self.cost[f, np.arange(G)[None]].sum()
    return float(bits / (self.c_full * max(sum(len(x) for x in parts), 1)))

  @staticmethod
  def prompt_share(outcomes) -> float:
    n_p = sum(o.ledger["n_prompt"] for o in outcomes)
    return n_p / max(n_p + sum(o.ledger["n_gen"] for o in outcomes), 1)

  def aimed(self, t: float, dec_opts, relax: bool) -> list[dict]:
    """Compositions aimed at total B ``t``: per decode option (index or None, its dev outcomes)
    B_P solved from the measured prompt share and decode cost (:func:`aim_prefill`), per prefill
    threshold of :meth:`target_taus` (without ``relax`` the configured ones and those that lift
    H floors to L; with ``relax`` those that may release) whose floors fit under
    that B_P (the no-floor one always)."""
    out = []
    for dj, outs in dec_opts:
      b_p = aim_prefill(t, self.prompt_share(outs), self.stage_cost(outs, "decode"))
      if b_p <= 0:
        continue
      b_p = min(b_p, 1.0)
      for tau, step in self.target_taus():
        if (step == "release") != relax:
          continue
        relaxed = step != "configured"
        f = self.floors("prefill", tau)
        if tau != NO_FLOOR and self.prefill_floor_cost(f) > b_p:
          continue
        out.append({"target": t, "d": dj, "p": {"tau": tau, "b_p": b_p, "floors": f},
                    "relaxed": relaxed, "step": step, "share": self.prompt_share(outs)})
    return out

  def _eval_items(self, stage: str, items: list[dict], kind: str) -> list[dict]:
    """Evaluate compositions on dev in one stacked run (saved as ``stage``); pool rows back."""
    pols = [self.compose(None if it["d"] is None else self.dec_cands[it["d"]], it["p"],
                         {"name": f"{kind} for B {it['target']:.2f}"}) for it in items]
    res = self._dev_eval(stage, pols, [p.window for p in pols]) if pols else []
    rows = []
    for it, r in zip(items, res):
      src = self._source(it.get("kind", kind), stage, it["d"], it["p"], it.get("pk"),
                         it.get("relaxed", False))
      rows.append({**it, "dev": self.dev_row(r), "source": {**src, "aimed_at": it["target"]}})
    return rows

  def match_decode(self, dec: list[dict], dec_res: list) -> list:
    """With ``Config.decode_b``: re-aim the decode candidate measured nearest it until one
    lands within :data:`MATCH_TOL` (at most :data:`MATCH_ROUNDS` more dev evaluations, stage
    ``dev_decode_matched``).  A path step's dev-measured decode B differs from its nominal one
    (measured on the model's own trajectory, under the controller), by 15% for no-transition's
    position bins on the 1.5B: the step nearest ``decode_b`` in nominal cost then measures well
    under it.  Each round takes the step of that candidate's path whose nominal cost is nearest
    ``nominal · decode_b / measured``.  Appends to ``dec`` (the candidates, ``aim`` "matched")
    and returns ``dec_res`` with their outcomes."""
    b = self.cfg.decode_b
    if b is None or not dec_res:
      return dec_res
    cands, states = self._ref_decode()
    added: list[dict] = []
    res = list(dec_res)
    for _ in range(MATCH_ROUNDS):
      j = self.matched_decode(res)
      c, got = dec[j], self.stage_cost(res[j], "decode")
      if abs(got - b) <= MATCH_TOL or not got > 0 or len(c["path_nominal"]) < 2:
        break
      noms = c["path_nominal"]
      want = c["nominal_b"] * b / got
      k = int(np.argmin([abs(x - want) for x in noms]))
      if any(tuple(x["tau"]) == tuple(c["tau"]) and x["step"] == k and
             x["window"] == c["window"] for x in dec):
        break                               # the path has no step nearer than those measured
      new = self._decode_path(c["tau"], cands, states, steps=[k])[0]
      new = {**new, "path_nominal": noms, "window": c["window"], "aim": "matched",
             "policy": self._decode_policy(new, c["window"])}
      added.append(new)
      dec.append(new)
      out = self._dev_eval("dev_decode_matched", [x["policy"] for x in added],
                           [x["window"] for x in added])
      res = list(dec_res) + out
    if added:
      j = self.matched_decode(res)
      self.log(f"decode B matched to {b:g}: candidate {j} (tau {tuple(dec[j]['tau'])}, step "
               f"{dec[j]['step']}) measured {self.stage_cost(res[j], 'decode'):.4f} after "
               f"{len(added)} re-aimed step(s)")
    return res

  def matched_decode(self, dec_res) -> int | None:
    """With ``Config.decode_b``: the decode candidate at ``Config.window`` whose dev-measured
    decode B is nearest it (ties: the more dev-accurate, then the lower index); else None."""
    if self.cfg.decode_b is None or not dec_res:
      return None

    def key(j):
      off = abs(self.stage_cost(dec_res[j], "decode") - self.cfg.decode_b)
      return (off if np.isfinite(off) else np.inf, self.error(dec_res[j]), j)

    # at the run's own window W: a matched comparison of variants is at one W too
    mine = [j for j in range(len(dec_res)) if self.dec_cands[j]["window"] == self.cfg.window]
    return min(mine or range(len(dec_res)), key=key)

  def variants(self, pool, dec, dec_res, pre, pre_res, ref_dev, di, e_ref):
    """One policy per target t of ``Config.targets``: the most dev-accurate composition whose
    dev-measured total B is <= t (:func:`pick_within`) among everything measured on dev.

    Round 1 (stage ``dev_targets``) adds, per target, the compositions of a decode and a prefill
    candidate whose estimate (:func:`composed_estimate`) fits under t, the most accurate first,
    and compositions aimed at t (:meth:`aimed`) under the configured floors; where none of these
    nor anything measured fits, aimed ones under relaxed floors.  Round 2 (``dev_targets_more``),
    for a target nothing measured reaches yet: aimed compositions under relaxed floors, and the
    round-1 aimed ones re-aimed by their measured overshoot; for a target already reached, the
    round-1 aimed ones that overshot it yet are more accurate than everything that fits,
    re-aimed likewise.  With ``Config.decode_b`` every composition uses the one decode candidate
    of :meth:`matched_decode` (the measured pool too, keep-at-L left out), so that variants of
    different ablations compare at one decode B.  Returns (variants, evaluated)."""
    cfg = self.cfg
    est = [(dj, pk) + composed_estimate(d_out, p_out)
           for dj, d_out in enumerate(dec_res) for pk, p_out in enumerate(pre_res)]
    cheapest = min(range(len(dec_res)), key=lambda j: (self.stage_cost(dec_res[j], "decode"), j),
                   default=None)
    dec_opts = [(di, ref_dev if di is None else dec_res[di])]
    if cheapest is not None and cheapest != di:
      dec_opts.append((cheapest, dec_res[cheapest]))
    matched = self.matched_decode(dec_res)
    if matched is not None:   # one decode stage for every target: the matched decode budget
      dec_opts = [(matched, dec_res[matched])]
      est = [e for e in est if e[0] == matched]
      pool = [r for r in pool if r["d"] == matched]
    kept = []
    if cfg.decode_keep and matched is None:
      kj, keep_res = self.decode_keep()
      dec_opts.append((kj, keep_res))
      kept = [{"d": kj, "p": None, "dev": self.dev_row(keep_res), "target": None,
               "source": self._source("decode kept", "dev_keep", kj, None)}]
    reached = lambda t, rows: any(r["dev"]["total"] <= t for r in rows)
    seen: set = set()

    def add(into: list, its) -> None:     # each composition evaluated once over both rounds
      for it in its:
        key = (it["d"], it.get("pk"), tuple(it["p"]["tau"]), round(float(it["p"]["b_p"]), 6))
        if key not in seen:
          seen.add(key)
          into.append(it)

    items: list[dict] = []
    for t in cfg.targets:
      fit = sorted((e for e in est if e[2] <= t), key=lambda e: (-e[3], e[2], e[0], e[1]))
      add(items, ({"target": t, "d": dj, "p": pre[pk], "pk": pk, "kind": "pair",
                   "estimate": {"total": b, "acc": acc}}
                  for dj, pk, b, acc in fit[:PAIRS_PER_TARGET]))
      # The B_P grid is coarse: a B_P aimed at t spends the budget (configured floors).
      near = [{**it, "kind": "aimed"} for it in self.aimed(t, dec_opts, relax=False)]
      add(items, near)
      if not fit and not near and not reached(t, pool):
        add(items, ({**it, "kind": "aimed"} for it in self.aimed(t, dec_opts, relax=True)))
    first = kept + self._eval_items("dev_targets", items, "pair")
    more: list[dict] = []

    def reaim(r: dict, t: float) -> None:   # B_P lowered by the measured overshoot
      b_p = r["p"]["b_p"] - (r["dev"]["total"] - t) / max(r["share"], 1e-12) - REAIM_MARGIN
      if b_p > 0:
        again = {k: v for k, v in r.items() if k not in ("dev", "source")}
        add(more, [{**again, "kind": "re-aimed", "p": {**r["p"], "b_p": b_p}}])

    for t in cfg.targets:
      mine = [r for r in first if r["target"] == t and r.get("kind") == "aimed"]
      again, unreached = to_reaim([r["dev"] for r in pool + first], [r["dev"] for r in mine], t)
      if unreached and not any(r.get("step") == "release" for r in mine):
        add(more, ({**it, "kind": "aimed"} for it in self.aimed(t, dec_opts, relax=True)))
      for j in again:
        reaim(mine[j], t)
    second = self._eval_items("dev_targets_more", more, "aimed")
    rows = pool + first + second
    out = []
    keeps = [keeps_prompt(r["p"]) for r in rows]
    dev_rows = [r["dev"] for r in rows]
    for t in cfg.targets:
      j = pick_within(dev_rows, t, keeps=keeps, band=cfg.keep_se, n=len(self.dev.requests))
      j0 = pick_within(dev_rows, t)
      if j is None:
        low = min(r["total"] for r in dev_rows)
        self.log(f"target B {t:.2f} not reached on dev (lowest measured total B {low:.3f}): "
                 "no variant written")
        out.append({"target": t, "record": {"target": t, "reached": False, "policy": None,
                                            "lowest_measured_B_total": low}})
        continue
      r = rows[j]
      dv, src = r["dev"], r["source"]
      info = {"target": t, "reached": True, "policy": f"policy/B{t:.2f}",
              "dev_accuracy": dv["acc"], "dev_reference_accuracy": 1 - e_ref,
              "measured_B_total": dv["total"], "measured_B_prefill": dv["prefill"],
              "measured_B_decode": dv["decode"], "from": src,
              "floors_relaxed": src["floors_relaxed"]}
      if j != j0:   # the tie band moved the pick: what the rule without it chose
        info["keep_band"] = {"keep_se": cfg.keep_se, "without": {
            "dev_accuracy": rows[j0]["dev"]["acc"], "measured_B_total": rows[j0]["dev"]["total"],
            "from": rows[j0]["source"]}}
        self.log(f"target B {t:.2f}: the tie band ({cfg.keep_se:g} s.e.) keeps the prompt "
                 f"(dev {dv['acc']:.3f}) over a composition that releases (dev "
                 f"{rows[j0]['dev']['acc']:.3f})")
      d = None if r["d"] is None else dec[r["d"]]
      pol = self.compose(d, r["p"], {"name": f"calibrated B{t:.2f}", "variant": info})
      info.update(b_d=float(pol.b_d), b_p=float(pol.b_p))
      self.log(f"variant B{t:.2f}: dev accuracy {dv['acc']:.3f}, measured B {dv['total']:.3f} "
               f"(prefill {dv['prefill']:.3f}, decode {dv['decode']:.3f}) from {src['kind']}"
               + (", floors relaxed" if src["floors_relaxed"] else ""))
      out.append({"target": t, "record": info, "policy": pol})
    evaluated = [{"source": r["source"], "dev": r["dev"], "estimate": r.get("estimate")}
                 for r in first + second]
    return out, evaluated

  def _write_variants(self, variants: list[dict]) -> None:
    """``OUT/policy/B<t>/`` per reached target; variant directories of other targets (an earlier
    run's) are removed so that the policy directory offers only this run's."""
    import shutil
    from calibrate.evaluate import policy_variants
    root = os.path.join(self.out, "policy")
    keep = {f"B{v['target']:.2f}" for v in variants if "policy" in v}
    for where in policy_variants(root).values():
      if os.path.basename(where) not in keep:
        shutil.rmtree(where)
    for v in variants:
      if "policy" in v:
        P.save(v["policy"], os.path.join(root, f"B{v['target']:.2f}"))

  def record(self, dec, drows, di, pre, prows, pi, e_ref) -> dict:
    d, gn = self.describe, self.group_name
    name = lambda k, g: f"{k[0]}:{d(k[1])}:{g}:{Act.NAMES[k[3]]}"
    return {
        "n_cal": len(self.cal.requests), "n_dev": len(self.dev.requests),
        "config": {k: (list(v) if isinstance(v, tuple) else v)
                   for k, v in dataclasses.asdict(self.cfg).items()},
        "ablation": (None if self.ablation is None else
                     {"name": self.ablation, "what": ABLATION[self.ablation],
                      "stand_in": T.STAND_IN if self.ablation in T.MERGED else None,
                      "position_bins": None if self.bins is None else list(self.bins)}),
        "reference_cal_accuracy": 1 - self.error(self.ref),
        "nbar": {"decode": {d(i): v for i, v in self.nbar_dec.items()},
                 "prefill": {d(i): v for i, v in self.nbar_pre.items()}},
        "V": {name(k, gn(k[2])): v for k, v in sorted(self.V.items())},
        "D": {name(k, f"g{k[2]}"): v for k, v in sorted(self.D.items())},
        "rho": {"decode": {f"{d(i)}:{gn(g)}": list(v) for (i, g), v in self.rho_dec.items()},
                "prefill": {f"{d(i)}:{gn(g)}": list(v) for (i, g), v in self.rho_pre.items()}},
        "decode_candidates": [{"tau": list(c["tau"]), "step": c["step"], "path_len": c["path_len"],
                               "nominal_b": c["nominal_b"], "window": c["window"], "dev": r,
                               **({"aim": c["aim"]} if "aim" in c else {})}
                              for c, r in zip(dec, drows)],
        "prefill_candidates": [{"tau": list(c["tau"]), "b_p": c["b_p"], "dev": r}
                               for c, r in zip(pre, prows)],
        "selected": {"decode": di, "prefill": pi},
        "dev_reference_accuracy": 1 - e_ref,
    }


def composed_estimate(d_outs, p_outs) -> tuple[float, float]:
  """(total B, accuracy) expected of composing the decode stage measured in ``d_outs`` (prefill
  all-high) with the prefill stage measured in ``p_outs`` (decode all-high), request by request:
  the prefill bits of one with the decode bits and lengths of the other; a request counts as
  passed when it passed under both.  An estimate only: the composition is then measured."""
  bits = full = 0.0
  passed = 0
  for d, p in zip(d_outs, p_outs):
    bits += p.ledger["prefill_bits"] + d.ledger["decode_bits"]
    full += d.ledger["full_kv_bits"]
    passed += bool(d.passed and p.passed)
  return (bits / full if full else float("nan")), passed / max(len(d_outs), 1)


def total_b(outcomes) -> float:
  bits = sum(o.ledger["prefill_bits"] + o.ledger["decode_bits"] for o in outcomes)
  full = sum(o.ledger["full_kv_bits"] for o in outcomes)
  return bits / full if full else float("nan")


def pick_points(noms: Sequence[float], k: int) -> list[int]:
  """Indices of ``k`` path steps evenly spaced in nominal cost (first and last always kept;
  ``k <= 0``: all)."""
  n = len(noms)
  if k <= 0 or k >= n:
    return list(range(n))
  lo, hi = noms[0], noms[-1]
  picks = {0, n - 1}
  for t in np.linspace(lo, hi, k)[1:-1]:
    picks.add(int(np.argmin([abs(x - t) for x in noms])))
  return sorted(picks)
