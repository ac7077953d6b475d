"""Inputs of the Spherical KV tier partitions for ONE layer (docs/SPHERICAL_KV.md §2.5, §3
"Kernel contract").  Immutable pytrees; what must be static (the tier formats) is pytree metadata,
so it reaches jit as part of the tree structure.

A tier's pages are tier-homogeneous and belong to one (layer group, sequence, KV head): unlike the
BF16/INT4 pools, a tier page has no head axis, and its page table is per (sequence, KV head).
Shapes (L = layers, P = pages of the tier, page = page size, NB = packed angle bytes per key):

* ``SphPool``: ``ang u8 [L, P, page, NB]``, ``side u32 [L, P, page]`` (fp16 radius | fp16 value
  scale), ``v bf16 [L, P, page, D]`` or ``u8 [L, P, page, D/2]`` (INT4 half-split nibbles, scale
  in the side word's high half).  With ``layer=None`` the leading L axis is absent.
* ``SphMaps``: per tier, ``pages [B, Hkv, n]`` and ``length [B, Hkv]`` of this layer's group.
  Entry j of (b, h) lives in page ``pages[b, h, j // page]`` at row ``j % page``; entries
  ``j >= length[b, h]`` are invisible and may hold garbage (NaN included).
* ``SphConsts``: the rotation signs ``[L, D]`` (Π_ℓ = H_D·diag(s_ℓ)/√D) and the centering means
  ``mu [L, Hkv, D]`` (f32); without the L axis when ``layer=None``.
* ``SphInputs``: the pools, maps and constants plus the static ``spec``, one :class:`TierSpec`
  per tier, in the same order as ``pools`` and the maps' tuples.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from pallas_kernels import spherical


@dataclasses.dataclass(frozen=True)
class TierSpec:
  """One tier's static format: angle layout (``"A4"``, ``"A42"``, ``"A2"``: b₁/b_h bits), value
  format (``"bf16"`` or ``"int4"``), head dim ``d`` and optional per-level angle scales
  ``sigma`` (levels 2..n; None: isotropic)."""

  layout: str
  values: str
  d: int
  sigma: tuple[float, ...] | None = None

  def __post_init__(self):
    if self.values not in spherical.VALUE_FORMATS:
      raise ValueError(f"values must be one of {spherical.VALUE_FORMATS}, got {self.values!r}")
    self.key  # validates layout, d and sigma

  @property
  def key(self) -> spherical.Spec:
    """The key code format of :mod:`pallas_kernels.spherical`."""
    return spherical.spec(self.layout, self.d, self.sigma)

  @property
  def b1(self) -> int:
    return self.key.b1

  @property
  def bh(self) -> int:
    return self.key.bh

  @property
  def code_bytes(self) -> int:
    return self.key.code_bytes

  @property
  def value_width(self) -> int:
    """Last-axis length of the value stream: D (bf16) or D/2 bytes (INT4)."""
    return self.d if self.values == "bf16" else self.d // 2

  @property
  def name(self) -> str:
    """The tier's name in reports: its layout, with ``/int4`` when its values are INT4 (a
    ladder may hold one layout twice, e.g. the compact ladder's A4 with INT4 and BF16 values)."""
    return self.layout if self.values == "bf16" else f"{self.layout}/int4"

  @property
  def bytes(self) -> int:
    """Bytes per (token, layer, KV head): §2.3's table."""
    return spherical.tier_bytes(self.layout, self.d, self.values)


class SphPool(NamedTuple):
  ang: jax.Array   # [L, P, page, NB] uint8
  side: jax.Array  # [L, P, page] uint32
  v: jax.Array     # [L, P, page, D] bf16 or [L, P, page, D/2] uint8


class SphMaps(NamedTuple):
  pages: tuple[jax.Array, ...]   # per tier [B, Hkv, n_t] int32
  length: tuple[jax.Array, ...]  # per tier [B, Hkv] int32, entries (not pages)


class SphConsts(NamedTuple):
  signs: jax.Array  # [L, D] f32 in {±1}
  mu: jax.Array     # [L, Hkv, D] f32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SphInputs:
  """Everything the tier partitions of one decode-attention call read."""

  pools: tuple[SphPool, ...]
  maps: SphMaps
  consts: SphConsts
  spec: tuple[TierSpec, ...] = dataclasses.field(metadata=dict(static=True), default=())

  def __post_init__(self):
    if not isinstance(self.pools, tuple) or not isinstance(self.maps, SphMaps):
      return  # a pytree prefix or placeholder (e.g. vmap axes), not inputs
    n = len(self.spec)
    if len(self.pools) != n or len(self.maps.pages) != n or len(self.maps.length) != n:
      raise ValueError(
        f"SphInputs needs one pool, page table and length per tier spec: {n} specs, "
        f"{len(self.pools)} pools, {len(self.maps.pages)} tables, {len(self.maps.length)} lengths"
      )
    if len({s.d for s in self.spec}) > 1:
      raise ValueError(f"every tier must share the head dim, got {[s.d for s in self.spec]}")


__all__ = ["SphConsts", "SphInputs", "SphMaps", "SphPool", "TierSpec"]
