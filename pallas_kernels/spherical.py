"""The Spherical KV key format (docs: docs/SPHERICAL_KV.md §2.1–2.3): centering, a fixed
Hadamard rotation, the polar tree, per-level angle quantizers, the tier code layouts, CosFromAngles
and the tier byte sizes.  Imports nothing of the method (no cache, controller or model code).

A key ``k ∈ R^D`` (post-RoPE, one layer ℓ and KV head h; D a power of two ≥ 8) is stored as

* ``x = Π_ℓ (k − μ_{ℓ,h})`` with ``Π_ℓ = H_D·diag(s_ℓ)/√D`` (:func:`rotation`), then
* the polar tree of ``x``: level 1 angles ``atan2(x_{2i+1}, x_{2i})`` on the full circle, level
  ℓ ≥ 2 angles ``atan2(ρ_{2i+1}, ρ_{2i})`` ∈ [0, π/2] of the previous level's pair norms, D − 1
  angles in all, and the radius ``r = ‖x‖`` (fp16, in the low half of a u32 side word);
* codes in *tree order* ``[level 1 (D/2) | level 2 (D/4) | … | level n (1) | pad (1, always 0)]``
  packed by the tier's layout (:data:`LAYOUTS`): A4 (4/4 bits), A42 (4 bits level 1, 2 bits
  above), A2 (2/2).

Exactness.  No step of the encoder divides or calls atan2: an angle's code is the number of bin
boundaries θ_j it has passed, and "φ ≥ θ_j" for the pair ``(a, b)`` (φ = atan2(b, a)) is the
comparison ``b·cos θ_j ≥ a·sin θ_j`` of two correctly rounded f32 products (no add, so no FMA
contraction can change it) against constants computed once in float64.  The codes are therefore a
deterministic function of the f32 pair values on every IEEE backend, under jit and eagerly; they
may differ from ``⌊(atan2(b, a) − θ_0)/Δ⌋`` only for angles within a few f32 ulps of a boundary.
What feeds the quantizer — the rotation matmul (accumulation order) and the pair norms ``ρ`` (a
backend may contract ``a² + b²`` into an FMA) — is f32 arithmetic that is deterministic on one
backend but not across backends, so a key may land in a neighbouring bin on another backend (the
design allows one code of slack there).  Everything after the codes is exact: packing and
unpacking are integer-only (shifts on int32, TPU has no int8 shifts), and decoding reads cos/sin of
the bin centres from float64-computed tables, so the decoded direction (a product of table values
in a fixed order) has the same bits everywhere.

The logit of a stored key for a query q is ``(q·μ + r̃·CosFromAngles(Π_ℓ q, φ̃))/√D``
(:func:`scores`); CosFromAngles works on the angles, never on a rebuilt dense key.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# Max's optimal uniform quantizer steps for a unit Gaussian, by bit width (2, 3, 4 bits).
MAX_STEP = {2: 0.9957, 3: 0.5860, 4: 0.3352}
FP16_MAX = float(np.finfo(np.float16).max)

# Tier layouts: (level-1 bits, higher-level bits).
LAYOUTS = {"A4": (4, 4), "A42": (4, 2), "A2": (2, 2)}
VALUE_FORMATS = ("bf16", "int4")
SIDE_BYTES = 4  # u32 side word: fp16 radius | fp16 value scale
POSITION_BYTES = 4  # per stored item (i32 position)
TABLE_ENTRY_BYTES = 4  # per page (i32 page-table entry)


@dataclasses.dataclass(frozen=True)
class Spec:
  """A key code format: head dim ``d``, level-1 bits ``b1``, higher-level bits ``bh`` and the
  per-level angle scale ``sigma`` of levels 2..n (None: the isotropic ``2^{-(ℓ+1)/2}``).

  Hashable, so it can be a static argument; ``sigma`` is a tuple of Python floats."""

  d: int
  b1: int
  bh: int
  sigma: tuple[float, ...] | None = None

  def __post_init__(self):
    if self.d < 8 or self.d & (self.d - 1):
      raise ValueError(f"head dim must be a power of two >= 8, got {self.d}")
    if (self.b1, self.bh) not in LAYOUTS.values():
      raise ValueError(f"(b1, bh) = ({self.b1}, {self.bh}) is not a tier layout {LAYOUTS}")
    if self.sigma is not None and len(self.sigma) != self.levels - 1:
      raise ValueError(
        f"sigma needs {self.levels - 1} values (levels 2..{self.levels}), got {len(self.sigma)}"
      )
    if self.sigma is not None and not all(s > 0 for s in self.sigma):
      raise ValueError(f"sigma must be positive, got {self.sigma}")

  @property
  def levels(self) -> int:
    return self.d.bit_length() - 1

  @property
  def layout(self) -> str:
    return {v: k for k, v in LAYOUTS.items()}[(self.b1, self.bh)]

  @property
  def code_bytes(self) -> int:
    """Packed angle bytes per key: the D tree-order codes (D − 1 angles + the pad)."""
    return (self.d // 2) * (self.b1 + self.bh) // 8


def spec(layout: str, d: int, sigma=None) -> Spec:
  """The :class:`Spec` of a named layout (``"A4"``, ``"A42"``, ``"A2"``)."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, got {layout!r}")
  b1, bh = LAYOUTS[layout]
  return Spec(d, b1, bh, None if sigma is None else tuple(float(s) for s in sigma))


# --- rotation and centering --------------------------------------------------------------------


def hadamard(d: int) -> np.ndarray:
  """Sylvester–Hadamard matrix H_d (entries ±1), float64."""
  if d < 1 or d & (d - 1):
    raise ValueError(f"Hadamard size must be a power of two, got {d}")
  h = np.ones((1, 1))
  while h.shape[0] < d:
    h = np.block([[h, h], [h, -h]])
  return h


def rotation_signs(d: int, layer: int, seed: int = 0) -> np.ndarray:
  """The per-layer signs ``s_ℓ ∈ {±1}^d`` (numpy's PCG64: the same on every machine)."""
  rng = np.random.default_rng([seed, layer])
  return (2 * rng.integers(0, 2, d) - 1).astype(np.float64)


def rotation(d: int, layer: int, seed: int = 0) -> np.ndarray:
  """``Π_ℓ = H_d·diag(s_ℓ)/√d`` as float32 [d, d] (orthogonal); rotate with ``x @ Π.T``."""
  return (hadamard(d) * rotation_signs(d, layer, seed)[None, :] / math.sqrt(d)).astype(np.float32)


def key_mean(k: np.ndarray, sink: int = 4) -> np.ndarray:
  """Centering constant μ: mean over tokens of post-RoPE keys ``[T, Hkv, D]`` without the first
  ``sink`` tokens (attention sinks have atypical keys) -> float32 [Hkv, D]."""
  k = np.asarray(k, np.float64)
  if k.ndim != 3 or k.shape[0] <= sink:
    raise ValueError(f"key_mean needs keys [T > sink={sink}, Hkv, D], got shape {k.shape}")
  return k[sink:].mean(axis=0).astype(np.float32)


def to_code_space(k: jax.Array, mu: jax.Array, rot: jax.Array) -> jax.Array:
  """``x = Π (k − μ)`` in f32: ``k [..., H, D]``, ``mu [H, D]`` (or broadcastable),
  ``rot [D, D]``."""
  x0 = k.astype(jnp.float32) - jnp.asarray(mu, jnp.float32)
  return jnp.einsum(
    "...d,ed->...e", x0, jnp.asarray(rot, jnp.float32), precision=jax.lax.Precision.HIGHEST
  )


# --- quantizer constants (float64 in numpy, then fixed f32 tables) ----------------------------


def steps(sp: Spec) -> np.ndarray:
  """Angle bin width per level 1..n (float64)."""
  n = sp.levels
  out = [2 * math.pi / 2**sp.b1]
  for lvl in range(2, n + 1):
    sig = 2.0 ** (-(lvl + 1) / 2) if sp.sigma is None else sp.sigma[lvl - 2]
    out.append(min(MAX_STEP[sp.bh] * sig, (math.pi / 2) / 2**sp.bh))
  return np.asarray(out)


def _exact_trig(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """cos, sin in float64 with multiples of π/2 snapped to exact 0/±1 (cos(π/2) is 6e-17 in
  float64: a boundary on an axis must test the axis itself)."""
  c, s = np.cos(theta), np.sin(theta)
  c = np.where(np.abs(c) < 1e-12, 0.0, c)
  s = np.where(np.abs(s) < 1e-12, 0.0, s)
  return c, s


def boundaries(sp: Spec, level: int) -> np.ndarray:
  """Bin boundaries of a level (float64): level 1 the ``2^{b1}`` rays ``−π + jΔ₁`` (bin j is
  ``[θ_j, θ_{j+1})``, cyclically); level ≥ 2 the ``2^{bh} − 1`` inner boundaries
  ``π/4 + (j − 2^{bh−1})Δ_ℓ``, j = 1..2^{bh}−1 (the outer bins reach 0 and π/2)."""
  dl = steps(sp)[level - 1]
  if level == 1:
    return -math.pi + dl * np.arange(2**sp.b1)
  half = 2 ** (sp.bh - 1)
  return math.pi / 4 + (np.arange(1, 2**sp.bh) - half) * dl


def centers(sp: Spec, level: int) -> np.ndarray:
  """Decoded angle of every code of a level (float64)."""
  dl = steps(sp)[level - 1]
  if level == 1:
    return -math.pi + (np.arange(2**sp.b1) + 0.5) * dl
  return math.pi / 4 + (np.arange(2**sp.bh) + 0.5 - 2 ** (sp.bh - 1)) * dl


def level_of_position(d: int) -> np.ndarray:
  """Tree level of each of the D code positions (0 for the pad)."""
  out, off, width, lvl = np.zeros(d, np.int32), 0, d // 2, 1
  while width >= 1:
    out[off : off + width] = lvl
    off, width, lvl = off + width, width // 2, lvl + 1
  return out


def trig_tables(sp: Spec) -> tuple[np.ndarray, np.ndarray]:
  """cos / sin of the decoded angle per (code position, code) as float32 ``[D, 2^max(b)]``; the
  pad row decodes to angle 0 (unused)."""
  width = 2 ** max(sp.b1, sp.bh)
  ct, st = np.ones((sp.d, width)), np.zeros((sp.d, width))
  lv = level_of_position(sp.d)
  for lvl in range(1, sp.levels + 1):
    c, s = _exact_trig(centers(sp, lvl))
    ct[lv == lvl, : len(c)] = c
    st[lv == lvl, : len(s)] = s
  return ct.astype(np.float32), st.astype(np.float32)


# --- encode ------------------------------------------------------------------------------------


def _level1_codes(a: jax.Array, b: jax.Array, sp: Spec) -> jax.Array:
  """Codes of the full-circle angles ``atan2(b, a)``: the bin j with the point at or
  counter-clockwise of ray j and strictly clockwise of ray j+1 (each test is one product
  comparison; bins are narrower than π, so exactly one bin holds any nonzero point; the zero
  vector, which has no direction, gets code 0)."""
  c, s = _exact_trig(boundaries(sp, 1))
  c, s = c.astype(np.float32), s.astype(np.float32)
  left = b[..., None] * c >= a[..., None] * s  # [..., D/2, 2^b1]
  inside = left & ~jnp.roll(left, -1, axis=-1)
  code = jnp.sum(jnp.where(inside, jnp.arange(len(c), dtype=jnp.int32), 0), axis=-1)
  return code.astype(jnp.int32)


def _upper_codes(a: jax.Array, b: jax.Array, sp: Spec, level: int) -> jax.Array:
  """Codes of ``atan2(b, a)`` ∈ [0, π/2] (a, b ≥ 0): the number of inner boundaries passed."""
  c, s = _exact_trig(boundaries(sp, level))
  c, s = c.astype(np.float32), s.astype(np.float32)
  passed = b[..., None] * c >= a[..., None] * s
  return jnp.sum(passed.astype(jnp.int32), axis=-1)


def encode(x: jax.Array, sp: Spec) -> tuple[jax.Array, jax.Array]:
  """Rotated, centered keys ``x [..., D]`` -> (tree-order codes ``int32 [..., D]``, radius
  ``f32 [...]`` = ‖x‖ from the tree's pair norms).  Jittable; no division, no atan2."""
  if x.shape[-1] != sp.d:
    raise ValueError(f"keys have dim {x.shape[-1]}, spec says {sp.d}")
  x = x.astype(jnp.float32)
  a, b = x[..., 0::2], x[..., 1::2]
  parts = [_level1_codes(a, b, sp)]
  rho = jnp.sqrt(a * a + b * b)
  for lvl in range(2, sp.levels + 1):
    a, b = rho[..., 0::2], rho[..., 1::2]
    parts.append(_upper_codes(a, b, sp, lvl))
    rho = jnp.sqrt(a * a + b * b)
  parts.append(jnp.zeros(x.shape[:-1] + (1,), jnp.int32))  # pad
  return jnp.concatenate(parts, axis=-1), rho[..., 0]


def encode_numpy(x: np.ndarray, sp: Spec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The quantizer's definition in float64 with atan2 (an independent oracle): ``x [..., D]``
  -> (codes int32 [..., D], radius float64 [...], angles float64 [..., D] with the pad 0)."""
  x = np.asarray(x, np.float64)
  a, b = x[..., 0::2], x[..., 1::2]
  phi1 = np.arctan2(b, a)
  phi1 = np.where(phi1 == -np.pi, np.pi, phi1)  # (−π, π]
  codes = [np.floor((phi1 + np.pi) / steps(sp)[0]).astype(np.int64) % 2**sp.b1]
  angles = [phi1]
  rho = np.hypot(a, b)
  half = 2 ** (sp.bh - 1)
  for lvl in range(2, sp.levels + 1):
    a, b = rho[..., 0::2], rho[..., 1::2]
    phi = np.arctan2(b, a)
    c = np.floor((phi - np.pi / 4) / steps(sp)[lvl - 1]).astype(np.int64) + half
    codes.append(np.clip(c, 0, 2**sp.bh - 1))
    angles.append(phi)
    rho = np.hypot(a, b)
  pad = np.zeros(x.shape[:-1] + (1,))
  return (
    np.concatenate(codes + [pad.astype(np.int64)], -1).astype(np.int32),
    rho[..., 0],
    np.concatenate(angles + [pad], -1),
  )


# --- packing -----------------------------------------------------------------------------------


def _pack_split(c: jax.Array, bits: int) -> jax.Array:
  """``c [..., N]`` -> ``uint8 [..., N·bits/8]``: byte i = Σ_j c_{i + j·N/per} << bits·j."""
  per = 8 // bits
  n = c.shape[-1] // per
  out = jnp.zeros(c.shape[:-1] + (n,), jnp.int32)
  for j in range(per):
    out = out | ((c[..., j * n : (j + 1) * n] & (2**bits - 1)) << (bits * j))
  return out.astype(jnp.uint8)


def _unpack_split(p: jax.Array, bits: int) -> jax.Array:
  p = p.astype(jnp.int32)  # TPU shifts need int32
  return jnp.concatenate([(p >> (bits * j)) & (2**bits - 1) for j in range(8 // bits)], -1)


def pack(codes: jax.Array, sp: Spec) -> jax.Array:
  """Tree-order codes ``[..., D]`` (unsigned, in range) -> ``uint8 [..., sp.code_bytes]``.

  A4: byte i = c_i | c_{i+D/2} << 4 (low nibbles = level 1).  A2: byte i = Σ_j c_{i+jD/4} << 2j.
  A42: level-1 block of D/4 bytes (byte i = c_i | c_{i+D/4} << 4), then D/8 bytes of the higher
  levels, byte i = Σ_j c_{D/2+i+jD/8} << 2j."""
  if codes.shape[-1] != sp.d:
    raise ValueError(f"codes have length {codes.shape[-1]}, spec says {sp.d}")
  c = codes.astype(jnp.int32)
  if sp.b1 == sp.bh:
    return _pack_split(c, sp.b1)
  h = sp.d // 2
  return jnp.concatenate([_pack_split(c[..., :h], sp.b1), _pack_split(c[..., h:], sp.bh)], -1)


def unpack(packed: jax.Array, sp: Spec) -> jax.Array:
  """Inverse of :func:`pack`: ``uint8 [..., sp.code_bytes]`` -> tree-order codes
  ``int32 [..., D]``."""
  if packed.shape[-1] != sp.code_bytes:
    raise ValueError(
      f"packed codes have {packed.shape[-1]} bytes, {sp.layout} at D={sp.d} has {sp.code_bytes}"
    )
  if sp.b1 == sp.bh:
    return _unpack_split(packed, sp.b1)
  n1 = sp.d // 2 * sp.b1 // 8
  return jnp.concatenate(
    [_unpack_split(packed[..., :n1], sp.b1), _unpack_split(packed[..., n1:], sp.bh)], -1
  )


def side_word(radius: jax.Array, value_scale: jax.Array | None = None) -> jax.Array:
  """u32 side word: fp16 radius (low half) | fp16 value scale (high half; 0 for BF16 values)."""
  bits = lambda v: jax.lax.bitcast_convert_type(
    jnp.minimum(v.astype(jnp.float32), FP16_MAX).astype(jnp.float16), jnp.uint16
  )
  lo = bits(radius).astype(jnp.uint32)
  hi = jnp.zeros_like(lo) if value_scale is None else bits(value_scale).astype(jnp.uint32)
  return lo | (hi << 16)


def side_radius(side: jax.Array) -> jax.Array:
  """The fp16 radius of a side word, as f32."""
  lo = (side & jnp.uint32(0xFFFF)).astype(jnp.uint16)
  return jax.lax.bitcast_convert_type(lo, jnp.float16).astype(jnp.float32)


def side_value_scale(side: jax.Array) -> jax.Array:
  """The fp16 value scale of a side word, as f32."""
  hi = (side >> 16).astype(jnp.uint16)
  return jax.lax.bitcast_convert_type(hi, jnp.float16).astype(jnp.float32)


# --- decode and CosFromAngles ------------------------------------------------------------------


def angle_trig(codes: jax.Array, sp: Spec) -> tuple[jax.Array, jax.Array]:
  """Tree-order codes ``[..., D]`` -> (cos φ̃, sin φ̃) f32 ``[..., D]`` from the exact tables."""
  ct, st = trig_tables(sp)
  pos = jnp.arange(sp.d)
  c = codes.astype(jnp.int32)
  return jnp.asarray(ct)[pos, c], jnp.asarray(st)[pos, c]


def _level_slices(d: int) -> list[slice]:
  out, off, width = [], 0, d // 2
  while width >= 1:
    out.append(slice(off, off + width))
    off, width = off + width, width // 2
  return out


def direction(cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Unit direction ũ ``[..., D]`` from tree-order cos/sin (top-down; products only)."""
  sl = _level_slices(cos.shape[-1])
  u = jnp.ones(cos.shape[:-1] + (1,), jnp.float32)
  for s in reversed(sl):  # level n .. 1
    u = jnp.stack([u * cos[..., s], u * sin[..., s]], -1).reshape(u.shape[:-1] + (-1,))
  return u


def cos_from_angles(qr: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """CosFromAngles: ``q'·ũ`` from the rotated query ``qr [..., D]`` and a key's tree-order cos/sin
  ``[..., D]`` (broadcast against each other), bottom-up, without forming ũ:
  ``V¹_i = q'_{2i} cos φ¹_i + q'_{2i+1} sin φ¹_i``, ``V^ℓ_i = cos φ^ℓ_i V^{ℓ−1}_{2i} + sin φ^ℓ_i
  V^{ℓ−1}_{2i+1}``; returns ``V^n_0`` [...]."""
  sl = _level_slices(cos.shape[-1])
  qr = qr.astype(jnp.float32)
  v = qr[..., 0::2] * cos[..., sl[0]] + qr[..., 1::2] * sin[..., sl[0]]
  for s in sl[1:]:
    v = cos[..., s] * v[..., 0::2] + sin[..., s] * v[..., 1::2]
  return v[..., 0]


def decode_key(
  packed: jax.Array, side: jax.Array, mu: jax.Array, rot: jax.Array, sp: Spec
) -> jax.Array:
  """Dense ``k̃ = μ + r̃·Πᵀ ũ`` (tests and the format-only path; kernels never form it)."""
  u = direction(*angle_trig(unpack(packed, sp), sp))
  x = side_radius(side)[..., None] * u
  return jnp.einsum(
    "...e,ed->...d", x, jnp.asarray(rot, jnp.float32), precision=jax.lax.Precision.HIGHEST
  ) + jnp.asarray(mu, jnp.float32)


def encode_key(
  k: jax.Array, mu: jax.Array, rot: jax.Array, sp: Spec
) -> tuple[jax.Array, jax.Array]:
  """Post-RoPE keys ``[..., H, D]`` -> (packed codes ``uint8 [..., H, code_bytes]``, side words
  ``u32 [..., H]`` with the fp16 radius and value scale 0)."""
  codes, r = encode(to_code_space(k, mu, rot), sp)
  return pack(codes, sp), side_word(r)


def scores(
  q: jax.Array,
  packed: jax.Array,
  side: jax.Array,
  mu: jax.Array,
  rot: jax.Array,
  sp: Spec,
  scale: float | None = None,
) -> jax.Array:
  """Reference logits without a dense key: ``q [..., D]`` against stored keys ``packed [..., NB]``,
  ``side [...]`` (broadcast against each other; ``mu`` broadcast with them, one [D] row per
  key) -> ``(q·μ + r̃·CosFromAngles(Π q, φ̃))·scale`` (scale defaults to 1/√D)."""
  scale = 1.0 / math.sqrt(sp.d) if scale is None else scale
  qf = q.astype(jnp.float32)
  qr = jnp.einsum(
    "...d,ed->...e", qf, jnp.asarray(rot, jnp.float32), precision=jax.lax.Precision.HIGHEST
  )
  beta = jnp.sum(qf * jnp.asarray(mu, jnp.float32), axis=-1)
  cos, sin = angle_trig(unpack(packed, sp), sp)
  return (beta + side_radius(side) * cos_from_angles(qr, cos, sin)) * scale


# --- byte sizes --------------------------------------------------------------------------------


def tier_bytes(layout: str, d: int, values: str = "bf16") -> int:
  """Bytes per (token, layer, KV head) of a tier: packed angle codes + u32 side word + values
  (BF16: 2D; INT4: D/2, its fp16 scale lives in the side word)."""
  if values not in VALUE_FORMATS:
    raise ValueError(f"values must be one of {VALUE_FORMATS}, got {values!r}")
  v = 2 * d if values == "bf16" else d // 2
  return spec(layout, d).code_bytes + SIDE_BYTES + v


def item_bytes(layout: str, d: int, layers: int, values: str = "bf16", page: int = 16) -> float:
  """RDR item cost C(t) of one (token, layer group, KV head): ``layers`` × :func:`tier_bytes` +
  a 4-byte position + a 1-bit protection flag + a 4-byte page-table entry per ``page`` items."""
  if layers < 1 or page < 1:
    raise ValueError(f"layers and page must be >= 1, got {layers}, {page}")
  return layers * tier_bytes(layout, d, values) + POSITION_BYTES + 1 / 8 + TABLE_ENTRY_BYTES / page


def dense_bytes(d: int) -> int:
  """Dense BF16 K + V bytes per (token, layer, KV head)."""
  return 4 * d


__all__ = [
  "FP16_MAX",
  "LAYOUTS",
  "MAX_STEP",
  "Spec",
  "VALUE_FORMATS",
  "angle_trig",
  "boundaries",
  "centers",
  "cos_from_angles",
  "decode_key",
  "dense_bytes",
  "direction",
  "encode",
  "encode_key",
  "encode_numpy",
  "hadamard",
  "item_bytes",
  "key_mean",
  "level_of_position",
  "pack",
  "rotation",
  "rotation_signs",
  "scores",
  "side_radius",
  "side_value_scale",
  "side_word",
  "spec",
  "steps",
  "tier_bytes",
  "to_code_space",
  "trig_tables",
  "unpack",
]
