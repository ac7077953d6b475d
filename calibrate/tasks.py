"""Task oracles for calibration: prepared requests, a tracker per request, and an exact scorer.

A task has ``tokenizer``, ``requests`` (:class:`pask_jax.prompt.Prompt`: ``ids``, ``tags``,
``grammar``, ``case``),
``tracker(i)`` (a :class:`calibrate.stack.Recorder` with the structural-tag adapter and the shared
parser-state vocabulary) and ``score(i, text, complete) -> (passed, per_call)``.

* :class:`BFCLTask` — BFCL through :mod:`calibrate.bfcl` (official AST checker; incomplete or
  unparseable output fails).
* :class:`SyntheticTask` — tool calls with enumerated arguments for CPU tests.  Its oracle is
  exact: a case passes iff the decoded calls equal the expected calls (name and every argument).
  The expected calls are *given* (``expected=``) or fixed once from a reference generation
  (:meth:`SyntheticTask.fix_oracle`), so the task is "reproduce the full-precision answer".
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from pask_jax.grammar.frontier import StateVocab
from pask_jax.prompt import Prompt


class _Base:
  tokenizer: Any
  requests: list[Prompt]
  vocab: StateVocab

  def tracker(self, i: int):
    from calibrate.stack import Recorder
    from pask_jax.grammar.fc_adapter import FCAdapter
    g = self.requests[i].grammar
    return Recorder(g, FCAdapter(g, self.tokenizer, vocab=self.vocab))

  def subset(self, idx: Sequence[int]):
    """The same task over ``requests[idx]`` (shares the state vocabulary)."""
    t = object.__new__(type(self))
    t.__dict__.update(self.__dict__)
    t.requests = [self.requests[i] for i in idx]
    if hasattr(self, "expected"):
      t.expected = [self.expected[i] for i in idx]
    return t


class BFCLTask(_Base):
  """BFCL cases (one split) for one model: rendered, tokenized, labeled, with grammars."""

  def __init__(self, cases, tokenizer, *, arch: str, compiler, vocab: StateVocab | None = None):
    from calibrate import bfcl
    self.tokenizer, self.arch = tokenizer, arch
    self.fmt = bfcl.style_for(arch)[0]
    self.vocab = vocab if vocab is not None else StateVocab(grow=True)
    self.requests = bfcl.prepare(cases, tokenizer, arch=arch, compiler=compiler,
                                 prompt_labels=True)

  def score(self, i: int, text: str, complete: bool) -> tuple[bool, float]:
    from calibrate import bfcl
    s = bfcl.score(self.requests[i].case, text, complete=complete, fmt=self.fmt)
    return bool(s["passed"]), float(s["per_call"])

  def category(self, i: int) -> str:
    return self.requests[i].case.category


MODES = ("eco", "boost", "quiet", "sport", "auto", "manual")
LEVELS = ("low", "mid", "high", "max")


class SyntheticTask(_Base):
  """``n`` requests to call ``set_mode(mode, level)`` (both enums) in the JSON-list format."""

  def __init__(self, tokenizer, compiler, n: int, *, seed: int = 0,
               expected: Sequence[list[dict]] | None = None, vocab: StateVocab | None = None):
    from pask_jax.grammar.toolcall import tool_call_grammar, tools_system_prompt
    from pask_jax.prompt import encode, render
    rng = np.random.default_rng(seed)
    self.tokenizer, self.fmt = tokenizer, "json_list"
    self.vocab = vocab if vocab is not None else StateVocab(grow=True)
    tools = [{"type": "function", "function": {
        "name": "set_mode", "description": "Set the vehicle drive mode and assist level.",
        "parameters": {"type": "object", "properties": {
            "mode": {"type": "string", "enum": list(MODES)},
            "level": {"type": "string", "enum": list(LEVELS)}},
            "required": ["mode", "level"]}}}]
    grammar = tool_call_grammar(compiler, tools, self.fmt, max_calls=1)
    system = tools_system_prompt(tools, self.fmt)
    self.requests = []
    for _ in range(n):
      m, l = MODES[rng.integers(len(MODES))], LEVELS[rng.integers(len(LEVELS))]
      words = " ".join(rng.choice(["please", "now", "quickly", "for the trip", "today"], 2))
      msgs = [{"role": "system", "content": system},
              {"role": "user", "content": f"Switch to {m} mode with {l} assist {words}."}]
      # The tools are described in the system message whatever the template reads.
      text = render(tokenizer, msgs)
      ids, tags = encode(tokenizer, text, labels=True)
      self.requests.append(Prompt(text, ids, tags, grammar, tools, self.fmt,
                                  {"mode": m, "level": l}))
    self.expected = list(expected) if expected is not None else [None] * n

  @staticmethod
  def calls(text: str) -> list[dict] | None:
    from pask_jax.grammar.toolcall import parse_calls
    try:
      return parse_calls(text, "json_list")
    except Exception:
      return None

  def fix_oracle(self, texts: Sequence[str]) -> None:
    """Set the expected calls from complete reference outputs (one text per request)."""
    exp = [self.calls(t) for t in texts]
    bad = [i for i, e in enumerate(exp) if e is None]
    if bad:
      raise ValueError(f"reference outputs {bad} hold no complete call (raise max_tokens)")
    self.expected = exp

  def score(self, i: int, text: str, complete: bool) -> tuple[bool, float]:
    want = self.expected[i]
    if want is None:
      raise RuntimeError("SyntheticTask has no oracle yet: pass expected= or call fix_oracle()")
    got = self.calls(text) if complete else None
    ok = got is not None and json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    return ok, float(ok)

  def category(self, i: int) -> str:
    return "synthetic"
