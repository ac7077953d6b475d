"""The Mosaic GPU INT4 partition read straight from the cache's paged low pool (Hopper).

:mod:`~pallas_kernels.gpu.mgpu_int4` reads contiguous int4 keys per (sequence, KV head); the
cache holds its INT4 rows in pages of uint8 half-split bytes (``pallas_kernels.int4``: byte i of
a row is element i in the low nibble and element i + D/2 in the high one), and reading those as
jax int4 costs XLA a copy of the pool per step. This kernel reads the pool itself:

* one page is one pipeline tile: the TMA box ``pool[tbl[b, i], :, h, :]`` comes from the page
  table in the pipeline's index map (a strided box: rows Hkv x D/2 bytes apart);
* a byte tile splits into its two halves with bitwise operations only (Mosaic GPU refuses 8-bit
  arithmetic): ``x & 0xF0`` is 16 x the high element, exact in bf16, so q's high half carries
  1/16 (:func:`mgpu_qk.nibble_q`) and O^T's high rows are divided by 16 at the end;
  ``(x & 0x0F) ^ 0x08`` is the low element + 8, so the scores lose ``8 * sum(q_low)`` per query
  (the ``bias`` input) and the bf16 V tile loses 8 before the P.V MMA;
* V is token-major as stored: both halves are written into a bf16 shared-memory tile that
  wgmma reads transposed (``mgpu_int4``'s ``v_major="token"``).

The rest is ``mgpu_int4.partition``'s (operand swap, base-2 online softmax with per-element row
sums, K scale times ``qk_scale`` on the rows of S^T, V scale folded into P^T, ``cols``).

Shapes (B sequences, Hkv KV heads, BH = B x Hkv with the head minor, P pages of ``page`` rows):
``q[BH, 16, D]`` bf16 and ``bias[BH, 4, 16]`` f32 from ``mgpu_qk.nibble_q``; ``k, v[P, page,
Hkv, D/2]`` uint8; ``ks, vs[Hkv, P, page]`` f32 (head-major: a page's scales are one TMA box);
``tbl[B, n_pages]`` int32 pages in order; ``lens[B]`` int32 visible keys. Outputs are
``mgpu_int4.partition``'s partials ``[BH, splits, D, 16]``, combined by ``mgpu_int4.merge``.
Behind ``decode_attention``'s GPU backend through ``mgpu_decode`` (which makes the cache's fp16
scales ``[P, page, Hkv, 2]`` head-major).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu import mgpu_common as C
from pallas_kernels.gpu import mgpu_int4 as M
from pallas_kernels.gpu.mgpu_qk import nibble_q, paged_keys

__all__ = ["partition_paged", "attend_paged", "partition_paged_reference", "gather", "nibble_q"]


def _check(q, bias, k, ks, v, vs, tbl, lens, *, splits, stages, layout) -> None:
  bh, n16, d = q.shape
  if layout not in ("token", "head"):
    raise ValueError(f"layout must be 'token' ([P, page, Hkv, D/2]) or 'head' ([P, Hkv, page, "
                     f"D/2]), got {layout!r}")
  if k.ndim != 4 or k.dtype != jnp.uint8:
    raise ValueError(f"k must be the uint8 pool [P, page, Hkv, D/2], got {k.dtype} {k.shape}")
  p, page, hkv, h = _dims(k, layout)
  b = tbl.shape[0]
  # The scales may cover one layer of a code stack of L layers (``base`` picks the layer).
  p_s = ks.shape[1] if ks.ndim == 3 and ks.shape[1] and p % ks.shape[1] == 0 else p
  want = {"q": (b * hkv, C.N_PAD, 2 * h), "bias": (b * hkv, 4, C.N_PAD), "v": k.shape,
          "ks": (hkv, p_s, page), "vs": (hkv, p_s, page), "lens": (b,)}
  for name, arr in (("q", q), ("bias", bias), ("v", v), ("ks", ks), ("vs", vs),
                    ("lens", lens)):
    if tuple(arr.shape) != tuple(want[name]):
      raise ValueError(f"{name} must have shape {tuple(want[name])} for the pool "
                       f"{tuple(k.shape)} and tables {tuple(tbl.shape)}, got {tuple(arr.shape)}")
  if v.dtype != jnp.uint8:
    raise ValueError(f"v must be the uint8 pool like k, got {v.dtype}")
  if d % 64 or page % 64:
    raise ValueError(f"head dim {d} and page {page} must be multiples of 64 (wgmma's M)")
  if tbl.shape[1] % splits:
    raise ValueError(f"{tbl.shape[1]} pages must divide into {splits} splits")
  need = C.smem_bytes(d, page, stages, "token")
  if need > C.SM90_SMEM:
    raise ValueError(f"page {page} x {stages} stages needs {need} bytes of shared memory, over "
                     f"the {C.SM90_SMEM} a Hopper block has: use fewer stages")


def _dims(pool, layout: str):
  """(P, page, Hkv, D/2) of a pool in either layout."""
  p, a, b, h = pool.shape
  return (p, a, b, h) if layout == "token" else (p, b, a, h)


@functools.partial(jax.jit, static_argnames=("splits", "stages", "qk_scale", "cols",
                                             "approx_math", "no_auto_barriers", "layout"))
def partition_paged(q, bias, k, ks, v, vs, tbl, lens, base=None, *, splits: int = 8,
                    stages: int = 2, qk_scale: float = 1.0, cols: int = C.N_PAD,
                    approx_math: bool = False, no_auto_barriers: bool = False,
                    layout: str = "token"):
  """-> (o, m, l) ``[BH, splits, D, 16]`` f32 as ``mgpu_int4.partition`` (module doc).

  ``layout="head"``: pools ``[P, Hkv, page, D/2]``, so a (page, head) box is contiguous bytes
  instead of ``page`` rows ``Hkv x D/2`` bytes apart. ``base`` (int32 ``[1]``, default 0) is
  added to every page id of the codes but not of the scales: the codes of a layer stack
  (``[L * P, ...]``) read at one layer's pages, with that layer's scales alone."""
  _check(q, bias, k, ks, v, vs, tbl, lens, splits=splits, stages=stages, layout=layout)
  base = jnp.zeros((1,), jnp.int32) if base is None else jnp.asarray(base, jnp.int32).reshape(1)
  narrow = C.check_cols(cols)
  bh, _, d = q.shape
  _, page, hkv, h = _dims(k, layout)
  steps = tbl.shape[1] // splits
  _, b_tr = C.transforms(h, jnp.int8, "pool bytes")
  _, q_tr = C.transforms(h, jnp.bfloat16, "queries")      # swizzled in halves: sliced at D/2
  _, p_tr = C.transforms(C.N_PAD, jnp.bfloat16, "probabilities")
  _, vb_tr = C.transforms(d, jnp.bfloat16, "values", swz=32)   # P^T's swizzle (wgmma: equal)
  row = plgpu.Layout.WGMMA.reduce(1)
  col = plgpu.Layout.WGMMA.reduce(0)
  wg = plgpu.Layout.WGMMA

  def halves(ref):
    """A byte tile -> (low elements + 8, 16 x high elements) as bf16 in the wgmma layout."""
    x = C.load(ref, plgpu.Layout.WGMMA_UPCAST_2X)
    lo = lax.bitwise_xor(lax.bitwise_and(x, jnp.int8(15)), jnp.int8(8))
    return (plgpu.layout_cast(lo.astype(jnp.bfloat16), wg),
            plgpu.layout_cast(lax.bitwise_and(x, jnp.int8(-16)).astype(jnp.bfloat16), wg))

  def body(q_gmem, bias_gmem, k_gmem, ks_gmem, v_gmem, vs_gmem, tbl_gmem, lens_gmem, base_gmem,
           o_gmem, m_gmem, l_gmem, q_smem, b_smem, vb_smem, p_smem, o_smem, bar):
    i = lax.axis_index("bh")
    sp = lax.axis_index("sp")
    b, hd = i // hkv, lax.rem(i, hkv)
    length = lens_gmem[b]
    plgpu.copy_gmem_to_smem(q_gmem.at[i], q_smem, bar)
    plgpu.copy_gmem_to_smem(bias_gmem.at[i], b_smem, bar)
    plgpu.barrier_wait(bar)
    bias = C.load(b_smem.at[0], col)

    def step(idx, k_smem, ks_smem, v_smem, vs_smem, carry):
      m, l, acc = carry
      klo, khi = halves(k_smem)

      def scores(acc_ref):
        plgpu.wgmma(acc_ref, klo, q_smem.at[:, :h].T)
        plgpu.wgmma(acc_ref, khi, q_smem.at[:, h:].T)
        return acc_ref[...]

      s = pl.run_scoped(scores, plgpu.ACC((page, C.N_PAD), jnp.float32))
      s = s - lax.broadcast_in_dim(bias, s.shape, [1])
      if narrow:
        s = s[:, :cols]
      p, alpha, m_new, l = C.softmax_tile(
          s, C.load(ks_smem, row) * qk_scale, C.load(vs_smem, row),
          (sp * steps + idx[0]) * page, length, m, l)
      if narrow:
        p = jnp.concatenate([p, C.zeros((page, C.N_PAD - cols))], axis=1)
      p_smem[...] = p.astype(jnp.bfloat16)
      vlo, vhi = halves(v_smem)
      vb_smem.at[:, :h][...] = vlo - 8.0     # small integers: exact in bf16
      vb_smem.at[:, h:][...] = vhi           # 16 x the value; O^T's rows divided at the end
      plgpu.commit_smem()

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, vb_smem.T, p_smem)
        return acc_ref[...]

      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
      out = pl.run_scoped(pv, plgpu.ACC((d, C.N_PAD), jnp.float32))
      return m_new, l, acc + (out[:, :cols] if narrow else out)

    page_of = lambda j: tbl_gmem[b, sp * steps + j]
    code_page = lambda j: page_of(j) + base_gmem[0]
    codes = (plgpu.BlockSpec((None, page, None, h), lambda j: (code_page(j), 0, hd, 0),
                             transforms=b_tr) if layout == "token" else
             plgpu.BlockSpec((None, None, page, h), lambda j: (code_page(j), hd, 0, 0),
                             transforms=b_tr))
    scales = plgpu.BlockSpec((None, None, page), lambda j: (hd, page_of(j), 0))
    m, l, acc = plgpu.emit_pipeline(
        step,
        grid=(steps,),
        in_specs=[codes, scales, codes, scales],
        max_concurrent_steps=stages,
        init_carry=(plgpu.layout_cast(jnp.full((cols,), C.FLOOR, jnp.float32), col),
                    C.zeros((page, cols)), C.zeros((d, cols))),
    )(k_gmem, ks_gmem, v_gmem, vs_gmem)
    dim = plgpu.broadcasted_iota(jnp.int32, acc.shape, 0, layout=wg)
    acc = jnp.where(dim < h, acc, acc * (1.0 / 16))
    C.store_partials(o_smem, (o_gmem.at[i, sp], m_gmem.at[i, sp], l_gmem.at[i, sp]), acc, m,
                      l.sum(axis=0), pad=C.N_PAD - cols)

  f32 = jax.ShapeDtypeStruct((bh, splits, d, C.N_PAD), jnp.float32)
  as_s8 = lambda x: lax.bitcast_convert_type(x, jnp.int8)     # same width: a free bitcast
  return plgpu.kernel(
      body,
      out_type=(f32, f32, f32),
      grid=(bh, splits),
      grid_names=("bh", "sp"),
      compiler_params=C.params(approx_math, no_auto_barriers),
      scratch_types=dict(
          q_smem=plgpu.SMEM((C.N_PAD, d), jnp.bfloat16, transforms=q_tr),
          b_smem=plgpu.SMEM((4, C.N_PAD), jnp.float32),
          vb_smem=plgpu.SMEM((page, d), jnp.bfloat16, transforms=vb_tr),
          p_smem=plgpu.SMEM((page, C.N_PAD), jnp.bfloat16, transforms=p_tr),
          o_smem=plgpu.SMEM((d, C.N_PAD), jnp.float32),
          bar=plgpu.Barrier(num_arrivals=2),
      ),
  )(q, bias, as_s8(k), ks, as_s8(v), vs, tbl, lens, base)


def attend_paged(q, k, ks, v, vs, tbl, lens, *, sm_scale: float, **knobs):
  """Softmax attention of ``q[BH, 16, D]`` over the paged pool -> ``[BH, 16, D]`` f32."""
  qn, bias = nibble_q(q.astype(jnp.bfloat16))
  return M.merge(*partition_paged(qn, bias, k, ks, v, vs, tbl, lens,
                                  qk_scale=sm_scale * C.LOG2E, **knobs))


def gather(pool, tbl, scales):
  """The pool through the tables as contiguous rows: (codes ``[BH, N, D]`` int4 in logical
  order, scales ``[BH, N]`` f32), N = n_pages x page, the head minor in BH."""
  codes, s = paged_keys(pool, tbl, scales)
  return codes.astype(jnp.int4), s


def partition_paged_reference(q, k, ks, v, vs, tbl, lens, base=None, *, splits: int = 8,
                              qk_scale: float = 1.0, layout: str = "token", **_):
  """:func:`partition_paged` in jnp from the original ``q``: the pool gathered through the
  tables, then ``mgpu_int4.partition_reference`` with page-sized tiles and token-major V."""
  if layout == "head":      # [P, Hkv, page, D/2] -> the token layout
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  if base is not None:      # the codes at the layer's pages, the scales at the table's
    k = lax.dynamic_slice_in_dim(k, jnp.asarray(base, jnp.int32).reshape(()), ks.shape[1], 0)
    v = lax.dynamic_slice_in_dim(v, jnp.asarray(base, jnp.int32).reshape(()), ks.shape[1], 0)
  kc, kss = gather(k, tbl, ks)
  vc, vss = gather(v, tbl, vs)
  hkv = k.shape[2]
  return M.partition_reference(q, kc, kss, vc, vss, jnp.repeat(lens, hkv), tile=k.shape[1],
                               splits=splits, v_major="token", qk_scale=qk_scale)
