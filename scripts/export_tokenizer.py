"""Export a GGUF model's tokenizer (tokenizer.json, chat template, stop ids) to a small .json.gz.

Tests use the committed ``tests/data/qwen_tokenizer.json.gz`` because CI has no Qwen GGUF:

  python scripts/export_tokenizer.py ~/.cache/pask-jax/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
      tests/data/qwen_tokenizer.json.gz

``load(path)`` rebuilds the :class:`models.tokenizer.Tokenizer` from such a file.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def export(gguf_path: str, out: str) -> dict:
  from models import gguf_io
  from models.tokenizer import Tokenizer
  tok = Tokenizer.from_gguf_metadata(gguf_io.metadata(gguf_io.open_gguf(gguf_path)))
  rec = {"tokenizer": json.loads(tok.tok.to_str()), "chat_template": tok.chat_template,
         "stop_ids": list(tok.stop_ids), "bos_id": tok.bos_id, "add_bos": tok.add_bos,
         "vocab_size": tok.vocab_size, "special_tokens": tok.special_tokens, "hash": tok.hash(), "source": os.path.basename(gguf_path)}
  # Compact JSON and maximum compression: the file is committed.
  with gzip.GzipFile(out, "wb", compresslevel=9, mtime=0) as f:
    f.write(json.dumps(rec, separators=(",", ":"), ensure_ascii=False).encode())
  return rec


def load(path: str):
  """The Tokenizer stored by :func:`export` (no GGUF needed)."""
  from tokenizers import Tokenizer as HFTokenizer
  from models.tokenizer import Tokenizer
  with gzip.open(path, "rb") as f:
    rec = json.loads(f.read())
  return Tokenizer(HFTokenizer.from_str(json.dumps(rec["tokenizer"])),
                   chat_template=rec["chat_template"], stop_ids=rec["stop_ids"],
                   bos_id=rec["bos_id"], add_bos=rec["add_bos"], vocab_size=rec["vocab_size"],
                   special_tokens=rec.get("special_tokens"))


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
