"""Incremental detokenization (serve/detok.py) equals a full decode at every step."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

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


def _steps(tok, ids, full=None):
  """Detokenizer.text after every token, checked against a full decode (``full``'s, else
  ``tok``'s); the detokenizer."""
  d, out = Detokenizer(tok), []
  for t in ids:
    out.append(t)
    assert d.text(out) == (full or tok).decode(out), len(out)
  return d


def test_byte_level_decodes_only_new_tokens():
  """Byte-level BPE: DecodeStream's chunks plus the tokens after the last one (an incomplete
  character) decoded alone; no step decodes the whole output."""
  tok = smollm2().tokenizer

  class Counting:
    tok, stop_ids, longest = smollm2().tokenizer.tok, (), 0

    def decode(self, ids):
      self.longest = max(self.longest, len(ids))
      return tok.decode(ids)

  ids = tok.encode("東京の天気は晴れ 🌤️ 👩‍👩‍👧 " * 20)
  c = Counting()
  d = _steps(c, ids, full=tok)
  assert d.stream is not None and len(ids) > 100 and 0 < c.longest <= 8, c.longest


def _tokenizer(model, decoder, special=()):
  from tokenizers import Tokenizer as HFTokenizer

  from models.tokenizer import Tokenizer
  hf = HFTokenizer(model)
  hf.decoder = decoder
  hf.add_special_tokens(list(special))
  return Tokenizer(hf, chat_template=None, stop_ids=[])


def test_sentencepiece_byte_fallback():
  """A SentencePiece-style decoder (byte-fallback tokens, leading space stripped): the text after
  a chunk is not its tokens decoded alone, so an incomplete character decodes whole."""
  from tokenizers import decoders, models
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
  vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
  for piece in ["▁", "▁hello", "▁world", "a", "▁a", "lo", "o"]:
    vocab[piece] = len(vocab)
  tok = _tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"),
                   decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                      decoders.Fuse(), decoders.Strip(" ", 1, 0)]),
                   special=["<s>", "</s>"])
  byte = lambda s: [vocab[f"<0x{b:02X}>"] for b in s.encode()]
  ids = [vocab["▁hello"], vocab["▁"]] + byte("東京👩‍👧") + [1, vocab["▁world"], vocab["a"]]
  d = _steps(tok, ids)
  assert d.text(ids) == "hello 東京👩‍👧 worlda"
  _steps(tok, np.random.default_rng(1).integers(0, len(vocab), 300).tolist())


def test_decoder_that_rewrites_before_the_window():
  """A decoder that changes text already streamed ("ab" -> "X" over the fused string): the
  stream's prefix no longer matches, so the text is decoded whole until a new stream starts."""
  from tokenizers import decoders, models
  vocab = {"[UNK]": 0, "a": 1, "b": 2, "c": 3}
  tok = _tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"),
                   decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")]))
  d = _steps(tok, [1, 2, 3, 1, 3, 1, 2, 2, 1])
  assert d.last == "XcacXba" and d.stream is not None


def test_plain_tokenizer_and_bad_input():
  """A tokenizer with only ``decode`` is decoded whole; bad input is a one-line error."""
  class Plain:
    stop_ids = ()
    decode = staticmethod(lambda ids: " ".join(map(str, ids)))

  assert _steps(Plain(), [5, 6, 7]).last == "5 6 7"
  d = Detokenizer(smollm2().tokenizer)
  d.text([1, 2])
  for bad, msg in [([1], "must only grow"), ([1, 2, -3], "token id -3 is negative"),
                   ([1, 2, "x"], "invalid literal")]:
    with pytest.raises((ValueError, TypeError), match=msg) as e:
      d.text(bad)
    assert "\n" not in str(e.value)
