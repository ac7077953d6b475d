"""Rows that stress the INT4 quantizer (tests/test_int4.py, bench/check_int4_backend.py)."""
from __future__ import annotations

import numpy as np

from pallas_kernels import int4


def adversarial_rows(rng: np.random.Generator, n: int = 512, d: int = 8) -> np.ndarray:
  """``float32 [n + 8, d]``: rows whose elements sit exactly on, and one f32 ulp either side of,
  the rounding midpoints (c + 1/2)·s of their own scale, plus huge, tiny and subnormal-scale
  rows."""
  base = rng.standard_normal((n, d)).astype(np.float32) * rng.choice([1e-6, 1e-3, 1.0, 300.0],
                                                                     (n, 1)).astype(np.float32)
  _, s = int4.quantize_numpy(base)
  s = s.astype(np.float32)[:, None]
  half = rng.integers(-7, 7, (n, d)).astype(np.float32) + 0.5
  mid = (half * s).astype(np.float32)
  nudge = rng.choice([-1, 0, 0, 1], (n, d))
  mid = np.where(nudge > 0, np.nextafter(mid, np.float32(np.inf)),
                 np.where(nudge < 0, np.nextafter(mid, -np.float32(np.inf)), mid))
  rows = base.copy()
  keep = rng.random((n, d)) < 0.75
  rows[keep] = mid[keep]          # most elements on midpoints; the max element keeps the scale
  big = rng.standard_normal((8, d)).astype(np.float32) * np.float32(1e6)      # scale > fp16 max
  return np.concatenate([rows, big]).astype(np.float32)
