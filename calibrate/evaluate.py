"""Accuracy against measured KV budget: PASK and the baselines on one task, same stack.

Every method shares the model weights, tokenizer, prompts (rendered once per case, identical ids
for every method), tool-call grammars, greedy decoding, batching and the payload cost model
(:mod:`pask_jax.baselines.budget`).  A :class:`Session` holds one model and its runners, so that
runs of several methods and budgets in one process share compilations (the driver
``scripts/eval_h200.py`` relies on it); :func:`run` evaluates one (method, budget, split) and
writes:

* ``cases.jsonl`` — per case: id, category, split, text, calls, passed, per_call, error, finish,
  prompt_len, gen_len, prefill_B, decode_B, total_B, prefill_s, decode_s, tokens (the generated
  token ids: the stability metrics of :mod:`calibrate.stability` compare them);
* ``summary.csv`` — per category, ``simple+multiple`` (the headline) and ``overall``: n,
  accuracy, per-call fraction, mean prefill/decode/total B, and the workload-weighted total B
  (Σ payload / Σ Full-KV payload);
* ``summary.json`` — the same plus the configuration, knobs and timings (read by :func:`report`).

Budget-flexible baselines are set to the target from the prompt lengths of the run and the
expected generated length ``gen`` (measured on the development split by :func:`tune`); method
knobs come from a knobs file written by :func:`tune` (development split only, frozen before test).
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
import os
import re
import time
from typing import Any, Sequence

import numpy as np

from pask_jax import baselines as BL
from pask_jax.baselines import budget as BU
from pask_jax.prompt import Prompt
from pask_jax.spherical import variants as SV

SPLIT_NAMES = {"cal": "calibration", "dev": "development", "test": "test",
               "calibration": "calibration", "development": "development"}
HEADLINE = ("simple_python", "multiple")
# Methods that run a PASK policy's own budget (its B<x> variant): PASK and PASK+ADA.
PASK_POLICY = ("pask", "pask+ada")
# Knob grids (paper Table 8).  "paper" is the full grid; "small" the one the H200 driver uses.
GRIDS = {
    "paper": {"streaming": {"sink": [4]},
              "h2o": {"sink": [2, 4, 8], "recent": [16, 32, 64, 128]},
              "mikv": {"sink": [2, 4, 8], "recent": [16, 32, 64, 128]},
              "snapkv": {"obs": [16, 32, 64, 128], "pool": ["avg", "max"], "kernel": [3, 5, 7]},
              "rocketkv": {"obs": [16, 32, 64, 128], "kernel": list(BL.rocketkv.KERNELS)},
              "triaxial": BL.triaxial.GRID},
    "small": {"streaming": {"sink": [4]},
              "h2o": {"sink": [4], "recent": [16, 64]},
              "mikv": {"sink": [4], "recent": [16, 64]},
              "snapkv": {"obs": [16, 64], "pool": ["avg", "max"], "kernel": [7]},
              "rocketkv": {"obs": [16, 64], "kernel": [63]},
              "triaxial": {"prefix": [4], "bits": [[2, 4], [4, 4]], "window": [32, 128]}},
}
DEFAULT_KNOBS = {"gen": 48.0, "streaming": {"sink": 4}, "int4": {"sink": 4, "window": 32},
                 "h2o": {"sink": 4, "recent": 32}, "mikv": {"sink": 4, "recent": 32},
                 "snapkv": {"obs": 32, "pool": "max", "kernel": 7},
                 "rocketkv": {"obs": 32, "kernel": 63},
                 "triaxial": {"prefix": 4, "bits": [2, 4], "window": 32},
                 **{m: {"sink": 4, "window": 32} for m in SV.METHODS}}


# --- tasks ---------------------------------------------------------------------------------------

class BFCLSuite:
  """BFCL through :mod:`calibrate.bfcl` (data, split, prompts, grammars, official checker): the
  cases an evaluation runs, their prepared prompts and their scores.  (The calibration oracle
  over prepared requests is :class:`calibrate.tasks.BFCLTask`.)"""
  name = "bfcl"
  tool_calls = True   # answers are tool calls under a grammar: may also run unconstrained

  def __init__(self, tokenizer, arch: str, compiler, seed: int = 0):
    from calibrate import bfcl
    bfcl.require()   # a one-line error naming the install command, before any work
    self.bfcl, self.tok, self.arch, self.seed = bfcl, tokenizer, arch, seed
    self.fmt, indent = bfcl.style_for(arch)
    self.grammars = bfcl.Grammars(compiler, self.fmt, indent) if compiler is not None else None

  def cases(self, split: str, categories: Sequence[str] | None = None,
            max_cases: int | None = None, skip: int = 0) -> list:
    cats = tuple(categories) if categories else self.bfcl.NONLIVE
    cs = self.bfcl.load(cats, split=SPLIT_NAMES.get(split, split), seed=self.seed)
    return cap_per_category(cs, max_cases, skip)

  def prepare(self, cases, prompt_labels: bool) -> list[Prompt]:
    return self.bfcl.prepare(cases, self.tok, arch=self.arch, prompt_labels=prompt_labels,
                             grammars=self.grammars)

  def score(self, case, text: str, complete: bool) -> dict:
    return self.bfcl.score(case, text, complete=complete, fmt=self.fmt)


class JsonlSuite:
  """A user's JSONL task file (:func:`calibrate.tasks.read_jsonl`, the format ``pask-jax
  calibrate --task jsonl`` reads) for ``eval`` and ``tune``: split ``test`` is every case of the
  file (keep test cases in a file of their own: calibration saw the others), ``cal`` / ``dev``
  the 1:1 split calibration makes of it with the same ``seed``.  Prompts, grammars and scores
  are calibration's (:class:`calibrate.tasks.JsonlTask`, :func:`calibrate.tasks.check_answer`);
  tool-call answers are tagged by the tool-call adapter, JSON-schema answers as free text (as
  calibration and the server tag them)."""

  def __init__(self, cases, tokenizer, arch: str, compiler, *, seed: int = 0,
               name: str = "jsonl"):
    self.all, self.tok, self.arch, self.compiler = list(cases), tokenizer, arch, compiler
    self.seed, self.name = seed, name

  def cases(self, split: str, categories: Sequence[str] | None = None,
            max_cases: int | None = None, skip: int = 0) -> list:
    from calibrate import tasks
    split = {"calibration": "cal", "development": "dev"}.get(split, split)
    if split == "test":
      cs = list(self.all)
    elif split in ("cal", "dev"):
      cs = tasks.split_jsonl(self.all, self.seed)[split == "dev"]
    else:
      raise ValueError(f"unknown split {split!r}; choose cal, dev or test")
    if categories:
      known = sorted({c.category for c in self.all})
      bad = [c for c in categories if c not in known]
      if bad:
        raise ValueError(f"categor{'y' if len(bad) == 1 else 'ies'} {', '.join(bad)} not in "
                         f"the task file (it has {', '.join(known)})")
      cs = [c for c in cs if c.category in categories]
    return cap_per_category(cs, max_cases, skip)

  def prepare(self, cases, prompt_labels: bool) -> list[Prompt]:
    from calibrate import tasks
    return tasks.JsonlTask(cases, self.tok, arch=self.arch, compiler=self.compiler).requests

  def free_text(self, p: Prompt) -> bool:
    """Whether the answer of ``p`` is tagged as free generation (a JSON-schema case)."""
    return p.case.tools is None

  def score(self, case, text: str, complete: bool) -> dict:
    from calibrate import tasks
    from pask_jax.prompt import style
    return tasks.check_answer(case, text, complete, style(self.arch)[0])


def cap_per_category(cases: list, max_cases: int | None, skip: int = 0) -> list:
  """Per category, in order, the cases after the first ``skip``, at most ``max_cases`` of them (a
  deterministic cut: runs over disjoint slices of one split can be pooled by :func:`merge`)."""
  if skip < 0:
    raise ValueError(f"skip must be >= 0, got {skip}")
  seen: dict[str, int] = {}
  out = []
  for c in cases:
    k = seen[c.category] = seen.get(c.category, 0) + 1
    if k > skip and (not max_cases or k <= skip + max_cases):
      out.append(c)
  return out


# --- runs ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class RunConfig:
  method: str
  budget: float | None = 1.0         # pask: None runs the policy at its own budget
  split: str = "test"
  categories: tuple[str, ...] | None = None
  max_cases: int | None = None
  max_tokens: int = 128
  policy: str | None = None          # pask: a policy directory (or all-high / demo)
  knobs: dict | None = None           # see DEFAULT_KNOBS; merged over it
  skip_cases: int = 0                 # per category: leave out the first N (run a later slice)
  temperature: float = 0.0           # > 0: nucleus sampling (G5's seeded disagreement); 0 greedy
  top_p: float = 1.0
  sample_seed: int = 0               # the sampling key's seed (rows share a key per step)
  constrained: bool = True           # False: tool-call tasks decode without their grammar


_VARIANT = re.compile(r"B(\d+(?:\.\d+)?)")


def policy_variants(where: str) -> dict[float, str]:
  """The per-budget variants a policy directory holds: sub-directories ``B<target>`` (e.g.
  ``B0.33``) with a ``policy.json``, by target total B."""
  out = {}
  from pask_jax import policy as P
  if where in P.BUILTIN or not os.path.isdir(where):
    return out
  for name in sorted(os.listdir(where)):
    m = _VARIANT.fullmatch(name)
    if m and os.path.isfile(os.path.join(where, name, "policy.json")):
      out[float(m.group(1))] = os.path.join(where, name)
  return out


def policy_target(where: str) -> float | None:
  """The total B a policy is made for, where it says: a ``B<target>`` variant directory, a
  policy whose decode and prefill budgets are one B (``all-high`` 1, ``demo`` 0.5), or an edit
  of a variant (its source's target).  None for one whose budgets differ (the calibrated
  top-level policy: B_D 0, B_P 0.5 measures ~0.44)."""
  from pask_jax import policy as P
  if where in P.BUILTIN:
    return {"all-high": 1.0, "demo": 0.5}.get(where)
  m = _VARIANT.fullmatch(os.path.basename(os.path.normpath(where)))
  if m:
    return float(m.group(1))
  try:
    rec = P.read_record(where)
    b = rec.get("budgets") or {}
  except (FileNotFoundError, ValueError) as e:
    raise ValueError(f"policy {where!r} not found: {e}") from None
  b_d, b_p = b.get("b_d"), b.get("b_p")
  if b_d is not None and b_d == b_p:
    return float(b_p)
  # an edit of a B<x> variant (`pask-jax policy edit`: Table 17's decomposition, no-release) runs
  # at its source's target, so that its cells sit beside the source's in a campaign
  src = ((rec.get("extra") or {}).get("edit") or {}).get("source_variant") or {}
  t = src.get("target")
  return float(t) if isinstance(t, (int, float)) else None


def pick_policy(where: str, budget: float | None) -> tuple[str, float | None]:
  """(policy to run, its target B) for PASK at ``budget``: the ``B<budget>`` variant of a
  directory that holds variants; else the policy itself when its own target is ``budget`` (or
  ``budget`` is None).  A budget the policy cannot honour is a ValueError naming what it can."""
  var = policy_variants(where)
  if var:
    have = ", ".join(f"{b:.2f}" for b in var)
    if budget is None:
      raise ValueError(f"policy {where} holds one variant per budget: give --budget one of {have}")
    for b, d in var.items():
      if abs(b - budget) < 5e-3:
        return d, b
    raise ValueError(f"policy {where} has no variant for --budget {budget:g}: its variants are "
                     f"for B {have}")
  own = policy_target(where)
  if budget is None or (own is not None and abs(own - budget) < 5e-3):
    return where, own
  says = f"its own target B is {own:g}" if own is not None else \
      "it states no target B (decode and prefill budgets differ) and holds no B<x> variants"
  raise ValueError(f"--budget {budget:g} cannot be honoured with policy {where}: {says}; "
                   f"leave --budget out to run it as it is")


def check_config(rc: RunConfig) -> None:
  """Clear errors for bad input (before any model work)."""
  if rc.method not in BL.METHODS:
    raise ValueError(f"unknown method {rc.method!r}; choose from {', '.join(BL.METHODS)}")
  if rc.method == "pask" and not rc.policy:
    raise ValueError("--method pask needs --policy DIR (a FrozenPolicy saved by pask_jax.policy)")
  if rc.method in SV.TAGGED and not rc.policy:
    raise ValueError(f"--method {rc.method} needs --policy DIR (the PASK policy whose floor-H "
                     f"tags RDR protects, or whose controller PASK+ADA runs)")
  if rc.budget is not None or rc.method != "pask":
    BU.check_target(rc.budget)
  if rc.method in PASK_POLICY:
    pick_policy(rc.policy, rc.budget)
  if rc.method == "triaxial":
    BL.triaxial.Knobs.parse(merged_knobs(rc.knobs)["triaxial"])
  if rc.split not in SPLIT_NAMES:
    raise ValueError(f"unknown split {rc.split!r}; choose from cal, dev, test")
  if rc.max_tokens <= 0:
    raise ValueError("max_tokens must be positive")
  if rc.skip_cases < 0:
    raise ValueError("skip_cases must be >= 0")
  if not rc.temperature >= 0:
    raise ValueError(f"temperature must be >= 0 (0: greedy), got {rc.temperature}")
  if not 0 < rc.top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1], got {rc.top_p}")
  if not rc.constrained and rc.method in TAGGED:
    raise ValueError(f"--method {rc.method} reads the grammar's parser tags, which an "
                     f"unconstrained run does not have: run it constrained")


# Methods that read the parser's structural tags (and so need the grammar's parser).
TAGGED = ("pask", "triaxial") + SV.TAGGED
# Tasks whose answers are tool calls under a grammar an unconstrained run leaves out (a
# registered task's suite says so by ``tool_calls``).
UNCONSTRAINED_TASKS = ("bfcl", "w3")


def merged_knobs(knobs: dict | None) -> dict:
  out = json.loads(json.dumps(DEFAULT_KNOBS))
  for k, v in (knobs or {}).items():
    if isinstance(v, dict):
      out.setdefault(k, {}).update(v)
    else:
      out[k] = v
  return out


class Session:
  """One model, its tokenizer, a task and lazily built runners shared across runs."""

  def __init__(self, loaded, task=None, *, batch: int = 64, compiler=None):
    from pask_jax.grammar import GrammarCompiler
    self.m, self.tok, self.cfg = loaded, loaded.tokenizer, loaded.cfg
    self.batch = batch
    self.compiler = compiler or GrammarCompiler(self.tok, self.cfg.vocab_size)
    self.task = task or BFCLSuite(self.tok, self.cfg.arch, self.compiler)
    self.capacity = 0
    self.runners: dict[str, Any] = {}
    self.policies: dict[str, Any] = {}
    self.calibrations: dict[Any, Any] = {}   # a baseline's calibration-split state (triaxial)

  def ensure_capacity(self, preps: Sequence[Prompt], max_tokens: int) -> None:
    from pask_jax.decode import capacity_for
    need = capacity_for(max(len(p.ids) for p in preps), max_tokens)
    if need > self.cfg.max_position:
      raise ValueError(f"prompts need {need} positions, beyond the model's {self.cfg.max_position}")
    if need > self.capacity:
      self.capacity, self.runners = need, {}

  def runner(self, kind: str, batch: int | None = None):
    """'full' | 'pask' (PaskRunner, policy swapped per run) | 'masked' | 'triaxial' |
    ('spherical', method, sink, window) (a Spherical KV method of
    :mod:`pask_jax.spherical.variants`), of ``batch`` rows
    (default: the session's); one per (kind, batch), shared by the runs that use it."""
    batch = batch or self.batch
    r = self.runners.get((kind, batch))
    if r is None:
      from pask_jax import policy as P
      from pask_jax.decode import PaskRunner, Runner
      kw = dict(batch=batch, capacity=self.capacity)
      if kind == "full":
        r = Runner(self.m.model, **kw)
      elif kind == "pask":
        r = PaskRunner(self.m.model, P.all_high(self.cfg), **kw)
      elif kind == "triaxial":
        r = BL.triaxial.TriaxialRunner(self.m.model, **kw)
      elif isinstance(kind, tuple) and kind[0] == "spherical":
        from pask_jax.spherical.runner import SphRunner
        _, method, sink, window = kind
        r = SphRunner.for_method(self.m.model, method, sink=sink, window=window,
                                 stats=self.runner("sph-stats", batch), **kw)
      elif kind == "sph-stats":   # the Spherical KV methods' shared statistics prefill
        r = BL.MaskedRunner(self.m.model, **kw)
      else:
        r = BL.MaskedRunner(self.m.model, **kw)
      self.runners[(kind, batch)] = r
    return r

  def load_policy(self, where: str):
    from pask_jax import policy as P
    if where not in self.policies:
      try:
        self.policies[where] = P.resolve(where, self.cfg, tokenizer_hash=self.tok.hash())
      except FileNotFoundError as e:
        raise ValueError(f"policy {where!r} not found: {e}") from None
    return self.policies[where]


def batch_size(n: int, most: int) -> int:
  """Rows per generation batch for ``n`` cases and at most ``most`` rows: as few batches as
  ``most`` allows, balanced (70 cases at 64 -> 2 × 35), so no batch is padded beyond its cases
  by more than one row and a small run never pads to ``most``."""
  if n <= 0 or most <= 0:
    raise ValueError(f"need cases and a positive batch, got {n} cases, batch {most}")
  k = -(-n // most)
  return -(-n // k)


class _Counted:
  """Wraps a request's tracker to call ``done()`` once when :func:`pask_jax.decode.generate`
  finishes the row — by its own rules: a stop token, a terminated grammar, or ``max_tokens``
  tokens accepted — so a progress bar advances per case as cases finish, not per batch."""

  def __init__(self, inner, stops, max_tokens: int, done):
    self.inner, self.stops, self.left, self.done = inner, stops, max_tokens, done

  def fill(self, bits, row):
    self.inner.fill(bits, row)

  def fork(self):
    return _Counted(self.inner.fork(), self.stops, self.left, None)

  def accept(self, token: int):
    out = self.inner.accept(token)
    self.left -= 1
    if self.done is not None and (token in self.stops or self.inner.terminated or self.left <= 0):
      self.done, done = None, self.done
      done()
    return out

  @property
  def terminated(self) -> bool:
    return self.inner.terminated

  def __getattr__(self, name):   # matcher, adapter, ... of the wrapped tracker
    return getattr(self.inner, name)


def _setup(s: Session, rc: RunConfig, preps: list[Prompt],
           batch: int | None = None) -> tuple[Any, dict]:
  """Runner for the method (``batch`` rows), configured for the target; and the settings
  actually used."""
  kn = merged_knobs(rc.knobs)
  # ĝ: the method's own dev estimate when tuning recorded one, else the Full-KV dev mean.
  gen = float(kn.get(rc.method, {}).get("gen", kn["gen"]))
  lengths = [(len(p.ids), gen) for p in preps]
  m = rc.method
  used: dict[str, Any] = {"gen": gen}
  if m == "full":
    return s.runner("full", batch), used
  if m in ("pask", "streaming", "int4"):
    r = s.runner("pask", batch)
    if m == "pask":
      r.policy = s.load_policy(rc.policy)
      used.update(policy=rc.policy, b_d=float(r.policy.b_d), b_p=float(r.policy.b_p))
    elif m == "int4":
      r.policy = BL.int4.policy(s.cfg, sink=int(kn["int4"]["sink"]),
                                window=int(kn["int4"]["window"]))
      used.update(kn["int4"])
    else:
      sink = int(kn["streaming"].get("sink", 4))
      w = BL.streaming.window_for(rc.budget, lengths, sink)
      r.policy = BL.streaming.policy(s.cfg, sink=sink, window=w)
      used.update(sink=sink, window=w)
    return r, used
  if m == "triaxial":
    # The allocation frozen in the knobs when it was made for these knobs and this target;
    # otherwise calibrated now, on the calibration split only.
    from calibrate import triaxial as TC
    tk = BL.triaxial.Knobs.parse(kn[m])
    alloc = kn[m].get("allocation")
    if not BL.triaxial.matches(alloc, tk, rc.budget):
      alloc = TC.calibrate(s, tk, rc.budget, max_tokens=rc.max_tokens,
                           max_cases=kn[m].get("cal_cases"))
    used.update(tk.asdict(), allocation=alloc)
    return s.runner("triaxial", batch).configure(tk, alloc), used
  if m in SV.METHODS:   # Spherical KV and its ablations / hybrids: one SphRunner each
    sink, window = int(kn[m]["sink"]), int(kn[m]["window"])
    used.update(sink=sink, window=window)
    pol = None
    if m in SV.TAGGED:
      where = pick_policy(rc.policy, rc.budget)[0] if policy_variants(rc.policy) else rc.policy
      pol = s.load_policy(where)
      used.update(policy=where)
      if m in PASK_POLICY:
        used.update(b_d=float(pol.b_d), b_p=float(pol.b_p))
    return s.runner(("spherical", m, sink, window), batch).configure(rc.budget, pol), used
  k = {a: v for a, v in kn[m].items() if a != "gen"}
  q = BU.low_ratio(s.cfg.head_dim)
  ratio = BL.plan(m, rc.budget, lengths, sink=int(k.get("sink", 4)),
                  recent=int(k.get("recent", 32)), q=q, obs=int(k.get("obs", 32)), gen=gen)
  conf = BL.Config(m, ratio=ratio, target=rc.budget, gen=gen, **k)
  # the settings a run records (merge and campaigns compare them): only the fields the method reads
  used.update({f: v for f, v in dataclasses.asdict(conf).items()
               if m == "rocketkv" or f not in BL.masked.ROCKET_ONLY})
  return s.runner("masked", batch).configure(conf), used


def _measured(rc: RunConfig, used: dict, n_prompt: int, n_gen: int, led: dict | None,
              hbm: dict | None = None) -> dict:
  """A case's measured B fields, and with ``hbm`` (the runner's :meth:`hbm` row: methods with a
  kernel path) its decode step's ``hbm_bytes_per_token`` and ``b_HBM``."""
  extra = {} if hbm is None else {k: hbm[k] for k in ("hbm_bytes_per_token", "b_HBM")}
  if rc.method == "full":
    return {**BL.full.measured(n_prompt, n_gen), **extra}
  if rc.method == "streaming":
    return {**BL.streaming.measured(led["n_prompt"], led["n_gen"], used["sink"], used["window"]),
            **extra}
  out = {"prefill_B": led["prefill_B"], "decode_B": led["decode_B"],
         "total_B": led["measured_B"], **extra}
  if rc.method in SV.METHODS:   # where the items went (per route) and any floor deficit
    out.update(items=led["items"], deficit_bytes=led["deficit_bytes"])
  return out


def _resolved(s: Session, rc: RunConfig, cases: list | None, what: str) -> tuple:
  """``(rc, cases)`` of a run: the config checked, a PASK policy's variant for the budget (the
  label its own target), and the cases (default: the task's for the config); one-line
  ValueError for no cases (``what`` names them)."""
  check_config(rc)
  if rc.method in PASK_POLICY:   # the variant for the budget; the label is its own target
    pol, target = pick_policy(rc.policy, rc.budget)
    rc = dataclasses.replace(rc, policy=pol, budget=target)
  if cases is None:
    cases = s.task.cases(rc.split, rc.categories, rc.max_cases, skip=rc.skip_cases)
  if not cases:
    raise ValueError(f"no {what} for split {rc.split!r} and categories {rc.categories}")
  return rc, cases


def _trackers(s: Session, rc: RunConfig, runner):
  """The per-prompt tracker factory of a run: the grammar, and for methods that read the
  parser's tags the tool-call adapter (PASK's with the policy's parser-state vocabulary)."""
  from pask_jax.tracker import Tracker
  # A task may tag some answers as free generation (a JSON-schema case of a JSONL task).
  free = getattr(s.task, "free_text", lambda p: False)
  if rc.method in PASK_POLICY:
    from pask_jax import policy as P
    from pask_jax.grammar.fc_adapter import FCAdapter
    # parser-state ids of the calibrated reserve Γ
    vocab = P.state_vocab(runner.policy if rc.method == "pask" else s.load_policy(rc.policy))
    return lambda p: (Tracker(p.grammar) if free(p) or p.grammar is None else
                      Tracker(p.grammar, FCAdapter(p.grammar, s.tok, vocab=vocab)))
  if rc.method in TAGGED:
    from pask_jax.grammar.fc_adapter import FCAdapter
    return lambda p: (Tracker(p.grammar) if free(p) or p.grammar is None else
                      Tracker(p.grammar, FCAdapter(p.grammar, s.tok)))
  return lambda p: Tracker(p.grammar)


def _bar(progress: Any, total: int, desc: str):
  """``progress`` (True: tqdm; False/None: none; else a factory) -> a bar or None."""
  if progress is True:
    import functools

    from tqdm.auto import tqdm
    progress = functools.partial(tqdm, unit="case")
  return progress(total=total, desc=desc) if progress else None


def run(s: Session, rc: RunConfig, out: str | None = None, *, progress: Any = True,
        cases: list | None = None) -> dict:
  """Evaluate one (method, budget, split); returns the summary dict (and writes ``out``).

  Batches hold at most ``s.batch`` cases and never more rows than the run has cases
  (:func:`batch_size`).  ``progress``: True for a tqdm bar that advances as each case finishes,
  False for none, or a factory ``progress(total=, desc=)`` of an object with ``update(n)`` and
  ``close()``."""
  from pask_jax.decode import Sampling, generate
  if getattr(s.task, "kind", None) == "lm":   # W1: teacher-forced NLL, not generation
    return run_lm(s, rc, out, cases=cases)
  if getattr(s.task, "kind", None) == "episodes":   # W3's multi-turn rollouts
    return run_episodes(s, rc, out, progress=progress, cases=cases)
  rc, cases = _resolved(s, rc, cases, "cases")
  tagged = rc.method in TAGGED   # methods that read the parser's tags
  preps = s.task.prepare(cases, prompt_labels=tagged)
  if not rc.constrained:
    if not getattr(s.task, "tool_calls", False):
      raise ValueError(f"task {s.task.name!r} has no tool-call grammar to leave out: only "
                       f"{' and '.join(UNCONSTRAINED_TASKS)} run unconstrained")
    preps = [dataclasses.replace(p, grammar=None) for p in preps]
  s.ensure_capacity(preps, rc.max_tokens)
  batch = batch_size(len(preps), s.batch)
  runner, used = _setup(s, rc, preps, batch)
  tracker = _trackers(s, rc, runner)
  sampling = Sampling(max_tokens=rc.max_tokens, temperature=rc.temperature, top_p=rc.top_p,
                      seed=rc.sample_seed)
  order = sorted(range(len(preps)), key=lambda i: len(preps[i].ids))
  rows: list[dict | None] = [None] * len(preps)
  bar = _bar(progress, len(preps), f"{rc.method} B={label(rc.budget)} {rc.split}")
  stops = set(s.tok.stop_ids)
  segmented = getattr(runner, "reads_segments", False)   # W2's document: ω's retrieved weight
  t0 = time.perf_counter()
  for st in range(0, len(order), batch):
    idx = order[st:st + batch]
    ps = [preps[i] for i in idx]
    told = [0]

    def done():
      told[0] += 1
      if bar is not None:
        bar.update(1)

    trackers = [_Counted(tracker(p), stops, rc.max_tokens, done) for p in ps]
    res = generate(runner, s.tok, [p.ids for p in ps], trackers=trackers,
                   prompt_tags=[p.tags for p in ps] if tagged else None,
                   prompt_segments=[p.retrieved for p in ps] if segmented else None,
                   sampling=sampling)
    if bar is not None and told[0] < len(idx):   # a row generate() ended by another rule
      bar.update(len(idx) - told[0])
    for i, p, r in zip(idx, ps, res):
      sc = s.task.score(p.case, r.text, r.finish == "stop")
      b = _measured(rc, used, r.prompt_len, len(r.tokens), r.ledger, r.hbm)
      n_gen = r.ledger["n_gen"] if r.ledger else len(r.tokens)
      rows[i] = {"id": p.case.id, "category": p.case.category, "split": rc.split,
                 "method": rc.method, "budget": rc.budget, "text": r.text, "calls": sc["calls"],
                 "passed": bool(sc["passed"]), "per_call": float(sc["per_call"]),
                 "error": sc["error"], "valid": sc.get("valid"), "finish": r.finish,
                 "prompt_len": r.prompt_len,
                 "gen_len": len(r.tokens), "kv_gen_len": int(n_gen), **b,
                 "prefill_s": r.prefill_s, "decode_s": r.decode_s,
                 "tokens": [int(t) for t in r.tokens]}
  if bar is not None:
    bar.close()
  return _finish(s, rc, out, rows, batch, used, time.perf_counter() - t0)


def _finish(s: Session, rc: RunConfig, out: str | None, rows: list[dict], batch: int,
            used: dict, wall: float) -> dict:
  """A generating run's summary (the rows summarized, the sampling and an unconstrained run
  said), written to ``out`` with the rows."""
  summ = summarize(rows)
  meta = {"method": rc.method, "budget": rc.budget,
          "measured_B": summ["overall"]["total_B"], "split": rc.split, "model": s.cfg.arch,
          "model_identity": _ident(s), "task": s.task.name, "n_cases": len(rows),
          "max_tokens": rc.max_tokens, "batch": batch, "capacity": s.capacity,
          "settings": used, "wall_s": wall, "categories": summ}
  if rc.temperature > 0:
    meta["sampling"] = {"temperature": rc.temperature, "top_p": rc.top_p,
                        "seed": rc.sample_seed}
  if not rc.constrained:
    meta["constrained"] = False
  if out:
    write(out, rows, meta)
  return meta


# --- W3's multi-turn episodes (calibrate.multiturn) ----------------------------------------------

def run_episodes(s: Session, rc: RunConfig, out: str | None = None, *, progress: Any = True,
                 cases: list | None = None) -> dict:
  """W3's multi-turn episodes (``s.task.kind == "episodes"``: :class:`calibrate.multiturn.
  EpisodeSuite`) for one (method, budget): every episode rolls out against its simulated APIs
  (each answer a generation over the conversation so far, in lockstep batches of the active
  episodes), then bfcl-eval's multi-turn checker scores it.  A row per episode: ``passed``,
  ``error``, ``answers`` (generations), ``calls`` (the call strings of every answer, per turn),
  ``tokens`` (every answer's tokens, in order), ``prompt_len`` (the last conversation's),
  ``gen_len``, and the measured B as the token-weighted mean over the episode's answers
  (``kv_tokens``: the tokens they weigh, every answer's conversation and output, which the
  summary's weighted B weighs the episode by); ``finish`` is "stop" for an episode that ran all
  its turns, else why it ended ("context full": the conversation outgrew the suite's
  ``length``; "step limit": more than :data:`calibrate.multiturn.MAX_STEPS` answers with calls
  in a turn, failed as BFCL fails it)."""
  task = s.task
  if not rc.constrained:
    raise ValueError("multi-turn episodes decode under their tool-call grammar (choice auto: "
                     "the model may already answer in free text); run them constrained")
  rc, cases = _resolved(s, rc, cases, "episodes")
  room = task.length - rc.max_tokens   # the longest conversation an answer may follow
  if room < 64:
    raise ValueError(f"length {task.length} leaves no room for a conversation before "
                     f"{rc.max_tokens} new tokens")
  if rc.method == "triaxial" and not merged_knobs(rc.knobs)["triaxial"].get("allocation"):
    raise ValueError("triaxial calibrates its allocation on single-answer cases: give its knobs "
                     "an allocation (e.g. one tuned on w3) to run it on episodes")
  tagged = rc.method in TAGGED
  rolls = [task.rollout(e, rc.method) for e in cases]
  try:
    return _episodes(s, rc, out, rolls, room, tagged, progress)
  finally:   # an exception mid-run: no API instance is left in bfcl-eval's globals
    for r in rolls:
      r.free()


def _episodes(s: Session, rc: RunConfig, out: str | None, rolls: list, room: int, tagged: bool,
              progress: Any) -> dict:
  """:func:`run_episodes`'s rollouts, rows and summary."""
  from pask_jax.decode import Sampling, generate
  from pask_jax.prompt import Prompt
  task = s.task
  first = {}
  for i, r in enumerate(rolls):
    p = task.prompt(r, tagged)
    if len(p.ids) > room:   # the first turn's conversation does not fit the context
      r.stop("context full")
    else:
      first[i] = p
  # Budget-matched methods are fitted to the first answers' conversations; later answers follow
  # longer ones, and each answer's measured B is what the row reports.
  fit = list(first.values()) or [Prompt("", [0] * room)]
  s.ensure_capacity([Prompt("", [0] * room)], rc.max_tokens)
  batch = batch_size(len(rolls), s.batch)
  runner, used = _setup(s, rc, fit, batch)
  tracker = _trackers(s, rc, runner)
  sampling = Sampling(max_tokens=rc.max_tokens, temperature=rc.temperature, top_p=rc.top_p,
                      seed=rc.sample_seed)
  steps: list[list[tuple[dict, int]]] = [[] for _ in rolls]
  last = [0] * len(rolls)
  secs = [[0.0, 0.0] for _ in rolls]
  bar = _bar(progress, len(rolls), f"{rc.method} B={label(rc.budget)} {rc.split} episodes")
  if bar is not None and len(first) < len(rolls):
    bar.update(len(rolls) - len(first))
  t0 = time.perf_counter()
  pending = first
  while pending:
    live = sorted(pending, key=lambda i: len(pending[i].ids))
    for st in range(0, len(live), batch):
      idx = live[st:st + batch]
      ps = [pending[i] for i in idx]
      res = generate(runner, s.tok, [p.ids for p in ps], trackers=[tracker(p) for p in ps],
                     prompt_tags=[p.tags for p in ps] if tagged else None, sampling=sampling)
      for i, r in zip(idx, res):
        rolls[i].feed(r.text, r.tokens, r.finish)
        n_gen = r.ledger["n_gen"] if r.ledger else len(r.tokens)
        steps[i].append((_measured(rc, used, r.prompt_len, len(r.tokens), r.ledger, r.hbm),
                         r.prompt_len + int(n_gen)))
        last[i] = r.prompt_len
        secs[i][0] += r.prefill_s
        secs[i][1] += r.decode_s
    pending = {}
    for i in live:
      r = rolls[i]
      if not r.done:
        p = task.prompt(r, tagged)
        if len(p.ids) > room:
          r.stop("context full")
        else:
          pending[i] = p
      if r.done and bar is not None:
        bar.update(1)
  if bar is not None:
    bar.close()
  rows = []
  for i, r in enumerate(rolls):
    sc = r.score()
    w = sum(n for _, n in steps[i])
    b = {k: sum(d[k] * n for d, n in steps[i]) / w
         for k in ("prefill_B", "decode_B", "total_B")} if w else \
        {"prefill_B": float("nan"), "decode_B": float("nan"), "total_B": float("nan")}
    rows.append({"id": r.ep.id, "category": r.ep.category, "split": rc.split,
                 "method": rc.method, "budget": rc.budget, "text": "\n".join(r.texts),
                 "calls": r.decoded, "passed": sc["passed"], "per_call": float(sc["passed"]),
                 "error": sc["error"], "finish": "stop" if r.stopped == "done" else r.stopped,
                 "turns": len(r.ep.turns), "turns_run": min(r.turn, len(r.ep.turns)),
                 "answers": r.answers, "prompt_len": last[i], "gen_len": len(r.tokens),
                 "kv_gen_len": len(r.tokens), "kv_tokens": w, **b, "prefill_s": secs[i][0],
                 "decode_s": secs[i][1], "tokens": r.tokens})
  return _finish(s, rc, out, rows, batch, used, time.perf_counter() - t0)


# --- the LM task (teacher forcing through the method's cache) -------------------------------

def _nll(logits, targets):
  import jax
  import jax.numpy as jnp
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]


@functools.lru_cache(maxsize=1)
def _nll_fn():
  import jax
  return jax.jit(_nll)


def run_lm(s: "Session", rc: RunConfig, out: str | None = None, *,
           cases: list | None = None) -> dict:
  """The LM task (W1 of :mod:`calibrate.longctx`: ``s.task`` has ``kind == "lm"``, ``tail``,
  ``length``, ``prompt_ids(case)``, ``forced(case)``) for one (method, budget): per document
  the mean NLL of its last ``tail`` tokens, fed one per step through the runner's forced-token
  path (``advance_logits``) and so read from the method's cache, and the method's measured B;
  writes ``out``/cases.jsonl, summary.csv, summary.json (the harness's files, NLL columns in
  place of accuracy)."""
  import jax
  import jax.numpy as jnp

  from pask_jax import tags as T
  from pask_jax.decode import pad_prompts, runner_hbm
  if rc.temperature > 0:
    raise ValueError("W1 feeds the document's own tokens (teacher forcing): it samples nothing; "
                     "leave the temperature at 0")
  from pask_jax.grammar.matcher import new_bitmask
  from pask_jax.prompt import Prompt
  from pask_jax.sample import how_of
  from pask_jax.tracker import FREE_TAG
  task = s.task
  rc, cases = _resolved(s, rc, cases, "W1 documents")
  K = task.tail
  # The budget-matched baselines plan for ``gen`` generated tokens: here exactly the tail.
  # (a tuned knobs file's per-method ĝ too: the generated length is K, not a dev estimate)
  kn = dict(rc.knobs or {})
  kn.update(gen=float(K), **{rc.method: {**kn.get(rc.method, {}), "gen": float(K)}})
  rc = dataclasses.replace(rc, knobs=kn, max_tokens=K)
  preps = [Prompt("", task.prompt_ids(c), case=c) for c in cases]
  s.ensure_capacity(preps, K)
  batch = batch_size(len(preps), s.batch)
  runner, used = _setup(s, rc, preps, batch)
  B, V = runner.batch, runner.cfg.vocab_size
  nll = _nll_fn()
  rows = []
  t0 = time.perf_counter()
  for st in range(0, len(preps), batch):
    ps = preps[st:st + batch]
    n = len(ps)
    tokens, lengths = pad_prompts([p.ids for p in ps], B, runner.capacity)
    t1 = time.perf_counter()
    logits, state = runner.begin(tokens, lengths, None)
    jax.block_until_ready(logits)
    t2 = time.perf_counter()
    fed = np.zeros((K, B), np.int32)
    tgt = np.zeros((K, B), np.int32)
    for b, p in enumerate(ps):
      f, t = task.forced(p.case)
      fed[:, b], tgt[:, b] = f, t
    bits = jnp.asarray(np.full(new_bitmask(B, V).shape, -1, np.int32))
    tag_ids = jnp.asarray(np.broadcast_to(FREE_TAG, (B, T.N_CAND)).copy())
    state_ids = jnp.full((B,), -1, jnp.int32)
    active = jnp.asarray(np.arange(B) < n)
    temp, top_p = jnp.zeros((B,), jnp.float32), jnp.ones((B,), jnp.float32)
    how = how_of(0.0, 1.0)   # greedy (the tokens are unused): no sampling branch in the step
    key = jax.random.key(0)
    scores = []
    for j in range(K):
      _, logits, state = runner.advance_logits(state, jnp.asarray(fed[j]), tag_ids, state_ids,
                                               active, bits, key, temp, top_p, how)
      scores.append(nll(logits, jnp.asarray(tgt[j])))
    scores = np.asarray(jnp.stack(scores))                           # [K, B]
    t3 = time.perf_counter()
    reports = runner.report(state) or [None] * n
    hbms = runner_hbm(runner, state, reports)
    for b, p in enumerate(ps):
      led = reports[b]
      if led is not None:
        led = {**led, "n_gen": led.get("n_gen", K)}
      meas = _measured(rc, used, len(p.ids), K, led, hbms[b])
      v = scores[:, b].astype(np.float64)
      rows.append({"id": p.case.id, "category": "w1", "split": rc.split, "method": rc.method,
                   "budget": rc.budget, "nll": float(v.mean()), "nll_first_half":
                   float(v[:max(1, K // 2)].mean()), "nll_last_half": float(v[K // 2:].mean())
                   if K > 1 else float(v.mean()), "prompt_len": len(p.ids), "gen_len": K,
                   "kv_gen_len": K, **meas, "prefill_s": t2 - t1, "decode_s": t3 - t2})
  wall = time.perf_counter() - t0
  summ = summarize_lm(rows)
  meta = {"method": rc.method, "budget": rc.budget, "measured_B": summ["overall"]["total_B"],
          "split": rc.split, "model": s.cfg.arch, "model_identity": _ident(s),
          "task": task.name, "n_cases": len(rows), "max_tokens": K, "batch": batch,
          "capacity": s.capacity, "settings": used, "wall_s": wall, "categories": summ,
          "length": task.length, "tail": K, "corpus_sha256": getattr(task, "corpus_sha256", None)}
  if out:
    write_lm(out, rows, meta)
  return meta


LM_FIELDS = ("method", "budget", "split", "category", "n", "nll", "ppl", "nll_first_half",
             "nll_last_half", "prefill_B", "decode_B", "total_B", "total_B_weighted",
             "prompt_len", "gen_len")


def summarize_lm(rows: Sequence[dict]) -> dict[str, dict]:
  """``w1`` and ``overall`` (the same rows): mean NLL per token (documents weigh equally: every
  one scores ``tail`` tokens), its perplexity, and the B means as the harness reports them."""
  out = {}
  for k in ("w1", "overall"):
    v = list(rows)
    mean = lambda f: float(np.mean([r[f] for r in v])) if v else float("nan")
    n_all = sum(r["prompt_len"] + r["kv_gen_len"] for r in v)
    w = sum(r["total_B"] * (r["prompt_len"] + r["kv_gen_len"]) for r in v) / n_all if n_all \
        else float("nan")
    nll = mean("nll")
    out[k] = {"n": len(v), "nll": nll, "ppl": float(math.exp(nll)) if v else float("nan"),
              "nll_first_half": mean("nll_first_half"), "nll_last_half": mean("nll_last_half"),
              "prefill_B": mean("prefill_B"), "decode_B": mean("decode_B"),
              "total_B": mean("total_B"), "total_B_weighted": w, "gen_len": mean("gen_len"),
              "prompt_len": mean("prompt_len"), **hbm_means(v)}
  return out


def write_lm(out: str, rows: Sequence[dict], meta: dict) -> None:
  """:func:`write` with W1's columns (:data:`LM_FIELDS`)."""
  write(out, rows, meta, fields=LM_FIELDS)


def label(budget: float | None) -> str:
  """A requested B as a label: ``0.33``, or ``own`` for a policy run at its own budget."""
  return "own" if budget is None else f"{budget:g}"


def _ident(s: Session) -> dict:
  from pask_jax import policy as P
  return P.identity_of(s.cfg, s.tok.hash())


def _nanmean(xs) -> float:
  """The mean of the numbers that are not NaN (NaN when none is)."""
  a = np.asarray(xs, np.float64)
  a = a[~np.isnan(a)]
  return float(a.mean()) if a.size else float("nan")


def summarize(rows: Sequence[dict]) -> dict[str, dict]:
  """Per category, ``simple+multiple`` and ``overall``: accuracy, per-call and B means."""
  groups: dict[str, list[dict]] = {}
  for r in rows:
    groups.setdefault(r["category"], []).append(r)
  head = [r for r in rows if r["category"] in HEADLINE]
  if head:
    groups["simple+multiple"] = head
  groups["overall"] = list(rows)
  out = {}
  for k, v in groups.items():
    mean = lambda f: _nanmean([r[f] for r in v])
    # a row's tokens: an episode's (W3's multi-turn) are every answer's conversation and output
    tok = lambda r: r.get("kv_tokens", r["prompt_len"] + r["kv_gen_len"])
    n_all = sum(tok(r) for r in v)
    w = sum(r["total_B"] * tok(r) for r in v if tok(r)) / n_all if n_all else float("nan")
    valid = [r["valid"] for r in v if r.get("valid") is not None]
    out[k] = {"n": len(v), "accuracy": mean("passed"), "per_call": mean("per_call"),
              "valid": float(np.mean(valid)) if valid else None,
              "prefill_B": mean("prefill_B"), "decode_B": mean("decode_B"),
              "total_B": mean("total_B"), "total_B_weighted": w,
              "gen_len": mean("gen_len"), "prompt_len": mean("prompt_len"), **hbm_means(v)}
  return out


def hbm_means(rows: Sequence[dict]) -> dict:
  """Mean ``b_HBM`` and ``hbm_bytes_per_token`` over the rows that carry them (a method with
  a kernel path: docs/SPHERICAL_KV.md §4); None where no row does (rows written before the
  fields existed, methods without a kernel path)."""
  out = {}
  for k in ("b_HBM", "hbm_bytes_per_token"):
    xs = [r[k] for r in rows if r.get(k) is not None]
    out[k] = float(np.mean(xs)) if xs else None
  return out


def hbm_cell(d: dict) -> str:
  """A report table's b_HBM cell of a summary ``d``: the mean, or a dash."""
  return "–" if d.get("b_HBM") is None else f"{d['b_HBM']:.3f}"


CSV_FIELDS = ("method", "budget", "split", "category", "n", "accuracy", "per_call", "prefill_B",
              "decode_B", "total_B", "total_B_weighted", "prompt_len", "gen_len")


def write(out: str, rows: Sequence[dict], meta: dict,
          fields: Sequence[str] = CSV_FIELDS) -> None:
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "cases.jsonl"), "w") as f:
    for r in rows:
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
  with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(fields)
    for cat, d in meta["categories"].items():
      w.writerow([meta["method"], label(meta["budget"]), meta["split"], cat] +
                 [_fmt(d[k]) for k in fields[4:]])
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(meta, f, indent=1)
    f.write("\n")


def _fmt(x):
  return f"{x:.4f}" if isinstance(x, float) else x


# --- tuning (development split only) --------------------------------------------------------------

def grid_configs(method: str, grid: str | dict) -> list[dict]:
  g = GRIDS[grid][method] if isinstance(grid, str) else grid[method]
  keys = sorted(g)
  out = [{}]
  for k in keys:
    out = [{**c, k: v} for c in out for v in g[k]]
  return out


# How far over its target a tuned grid point's measured B on dev may lie and still count as
# meeting it (budget matching from prompt lengths and ĝ is not exact: test cells land within ~0.02).
B_SLACK = 0.02


def check_tunable(methods: Sequence[str], grid: str | dict) -> None:
  """One-line ``ValueError`` for a method without a tuning grid (before anything is run)."""
  if isinstance(grid, str) and grid not in GRIDS:
    raise ValueError(f"unknown grid {grid!r}; grids: {sorted(GRIDS)}")
  g = GRIDS[grid] if isinstance(grid, str) else grid
  bad = [m for m in methods if m not in GRIDS["paper"] or m not in g]
  if bad:
    raise ValueError(f"no tuning grid for {', '.join(map(repr, bad))} (tunable: "
                     f"{', '.join(sorted(GRIDS['paper']))}; full and int4 have no knobs to tune "
                     f"against a budget)")


def tune(s: Session, methods: Sequence[str], budget: float | Sequence[float], *,
         grid: str | dict = "small", split: str = "dev", max_cases: int | None = None,
         max_tokens: int = 128, categories: Sequence[str] | None = None, out: str | None = None,
         progress: bool = True, resume: bool = True):
  """Dev-split tuning (paper C.3): measure ``gen`` (mean generated tokens under Full KV), then per
  method pick the grid point with the best overall accuracy at ``budget`` among those whose
  measured B meets it (within ``B_SLACK``; ties: headline accuracy, then measured B closest to
  the target; none meets it: the closest B) and record that point's own mean generated
  length as the method's ``gen`` (its ĝ for budget matching).  Returns (and writes
  ``out``/knobs.json, ``out``/tune.csv) the frozen knobs.

  ``budget`` may be a list: one Full-KV run serves every budget, and each budget's results go to
  ``out``/B<budget>/ (a list of results is returned).  Results are written after every grid point
  (``"complete": false`` until the last), and with ``resume`` a rerun into the same ``out`` with
  the same model, cases, split, grid and max_tokens measures only the points still missing, so a
  search cut short by a time limit goes on where it stopped."""
  if SPLIT_NAMES.get(split) == "test":
    raise ValueError("tuning on the test split is not allowed (C.3: dev only, frozen before test)")
  check_tunable(methods, grid)
  many = not isinstance(budget, (int, float))
  budgets = [BU.check_target(b) for b in (budget if many else [budget])]
  if not budgets:
    raise ValueError("no budget to tune at")
  cases = s.task.cases(split, categories, max_cases)
  # What makes a measured grid point reusable (the grid itself may grow between runs).
  identity = {"model": _ident(s), "task": s.task.name, "split": split, "max_tokens": max_tokens,
              "cases": sorted(f"{c.category}/{c.id}" for c in cases)}
  dirs = [(os.path.join(out, f"B{b:.2f}") if many else out) if out else None for b in budgets]
  logs = [_tune_log(d, identity, b) if resume and d else [] for d, b in zip(dirs, budgets)]
  full = next((r for lg in logs for r in lg if r["method"] == "full"), None)
  if full is None:
    r = run(s, RunConfig("full", 1.0, split, max_tokens=max_tokens), None, progress=progress,
            cases=cases)
    o = r["categories"]["overall"]
    full = {"method": "full", "knobs": "{}", "accuracy": o["accuracy"], "total_B": 1.0,
            "gen": o["gen_len"]}
  results = []
  for b, d, log in zip(budgets, dirs, logs):
    if not any(r["method"] == "full" for r in log):
      log.insert(0, full)
    done = {(r["method"], r["knobs"]) for r in log}
    for m in methods:
      for c in grid_configs(m, grid):
        if (m, json.dumps(c)) in done:
          continue
        kn = merged_knobs({"gen": full["gen"], m: c})
        try:
          r = run(s, RunConfig(m, b, split, max_tokens=max_tokens, knobs=kn), None,
                  progress=progress, cases=cases)
        except ValueError as e:  # e.g. a budget the method cannot reach
          log.append({"method": m, "knobs": json.dumps(c), "error": str(e)})
        else:
          o = r["categories"]["overall"]
          h = r["categories"].get("simple+multiple", o)
          # the method's own mean generated length on dev: its ĝ for budget matching on test
          # (and a calibrated baseline's allocation, frozen with its knobs)
          log.append({"method": m, "knobs": json.dumps(c), "accuracy": o["accuracy"],
                      "headline": h["accuracy"], "total_B": o["total_B"], "gen": o["gen_len"],
                      **({"allocation": r["settings"]["allocation"]}
                         if "allocation" in r["settings"] else {})})
        if d:
          _write_tune(d, tune_result(log, methods, b, split, grid, identity, False))
    res = tune_result(log, methods, b, split, grid, identity, True)
    if d:
      _write_tune(d, res)
    results.append(res)
  return results if many else results[0]


def tune_result(log, methods, budget, split, grid, identity, complete) -> dict:
  """The frozen knobs from the measured grid points in ``log`` (the Full-KV row first, then one
  row per point as :func:`tune` logs them): per method the best point at ``budget``, as
  :func:`tune` chooses it; -> the result :func:`tune` writes to knobs.json."""
  full = log[0]
  knobs = merged_knobs({"gen": full["gen"]})
  # Methods tuned into this folder by an earlier call keep their knobs.
  g = GRIDS[grid] if isinstance(grid, str) else grid
  for m in dict.fromkeys([*methods, *(r["method"] for r in log[1:])]):
    best = None
    points = [json.dumps(c) for c in grid_configs(m, grid)] if m in g else \
        [r["knobs"] for r in log if r["method"] == m]
    for r in log:
      if r["method"] != m or "error" in r or r["knobs"] not in points:
        continue
      # a point that spends more than the budget (a protected sink + recent floor above the
      # target) cannot win on accuracy bought with bytes: over-budget points rank last
      within = r["total_B"] <= budget + B_SLACK
      key = (within, r["accuracy"] if within else -abs(r["total_B"] - budget), r["headline"],
             -abs(r["total_B"] - budget))
      if best is None or key > best[0]:
        frozen = {"allocation": r["allocation"]} if "allocation" in r else {}
        best = (key, {**json.loads(r["knobs"]), "gen": r["gen"], **frozen})
    if best is not None:
      knobs[m].update(best[1])
  return {"knobs": knobs, "budget": budget, "split": split, "grid": grid,
          "n_cases": len(identity["cases"]), "full_accuracy": full["accuracy"],
          "complete": complete, "identity": identity, "log": log}


def _tune_log(d: str, identity: dict, budget: float) -> list[dict]:
  """The grid points already measured in ``d``/knobs.json by a tune with the same identity."""
  p = os.path.join(d, "knobs.json")
  if not os.path.isfile(p):
    return []
  try:
    with open(p) as f:
      prev = json.load(f)
  except (OSError, ValueError):
    return []
  same = prev.get("identity") == json.loads(json.dumps(identity)) and prev.get("budget") == budget
  if not same:
    import sys
    print(f"tune: {p} was measured with other settings; measuring again", file=sys.stderr)
    return []
  return [r for r in prev.get("log", []) if "error" not in r]


def _write_tune(d: str, res: dict) -> None:
  os.makedirs(d, exist_ok=True)
  tmp = os.path.join(d, "knobs.json.tmp")
  with open(tmp, "w") as f:
    json.dump(res, f, indent=1)
    f.write("\n")
  os.replace(tmp, os.path.join(d, "knobs.json"))  # a cut-off write never leaves half a file
  with open(os.path.join(d, "tune.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, ["method", "knobs", "accuracy", "headline", "total_B", "gen", "error"],
                       extrasaction="ignore")
    w.writeheader()
    for row in res["log"]:
      w.writerow(row)


def read_cases(d: str) -> list[dict]:
  """The per-case rows of a run directory (``cases.jsonl`` or ``cases.jsonl.gz``)."""
  import gzip
  for name, opener in (("cases.jsonl", open), ("cases.jsonl.gz", gzip.open)):
    p = os.path.join(d, name)
    if os.path.exists(p):
      with opener(p, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
  raise ValueError(f"{d}: no cases.jsonl(.gz) (not a pask-jax eval run directory)")


# What must agree for runs to be pooled (one method at one operating point).  Settings solved
# from a slice's own prompt lengths to meet the target B (H2O/MiKV ratio, StreamingLLM window, the
# ĝ a rerun re-estimates) may differ between slices, and so may the policy's directory (a path,
# not the policy: its B_D and B_P must agree); they are kept per slice.
_SAME = ("method", "budget", "split", "model_identity", "task", "max_tokens")
_SOLVED = ("ratio", "window", "gen", "policy")


def _fixed(settings: dict) -> dict:
  return {k: v for k, v in (settings or {}).items() if k not in _SOLVED}


def merge(dirs: Sequence[str], out: str) -> dict:
  """Pool runs of ONE configuration over disjoint case slices (e.g. ``--max-cases 80`` and
  ``--skip-cases 80`` on the same split) into one run directory: cases concatenated, summary
  recomputed from them.  Refuses runs whose method, budget, split, model, task, max_tokens or
  resolved settings differ, and cases that occur twice."""
  metas = load_runs(dirs)
  first = metas[0]
  for m in metas[1:]:
    bad = [k for k in _SAME if m.get(k) != first.get(k)]
    if _fixed(m.get("settings")) != _fixed(first.get("settings")):
      bad.append("settings")
    if bad:
      raise ValueError(f"{m['dir']} differs from {first['dir']} in {', '.join(bad)}: "
                       "only runs of one configuration can be merged")
  rows: list[dict] = []
  seen: dict[tuple, str] = {}
  for m in metas:
    for r in read_cases(m["dir"]):
      key = (r["category"], r["id"])
      if key in seen:
        raise ValueError(f"case {r['id']} ({r['category']}) is in both {seen[key]} and "
                         f"{m['dir']}: merge disjoint slices only")
      seen[key] = m["dir"]
      rows.append(r)
  meta = {k: v for k, v in first.items() if k != "dir"}
  lm = bool(rows) and all("nll" in r for r in rows)   # W1 runs (run_lm): NLL, not accuracy
  summ = summarize_lm(rows) if lm else summarize(rows)
  meta.update(n_cases=len(rows), wall_s=float(sum(m.get("wall_s", 0.0) for m in metas)),
              merged_from=[m["dir"] for m in metas],
              settings_by_slice=[m.get("settings") for m in metas], categories=summ,
              measured_B=summ["overall"]["total_B"])
  (write_lm if lm else write)(out, rows, meta)
  return meta


def read_knobs(path: str) -> dict:
  """A knobs.json from :func:`tune` (or a plain knobs dict)."""
  with open(path) as f:
    d = json.load(f)
  return d.get("knobs", d)


# --- report --------------------------------------------------------------------------------------

def load_runs(dirs: Sequence[str]) -> list[dict]:
  out = []
  for d in dirs:
    p = os.path.join(d, "summary.json")
    if not os.path.exists(p):
      raise ValueError(f"{d}: no summary.json (not a pask-jax eval run directory)")
    with open(p) as f:
      out.append({**json.load(f), "dir": d})
  return out


HBM_NOTE = ("\nb_HBM: HBM bytes one decode step reads per generated token (the weights "
            "shared by the batch, every visible row, tables, A1's rebuild traffic) over paged "
            "dense BF16's for the same tokens, mean over cases (docs/SPHERICAL_KV.md §4); – : "
            "no kernel path (masked baselines) or cases written before it was recorded.\n")


def report(dirs: Sequence[str] | None, out: str, *, runs: Sequence[dict] | None = None) -> str:
  """Markdown table + PNG of headline (simple+multiple) accuracy against measured total B, of the
  run directories ``dirs`` or of ``runs`` already loaded (summary dicts, e.g. pooled cells of
  :mod:`calibrate.campaign`).  Accuracies carry ±1 binomial standard error and n; W2 runs
  (:func:`is_em`) show exact match, overall and per hop, in place of the BFCL columns.  Runs of the
  LM task (W1: NLL, no accuracy) get their own table and NLL-vs-B plot (:func:`report_lm`); the
  two kinds do not share one report."""
  runs = load_runs(dirs) if runs is None else list(runs)
  lm = [is_lm(r) for r in runs]
  if runs and all(lm):
    return report_lm(runs, out)
  if any(lm):
    raise ValueError("W1 (NLL) runs and accuracy runs cannot share one report: report them "
                     "separately")
  runs.sort(key=row_order)
  cats = [c for c in ("simple_python", "multiple", "parallel", "parallel_multiple", "hop1",
                      "hop2") if any(c in r["categories"] for r in runs)]
  em = is_em(runs)   # W2: exact match per hop and overall, no BFCL headline
  head = ["method", "target B", "measured B (prefill / decode / total)"] + \
      (["EM ± s.e."] if em else ["simple+multiple ± s.e.", "overall ± s.e."]) + cats + \
      [f"{c} per-call" for c in cats if c.startswith("parallel")] + \
      (["n"] if em else ["n (simple+multiple / all)"]) + ["b_HBM"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  over = 0
  pct = lambda d, k="accuracy": f"{100 * d[k]:.2f}" if d else "–"
  se = lambda d: f"{pct(d)} ± {100 * binomial_se(d['accuracy'], d['n']):.2f}" if d else "–"
  for r in runs:
    c = r["categories"]
    o, h = c["overall"], c.get("simple+multiple")
    spent = f"{o['prefill_B']:.3f} / {o['decode_B']:.3f} / {o['total_B']:.3f}"
    if over_budget(r):
      over += 1
      spent += " **over**"
    row = [r["method"], "–" if is_full(r) else
           "policy's own" if r["budget"] is None else f"{r['budget']:.2f}",
           spent] + ([se(o)] if em else [se(h), se(o)]) + [pct(c.get(k)) for k in cats]
    row += [pct(c.get(k), "per_call") for k in cats if k.startswith("parallel")]
    row += [str(o["n"])] if em else [f"{h['n'] if h else '–'} / {o['n']}"]
    row += [hbm_cell(o)]
    lines.append("| " + " | ".join(row) + " |")
  md = "\n".join(lines) + "\n" + HBM_NOTE
  if over:
    md += (f"\n**over**: measured total B above the target by more than {B_SLACK} (the method "
           f"has no setting that reaches it on these cases); its accuracy is bought with bytes "
           f"the budget does not allow.\n")
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "report.md"), "w") as f:
    f.write(md)
  plot_runs(runs, os.path.join(out, "accuracy_vs_B.png"))
  return md


def is_lm(run: dict) -> bool:
  """Whether a loaded run (summary dict) is of the LM task (W1: NLL, not accuracy)."""
  return "nll" in run["categories"]["overall"]


def is_em(runs: Sequence[dict]) -> bool:
  """Whether runs are of W2 (needle retrieval: their accuracy is exact match of the code)."""
  return bool(runs) and all(str(r.get("task", "")).startswith("w2:") for r in runs)


def plot_name(runs: Sequence[dict]) -> str:
  """The file name :func:`report` gives the plot of ``runs``."""
  return "nll_vs_B.png" if runs and all(is_lm(r) for r in runs) else "accuracy_vs_B.png"


def report_lm(runs: Sequence[dict], out: str) -> str:
  """W1's table (method, target and measured B, NLL per token, perplexity, n; per run the
  length and tail) and NLL against measured total B (``out``/report.md, ``out``/nll_vs_B.png)."""
  runs = sorted(runs, key=row_order)
  head = ["method", "target B", "measured B (prefill / decode / total)", "NLL / token", "ppl",
          "length / tail", "n", "b_HBM"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in runs:
    o = r["categories"]["overall"]
    lines.append("| " + " | ".join([
        r["method"], "–" if is_full(r) else label(r["budget"]),
        f"{o['prefill_B']:.3f} / {o['decode_B']:.3f} / {o['total_B']:.3f}", f"{o['nll']:.4f}",
        f"{o['ppl']:.3f}", f"{r.get('length', '?')} / {r.get('tail', '?')}", str(o["n"]),
        hbm_cell(o)]) + " |")
  md = "\n".join(lines) + "\n" + HBM_NOTE
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "report.md"), "w") as f:
    f.write(md)
  try:
    import matplotlib
  except ImportError:
    return md
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.4, 4.4))
  by: dict[str, list] = {}
  for r in runs:
    o = r["categories"]["overall"]
    by.setdefault("full" if is_full(r) else r["method"], []).append((o["total_B"], o["nll"]))
  for m, pts in by.items():
    pts.sort()
    if m == "full":
      ax.axhline(pts[0][1], color="k", ls="--", lw=1, label="Full KV")
      continue
    ax.plot(*zip(*pts), marker="o", label=m)
  ax.set_xlabel("measured relative total KV cost B")
  ax.set_ylabel("NLL per token (last tail tokens)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "nll_vs_B.png"), dpi=130)
  plt.close(fig)
  return md


def is_full(run: dict) -> bool:
  """Whether a run is Full KV, whatever its row is called (a plan's label, a sampling seed)."""
  return run.get("base_method", run.get("method")) == "full"


def row_order(r: dict) -> tuple:
  """A report row's place: by method (the registry's order), target budget, row name."""
  m = r.get("base_method", r["method"])
  return (BL.METHODS.index(m) if m in BL.METHODS else 99, r["budget"] or 0.0, r["method"])


def over_budget(run: dict) -> bool:
  """Whether a run's measured total B lies above its target budget by more than ``B_SLACK`` (a
  method whose floor — a protected sink and recent window, prefill-only compression — exceeds
  the target).  Full KV and runs without a target never are."""
  b = run.get("budget")
  return (not is_full(run) and b is not None and b < 1.0
          and run["categories"]["overall"]["total_B"] > b + B_SLACK)


def binomial_se(p: float, n: int) -> float:
  """Standard error of an accuracy ``p`` measured on ``n`` cases: sqrt(p (1 - p) / n)."""
  return float(np.sqrt(p * (1 - p) / n)) if n else float("nan")


def _fit(lo: float, hi: float, pad: float, floor: float, bounds: tuple[float, float]):
  """Axis limits around [lo, hi]: ``pad`` of the span on each side (at least ``floor``), clipped
  to ``bounds``."""
  m = max((hi - lo) * pad, floor)
  return max(bounds[0], lo - m), min(bounds[1], hi + m)


def plot_runs(runs: list[dict], path: str) -> dict | None:
  """Headline accuracy (simple + multiple; overall when absent) against measured total B, with
  binomial standard-error bars (sqrt(p (1 - p) / n), n the headline cases of that run) and axes
  fitted to the data (Full KV is a line with its ±1 s.e. band).  Returns what it drew."""
  try:
    import matplotlib
  except ImportError:  # the table and CSVs are still written; plot later where matplotlib is
    print(f"matplotlib is not installed: {path} not written")
    return None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.4, 4.4))
  by: dict[str, list] = {}
  for r in runs:   # a sampled table's seeds of one method and budget: one series
    c = r["categories"]
    h = c.get("simple+multiple", c["overall"])
    by.setdefault("full" if is_full(r) else r.get("series", r["method"]), []).append(
        (c["overall"]["total_B"], 100 * h["accuracy"], 100 * binomial_se(h["accuracy"], h["n"])))
  drawn: dict[str, Any] = {"series": {}}
  xs_all, lo_y, hi_y = [], [], []
  for m, pts in by.items():
    pts.sort()
    xs, ys, es = (list(v) for v in zip(*pts))
    if m == "full":   # several (sampling seeds): their mean and largest s.e.
      y, e = float(np.mean(ys)), max(es)
      ax.axhline(y, color="k", ls="--", lw=1, label="Full KV (±1 s.e.)")
      ax.axhspan(y - e, y + e, color="k", alpha=0.08, lw=0)
      lo_y.append(y - e)
      hi_y.append(y + e)
      drawn["series"]["Full KV"] = ([], [y], [e])
      continue
    label = {"pask": "PASK"}.get(m, m)
    ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label)
    drawn["series"][label] = (xs, ys, es)
    xs_all += xs
    lo_y += [y - e for y, e in zip(ys, es)]
    hi_y += [y + e for y, e in zip(ys, es)]
  if xs_all:
    ax.set_xlim(*_fit(min(xs_all), max(xs_all), 0.08, 0.02, (0.0, 1.05)))
  if lo_y:
    ax.set_ylim(*_fit(min(lo_y), max(hi_y), 0.06, 1.0, (0.0, 100.0)))
  drawn["xlim"], drawn["ylim"] = ax.get_xlim(), ax.get_ylim()
  ax.set_xlabel("measured relative total KV cost B")
  ax.set_ylabel("exact match (%)" if is_em(runs) else "accuracy, simple + multiple (%)"
                if any("simple+multiple" in r["categories"] for r in runs) else "accuracy (%)")
  ax.set_title("error bars: ±1 binomial standard error", fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)
  return drawn
