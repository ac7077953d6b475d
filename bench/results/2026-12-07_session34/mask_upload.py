"""Host cost per stacked calibration step of the next-token masks (issue 24, CPU): the old path
(every row's mask written into a [B, words] array, then uploaded as a copy) against the new one
(calibrate.stack: one row per distinct parser-state node, uploaded with the row index), at B
rows, the Qwen vocabulary, U distinct nodes; mock trackers that copy a cached mask as
calibrate.shared.SharedTracker does for every row after the first at its node."""
import sys
import time

import numpy as np

from calibrate import stack as S
from pask_jax.recycle import upload

B, WORDS = 1024, -(-151936 // 32)


class Mock:
  def __init__(self, node, mask):
    self.mask_key, self.mask = node, mask

  def fill(self, bits, row):
    bits[row] = self.mask


def run(U, reps=20):
  rng = np.random.default_rng(0)
  masks = [rng.integers(-2**31, 2**31 - 1, WORDS, dtype=np.int32) for _ in range(U)]
  nodes = [object() for _ in range(U)]
  which = rng.integers(0, U, B)
  trs = [Mock(nodes[u], masks[u]) for u in which]
  running = np.ones(B, bool)
  best = {}
  for _ in range(reps):
    t0 = time.perf_counter()
    bits = np.empty((B, WORDS), np.int32)
    for b in range(B):
      trs[b].fill(bits, b)
    x = upload(bits)
    x.block_until_ready()
    t1 = time.perf_counter()
    m, r = S.row_masks(trs, running, WORDS)
    y, z = upload(m), upload(r)
    y.block_until_ready(), z.block_until_ready()
    t2 = time.perf_counter()
    for k, v in (("old_ms", t1 - t0), ("new_ms", t2 - t1)):
      best[k] = min(best.get(k, 1e9), 1e3 * v)
  return {"B": B, "U": U, "upload_rows": int(m.shape[0]), **best}


if __name__ == "__main__":
  for U in (int(x) for x in (sys.argv[1:] or (40, 100, 300, 1024))):
    print(run(U))
