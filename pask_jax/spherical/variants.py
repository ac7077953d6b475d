"""The Spherical KV methods of the evaluation harness (docs/SPHERICAL_KV.md §4 "Ablations", §3
"Coexistence"): each a configuration of the one :class:`pask_jax.spherical.runner.SphRunner`
(ladder, plan, read path, tag protection), never a copy of it.  Imports nothing heavy, so the
method registry (``pask_jax.baselines.METHODS``) can list the names.

==============  =====  ==========================================================================
name            label  configuration (what it isolates)
==============  =====  ==========================================================================
spherical       A0     full method (the design's ``sphkv``): paper ladder A2/A42/A4, RDR plan,
                       logits from the codes (ADA)
sphkv-rd        A1     RD-only: A0's storage and controller, read by reconstruct-then-dot (each
                       step the tiers' visible keys are decoded into a transient dense BF16 K,
                       then a BF16 partition attends) — isolates in-kernel angle-domain attention
sphkv-angle     A2     angle-only: every non-sink token at t2 (A42), no drop, no RDR — isolates
                       the format at a fixed rate, without rate–distortion allocation
sphkv-retain    A3     retention-only: tiers {drop, t3 (A4)}, RDR plan — isolates retention
                       (drop vs keep) without down-tiering
sphkv-quant     A3'    quantization-only: every non-sink token at t1 (A2), no drop, no RDR —
                       isolates the cheapest tier without retention
sphkv-gated     A5     A0 with the ``gated`` decode rule: a generated token's items are placed
                       when it leaves the window, at argmin_t D_i(t) + λ_g C(t) from the
                       attention it received there, within the balance — isolates the decode
                       gate (vs A0's fixed rule)
rdr+tags        ext.   A0 with PASK's floor-H tags in RDR's protected set P (a PASK policy's
                       floors, the grammar tracker's tags) — isolates what parser tags add to RDR
sphkv-shared    A0s    A0 with one route for every KV head of a (token, group): RDR on the heads'
                       summed distortion — isolates per-head tiers (vs shared)
sphkv-compact   ext.   A0 on the compact ladder (§2.3 [ours]): A42 and A4 keys with INT4 values
                       below the top tier, A4 keys with BF16 values on top (protected items) —
                       the low-residency curve, at PASK's INT4 bytes per item
sphkv-flat      A4     A0 with the segment weights ω = (1, 1, 1): the prompt's recent tokens
                       (its last 64) weigh no more than the rest — isolates the recency weight
                       of §2.4's distortion (generated tokens take the fixed rule here; ω
                       reaches them only under the gated rule)
sphkv-recent4   A4     A0 with ω = (1, 1, 4): recent tokens weigh twice A0's — the other side
                       of the ω sweep
sphkv-retrieved A4     A0 with ω = (1, 2, 2): retrieved evidence (the spans a workload marks:
                       W2's document) weighs as the recent tokens — ω's middle weight (A0
                       prices it as the prefix; W1 and W3 mark none, so there it is A0)
pask+ada        ext.   PASK's policy and controller (R/L/H from tags, PASK's budget) with its L
                       items stored at tier A4 keys + INT4 values (the compact ladder's t2, the
                       bytes of PASK's INT4 L) instead of INT4 K+V — isolates the key format
                       under PASK's policy
==============  =====  ==========================================================================

Fixed-rate variants (``plan="fixed"``) ignore the budget when placing items (their rate is the
tier's); a requested B below that rate is reported as a deficit, never hidden.
"""
from __future__ import annotations

import dataclasses

PLANS = ("rdr", "fixed", "pask")
READS = ("angles", "reconstruct")
DECODES = ("fixed", "gated")
HEADS = ("own", "shared")
OMEGA = (1.0, 1.0, 2.0)     # §2.4's segment weights: prefix, retrieved, recent


def check_omega(omega) -> tuple[float, float, float]:
  """``omega`` as three positive finite floats (prefix, retrieved, recent), or a one-line error:
  a weight of 0 would make a segment's items free to drop, a negative one rewards distortion."""
  if isinstance(omega, (str, bytes)):
    raise ValueError(f"omega must be three numbers (prefix, retrieved, recent), got {omega!r}")
  try:
    om = tuple(float(x) for x in omega)
  except (TypeError, ValueError):
    raise ValueError(f"omega must be three numbers (prefix, retrieved, recent), got "
                     f"{omega!r}") from None
  if len(om) != 3 or not all(0 < x < float("inf") for x in om):
    raise ValueError(f"omega must be three positive finite weights (prefix, retrieved, "
                     f"recent), got {omega!r}")
  return om


@dataclasses.dataclass(frozen=True)
class Variant:
  """One harness method as SphRunner settings: ``layouts`` the ladder (ascending cost) with
  ``values`` its value format (one for every tier, or one per tier); ``plan`` "rdr" (the RDR
  controller under the budget), "fixed" (every item at the ladder's only tier, no drop) or
  "pask" (PASK's controller and policy: H to the BF16 pool, L to the ladder's only tier, R
  dropped); ``read`` "angles" (logits from the
  codes) or "reconstruct" (dense BF16 K rebuilt per step, then attention); ``tags``: PASK
  floor-H tags join P; ``decode`` "fixed" (§2.4's fixed rule) or "gated" (the tier of a
  generated token chosen when it leaves the window, from the attention it received there;
  plan "rdr" only); ``heads`` "own" (per-head routes) or "shared" (one route per (token, group),
  plan "rdr" only); ``omega`` the segment weights (prefix, retrieved, recent) of RDR's
  distortion (plan "rdr" only).  ``needs_policy``: the run takes a PASK policy and the
  parser's tags."""

  label: str
  layouts: tuple[str, ...] = ("A2", "A42", "A4")
  values: str | tuple[str, ...] = "bf16"
  plan: str = "rdr"
  read: str = "angles"
  tags: bool = False
  decode: str = "fixed"
  heads: str = "own"
  omega: tuple[float, float, float] = OMEGA
  isolates: str = ""

  def __post_init__(self):
    if self.plan not in PLANS:
      raise ValueError(f"plan must be one of {PLANS}, got {self.plan!r}")
    if self.read not in READS:
      raise ValueError(f"read must be one of {READS}, got {self.read!r}")
    if not self.layouts:
      raise ValueError("a variant needs at least one tier layout")
    if self.plan in ("fixed", "pask") and len(self.layouts) != 1:
      raise ValueError(f"plan {self.plan!r} places items at one tier; got the ladder "
                       f"{self.layouts}")
    if self.tags and self.plan != "rdr":
      raise ValueError("tags join RDR's protected set: they need plan 'rdr'")
    if self.decode not in DECODES:
      raise ValueError(f"decode must be one of {DECODES}, got {self.decode!r}")
    if self.decode == "gated" and self.plan != "rdr":
      raise ValueError("the gated decode rule prices tiers with RDR's λ: it needs plan 'rdr'")
    if not isinstance(self.values, str) and len(self.values) != len(self.layouts):
      raise ValueError(f"one value format per tier: {len(self.layouts)} layouts, "
                       f"{len(self.values)} formats")
    if self.heads not in HEADS:
      raise ValueError(f"heads must be one of {HEADS}, got {self.heads!r}")
    if self.heads == "shared" and self.plan != "rdr":
      raise ValueError("shared tiers are an RDR decision: they need plan 'rdr'")
    object.__setattr__(self, "omega", check_omega(self.omega))
    if self.omega != OMEGA and self.plan != "rdr":
      raise ValueError("the segment weights ω price RDR's distortion: they need plan 'rdr'")

  @property
  def needs_policy(self) -> bool:
    return self.tags or self.plan == "pask"


VARIANTS: dict[str, Variant] = {
    "spherical": Variant("A0", isolates="full method: ADA + RDR, paper ladder"),
    "sphkv-rd": Variant("A1", read="reconstruct",
                        isolates="angle-domain attention: same storage and RDR, "
                                 "reconstruct-then-dot"),
    "sphkv-angle": Variant("A2", layouts=("A42",), plan="fixed",
                           isolates="rate-distortion allocation: every item at t2, no drop"),
    "sphkv-retain": Variant("A3", layouts=("A4",),
                            isolates="down-tiering: RDR over {drop, t3} only"),
    "sphkv-quant": Variant("A3'", layouts=("A2",), plan="fixed",
                           isolates="retention: every item at t1, no drop"),
    "sphkv-gated": Variant("A5", decode="gated",
                           isolates="decode gate: a generated token's tier from the attention "
                                    "it received in the window, not the fixed rule"),
    "rdr+tags": Variant("ext", tags=True,
                        isolates="parser tags: PASK's floor-H tags join RDR's protected set"),
    "sphkv-shared": Variant("A0s", heads="shared",
                            isolates="per-head tiers: one route for every KV head of a "
                                     "(token, group)"),
    "sphkv-compact": Variant("ext", layouts=("A42", "A4", "A4"),
                             values=("int4", "int4", "bf16"),
                             isolates="compact ladder: INT4 values below the top tier"),
    "sphkv-flat": Variant("A4", omega=(1.0, 1.0, 1.0),
                          isolates="segment weights: recent tokens weigh as the rest "
                                   "(ω = 1, 1, 1)"),
    "sphkv-recent4": Variant("A4", omega=(1.0, 1.0, 4.0),
                             isolates="segment weights: recent tokens weigh twice A0's "
                                      "(ω = 1, 1, 4)"),
    "sphkv-retrieved": Variant("A4", omega=(1.0, 2.0, 2.0),
                               isolates="segment weights: retrieved evidence weighs as the "
                                        "recent tokens (ω = 1, 2, 2)"),
    "pask+ada": Variant("ext", layouts=("A4",), values="int4", plan="pask",
                        isolates="key format under PASK: L items angle-coded, not INT4"),
}
METHODS = tuple(VARIANTS)
TAGGED = tuple(n for n, v in VARIANTS.items() if v.needs_policy)   # take a policy and tags


def variant(name: str) -> Variant:
  """The configuration of harness method ``name`` (one-line error for an unknown name)."""
  try:
    return VARIANTS[name]
  except KeyError:
    raise ValueError(f"unknown Spherical KV method {name!r}; choose from "
                     f"{', '.join(VARIANTS)}") from None


__all__ = ["DECODES", "HEADS", "METHODS", "OMEGA", "PLANS", "READS", "TAGGED", "VARIANTS",
           "Variant", "check_omega", "variant"]
