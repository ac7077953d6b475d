"""Device check of the GPU Spherical KV tier kernel (pallas_kernels.gpu.spherical), for an H200.

1. Correctness on the GPU at the Qwen 1.5B (12 q / 2 kv, d128) and 0.5B (14 q / 2 kv, d64)
   shapes: every tier format against ``reference.sph_partials`` (relative error of each tier's
   normalized partial; poisoned invisible slots), and ``decode_attention(sph=, backend="gpu")``
   against ``decode_attention_sph_reference``.
2. G2 of docs/SPHERICAL_KV.md §4 (B = 8, 32K keys per (sequence, KV head), one layer): the
   tier partition's time and GB/s of stored bytes (each ``--variants`` trig/expand pair); the
   reconstruct-then-attend path on the same
   storage (XLA decodes the tier into a dense BF16 K in HBM, then the BF16 partition reads it);
   the INT4 partition (Triton, page 16; and "auto" at page 128: Mosaic GPU on Hopper) on the
   same key count.  Prints one line per measurement; exit 1 when a rel err exceeds its bound.

    python bench/check_sph_gpu.py [--keys 32768] [--batch 8] [--iters 20] [--quick]
    python bench/check_sph_gpu.py --no-check --sweep '[{}, {"block": 64}, {"num_warps": 4}]'
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels import common, int4, reference, spherical
from pallas_kernels.gpu import partials_gpu, sph_partials_gpu
from pallas_kernels.sph_types import SphConsts, SphInputs, SphMaps, SphPool, TierSpec
from pallas_kernels.testing import sph_synth, synth
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window

SHAPES = {"1.5B": (12, 2, 128), "0.5B": (14, 2, 64)}
FORMATS = [(lay, val) for lay in spherical.LAYOUTS for val in spherical.VALUE_FORMATS]
TOL = 3e-5


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if not np.isfinite(a).all():
    return float("inf")
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def timed(f, *args, iters=20):
  """Median seconds of one call (after a warm-up call)."""
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return statistics.median(ts)


CUPTI = False   # --cupti: also each call's kernels' device time (CUPTI), not only wall time


def device_us(f, *args) -> str:
  """With --cupti: " | kernels T µs (name t, ...)" of one call of ``f`` (CUPTI, the median of 5:
  the wall time above also holds the host's dispatch, ~tens of µs, which matters at 0.2 ms)."""
  if not CUPTI:
    return ""
  from bench.bench_kernels import kernel_times
  try:
    ks, total = kernel_times(f, args)
  except Exception as e:  # noqa: BLE001 -- the wall-time figure stands
    return f" | CUPTI failed: {str(e)[:100]}"
  top = ", ".join(f"{n[:28]} {t:.1f}" for n, t in sorted(ks, key=lambda x: -x[1])[:3])
  return f" | kernels {total:.1f} µs ({top})"


def correctness() -> bool:
  ok = True
  for name, (hq, hkv, d) in SHAPES.items():
    b, page = 2, 16
    tiers = [TierSpec(lay, val, d) for lay, val in FORMATS]
    rng = np.random.default_rng(d)
    lens = [rng.integers(0, 700, (b, hkv)) for _ in tiers]
    sph = sph_synth.make(tiers, lens, b=b, hkv=hkv, page=page, layers=2, seed=d)
    q = jax.random.normal(jax.random.PRNGKey(d), (b, hq, d), jnp.float32).astype(jnp.bfloat16)
    got = sph_partials_gpu(q, sph, jnp.int32(1))
    want = reference.sph_partials(q, sph, 1)
    # The reference once more on the host's CPU backend (f32 dots computed as written): the
    # first GPU run (H100) measured the kernel 1.6-2.6e-3 from the reference run on the GPU,
    # with JAX_DEFAULT_MATMUL_PRECISION=highest too; this says which side the error is on.
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
      host = reference.sph_partials(jax.device_put(q, cpu), jax.device_put(sph, cpu), 1)
    # One bf16 pass for q·k and p·V: if the default's error is this one's, the hi/lo passes
    # (FP32-grade by design) do not take effect on the GPU.
    coarse = sph_partials_gpu(q, sph, jnp.int32(1), qk_passes=1, exact_pv=False)
    table = sph_partials_gpu(q, sph, jnp.int32(1), trig="table", expand="direct")
    for k, ts in enumerate(tiers):
      one = lambda x: common.merge(x[0][:, :, k:k + 1], x[1][:, :, k:k + 1], x[2][:, :, k:k + 1],
                                   axis=2)[0]
      e, eh, gh, ch, et = (rel(one(got), one(want)), rel(one(got), one(host)),
                           rel(one(want), one(host)), rel(one(coarse), one(host)),
                           rel(one(table), one(want)))
      ok &= e < TOL and et < TOL
      print(f"correct {name} {ts.layout}/{ts.values}: tier partial rel err {e:.2e} "
            f"(bound {TOL:.0e}); trig table + direct expansion {et:.2e}; kernel vs host-CPU "
            f"reference {eh:.2e}, GPU reference vs host-CPU reference {gh:.2e}, one bf16 pass "
            f"vs host {ch:.2e}")
    # The whole call: base partitions + tiers, one merge, vs the reference (f32 merged -> bf16).
    s = synth.Shape(b=b, hq=hq, hkv=hkv, d=d, page=page, w=32, lo_cap=512, hi_cap=128)
    args = synth.stack_layers(synth.make(s, (500, 37), (100, 0), (32, 5), seed=d))
    out, lse = pk.decode_attention(*args, sph=sph, layer=jnp.int32(1), backend="gpu",
                                   return_lse=True)
    ref, ref_lse = reference.decode_attention_sph_reference(*args, sph, jnp.int32(1),
                                                            return_lse=True)
    e, el = rel(out, ref), rel(lse, ref_lse)
    ok &= e < 6e-3 and el < 1e-5
    print(f"correct {name} decode_attention(sph=, gpu): out rel err {e:.2e} (bf16 out, bound "
          f"6e-3), lse rel err {el:.2e} (bound 1e-5)")
  return ok


def tier_storage(key, ts: TierSpec, b, hkv, n, page):
  """Random but valid stored tier (all visible): codes, fp16 radius ~1, fp16 value scale."""
  p = b * hkv * n
  k1, k2, k3, k4 = jax.random.split(key, 4)
  ang = jax.random.randint(k1, (p, page, ts.code_bytes), 0, 256, jnp.int32).astype(jnp.uint8)
  r = jax.random.uniform(k2, (p, page), jnp.float32, 0.5, 2.0)
  if ts.values == "bf16":
    v = jax.random.normal(k3, (p, page, ts.d), jnp.float32).astype(jnp.bfloat16)
    side = spherical.side_word(r)
  else:
    v = jax.random.randint(k3, (p, page, ts.d // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    side = spherical.side_word(r, jnp.full((p, page), 0.1, jnp.float32))
  tbl = jax.random.permutation(k4, p).reshape(b, hkv, n).astype(jnp.int32)
  return SphPool(ang, side, v), tbl


def empty_base(b, hkv, d, hq):
  """A window of no visible rows and no pools (the tiers alone)."""
  z = jnp.zeros((b, 16, hkv, d), jnp.bfloat16)
  window = Window(z, z, jnp.zeros((b,), jnp.int32))
  hi = HighPool(jnp.zeros((0, 16, hkv, d), jnp.bfloat16), jnp.zeros((0, 16, hkv, d), jnp.bfloat16))
  codes = jnp.zeros((0, 16, hkv, d // 2), jnp.uint8)
  lo = LowPool(codes, codes, jnp.zeros((0, 16, hkv, 2), jnp.float16))
  return window, hi, lo


VARIANTS = ("code/joins", "poly/joins", "table/direct", "table/joins", "poly/direct")


def g2(batch, keys, iters, variants=VARIANTS):
  page = 16
  n = keys // page
  for name, (hq, hkv, d) in SHAPES.items():
    g = hq // hkv
    q = jax.random.normal(jax.random.PRNGKey(1), (batch, hq, d), jnp.float32).astype(jnp.bfloat16)
    lens = jnp.full((batch, hkv), keys, jnp.int32)
    signs = jnp.asarray(spherical.rotation_signs(d, 0), jnp.float32)
    mu = jax.random.normal(jax.random.PRNGKey(2), (hkv, d), jnp.float32)
    for lay, val in FORMATS:
      ts = TierSpec(lay, val, d)
      pool, tbl = tier_storage(jax.random.PRNGKey(3), ts, batch, hkv, n, page)
      sph = SphInputs((pool,), SphMaps((tbl,), (lens,)), SphConsts(signs, mu), (ts,))
      stored = batch * hkv * keys * ts.bytes
      t_var = {}
      for v in variants:
        trig, expand = v.split("/")
        f = jax.jit(lambda q, s, trig=trig, expand=expand: sph_partials_gpu(
            q, s, trig=trig, expand=expand))
        t_var[v] = timed(f, q, sph, iters=iters)
      t_k = t_var[variants[0]]

      # Reconstruct-then-attend on the same storage: dense BF16 K in HBM, then the BF16
      # partition (each (sequence, KV head) as a sequence of one KV head, its tier table).
      rot = reference.sph_rotation(signs)

      @jax.jit
      def rebuild(pool):
        k = spherical.decode_key(pool.ang, pool.side, mu[0], rot, ts.key).astype(jnp.bfloat16)
        if ts.values == "bf16":
          v = pool.v
        else:
          v = int4.dequantize(pool.v, spherical.side_value_scale(pool.side)).astype(jnp.bfloat16)
        return k[:, :, None], v[:, :, None]                     # [P, page, 1, D]

      window, _, lo = empty_base(batch * hkv, 1, d, g)
      qf = q.reshape(batch * hkv, g, d)
      maps = PageMaps(tbl.reshape(batch * hkv, n), lens.reshape(-1),
                      jnp.zeros((batch * hkv, 0), jnp.int32), jnp.zeros((batch * hkv,), jnp.int32))

      @jax.jit
      def attend(k, v):
        return partials_gpu(qf, window, HighPool(k, v), lo, maps)

      @jax.jit
      def both(pool):
        return attend(*rebuild(pool))

      t_rb = timed(rebuild, pool, iters=iters)
      t_at = timed(attend, *rebuild(pool), iters=iters)
      t_both = timed(both, pool, iters=iters)
      print(f"G2 {name} B={batch} keys={keys} {lay}/{val}: tier kernel {t_k * 1e3:.3f} ms "
            f"({stored / t_k / 1e9:.0f} GB/s of {ts.bytes} B/key stored) | reconstruct+attend "
            f"{t_both * 1e3:.3f} ms (rebuild {t_rb * 1e3:.3f} + BF16 partition "
            f"{t_at * 1e3:.3f}) -> {t_both / t_k:.2f}x"
            + device_us(jax.jit(lambda q, s: sph_partials_gpu(q, s)), q, sph)
            + device_us(both, pool))
      print(f"G2 {name} {lay}/{val} variants (trig/expand): " + ", ".join(
          f"{v} {t * 1e3:.3f} ms ({stored / t / 1e9:.0f} GB/s)" for v, t in t_var.items()))

    int4_partition(name, q, hkv, keys, iters)


def int4_partition(name, q, hkv, keys, iters):
  """The INT4 partition on the same key count (B, Hkv, keys) as the tier runs, G2's yardstick:
  Triton at page 16; "auto" (Mosaic GPU on Hopper) at page 128."""
  batch, hq, d = q.shape
  g = hq // hkv
  for lo_page, kernel in ((16, "triton"), (128, "auto")):
    p_lo = batch * -(-keys // lo_page)
    ks = jax.random.split(jax.random.PRNGKey(4), 3)
    codes = lambda kk: jax.random.randint(kk, (p_lo, lo_page, hkv, d // 2), 0, 256,
                                          jnp.int32).astype(jnp.uint8)
    sc = jnp.full((p_lo, lo_page, hkv, 2), 0.05, jnp.float16)
    lo = LowPool(codes(ks[0]), codes(ks[1]), sc)
    if kernel == "auto":
      lo = LowPool(*int4.pool_arrays(*int4.pool_codes(lo.k, lo.v), "int4"),
                   int4.scale_array(sc, "int4"))
    window, hi, _ = empty_base(batch, hkv, d, g)
    tbl = jax.random.permutation(ks[2], p_lo).reshape(batch, -1).astype(jnp.int32)
    maps = PageMaps(jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch,), jnp.int32), tbl,
                    jnp.full((batch,), keys, jnp.int32))
    try:
      f_lo = jax.jit(lambda q, lo: partials_gpu(q, window, hi, lo, maps, int4_kernel=kernel))
      t = timed(f_lo, q, lo, iters=iters)
    except Exception as e:  # noqa: BLE001 -- report and go on (the tier numbers stand)
      print(f"G2 {name} INT4 partition page {lo_page} {kernel}: failed: {str(e)[:200]}")
      continue
    stored = batch * hkv * keys * (d + 4)
    print(f"G2 {name} B={batch} keys={keys} INT4 partition page {lo_page} ({kernel}): "
          f"{t * 1e3:.3f} ms ({stored / t / 1e9:.0f} GB/s of {d + 4} B/key stored)"
          + device_us(f_lo, q, lo))


def sweep(batch, keys, iters, knob_sets, formats) -> bool:
  """The tier kernel's time under each knob set (``sph_partials_gpu`` keyword arguments: block,
  splits, num_warps, num_stages, qk_passes, exact_pv, codes, fma, ...) at both shapes, for
  ``formats`` ("layout/values"); each knob set first checked against the reference on small
  ragged inputs of every format (False if one misses the bound; ``qk_passes=1`` is expected
  to)."""
  page = 16
  n = keys // page
  ok = True
  for name, (hq, hkv, d) in SHAPES.items():
    tiers = [TierSpec(lay, val, d) for lay, val in FORMATS]
    rng = np.random.default_rng(d)
    small = sph_synth.make(tiers, [rng.integers(0, 300, (2, hkv)) for _ in tiers], b=2, hkv=hkv,
                           page=page, layers=2, seed=d)
    qs = jax.random.normal(jax.random.PRNGKey(d), (2, hq, d), jnp.float32).astype(jnp.bfloat16)
    want = reference.sph_partials(qs, small, 1)
    one = lambda x, k: common.merge(*(y[:, :, k:k + 1] for y in x), axis=2)[0]
    for kn in knob_sets:
      try:
        got = sph_partials_gpu(qs, small, jnp.int32(1), **kn)
      except Exception as e:  # noqa: BLE001 -- reported with the timing below
        print(f"G2 sweep check {name} {kn}: failed: {str(e)[:160]}", flush=True)
        continue
      err = max(rel(one(got, k), one(want, k)) for k in range(len(tiers)))
      ok &= err < TOL
      print(f"G2 sweep check {name} {kn}: max tier rel err {err:.2e} (bound {TOL:.0e})",
            flush=True)
    q = jax.random.normal(jax.random.PRNGKey(1), (batch, hq, d), jnp.float32).astype(jnp.bfloat16)
    lens = jnp.full((batch, hkv), keys, jnp.int32)
    signs = jnp.asarray(spherical.rotation_signs(d, 0), jnp.float32)
    mu = jax.random.normal(jax.random.PRNGKey(2), (hkv, d), jnp.float32)
    for fmt in formats:
      lay, val = fmt.split("/")
      ts = TierSpec(lay, val, d)
      pool, tbl = tier_storage(jax.random.PRNGKey(3), ts, batch, hkv, n, page)
      sph = SphInputs((pool,), SphMaps((tbl,), (lens,)), SphConsts(signs, mu), (ts,))
      stored = batch * hkv * keys * ts.bytes
      for kn in knob_sets:
        try:
          f_kn = jax.jit(lambda q, s, kn=kn: sph_partials_gpu(q, s, **kn))
          t = timed(f_kn, q, sph, iters=iters)
        except Exception as e:  # noqa: BLE001 -- a knob set that does not compile: say so, go on
          print(f"G2 sweep {name} {fmt} {kn}: failed: {str(e)[:160]}", flush=True)
          continue
        print(f"G2 sweep {name} {fmt} {kn}: {t * 1e3:.3f} ms ({stored / t / 1e9:.0f} GB/s)"
              + device_us(f_kn, q, sph), flush=True)
    int4_partition(name, q, hkv, keys, iters)
  return ok


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--keys", type=int, default=32768)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--quick", action="store_true", help="correctness only")
  ap.add_argument("--no-check", action="store_true",
                  help="G2 timings only (correctness measured by an earlier run of the same tree)")
  ap.add_argument("--variants", default=",".join(VARIANTS),
                  help="tier kernel trig/expand variants timed in G2 (the first is the one "
                       "compared with reconstruct-then-attend)")
  ap.add_argument("--sweep", default=None,
                  help='JSON list of knob sets timed instead of G2, e.g. \'[{}, {"block": 64}]\'')
  ap.add_argument("--sweep-formats", default="A4/int4,A4/bf16,A42/int4")
  ap.add_argument("--cupti", action="store_true",
                  help="also each timed call's kernels' device time (CUPTI)")
  a = ap.parse_args()
  global CUPTI
  CUPTI = a.cupti
  print(f"backend {jax.default_backend()} {jax.devices()[0].device_kind} jax {jax.__version__}")
  ok = True
  if not a.no_check:
    ok = correctness()
    print("correctness", "OK" if ok else "FAILED")
  if a.sweep:
    ok &= sweep(a.batch, a.keys, a.iters, json.loads(a.sweep), a.sweep_formats.split(","))
  elif not a.quick:
    g2(a.batch, a.keys, a.iters, tuple(a.variants.split(",")))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
