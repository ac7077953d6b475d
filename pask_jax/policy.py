"""The frozen policy Λ, Γ, B_D (paper §3.4–3.5, A.2, A.4, B.1, B.3) and its cost model.

``FrozenPolicy`` is a pytree of dense tables indexed by tag id (``pask_jax.tags``) so that the
online lookup is one gather:

* ``action[N, G]`` / ``floor[N, G]`` (int8, R=0 < L=1 < H=2): base action a⁰ and floor a⁻ per
  tag id and layer group.  The parent chain (class,role,state,next) → (class,role,state) →
  (class,role) → class is resolved at build time: an id without its own entry carries the entry
  of its nearest calibrated ancestor; an id with none (or a malformed id) gets H for action and
  floor and no scores.  Parent aggregates, if calibration wants them (e.g. the max over children),
  are entries of the parent ids themselves.
* ``prio[N, G, 2]`` (float32): the adjacent-upgrade scores ρ(R→L) at ``[..., 0]`` and ρ(L→H) at
  ``[..., 1]`` (Eq. 8).  NaN means "no calibrated score": such an upgrade is never promoted, and
  the matching demotion is ranked last (B.1: optional promotions require a unique calibrated score).
* ``crit[N]``: Crit(z) of Alg. 2 (state critical or next lookahead_critical).
* ``reserve[S]`` and ``pooled``: Γ per parser-state id and the pooled fallback for unseen states
  (Eq. 10), **in units of C_full** (so a model-independent policy stays model independent; the
  controller multiplies by ``c_full``).  Calibration divides its bit-valued quantile by C_full.
* ``b_d`` / ``b_p``: decode and prefill budgets (fractions of Full-KV payload).
* ``cost[3, G]``: m(a, c) in bits (B.3, Eq. 13–14) and ``c_full`` = Σ_c m(H, c).
* static: ``sink`` and ``window`` sizes, and ``record``: the A.4 record as a JSON string.

A policy built without a model (``model=None``) is a *template*: its tables do not depend on the
model, its cost is zero until :func:`bind` (or :func:`load` with a model) fills it in.  A policy
bound to a model carries the model identity (n_layers, n_kv_heads, head_dim, tokenizer hash, …)
and :func:`load` refuses it for any other model.

On disk (``save``/``load``), one store per kind of datum: ``DIR/arrays`` (orbax) holds every table
(``action``, ``floor``, ``prio``, ``crit``, and ``gamma`` = Γ per parser state then the pooled Γ)
and nothing else does; ``DIR/policy.json`` holds the record (format ``pask-policy/2``): what is not
an array (provenance, budgets B_D / B_P, thresholds, the ablation, the model identity, the cost
model's definition, the parser-state vocabulary, a variant's derivation).  A ``pask-policy/1``
directory (whose record also repeated the tables as sparse entries and Γ values) still loads: the
arrays are read from ``arrays/`` and the repeated tables dropped; one whose ``arrays/`` is gone is
rebuilt once by :func:`convert` (``pask-jax policy convert DIR``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any, Mapping, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from pask_jax import tags as T
from pask_jax import actions as Act

FORMAT = "pask-policy/2"
LEGACY_FORMAT = "pask-policy/1"   # the record also held the tables (entries, Γ values)
# What the record says of the arrays it does not hold (DIR/arrays, orbax).
ARRAYS = {"store": "arrays/ (orbax)",
          "tables": {"action": "int8 [N_IDS, G]", "floor": "int8 [N_IDS, G]",
                     "prio": "float32 [N_IDS, G, 2] (NaN: no score)", "crit": "bool [N_IDS]",
                     "gamma": "float32 [S + 1]: reserve per parser-state id, then pooled "
                              "(units of C_full)"}}
DEFAULT_SINK = 4
DEFAULT_WINDOW = 32
# Tie order of the online controller (documented in controller.py; recorded here per A.4).
TIE_ORDER = ("demote: ascending stored priority, NaN last, ties -> lower layer group first; "
             "promote: descending priority, ties -> upper layer group first; "
             "ids: ascending tag id (tags.all_ids)")
QUANTIZER = {"bits": 4, "symmetric": True,
             "granularity": "per (token, KV head) row, K and V separate",
             "scale": "fp16(max|x|/7), floor smallest positive fp16 "
                      "(bumped one fp16 up if max|x|/s>7.5)",
             "codes": "clip(round(x/s), -7, 7)", "zero_row": "codes 0, scale 1",
             "layout": "half-split nibbles: byte i = x[i] | x[i+D/2] << 4"}
PAYLOAD = {"unit": "bits", "n_c": "2*sum_{l in c} Hkv_l*d_l", "k_c": "2*sum_{l in c} Hkv_l",
           "p_c": "2*sum_{l in c} Hkv_l*(d_l mod 2)", "m_R": "0", "m_H": "16*n_c",
           "m_L": "4*n_c + 16*k_c + 4*p_c", "c_full": "sum_c m(H,c)"}
_IDENT_REQUIRED = ("n_layers", "n_kv_heads", "head_dim")


# ---- model identity and cost model ------------------------------------------------------------

def identity_of(model: Any, tokenizer_hash: str | None = None) -> dict:
  """Model identity as a dict.  ``model``: a dict, or anything with ``n_layers``, ``n_kv_heads``,
  ``head_dim`` attributes (``identity()`` is used when present, e.g. ``models.ModelConfig``)."""
  if isinstance(model, Mapping):
    ident = dict(model)
  elif hasattr(model, "identity"):
    ident = dict(model.identity())
  else:
    ident = {k: getattr(model, k) for k in _IDENT_REQUIRED}
  for k in _IDENT_REQUIRED:
    if k not in ident:
      if hasattr(model, k):
        ident[k] = getattr(model, k)
      else:
        raise ValueError(f"model identity lacks {k!r}: {ident}")
  if tokenizer_hash is not None:
    ident["tokenizer_hash"] = tokenizer_hash
  return {k: (list(v) if isinstance(v, tuple) else v) for k, v in ident.items()}


def _per_layer(x, n_layers: int) -> list[int]:
  return [int(x)] * n_layers if np.isscalar(x) else [int(v) for v in x]


def cost_model(n_layers: int, n_kv_heads: int | Sequence[int], head_dim: int | Sequence[int],
               n_groups: int = 3) -> np.ndarray:
  """m(a, c) in bits, ``float64[3, G]`` indexed by action (R, L, H) and group (B.3, Eq. 13–14).

  Per-layer ``n_kv_heads`` / ``head_dim`` sequences are accepted (the paper's H_ℓ, d_ℓ).
  """
  heads, dims = _per_layer(n_kv_heads, n_layers), _per_layer(head_dim, n_layers)
  m = np.zeros((3, n_groups), np.float64)
  for g, (lo, hi) in enumerate(T.layer_groups(n_layers, n_groups)):
    n_c = 2 * sum(heads[l] * dims[l] for l in range(lo, hi))
    k_c = 2 * sum(heads[l] for l in range(lo, hi))
    p_c = 2 * sum(heads[l] * (dims[l] % 2) for l in range(lo, hi))
    m[Act.H, g] = 16 * n_c
    m[Act.L, g] = 4 * n_c + 16 * k_c + 4 * p_c
  return m


# ---- the pytree -------------------------------------------------------------------------------

@flax.struct.dataclass
class FrozenPolicy:
  action: jax.Array   # [N, G] int8
  floor: jax.Array    # [N, G] int8
  prio: jax.Array     # [N, G, 2] float32: ρ(R→L), ρ(L→H); NaN = no score
  crit: jax.Array     # [N] bool
  reserve: jax.Array  # [S] float32, Γ per parser-state id, units of C_full
  pooled: jax.Array   # [] float32, Γ for unseen states, units of C_full
  b_d: jax.Array      # [] float32
  b_p: jax.Array      # [] float32
  cost: jax.Array     # [3, G] float32 bits
  c_full: jax.Array   # [] float32 bits
  sink: int = flax.struct.field(pytree_node=False, default=DEFAULT_SINK)
  window: int = flax.struct.field(pytree_node=False, default=DEFAULT_WINDOW)
  record_json: str = flax.struct.field(pytree_node=False, default="{}")

  @property
  def n_groups(self) -> int:
    return self.action.shape[-1]

  @property
  def record(self) -> dict:
    return json.loads(self.record_json)

  @property
  def model(self) -> dict | None:
    return self.record.get("model")

  @property
  def allowance(self) -> jax.Array:
    """b = B_D · C_full bits per accepted non-stop token (fractional bits kept)."""
    return self.b_d * self.c_full

  def gamma(self, state_id: jax.Array) -> jax.Array:
    """Γ(s) in bits; ids outside the table (or -1) use the pooled reserve."""
    s = jnp.asarray(state_id, jnp.int32)
    n = self.reserve.shape[0]
    known = (s >= 0) & (s < n)
    g = jnp.where(known, self.reserve[jnp.clip(s, 0, max(n - 1, 0))] if n else self.pooled,
                  self.pooled)
    return g * self.c_full


class Entry(NamedTuple):
  """One calibrated table entry: per group base action, floor and scores (length-G sequences)."""
  action: Sequence[int]
  floor: Sequence[int]
  prio: Sequence[Sequence[float]] | None = None   # [G][2]: ρ(R→L), ρ(L→H); None = no scores


def _check_entry(tag_id: int, e: Entry, n_groups: int):
  a, f = list(e.action), list(e.floor)
  if len(a) != n_groups or len(f) != n_groups:
    raise ValueError(f"entry {T.describe(tag_id)}: need {n_groups} groups, got {a}, {f}")
  if not all(x in (Act.R, Act.L, Act.H) for x in a + f):
    raise ValueError(f"entry {T.describe(tag_id)}: actions must be 0/1/2 (R/L/H), got {a}, {f}")
  if not T.is_well_formed(tag_id):
    raise ValueError(f"entry for malformed tag id {tag_id}")


def _check_ablated(tag_id: int, e: Entry, ablation: str | None):
  if ablation is None:
    return
  key = T.coarsen(tag_id, ablation)
  if key != tag_id:
    raise ValueError(f"ablation {ablation}: entry {T.describe(tag_id)} is not an ablated key "
                     f"(its key is {T.describe(key, ablation)})")
  if ablation == "no-layer" and (len(set(e.action)) > 1 or len(set(e.floor)) > 1):
    raise ValueError(f"ablation no-layer: entry {T.describe(tag_id)} differs across the layer "
                     f"groups: action {list(e.action)}, floor {list(e.floor)}")


def lean(pol: "FrozenPolicy") -> "FrozenPolicy":
  """``pol`` without its readable record (a static pytree field: name, budgets' provenance,
  thresholds), so that every policy of one shape, sink and window shares one compilation of the
  jitted functions that take a policy as an input; nothing traced reads the record."""
  return pol.replace(record_json="{}")


def ablation_of(pol: "FrozenPolicy") -> str | None:
  """The ablation a policy was calibrated under (None: the full method)."""
  return pol.record.get("ablation")


def position_bins(pol: "FrozenPolicy | None") -> tuple[int, ...] | None:
  """The no-transition policy's position bins (first positions), else None."""
  if pol is None:
    return None
  b = pol.record.get("position_bins")
  return None if b is None else tuple(int(x) for x in b)


@functools.lru_cache(maxsize=None)
def _fallbacks(ablation: str | None) -> tuple[tuple[int, bool, tuple[int, ...]], ...]:
  """(id, Crit of its key, its key's fallback chain) of every well-formed id under ``ablation``:
  what :func:`build` resolves entries along (cached: calibration builds hundreds of policies,
  and this walk over every id was most of a build's time)."""
  keys = T.key_table(ablation)
  return tuple((i, T.is_critical(keys[i]), tuple(T.parents(keys[i])))
               for i in range(T.N_IDS) if T.is_well_formed(i))


def build(entries: Mapping[int, Entry], model: Any = None, *, n_groups: int = 3,
          reserve: Mapping[int, float] | Sequence[float] = (), pooled: float = 0.0,
          b_d: float = 1.0, b_p: float = 1.0, sink: int = DEFAULT_SINK,
          window: int = DEFAULT_WINDOW, tokenizer_hash: str | None = None,
          adapter: str = "", thresholds: Any = None, reserve_k: int = 8,
          reserve_beta: float = 0.8, extra: Mapping[str, Any] | None = None,
          ablation: str | None = None, position_bins: Sequence[int] | None = None
          ) -> FrozenPolicy:
  """Pack calibrated entries into a ``FrozenPolicy`` (Alg. 1 line 11, "Pack").

  ``entries``: tag id → :class:`Entry`.  ``reserve``: Γ per parser-state id in units of C_full
  (a dict, unlisted ids take ``pooled``; or a dense sequence).  ``model``: see
  :func:`identity_of`; ``None`` makes a model-independent template (see :func:`bind`).
  ``ablation`` (one of :data:`pask_jax.tags.ABLATIONS`, recorded as ``record["ablation"]``):
  entries are keyed by ablated keys (:func:`pask_jax.tags.coarsen`) and every tag id gets the
  entry of its key, resolved along the key's parent chain, and Crit of its key (no-state: no id
  is critical); no-layer entries must be equal across the groups.  no-transition needs
  ``position_bins`` (the bins' first positions, recorded as ``record["position_bins"]``; the
  decode entries are keyed by :func:`pask_jax.tags.position_id`).  The component ablations
  (no-floors, fixed-order) change what calibration writes, not the table's layout.
  """
  G = n_groups
  T.check_ablation(ablation)
  if (ablation == "no-transition") != (position_bins is not None):
    raise ValueError("position_bins go with the no-transition ablation, and it needs them")
  if position_bins is not None:
    e = [int(x) for x in position_bins]
    if not 1 <= len(e) <= T.MAX_POSITION_BINS or e[0] != 0 or any(
        b <= a for a, b in zip(e, e[1:])):
      raise ValueError(f"position bins must be 1..{T.MAX_POSITION_BINS} increasing first "
                       f"positions from 0, got {e}")
  action = np.full((T.N_IDS, G), Act.H, np.int8)
  floor = np.full((T.N_IDS, G), Act.H, np.int8)
  prio = np.full((T.N_IDS, G, 2), np.nan, np.float32)
  crit = np.zeros((T.N_IDS,), bool)
  for i, e in entries.items():
    _check_entry(int(i), e, G)
    _check_ablated(int(i), e, ablation)
  for i, critical, chain in _fallbacks(ablation):
    crit[i] = critical
    for p in chain:
      if p in entries:
        e = entries[p]
        action[i], floor[i] = e.action, e.floor
        if e.prio is not None:
          prio[i] = np.asarray(e.prio, np.float32).reshape(G, 2)
        break
  if isinstance(reserve, Mapping):
    n = max((int(k) + 1 for k in reserve), default=0)
    res = np.full((n,), pooled, np.float32)
    for k, v in reserve.items():
      res[int(k)] = v
  else:
    res = np.asarray(reserve, np.float32).reshape(-1)

  record = {
      "format": FORMAT, "adapter": adapter, "vocab": T.vocab_record(), "n_groups": G,
      "layer_boundaries": None, "quantizer": QUANTIZER, "payload_cost": dict(PAYLOAD),
      "sink": int(sink), "window": int(window), "thresholds": thresholds,
      "budgets": {"b_d": float(b_d), "b_p": float(b_p)},
      "reserve": {"k": int(reserve_k), "beta": float(reserve_beta), "unit": "c_full"},
      "arrays": ARRAYS,
      "fallback": "parent chain (class,role,state,next)->(class,role,state)->(class,role)->class, "
                  "precomputed; nothing compatible -> H action and floor; no score -> no promotion",
      "tie_order": TIE_ORDER,
      "model": None, "extra": dict(extra or {}),
  }
  if ablation is not None:      # only then: the records of unablated policies stay as they were
    record["ablation"] = ablation
  if position_bins is not None:
    record["position_bins"] = [int(x) for x in position_bins]
  pol = FrozenPolicy(
      action=jnp.asarray(action), floor=jnp.asarray(floor), prio=jnp.asarray(prio),
      crit=jnp.asarray(crit), reserve=jnp.asarray(res), pooled=jnp.float32(pooled),
      b_d=jnp.float32(b_d), b_p=jnp.float32(b_p), cost=jnp.zeros((3, G), jnp.float32),
      c_full=jnp.float32(0.0), sink=int(sink), window=int(window),
      record_json=json.dumps(record, sort_keys=True))
  return bind(pol, model, tokenizer_hash) if model is not None else pol


def bind(pol: FrozenPolicy, model: Any, tokenizer_hash: str | None = None) -> FrozenPolicy:
  """Fill in the cost model and identity of ``model``; refuse a policy made for another model."""
  ident = identity_of(model, tokenizer_hash)
  rec = pol.record
  if rec.get("model") is not None:
    check_identity(rec["model"], ident)
  G = pol.n_groups
  cost = cost_model(ident["n_layers"], ident["n_kv_heads"], ident["head_dim"], G)
  rec["model"] = ident
  rec["layer_boundaries"] = list(T.layer_boundaries(int(ident["n_layers"]), G))
  rec["payload_cost"]["m_bits"] = {"R": cost[Act.R].tolist(), "L": cost[Act.L].tolist(),
                                   "H": cost[Act.H].tolist()}
  rec["payload_cost"]["c_full_bits"] = float(cost[Act.H].sum())
  return pol.replace(cost=jnp.asarray(cost, jnp.float32), c_full=jnp.float32(cost[Act.H].sum()),
                     record_json=json.dumps(rec, sort_keys=True))


def transfer(pol: FrozenPolicy, model: Any, tokenizer_hash: str | None = None) -> FrozenPolicy:
  """The policy, unchanged, bound to another model (the paper's Table 4: a policy calibrated on
  one model used as it is on another).  Its tables are per tag and layer group, B_D / B_P and Γ
  fractions of C_full, so only the cost model and the identity change: the layer groups are the
  target's (``tags.layer_boundaries`` over its layers), the bits its own.  The record keeps the
  source's identity and content under ``transferred_from``.  A model with fewer layers than the
  policy has groups: ValueError."""
  ident = identity_of(model, tokenizer_hash)
  if int(ident["n_layers"]) < pol.n_groups:
    raise ValueError(f"the policy has {pol.n_groups} layer groups, the model only "
                     f"{ident['n_layers']} layers")
  rec = pol.record
  src = rec.pop("model", None)
  rec["transferred_from"] = {"model": src, "name": (rec.get("extra") or {}).get("name"),
                             "layer_boundaries": rec.get("layer_boundaries")}
  return bind(pol.replace(record_json=json.dumps(rec, sort_keys=True)), ident)


STAGES = ("prefill", "decode")


@functools.cache
def _prompt_rows() -> np.ndarray:
  """bool[N_IDS]: the rows of prompt labels (the prefill stage's keys); the rest are decode's."""
  return np.array([T.unpack(i)[0] == T.Family.PROMPT for i in range(T.N_IDS)])


def edit(pol: FrozenPolicy, *, all_high: str | None = None,
         no_release: str | None = None) -> FrozenPolicy:
  """A policy with one stage changed, the other's tables and budget as they were.

  ``all_high`` ("prefill" or "decode"): that stage keeps every token H — its rows' actions and
  floors H, no scores, its budget 1 (decode: Γ 0 too) — the paper's prefill–decode stage
  decomposition (Table 17: "prefill-only" is ``all_high="decode"``).  ``no_release="prefill"``:
  every prompt label's floor (and base action) L — what Alg. 1's KEEP threshold composes: the
  prompt at uniform INT4, the B_P above that spent on H upgrades by the calibrated priorities.
  No prompt token is released, and the calibrated H floors go to L too, so the budget holds
  whenever B_P covers INT4's cost (keeping those H floors would put most prompts over it).
  The decode stage's floors price its reserve Γ, so changing them needs a recalibration, not an
  edit.  Bad arguments: a one-line ValueError."""
  for name, v in (("all_high", all_high), ("no_release", no_release)):
    if v is not None and v not in STAGES:
      raise ValueError(f"{name} must be one of {', '.join(STAGES)}, got {v!r}")
  if all_high is None and no_release is None:
    raise ValueError("nothing to edit: give all_high and/or no_release")
  if no_release == "decode":
    raise ValueError("no_release='decode' is not an edit: the decode floors price the reserve "
                     "Γ; recalibrate (Alg. 1's KEEP decode stage) instead")
  if all_high is not None and all_high == no_release:
    raise ValueError(f"the {all_high} stage cannot be both all-high and no-release")
  pr = _prompt_rows()
  action, floor = np.array(pol.action), np.array(pol.floor)
  prio = np.array(pol.prio)
  changes: dict[str, Any] = {}
  if all_high is not None:
    rows = pr if all_high == "prefill" else ~pr
    action[rows], floor[rows], prio[rows] = Act.H, Act.H, np.nan
    if all_high == "prefill":
      changes["b_p"] = jnp.float32(1.0)
    else:
      changes.update(b_d=jnp.float32(1.0), pooled=jnp.float32(0.0),
                     reserve=jnp.zeros_like(pol.reserve))
  if no_release == "prefill":
    if np.isnan(prio[pr]).all():
      raise ValueError("no_release='prefill' needs the calibrated prompt priorities, and this "
                       "policy's prefill has none (all-high): the edit would be uniform INT4 of "
                       "the prompt, not Alg. 1's KEEP composition")
    action[pr], floor[pr] = Act.L, Act.L
  rec = pol.record
  extra = dict(rec.get("extra") or {})
  done = [f"{all_high} all-high"] * (all_high is not None) + \
         [f"{no_release} no-release"] * (no_release is not None)
  # The source's dev-measured variant record describes the source, not this policy (policy
  # derive reads extra.variant as measured): kept under the edit.
  extra["edit"] = {"all_high": all_high, "no_release": no_release,
                   "source_name": extra.get("name"), "source_variant": extra.pop("variant", None)}
  extra["name"] = f"{extra.get('name') or 'policy'} ({', '.join(done)})"
  rec["extra"] = extra
  th = dict(rec.get("thresholds") or {})
  if all_high is not None:
    th[all_high] = None                   # as compose() records an all-high stage
  if no_release == "prefill":
    th["prefill"] = [-1.0, 1.0]           # calibrate.alg1.KEEP: every floor L
  rec["thresholds"] = th
  return pol.replace(action=jnp.asarray(action), floor=jnp.asarray(floor),
                     prio=jnp.asarray(prio), record_json=json.dumps(rec, sort_keys=True),
                     **changes)


def check_identity(policy_ident: Mapping, model_ident: Mapping, where: str = "policy"):
  """Raise ValueError naming every field on which the two identities disagree.

  The required fields (n_layers, n_kv_heads, head_dim) are always compared; any other field
  (tokenizer_hash, arch, vocab_size) is compared when both sides have it.
  """
  bad = []
  for k in sorted(set(policy_ident) | set(model_ident)):
    if k in _IDENT_REQUIRED or (k in policy_ident and k in model_ident):
      pv, mv = policy_ident.get(k), model_ident.get(k)
      if pv != mv:
        bad.append(f"{k}: {where} has {pv!r}, model has {mv!r}")
  if bad:
    raise ValueError(f"{where} was made for another model; mismatching fields: " + "; ".join(bad))


# ---- save / load ------------------------------------------------------------------------------

_TABLES = ("action", "floor", "prio", "crit", "gamma")   # DIR/arrays: the only copy of each
_BUDGETS = ("b_d", "b_p")   # in the record's budgets (pask-policy/1 kept them in arrays/ too)


def metadata(rec: Mapping[str, Any]) -> dict:
  """The record as ``policy.json`` holds it (format ``pask-policy/2``): a ``pask-policy/1``
  record's copies of the tables (``entries``, ``reserve.per_state``, ``reserve.pooled``) dropped,
  the arrays' description added.  Pure: returns a new dict."""
  out = {k: v for k, v in rec.items() if k != "entries"}
  if isinstance(out.get("reserve"), Mapping):
    out["reserve"] = {k: v for k, v in out["reserve"].items() if k not in ("per_state", "pooled")}
  out["format"] = FORMAT
  out["arrays"] = ARRAYS
  return out


def _budgets_of(pol: FrozenPolicy, rec: Mapping[str, Any]) -> dict:
  """``rec["budgets"]`` with B_D / B_P the policy's own: a recorded value that is the array's
  (as float32) is kept as written, another is replaced by the array's."""
  b = dict(rec.get("budgets") or {})
  for k in _BUDGETS:
    v = np.float32(getattr(pol, k))
    if k not in b or np.float32(b[k]) != v:
      b[k] = float(v)
  return b


def save(pol: FrozenPolicy, directory: str | os.PathLike) -> None:
  """Write ``directory/arrays`` (orbax: the tables) and ``directory/policy.json`` (the record:
  everything that is not an array; B_D and B_P under ``budgets``); overwrites both."""
  import orbax.checkpoint as ocp
  d = os.path.abspath(os.fspath(directory))
  os.makedirs(d, exist_ok=True)
  tree = {k: np.asarray(getattr(pol, k)) for k in _TABLES if k != "gamma"}
  # orbax refuses zero-size arrays: Γ is stored as [reserve..., pooled] (never empty).
  tree["gamma"] = np.concatenate([np.asarray(pol.reserve, np.float32).reshape(-1),
                                  np.asarray(pol.pooled, np.float32).reshape(1)])
  rec = metadata(pol.record)
  rec["budgets"] = _budgets_of(pol, rec)
  ckptr = ocp.PyTreeCheckpointer()
  if jax.process_count() > 1:
    # One process of several (calibration across processes: process 0 writes alone); orbax's
    # default would wait for every process at its barriers.
    me = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                            active_processes={jax.process_index()})
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=me),
                             multiprocessing_options=me)
  ckptr.save(os.path.join(d, "arrays"), tree, force=True)
  # The record last and whole (a temporary file renamed over the old one): a save or a
  # `policy convert` stopped at any point leaves a directory that loads (and converts again).
  tmp = os.path.join(d, f".policy.json.{os.getpid()}.tmp")
  with open(tmp, "w") as f:
    json.dump(rec, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, os.path.join(d, "policy.json"))


def _convert_hint(d: str) -> str:
  return f"convert it once with: pask-jax policy convert {d}"


def load(directory: str | os.PathLike, model: Any = None,
         tokenizer_hash: str | None = None) -> FrozenPolicy:
  """Read a policy; with ``model`` given, refuse a mismatch (ValueError) and bind the cost model.

  A policy saved bound to a model needs no ``model`` argument (its own identity gives the cost).
  The tables come from ``arrays/`` alone, B_D / B_P from the record's ``budgets`` (a
  ``pask-policy/1`` directory: from ``arrays/``, where it kept them too).
  """
  import orbax.checkpoint as ocp
  d = os.path.abspath(os.fspath(directory))
  rec = read_record(d)
  legacy = rec["format"] == LEGACY_FORMAT
  if model is not None and rec.get("model") is not None:
    check_identity(rec["model"], identity_of(model, tokenizer_hash), where=f"policy {d}")
  if not os.path.isdir(os.path.join(d, "arrays")):
    if legacy and isinstance(rec.get("entries"), dict):
      raise FileNotFoundError(f"{d} has no arrays/ directory: an old ({LEGACY_FORMAT}) policy "
                              f"whose tables are only in policy.json; {_convert_hint(d)}")
    raise FileNotFoundError(f"{d} has no arrays/ directory (a policy is policy.json + arrays/)")
  try:
    arr = ocp.PyTreeCheckpointer().restore(os.path.join(d, "arrays"))
  except Exception as e:  # noqa: BLE001 — orbax raises many kinds; one line names the problem
    raise ValueError(f"{d}/arrays cannot be read: {type(e).__name__}: "
                     f"{' '.join(str(e).split())[:200]}") from None
  if not isinstance(arr, dict) or any(k not in arr for k in _TABLES):
    raise ValueError(f"{d}/arrays lacks the policy arrays {list(_TABLES)}")
  G = int(rec["n_groups"])
  if np.asarray(arr["action"]).shape != (T.N_IDS, G):
    raise ValueError(f"{d}: table shape {np.asarray(arr['action']).shape} != {(T.N_IDS, G)}")
  # pask-policy/1 kept B_D / B_P in arrays/ too (the exact float32s); its arrays/ rewritten by a
  # `policy convert` stopped before the record no longer has them: the record's then.
  budgets = arr if legacy and all(k in arr for k in _BUDGETS) else rec.get("budgets")
  if not isinstance(budgets, dict) or any(k not in budgets for k in _BUDGETS):
    raise ValueError(f"{d}: no budgets (b_d, b_p) in policy.json nor in arrays/")
  rec = metadata(rec)
  gamma = np.asarray(arr["gamma"], np.float32)
  pol = FrozenPolicy(
      action=jnp.asarray(arr["action"], jnp.int8), floor=jnp.asarray(arr["floor"], jnp.int8),
      prio=jnp.asarray(arr["prio"], jnp.float32), crit=jnp.asarray(arr["crit"], bool),
      reserve=jnp.asarray(gamma[:-1], jnp.float32), pooled=jnp.float32(gamma[-1]),
      b_d=jnp.float32(budgets["b_d"]), b_p=jnp.float32(budgets["b_p"]),
      cost=jnp.zeros((3, G), jnp.float32), c_full=jnp.float32(0),
      sink=int(rec["sink"]), window=int(rec["window"]),
      record_json=json.dumps(rec, sort_keys=True))
  if rec.get("model") is not None:
    pol = bind(pol, rec["model"])
  if model is not None:
    pol = bind(pol, model, tokenizer_hash)
  return pol


def digest(directory: str | os.PathLike) -> str:
  """sha256 of what a policy directory decides with, not of how it is stored: every table's
  dtype, shape and bytes, B_D / B_P as float32, sink, window and the record without its storage
  fields (``format``, ``arrays``).  A ``pask-policy/1`` directory and its conversion, or a policy
  saved again (orbax writes timestamps), digest the same; any changed table or record field
  does not."""
  d = os.fspath(directory)
  pol = load(d)
  h = hashlib.sha256()
  for k in ("action", "floor", "prio", "crit", "reserve", "pooled", "b_d", "b_p"):
    a = np.ascontiguousarray(np.asarray(getattr(pol, k)))
    h.update(f"{k}\0{a.dtype.str}\0{a.shape}\0".encode())
    h.update(a.tobytes())
  rec = {k: v for k, v in pol.record.items() if k not in ("format", "arrays")}
  rec["budgets"] = {k: v for k, v in (rec.get("budgets") or {}).items() if k not in _BUDGETS}
  rec["sink"], rec["window"] = pol.sink, pol.window
  h.update(json.dumps(rec, sort_keys=True).encode())
  return h.hexdigest()


def convert(directory: str | os.PathLike) -> str:
  """Rewrite a ``pask-policy/1`` directory as ``pask-policy/2`` in place (the tables in
  ``arrays/`` only, the record without them) and say what was done; a ``pask-policy/2``
  directory is left as it is.  The tables are read from ``arrays/``, or, where it is gone,
  rebuilt from the old record's entries (:func:`from_record`)."""
  d = os.fspath(directory)
  rec = read_record(d)
  if rec["format"] == FORMAT:
    return f"{d}: already {FORMAT}, nothing to do"
  if os.path.isdir(os.path.join(d, "arrays")):
    pol, how = load(d), "tables read from arrays/"
  else:
    if not isinstance(rec.get("entries"), dict):
      raise ValueError(f"{d} has neither arrays/ nor the entries of an old policy.json: "
                       "nothing to convert from")
    try:
      pol = from_record(rec)
    except (KeyError, TypeError, IndexError) as e:
      raise ValueError(f"{d}/policy.json: an old record whose entries cannot be read "
                       f"({type(e).__name__}: {e})") from None
    how = "tables rebuilt from the old policy.json's entries"
  save(pol, d)
  return f"{d}: converted to {FORMAT} ({how}; policy.json keeps no arrays)"


def read_record(directory: str | os.PathLike) -> dict:
  """``directory/policy.json`` checked: one-line errors (FileNotFoundError / ValueError) for a
  missing or non-directory path, invalid JSON, a record that is not an object, and missing or
  out-of-range fields (``n_groups`` >= 1, ``sink`` >= 0, ``window`` >= 1)."""
  d = os.fspath(directory)
  if not os.path.exists(d):
    raise FileNotFoundError(f"policy directory not found: {d}")
  if not os.path.isdir(d):
    raise ValueError(f"{d} is a file, not a policy directory (policy.json + arrays/); the "
                     f"built-in policies are {', '.join(BUILTIN)}")
  path = os.path.join(d, "policy.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{d} has no policy.json")
  rec = read_json(path)
  check_record(rec, path)
  return rec


def read_json(path: str | os.PathLike, what: str = "") -> Any:
  """The JSON value in ``path``; a file that is not JSON (or not text) is a one-line ValueError
  naming it (``what``, e.g. "calibration record", before the path)."""
  try:
    with open(path) as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{what + ' ' if what else ''}{os.fspath(path)} is not valid JSON: "
                     f"{e}") from None


def check_record(rec: Any, where: str = "policy record") -> None:
  """Raise ValueError naming the first problem of a policy record (see :func:`read_record`)."""
  if not isinstance(rec, dict):
    raise ValueError(f"{where}: a policy record is a JSON object, not a {type(rec).__name__}")
  if rec.get("format") not in (FORMAT, LEGACY_FORMAT):
    raise ValueError(f"{where}: not a {FORMAT} policy (format={rec.get('format')!r})")
  for key, lo in (("n_groups", 1), ("sink", 0), ("window", 1)):
    if key not in rec:
      raise ValueError(f"{where}: the record lacks {key!r}")
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
      raise ValueError(f"{where}: {key!r} must be an integer >= {lo}, got {v!r}")
  for key in ("entries", "reserve", "budgets"):
    if key in rec and not isinstance(rec[key], dict):
      raise ValueError(f"{where}: {key!r} must be an object, got {type(rec[key]).__name__}")
  if rec["format"] == FORMAT:     # the budgets live in the record alone
    b = rec.get("budgets")
    for key in _BUDGETS:
      v = None if b is None else b.get(key)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
        raise ValueError(f"{where}: 'budgets' must give {key!r} as a finite number >= 0, "
                         f"got {v!r}")


# ---- shipped policies -------------------------------------------------------------------------

POLICIES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "policies")


def all_high(model: Any = None, *, n_groups: int = 3, sink: int = DEFAULT_SINK,
             window: int = DEFAULT_WINDOW, tokenizer_hash: str | None = None) -> FrozenPolicy:
  """The reference π_ref (A.4): B_D = 1, every action and floor H, Γ = 0."""
  return build({}, model, n_groups=n_groups, b_d=1.0, b_p=1.0, pooled=0.0, sink=sink,
               window=window, tokenizer_hash=tokenizer_hash, adapter="any",
               extra={"name": "all-high"})


def demo_entries(n_groups: int) -> dict[int, Entry]:
  """Hand-written (not calibrated) entries; three-group values stretched to ``n_groups``."""
  Cl = T.Cls
  # (action lower/middle/upper, floor lower/middle/upper)
  fc = {
      T.fc(Cl.PURE_SCAFFOLD): ("RRL", "RRR"),
      T.fc(Cl.SCHEMA_BEARING): ("LHH", "LLH"),
      T.fc(Cl.SCHEMA_BEARING, T.FCRole.SCAFFOLD_SEPARATOR): ("RLL", "RRL"),
      T.fc(Cl.SCHEMA_BEARING, T.FCRole.DISPATCH_KEY): ("HHH", "HHH"),
      T.fc(Cl.SCHEMA_BEARING, T.FCRole.REQUIRED): ("LHH", "LLH"),
      T.fc(Cl.SCHEMA_BEARING, T.FCRole.OPTIONAL): ("LLH", "RLL"),
      T.fc(Cl.FREE_GENERATION): ("LLH", "LLL"),
  }
  sq = {
      T.sql(Cl.PURE_SCAFFOLD): ("RLL", "RRR"),
      T.sql(Cl.SCHEMA_BEARING): ("LHH", "LLH"),
      T.sql(Cl.SCHEMA_BEARING, T.SQLRole.PROJECTION): ("LHH", "LLH"),
      T.sql(Cl.SCHEMA_BEARING, T.SQLRole.RELATION): ("HHH", "LHH"),
      T.sql(Cl.SCHEMA_BEARING, T.SQLRole.PREDICATE): ("LHH", "LLH"),
      T.sql(Cl.SCHEMA_BEARING, T.SQLRole.OUTSIDE_SCHEMA): ("LLH", "RLL"),
      T.sql(Cl.FREE_GENERATION): ("LLH", "LLL"),
  }
  P = T.PromptLabel
  pr = {
      T.prompt(P.PROTECTED_CONTENT): ("HHH", "LHH"),
      T.prompt(P.SCHEMA_SCAFFOLD): ("RLL", "RRR"),
      T.prompt(P.FUNCTION_NAME): ("HHH", "HHH"),
      T.prompt(P.PARAMETER_KEY): ("LHH", "LLH"),
      T.prompt(P.TYPE_CONSTRAINT): ("LLH", "RLL"),
      T.prompt(P.ENUM_CONSTRAINT): ("LHH", "LLH"),
      T.prompt(P.SCHEMA_DESCRIPTION): ("RLL", "RRR"),
  }
  code = {"R": Act.R, "L": Act.L, "H": Act.H}
  stretch = lambda s: [code[s[min(2, g * 3 // n_groups)]] for g in range(n_groups)]
  out = {}
  for i, (a, f) in {**fc, **sq, **pr}.items():
    # Scores grow with depth (upper groups matter more) and are larger for L→H than R→L.
    prio = [[1.0 + g, 2.0 + 2 * g] for g in range(n_groups)]
    out[i] = Entry(stretch(a), stretch(f), prio)
  return out


def demo(model: Any = None, *, n_groups: int = 3, b_d: float = 0.5, b_p: float = 0.5,
         sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW,
         tokenizer_hash: str | None = None) -> FrozenPolicy:
  """A hand-written policy that compresses: scaffold → R/L, function names and required
  arguments H in the upper groups, free text L; B_D = B_P = 0.5, Γ = 0.  Not calibrated."""
  return build(demo_entries(n_groups), model, n_groups=n_groups, b_d=b_d, b_p=b_p, pooled=0.0,
               sink=sink, window=window, tokenizer_hash=tokenizer_hash, adapter="any",
               extra={"name": "demo", "note": "hand-written, not calibrated"})


BUILTIN = {"all-high": all_high, "demo": demo}


def resolve(name_or_dir: str, model: Any = None, tokenizer_hash: str | None = None) -> FrozenPolicy:
  """``"all-high"``, ``"demo"`` (constructed), or a policy directory (loaded and checked)."""
  if name_or_dir in BUILTIN:
    return BUILTIN[name_or_dir](model, tokenizer_hash=tokenizer_hash)
  return load(name_or_dir, model, tokenizer_hash)


def describe(pol: FrozenPolicy, tag_id: int) -> str:
  """``fc:pure_scaffold -> action RRL floor RRR`` for logs."""
  a = "".join(Act.NAMES[int(x)] for x in np.asarray(pol.action[tag_id]))
  f = "".join(Act.NAMES[int(x)] for x in np.asarray(pol.floor[tag_id]))
  return f"{T.describe(tag_id)} -> action {a} floor {f}"


def from_record(rec: Mapping[str, Any]) -> FrozenPolicy:
  """Rebuild a policy from an old (``pask-policy/1``) record alone, which repeated the tables
  (entries, reserve, budgets, sink/window, model identity): :func:`build` is deterministic, so
  this equals the arrays saved beside it.  :func:`convert` uses it where ``arrays/`` is gone; a
  ``pask-policy/2`` record holds no tables (one-line ValueError)."""
  check_record(rec)
  if rec["format"] != LEGACY_FORMAT or not isinstance(rec.get("entries"), dict):
    raise ValueError(f"only a {LEGACY_FORMAT} record holds the tables; a {FORMAT} policy's are "
                     "in its arrays/ (policy.load)")
  code = {n: i for i, n in enumerate(Act.NAMES)}
  ents = {int(e["id"]): Entry([code[a] for a in e["action"]], [code[a] for a in e["floor"]],
                              e["prio"]) for e in rec["entries"].values()}
  res = rec["reserve"]
  per = res.get("per_state", {})
  reserve = [per[str(i)] for i in range(len(per))]
  model = rec.get("model")
  return build(ents, model, n_groups=int(rec["n_groups"]), reserve=reserve,
               pooled=float(res["pooled"]), b_d=float(rec["budgets"]["b_d"]),
               b_p=float(rec["budgets"]["b_p"]), sink=int(rec["sink"]), window=int(rec["window"]),
               adapter=rec.get("adapter", ""), thresholds=rec.get("thresholds"),
               reserve_k=int(res.get("k", 8)), reserve_beta=float(res.get("beta", 0.8)),
               extra=rec.get("extra"), ablation=rec.get("ablation"),
               position_bins=rec.get("position_bins"))


def state_vocab(pol: FrozenPolicy):
  """The parser-state vocabulary a calibrated policy's reserve Γ is indexed by (a frozen
  :class:`~pask_jax.grammar.frontier.StateVocab`), or None (then every state is "unseen" and the
  pooled reserve applies)."""
  keys = pol.record.get("extra", {}).get("state_vocab")
  if not keys:
    return None
  from pask_jax.grammar.frontier import StateVocab
  return StateVocab(keys)
