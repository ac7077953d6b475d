"""A resumable accuracy campaign: a plan of cells, run piece by piece, results kept per cell.

``pask-jax campaign PLAN.toml [--time-limit S] [--dry-run]`` walks the cells of a plan (model ×
method × budget × split slice), skips the cells whose results are already in the results folder,
runs (through :func:`calibrate.evaluate.run`, the evaluator of ``pask-jax eval``) those expected to
finish within the time given, and stops cleanly.  ``pask-jax report`` pools and tabulates the cells.

A plan (TOML; relative paths are relative to the current directory)::

    name = "qwen05-bfcl"            # results go to RESULTS/<name>/ (RESULTS: results/campaign)
    task = "bfcl"                   # bfcl, or a long-context workload w1 | w2 | w3 (below)
    seed = 0                        # the split seed (calibrate.bfcl.assign_splits, paper C.1)
    batch = 64                      # most sequences per generation batch (not in the cell key)
    max_tokens = 128
    case_seconds = 2.0              # time per case assumed before any cell of a model/method ran
    load_seconds = 60.0             # time to load a model, likewise

    [models]
    qwen05 = "qwen2.5-coder-0.5b-instruct"          # registered name, GGUF file or HF directory
    # qwen05 = { model = "...", dtype = "bfloat16" }  # dtype: auto (default), float32, bfloat16

    [methods.full]                                   # the table name is the label
    [methods.h2o]
    budgets = [0.33, 0.5]
    knobs = "runs/tune/B{budget:.2f}/knobs.json"     # from pask-jax tune ({budget}, {model});
                                                     # or one file, or an inline table
    [methods.pask]
    budgets = [0.33, 0.5]
    policy = "policies/qwen2.5-coder-0.5b-instruct-bfcl/B{budget:.2f}"   # {budget}, {model}
    [methods.pask-demo]
    method = "pask"                                  # the method, when the label is not one
    policy = "demo"
    budgets = [0.5]

    [splits.test]
    split = "test"                  # cal | dev | test: the code's seeded 1:1:3 split
    categories = ["simple_python", "multiple"]   # default: the four non-live ones
    skip = 0                        # per category: leave out the first N (in file order)
    cases = 80                      # per category: at most N after those (default: all)
    chunk = 20                      # optional: one cell per 20 cases per category
    # ids = ["simple_python_3", ...]  # or exactly these cases (of the split)

The long-context workloads of Spherical KV (:mod:`calibrate.longctx`; docs/SPHERICAL_KV.md §4):
``task = "w1" | "w2" | "w3"`` with ``length`` (prompt / document tokens, as ``pask-jax eval
--length``) and, for W1, ``tail`` (scored tokens, default 1024), at the top (the default of every
split) or in a split entry, which may also name its own ``task``, ``max_tokens``, ``batch`` and
``case_seconds`` — so one plan holds every workload and length, each split entry one of them::

    [splits.w1-8k]
    task = "w1"
    length = 8192
    tail = 1024
    split = "test"
    chunk = 16                      # W1: 64 documents per split (§4), one category w1
    batch = 16
    case_seconds = 6.0
    [splits.w2-8k]
    task = "w2"                     # 300 prompts per hop and split; categories hop1, hop2
    length = 8192
    max_tokens = 24
    split = "test"
    cases = 300
    chunk = 50

W1 scores the last ``tail`` tokens (its cells' max_tokens is the tail); W2 is exact match, W3 the
AST checker on the unpadded case.  A workload's cases are named without a model (W1/W2
:class:`calibrate.longctx.Stub`, W3 the BFCL split of ``seed``) and built when the cell runs.

A generating split may sample instead of decoding greedily (§4's seeded trajectory
disagreement, G5)::

    [splits.w3-8k-sampled]
    task = "w3"
    length = 8192
    split = "test"
    cases = 50
    sampling = { temperature = 0.7, top_p = 0.95, seeds = [0, 1, 2] }   # one cell per seed

Its cells carry the sampling in their key (greedy cells keep theirs); the report gives them a
table of their own (one row per seed), compares each seed's run with Full KV's of the same seed,
and adds the seed disagreement of every method and budget beside Full KV's.

A cell is identified by the sha256 (first :data:`KEY_LEN` hex digits) of the canonical JSON of its
key material: the task, the model fingerprint (sha256 of the weights file, or of every file of a
checkpoint directory, computed once and cached by path, size and mtime) and dtype, the method, the
target budget, the settings that change its answers (max_tokens; the method's own knobs with the
generated-length estimate ĝ its budget matching uses; the policy's content digest,
:func:`pask_jax.policy.digest`: its tables and record, not its files), the split and the
case ids; for a workload the task is its name with the length (``w1:L8192:K1024``,
``w2:L8192``, ``w3:L8192``, :func:`calibrate.longctx.name_of`) and the seed is in the key too
(its documents, needles and padding follow it).  Labels, plan order, batch size and file paths
are not in it.  Its folder
``RESULTS/<plan name>/<key>/`` holds ``cell.json`` (the summary of ``pask-jax eval`` plus the key
material, n, accuracy, binomial standard error, measured B, timings, git commit, jax and devices)
and ``cases.jsonl`` (per case also the generated token ids, ``tokens``, for the stability
metrics of the report; cells written before hold texts only and still report).  A cell is
written in ``.partial-<key>/`` and renamed into place when complete, so an interrupted cell
leaves no ``cell.json`` and runs again next time.

``pask-jax report`` tabulates each (model, workload with its length, split) on its own, with its
quality metric (BFCL and W3: AST accuracy; W2: exact match; W1: NLL per token and perplexity)
beside the measured B, a quality-vs-measured-B plot, and — for the generating tasks — the
stability of every row against the Full-KV row of the same table
(:mod:`calibrate.stability`: length drift, trajectory disagreement, failure counts; for sampled
splits the seed disagreement too).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from typing import Any

from calibrate import evaluate as E
from calibrate import longctx as LC
from calibrate import stability as ST
from pask_jax.spherical import variants as SV

RESULTS = os.path.join("results", "campaign")
KEY_LEN = 16
CELL = "cell.json"
PARTIAL = ".partial-"
DTYPES = ("auto", "float32", "bfloat16")
# Budget-matched methods: their settings are solved from the target and the estimate ĝ.
MATCHED = ("streaming", "h2o", "snapkv", "mikv", "rocketkv")
_TOP = {"name", "task", "seed", "batch", "max_tokens", "case_seconds", "load_seconds", "models",
        "methods", "splits", "length", "tail"}
_METHOD = {"method", "budgets", "policy", "knobs"}
# The methods run under a PASK policy: PASK itself, and the Spherical KV hybrids that take its
# floor-H tags (rdr+tags) or its controller (pask+ada).
POLICY_METHODS = ("pask",) + SV.TAGGED
# Methods without a target budget: one cell at the nominal B = 1 (full, int4, and the
# fixed-rate Spherical KV ablations, whose rate is their tier's).
UNBUDGETED = ("full", "int4") + tuple(n for n, v in SV.VARIANTS.items() if v.plan == "fixed")
_SPLIT = {"split", "categories", "skip", "cases", "chunk", "ids", "task", "length", "tail",
          "max_tokens", "batch", "case_seconds", "sampling", "constrained"}
_SAMPLING = {"temperature", "top_p", "seeds"}
_MODEL = {"model", "dtype", "key_center"}


class PlanError(ValueError):
  """A plan that cannot run; the one-line message names the offending key."""


# --- the plan -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Model:
  label: str
  spec: str           # registered name, GGUF file or HF checkpoint directory
  dtype: str = "auto"
  key_center: bool = True   # models.center (part of the cell key: it changes INT4 answers)


@dataclasses.dataclass(frozen=True)
class Method:
  label: str
  method: str
  budgets: tuple[float, ...]
  policy: str | None = None         # POLICY_METHODS: a built-in name or a directory pattern
  knobs: str | dict | None = None    # a knobs file pattern or an inline knobs table


@dataclasses.dataclass(frozen=True)
class Split:
  label: str
  split: str
  categories: tuple[str, ...] | None = None
  skip: int = 0
  cases: int | None = None
  chunk: int | None = None
  ids: tuple[str, ...] | None = None
  task: str = "bfcl"             # bfcl | w1 | w2 | w3 (or a registered task)
  length: int | None = None      # w1-w3: prompt / document tokens
  tail: int | None = None        # w1: scored tokens
  max_tokens: int = 128          # w1: the tail
  batch: int = 64                # most sequences per generation batch (not in the key)
  case_seconds: float = 2.0      # per case, until a cell of this workload ran
  sampling: tuple | None = None  # (temperature, top_p, seeds): one cell per seed; None greedy
  constrained: bool = True       # bfcl / w3: False decodes without the tool-call grammar

  @property
  def workload(self) -> str:
    """The task with its length (the section of the report; part of the cell key)."""
    return self.task if self.task not in LC.TASKS else \
        LC.name_of(self.task, self.length, self.tail)


@dataclasses.dataclass(frozen=True)
class Plan:
  name: str
  path: str
  folder: str          # RESULTS/<name>
  task: str
  seed: int
  batch: int
  max_tokens: int
  case_seconds: float
  load_seconds: float
  models: tuple[Model, ...]
  methods: tuple[Method, ...]
  splits: tuple[Split, ...]


def _check_keys(table: dict, allowed: set, where: str) -> None:
  bad = sorted(set(table) - allowed)
  if bad:
    raise PlanError(f"{where}.{bad[0]}: unknown key; allowed: {', '.join(sorted(allowed))}")


def _get(table: dict, key: str, where: str, kind, default=None, ok=None, rule: str = ""):
  """``table[key]`` checked to be a ``kind`` (and ``ok``), or ``default`` when absent."""
  if key not in table:
    return default
  v = table[key]
  if kind is float and isinstance(v, int) and not isinstance(v, bool):
    v = float(v)
  if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool or (ok and not ok(v)):
    name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
    raise PlanError(f"{where}.{key}: expected {rule or name}, got {v!r}")
  return v


def _strings(table: dict, key: str, where: str) -> tuple[str, ...] | None:
  v = _get(table, key, where, list, ok=lambda x: x and all(isinstance(s, str) and s for s in x),
           rule="a non-empty list of strings")
  return None if v is None else tuple(v)


def load_plan(path: str, results: str | None = None) -> Plan:
  """Read and check a plan (one-line :class:`PlanError` naming the key for a bad one)."""
  from pask_jax.baselines import METHODS
  from pask_jax.baselines import budget as BU
  if not os.path.isfile(path):
    raise PlanError(f"plan file not found: {path}")
  try:
    with open(path, "rb") as f:
      t = tomllib.load(f)
  except tomllib.TOMLDecodeError as e:
    raise PlanError(f"{path} is not valid TOML: {e}") from None
  _check_keys(t, _TOP, "plan")
  stem = os.path.splitext(os.path.basename(path))[0]
  name = _get(t, "name", "plan", str, stem, ok=lambda s: re.fullmatch(r"[\w.+-]+", s),
              rule="a name of letters, digits, '.', '+', '-', '_'")
  task = _get(t, "task", "plan", str, "bfcl", ok=lambda s: s in TASKS,
              rule="one of " + ", ".join(TASKS))
  pos = lambda x: x >= 1
  seed = _get(t, "seed", "plan", int, 0)
  batch = _get(t, "batch", "plan", int, 64, ok=pos, rule="a positive integer")
  max_tokens = _get(t, "max_tokens", "plan", int, 128, ok=pos, rule="a positive integer")
  case_s = _get(t, "case_seconds", "plan", float, 2.0, ok=lambda x: x >= 0, rule="seconds >= 0")
  load_s = _get(t, "load_seconds", "plan", float, 60.0, ok=lambda x: x >= 0, rule="seconds >= 0")
  length = _get(t, "length", "plan", int, ok=lambda x: x >= 8, rule="an integer >= 8")
  tail = _get(t, "tail", "plan", int, ok=pos, rule="a positive integer")

  models = []
  for label, v in _get(t, "models", "plan", dict, {}).items():
    where = f"models.{label}"
    if isinstance(v, str):
      v = {"model": v}
    if not isinstance(v, dict):
      raise PlanError(f"{where}: expected a model name or path, or a table with model and dtype")
    _check_keys(v, _MODEL, where)
    spec = _get(v, "model", where, str, ok=bool, rule="a model name or path")
    if spec is None:
      raise PlanError(f"{where}.model: missing (a registered name, GGUF file or HF directory)")
    dtype = _get(v, "dtype", where, str, "auto", ok=lambda s: s in DTYPES,
                 rule="one of " + ", ".join(DTYPES))
    kc = _get(v, "key_center", where, bool, True)
    models.append(Model(label, spec, dtype, kc))
  if not models:
    raise PlanError("models: the plan has no models (add e.g. [models] m = "
                    "\"smollm2-135m-instruct\")")

  methods = []
  for label, v in _get(t, "methods", "plan", dict, {}).items():
    where = f"methods.{label}"
    if not isinstance(v, dict):
      raise PlanError(f"{where}: expected a table")
    _check_keys(v, _METHOD, where)
    m = _get(v, "method", where, str, label)
    if m not in METHODS:
      raise PlanError(f"{where}.method: unknown method {m!r}; choose from {', '.join(METHODS)}")
    budgets = _get(v, "budgets", where, list, None,
                   ok=lambda x: x and all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                          for b in x), rule="a non-empty list of numbers")
    if budgets is None:
      if m not in UNBUDGETED:
        raise PlanError(f"{where}.budgets: missing (method {m} needs target budgets in (0, 1])")
      budgets = [1.0]   # no target (full, int4, fixed-rate): one cell at the nominal B = 1
    if m == "full" and budgets != [1.0]:
      raise PlanError(f"{where}.budgets: method full has no budget (leave budgets out)")
    for b in budgets:
      try:
        BU.check_target(float(b))
      except ValueError as e:
        raise PlanError(f"{where}.budgets: {e}") from None
    policy = _get(v, "policy", where, str, ok=bool, rule="a policy name or directory")
    if m in POLICY_METHODS and policy is None:
      raise PlanError(f"{where}.policy: missing (method {m} needs a policy directory, or demo)")
    if m not in POLICY_METHODS and policy is not None:
      raise PlanError(f"{where}.policy: only methods {', '.join(POLICY_METHODS)} take a policy")
    knobs = _get(v, "knobs", where, (str, dict))
    methods.append(Method(label, m, tuple(float(b) for b in dict.fromkeys(budgets)), policy,
                          knobs))
  if not methods:
    raise PlanError("methods: the plan has no methods (add e.g. [methods.full])")

  splits = []
  for label, v in _get(t, "splits", "plan", dict, {}).items():
    where = f"splits.{label}"
    if not isinstance(v, dict):
      raise PlanError(f"{where}: expected a table")
    _check_keys(v, _SPLIT, where)
    sp = _get(v, "split", where, str, ok=lambda s: s in E.SPLIT_NAMES, rule="cal, dev or test")
    if sp is None:
      raise PlanError(f"{where}.split: missing (cal, dev or test)")
    ids = _strings(v, "ids", where)
    if ids is not None and ({"skip", "cases", "chunk"} & set(v)):
      raise PlanError(f"{where}.ids: give either ids or skip/cases/chunk, not both")
    wl = _workload(v, where, task, length, tail, max_tokens)
    splits.append(Split(label, sp, _strings(v, "categories", where),
                        _get(v, "skip", where, int, 0, ok=lambda x: x >= 0, rule="an integer >= 0"),
                        _get(v, "cases", where, int, ok=pos, rule="a positive integer"),
                        _get(v, "chunk", where, int, ok=pos, rule="a positive integer"), ids,
                        *wl,
                        _get(v, "batch", where, int, batch, ok=pos, rule="a positive integer"),
                        _get(v, "case_seconds", where, float, case_s, ok=lambda x: x >= 0,
                             rule="seconds >= 0"),
                        _sampling(v, where, wl[0]), _constrained(v, where, wl[0])))
  if not splits:
    raise PlanError("splits: the plan has no splits (add e.g. [splits.test] split = \"test\")")
  free = [s for s in splits if not s.constrained]
  tagged = [m for m in methods if m.method in E.TAGGED]
  if free and tagged:
    raise PlanError(f"splits.{free[0].label}.constrained: method {tagged[0].method} (methods."
                    f"{tagged[0].label}) reads the grammar's parser tags, which an unconstrained "
                    f"split does not have: give the unconstrained splits a plan of their own")
  long = [s for s in splits if s.task in LC.TASKS]
  if length is not None and not any("length" not in t["splits"][s.label] for s in long):
    raise PlanError("plan.length: no split takes it (only tasks w1, w2, w3 take a length)")
  if tail is not None and not any("tail" not in t["splits"][s.label] for s in long
                                  if s.task == "w1"):
    raise PlanError("plan.tail: no split takes it (only task w1 takes a tail)")
  folder = os.path.join(results or RESULTS, name)
  return Plan(name, path, folder, task, seed, batch, max_tokens, case_s, load_s, tuple(models),
              tuple(methods), tuple(splits))


def _constrained(v: dict, where: str, task: str) -> bool:
  """A split entry's ``constrained`` (default true); false only where the task's answers are
  tool calls under a grammar (bfcl, w3; a registered task's suite says so by ``tool_calls``,
  checked when its cells run)."""
  c = _get(v, "constrained", where, bool, True)
  if not c and task in LC.TASKS and task not in E.UNCONSTRAINED_TASKS:
    raise PlanError(f"{where}.constrained: task {task} has no tool-call grammar to leave out "
                    f"({' and '.join(E.UNCONSTRAINED_TASKS)} have)")
  return c


def _sampling(v: dict, where: str, task: str) -> tuple | None:
  """A split entry's ``sampling = {temperature, top_p, seeds}`` -> (temperature, top_p, seeds)
  or None (greedy)."""
  t = _get(v, "sampling", where, dict)
  if t is None:
    return None
  where = f"{where}.sampling"
  if task == "w1":
    raise PlanError(f"{where}: task w1 feeds the document's own tokens and samples nothing")
  _check_keys(t, _SAMPLING, where)
  temp = _get(t, "temperature", where, float, ok=lambda x: x > 0, rule="a number > 0")
  if temp is None:
    raise PlanError(f"{where}.temperature: missing (e.g. 0.7)")
  top_p = _get(t, "top_p", where, float, 1.0, ok=lambda x: 0 < x <= 1, rule="a number in (0, 1]")
  seeds = _get(t, "seeds", where, list, [0, 1, 2],
               ok=lambda x: x and all(isinstance(i, int) and not isinstance(i, bool) for i in x)
               and len(set(x)) == len(x), rule="a non-empty list of distinct integers")
  return temp, top_p, tuple(seeds)


def _workload(v: dict, where: str, task: str, length: int | None, tail: int | None,
              max_tokens: int) -> tuple[str, int | None, int | None, int]:
  """A split entry's (task, length, tail, max_tokens): its own keys, else the plan's."""
  task = _get(v, "task", where, str, task, ok=lambda s: s in TASKS,
              rule="one of " + ", ".join(TASKS))
  max_tokens = _get(v, "max_tokens", where, int, max_tokens, ok=lambda x: x >= 1,
                    rule="a positive integer")
  if task not in LC.TASKS:
    for k in ("length", "tail"):
      if k in v:
        raise PlanError(f"{where}.{k}: only tasks {', '.join(LC.TASKS)} take a {k} (this split's "
                        f"task is {task})")
    return task, None, None, max_tokens
  least = 8 if task == "w1" else 64
  lkey = f"{where}.length" if "length" in v else "plan.length"
  length = _get(v, "length", where, int, length, ok=lambda x: x >= least,
                rule=f"an integer >= {least}")
  if length is None:
    raise PlanError(f"{where}.length: missing (task {task} needs a prompt length in tokens, "
                    f"e.g. length = 8192, here or at the top of the plan)")
  if length < least:   # the plan's length, given for all splits
    raise PlanError(f"{lkey}: task {task} needs a length >= {least}, got {length}")
  if task != "w1":
    if "tail" in v:
      raise PlanError(f"{where}.tail: only task w1 takes a tail (this split's task is {task})")
    return task, length, None, max_tokens
  tkey = f"{where}.tail" if "tail" in v else "plan.tail"
  tail = _get(v, "tail", where, int, 1024 if tail is None else tail, ok=lambda x: x >= 1,
              rule="a positive integer")
  if tail > length - 4:
    raise PlanError(f"{tkey}: a tail of {tail} leaves no prompt in a document of {length} tokens "
                    f"(need tail <= length - 4)")
  return task, length, tail, tail   # W1 generates nothing: its max_tokens is the tail


# --- fingerprints ---------------------------------------------------------------------------------

def _sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()


def _files(d: str) -> list[str]:
  out = []
  for root, dirs, names in os.walk(d):
    dirs[:] = sorted(x for x in dirs if not x.startswith("."))
    out += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
  return out


def fingerprint(path: str) -> str:
  """sha256 of a file, or of a directory's files (relative path and content digest of each, in
  order; hidden files left out).  Cached by real path, sizes and mtimes in the pask-jax cache
  (``$PASK_JAX_CACHE``), so a multi-GB checkpoint is read once."""
  from models import registry
  real = os.path.realpath(path)
  files = _files(real) if os.path.isdir(real) else [real]
  stamp = [[os.path.relpath(f, real) if f != real else "", os.path.getsize(f),
            os.stat(f).st_mtime_ns] for f in files]
  store = os.path.join(registry.cache_dir(), "fingerprints.json")
  try:
    with open(store) as f:
      cache = json.load(f)
  except (OSError, ValueError):
    cache = {}
  hit = cache.get(real)
  if hit and hit.get("stamp") == stamp:
    return hit["sha256"]
  if os.path.isdir(real):
    h = hashlib.sha256()
    for (rel, _, _), f in zip(stamp, files):
      h.update(f"{rel}\0{_sha256_file(f)}\n".encode())
    digest = h.hexdigest()
  else:
    digest = _sha256_file(real)
  cache[real] = {"stamp": stamp, "sha256": digest}
  tmp = f"{store}.{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(cache, f)
  os.replace(tmp, store)
  return digest


def model_path(model: Model) -> str:
  """The weights a model label names (registered names resolved), or a PlanError naming it."""
  from models import registry
  try:
    path = registry.resolve(model.spec)
  except (FileNotFoundError, ValueError) as e:
    raise PlanError(f"models.{model.label}: {e}") from None
  if not os.path.exists(path):
    raise PlanError(f"models.{model.label}: model not found: {path} (not a file, a directory, "
                    f"nor one of the registered names: {', '.join(registry.NAMES)})")
  return path


# --- tasks ----------------------------------------------------------------------------------------

class BFCL:
  """What the campaign needs of the BFCL task: a split's cases before any model loads (the
  code's own split, :func:`calibrate.bfcl.load`), and an evaluation session for a model.

  A task may also have ``material(split, seed)`` (what of the task goes into a cell's key;
  default ``{"task": name}``) and ``bind(session, split, cases, seed)`` (make ``session`` evaluate
  this split — a model's session serves every task of a plan — and return the cases to run)."""
  name = "bfcl"

  def cases(self, split: str, categories: Sequence[str] | None, seed: int) -> list:
    from calibrate import bfcl
    return bfcl.load(tuple(categories) if categories else bfcl.NONLIVE,
                     split=E.SPLIT_NAMES[split], seed=seed)

  def session(self, path: str, dtype: str, batch: int, seed: int,
              center_keys: bool = True) -> E.Session:
    from pask_jax import api
    from pask_jax.grammar import GrammarCompiler
    m = api.load_model(path, dtype=dtype, center_keys=center_keys)
    gc = GrammarCompiler(m.tokenizer, m.cfg.vocab_size)
    task = E.BFCLSuite(m.tokenizer, m.cfg.arch, gc, seed=seed)
    return E.Session(m, task, batch=batch, compiler=gc)

  def bind(self, session: E.Session, split: Split, cases: Sequence, seed: int) -> list:
    if not isinstance(session.task, E.BFCLSuite):   # the session last ran a workload
      session.task = E.BFCLSuite(session.tok, session.cfg.arch, session.compiler, seed=seed)
    return list(cases)


class _Unbound:
  """A workload session's task until :meth:`Workload.bind` gives it one."""
  name = "unbound"


class Workload:
  """The long-context workloads W1–W3 (:mod:`calibrate.longctx`) for the campaign: cases named
  before any model loads (:func:`calibrate.longctx.stubs`), one session per model for every
  workload and length of the plan, and per split the workload's suite (its length, tail and the
  plan's seed) bound to the session and the cell's cases built by it."""

  def __init__(self, name: str):
    self.name = name
    self._session: Any = None
    self._suites: dict[tuple, Any] = {}

  def material(self, split: Split, seed: int) -> dict:
    return {"task": split.workload, "seed": seed}

  def cases(self, split: str, categories: Sequence[str] | None, seed: int) -> list:
    return LC.stubs(self.name, split, categories, seed)

  def load(self, path: str, dtype: str, center_keys: bool):
    from pask_jax import api
    return api.load_model(path, dtype=dtype, center_keys=center_keys)

  def compiler(self, loaded):
    from pask_jax.grammar import GrammarCompiler
    return GrammarCompiler(loaded.tokenizer, loaded.cfg.vocab_size)

  def session(self, path: str, dtype: str, batch: int, seed: int,
              center_keys: bool = True) -> E.Session:
    m = self.load(path, dtype, center_keys)
    return E.Session(m, _Unbound(), batch=batch, compiler=self.compiler(m))

  def suite(self, session: E.Session, split: Split, seed: int):
    """The workload's suite for ``split`` on ``session``'s model (built once per length)."""
    if self._session is not session:
      self._session, self._suites = session, {}
    k = (split.length, split.tail, seed)
    if k not in self._suites:
      self._suites[k] = LC.suite(self.name, session.m, session.compiler, length=split.length,
                                 tail=split.tail or 1024, seed=seed)
    return self._suites[k]

  def bind(self, session: E.Session, split: Split, cases: Sequence, seed: int) -> list:
    session.task = self.suite(session, split, seed)
    return session.task.materialize(cases)


TASKS: dict[str, Callable[[], Any]] = {"bfcl": BFCL,
                                       **{w: functools.partial(Workload, w) for w in LC.TASKS}}


def task_names(plan: "Plan") -> list[str]:
  """The tasks a plan's splits name, in plan order."""
  return list(dict.fromkeys(sp.task for sp in plan.splits))


def check_task_data(plan: "Plan") -> None:
  """One-line errors, before any model loads, for data a plan's tasks need: the BFCL install
  (bfcl, w3) and the pinned W1/W2 corpus."""
  from calibrate import bfcl
  names = task_names(plan)
  if {"bfcl", "w3", "w3mt"} & set(names):
    try:
      bfcl.require()
    except bfcl.BFCLMissing as e:
      raise PlanError(str(e)) from None
  if {"w1", "w2"} & set(names):
    LC.corpus()   # CorpusError (a ValueError) names the install command


def _adapters(plan: "Plan", task: Any = None) -> dict[str, Any]:
  """Each task of the plan -> its adapter (``task``: one adapter for every split, as tests give
  a fake task)."""
  return {n: task if task is not None else TASKS[n]() for n in task_names(plan)}


def _material(adapter: Any, split: Split, seed: int) -> dict:
  m = getattr(adapter, "material", None)
  return m(split, seed) if m is not None else {"task": adapter.name}


# --- cells ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cell:
  key: str
  material: dict        # what the key hashes (see the module docstring)
  model: Model
  method: Method
  budget: float
  split: Split
  part: int | None      # the chunk of the split, when it is chunked
  cases: tuple          # the task's case objects, in the split's order
  model_path: str
  policy: str | None     # the resolved policy (pask)
  knobs: dict | None     # the knobs the run gets
  dir: str
  sample_seed: int | None = None   # the sampling seed of a split with ``sampling``

  @property
  def done(self) -> bool:
    return os.path.isfile(os.path.join(self.dir, CELL))

  @property
  def slice_label(self) -> str:
    return (self.split.label + ("" if self.part is None else f"#{self.part}")
            + ("" if self.sample_seed is None else f" seed {self.sample_seed}"))

  @property
  def label(self) -> str:
    b = "" if self.method.method in UNBUDGETED and self.budget == 1 else \
        f" B={self.budget:g}"
    return f"{self.model.label} {self.method.label}{b} {self.slice_label}"


def canonical(obj: Any) -> str:
  return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def cell_key(material: dict) -> str:
  """The short hash of a cell's key material (see the module docstring)."""
  return hashlib.sha256(canonical(material).encode()).hexdigest()[:KEY_LEN]


def select(split: Split, every: list, seed: int) -> list[list]:
  """The split entry's cases (per category: after ``skip``, at most ``cases``; or ``ids``),
  chunked into one list per cell."""
  where = f"splits.{split.label}"
  if split.ids is not None:
    by_id = {c.id: c for c in every}
    for i in split.ids:
      if i not in by_id:
        raise PlanError(f"{where}.ids: case {i!r} is not in the {split.split} split (seed {seed})"
                        f" of categories {', '.join(sorted({c.category for c in every}))}")
    chosen = [c for c in every if c.id in set(split.ids)]
    return [chosen]
  per: dict[str, list] = {}
  for c in every:
    per.setdefault(c.category, []).append(c)
  end = None if split.cases is None else split.skip + split.cases
  per = {k: v[split.skip:end] for k, v in per.items()}
  if not any(per.values()):
    raise PlanError(f"{where}: selects no cases (skip {split.skip} per category)")
  if split.chunk is None:
    return [[c for v in per.values() for c in v]]
  parts = -(-max(len(v) for v in per.values()) // split.chunk)
  return [[c for v in per.values() for c in v[i * split.chunk:(i + 1) * split.chunk]]
          for i in range(parts)]


def _knobs(method: Method, model: Model, budget: float) -> dict | None:
  where = f"methods.{method.label}.knobs"
  if method.knobs is None or isinstance(method.knobs, dict):
    return method.knobs
  try:   # knobs tuned at each budget: "runs/tune/B{budget:.2f}/knobs.json" (pask-jax tune)
    path = method.knobs.format(budget=budget, model=model.label)
  except (KeyError, IndexError, ValueError) as e:
    raise PlanError(f"{where}: bad pattern {method.knobs!r} ({e}); fields: {{budget}}, "
                    "{model}") from None
  if not os.path.isfile(path):
    raise PlanError(f"{where}: file not found: {path} (model {model.label}, B={budget:g})")
  try:
    return E.read_knobs(path)
  except ValueError as e:
    raise PlanError(f"{where}: {path} is not valid JSON: {e}") from None


def _policy(method: Method, model: Model, budget: float) -> tuple[str | None, dict | None]:
  from pask_jax import policy as P
  if method.policy is None:
    return None, None
  if method.policy in P.BUILTIN:
    return method.policy, {"builtin": method.policy}
  try:
    d = method.policy.format(budget=budget, model=model.label)
  except (KeyError, IndexError, ValueError) as e:
    raise PlanError(f"methods.{method.label}.policy: bad pattern {method.policy!r} ({e}); "
                    "fields: {budget}, {model}") from None
  if not os.path.isfile(os.path.join(d, "policy.json")):
    raise PlanError(f"methods.{method.label}.policy: no policy directory {d} (model "
                    f"{model.label}, B={budget:g})")
  # keyed on what the policy decides with (policy.digest), not on its files: a conversion to a
  # newer storage format or a re-save keeps the cells it already has
  try:
    return d, {"content": P.digest(d)}
  except (OSError, ValueError) as e:
    raise PlanError(f"methods.{method.label}.policy: {d}: {e}") from None


def _settings(method: str, knobs: dict | None, policy_fp: dict | None, max_tokens: int) -> dict:
  """What of a run's configuration changes its answers (beyond model, budget and cases)."""
  out: dict[str, Any] = {"max_tokens": max_tokens}
  kn = E.merged_knobs(knobs)
  if method in MATCHED:
    own = dict(kn.get(method, {}))
    own["gen"] = float(own.get("gen", kn["gen"]))   # the ĝ its budget matching uses
    out["knobs"] = own
  elif method == "int4":
    out["knobs"] = {k: v for k, v in kn["int4"].items() if k != "gen"}
  elif method in kn:   # e.g. triaxial: its knobs and any frozen allocation change its answers
    out["knobs"] = kn[method]
  if policy_fp is not None:
    out["policy"] = policy_fp
  return out


def _resolved(method: Method, model: Model, budget: float, max_tokens: int):
  """A cell's knobs, policy and the settings of its key -> (knobs, policy, settings)."""
  knobs = _knobs(method, model, budget)
  policy, policy_fp = _policy(method, model, budget)
  return knobs, policy, _settings(method.method, knobs, policy_fp, max_tokens)


def cells(plan: Plan, task: Any = None) -> list[Cell]:
  """Every cell of the plan, in plan order (model, split, slice, method, budget).  ``task``: the
  adapter of every split (default: each split's task in :data:`TASKS`)."""
  adapters = _adapters(plan, task)
  split_cases: dict[str, list[list]] = {}
  for sp in plan.splits:
    try:
      every = adapters[sp.task].cases(sp.split, sp.categories, plan.seed)
    except ValueError as e:
      raise PlanError(f"splits.{sp.label}: {e}") from None
    split_cases[sp.label] = select(sp, every, plan.seed)
  out = []
  for mo in plan.models:
    path = model_path(mo)
    model_fp = {"sha256": fingerprint(path), "dtype": mo.dtype, "key_center": mo.key_center}
    # once per method, budget and max_tokens, not per case chunk (a policy's digest reads its
    # arrays)
    resolved = {(me.label, b, n): _resolved(me, mo, b, n) for me in plan.methods
                for b in me.budgets for n in dict.fromkeys(sp.max_tokens for sp in plan.splits)}
    for sp in plan.splits:
      parts = split_cases[sp.label]
      task_m = _material(adapters[sp.task], sp, plan.seed)
      for i, cs in enumerate(parts):
        ids = sorted(f"{c.category}/{c.id}" for c in cs)
        for me in plan.methods:
          for b in me.budgets:
            knobs, policy, settings = resolved[me.label, b, sp.max_tokens]
            material = {**task_m, "model": model_fp, "method": me.method, "budget": b,
                        "settings": settings, "split": E.SPLIT_NAMES[sp.split], "cases": ids}
            if not sp.constrained:   # constrained cells keep their keys
              material["constrained"] = False
            for seed in (None,) if sp.sampling is None else sp.sampling[2]:
              m = material if seed is None else {**material, "sampling": {
                  "temperature": sp.sampling[0], "top_p": sp.sampling[1], "seed": seed}}
              key = cell_key(m)
              out.append(Cell(key, m, mo, me, b, sp, i if sp.chunk else None, tuple(cs),
                              path, policy, knobs, os.path.join(plan.folder, key), seed))
  return out


# --- running --------------------------------------------------------------------------------------

def read_cell(d: str) -> dict:
  with open(os.path.join(d, CELL)) as f:
    return {**json.load(f), "dir": d}


class Estimator:
  """Expected seconds of a cell: its cases times the per-case time of finished cells of the same
  model, task (a workload with its length) and method (else of the same model and task, else
  the split's ``case_seconds``, the plan's unless the split gives its own), plus the model's
  load time when it is not loaded yet (measured before, else the plan's ``load_seconds``)."""

  def __init__(self, plan: Plan, done: Sequence[dict]):
    self.plan = plan
    self.rate: dict[tuple, list[float]] = {}
    self.load: dict[str, float] = {}
    for c in done:
      self.add(c)

  def add(self, c: dict) -> None:
    fp = canonical(c["material"]["model"])
    task = canonical(c["material"]["task"])
    t = c["timings"]
    for k in ((fp, task, c["method"]), (fp, task)):
      r = self.rate.setdefault(k, [0.0, 0])
      r[0] += t["cell_s"]
      r[1] += c["n"]
    if t.get("load_s") is not None:
      self.load[fp] = t["load_s"]

  def seconds(self, cell: Cell, loaded: bool) -> float:
    fp = canonical(cell.material["model"])
    task = canonical(cell.material["task"])
    per = cell.split.case_seconds
    for k in ((fp, task, cell.method.method), (fp, task)):
      if self.rate.get(k, [0, 0])[1]:
        per = self.rate[k][0] / self.rate[k][1]
        break
    load = 0.0 if loaded else self.load.get(fp, self.plan.load_seconds)
    return len(cell.cases) * per + load


def _git() -> dict:
  def git(*a):
    try:
      return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10,
                            check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      return None
  commit = git("rev-parse", "HEAD")
  status = git("status", "--porcelain", "--untracked-files=no")
  return {"commit": commit, "dirty": None if status is None else bool(status)}


def _jax() -> dict:
  import jax
  import jaxlib
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
          "devices": [d.device_kind for d in jax.devices()]}


def _stamp() -> str:
  return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _split_rule(task: str, seed: int) -> str:
  if task in ("bfcl", "w3"):
    return f"calibrate.bfcl.assign_splits, seed {seed}"
  if task == "w3mt":
    return f"calibrate.multiturn.load (sha256 order, 1:1:3), seed {seed}"
  if task in LC.TASKS:
    return f"calibrate.longctx seeded generators, seed {seed}"
  return task


def run_cell(session: E.Session, cell: Cell, plan: Plan, *, load_s: float | None = None,
             progress: Any = False, clock: Callable[[], float] = time.monotonic,
             cases: Sequence | None = None) -> dict:
  """Evaluate one cell and write its folder (``cell.json`` + ``cases.jsonl``), atomically: the
  run writes ``.partial-<key>/``, renamed to ``<key>/`` once complete; on any exception the
  partial folder is removed and the exception goes on.  ``cases``: the cases to run, as the
  task built them from the cell's (default: the cell's own)."""
  part = os.path.join(plan.folder, PARTIAL + cell.key)
  shutil.rmtree(part, ignore_errors=True)
  smp = cell.material.get("sampling") or {}
  rc = E.RunConfig(cell.method.method, cell.budget, cell.split.split, cell.split.categories,
                   max_tokens=cell.split.max_tokens, policy=cell.policy, knobs=cell.knobs,
                   temperature=smp.get("temperature", 0.0), top_p=smp.get("top_p", 1.0),
                   sample_seed=smp.get("seed", 0),
                   constrained=cell.material.get("constrained", True))
  try:
    started, t0 = _stamp(), clock()
    meta = E.run(session, rc, part, progress=progress,
                 cases=list(cell.cases if cases is None else cases))
    cell_s = clock() - t0
    c = meta["categories"]
    o, h = c["overall"], c.get("simple+multiple")
    if E.is_lm(meta):   # W1: NLL per token of the scored tail, no accuracy
      quality = {"n": o["n"], "accuracy": None, "se": None, "headline": None,
                 "nll": o["nll"], "ppl": o["ppl"]}
    else:
      quality = {"n": o["n"], "accuracy": o["accuracy"],
                 "se": E.binomial_se(o["accuracy"], o["n"]),
                 "headline": None if h is None else {"n": h["n"], "accuracy": h["accuracy"],
                                                     "se": E.binomial_se(h["accuracy"], h["n"])}}
    doc = {"key": cell.key, "plan": plan.name, "material": cell.material,
           "labels": {"model": cell.model.label, "method": cell.method.label,
                      "split": cell.split.label, "part": cell.part},
           **meta,
           "model_spec": cell.model.spec, "model_path": cell.model_path,
           "dtype": cell.model.dtype, "seed": plan.seed,
           "split_rule": _split_rule(cell.split.task, plan.seed),
           "policy": cell.policy, "knobs": cell.knobs, "plan_batch": cell.split.batch,
           **quality,
           "measured_B": {k: o[k] for k in ("prefill_B", "decode_B", "total_B",
                                            "total_B_weighted")},
           "timings": {"cell_s": cell_s, "eval_wall_s": meta["wall_s"], "load_s": load_s,
                       "started": started, "finished": _stamp()},
           "git": _git(), "jax": _jax()}
    for name in ("summary.json", "summary.csv"):   # cell.json holds all of the summary
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(part, name))
    with open(os.path.join(part, CELL), "w") as f:
      json.dump(doc, f, indent=1)
      f.write("\n")
    if os.path.isdir(cell.dir):   # a folder without cell.json (left by hand): replaced
      shutil.rmtree(cell.dir)
    os.replace(part, cell.dir)
  except BaseException:
    shutil.rmtree(part, ignore_errors=True)
    raise
  return {**doc, "dir": cell.dir}


@dataclasses.dataclass
class Outcome:
  done_before: list[Cell] = dataclasses.field(default_factory=list)
  ran: list[Cell] = dataclasses.field(default_factory=list)
  left: list[Cell] = dataclasses.field(default_factory=list)      # did not fit in the time
  failed: list[tuple[Cell, str]] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def _lock(folder: str):
  """One campaign at a time on a results folder; partial cells of a killed one are removed."""
  import fcntl
  os.makedirs(folder, exist_ok=True)
  ignore = os.path.join(folder, ".gitignore")
  if not os.path.exists(ignore):   # the cells are committed, the lock and partial cells not
    with open(ignore, "w") as f:
      f.write(f".lock\n{PARTIAL}*/\n")
  with open(os.path.join(folder, ".lock"), "w") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      raise PlanError(f"another campaign is running on {folder}") from None
    for e in os.scandir(folder):
      if e.name.startswith(PARTIAL):
        shutil.rmtree(e.path, ignore_errors=True)
    yield


def _say(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def run(plan: Plan, *, time_limit: float | None = None, task: Any = None,
        progress: Any = False, copy_to: str | None = None,
        log: Callable[[str], None] = _say, clock: Callable[[], float] = time.monotonic) -> Outcome:
  """Run the plan's cells that are not done and are expected to finish within ``time_limit``
  seconds (from now; None: all), one model loaded at a time.  A cell is started only when its
  expected time fits in what is left; a running cell is not cut.  A cell that fails with a
  ``ValueError`` (e.g. a budget its method cannot reach) is reported and the rest go on; any
  other exception stops the campaign, leaving no trace of the interrupted cell.  ``copy_to``:
  also copy each finished cell to ``copy_to/<plan name>/<key>/`` as soon as it is written (a
  machine whose results come back from one folder)."""
  t0 = clock()
  adapters = _adapters(plan, task)
  todo = cells(plan, task)
  out = Outcome()
  with _lock(plan.folder):
    done = [read_cell(c.dir) for c in todo if c.done]
    est = Estimator(plan, done)
    loaded: tuple[str, Any] | None = None
    for i, cell in enumerate(todo):
      tag = f"[{i + 1}/{len(todo)}] {cell.label}"
      if cell.done:
        out.done_before.append(cell)
        continue
      here = loaded is not None and loaded[0] == cell.model.label
      need = est.seconds(cell, here)
      spent = clock() - t0
      if time_limit is not None and spent + need > time_limit:
        out.left.append(cell)
        log(f"{tag}: left for later (expected {need:.0f} s, {time_limit - spent:.0f} s left)")
        continue
      load_s = None
      adapter = adapters[cell.split.task]
      if not here:
        loaded = None   # the previous model's session goes before the next loads
        t = clock()
        loaded = (cell.model.label, adapter.session(cell.model_path, cell.model.dtype,
                                                    cell.split.batch, plan.seed,
                                                    center_keys=cell.model.key_center))
        load_s = clock() - t
      log(f"{tag}: {len(cell.cases)} cases, expected {need:.0f} s")
      session = loaded[1]
      session.batch = cell.split.batch
      try:
        bind = getattr(adapter, "bind", None)
        run_cases = bind(session, cell.split, cell.cases, plan.seed) if bind else None
        doc = run_cell(session, cell, plan, load_s=load_s, progress=progress, clock=clock,
                       cases=run_cases)
      except ValueError as e:
        out.failed.append((cell, str(e)))
        log(f"{tag}: failed: {e}")
        continue
      if copy_to:
        shutil.copytree(cell.dir, os.path.join(copy_to, plan.name, cell.key), dirs_exist_ok=True)
      est.add(doc)
      out.ran.append(cell)
      if doc["accuracy"] is None:   # W1
        q = f"NLL {doc['nll']:.4f} (ppl {doc['ppl']:.3f})"
      else:
        hd = doc["headline"] or {"accuracy": doc["accuracy"], "se": doc["se"]}
        q = f"accuracy {100 * hd['accuracy']:.2f} ± {100 * hd['se']:.2f}%"
      log(f"{tag}: {q}, measured B {doc['measured_B']['total_B']:.3f}, "
          f"{doc['timings']['cell_s']:.1f} s -> {cell.dir}")
  return out


def describe(plan: Plan, cs: Sequence[Cell]) -> str:
  """The dry-run listing: one line per cell (key, status, cases, what it is), and a total."""
  done = [read_cell(c.dir) for c in cs if c.done]
  est = Estimator(plan, done)
  lines = [f"plan {plan.name}: {len(cs)} cells under {plan.folder}"]
  todo_s = 0.0
  seen: set[str] = set()
  for c in cs:
    if c.done:
      st = "done"
    else:
      s = est.seconds(c, c.model.label in seen)
      seen.add(c.model.label)
      todo_s += s
      st = f"todo ~{s:.0f} s"
    lines.append(f"{c.key}  {st:>14}  {len(c.cases):5d} cases  {c.label}")
  n_done = sum(c.done for c in cs)
  lines.append(f"{n_done} done, {len(cs) - n_done} to run (~{todo_s:.0f} s expected)")
  return "\n".join(lines)


def parse_duration(text: str) -> float:
  """Seconds from ``600``, ``600s``, ``10m`` or ``1.5h``."""
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", text)
  if not m:
    raise ValueError(f"expected a duration such as 600, 10m or 1.5h, got {text!r}")
  return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


# --- report ---------------------------------------------------------------------------------------

def _group(material: dict) -> str:
  """Cells of one configuration over different cases pool into one row."""
  return cell_key({k: v for k, v in material.items() if k != "cases"})


def _walk(path: str, runs: list, cells_: list, skipped: list) -> None:
  if os.path.isfile(os.path.join(path, CELL)):
    cells_.append(read_cell(path))
    return
  if os.path.isfile(os.path.join(path, "summary.json")):
    runs.extend(E.load_runs([path]))
    return
  before = len(runs) + len(cells_)
  subs = sorted(e.path for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))
  inner: list[str] = []
  for s in subs:
    _walk(s, runs, cells_, inner)
  if len(runs) + len(cells_) == before:
    skipped.append(path)
  else:
    skipped.extend(inner)


def _current(plan: Plan) -> set[str]:
  """(method, budget, settings) of every cell the plan makes now (no model or data needed): a
  cell of the plan's folder outside it ran under settings since replaced (a recalibrated policy,
  retuned knobs)."""
  return {canonical([me.method, b, _resolved(me, mo, b, n)[2]])
          for mo in plan.models for me in plan.methods for b in me.budgets
          for n in dict.fromkeys(sp.max_tokens for sp in plan.splits)}


def collect(paths: Sequence[str], *, results: str | None = None,
            log: Callable[[str], None] = _say) -> list[dict]:
  """Runs for :func:`calibrate.evaluate.report` from eval run folders, campaign cells, folders
  holding either (a plan's results folder, ``results/campaign``), or plan files (their results
  folder; only the cells of the plan's current settings: give the folder for every cell).
  Folders that hold neither are skipped with a note; cells of one configuration over different
  cases are pooled into one run (each case counted once)."""
  runs: list[dict] = []
  found: list[dict] = []
  for p in paths:
    current = None
    if p.endswith(".toml") and os.path.isfile(p):
      plan = load_plan(p, results)
      p, current = plan.folder, _current(plan)
    if not os.path.isdir(p):
      raise ValueError(f"{p}: no such folder (an eval run, a campaign cell or a folder of them)")
    skipped: list[str] = []
    cells_: list[dict] = []
    _walk(p, runs, cells_, skipped)
    for s in skipped:
      log(f"report: skipped {s}: not an eval run or a campaign cell")
    if current is not None:
      now = [c for c in cells_ if canonical([c["material"]["method"], c["material"]["budget"],
                                             c["material"]["settings"]]) in current]
      if len(now) < len(cells_):
        log(f"report: left out {len(cells_) - len(now)} cells of {p} whose settings the plan no "
            f"longer has (a recalibrated policy, retuned knobs); report the folder to see them")
      cells_ = now
    found.extend(cells_)
  groups: dict[str, list[dict]] = {}
  for c in found:
    groups.setdefault(_group(c["material"]), []).append(c)
  for g, cs in groups.items():
    rows, seen = [], set()
    for c in sorted(cs, key=lambda c: c["key"]):
      for r in E.read_cases(c["dir"]):
        if (r["category"], r["id"]) not in seen:
          seen.add((r["category"], r["id"]))
          rows.append(r)
    first = cs[0]
    meta = {k: v for k, v in first.items() if k not in ("dir", "key", "labels")}
    lm = bool(rows) and all("nll" in r for r in rows)   # W1: NLL, not accuracy
    meta.update(label=first["labels"]["method"], model_label=first["labels"]["model"],
                group=g, cells=[c["key"] for c in cs], n_cases=len(rows),
                categories=E.summarize_lm(rows) if lm else E.summarize(rows),
                dir=os.path.dirname(first["dir"]), case_rows=rows)
    runs.append(meta)
  if not runs:
    raise ValueError(f"no eval runs or campaign cells in {', '.join(paths)} (no summary.json or "
                     f"{CELL})")
  return runs


def sampling_of(r: dict) -> dict | None:
  """A run's or cell's sampling (temperature, top_p, seed), None when it decoded greedily."""
  return (r.get("material") or {}).get("sampling") or r.get("sampling")


def constrained_of(r: dict) -> bool:
  """Whether a run or cell decoded under its tool-call grammar (every run before the option)."""
  return (r.get("material") or {}).get("constrained", r.get("constrained", True))


def _section(r: dict) -> tuple[str, str]:
  """(key, title) of the table a run goes in: one per model and split (and sampling
  temperature / top-p: the seeds of one sampling share a table)."""
  smp = sampling_of(r)
  how = [] if smp is None else [[smp["temperature"], smp["top_p"]]]
  tag = "" if smp is None else f", sampled T={smp['temperature']:g} top-p {smp['top_p']:g}"
  if not constrained_of(r):
    how, tag = how + ["unconstrained"], tag + ", unconstrained"
  if "material" in r:
    m = r["material"]
    key = canonical([m["model"], m["task"], m["split"], *how])
    return key, f"{r['model_label']} ({m['model']['dtype']}), {m['task']} {m['split']}{tag}"
  ident = r.get("model_identity") or {"model": r.get("model")}
  key = canonical([ident, r.get("task"), r.get("split"), *how])
  return key, f"{r.get('model', '?')}, {r.get('task', '?')} {r.get('split', '?')}{tag}"


def _task_of(rs: Sequence[dict]) -> str:
  r = rs[0]
  return str((r.get("material") or {}).get("task") or r.get("task") or "")


def quality_note(rs: Sequence[dict]) -> str:
  """What the quality column of a table of ``rs`` measures (one line; empty for BFCL)."""
  task = _task_of(rs)
  if task.startswith("w1:"):
    return (f"Quality: mean NLL per token of the last {rs[0].get('tail', '?')} tokens of each "
            "document, fed one by one through the method's cache (ppl = exp NLL; lower is "
            "better).")
  if task.startswith("w2:"):
    return "Quality: exact match (EM) of the 6-digit code asked for, per hop and overall."
  if task.startswith("w3:"):
    return ("Quality: AST accuracy (BFCL's checker) of the unpadded case, simple_python + "
            "multiple.")
  if task.startswith("w3mt:"):
    return ("Quality: multi-turn success (bfcl-eval's multi-turn checker: the API state and "
            "call results after every turn) of episodes against the simulated APIs.")
  return ""


def _case_rows(r: dict) -> list[dict]:
  return r["case_rows"] if "case_rows" in r else E.read_cases(r["dir"])


def stability(rs: Sequence[dict]) -> tuple[str, list[dict]]:
  """The stability table (markdown) of one table's runs against its Full-KV run
  (:func:`calibrate.stability.compare`; the Full-KV run with the most cases when there are
  several), and its rows; W1 (teacher-forced: nothing generated) has none."""
  if not rs or all(E.is_lm(r) for r in rs):
    return "", []
  dense = [r for r in rs if E.is_full(r)]
  if not dense:
    return ("\n**Stability**: no Full-KV run (method full) in this table: not computed.\n"
            + seed_table(rs), [])
  seed = lambda r: (sampling_of(r) or {}).get("seed")
  refs = {}   # per sampling seed (None: greedy), the Full-KV run with the most cases
  for d in sorted(dense, key=lambda r: r["n_cases"]):
    refs[seed(d)] = _case_rows(d)
  calls = not _task_of(rs).startswith(("w1:", "w2:"))   # W2 answers are codes, not calls
  head = ["method", "target B", *ST.HEAD]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  out = []
  for r in sorted(rs, key=E.row_order):
    ref = refs.get(seed(r))
    st = None if ref is None else ST.compare(_case_rows(r), ref, calls=calls)
    out.append({"method": r["method"], "budget": r["budget"],
                **{k: (st or {}).get(k) for k in ST.FIELDS}})
    b = "–" if r.get("base_method", r["method"]) == "full" else E.label(r["budget"])
    lines.append("| " + " | ".join([r["method"], b, *ST.cells(st)]) + " |")
  md = ("\n**Stability vs Full KV** (calibrate.stability; n: cases shared with the Full-KV run; "
        "Δ_tok = (generated tokens − Full KV's) / Full KV's; disagreement: the generated tokens "
        "differ from Full KV's (text: rows without token ids), first divergence in tokens; "
        f"looping, early stop (< {ST.EARLY:g} × Full KV's tokens), malformed calls and "
        "derailed ones (other functions called than Full KV's) counted"
        + ("; sampled runs against Full KV's run of the same seed"
           if any(seed(r) is not None for r in rs) else "") + "):\n\n"
        + "\n".join(lines) + "\n")
  return md + seed_table(rs), out


def _config(r: dict) -> str:
  """A run's configuration without its sampling seed: a cell's key material less the cases and
  the seed; an eval run's method, budget, settings, task and split."""
  m = r.get("material")
  if m is not None:
    m = {k: v for k, v in m.items() if k != "cases"}
    m["sampling"] = {k: v for k, v in (m.get("sampling") or {}).items() if k != "seed"}
    return canonical([m, r.get("series", r["method"])])
  return canonical([r.get("base_method", r["method"]), r["budget"], r.get("settings"),
                    r.get("task"), r.get("split"), r.get("series", r["method"])])


def seed_table(rs: Sequence[dict]) -> str:
  """The seed disagreement (:func:`calibrate.stability.seed_disagreement`) of every (method,
  budget) of a sampled table with runs at two or more seeds, beside Full KV's (markdown; empty
  for a greedy table)."""
  groups: dict[str, dict] = {}   # configuration (everything but the seed) -> seed -> run
  for r in rs:
    smp = sampling_of(r)
    if smp is None:
      continue
    g = groups.setdefault(_config(r), {"runs": {}, "row": r})
    old = g["runs"].get(smp["seed"])
    if old is None or r["n_cases"] > old["n_cases"]:   # one run per seed (the largest)
      g["runs"][smp["seed"]] = r
  got = [(g["row"], ST.seed_disagreement([_case_rows(x) for x in g["runs"].values()]))
         for g in groups.values()]
  got = [(r, v) for r, v in got if v is not None]
  if not got:
    return ""
  dense = [v for r, v in got if E.is_full(r)]
  ref = dense[0]["disagree"] if dense else None
  lines = ["| method | target B | seeds | n | seed disagreement | − Full KV's |",
           "|---|---|---|---|---|---|"]
  for r, v in sorted(got, key=lambda x: E.row_order(x[0])):
    full = E.is_full(r)
    b = "–" if full else E.label(r["budget"])
    diff = "–" if ref is None or full else f"{100 * (v['disagree'] - ref):+.1f} pts"
    lines.append(f"| {r.get('series', r['method'])} | {b} | {v['seeds']} | {v['n']} | "
                 f"{100 * v['disagree']:.1f}% | {diff} |")
  return ("\n**Seed disagreement** (calibrate.stability.seed_disagreement: the cases whose "
          "generated tokens are not the same under every sampling seed; G5: at most Full KV's "
          "+ 5 points):\n\n" + "\n".join(lines) + "\n")


def _write_section(rs: Sequence[dict], d: str) -> str:
  """One table's report in folder ``d``: the quality table and plot (:func:`E.report`), the
  quality note and the stability table (report.md, stability.csv); returns the markdown."""
  md = E.report(None, d, runs=rs)
  note = quality_note(rs)
  stab, rows = stability(rs)
  md = (f"{note}\n\n" if note else "") + md + stab
  with open(os.path.join(d, "report.md"), "w") as f:
    f.write(md)
  if rows:
    import csv
    with open(os.path.join(d, "stability.csv"), "w", newline="") as f:
      w = csv.DictWriter(f, ["method", "budget", *ST.FIELDS])
      w.writeheader()
      w.writerows(rows)
  return md


def report(paths: Sequence[str], out: str, *, results: str | None = None,
           log: Callable[[str], None] = _say) -> tuple[str, list[str]]:
  """Tables (with n and binomial standard errors) and quality-vs-B plots (error bars) of every
  run and cell under ``paths``: one table and plot per model, task (a workload with its
  length) and split, each with its quality metric (:func:`quality_note`) and, for generating
  tasks, the stability of every row against the table's Full-KV row (:func:`stability`; also
  ``stability.csv``); with one table, ``out``/report.md and ``out``/accuracy_vs_B.png (W1:
  nll_vs_B.png) as ``pask-jax report`` always wrote.  Returns the markdown and the files
  written."""
  runs = collect(paths, results=results, log=log)
  sections: dict[str, tuple[str, list[dict]]] = {}
  for r in runs:
    r.setdefault("base_method", r["method"])   # the method itself, before labels rename rows
    k, title = _section(r)
    sections.setdefault(k, (title, []))[1].append(r)
  for _, rs in sections.values():
    named: dict[tuple, list[dict]] = {}
    for r in rs:
      if "label" in r:
        r["method"] = r["label"]   # the plan's label names the row and the plot's series
      smp = sampling_of(r)
      if smp is not None:   # one row per seed; the seeds of a method and budget form a series
        r["series"] = r["method"]
        r["method"] += f" seed {smp['seed']}"
      named.setdefault((r["method"], r["budget"]), []).append(r)
    for same in named.values():
      if len(same) > 1:   # one label, several settings: tell them apart
        for r in same:
          r["method"] += f" [{(r.get('group') or r['dir'])[-6:]}]"
  if len(sections) == 1:
    (_, rs), = sections.values()
    md = _write_section(rs, out)
    return md, [os.path.join(out, "report.md"), os.path.join(out, E.plot_name(rs))]
  parts, files = [], []
  for i, (title, rs) in enumerate(sorted(sections.values(), key=lambda s: s[0])):
    slug = f"{i + 1:02d}-" + re.sub(r"[^\w.+-]+", "_", title).strip("_")[:60]
    md = _write_section(rs, os.path.join(out, slug))
    png = E.plot_name(rs)
    files.append(os.path.join(out, slug, png))
    parts.append(f"## {title}\n\n{md}\n![{png[:-4].replace('_', ' ')}]({slug}/{png})\n")
  text = "\n".join(parts)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "report.md"), "w") as f:
    f.write(text)
  return text, [os.path.join(out, "report.md")] + files
