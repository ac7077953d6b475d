"""XGrammar glue: tokenizer info from our tokenizer, grammar compilation, per-request matchers.

The bitmask is filled on the host (``int32[B, ceil(V/32)]``, bit ``t % 32`` of word ``t // 32``
set = token ``t`` allowed) and shipped to the jitted step, which unpacks it and masks the logits
(:func:`pask_jax.sample.apply_bitmask`).
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from pask_jax.grammar.errors import GrammarError, xgrammar_message


def import_xgrammar():
  """The xgrammar module, imported on first use (it imports torch).

  Loading it installs tvm_ffi's SIGSEGV handler over Python's faulthandler; that handler
  backtraces through the unwinder, so a fault inside the unwinder (a C++ exception thrown while
  the process is out of memory mappings) deadlocks instead of ending the process.  Where
  faulthandler was on, it is put back: a crash then ends with a traceback."""
  import faulthandler
  import sys
  first, restore = "xgrammar" not in sys.modules, faulthandler.is_enabled()
  import xgrammar
  if first and restore:
    faulthandler.disable()
    faulthandler.enable(sys.__stderr__, all_threads=True)
  return xgrammar


# XGrammar 0.2.9 lowers a string with minLength / maxLength to a bounded repetition of
# [^"\\\r\n]: it admits the control characters U+0000-U+001F that JSON forbids unescaped (a
# random model wrote "#le\x1f" into one, and json.loads refused the answer) and no escape at all
# (mlc-ai/xgrammar#800; the fix, #880, is not released).  Each such class is rewritten to
# [^\0-\x1f"\\]: any code point but a control character, quote or backslash, so the string is
# always valid JSON.  Escapes stay out, as in XGrammar's own class: with an escape alternative the
# repeated element is no longer one character class and XGrammar fills the next-token mask inside
# the string in 9-58 ms instead of 0.02 (SmolLM2's 49K vocabulary, this 2-core host), every row
# of every decode step (bench/RESULTS.md, 2026-12-06 (sixth)).
_BOUNDED_CHAR = ' ::= (([^\\"\\\\\\r\\n]))'
_JSON_CHAR = ' ::= (([^\\0-\\x1f\\"\\\\]))'


def schema_ebnf(text: str, indent: int | None = None) -> str:
  """The EBNF grammar of the JSON schema ``text`` (compact JSON unless ``indent``): XGrammar's
  conversion, its length-bounded string characters kept out of the control characters
  (above)."""
  xgr = import_xgrammar()
  ebnf = str(xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True,
                                          indent=indent))
  lines = []
  for line in ebnf.splitlines():
    name = line.split(" ::= ", 1)[0]
    if line.endswith(_BOUNDED_CHAR) and name.endswith("_characters"):
      line = name + _JSON_CHAR
    lines.append(line)
  return "\n".join(lines) + "\n"


class GrammarCompiler:
  """Compiles grammars for one tokenizer/model pair (vocab size = the model's logits width)."""

  def __init__(self, tokenizer, vocab_size: int, threads: int = 2):
    xgr = import_xgrammar()
    vocab = list(tokenizer.token_bytes())
    vocab += [b""] * (vocab_size - len(vocab))  # padding rows of the lm_head: never allowed
    self.vocab_size = vocab_size
    self.stop_ids = list(tokenizer.stop_ids)
    self.info = xgr.TokenizerInfo(vocab[:vocab_size], xgr.VocabType.RAW, vocab_size=vocab_size,
                                  stop_token_ids=self.stop_ids)
    self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads)

  def json_schema(self, schema: dict | str, where: str = "schema") -> "Grammar":
    """Compile a JSON schema after :func:`~pask_jax.grammar.schema_check.prepare` (refused
    unless XGrammar enforces it exactly: GrammarError naming the problem)."""
    from pask_jax.grammar.schema_check import prepare
    try:
      obj = json.loads(schema) if isinstance(schema, str) else schema
    except json.JSONDecodeError as e:
      raise GrammarError(f"JSON schema is not valid JSON: {e}") from None
    text = json.dumps(prepare(obj, where))
    xgr = import_xgrammar()
    try:
      compiled = self._compiler.compile_grammar(xgr.Grammar.from_ebnf(schema_ebnf(text)))
    except Exception as e:
      raise GrammarError(f"{where}: XGrammar cannot compile this JSON schema: "
                         f"{xgrammar_message(e)}") from None
    return Grammar(compiled, "json_schema", source=text)

  def ebnf(self, text: str, root: str = "root") -> "Grammar":
    xgr = import_xgrammar()
    try:
      compiled = self._compiler.compile_grammar(xgr.Grammar.from_ebnf(text, root_rule_name=root))
    except Exception as e:
      raise GrammarError(f"XGrammar cannot compile this EBNF grammar: {xgrammar_message(e)}") \
          from None
    return Grammar(compiled, "ebnf", source=text)

  def structural_tag(self, tag: dict) -> "Grammar":
    """Compile an XGrammar structural tag (``{"type": "structural_tag", "format": ...}``)."""
    try:
      compiled = self._compiler.compile_structural_tag(json.dumps(tag))
    except Exception as e:
      raise GrammarError(f"XGrammar cannot compile this structural tag: {xgrammar_message(e)}") \
          from None
    return Grammar(compiled, "structural_tag", source=json.dumps(tag))


class Grammar:
  def __init__(self, compiled, kind: str, source: str = "", meta: dict[str, Any] | None = None):
    self.compiled, self.kind, self.source, self.meta = compiled, kind, source, meta or {}

  def matcher(self) -> "Matcher":
    return Matcher(self)


class Matcher:
  """One request's parser state. ``fill`` writes the allowed-token bitmask for the next step."""

  def __init__(self, grammar: Grammar):
    xgr = import_xgrammar()
    self.grammar = grammar
    self.m = xgr.GrammarMatcher(grammar.compiled, max_rollback_tokens=-1)

  def fill(self, bitmask: np.ndarray, row: int = 0) -> None:
    self.m.fill_next_token_bitmask(bitmask, row)

  def accept(self, token: int) -> bool:
    return self.m.accept_token(int(token))

  def fork(self) -> "Matcher":
    """An independent matcher in the same state (XGrammar copies the parser state)."""
    new = object.__new__(Matcher)
    new.grammar, new.m = self.grammar, self.m.fork()
    return new

  def rollback(self, n: int) -> None:
    self.m.rollback(n)

  def jump_forward(self) -> str:
    return self.m.find_jump_forward_string()

  @property
  def terminated(self) -> bool:
    return self.m.is_terminated()

  def completed(self) -> bool:
    return self.m.is_completed()


def bitmask_words(vocab_size: int) -> int:
  return math.ceil(vocab_size / 32)


def new_bitmask(batch: int, vocab_size: int, allow_all: bool = True) -> np.ndarray:
  return np.full((batch, bitmask_words(vocab_size)), -1 if allow_all else 0, np.int32)
