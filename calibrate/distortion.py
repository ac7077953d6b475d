"""Runtime-D: attention-output distortion on fixed reference trajectories (paper Eq. 7, A.4).

For a reference request (prompt + its all-high generation) the model is run once, teacher-forced,
and every layer's queries and K/V are kept (:func:`capture`).  For an intervention (a per-token,
per-layer-group action map: H exact, L INT4 round trip with the cache's own quantizer, R removed)
attention is recomputed at every *decode* query position ``u`` — the queries a PASK decode step
computes — with the storage rule of the cache: sink positions and the recent window
(``t > u − W``) stay exact, older entries take their action.  Queries, reference tokens and the
unaffected K/V are unchanged, isolating numerical deviation from trajectory changes.

Per intervention, layer ℓ and query u the distortion is ``max_h ‖o_ref − o_a‖²`` over query heads;
:func:`distortion` sums it over decode queries and over the layers of each group — Eq. 7's
numerator for one request, for all groups at once.  Prompt tokens (prefill companion) and
generated tokens (decode) are handled alike: the prompt is computed at full precision and its
retention plan only changes what later (decode) queries see.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pask_jax import kv_dense
from pallas_kernels import int4
from pask_jax import actions as Act


def _capture_attend(carry, layer, q, k, v, positions):
  dense, qs = carry
  o, dense = kv_dense.attend(dense, layer, q, k, v, positions)
  return o, (dense, qs.at[layer].set(q.astype(qs.dtype)))


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(graphdef, params, tokens, lengths):
  from flax import nnx
  model = nnx.merge(graphdef, params)
  cfg = model.cfg
  B, Tn = tokens.shape
  dense = kv_dense.init(cfg.n_layers, B, Tn, cfg.n_kv_heads, cfg.head_dim, jnp.bfloat16)
  dense = dense._replace(length=lengths)
  qs = jnp.zeros((cfg.n_layers, B, Tn, cfg.n_heads, cfg.head_dim), jnp.bfloat16)
  pos = jnp.broadcast_to(jnp.arange(Tn, dtype=jnp.int32), (B, Tn))
  _, (dense, qs) = model(tokens, pos, (dense, qs), _capture_attend, last_only=lengths - 1)
  return qs, dense.k, dense.v


def capture(model, seqs: list[list[int]], bucket: int = 64, length: int | None = None):
  """Teacher-forced forward of whole sequences -> per sequence (q [L, T, Hq, D], k, v [L, T, Hkv,
  D]) in BF16 (what the cache stores), unpadded.  ``length``: the padded length of the forward
  (default: the longest sequence rounded up to ``bucket``); one length for every batch of a
  calibration compiles the forward once."""
  from models import decoder
  graphdef, params = decoder.split(model)
  Tn = -(-max(len(s) for s in seqs) // bucket) * bucket
  if length is not None:
    if length < max(len(s) for s in seqs):
      raise ValueError(f"capture length {length} is shorter than a sequence of "
                       f"{max(len(s) for s in seqs)} tokens")
    Tn = length
  toks = np.zeros((len(seqs), Tn), np.int32)
  for i, s in enumerate(seqs):
    toks[i, :len(s)] = s
  lens = jnp.asarray([len(s) for s in seqs], jnp.int32)
  qs, ks, vs = _forward(graphdef, params, jnp.asarray(toks), lens)
  return [(qs[:, i, :len(s)], ks[:, i, :len(s)], vs[:, i, :len(s)]) for i, s in enumerate(seqs)]


@functools.partial(jax.jit, static_argnames=("sink", "window", "group_of", "n_groups", "U"))
def _distortion(q, k, v, act, u_lo, u_hi, n, *, sink, window, group_of, n_groups, U):
  """q [L, T, Hq, D], k/v [L, T, Hkv, D] (padded to T >= u_lo + U), act int [A, T, G] ->
  D [A, G] float32.  Decode queries are positions ``u_lo <= u < u_hi`` (at most ``U``); keys
  ``t < n`` exist.
  """
  L, Tn, Hq, D = q.shape
  Hkv = k.shape[2]
  g = Hq // Hkv
  scale = D ** -0.5
  t = jnp.arange(Tn)
  u = u_lo + jnp.arange(U)
  q = jax.lax.dynamic_slice_in_dim(q, u_lo, U, axis=1)               # decode queries only
  qmask = u < u_hi                                                   # [U]
  vis = (t[None, :] <= u[:, None]) & (t[None, :] < n)                 # [U, T]
  old = vis & (t[None, :] >= sink) & (t[None, :] <= u[:, None] - window)
  gl = jnp.asarray(group_of, jnp.int32)

  def layer(acc, xs):
    ql, kl, vl, gi = xs
    qf = ql.astype(jnp.float32).reshape(U, Hkv, g, D) * scale
    kf, vf = kl.astype(jnp.float32), vl.astype(jnp.float32)
    kq = int4.dequantize(*int4.quantize_packed(kf))
    vq = int4.dequantize(*int4.quantize_packed(vf))
    se = jnp.einsum("ukgd,tkd->kgut", qf, kf)
    sq = jnp.einsum("ukgd,tkd->kgut", qf, kq)

    def out(a):                                                       # a: [T] action in group
      low = old & (a[None, :] == Act.L)                                 # [U, T]
      gone = old & (a[None, :] == Act.R)
      s = jnp.where(low, sq, se)
      s = jnp.where(vis & ~gone, s, -jnp.inf)
      p = jax.nn.softmax(s, axis=-1)
      p = jnp.where(jnp.isnan(p), 0.0, p)
      pl = jnp.where(low, p, 0.0)
      o = jnp.einsum("kgut,tkd->ukgd", p - pl, vf) + jnp.einsum("kgut,tkd->ukgd", pl, vq)
      return o.reshape(U, Hq, D)

    ref = out(jnp.full((Tn,), Act.H, jnp.int32))
    o = jax.vmap(out)(act[:, :, gi].astype(jnp.int32))               # [A, U, Hq, D]
    d = jnp.max(jnp.sum((o - ref[None]) ** 2, axis=-1), axis=-1)     # [A, U]
    d = jnp.sum(jnp.where(qmask[None], d, 0.0), axis=-1)             # [A]
    return acc.at[:, gi].add(d), None

  acc = jnp.zeros((act.shape[0], n_groups), jnp.float32)
  acc, _ = jax.lax.scan(layer, acc, (q, k, v, gl))
  return acc


def size(requests, bucket: int = 64) -> tuple[int, int]:
  """The padded ``(T, U)`` that :func:`distortion` needs for every ``(n, n_prompt, n_decode_q)``
  of ``requests`` at once: one compiled kernel for a whole calibration set, where a size per
  request compiled dozens (on the H100 they made Runtime-D of the Qwen 0.5B take 373 s)."""
  requests = list(requests)
  U = max(32, -(-max(d for _, _, d in requests) // 32) * 32)
  Tn = -(-max(max(n, p + U) for n, p, _ in requests) // bucket) * bucket
  return Tn, U


def distortion(q, k, v, act: np.ndarray, n_prompt: int, n_decode_q: int, *, sink: int,
               window: int, group_of: tuple[int, ...], n_groups: int, bucket: int = 64,
               padded: tuple[int, int] | None = None):
  """Eq. 7 numerator for one request: ``D [A, G]``.

  ``act int [A, n, G]``: each intervention's action per token (prompt + generated) and group;
  ``n_decode_q``: decode queries at positions ``n_prompt .. n_prompt + n_decode_q − 1``;
  ``padded``: ``(T, U)`` from :func:`size` (default: this request's own).
  """
  n = q.shape[1]
  Tn, U = padded or size([(n, n_prompt, n_decode_q)], bucket)
  if Tn < max(n, n_prompt + U) or U < n_decode_q:
    raise ValueError(f"padded size {(Tn, U)} does not hold a request of {n} tokens "
                     f"({n_prompt} prompt, {n_decode_q} decode queries)")
  pad = lambda x: jnp.pad(x, ((0, 0), (0, Tn - n)) + ((0, 0),) * (x.ndim - 2))
  a = np.full((act.shape[0], Tn, act.shape[2]), Act.H, np.int8)
  a[:, :n] = act
  return np.asarray(_distortion(pad(q), pad(k), pad(v), jnp.asarray(a), n_prompt,
                                n_prompt + n_decode_q, n, sink=sink, window=window,
                                group_of=tuple(group_of), n_groups=n_groups, U=U))
