"""Decode-attention kernel benchmark on a GPU (issue 4, "Performance"); not a test.

  python bench/bench_kernels.py --out DIR [--quick] [--sweep]
  python bench/bench_kernels.py --out DIR --int4-sweep   # INT4-path variants, headline shape only
  python bench/bench_kernels.py --profile-one 'KNOBS' --mix b_int4_part   # one call, for ncu
  python bench/bench_kernels.py --out DIR --lo-page 128 --int4-kernels triton,mosaic --shapes 0,3
      # INT4 pages of 128 tokens; each INT4 row with both INT4 kernels (Mosaic GPU: Hopper only)
  python bench/bench_kernels.py --out DIR --lo-page 128 --lo-formats bytes,int4 --shapes 0,3
      # each INT4 row also with the pool in the int4 storage format (the Mosaic GPU pool kernel)

Measures, in ONE process and run, per configuration:
  * the card's copy bandwidth (jnp elementwise read+write of 2 GiB) -- the ceiling;
  * jax's own ``jax.experimental.pallas.ops.gpu.decode_attention.gqa`` on the dense BF16 cache of
    the same logical context -- the baseline;
  * our kernel on (a) all context in the BF16 pool (+ BF16 window) and (b) a B ~ 0.33 mix (most old
    tokens INT4, some released, the rest and the window BF16), with error vs the jnp reference.
Timing: ``reps`` jitted bundles of ``inner`` chained calls (each call's q depends on the previous
output, so nothing is CSE'd or overlapped), inputs rotated across copies so that small configs
are not served from the 60 MB L2; median per call.  Bytes are the K/V bytes the kernel must read
(visible rows, scales included); effective bandwidth = bytes / time.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from pallas_kernels import int4
from pallas_kernels.testing import synth
from pallas_kernels.gpu import decode_attention_gpu
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window

PAGE = 16
WIN = 64


def build(key, b, hq, hkv, d, lo_len, hi_len, win_len, lo_page=PAGE, hi_page=PAGE):
  """Random inputs on device (no poisoning; scattered page tables), tight pool capacities."""
  ks = jax.random.split(key, 8)
  n_lo, n_hi = -(-lo_len // lo_page), -(-hi_len // hi_page)
  p_lo, p_hi = b * n_lo, b * n_hi
  bf = jnp.bfloat16
  def normal(k, shape):
    return jax.random.normal(k, shape, jnp.float32).astype(bf)
  kw, vw = normal(ks[0], (b, WIN, hkv, d)), normal(ks[1], (b, WIN, hkv, d))
  hi = HighPool(normal(ks[2], (max(p_hi, 0), hi_page, hkv, d)),
                normal(ks[3], (max(p_hi, 0), hi_page, hkv, d)))
  qz = jax.jit(int4.quantize_packed)
  kc, ksc = qz(jax.random.normal(ks[4], (p_lo, lo_page, hkv, d), jnp.float32))
  vc, vsc = qz(jax.random.normal(ks[5], (p_lo, lo_page, hkv, d), jnp.float32))
  lo = LowPool(kc, vc, jnp.stack([ksc, vsc], -1))
  perm = lambda k, n: jax.random.permutation(k, n).reshape(b, -1).astype(jnp.int32)
  maps = PageMaps(perm(ks[6], p_hi) if p_hi else jnp.zeros((b, 0), jnp.int32),
                  jnp.full((b,), hi_len, jnp.int32),
                  perm(ks[7], p_lo) if p_lo else jnp.zeros((b, 0), jnp.int32),
                  jnp.full((b,), lo_len, jnp.int32))
  q = normal(jax.random.fold_in(key, 99), (b, hq, d))
  win = Window(kw, vw, jnp.full((b,), win_len, jnp.int32))
  return q, win, hi, lo, maps


def to_format(args, fmt):
  """Kernel inputs with the INT4 pool's codes in storage format ``fmt`` (same codes, scales)."""
  q, win, hi, lo, maps = args
  k, v = jax.jit(lambda k, v: int4.pool_arrays(*int4.pool_codes(k, v), fmt))(lo.k, lo.v)
  return q, win, hi, LowPool(k, v, int4.scale_array(lo.scale, fmt)), maps


def kv_bytes(b, hkv, d, lo_len, hi_len, win_len):
  return b * hkv * (2 * 2 * d * (hi_len + win_len) + (2 * (d // 2) + 4) * lo_len)


def timeit(fn, arg_sets, inner=10, reps=7):
  """Median seconds per call of fn(*args) on device, chained to defeat CSE/overlap."""
  def bundle(sets):
    acc = jnp.zeros((), jnp.float32)
    for r in range(inner):
      a = sets[r % len(sets)]
      q = a[0] + (acc * 0).astype(a[0].dtype)
      acc = acc + fn(q, *a[1:])[0, 0, 0].astype(jnp.float32)
    return acc
  f = jax.jit(bundle)
  f(arg_sets).block_until_ready()
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    f(arg_sets).block_until_ready()
    ts.append((time.perf_counter() - t) / inner)
  return statistics.median(ts), min(ts), max(ts)


def kernel_times(fn, args, iterations=5):
  """CUPTI: per kernel (name, median ms) of one call of ``jax.jit(fn)(*args)``, and their sum."""
  from jax.experimental.mosaic.gpu import profiler
  _, runs = profiler.measure(jax.jit(fn), aggregate=False, iterations=iterations)(*args)
  per = [[t for _, t in r] for r in runs]
  names = [n for n, _ in runs[0]]
  med = [statistics.median(ts) for ts in zip(*per)]
  return [(n[:80], round(t * 1e3, 2)) for n, t in zip(names, med)], sum(med) * 1e3


def copy_bw():
  """(copy read+write, read-only) bandwidth in bytes/s over a 2 GiB f32 array."""
  x = jax.random.normal(jax.random.key(0), (1 << 29,), jnp.float32)
  out = []
  for f, nb in ((jax.jit(lambda x: x + 1.0), 2 * x.nbytes), (jax.jit(jnp.sum), x.nbytes)):
    f(x).block_until_ready()
    ts = []
    for _ in range(10):
      t = time.perf_counter()
      f(x).block_until_ready()
      ts.append(time.perf_counter() - t)
    out.append(nb / statistics.median(ts))
  return out


def n_copies(nbytes, inner=10):
  """Distinct input copies per timed bundle: one per call (no CSE, no L2 reuse) within 12 GB."""
  return max(1, min(inner, int(12e9 // max(nbytes, 1))))


# --int4-sweep variants (runs 1-3 are recorded in bench/RESULTS.md, "## Kernels"; this is run 4).
_FUSED2 = dict(fuse=True, num_warps=2, num_stages=1, block_hi=64, int4_dequant="asm",
               int4_prefetch=True)
INT4_SWEEP = {
    "b_mix": [
        {}, dict(exact_pv_lo=False), _FUSED2, {**_FUSED2, "num_warps": 4, "num_stages": 2},
        dict(chunk_hi=1024), dict(chunk_hi=2048),
        dict(int4_prefetch=False, num_stages_lo=3),
        dict(int4_prefetch=False, num_stages_lo=3, num_warps_lo=4, block_lo=64),
        dict(exact_pv_lo=False, num_warps_lo=4, block_lo=128),
    ],
    "b_int4_part": [
        {}, dict(exact_pv_lo=False), dict(int4_prefetch=False, num_stages_lo=3),
        dict(int4_prefetch=False, num_stages_lo=4, num_warps_lo=4, block_lo=64),
        dict(exact_pv_lo=False, block_lo=32),
    ],
    "b_bf16_part": [{}, dict(chunk_hi=1024), dict(chunk_hi=2048), dict(num_warps=4, block_hi=64)],
}


def profile_one(kn, mix):
  """One warm-up and one timed-free call of the headline shape's ``mix`` (for ncu)."""
  b, hq, hkv, d, ctx = 8, 32, 8, 128, 32768
  lo_b, hi_b = int(ctx * 0.795), int(ctx * 0.122) - WIN
  lens = {"a_bf16": (0, ctx - WIN, WIN), "b_mix": (lo_b, hi_b, WIN), "b_int4_part": (lo_b, 0, 1)}
  a = build(jax.random.key(5), b, hq, hkv, d, *lens[mix])
  f = jax.jit(lambda *x: decode_attention_gpu(*x, **kn))
  f(*a).block_until_ready()
  f(*a).block_until_ready()
  print("profiled", mix, kn, flush=True)
  return 0


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="bench_out")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--sweep", action="store_true", help="knob sweep on the headline shape")
  ap.add_argument("--knobs", default="{}", help="JSON dict of kernel knobs for all configs")
  ap.add_argument("--int4-sweep", action="store_true",
                  help="headline shape only: (a) with defaults, (b) and its INT4 part over "
                       "INT4_SWEEP")
  ap.add_argument("--no-gqa", action="store_true", help="skip the jax gqa baseline")
  ap.add_argument("--profile-one", default=None, help="JSON knobs: run the headline shape's --mix "
                  "once (after one warm-up call) and exit; for ncu")
  ap.add_argument("--mix", default="b_int4_part")
  ap.add_argument("--lo-page", type=int, default=PAGE, help="tokens per INT4 page")
  ap.add_argument("--lo-formats", default="bytes",
                  help="comma list of INT4 storage formats (bytes, int4): each INT4 row in each; "
                       "int4 is read by the Mosaic GPU kernel only")
  ap.add_argument("--int4-kernels", default="",
                  help="comma list of int4_kernel values: each row with INT4 entries runs each; "
                       "'fused' (one Mosaic GPU launch for both pools: int4 format, both pools' "
                       "pages a multiple of 64, see --hi-page) runs on the rows without INT4 "
                       "entries too")
  ap.add_argument("--hi-page", type=int, default=PAGE, help="tokens per BF16-pool page")
  ap.add_argument("--fused-variants", default="[{}]",
                  help="JSON list of knob dicts (splits_lo, splits_hi, tile_hi, stages_lo, "
                       "stages_hi): each 'fused' row runs each")
  ap.add_argument("--bf16-variants", default="[]",
                  help="JSON list of knob dicts run besides the defaults on the all-BF16 cache "
                       "(a_bf16), e.g. the Triton partition's num_warps")
  ap.add_argument("--mosaic-variants", default="[{}]",
                  help="JSON list of knob dicts (splits_lo, wgs_lo, upcast_lo, early_v_lo): each "
                       "'mosaic' row runs each; wgs_lo > 1 (warp-specialized), upcast_lo other "
                       "than 'bf16' and early_v_lo on the "
                       "int4 format only")
  ap.add_argument("--shapes", default="", help="comma list of shape indices (default: all)")
  ap.add_argument("--cupti", action="store_true",
                  help="also each variant's kernels one by one under CUPTI (device time per "
                       "kernel; the gap to the timed call is host or launch time)")
  args = ap.parse_args(argv)
  if args.profile_one is not None:
    return profile_one(json.loads(args.profile_one), args.mix)
  os.makedirs(args.out, exist_ok=True)
  from jax.experimental.pallas.ops.gpu.decode_attention import gqa
  dev = jax.devices()[0]
  print(f"jax {jax.__version__} on {dev.device_kind}", flush=True)
  bw, rbw = copy_bw()
  print(f"copy bandwidth (read+write): {bw / 1e12:.3f} TB/s; "
        f"read-only (sum): {rbw / 1e12:.3f} TB/s", flush=True)
  knobs = json.loads(args.knobs)
  rows = []

  # (name, B, Hq, Hkv, D, context)
  shapes = [("4B-like b8 32K", 8, 32, 8, 128, 32768), ("4B-like b1 8K", 1, 32, 8, 128, 8192),
            ("4B-like b32 8K", 32, 32, 8, 128, 8192), ("0.5B b8 32K", 8, 14, 2, 64, 32768),
            ("0.5B b1 8K", 1, 14, 2, 64, 8192)]
  if args.quick or args.int4_sweep:
    shapes = shapes[:1]
  if args.shapes:
    shapes = [shapes[int(i)] for i in args.shapes.split(",")]
  key = jax.random.key(1)
  for name, b, hq, hkv, d, ctx in shapes:
    # (a) all BF16: pool + window.  (b) B ~ 0.33: 8% released, 79% INT4, 12% BF16 pool, window.
    lo_b = int(ctx * 0.795)
    hi_b = int(ctx * 0.122) - WIN
    mixes = {"a_bf16": (0, ctx - WIN, WIN), "b_mix": (lo_b, hi_b, WIN)}
    if name.startswith("4B-like b8"):   # where the time of (b) goes: each part alone
      mixes.update({"b_int4_part": (lo_b, 0, 1), "b_bf16_part": (0, hi_b, WIN)})
    # Baseline: jax's gqa over the dense BF16 cache of the same logical context.
    kd = jax.random.normal(key, (b, ctx, hkv, d), jnp.float32).astype(jnp.bfloat16)
    vd = jax.random.normal(jax.random.fold_in(key, 1), (b, ctx, hkv, d), jnp.float32).astype(
        jnp.bfloat16)
    qd = jax.random.normal(jax.random.fold_in(key, 2), (b, hq, d), jnp.float32).astype(jnp.bfloat16)
    dense_bytes = 2 * kd.nbytes
    base = {}
    # "fresh": a distinct cache per call, as in decode (its internal K/V transposes are paid each
    # call); "amortized": one cache for the whole bundle, so XLA computes the transposes once.
    for tag, nc in (() if args.no_gqa else (("fresh", n_copies(dense_bytes)), ("amortized", 1))):
      sets = [(qd, kd, vd)] + [(qd, kd + 0, vd + 0) for _ in range(nc - 1)]
      try:
        base[tag] = timeit(lambda q, k, v: gqa(q, k, v), sets)[0]
      except Exception:
        traceback.print_exc()
        base[tag] = float("nan")
      del sets
      rows.append(dict(shape=name, variant=f"jax gqa {tag}", B_payload=1.0,
                       time_us=base[tag] * 1e6, bytes=dense_bytes,
                       tbps=dense_bytes / base[tag] / 1e12, vs_baseline=base["fresh"] / base[tag],
                       err=None, knobs=""))
      print(rows[-1], flush=True)
    t_base = base.get("fresh", float("nan"))
    del kd, vd
    for mix, (lo_len, hi_len, win_len) in mixes.items():
      nbytes = kv_bytes(b, hkv, d, lo_len, hi_len, win_len)
      payload = (hi_len + win_len + lo_len * (4 * d + 16) / (16 * d)) / ctx
      arg_sets = [build(jax.random.fold_in(key, 10 + i), b, hq, hkv, d, lo_len, hi_len, win_len,
                        args.lo_page, args.hi_page) for i in range(n_copies(nbytes))]
      ref = synth.reference_f32(*arg_sets[0])
      assert len(arg_sets) > 1 or nbytes * 10 > 12e9
      variants = [knobs]
      kernels = args.int4_kernels.split(",") if args.int4_kernels else []
      if kernels and lo_len:
        variants = [{**knobs, "int4_kernel": k, **v} for k in kernels if k != "fused"
                    for v in (json.loads(args.mosaic_variants) if k == "mosaic" else [{}])]
      if "fused" in kernels:     # one Mosaic GPU launch for both pools, each knob variant
        variants = (variants if lo_len else [knobs]) + [
            {**knobs, "int4_kernel": "fused", **v} for v in json.loads(args.fused_variants)]
      if mix == "a_bf16":
        variants += [{**knobs, **v} for v in json.loads(args.bf16_variants)]
      if args.sweep and name.startswith("4B-like b8") and mix == "a_bf16":
        variants += [dict(num_warps=8, num_stages=3), dict(num_warps=4, num_stages=2, block_hi=64),
                     dict(chunk_hi=1024)]
      if args.int4_sweep:
        variants = [knobs] if mix == "a_bf16" else [{**knobs, **v} for v in INT4_SWEEP[mix]]
      if args.sweep and name.startswith("4B-like b8") and mix == "b_mix":
        variants += [dict(num_warps=4), dict(num_warps=8, num_stages=3, block_lo=128),
                     dict(num_warps=4, num_stages=3, block_lo=128, block_hi=64),
                     dict(chunk_lo=2048), dict(int4_dequant="cvt"),
                     dict(int4_dequant="cvt", num_warps=8, num_stages=4, block_hi=64)]
      is_fused = lambda v: v.get("int4_kernel") == "fused"
      runs = [("bytes", arg_sets, [v for v in variants
                                   if not is_fused(v) and v.get("wgs_lo", 1) == 1
                                   and v.get("upcast_lo") in (None, "bf16")
                                   and not v.get("early_v_lo")])]
      for fmt in args.lo_formats.split(","):
        if fmt != "bytes" and (lo_len or "fused" in kernels):
          # the same codes in another format, read by the Mosaic GPU kernels (each variant but
          # Triton's; without INT4 entries only the fused ones, the rest is the bytes row's)
          kns = [v for v in variants if v.get("int4_kernel") != "triton"
                 and (lo_len or is_fused(v))]
          runs.append((fmt, [to_format(a, fmt) for a in arg_sets],
                       kns if kernels else [knobs]))
      if "bytes" not in args.lo_formats.split(",") and lo_len:
        runs = runs[1:]
      for fmt, sets, kns in runs:
        for kn in kns if kns else ():
          try:
            fn = lambda *a, kn=kn: decode_attention_gpu(*a, **kn)
            out = fn(*sets[0])
            err = synth.rel_err(out, ref)
            t = timeit(fn, sets)[0]
          except Exception as e:
            print(f"FAILED {name} {mix} {fmt} {kn}: {type(e).__name__}: {str(e)[:500]}",
                  flush=True)
            continue
          rows.append(dict(shape=name, variant=f"pask {mix}", B_payload=round(payload, 3),
                           time_us=t * 1e6, bytes=nbytes, tbps=nbytes / t / 1e12,
                           vs_baseline=t_base / t, err=err,
                           knobs=json.dumps(kn if fmt == "bytes" else {**kn, "lo_format": fmt})))
          if args.cupti:
            try:
              ks, total = kernel_times(fn, sets[0])
              rows[-1].update(kernels_us=total, kernels=ks)
            except Exception as e:
              print(f"CUPTI failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
          print(rows[-1], flush=True)
      del arg_sets, ref, runs

  with open(os.path.join(args.out, "kernels.json"), "w") as f:
    json.dump(dict(jax=jax.__version__, device=dev.device_kind, copy_tbps=bw / 1e12,
                   read_tbps=rbw / 1e12, rows=rows), f,
              indent=1)
  with open(os.path.join(args.out, "kernels.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    w.writeheader()
    w.writerows(rows)
  print(f"\ncopy {bw / 1e12:.3f} TB/s, read {rbw / 1e12:.3f} TB/s  ({dev.device_kind}, "
        f"jax {jax.__version__}); x base = jax gqa fresh time / this time")
  print(f"{'shape':18s} {'variant':22s} {'B':>5s} {'us':>9s} {'TB/s':>6s} {'x base':>7s} "
        f"{'rel err':>8s}  knobs")
  for r in rows:
    e = "" if r["err"] is None else f"{r['err']:.1e}"
    print(f"{r['shape']:18s} {r['variant']:22s} {r['B_payload']:5.3f} {r['time_us']:9.1f} "
          f"{r['tbps']:6.3f} {r['vs_baseline']:7.2f} {e:>8s}  {r['knobs']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
