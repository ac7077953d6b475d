"""The Mosaic GPU INT4 partition prototype against its reference, and its rate over packed bytes.

Per variant (tile, pipeline stages, context splits) at the 4B-like and 0.5B head shapes: the
relative error norm against ``attend_reference`` with ragged lengths (some splits empty), then the
kernel time at full length over the bytes it reads (K and V codes + f32 scales). One JSON line each.

  python bench/bench_mgpu_int4.py --out $OUT/int4.jsonl [--quick | --table | --upcasts | --ws]

``--ws``: the committed kernel with and without the compiler's approximate exp2 and without
Pallas's automatic shared-memory barriers, against the warp-specialized ``partition_ws`` (2 or 3
compute warpgroups and a TMA warpgroup; 3 runs at 24K keys, a multiple of its 3-tile steps).
``--paged``: ``mgpu_paged.partition_paged`` reading the cache's paged uint8 pool (shuffled page
tables, pages of 64 and 128 rows) beside the committed contiguous kernel, same bytes counted.
``--pool``: ``mgpu_int4.partition`` over a pool of head-major int4 pages (page = tile = 128,
shuffled tables; V dim- and token-major) and the warp-specialized ``partition_ws`` over the same
pool (2 and 3 compute warpgroups) beside the contiguous kernel on the same codes, then
what one decode step's cache write costs XLA on such a pool: a row scatter into int4 (K
token-major), a column scatter into int4 (dim-major V) and the same rows into uint8 bytes.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
import traceback

import jax
import jax.numpy as jnp

from pallas_kernels.gpu import mgpu_int4, mgpu_paged, mgpu_upcast
from pallas_kernels.testing.synth import paged_pool
from bench.bench_mgpu_qk import emit, failed, kernel_time

SHAPES = {"4b": (8, 8, 4, 128), "0.5b": (8, 2, 7, 64)}   # batch, kv heads, q per kv, head dim


def inputs(name: str, n: int, seed: int = 0, batch: int | None = None):
  b, hkv, g, d = SHAPES[name]
  b = batch or b
  bh = b * hkv
  ks = jax.random.split(jax.random.key(seed), 6)
  q = jnp.zeros((bh, mgpu_int4.N_PAD, d), jnp.bfloat16)
  q = q.at[:, :g].set(jax.random.normal(ks[0], (bh, g, d), jnp.float32).astype(jnp.bfloat16))
  k = jax.random.randint(ks[1], (bh, n, d), -7, 8, jnp.int32).astype(jnp.int4)
  v = jax.random.randint(ks[2], (bh, n, d), -7, 8, jnp.int32).astype(jnp.int4)
  kscale = jax.random.uniform(ks[3], (bh, n), jnp.float32, 0.05, 0.3)
  vscale = jax.random.uniform(ks[4], (bh, n), jnp.float32, 0.05, 0.3)
  lens = jax.random.randint(ks[5], (bh,), 1, n + 1, jnp.int32)
  return q, k, kscale, v, vscale, lens, g, d


def measure(case, knobs: dict, iters: int) -> dict:
  """One variant on one input case: its relative error against the float32 reference (ragged
  lengths) and its kernel time at full length over the bytes it reads."""
  q, k, kscale, v, vscale, lens, g, d, ref = case
  n = k.shape[1]
  ws = "wgs" in knobs
  vin = v if knobs.get("v_major") == "token" else jnp.swapaxes(v, 1, 2)
  if ws:
    vin = mgpu_int4.block_v(vin, knobs.get("tile", 128))
  row = dict(bh=q.shape[0], d=d, n=n, **knobs)
  try:
    out = mgpu_int4.attend(q, k, kscale, vin, vscale, lens, sm_scale=d ** -0.5, **knobs)[:, :g]
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    qin, extra = q, ()
    if knobs.get("k_upcast") == "s8":
      qin, qscale = mgpu_int4.split_q(q)
      extra = (qscale,)
    kernel = mgpu_int4.partition_ws if ws else mgpu_int4.partition
    f = jax.jit(lambda *x, kn=tuple(knobs.items()): kernel(*x, **dict(kn)))
    sec = kernel_time(f, (qin, k, kscale, vin, vscale, jnp.full_like(lens, n), *extra), iters)
    nbytes = q.shape[0] * n * (d + 8)     # K and V: D/2 code bytes + 4 scale bytes each
    row.update(rel_err=err, us=sec * 1e6, bytes=nbytes, tbps=nbytes / sec / 1e12)
  except Exception as e:  # noqa: BLE001 - a sweep records failures and goes on
    row.update(error=f"{type(e).__name__}: {str(e)[:2000]}", tb=traceback.format_exc()[-4000:])
  return row


def case(name: str, n: int, batch: int | None = None):
  q, k, kscale, v, vscale, lens, g, d = inputs(name, n, batch=batch)
  ref = mgpu_int4.attend_reference(q, k, kscale, v, vscale, lens, sm_scale=d ** -0.5)[:, :g]
  return q, k, kscale, v, vscale, lens, g, d, ref


def plan(a):
  """(shape name, batch or None, keys, [knobs, ...]) per input case of the chosen mode."""
  if a.table:      # one best-split row per (head shape, batch, keys)
    for name, batch, n in itertools.product(SHAPES, (1, 8, 32), (8192, 32768)):
      yield name, batch, n, [dict(tile=128, stages=2, splits=sp, v_major="dim")
                             for sp in (4, 8, 16, 32, 64) if n % (128 * sp) == 0]
  elif a.upcasts:  # each (k_upcast, v_upcast) at the best knobs
    pairs = [("bf16", "bf16"), ("bf16_up4", "bf16"), ("bf16", "bf16_up4"),
             ("bf16_up4", "bf16_up4"), ("s8", "bf16"), ("s8", "bf16_up4")]
    for name, splits in (("4b", 8), ("0.5b", 32)):
      yield name, None, a.n, [dict(tile=128, stages=2, splits=splits, v_major="dim",
                                   k_upcast=ku, v_upcast=vu) for ku, vu in pairs]
  elif a.ws or a.only_cols:
    fast = dict(approx_math=True, no_auto_barriers=True)
    if not a.only_cols:
      for name, splits in (("4b", (4, 8)), ("0.5b", (8, 16))):
        base = dict(tile=128, stages=2, splits=8 if name == "4b" else 32,   # stage 1's best
                    v_major="dim")
        yield name, None, a.n, [dict(base, **fast)] + [
            dict(tile=128, stages=st, splits=sp, wgs=2, **fast)
            for st, sp in itertools.product((2, 4), splits)] + [
            # 64-row tiles: half the registers per warpgroup (more blocks per SM)
            dict(base, tile=64, stages=4, **fast),
            dict(tile=64, stages=4, splits=splits[0], wgs=2, **fast)]
        n3 = a.n * 3 // 4
        yield name, None, n3, [dict(base, **fast)] + [
            dict(tile=128, stages=st, splits=sp, wgs=3, **fast)
            for st, sp in ((2, splits[0]), (3, splits[0]), (2, splits[1]))
            if n3 % (128 * 3 * sp) == 0]
    if a.cols or a.only_cols:    # softmax over the first 8 columns (<= 8 query heads per KV head)
      for name, sp in (("4b", 8), ("0.5b", 32)):
        yield name, None, a.n, [dict(tile=128, stages=2, splits=sp, v_major="dim", cols=c, **fast)
                                for c in (16, 8)] + [
            dict(tile=128, stages=2, splits=s, wgs=2, cols=8, **fast)
            for s in ((4, 8) if name == "4b" else (8, 16))]
        n3 = a.n * 3 // 4
        one = dict(tile=128, stages=2, splits=sp, v_major="dim", cols=8, **fast)
        yield name, None, n3, [one] + [
            dict(tile=128, stages=2, splits=s, wgs=3, cols=8, **fast)
            for s in ((4, 8) if name == "4b" else (8, 16)) if n3 % (128 * 3 * s) == 0]
    if a.knobs:   # the committed kernel under each compiler-knob pair
      for name, sp in (("4b", 8), ("0.5b", 32)):
        yield name, None, a.n, [dict(tile=128, stages=2, splits=sp, v_major="dim",
                                     approx_math=am, no_auto_barriers=nb)
                                for am, nb in itertools.product((False, True), repeat=2)]
  else:
    grid = {"4b": itertools.product((64, 128), (2, 3, 4), (8, 16), ("token", "dim")),
            "0.5b": itertools.product((64, 128), (2, 3, 4), (16, 32, 64), ("token", "dim"))}
    if a.quick:
      grid = {"4b": [(128, 2, 8, "dim")], "0.5b": [(128, 2, 32, "dim")]}
    for name in SHAPES:
      yield name, None, a.n, [dict(tile=t, stages=st, splits=sp, v_major=vm)
                              for t, st, sp, vm in grid[name]]


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--n", type=int, default=32768)
  ap.add_argument("--iters", type=int, default=30)
  ap.add_argument("--upcasts", action="store_true",
                  help="the A-operand upcast variants (k_upcast x v_upcast) at the best knobs")
  ap.add_argument("--ws", action="store_true",
                  help="compiler knobs; the warp-specialized kernel (2 and 3 compute warpgroups)")
  ap.add_argument("--cols", action="store_true",
                  help="with --ws: also both kernels with the 8-column softmax")
  ap.add_argument("--only-cols", action="store_true",
                  help="the --cols rows alone (without the --ws sweep)")
  ap.add_argument("--knobs", action="store_true",
                  help="with --ws: also the committed kernel under each compiler-knob pair")
  ap.add_argument("--paged", action="store_true",
                  help="the kernel over the paged uint8 pool against the contiguous one")
  ap.add_argument("--head-only", action="store_true",
                  help="with --paged: only the head-layout rows (page 128)")
  ap.add_argument("--pool", action="store_true",
                  help="the kernel over a head-major int4 page pool; XLA's int4 cache writes")
  ap.add_argument("--upcast-only", action="store_true",
                  help="with --pool: the decode path's kernel (V dim-major, 8/32 splits, page ids "
                       "in global memory) with each (K, V) upcast (bf16, bf16_perm) alone")
  ap.add_argument("--table", action="store_true",
                  help="batch 1/8/32 x 8K/32K keys at both head shapes, splits swept per row")
  a = ap.parse_args()
  print(jax.devices(), jax.__version__, flush=True)
  if a.paged:
    return paged(a)
  if a.pool:
    return pool(a)
  with open(a.out, "w") as fo:
    for name, batch, n, variants in plan(a):
      c = case(name, n, batch)
      for knobs in variants:
        row = dict(shape=name, batch=batch or SHAPES[name][0], **measure(c, knobs, a.iters))
        print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "tb"}), flush=True)
        fo.write(json.dumps(row) + "\n")
        fo.flush()


def paged(a) -> None:
  """``--paged``: per head shape and page size, the paged kernel (splits x cols, both fast knobs)
  and, first, the committed contiguous kernel on the same codes."""
  fast = dict(approx_math=True, no_auto_barriers=True)
  with open(a.out, "w") as fo:
    for name, page in itertools.product(SHAPES, (128,) if a.head_only else (128, 64)):
      b, hkv, g, d = SHAPES[name]
      q, kp, tbl, ks = paged_pool(b, hkv, d, a.n, page, n_pad=mgpu_int4.N_PAD, seed=1)
      _, vp, _, vs = paged_pool(b, hkv, d, a.n, page, n_pad=mgpu_int4.N_PAD, seed=2)
      q = q.at[:, g:].set(0)
      lens = jax.random.randint(jax.random.key(3), (b,), 1, a.n + 1, jnp.int32)
      kc, kss = mgpu_paged.gather(kp, tbl, ks)
      vc, vss = mgpu_paged.gather(vp, tbl, vs)
      lens_bh = jnp.repeat(lens, hkv)
      sm = d ** -0.5
      ref = mgpu_int4.attend_reference(q, kc, kss, vc, vss, lens_bh, sm_scale=sm)[:, :g]
      nbytes = q.shape[0] * a.n * (d + 8)
      full = jnp.full_like(lens, a.n)
      if page == 128 and not a.head_only:   # the contiguous kernel on the same codes
        c = (q, kc, kss, vc, vss, lens_bh, g, d, ref)
        emit(fo, dict(shape=name, batch=b, how="contiguous", **measure(
            c, dict(tile=128, stages=2, splits=8 if name == "4b" else 32, v_major="dim", cols=8,
                    **fast), a.iters)))
      layouts = ("head",) if a.head_only else ("token", "head") if page == 128 else ("token",)
      for splits, cols, layout in itertools.product(
          (4, 8) if name == "4b" else (8, 16, 32), (16, 8), layouts):
        if layout == "head" and cols == 16:
          continue
        row = dict(shape=name, batch=b, how="paged", page=page, n=a.n, splits=splits, cols=cols,
                   layout=layout)
        try:
          kn = dict(splits=splits, cols=cols, layout=layout, **fast)
          if layout == "head":     # the same bytes, each (page, head) box contiguous
            kp_, vp_ = jnp.swapaxes(kp, 1, 2), jnp.swapaxes(vp, 1, 2)
          else:
            kp_, vp_ = kp, vp
          out = mgpu_paged.attend_paged(q, kp_, ks, vp_, vs, tbl, lens, sm_scale=sm,
                                        **kn)[:, :g]
          err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
          qn, bias = mgpu_paged.nibble_q(q)
          f = jax.jit(lambda *x, kn=tuple(kn.items()): mgpu_paged.partition_paged(
              *x, qk_scale=sm * mgpu_int4.LOG2E, **dict(kn)))
          sec = kernel_time(f, (qn, bias, kp_, ks, vp_, vs, tbl, full), a.iters)
          row.update(rel_err=err, us=sec * 1e6, bytes=nbytes, tbps=nbytes / sec / 1e12)
        except Exception as e:  # noqa: BLE001 - a sweep records failures and goes on
          failed(row, e)
        emit(fo, row)



def pool_inputs(name: str, n: int, tile: int, seed: int = 0):
  """q, an int4 pool of head-major pages (one spare page per sequence, shuffled tables) with
  both V layouts, f32 scales, per-row lengths [B * Hkv] and the page table."""
  b, hkv, g, d = SHAPES[name]
  n_pages, p = n // tile, b * (n // tile + 1)
  ks = jax.random.split(jax.random.key(seed), 6)
  codes = lambda key, shape: jax.random.randint(key, shape, -7, 8, jnp.int32).astype(jnp.int4)
  k = codes(ks[0], (p, hkv, tile, d))
  vt = codes(ks[1], (p, hkv, tile, d))                       # token-major
  vd = jnp.swapaxes(vt, 2, 3)                                # the same values dim-major
  kscale = jax.random.uniform(ks[2], (p, hkv, tile), jnp.float32, 0.05, 0.3)
  vscale = jax.random.uniform(ks[3], (p, hkv, tile), jnp.float32, 0.05, 0.3)
  tbl = jax.random.permutation(ks[4], p)[:b * n_pages].reshape(b, n_pages).astype(jnp.int32)
  q = jnp.zeros((b * hkv, mgpu_int4.N_PAD, d), jnp.bfloat16)
  q = q.at[:, :g].set(jax.random.normal(ks[5], (b * hkv, g, d)).astype(jnp.bfloat16))
  lens = jnp.repeat(jax.random.randint(jax.random.key(seed + 1), (b,), 1, n + 1, jnp.int32), hkv)
  return q, k, kscale, {"dim": vd, "token": vt}, vscale, lens, tbl, g, d


def pool(a) -> None:
  """``--pool``: per head shape, the contiguous kernel on the gathered codes, then the kernel
  over the pool (splits x V layout, cols 8, both fast knobs); then XLA's cache writes."""
  fast = dict(approx_math=True, no_auto_barriers=True, cols=8)
  tile = 128
  with open(a.out, "w") as fo:
    for name in SHAPES:
      q, k, ks, vv, vs, lens, tbl, g, d = pool_inputs(name, a.n, tile)
      sm = d ** -0.5
      nbytes = q.shape[0] * a.n * (d + 8)
      full = jnp.full_like(lens, a.n)
      kc, ksc, vd, vsc = mgpu_int4.pool_gather(k, ks, vv["dim"], vs, tbl)
      ref = mgpu_int4.attend_reference(q, kc, ksc, jnp.swapaxes(vd, 1, 2), vsc, lens,
                                       sm_scale=sm)[:, :g]
      best = 8 if name == "4b" else 32
      emit(fo, dict(shape=name, how="contiguous", **measure(
          (q, kc, ksc, jnp.swapaxes(vd, 1, 2), vsc, lens, g, d, ref),   # token-major in
          dict(tile=tile, stages=2, splits=best, v_major="dim", **fast), a.iters)))
      plain = ("bf16", "bf16")
      grid = [(v, sp, "gmem", plain) for v, sp in itertools.product(
          ("dim", "token"), (4, 8) if name == "4b" else (8, 16, 32))] + [
          ("dim", sp, "smem", plain) for sp in ((4, 8) if name == "4b" else (16, 32))]
      if a.upcast_only:    # the decode path's knobs, each (K, V) upcast
        grid = [("dim", best, "gmem", ups) for ups in (
            plain, ("bf16_perm", "bf16"), ("bf16", "bf16_perm"), ("bf16_perm", "bf16_perm"),
            ("bf16_perm_offset", "bf16_perm"))]
      for v_major, splits, table, (k_upcast, v_upcast) in grid:
        row = dict(shape=name, how="pool", tile=tile, n=a.n, v_major=v_major, splits=splits,
                   table=table, k_upcast=k_upcast, v_upcast=v_upcast, **fast)
        if v_upcast == "bf16_perm":    # the same values, each page's tokens in the stored order
          vv["dim_perm"] = vv.get("dim_perm", mgpu_upcast.store_order(vv["dim"]))
        vin = vv["dim_perm" if v_upcast == "bf16_perm" else v_major]
        try:
          kn = dict(tile=tile, splits=splits, v_major=v_major, qk_scale=sm * mgpu_int4.LOG2E,
                    table=table, k_upcast=k_upcast, v_upcast=v_upcast, **fast)
          f = jax.jit(lambda q, k, ks, v, vs, lens, tbl, kn=tuple(kn.items()):
                      mgpu_int4.partition(q, k, ks, v, vs, lens, None, tbl, **dict(kn)))
          out = mgpu_int4.merge(*f(q, k, ks, vin, vs, lens, tbl))[:, :g]
          err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
          sec = kernel_time(f, (q, k, ks, vin, vs, full, tbl), a.iters)
          row.update(rel_err=err, us=sec * 1e6, bytes=nbytes, tbps=nbytes / sec / 1e12)
        except Exception as e:  # noqa: BLE001 - a sweep records failures and goes on
          failed(row, e)
        emit(fo, row)
      if a.upcast_only:
        continue
      # The warp-specialized kernel over the pool (V dim-major): the table padded to splits x
      # warpgroups with page 0 (past every length), the bytes counted those of the keys alone.
      for (wgs, splits), table in itertools.product(
          ((2, 4), (3, 4)) if name == "4b" else ((2, 8), (3, 8)), ("gmem", "smem")):
        row = dict(shape=name, how="pool_ws", tile=tile, n=a.n, v_major="dim", wgs=wgs,
                   splits=splits, table=table, **fast)
        try:
          kn = dict(tile=tile, splits=splits, wgs=wgs, qk_scale=sm * mgpu_int4.LOG2E,
                    table=table, **fast)
          tp = jnp.pad(tbl, ((0, 0), (0, (-tbl.shape[1]) % (splits * wgs))))
          f = jax.jit(lambda q, k, ks, v, vs, lens, tbl, kn=tuple(kn.items()):
                      mgpu_int4.partition_ws(q, k, ks, v, vs, lens, tbl, **dict(kn)))
          out = mgpu_int4.merge(*f(q, k, ks, vv["dim"], vs, lens, tp))[:, :g]
          err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
          sec = kernel_time(f, (q, k, ks, vv["dim"], vs, full, tp), a.iters)
          row.update(rel_err=err, us=sec * 1e6, bytes=nbytes, tbps=nbytes / sec / 1e12,
                     padded_pages=int(tp.shape[1] - tbl.shape[1]))
        except Exception as e:  # noqa: BLE001
          failed(row, e)
        emit(fo, row)
      writes(fo, name, k, vv["dim"], tbl, a.iters)


def writes(fo, name, k, vd, tbl, iters: int) -> None:
  """One decode step's INT4 cache write per sequence (the next free row of its last page), as
  XLA does it on the pool: K rows into int4, V columns into dim-major int4, K rows into uint8
  bytes; correctness checked on the written rows, time by the profiler (all kernels)."""
  b = tbl.shape[0]
  hkv, d = k.shape[1], k.shape[3]
  pages = tbl[:, -1]
  slot = jnp.arange(b, dtype=jnp.int32) % k.shape[2]
  rows = jax.random.randint(jax.random.key(9), (b, hkv, d), -7, 8, jnp.int32).astype(jnp.int4)
  heads = jnp.arange(hkv)
  kw = jax.jit(lambda pool, x: pool.at[pages[:, None], heads[None], slot[:, None]].set(x),
               donate_argnums=0)
  vw = jax.jit(lambda pool, x: pool.at[pages[:, None], heads[None], :, slot[:, None]].set(x),
               donate_argnums=0)
  ku8 = jnp.zeros(k.shape[:3] + (d // 2,), jnp.uint8)
  rows8 = jax.random.randint(jax.random.key(10), (b, hkv, d // 2), 0, 256,
                             jnp.int32).astype(jnp.uint8)
  bw = jax.jit(lambda pool, x: pool.at[pages[:, None], heads[None], slot[:, None]].set(x),
               donate_argnums=0)
  for how, f, pool_, x in (("k_rows_int4", kw, k, rows), ("v_cols_int4", vw, vd, rows),
                           ("k_rows_uint8", bw, ku8, rows8)):
    row = dict(shape=name, how="write", what=how, pool_bytes=int(pool_.size * pool_.dtype.itemsize
                                                                 if pool_.dtype != jnp.int4
                                                                 else pool_.size // 2))
    try:
      pool_ = jnp.array(pool_, copy=True)
      out = f(pool_, x)
      got = (out[pages[:, None], heads[None], slot[:, None]] if how != "v_cols_int4" else
             out[pages[:, None], heads[None], :, slot[:, None]])
      row["ok"] = bool(jnp.array_equal(got.astype(jnp.int32), x.astype(jnp.int32)))
      hlo = f.lower(out, x).compile().as_text()
      row["converts_pool"] = "convert" in hlo and "s8[" in hlo
      t = jax.block_until_ready(out)
      t0 = time.perf_counter()
      for _ in range(iters):
        t = f(t, x)
      jax.block_until_ready(t)
      row["us_wall"] = (time.perf_counter() - t0) / iters * 1e6
    except Exception as e:  # noqa: BLE001
      failed(row, e)
    emit(fo, row)


if __name__ == "__main__":
  main()
