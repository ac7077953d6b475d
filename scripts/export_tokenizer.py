"""Export a GGUF model's tokenizer (tokenizer.json, chat template, stop ids) to a small .json.gz.

Tests use the committed ``tests/data/qwen_tokenizer.json.gz`` because CI has no Qwen GGUF:

  python scripts/export_tokenizer.py ~/.cache/pask-jax/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
      tests/data/qwen_tokenizer.json.gz

:func:`pask_jax.testing.load_tokenizer` rebuilds the :class:`models.tokenizer.Tokenizer`.
"""
from __future__ import annotations

import argparse
import os

from pask_jax.testing import export_tokenizer as export
from pask_jax.testing import load_tokenizer as load


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("gguf")
  ap.add_argument("out")
  a = ap.parse_args()
  rec = export(a.gguf, a.out)
  tok = load(a.out)
  assert tok.hash() == rec["hash"], "round trip changed the vocabulary"
  print(f"wrote {a.out}: {os.path.getsize(a.out)} bytes, vocab {rec['vocab_size']}, "
        f"stops {rec['stop_ids']}, hash {rec['hash']}")


if __name__ == "__main__":
  main()
