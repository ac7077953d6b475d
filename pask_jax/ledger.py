"""The per-request KV ledger (docs/DESIGN.md "Conventions", paper §3.2 Eq. 2, B.3, B.4).

Inside jit the ledger keeps only integer action counts, so every payload is exact::

  prefill_counts [B, G, 3] int32  R/L/H counts over prompt tokens (sinks counted as H: B.4
                                  "including mask-protected positions"; window tokens by their
                                  pending plan action, the long-range schedule)
  decode_counts  [B, G, 3] int32  R/L/H counts over accepted non-stop generated tokens
  n_prompt, n_gen [B] int32
  live_bits, peak_live_bits [B] float32  live payload measured from the cache (stored BF16
                                  entries, INT4 entries with their scales, and every occupied
                                  window slot at full BF16 cost; no alias counted twice)

Payloads (bits): scheduled = Σ_{c,a} count[c, a] · m(a, c); Full-KV = tokens · C_full; and
**measured B** = (prefill + decode payload) / Full-KV payload for the same lengths.  Physical
memory (pages, indices, allocator) is measured elsewhere.  :func:`summary` gives a host-side
float64 report per request.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from pask_jax import actions as Act


@flax.struct.dataclass
class Ledger:
  prefill_counts: jax.Array  # [B, G, 3] int32
  decode_counts: jax.Array   # [B, G, 3] int32
  n_prompt: jax.Array        # [B] int32
  n_gen: jax.Array           # [B] int32
  live_bits: jax.Array       # [B] float32
  peak_live_bits: jax.Array  # [B] float32


def init(batch: int, n_groups: int = 3) -> Ledger:
  z = lambda *s: jnp.zeros(s, jnp.int32)
  f = lambda: jnp.zeros((batch,), jnp.float32)
  return Ledger(z(batch, n_groups, 3), z(batch, n_groups, 3), z(batch), z(batch), f(), f())


def _counts(actions: jax.Array, mask: jax.Array) -> jax.Array:
  """actions int [..., N, G], mask bool [..., N] -> int32 [..., G, 3]."""
  oh = jax.nn.one_hot(actions.astype(jnp.int32), 3, dtype=jnp.int32) * mask[..., None, None]
  return jnp.sum(oh, axis=-3)


def record_prefill(led: Ledger, plan: jax.Array, lengths: jax.Array | None = None,
                   sink: int = 0) -> Ledger:
  """Charge a prefill plan ``int [B, T, G]`` over ``lengths [B]`` prompt tokens."""
  B, Tn, G = plan.shape
  n = jnp.full((B,), Tn, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
  t = jnp.arange(Tn)[None]
  act = jnp.where((t < sink)[..., None], Act.H, plan.astype(jnp.int32))
  return led.replace(prefill_counts=led.prefill_counts + _counts(act, t < n[:, None]),
                     n_prompt=led.n_prompt + n)


def record_decode(led: Ledger, actions: jax.Array, charged: jax.Array | None = None,
                  positions: jax.Array | None = None, sink: int = 0) -> Ledger:
  """Charge one decode step: ``actions int [B, G]`` for the sequences where ``charged [B]``
  (accepted, non-stop, active; default all).  With ``positions [B]`` (the new tokens' absolute
  positions) the cache's sink rule is mirrored: positions < ``sink`` are charged as H."""
  B, G = actions.shape
  c = jnp.ones((B,), bool) if charged is None else jnp.asarray(charged, bool)
  a = actions.astype(jnp.int32)
  if positions is not None:
    a = jnp.where((jnp.asarray(positions) < sink)[:, None], Act.H, a)
  return led.replace(decode_counts=led.decode_counts + _counts(a[:, None], c[:, None]),
                     n_gen=led.n_gen + c.astype(jnp.int32))


def live_payload(cache, cost: jax.Array, c_full: jax.Array) -> jax.Array:
  """Live payload bits ``[B]`` of a :class:`pask_jax.cache.Cache`: BF16 pool entries at m(H, c),
  INT4 entries at m(L, c) (scales included), window slots at C_full each."""
  hi = jnp.sum(cache.hi_len.astype(jnp.float32) * cost[Act.H][:, None], axis=0)
  lo = jnp.sum(cache.lo_len.astype(jnp.float32) * cost[Act.L][:, None], axis=0)
  return hi + lo + cache.win_len.astype(jnp.float32) * c_full


def record_live(led: Ledger, cache, cost: jax.Array, c_full: jax.Array) -> Ledger:
  live = live_payload(cache, cost, c_full)
  return led.replace(live_bits=live, peak_live_bits=jnp.maximum(led.peak_live_bits, live))


def scheduled_bits(counts: jax.Array, cost: jax.Array) -> jax.Array:
  """Σ_{c,a} counts[..., c, a] · m(a, c) in float32 (in jit; use :func:`summary` for exact)."""
  return jnp.sum(counts.astype(jnp.float32) * cost.T, axis=(-2, -1))


def measured_b(led: Ledger, cost: jax.Array, c_full: jax.Array) -> jax.Array:
  """(prefill + decode payload) / Full-KV payload, ``[B]`` float32 (NaN for empty requests)."""
  num = scheduled_bits(led.prefill_counts, cost) + scheduled_bits(led.decode_counts, cost)
  return num / ((led.n_prompt + led.n_gen).astype(jnp.float32) * c_full)


def summary(led: Ledger, policy) -> list[dict]:
  """Host-side report per request, float64 from the integer counts (JSON-able)."""
  cost = np.asarray(policy.cost, np.float64)     # [3, G]
  c_full = float(np.asarray(policy.cost, np.float64)[Act.H].sum())
  pc, dc = np.asarray(led.prefill_counts, np.int64), np.asarray(led.decode_counts, np.int64)
  out = []
  for b in range(pc.shape[0]):
    npf, ngn = int(led.n_prompt[b]), int(led.n_gen[b])
    pre = float((pc[b] * cost.T).sum())
    dec = float((dc[b] * cost.T).sum())
    full_p, full_d = npf * c_full, ngn * c_full
    ratio = lambda x, y: (x / y) if y else float("nan")
    names = lambda c: {g: dict(zip(Act.NAMES, map(int, c[g]))) for g in range(c.shape[0])}
    out.append({
        "n_prompt": npf, "n_gen": ngn,
        "prefill_bits": pre, "decode_bits": dec, "full_kv_bits": full_p + full_d,
        "prefill_B": ratio(pre, full_p), "decode_B": ratio(dec, full_d),
        "measured_B": ratio(pre + dec, full_p + full_d),
        "live_bits": float(led.live_bits[b]), "peak_live_bits": float(led.peak_live_bits[b]),
        "live_B": ratio(float(led.live_bits[b]), full_p + full_d),
        "prefill_counts": names(pc[b]), "decode_counts": names(dc[b]),
    })
  return out


def format_summary(rows: list[dict]) -> str:
  """One line per request for the CLI."""
  lines = []
  for i, r in enumerate(rows):
    d = {a: sum(c[a] for c in r["decode_counts"].values()) for a in Act.NAMES}
    lines.append(
        f"[{i}] prompt {r['n_prompt']} gen {r['n_gen']}: measured B {r['measured_B']:.3f} "
        f"(prefill {r['prefill_B']:.3f}, decode {r['decode_B']:.3f}); live "
        f"{r['live_bits'] / 8192:.1f} KiB (peak {r['peak_live_bits'] / 8192:.1f}); decode "
        f"R/L/H {d['R']}/{d['L']}/{d['H']}")
  return "\n".join(lines)
