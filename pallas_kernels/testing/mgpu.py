"""Checks shared by the Mosaic GPU kernels' CPU tests."""
from __future__ import annotations

from typing import Callable

import pytest

from pallas_kernels.gpu import mgpu_common as C


def assert_narrow_lowers(lower: Callable[..., str]) -> None:
  """``lower(cols=8)`` (the softmax over 8 columns, which concatenates registers) gives Mosaic
  GPU text where this jax lowers Mosaic GPU's concatenate (>= 0.11), and a one-line error naming
  that need where it does not (0.10)."""
  if C.HAS_CONCAT:
    assert "mosaic_gpu" in lower(cols=8)
  else:
    with pytest.raises(ValueError, match="needs Pallas Mosaic GPU's concatenate"):
      lower(cols=8)
