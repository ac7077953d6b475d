"""Runtime-D (calibrate/distortion.py, paper Eq. 7) against an independent float64 computation.

The oracle walks every (intervention, layer, decode query, head) explicitly: keys t <= u that
exist; sinks and the recent window (t > u - W) exact; older keys by the intervention's action in
the layer's group — H exact, L the INT4 round trip (pallas_kernels.int4's float64 oracle), R gone.
Swapping the L and R masks (or the window/sink rule) changes the oracle, so it would fail.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from calibrate import distortion as RD
from pallas_kernels import int4
from pask_jax import actions as Act


def _deq(x):
  c, s = int4.quantize_numpy(x.astype(np.float32))
  return c.astype(np.float64) * s.astype(np.float64)[..., None]


def _oracle(q, k, v, act, n_prompt, n_dec, sink, window, group_of, n_groups):
  L, n, Hq, D = q.shape
  Hkv = k.shape[2]
  g = Hq // Hkv
  out = np.zeros((act.shape[0], n_groups))
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  kq, vq = _deq(k), _deq(v)
  for l in range(L):
    gi = group_of[l]
    for u in range(n_prompt, n_prompt + n_dec):
      def attend(a):
        o = np.zeros((Hq, D))
        for h in range(Hq):
          kv = h // g
          keys, vals = [], []
          for t in range(u + 1):
            old = t >= sink and t <= u - window
            act_t = a[t] if old else Act.H
            if act_t == Act.R:
              continue
            keys.append(kq[l, t, kv] if act_t == Act.L else k[l, t, kv])
            vals.append(vq[l, t, kv] if act_t == Act.L else v[l, t, kv])
          s = np.array([q[l, u, h] @ kk for kk in keys]) / np.sqrt(D)
          p = np.exp(s - s.max())
          p /= p.sum()
          o[h] = p @ np.array(vals)
        return o
      ref = attend(np.full(n, Act.H))
      for ai in range(act.shape[0]):
        o = attend(act[ai, :, gi])
        out[ai, gi] += np.max(np.sum((o - ref) ** 2, axis=-1))
  return out


def test_runtime_d_matches_an_explicit_float64_computation():
  rng = np.random.default_rng(4)
  L, n_prompt, n_dec, Hq, Hkv, D = 3, 11, 6, 4, 2, 16
  n = n_prompt + n_dec
  sink, window, group_of, G = 2, 4, (0, 1, 2), 3
  q = rng.standard_normal((L, n, Hq, D)).astype(np.float32)
  k = (rng.standard_normal((L, n, Hkv, D)) * rng.uniform(0.5, 3, (1, 1, Hkv, 1))).astype(np.float32)
  v = rng.standard_normal((L, n, Hkv, D)).astype(np.float32)
  # Interventions: all R, all L, all H, and random mixes, per token and group.
  act = np.stack([np.full((n, G), Act.R), np.full((n, G), Act.L), np.full((n, G), Act.H)]
                 + [rng.integers(0, 3, (n, G)) for _ in range(3)]).astype(np.int8)
  got = RD.distortion(q, k, v, act, n_prompt, n_dec, sink=sink, window=window,
                      group_of=group_of, n_groups=G)
  want = _oracle(q, k, v, act, n_prompt, n_dec, sink, window, group_of, G)
  assert got.shape == want.shape == (act.shape[0], G)
  np.testing.assert_allclose(got[2], 0.0, atol=1e-9)                  # all-H: no distortion
  assert np.all(want[0] > want[1])                                     # releasing hurts more
  np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-7)


def test_one_padded_size_for_a_calibration_set_gives_each_request_its_own_result():
  """Runtime-D pads every request to one (T, U) from RD.size so it compiles once; the padding
  (zero keys past n, decode queries past the request's own) must not change a request's D."""
  rng = np.random.default_rng(7)
  L, Hq, Hkv, D, G = 2, 4, 2, 16, 2
  reqs = [(13, 9, 3), (40, 30, 9), (21, 5, 15)]                         # (n, prompt, decode q)
  padded = RD.size(reqs, bucket=16)
  assert padded[1] >= 15 and all(padded[0] >= max(n, p + padded[1]) for n, p, _ in reqs)
  for n, n_prompt, n_dec in reqs:
    q = rng.standard_normal((L, n, Hq, D)).astype(np.float32)
    k = rng.standard_normal((L, n, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((L, n, Hkv, D)).astype(np.float32)
    act = rng.integers(0, 3, (4, n, G)).astype(np.int8)
    kw = dict(sink=2, window=3, group_of=(0, 1), n_groups=G)
    own = RD.distortion(q, k, v, act, n_prompt, n_dec, **kw)
    got = RD.distortion(q, k, v, act, n_prompt, n_dec, padded=padded, **kw)
    assert np.linalg.norm(got - own) <= 1e-5 * np.linalg.norm(own)
  q, k, v = (rng.standard_normal((L, 40, h, D)).astype(np.float32) for h in (Hq, Hkv, Hkv))
  act = rng.integers(0, 3, (4, 40, G)).astype(np.int8)
  with np.testing.assert_raises_regex(ValueError, "does not hold a request of 40 tokens"):
    RD.distortion(q, k, v, act, 30, 9, padded=(32, 32), **kw)
