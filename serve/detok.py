"""Incremental detokenization for streaming: O(new tokens) per step, not O(output).

Decoding a request's whole output after every token (what the engine did) costs O(n) per token,
O(n²) per request: at 32 rows × 1024 tokens it was ~10 ms of host time per step on the H200
host.  The ``tokenizers`` library's :class:`~tokenizers.decoders.DecodeStream` decodes only a
window from a recent clean boundary (the prefix-window scheme of vLLM's detokenizer) and emits a
chunk once the window's new text does not end in U+FFFD (an incomplete UTF-8 sequence); the
chunks joined equal ``decode(ids)`` up to the last one.

:class:`Detokenizer` keeps that contract of the engine: ``text(ids) == decode(ids)`` at every
step, the tokens after the last chunk (an incomplete character, decoded as U+FFFD) included, so
that stop sequences, the held-back tail and the final delta see what a full decode sees.
"""
from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer, decoders
from tokenizers.decoders import DecodeStream


class Detokenizer:
  """``text(ids)``: the decoded text (``tok.decode(ids)``, special tokens skipped) of a growing
  token list, incrementally.

  ``ids`` must only grow between calls (the engine's ``Request.out``).  The returned text may end
  in U+FFFD while a multi-byte character is incomplete, exactly as ``decode(ids)`` would
  (:meth:`serve.engine.output.Output.send` holds such a tail back until its bytes arrive).

  ``tok`` is a :class:`models.tokenizer.Tokenizer` (its ``tok`` a ``tokenizers.Tokenizer``: every
  tokenizer the project loads, from GGUF metadata or ``tokenizer.json``).  A duck-typed tokenizer
  with only ``decode`` (no ``tokenizers.Tokenizer`` to stream with) is decoded whole each step.
  """

  def __init__(self, tok):
    self.tok = tok
    hf = getattr(tok, "tok", None)
    self.hf = hf if isinstance(hf, HFTokenizer) else None
    # Byte-level BPE decodes the concatenated bytes of its tokens at once, so the text after a
    # chunk (which ends in a complete character) decodes alone to what it adds to the whole.
    self.additive = self.hf is not None and isinstance(self.hf.decoder, decoders.ByteLevel)
    self.stream = self._stream() if self.hf is not None else None
    self.stable = ""      # the chunks DecodeStream emitted: decode(ids[:mark])
    self.mark = 0         # tokens behind ``stable``
    self.fed = 0          # tokens seen
    self.last = ""        # text(ids[:fed])

  def _stream(self, ids=None) -> DecodeStream:
    return DecodeStream(ids=ids, skip_special_tokens=True)

  def text(self, ids) -> str:
    n = len(ids)
    if n < self.fed:
      raise ValueError(f"detokenizer: the token list shrank from {self.fed} to {n} tokens; "
                       "it must only grow")
    if n == self.fed:
      return self.last
    new = [int(t) for t in ids[self.fed:]]
    bad = next((t for t in new if t < 0), None)
    if bad is not None:
      raise ValueError(f"detokenizer: token id {bad} is negative")
    self.fed = n
    if self.hf is None:
      self.last = self.tok.decode(list(ids))
      return self.last
    chunk = None
    if self.stream is not None:
      try:
        chunk = self.stream.step(self.hf, new)
      except Exception:  # noqa: BLE001 — InvalidPrefix: the decoder rewrote text before the window
        self.stream = None
    if chunk is not None:
      self.stable += chunk
      self.mark = n
      self.last = self.stable
    elif self.stream is not None and self.additive:
      self.last = self.stable + self.tok.decode(ids[self.mark:])
    else:
      # A decoder whose text after a chunk depends on the tokens before it (SentencePiece's
      # leading-space strip, cleanups), or a stream that lost its prefix: decode whole while the
      # text is incomplete, and start a stream again from a complete text.
      self.last = self.tok.decode(list(ids))
      if self.stream is None and not self.last.endswith("\ufffd"):
        self.stream = self._stream(list(ids))
        self.stable, self.mark = self.last, n
    return self.last
