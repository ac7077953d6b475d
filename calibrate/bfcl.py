"""BFCL (Berkeley Function Calling Leaderboard) as a task oracle: data, split, prompts, scoring.

Everything runs offline from the ``bfcl-eval==2026.3.23`` wheel (installed ``--no-deps``):

* **Data** — ``bfcl_eval/data/BFCL_v4_<category>.json`` (JSON lines: ``id``, ``question`` = turns
  of messages, ``function`` = BFCL function docs) joined by ``id`` with
  ``data/possible_answer/BFCL_v4_<category>.json`` (``ground_truth``).  Python categories only:
  :data:`NONLIVE` (simple_python, multiple, parallel, parallel_multiple) and :data:`LIVE`.
* **Split (paper C.1)** — see :func:`assign_splits`.  Seeded 1:1:3 calibration/development/test
  inside each category; a normalized tool-call schema (the case's function set as JSON-schema
  tools, sorted by name, serialized with sorted keys) lies in one partition only.  The rule is
  applied over a whole *family* (all four non-live categories together, or all four live ones),
  so a function set shared by two categories (76 between simple_python and parallel, 40 between
  multiple and parallel_multiple) is in one partition in both; and a case's partition depends only
  on (seed, family), never on which categories a caller loads.
* **Tools** — :func:`to_tools` maps BFCL docs to JSON schema with BFCL's own
  ``GORILLA_TO_OPENAPI`` type table (dict→object, float→number, tuple→array, any→string, ...),
  recursively through ``properties`` and ``items``; enums, required, descriptions and defaults
  stay; BFCL's non-schema ``optional`` flag is dropped.  Names keep their dots (the checker's
  stand-in config has ``underscore_to_dot=False``).  Descriptions are not rewritten (BFCL's
  handlers append "This is a float type value." and a Python-syntax note; we do not).
* **Prompt** — the case's messages (all turns) through :func:`pask_jax.prompt.render`: the
  model's chat template with ``tools=`` when the template uses tools, else a system message from
  :func:`~pask_jax.grammar.toolcall.tools_system_prompt` (merged into the case's own system
  message when it has one).  The grammar is :func:`~pask_jax.grammar.toolcall.tool_call_grammar`
  in the family's :data:`~pask_jax.grammar.toolcall.DEFAULT_STYLE` with up to
  :data:`MAX_CALLS` calls, the same for every category (the category is not leaked).
* **Scoring** — the official ``ast_checker`` module, unmodified; only
  ``bfcl_eval.constants.model_config`` (which imports every API SDK) is replaced in
  ``sys.modules`` by a one-entry stand-in.  Output that is incomplete (cut at ``max_tokens``
  before the grammar accepted a stop) or unparseable fails, with per-call fraction 0.
  Per-call fraction: expected calls matched one-to-one (maximum bipartite matching) by produced
  calls, each pair judged by the checker's ``simple_function_checker``; extra produced calls do
  not lower it (the case-level pass covers them).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import types
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from pask_jax.prompt import Prompt

NONLIVE = ("simple_python", "multiple", "parallel", "parallel_multiple")
LIVE = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
FAMILIES = (NONLIVE, LIVE)
SPLITS = ("calibration", "development", "test")
RATIO = (1, 1, 3)
MAX_CALLS = 8
MODEL_NAME = "pask-jax"  # the stand-in config's one entry (the checker looks names up by model)

# BFCL's own table (bfcl_eval.constants.type_mappings.GORILLA_TO_OPENAPI), Python subset, copied
# so that converting tools does not import bfcl_eval; a test checks it against the wheel's.
TYPE_MAP = {"integer": "integer", "number": "number", "float": "number", "string": "string",
            "boolean": "boolean", "bool": "boolean", "array": "array", "list": "array",
            "dict": "object", "object": "object", "tuple": "array", "any": "string"}
# JSON-schema keys kept from a BFCL parameter doc (everything else, e.g. ``optional``, is BFCL's).
_KEEP = {"description", "enum", "default", "items", "properties", "required", "maximum", "minimum",
         "title"}


@dataclasses.dataclass
class Case:
  id: str
  category: str
  messages: list[dict]     # every turn's messages, in order
  functions: list[dict]    # BFCL's docs as shipped (the checker reads these)
  tools: list[dict]        # OpenAI-style JSON-schema tools (prompt and grammar)
  answer: list[dict]       # ground_truth: [{fn: {arg: [acceptable values]}}]
  key: str                 # normalized tool-call schema (see module docstring)
  split: str = ""


@dataclasses.dataclass
class Record:
  id: str
  category: str
  split: str
  text: str
  tokens: int
  prompt_len: int
  finish: str
  calls: list[dict] | None  # BFCL form [{fn: {arg: val}}]; None if incomplete/unparseable
  passed: bool
  per_call: float
  error: str
  prefill_s: float
  decode_s: float
  ledger: dict | None = None

  def asdict(self) -> dict:
    return dataclasses.asdict(self)


# --- data ----------------------------------------------------------------------------------------

# bfcl-eval pins numpy==1.26.4, which jax does not accept, so no pyproject extra can install it;
# scripts/setup.sh installs it --no-deps (its checker and data need nothing beyond the stdlib).
INSTALL = "pip install --no-deps bfcl-eval==2026.3.23"


class BFCLMissing(ImportError):
  """bfcl-eval (the BFCL data and the official checker) is not installed."""


def require() -> str:
  """The installed bfcl_eval package directory, or a one-line error naming the install command
  (called before any model work by ``pask-jax eval``, ``tune`` and ``calibrate``)."""
  spec = importlib.util.find_spec("bfcl_eval")
  if spec is None or not spec.submodule_search_locations:
    raise BFCLMissing(f"the BFCL task needs bfcl-eval, which is not installed: run `{INSTALL}` "
                      "(--no-deps: its numpy pin conflicts with jax; scripts/setup.sh does this)")
  return list(spec.submodule_search_locations)[0]


def need() -> None:
  """:func:`require` for a command line: a missing install becomes a one-line exit."""
  try:
    require()
  except BFCLMissing as e:
    raise SystemExit(f"error: {e}")


def data_dir() -> str:
  """``bfcl_eval/data`` of the installed wheel (located, not imported)."""
  return os.path.join(require(), "data")


def _lines(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]


def _convert(p: dict) -> dict:
  """One BFCL parameter doc -> JSON schema (types via TYPE_MAP; unknown types -> string, as
  BFCL)."""
  t = p.get("type", "string")
  out = {"type": TYPE_MAP.get(t, "string") if isinstance(t, str) else "string"}
  out.update((k, v) for k, v in p.items() if k in _KEEP)
  if "properties" in p:
    out["properties"] = {k: _convert(v) for k, v in p["properties"].items()}
    # A `required` entry naming no property would make the schema unsatisfiable; BFCL 2026.3.23
    # has none, but guard so one bad doc cannot abort a run.
    out["required"] = [r for r in p.get("required", []) if r in out["properties"]]
  elif out["type"] == "object":
    # A dict with no declared fields (20 in BFCL) takes any fields: said explicitly so a strict
    # reading cannot shrink it to {} (XGrammar 0.2.9 already reads a bare object as any object).
    out["additionalProperties"] = True
  if isinstance(p.get("items"), dict):
    out["items"] = _convert(p["items"])
  if "required" in out and "properties" not in out:
    del out["required"]
  return out


def to_tools(functions: Sequence[dict]) -> list[dict]:
  """BFCL function docs -> OpenAI-style tools ``{"type": "function", "function": {...}}``."""
  tools = []
  for f in functions:
    params = _convert({**f.get("parameters", {}), "type": "dict"})
    params.pop("description", None)
    tools.append({"type": "function", "function": {
        "name": f["name"], "description": f.get("description", ""), "parameters": params}})
  return tools


def schema_key(tools: Sequence[dict]) -> str:
  """The normalized tool-call schema: the tool set sorted by name, canonical JSON."""
  fs = sorted((t["function"] for t in tools), key=lambda f: f["name"])
  return json.dumps(fs, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@functools.lru_cache(maxsize=None)
def _read(category: str) -> tuple[Case, ...]:
  d = data_dir()
  rows = _lines(os.path.join(d, f"BFCL_v4_{category}.json"))
  ans = {a["id"]: a["ground_truth"] for a in
         _lines(os.path.join(d, "possible_answer", f"BFCL_v4_{category}.json"))}
  out = []
  for r in rows:
    tools = to_tools(r["function"])
    out.append(Case(r["id"], category, [m for turn in r["question"] for m in turn], r["function"],
                    tools, ans[r["id"]], schema_key(tools)))
  return tuple(out)


def _family(category: str) -> tuple[str, ...]:
  for fam in FAMILIES:
    if category in fam:
      return fam
  raise ValueError(f"unsupported BFCL category {category!r}; choose from {NONLIVE + LIVE}")


def targets(n: int) -> tuple[int, int, int]:
  """Per-category partition sizes: round(n/5) calibration and development, the rest test."""
  a = round(n * RATIO[0] / sum(RATIO))
  b = round(n * RATIO[1] / sum(RATIO))
  return a, b, n - a - b


def assign_splits(cases: Sequence[Case], seed: int = 0) -> dict[str, str]:
  """Case id -> partition, deterministic in (seed, the case set).

  Rule: group cases by :attr:`Case.key` across all given categories.  Visit groups largest first
  (so big groups still fit), ties in the order of ``sha256(f"{seed}:{key}")``.  For each group,
  the partitions where every category of the group still has room for its cases are candidates;
  one is drawn with ``numpy.random.default_rng(seed)`` with probability proportional to the
  group's remaining room there (summed over its categories).  If none fits, the partition with the
  most room takes it.  For singleton groups this is sampling without replacement, i.e. a uniform
  random 1:1:3 split with exact sizes; the per-category sizes are :func:`targets`.
  """
  room: dict[str, list[int]] = {}
  for c in cases:
    room.setdefault(c.category, [0, 0, 0])
  for cat in room:
    room[cat] = list(targets(sum(1 for c in cases if c.category == cat)))
  groups: dict[str, list[Case]] = {}
  for c in cases:
    groups.setdefault(c.key, []).append(c)
  h = lambda k: hashlib.sha256(f"{seed}:{k}".encode()).hexdigest()
  order = sorted(groups, key=lambda k: (-len(groups[k]), h(k)))
  rng = np.random.default_rng(seed)
  out = {}
  for k in order:
    need: dict[str, int] = {}
    for c in groups[k]:
      need[c.category] = need.get(c.category, 0) + 1
    w = np.array([sum(room[cat][p] for cat in need) if all(room[cat][p] >= n for cat, n in
                                                             need.items()) else 0
                  for p in range(3)], np.float64)
    if w.sum() > 0:
      p = int(rng.choice(3, p=w / w.sum()))
    else:
      p = int(np.argmax([sum(room[cat][q] for cat in need) for q in range(3)]))
    for cat, n in need.items():
      room[cat][p] -= n
    for c in groups[k]:
      out[c.id] = SPLITS[p]
  return out


@functools.lru_cache(maxsize=None)
def _family_splits(family: tuple[str, ...], seed: int) -> dict[str, str]:
  return assign_splits([c for cat in family for c in _read(cat)], seed)


def load(categories: Iterable[str] = NONLIVE, *, split: str | Sequence[str] | None = None,
         seed: int = 0) -> list[Case]:
  """BFCL cases of ``categories`` (in file order) with their partition; optionally only
  ``split``."""
  require()   # before the cached readers: a missing install is named even after a cached read
  want = None if split is None else ({split} if isinstance(split, str) else set(split))
  if want is not None and not want <= set(SPLITS):
    raise ValueError(f"unknown split {want - set(SPLITS)}; choose from {SPLITS}")
  out = []
  for cat in categories:
    sp = _family_splits(_family(cat), seed)
    for c in _read(cat):
      c = dataclasses.replace(c, split=sp[c.id])
      if want is None or c.split in want:
        out.append(c)
  return out


# --- prompts and grammars ------------------------------------------------------------------------

def style_for(arch: str) -> tuple[str, int | None]:
  """(tool-call format, JSON indent) per model family (measured defaults; json_list otherwise)."""
  from pask_jax.prompt import style
  return style(arch)


def render(case: Case, tokenizer, fmt: str) -> str:
  """The prompt text: chat template with tools, or the tools system prompt (see module doc)."""
  from pask_jax.prompt import render as render_chat
  if not tokenizer.chat_template:
    raise ValueError("BFCL prompts need a chat template")
  return render_chat(tokenizer, case.messages, tools=case.tools, fmt=fmt, merge=True)


class Grammars:
  """Tool-call grammars per schema key, compiled once (cases sharing a tool set share one)."""

  def __init__(self, compiler, fmt: str, indent: int | None, max_calls: int = MAX_CALLS):
    self.compiler, self.fmt, self.indent, self.max_calls = compiler, fmt, indent, max_calls
    self.cache: dict[str, Any] = {}

  def __call__(self, case: Case):
    from pask_jax.grammar.toolcall import tool_call_grammar
    g = self.cache.get(case.key)
    if g is None:
      g = self.cache[case.key] = tool_call_grammar(self.compiler, case.tools, self.fmt,
                                                   max_calls=self.max_calls, indent=self.indent)
    return g


# --- scoring -------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def checker() -> types.ModuleType:
  """bfcl_eval's ``ast_checker`` module, imported offline (model_config replaced, see module
  doc)."""
  os.environ.setdefault("BFCL_PROJECT_ROOT", tempfile.mkdtemp(prefix="bfcl_root_"))
  name = "bfcl_eval.constants.model_config"
  if name not in sys.modules:
    stub = types.ModuleType(name)
    stub.__doc__ = "pask-jax stand-in: the checker only reads underscore_to_dot."
    stub.MODEL_CONFIG_MAPPING = {MODEL_NAME: types.SimpleNamespace(underscore_to_dot=False)}
    sys.modules[name] = stub
  require()
  try:
    from bfcl_eval.eval_checker.ast_eval import ast_checker
  except ImportError as e:   # a bfcl-eval whose checker now imports more than ours did
    raise BFCLMissing(f"bfcl-eval's AST checker cannot be imported ({e}); install the version "
                      f"this project pins: `{INSTALL}`") from None
  return ast_checker


def to_bfcl(calls: Sequence[dict]) -> list[dict]:
  """``[{"name", "arguments"}]`` (parse_calls) -> BFCL's ``[{name: {arg: val}}]``."""
  return [{c["name"]: dict(c["arguments"])} for c in calls]


def decode(text: str, fmt: str | None = None) -> list[dict]:
  """Model text -> BFCL form; ValueError when no call parses."""
  from pask_jax.grammar.toolcall import parse_calls
  return to_bfcl(parse_calls(text, fmt))


def _is_bfcl_form(calls) -> bool:
  return isinstance(calls, list) and bool(calls) and all(
      isinstance(c, dict) and len(c) == 1 and isinstance(next(iter(c.values())), dict)
      for c in calls)


def check(case: Case, calls: list[dict] | None) -> tuple[bool, str]:
  """(pass, error) from the official checker for the case's category."""
  if not _is_bfcl_form(calls):
    return False, "no tool call in BFCL form"
  ac = checker()
  r = ac.ast_checker(case.functions, calls, case.answer, ac.Language.PYTHON, case.category,
                     MODEL_NAME)
  return bool(r["valid"]), "" if r["valid"] else f"{r.get('error_type', '')}: {r.get('error')}"


def per_call(case: Case, calls: list[dict] | None) -> float:
  """Fraction of expected calls matched one-to-one by produced calls (see module doc)."""
  if not _is_bfcl_form(calls):
    return 0.0
  ac = checker()
  ok = []
  for exp in case.answer:
    desc = ac.find_description(case.functions, next(iter(exp)))
    ok.append([desc is not None and ac.simple_function_checker(
        desc, c, exp, ac.Language.PYTHON, MODEL_NAME)["valid"] for c in calls])
  return max_matching(ok) / len(case.answer)


def max_matching(ok: list[list[bool]]) -> int:
  """Maximum bipartite matching size (Kuhn's augmenting paths; a handful of calls per case)."""
  owner: dict[int, int] = {}

  def augment(i, seen):
    for j, good in enumerate(ok[i]):
      if good and j not in seen:
        seen.add(j)
        if j not in owner or augment(owner[j], seen):
          owner[j] = i
          return True
    return False

  return sum(augment(i, set()) for i in range(len(ok)))


def reference_calls(case: Case) -> list[dict]:
  """A correct answer built from the ground truth: each parameter's first acceptable value
  (inside dict values, whose fields list their own options, one level as the checker reads them);
  omittable ones ("" among the options) left out unless required.  For oracle self-checks and
  tests: it passes the checker on all 1,000 non-live cases (5 live ground truths omit a required
  parameter and cannot pass)."""
  def ref(v):
    if isinstance(v, dict):  # a dict value: field -> list of acceptable values
      return {k: o[0] for k, o in v.items() if o and o[0] != ""}  # one level, as dict_checker
    if isinstance(v, list):  # a list value (of plain values, or of dicts as above)
      return [ref(x) if isinstance(x, dict) else x for x in v]
    return v

  out = []
  for exp in case.answer:
    (fn, args), = exp.items()
    doc = next((f for f in case.functions if f["name"] == fn), {})
    req = set(doc.get("parameters", {}).get("required", []))
    call = {}
    for k, opts in args.items():
      vals = [o for o in opts if o != ""]
      # "" among the options marks an omittable parameter; a required one still needs a value.
      if vals and ("" not in opts or k in req):
        call[k] = ref(vals[0])
    out.append({fn: call})
  return out


def score(case: Case, text: str, *, complete: bool = True, fmt: str | None = None,
          tools: Sequence[dict] | None = None) -> dict:
  """Decode and check one output: {calls, passed, per_call, error, valid}; ``valid``: the
  output's calls parse and validate against the case's tool schemas, or ``tools``: the ones the
  prompt offered when they differ (W3's padded list) (:func:`pask_jax.grammar.call_problem`;
  what an unconstrained run is also scored by)."""
  if not complete:
    return {"calls": None, "passed": False, "per_call": 0.0, "error": "incomplete output",
            "valid": False}
  from pask_jax.grammar import call_problem
  valid = call_problem(list(case.tools if tools is None else tools), text) is None
  try:
    calls = decode(text, fmt)
  except ValueError as e:
    return {"calls": None, "passed": False, "per_call": 0.0, "error": f"unparseable: {e}",
            "valid": valid}
  ok, err = check(case, calls)
  return {"calls": calls, "passed": ok, "per_call": per_call(case, calls), "error": err,
          "valid": valid}


def summary(records: Sequence[Record]) -> dict[str, dict]:
  """Per category and overall: n, accuracy (instance-weighted), mean per-call fraction."""
  groups: dict[str, list[Record]] = {}
  for r in records:
    groups.setdefault(r.category, []).append(r)
  groups["overall"] = list(records)
  return {k: {"n": len(v), "accuracy": float(np.mean([r.passed for r in v])) if v else float("nan"),
              "per_call": float(np.mean([r.per_call for r in v])) if v else float("nan")}
          for k, v in groups.items()}


# --- generation ----------------------------------------------------------------------------------

def prepare(cases: Sequence[Case], tokenizer, *, arch: str, compiler=None, style=None,
            prompt_labels: bool = False, grammars: Grammars | None = None) -> list[Prompt]:
  """Render, tokenize and build grammars (``compiler=None`` and ``grammars=None``: unconstrained);
  each prompt carries its case.

  ``prompt_labels``: also compute PASK's prompt-span tags (§3.6) with ``label_prompt``.
  """
  from pask_jax.prompt import encode
  fmt, indent = style or style_for(arch)
  if grammars is None and compiler is not None:
    grammars = Grammars(compiler, fmt, indent)
  out = []
  for c in cases:
    text = render(c, tokenizer, fmt)
    ids, tags = encode(tokenizer, text, prompt_labels)
    out.append(Prompt(text, ids, tags, grammars(c) if grammars is not None else None, c.tools,
                      fmt, c))
  return out


def run_cases(runner, tokenizer, cases: Sequence[Case], *, batch: int | None = None,
              max_tokens: int = 160, compiler=None, style: tuple[str, int | None] | None = None,
              constrained: bool = True, tracker: Callable[[Any, Case], Any] | None = None,
              prompt_labels: bool | None = None, sampling=None, sort: bool = True,
              progress: Callable[[int, int], None] | None = None) -> list[Record]:
  """Generate for ``cases`` in batches with :func:`pask_jax.decode.generate` and score them.

  * ``runner``: a :class:`~pask_jax.decode.Runner` (Full KV) or
    :class:`~pask_jax.decode.PaskRunner`; its ``batch`` and ``capacity`` bound each call
    (``batch`` may be smaller; use :func:`capacity_needed` to size the runner).
  * ``constrained``: decode under the case's tool-call grammar (``compiler`` defaults to a
    :class:`~pask_jax.grammar.GrammarCompiler` for this tokenizer and the model's vocab).
  * ``tracker(grammar, case) -> Tracker``: per-request tracker; default a plain
    :class:`~pask_jax.tracker.Tracker` for Full KV, and for a PaskRunner one with an
    :class:`~pask_jax.grammar.fc_adapter.FCAdapter` (structural tags, §3.3), as the CLI does.
  * ``prompt_labels``: prompt-span tags for the PASK prefill plan (default: on for PaskRunner).
  * ``sampling``: a :class:`~pask_jax.decode.Sampling`; default greedy with ``max_tokens``.
  * ``sort``: batch cases of similar prompt length together (less padding); records come back
    in the input order either way.  Each request is decoded independently (its own mask and
    cache rows); only float rounding may differ with the padded batch shape.
  """
  from pask_jax.decode import PaskRunner, Sampling, generate
  from pask_jax.tracker import Tracker
  pask = isinstance(runner, PaskRunner)
  batch = min(batch or runner.batch, runner.batch)
  if prompt_labels is None:
    prompt_labels = pask
  if constrained and compiler is None:
    from pask_jax.grammar import GrammarCompiler
    compiler = GrammarCompiler(tokenizer, runner.cfg.vocab_size)
  fmt = (style or style_for(runner.cfg.arch))[0]
  if tracker is None:
    if pask and constrained:
      from pask_jax import policy as P
      from pask_jax.grammar.fc_adapter import FCAdapter
      vocab = P.state_vocab(runner.policy)       # parser-state ids of the calibrated reserve Γ
      tracker = lambda g, c: Tracker(g, FCAdapter(g, tokenizer, vocab=vocab))
    else:
      tracker = lambda g, c: Tracker(g)
  sampling = sampling or Sampling(max_tokens=max_tokens)
  preps = prepare(cases, tokenizer, arch=runner.cfg.arch,
                  compiler=compiler if constrained else None,
                  style=style, prompt_labels=prompt_labels)
  order = sorted(range(len(preps)), key=lambda i: len(preps[i].ids)) if sort else \
      list(range(len(preps)))
  recs: list[Record | None] = [None] * len(preps)
  for s in range(0, len(order), batch):
    idx = order[s:s + batch]
    ps = [preps[i] for i in idx]
    res = generate(runner, tokenizer, [p.ids for p in ps],
                   trackers=[tracker(p.grammar, p.case) for p in ps],
                   prompt_tags=[p.tags for p in ps] if prompt_labels else None,
                   sampling=sampling)
    for i, p, r in zip(idx, ps, res):
      sc = score(p.case, r.text, complete=r.finish == "stop", fmt=fmt)
      recs[i] = Record(p.case.id, p.case.category, p.case.split, r.text, len(r.tokens),
                       r.prompt_len, r.finish, sc["calls"], sc["passed"], sc["per_call"],
                       sc["error"], r.prefill_s, r.decode_s, r.ledger)
    if progress is not None:
      progress(min(s + batch, len(order)), len(order))
  return recs


def capacity_needed(cases: Sequence[Case], tokenizer, *, arch: str, max_tokens: int) -> int:
  """The cache capacity :func:`run_cases` needs for ``cases`` (longest prompt + ``max_tokens``)."""
  from pask_jax.decode import capacity_for
  fmt, _ = style_for(arch)
  longest = max(len(tokenizer.encode(render(c, tokenizer, fmt))) for c in cases)
  return capacity_for(longest, max_tokens)
