"""Incremental detokenization (serve/detok.py) equals a full decode at every step."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from pask_jax.testing import smollm2
from serve.detok import Detokenizer


def test_incremental_text_equals_full_decode():
  tok = smollm2().tokenizer
  texts = ["Grüße aus Köln — 東京の天気は晴れ 🌤️ and emoji 👩‍👩‍👧 end.",
           '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "°C"}}']
  rng = np.random.default_rng(0)
  for text in texts:
    ids = tok.encode(text)
    d, out = Detokenizer(tok), []
    for t in ids:
      out.append(t)
      assert d.text(out) == tok.decode(out)
  # Random ids (byte tokens split multi-byte characters anywhere).
  ids = rng.integers(0, 49152, 400).tolist()
  d, out = Detokenizer(tok), []
  for t in ids:
    out.append(t)
    assert d.text(out) == tok.decode(out)
