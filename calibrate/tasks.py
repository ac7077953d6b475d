"""Task oracles for calibration: prepared requests, a tracker per request, and a scorer.

:class:`Task` is the protocol :class:`calibrate.alg1.Calibration` and
:func:`calibrate.stack.run_stack` use: the prepared requests (:class:`pask_jax.prompt.Prompt`), a
grammar tracker per request that records the structural tags, and a scorer.  Three tasks
implement it:

* :class:`BFCLTask` — BFCL through :mod:`calibrate.bfcl` (official AST checker; incomplete or
  unparseable output fails).
* :class:`JsonlTask` — a user's task from a JSONL file (:func:`read_jsonl`, format below): tool
  calls checked against the expected calls, or JSON under a schema checked against an expected
  value or for validity.  ``pask-jax calibrate --task jsonl --data FILE`` runs Alg. 1 on it.
* :class:`SyntheticTask` — tool calls with enumerated arguments for CPU tests.  Its oracle is
  exact: a case passes iff the decoded calls equal the expected calls (name and every argument).
  The expected calls are *given* (``expected=``) or fixed once from a reference generation
  (:meth:`SyntheticTask.fix_oracle`), so the task is "reproduce the full-precision answer".

JSONL task file: one JSON object per line (blank lines are skipped), with these keys:

* ``messages`` (required): the conversation, OpenAI-style ``[{"role": ..., "content": ...}]``.
* exactly one of ``tools`` (OpenAI-style tools, or bare ``{"name", "parameters"}`` dicts: the
  answer is one to :data:`calibrate.bfcl.MAX_CALLS` calls, as the server's ``tool_choice
  "required"``) or ``schema`` (a JSON schema: the answer is JSON under it, as the server's
  ``response_format`` ``json_schema``).
* ``expected``: with ``tools``, the calls ``[{"name": ..., "arguments": {...}}, ...]``; with
  ``schema``, the JSON value.  Or ``"scorer": "json_valid"`` instead: any complete answer that
  parses and satisfies the schema (each call: a declared tool, arguments valid under its
  parameters) passes.  ``"scorer": "exact"`` (the default) needs ``expected``.
* ``id`` (optional, unique; default: the line number) and ``category`` (optional; default
  ``tools`` or ``schema``): the case's name in the saved stages, and the strata of the split
  (:func:`split_jsonl`) and of ``--max-cases``.

"exact" compares after JSON normalisation (:func:`canonical`: key order, and ``1.0`` vs ``1``, do
not matter; ``true`` vs ``1`` does), as BFCL's AST checker does for one acceptable value per
argument: calls are matched as a multiset (their order does not matter, as BFCL's parallel
categories), the case passes iff the produced calls are exactly the expected ones, and the
per-call fraction is the expected calls matched.  An omitted optional argument differs from one
given with its default value: write the calls a correct answer contains.  A bad line is a
``ValueError`` naming the file, the line and the problem.
"""
from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from pask_jax.grammar.frontier import StateVocab
from pask_jax.prompt import Prompt


@runtime_checkable
class Task(Protocol):
  """What calibration needs of a task (:class:`calibrate.alg1.Calibration` takes one for the
  calibration split and one for the development split; they share one ``vocab``).  A structural
  protocol: a class of your own needs no base class, only these members.  Optionally also
  ``expected``: a JSON-able oracle answer per request, hashed into the saved stages' fingerprint
  so that stages scored under another oracle are not resumed (:meth:`subset` must keep it
  aligned)."""

  tokenizer: Any
  """The model's tokenizer (decodes the generated tokens; ``stop_ids`` end a row)."""
  vocab: StateVocab
  """The parser-state vocabulary of the reserve Γ, grown as the trackers meet new states."""
  requests: list[Prompt]
  """The prepared requests: ``ids``, prompt-span ``tags`` (int32[len(ids), 4], for the PASK
  prefill plan: required, ``pask_jax.prompt.encode(..., labels=True)``), the ``grammar`` of the
  answer, and ``case`` (what :meth:`score` reads; its
  ``id`` and ``category``, when it has them, name it in the saved stages' fingerprint)."""

  def tracker(self, i: int) -> Any:
    """A fresh :class:`calibrate.stack.Recorder` for request ``i``: its grammar's matcher and
    the structural-tag adapter the policy will be served with (tool calls: ``FCAdapter`` with
    ``vocab``; no adapter: every token free generation, as the server tags JSON-schema
    answers)."""
    ...

  def score(self, i: int, text: str, complete: bool) -> tuple[bool, float]:
    """(passed, per-call fraction in [0, 1]) of request ``i``'s decoded ``text``;
    ``complete`` is False when the row stopped at ``max_tokens`` before the grammar accepted
    a stop (such an answer should fail).  Deterministic: Alg. 1 compares it across policies."""
    ...

  def category(self, i: int) -> str:
    """Request ``i``'s category (counted in the stages' fingerprint)."""
    ...

  def subset(self, idx: Sequence[int]) -> "Task":
    """The same task over ``requests[idx]`` sharing ``vocab`` (``calibrate --speedup``)."""
    ...


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


# --- a user's task from a JSONL file ------------------------------------------------------------

SCORERS = ("exact", "json_valid")
_KEYS = {"messages", "tools", "schema", "expected", "scorer", "id", "category"}


@dataclasses.dataclass
class JsonlCase:
  """One line of a JSONL task file, checked (see the module docstring)."""
  id: str
  category: str
  messages: list[dict]
  tools: list[dict] | None    # OpenAI-style tools (a tool-calling case), or None
  schema: Any                 # the answer's JSON schema (a structured-output case), or None
  expected: Any               # the expected calls or JSON value; None with scorer json_valid
  scorer: str                 # one of SCORERS
  key: str                    # the tool set's normalized key, or the schema's canonical JSON
  where: str                  # "FILE, line N" (for errors found later, e.g. compiling)


def canonical(v: Any) -> str:
  """A JSON value as canonical text: sorted keys, integral floats as integers (``1.0 == 1``),
  booleans kept apart from numbers."""
  def norm(x):
    if isinstance(x, float) and x.is_integer():
      return int(x)
    if isinstance(x, dict):
      return {k: norm(y) for k, y in x.items()}
    if isinstance(x, list):
      return [norm(y) for y in x]
    return x
  return json.dumps(norm(v), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _one_line(e: BaseException) -> str:
  return " ".join(str(e).split()) or type(e).__name__


def _invalid(value: Any, schema: Any) -> str | None:
  """The first reason ``value`` fails ``schema`` (one line), or None when it satisfies it."""
  import jsonschema
  cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
  err = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
  if err is None:
    return None
  at = "".join(f"/{p}" for p in err.absolute_path)
  return f"{err.message}" + (f" (at #{at})" if at else "")


def _check_line(obj: Any, n: int, where: str) -> JsonlCase:
  """One parsed line -> a JsonlCase; ValueError (without the location) naming the problem."""
  from calibrate.bfcl import MAX_CALLS, schema_key
  from pask_jax.grammar import normalize_tools, prepare_schema
  if not isinstance(obj, dict):
    raise ValueError(f"a case must be a JSON object, got {type(obj).__name__}")
  extra = sorted(set(obj) - _KEYS)
  if extra:
    raise ValueError(f"unknown key(s) {', '.join(map(repr, extra))}; a case has "
                     f"{', '.join(sorted(_KEYS))}")
  msgs = obj.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise ValueError("'messages' must be a non-empty list of messages")
  for j, m in enumerate(msgs):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise ValueError(f"messages[{j}] must be an object with a string 'role'")
    if not isinstance(m.get("content", ""), str):
      raise ValueError(f"messages[{j}].content must be a string")
  if ("tools" in obj) == ("schema" in obj):
    raise ValueError("a case needs exactly one of 'tools' (tool calls) and 'schema' (JSON)")
  scorer = obj.get("scorer", "exact")
  if scorer not in SCORERS:
    raise ValueError(f"unknown scorer {scorer!r}; choose from {', '.join(SCORERS)}")
  has = "expected" in obj
  if scorer == "exact" and not has:
    raise ValueError("a case needs 'expected' (or \"scorer\": \"json_valid\")")
  if scorer == "json_valid" and has:
    raise ValueError("scorer json_valid takes no 'expected' (drop one of them)")
  exp = obj.get("expected")
  tools, schema = None, None
  if "tools" in obj:
    try:
      fns = normalize_tools(obj["tools"])   # shape, names and every parameters schema
    except ValueError as e:
      raise ValueError(_one_line(e)) from None
    # Stored OpenAI-style with the parameters as written: the prompt shows them as the server
    # would (the grammar checks them again when it is compiled).
    tools = [{"type": "function", "function": {
        "name": f["name"], "description": f["description"],
        "parameters": t.get("function", t).get("parameters") or f["parameters"]}}
             for t, f in zip(obj["tools"], fns)]
    key = schema_key(tools)
    if has:
      if not isinstance(exp, list) or not exp:
        raise ValueError("'expected' must be a non-empty list of calls "
                         "[{\"name\": ..., \"arguments\": {...}}]")
      if len(exp) > MAX_CALLS:
        raise ValueError(f"'expected' holds {len(exp)} calls; an answer holds at most "
                         f"{MAX_CALLS}")
      params = {f["name"]: f["parameters"] for f in fns}
      for j, c in enumerate(exp):
        if not isinstance(c, dict) or set(c) != {"name", "arguments"}:
          raise ValueError(f"expected[{j}] must be {{\"name\": ..., \"arguments\": {{...}}}}")
        if c["name"] not in params:
          raise ValueError(f"expected[{j}] calls {c['name']!r}, which is not among the tools "
                           f"({', '.join(params)})")
        if not isinstance(c["arguments"], dict):
          raise ValueError(f"expected[{j}].arguments must be a JSON object")
        why = _invalid(c["arguments"], params[c["name"]])
        if why:
          raise ValueError(f"expected[{j}].arguments do not satisfy {c['name']!r}'s "
                           f"parameters: {why}")
  else:
    schema = obj["schema"]
    try:
      prepare_schema(schema, "schema")   # refused unless XGrammar enforces it exactly
    except ValueError as e:
      raise ValueError(_one_line(e)) from None
    key = canonical(schema)
    if has:
      why = _invalid(exp, schema)
      if why:
        raise ValueError(f"'expected' does not satisfy the schema: {why}")
  cid = obj.get("id", str(n))
  if not isinstance(cid, (str, int)) or isinstance(cid, bool) or cid == "":
    raise ValueError("'id' must be a non-empty string or an integer")
  cat = obj.get("category", "tools" if tools is not None else "schema")
  if not isinstance(cat, str) or not cat:
    raise ValueError("'category' must be a non-empty string")
  return JsonlCase(str(cid), cat, msgs, tools, schema, exp, scorer, key, where)


def read_jsonl(path: str) -> list[JsonlCase]:
  """The checked cases of a JSONL task file (format: module docstring); a ValueError
  ``"FILE, line N: problem"`` for the first bad line, ``"FILE: problem"`` for the file."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: cannot read the task file: "
                     f"{getattr(e, 'strerror', None) or _one_line(e)}") from None
  out: list[JsonlCase] = []
  seen: dict[str, int] = {}
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    where = f"{path}, line {n}"
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None
    try:
      case = _check_line(obj, n, where)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
    if case.id in seen:
      raise ValueError(f"{where}: id {case.id!r} repeats line {seen[case.id]}")
    seen[case.id] = n
    out.append(case)
  if not out:
    raise ValueError(f"{path}: no cases (one JSON object per line)")
  return out


def split_jsonl(cases: Sequence[JsonlCase], seed: int = 0, max_cases: int | None = None
                ) -> tuple[list[JsonlCase], list[JsonlCase]]:
  """(calibration, development): per category, the cases in a seeded random order dealt
  alternately to the two (BFCL's 1:1 between them; the deal continues across categories, so
  the two differ by at most one case in all and in each category); each in file order, at most
  ``max_cases`` per category (the first in file order, as ``--max-cases`` on BFCL).

  Unlike BFCL's split, cases sharing a tool set are not kept in one partition: a user's task
  usually has one tool set, and the file holds no test share (keep test cases in another
  file)."""
  if len(cases) < 2:
    raise ValueError(f"{len(cases)} case(s): calibration and development need at least 2")
  rng = np.random.default_rng(seed)
  by: dict[str, list[int]] = {}
  for i, c in enumerate(cases):
    by.setdefault(c.category, []).append(i)
  side, parts = 0, ([], [])
  for idx in by.values():
    for j in rng.permutation(len(idx)):
      parts[side].append(idx[j])
      side ^= 1

  def pick(ix: list[int]) -> list[JsonlCase]:
    seen: collections.Counter = collections.Counter()
    out = []
    for i in sorted(ix):
      seen[cases[i].category] += 1
      if max_cases is None or seen[cases[i].category] <= max_cases:
        out.append(cases[i])
    return out

  return pick(parts[0]), pick(parts[1])


class JsonlTask(_Base):
  """Cases of :func:`read_jsonl` for one model: rendered with the chat template (tools described
  in a system message when the template ignores them, as the server does), tokenized, labeled,
  with their grammars (tool calls in the family's format, :func:`pask_jax.prompt.style`)."""

  def __init__(self, cases: Sequence[JsonlCase], tokenizer, *, arch: str, compiler,
               vocab: StateVocab | None = None):
    from calibrate.bfcl import Grammars
    from pask_jax.prompt import encode, render, style
    self.tokenizer, self.arch = tokenizer, arch
    self.fmt, indent = style(arch)
    self.vocab = vocab if vocab is not None else StateVocab(grow=True)
    calls = Grammars(compiler, self.fmt, indent)
    schemas: dict[str, Any] = {}
    self.requests = []
    for c in cases:
      try:
        if c.tools is not None:
          g = calls(c)
        else:
          g = schemas.get(c.key)
          if g is None:
            g = schemas[c.key] = compiler.json_schema(c.schema, "schema")
        text = render(tokenizer, c.messages, tools=c.tools, fmt=self.fmt)
      except Exception as e:   # noqa: BLE001 — a template may raise on odd role orders
        raise ValueError(f"{c.where}: {_one_line(e)}") from None
      ids, tags = encode(tokenizer, text, labels=True)
      self.requests.append(Prompt(text, ids, tags, g, c.tools, self.fmt if c.tools else None, c))
    # The oracle, for the stages' fingerprint (a changed answer must not resume old stages).
    self.expected = [{"scorer": c.scorer, "expected": c.expected} for c in cases]

  def tracker(self, i: int):
    if self.requests[i].tools:
      return super().tracker(i)
    from calibrate.stack import Recorder
    return Recorder(self.requests[i].grammar, None)

  def score(self, i: int, text: str, complete: bool) -> tuple[bool, float]:
    s = check_answer(self.requests[i].case, text, complete, self.fmt)
    return s["passed"], s["per_call"]

  def category(self, i: int) -> str:
    return self.requests[i].case.category


def check_answer(case: JsonlCase, text: str, complete: bool, fmt: str | None = None) -> dict:
  """One answer to a JSONL case scored (module docstring): ``{"calls", "passed", "per_call",
  "error"}`` as BFCL's scorer returns it (``calls``: the parsed calls, or the JSON value of a
  schema case; None when unreadable).  An incomplete answer fails."""
  if not complete:
    return {"calls": None, "passed": False, "per_call": 0.0, "error": "incomplete output"}
  if case.tools is not None:
    from pask_jax.grammar.toolcall import parse_calls
    try:
      got = parse_calls(text, fmt)
    except ValueError as e:
      return {"calls": None, "passed": False, "per_call": 0.0,
              "error": f"unparseable: {_one_line(e)}"}
    ok, frac = score_calls(case, text, fmt)
  else:
    try:
      got = json.loads(text)
    except json.JSONDecodeError as e:
      return {"calls": None, "passed": False, "per_call": 0.0, "error": f"unparseable: {e.msg}"}
    ok = (_invalid(got, case.schema) is None if case.scorer == "json_valid"
          else canonical(got) == canonical(case.expected))
    frac = float(ok)
  return {"calls": got, "passed": bool(ok), "per_call": float(frac),
          "error": "" if ok else f"{'invalid' if case.scorer == 'json_valid' else 'differs'}"}


def score_calls(case: JsonlCase, text: str, fmt: str | None = None) -> tuple[bool, float]:
  """(passed, per-call fraction) of a tool-call answer (module docstring): ``exact`` — the calls
  equal the expected ones as a multiset after :func:`canonical`, the fraction the expected calls
  matched; ``json_valid`` — every call names a tool and satisfies its parameters."""
  from pask_jax.grammar.toolcall import parse_calls
  try:
    got = parse_calls(text, fmt)
  except ValueError:
    return False, 0.0
  if case.scorer == "json_valid":
    params = {t["function"]["name"]: t["function"]["parameters"] for t in case.tools}
    ok = all(c["name"] in params and _invalid(c["arguments"], params[c["name"]]) is None
             for c in got)
    return ok, float(ok)
  have = collections.Counter(canonical([c["name"], c["arguments"]]) for c in got)
  want = collections.Counter(canonical([c["name"], c["arguments"]]) for c in case.expected)
  return have == want, sum((have & want).values()) / len(case.expected)
