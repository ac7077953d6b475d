"""Structural tags (paper §3.3, Table 5), prompt labels (Table 6) and layer groups (A.2).

A decode tag is z = (class, role, state, next); a prefill key is a prompt label.  Both are packed
into one int32 **tag id** so that the frozen policy is a dense table indexed by id (one gather).

Id layout (bit fields, low to high)::

  bits 0-1   next    0 = absent, 1..2  (Next)
  bits 2-3   state   0 = absent, 1..3  (FCState / SQLState)
  bits 4-6   role    0 = absent, 1..7  (FCRole / SQLRole)
  bits 7-9   class   0 = absent, 1..7  (Cls; for the PROMPT family: PromptLabel)
  bits 10-11 family  (Family)

Every field value is 1-based so that 0 means "field absent": the parent chain of B.1,
(class,role,state,next) -> (class,role,state) -> (class,role) -> class, is "clear the highest
present low field", and parents are ids in the same table.  Only prefix ids are well formed (a
field may be present only if all fields above it are); ``N_IDS`` bounds every id.

Candidate sets (Eq. 12): a token spanning a structural boundary carries up to ``N_CAND`` ids, padded
with ``PAD`` (-1).  ``STOP`` (-2) as any candidate marks a stop token: it charges nothing (B.7).
"""
from __future__ import annotations

import enum
import functools
from typing import Sequence

import numpy as np



class Family(enum.IntEnum):
  FC = 0       # function calling (BFCL)
  SQL = 1      # text-to-SQL (BIRD)
  PROMPT = 2   # prefill prompt-span labels (class field = PromptLabel)


class Cls(enum.IntEnum):
  PURE_SCAFFOLD = 1
  SCHEMA_BEARING = 2
  FREE_GENERATION = 3


class FCRole(enum.IntEnum):
  SCAFFOLD_SEPARATOR = 1
  REQUIRED = 2
  OPTIONAL = 3
  DISPATCH_KEY = 4


class SQLRole(enum.IntEnum):
  PROJECTION = 1
  RELATION = 2
  PREDICATE = 3
  OUTSIDE_SCHEMA = 4


class FCState(enum.IntEnum):
  BOUNDARY = 1
  CRITICAL = 2


class SQLState(enum.IntEnum):
  STABLE = 1
  BOUNDARY = 2
  CRITICAL = 3


class Next(enum.IntEnum):
  LOOKAHEAD_CRITICAL = 1
  NO_LOOKAHEAD = 2


class PromptLabel(enum.IntEnum):
  """Table 6.  ``protected_content`` is a category, not an H action (A.3)."""
  PROTECTED_CONTENT = 1
  SCHEMA_SCAFFOLD = 2
  FUNCTION_NAME = 3
  PARAMETER_KEY = 4
  TYPE_CONSTRAINT = 5
  ENUM_CONSTRAINT = 6
  SCHEMA_DESCRIPTION = 7


# Per family: the enum of each field (None: field unused by that family).
VOCAB = {
    Family.FC: (Cls, FCRole, FCState, Next),
    Family.SQL: (Cls, SQLRole, SQLState, Next),
    Family.PROMPT: (PromptLabel, None, None, None),
}

# Field widths and offsets (see module doc).
_NEXT_BITS, _STATE_BITS, _ROLE_BITS, _CLS_BITS, _FAM_BITS = 2, 2, 3, 3, 2
_NEXT_SH = 0
_STATE_SH = _NEXT_SH + _NEXT_BITS
_ROLE_SH = _STATE_SH + _STATE_BITS
_CLS_SH = _ROLE_SH + _ROLE_BITS
_FAM_SH = _CLS_SH + _CLS_BITS
N_IDS = 1 << (_FAM_SH + _FAM_BITS)  # 4096: the policy table's first axis

N_CAND = 4   # candidate ids per token (Eq. 12)
PAD = -1     # candidate padding
STOP = -2    # reserved id of a stop token (charges nothing, B.7)


def pack(family, cls, role=0, state=0, nxt=0):
  """Fields -> tag id.  Works on Python ints and on integer numpy/jnp arrays alike."""
  return ((family << _FAM_SH) | (cls << _CLS_SH) | (role << _ROLE_SH) | (state << _STATE_SH)
          | (nxt << _NEXT_SH))


def unpack(tag_id):
  """Tag id -> (family, class, role, state, next); works on ints and arrays."""
  f = lambda sh, bits: (tag_id >> sh) & ((1 << bits) - 1)
  return (f(_FAM_SH, _FAM_BITS), f(_CLS_SH, _CLS_BITS), f(_ROLE_SH, _ROLE_BITS),
          f(_STATE_SH, _STATE_BITS), f(_NEXT_SH, _NEXT_BITS))


def fc(cls: Cls, role: FCRole | int = 0, state: FCState | int = 0, nxt: Next | int = 0) -> int:
  return int(pack(int(Family.FC), int(cls), int(role), int(state), int(nxt)))


def sql(cls: Cls, role: SQLRole | int = 0, state: SQLState | int = 0, nxt: Next | int = 0) -> int:
  return int(pack(int(Family.SQL), int(cls), int(role), int(state), int(nxt)))


def prompt(label: PromptLabel) -> int:
  return int(pack(int(Family.PROMPT), int(label)))


def is_well_formed(tag_id: int) -> bool:
  """A prefix id of a known family whose present fields are in that family's vocabularies."""
  if not 0 <= tag_id < N_IDS:
    return False
  fam, *fields = unpack(int(tag_id))
  if fam not in {int(k) for k in VOCAB}:
    return False
  enums = VOCAB[Family(fam)]
  if fields[0] == 0:
    return False  # class is the root of the chain: an id needs at least a class
  seen_absent = False
  for val, en in zip(fields, enums):
    if val == 0:
      seen_absent = True
      continue
    if seen_absent or en is None or val not in {int(e) for e in en}:
      return False
  return True


def parents(tag_id: int) -> list[int]:
  """The fallback chain of B.1, most specific first, starting with ``tag_id`` itself.

  ``parents(fc(c, r, s, n)) == [fc(c,r,s,n), fc(c,r,s), fc(c,r), fc(c)]``; absent fields are
  skipped, so a (class, role) id has the chain [(class, role), class].
  """
  fam, cls, role, state, nxt = unpack(int(tag_id))
  fields = [cls, role, state, nxt]
  chain = []
  for keep in range(4, 0, -1):
    if keep < 4 and fields[keep] == 0:
      continue  # that field was already absent: same id as the previous link
    kept = fields[:keep] + [0] * (4 - keep)
    chain.append(int(pack(fam, *kept)))
  return chain


def describe(tag_id: int, ablation: str | None = None) -> str:
  """Human-readable tag, e.g. ``fc:schema_bearing/required/critical/no_lookahead``; with a
  key ablation (:data:`KEY_ABLATIONS`) the stand-in of a merged field is written ``*``
  (``fc:*/required/critical/no_lookahead`` under no-class)."""
  if ablation == "no-transition" and tag_id in _POSITION_IDS:
    return f"pos:bin{_POSITION_IDS.index(int(tag_id))}"
  if ablation in MERGED and tag_id >= 0 and unpack(int(tag_id))[0] in _DECODE_FAMILIES:
    head, rest = describe(int(tag_id)).split(":", 1)
    parts = rest.split("/")
    if MERGED[ablation] < len(parts):
      parts[MERGED[ablation]] = "*"
    return f"{head}:" + "/".join(parts)
  if tag_id == PAD:
    return "pad"
  if tag_id == STOP:
    return "stop"
  fam, *fields = unpack(int(tag_id))
  try:
    family = Family(fam)
  except ValueError:
    return f"?{tag_id}"
  parts = []
  for val, en in zip(fields, VOCAB[family]):
    if val == 0:
      break
    try:
      parts.append(en(val).name.lower())
    except (TypeError, ValueError):
      parts.append(f"?{val}")
  return f"{family.name.lower()}:" + "/".join(parts)


def is_critical(tag_id: int) -> bool:
  """Crit(z) of Alg. 2: state critical or next lookahead_critical (decode families only)."""
  fam, cls, role, state, nxt = unpack(int(tag_id))
  if fam == Family.FC:
    crit_state = int(FCState.CRITICAL)
  elif fam == Family.SQL:
    crit_state = int(SQLState.CRITICAL)
  else:
    return False
  return state == crit_state or nxt == int(Next.LOOKAHEAD_CRITICAL)


def candidates(*ids: int) -> np.ndarray:
  """Up to ``N_CAND`` candidate ids -> ``int32[N_CAND]`` padded with ``PAD``."""
  if len(ids) > N_CAND:
    raise ValueError(f"at most {N_CAND} candidate ids, got {len(ids)}")
  out = np.full((N_CAND,), PAD, np.int32)
  out[:len(ids)] = ids
  return out


def all_ids(family: Family | None = None) -> list[int]:
  """Every well-formed id (of one family), in increasing order: the serialized tie order."""
  return [i for i in range(N_IDS) if is_well_formed(i)
          and (family is None or unpack(i)[0] == int(family))]


# ---- ablations (paper §4.3, C.5) -------------------------------------------------------------
#
# A policy may be calibrated under an ablation of the paper's Fig. 5.  Component ablations change
# Alg. 1 (calibrate/alg1.py): "no-floors" (no Runtime-V protection floors: the greedy path starts
# at all-R, distortion ranking alone) and "fixed-order" (floors kept; residual allocation in a
# fixed, layer-group round-robin order instead of the D-ranking).  Structural ablations coarsen
# the policy key: "no-class", "no-role", "no-state" (the parser state and the lookahead) map every
# decode tag id to an ablated key (:func:`coarsen`) — a merged class or role is replaced by the
# stand-in value 1 (a field may be present only if the fields above it are), state and next are
# cleared — and "no-layer" ties the actions of the layer groups (one key for every group).
# Prompt labels (the PROMPT family) are the prefill's keys, not parser transitions: no ablation
# coarsens them.  The frozen table stays indexed by tag id (entries[id] = entry[coarsen(id)],
# :func:`pask_jax.policy.build`), so the runtime is unchanged.
#
# "no-transition" replaces the decode tags by request-local position bins: bin k of a request's
# completion is the tag id :func:`position_id` (k), the bins' first positions are recorded in the
# policy (``record["position_bins"]``) and :class:`pask_jax.tracker.PositionTracker` emits them
# in place of the adapter's tags (and the unseen parser state, so the pooled reserve).
COMPONENT_ABLATIONS = ("no-floors", "fixed-order")
KEY_ABLATIONS = ("no-class", "no-role", "no-state")
ABLATIONS = COMPONENT_ABLATIONS + KEY_ABLATIONS + ("no-layer", "no-transition")
MAX_POSITION_BINS = 12
STAND_IN = 1                                  # the value a merged class / role field takes
MERGED = {"no-class": 0, "no-role": 1}        # ablation -> index of the merged field
_DECODE_FAMILIES = (int(Family.FC), int(Family.SQL))


def check_ablation(name: str | None) -> str | None:
  """``name`` if it is None or one of :data:`ABLATIONS`, else a one-line ValueError."""
  if name is not None and name not in ABLATIONS:
    raise ValueError(f"unknown ablation {name!r}; choose from {', '.join(ABLATIONS)}")
  return name


def coarsen(tag_id: int, ablation: str | None) -> int:
  """The ablated policy key of ``tag_id`` (itself a well-formed tag id for a well-formed one).

  no-class: class -> :data:`STAND_IN`; no-role: a present role -> :data:`STAND_IN`; no-state:
  state and next cleared.  Other ablations, prompt labels, and malformed ids map to themselves.
  """
  check_ablation(ablation)
  tag_id = int(tag_id)
  if ablation not in KEY_ABLATIONS or not is_well_formed(tag_id):
    return tag_id
  fam, cls, role, state, nxt = unpack(tag_id)
  if fam not in _DECODE_FAMILIES:
    return tag_id
  if ablation == "no-class":
    cls = STAND_IN
  elif ablation == "no-role":
    role = STAND_IN if role else 0
  else:
    state = nxt = 0
  return int(pack(fam, cls, role, state, nxt))


@functools.lru_cache(maxsize=None)
def key_table(ablation: str | None) -> tuple[int, ...]:
  """``coarsen(i, ablation)`` for every i < :data:`N_IDS` (cached: policies are built often)."""
  return tuple(coarsen(i, ablation) for i in range(N_IDS))


def position_id(k: int) -> int:
  """The tag id standing for position bin ``k`` (0-based) under no-transition: a well-formed FC
  (class, role) id, one per bin, no state or next (so never critical)."""
  if not 0 <= k < MAX_POSITION_BINS:
    raise ValueError(f"position bin {k} outside 0..{MAX_POSITION_BINS - 1}")
  return fc(1 + k // 4, 1 + k % 4)


def position_bin(position: int, edges) -> int:
  """The bin of a 0-based completion position, given the bins' first positions ``edges``
  (increasing, starting at 0): the last bin absorbs the tail."""
  return max(0, int(np.searchsorted(np.asarray(edges), position, side="right")) - 1)


def ablated_keys(ablation: str | None) -> list[int]:
  """Every ablated key (the image of :func:`coarsen` over :func:`all_ids`), increasing."""
  return sorted({coarsen(i, ablation) for i in all_ids()})


# ---- layer groups (A.2) ---------------------------------------------------------------------

def layer_boundaries(n_layers: int, n_groups: int = 3) -> tuple[int, ...]:
  """Boundaries ``(0, b1, ..., L)``: b_i = ⌈i·L/G⌉ = ⌊(i·L + G − 1)/G⌋.

  For G = 3 this is A.2's b1 = ⌊(L+2)/3⌋, b2 = ⌊(2L+2)/3⌋ (36 layers: 12/24; 40: 14/27; 32: 11/22).
  With more groups than layers some groups are empty (cost 0, they own no layer).
  """
  if n_layers < 1 or n_groups < 1:
    raise ValueError(f"need n_layers >= 1 and n_groups >= 1, got {n_layers}, {n_groups}")
  return tuple((i * n_layers + n_groups - 1) // n_groups for i in range(n_groups + 1))


def layer_groups(n_layers: int, n_groups: int = 3) -> tuple[tuple[int, int], ...]:
  """Half-open layer ranges ``((0, b1), (b1, b2), (b2, L))`` for the default three groups."""
  b = layer_boundaries(n_layers, n_groups)
  return tuple((b[i], b[i + 1]) for i in range(n_groups))


def group_of_layer(n_layers: int, n_groups: int = 3) -> tuple[int, ...]:
  """``g(ℓ)`` for every layer ℓ: a static tuple, usable as a Python or a jnp index."""
  out = []
  for g, (lo, hi) in enumerate(layer_groups(n_layers, n_groups)):
    out += [g] * (hi - lo)
  return tuple(out)


def vocab_record() -> dict:
  """The tag vocabularies as a JSON-able dict (for the A.4 policy record)."""
  rec = {"layout": {"next": [_NEXT_SH, _NEXT_BITS], "state": [_STATE_SH, _STATE_BITS],
                    "role": [_ROLE_SH, _ROLE_BITS], "class": [_CLS_SH, _CLS_BITS],
                    "family": [_FAM_SH, _FAM_BITS]},
         "pad": PAD, "stop": STOP, "n_cand": N_CAND, "families": {}}
  for fam, enums in VOCAB.items():
    rec["families"][fam.name.lower()] = {
        name: ({e.name.lower(): int(e) for e in en} if en is not None else None)
        for name, en in zip(("class", "role", "state", "next"), enums)}
  return rec


def stack_candidates(rows: Sequence[Sequence[int]]) -> np.ndarray:
  """A list of candidate lists -> ``int32[len(rows), N_CAND]``."""
  return np.stack([candidates(*r) for r in rows]) if rows else np.zeros((0, N_CAND), np.int32)


_POSITION_IDS = [position_id(k) for k in range(MAX_POSITION_BINS)]
