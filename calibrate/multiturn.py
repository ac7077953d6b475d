"""W3's multi-turn episodes (docs/SPHERICAL_KV.md §4, "BFCL ``multi_turn_base`` /
``multi_turn_long_context`` … for rollouts"): BFCL's multi-turn cases run as episodes against
the simulated APIs shipped in bfcl-eval, scored by its multi-turn checker.

An episode is a conversation of user turns over the tools of its API classes (GorillaFileSystem,
TwitterAPI, …, the function docs bfcl-eval ships for them).  Per turn the model answers; while
its answer holds calls (the tool-call grammar with ``choice="auto"``: free text, or call blocks
in the model's format), the calls run against the episode's API instances (bfcl-eval's
``execute_multi_turn_func_call``), their results come back as ``tool`` messages and the model
answers again until an answer holds no call; then the next user turn comes.  A turn with more
than :data:`MAX_STEPS` answers holding calls ends the episode, failed (BFCL forces the model to
quit there).  Every answer is a fresh generation over the
whole conversation so far (the method compresses the conversation's cache as it would a prompt),
as BFCL's own harness queries a model.  The checker (``multi_turn_checker``) replays the calls of
every turn on fresh instances and compares the instances' state and the calls' results with the
ground truth's, turn by turn.

Splits: each category's episodes in the order of ``sha256(f"{seed}:{id}")``, cut 1:1:3 into
calibration, development and test (:func:`calibrate.bfcl.targets`, the single-turn rule's
sizes) **[ours: multi-turn cases share no tool-set key to group by, unlike the single-turn
split]**.  An answer cut off at ``max_tokens`` or by the context (``length``) ends the turn as an
answer without calls; an episode whose conversation no longer fits ``length`` ends there.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import re
from collections.abc import Sequence
from typing import Any

CATEGORIES = ("multi_turn_base", "multi_turn_long_context")
MAX_STEPS = 20     # answers per turn (bfcl_eval.constants.default_prompts.MAXIMUM_STEP_LIMIT)
MAX_CALLS = 8      # call blocks per answer
_RUNS = itertools.count()   # rollouts of this process: their API instances never share a name
SPLIT_NAMES = {"cal": "calibration", "dev": "development", "test": "test",
               "calibration": "calibration", "development": "development"}


@dataclasses.dataclass(frozen=True)
class Episode:
  id: str
  category: str
  split: str
  turns: tuple          # per user turn: its messages
  tools: tuple          # OpenAI-style JSON-schema tools of the episode's API classes
  ground_truth: tuple   # per turn: the ground-truth calls (BFCL's call strings)
  entry: dict = dataclasses.field(repr=False, compare=False)   # the BFCL entry (the checker's)

  @property
  def key(self) -> str:
    """The tool set (episodes sharing one share a compiled grammar)."""
    return ",".join(sorted(self.entry["involved_classes"]))


@functools.lru_cache(maxsize=None)
def _read(category: str) -> tuple[Episode, ...]:
  from calibrate import bfcl
  bfcl.checker()   # bfcl-eval importable offline (the model_config stand-in)
  from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING
  d = bfcl.data_dir()
  docs = {}
  for cls, name in MULTI_TURN_FUNC_DOC_FILE_MAPPING.items():
    path = os.path.join(d, "multi_turn_func_doc", name)
    if os.path.isfile(path):
      with open(path) as f:
        docs[cls] = [json.loads(l) for l in f if l.strip()]
  with open(os.path.join(d, "possible_answer", f"BFCL_v4_{category}.json")) as f:
    truth = {r["id"]: r["ground_truth"] for r in map(json.loads, filter(str.strip, f))}
  out = []
  with open(os.path.join(d, f"BFCL_v4_{category}.json")) as f:
    for r in map(json.loads, filter(str.strip, f)):
      fns = [fn for c in r["involved_classes"] for fn in docs[c]]
      out.append(Episode(r["id"], category, "", tuple(tuple(t) for t in r["question"]),
                         tuple(bfcl.to_tools(fns)), tuple(tuple(t) for t in truth[r["id"]]),
                         r))
  return tuple(out)


def load(categories: Sequence[str] = CATEGORIES, *, split: str | None = None,
         seed: int = 0) -> list[Episode]:
  """The episodes of ``categories`` with their partition (module docstring), in file order;
  optionally only ``split`` (cal/dev/test or the long names).  One-line ValueError for an
  unknown category or split."""
  from calibrate import bfcl
  bad = [c for c in categories if c not in CATEGORIES]
  if bad:
    raise ValueError(f"multi-turn categories are {', '.join(CATEGORIES)}, got {', '.join(bad)}")
  if split is not None and split not in SPLIT_NAMES:
    raise ValueError(f"unknown split {split!r}; choose from cal, dev, test")
  out = []
  for cat in categories:
    eps = _read(cat)
    order = sorted(range(len(eps)),
                   key=lambda i: hashlib.sha256(f"{seed}:{eps[i].id}".encode()).hexdigest())
    a, b, _ = bfcl.targets(len(eps))
    part = {}
    for rank, i in enumerate(order):
      part[i] = bfcl.SPLITS[0 if rank < a else 1 if rank < a + b else 2]
    out += [dataclasses.replace(e, split=part[i]) for i, e in enumerate(eps)]
  if split is not None:
    out = [e for e in out if e.split == SPLIT_NAMES[split]]
  return out


def call_text(call: dict) -> str:
  """``{"name", "arguments"}`` -> the call string bfcl-eval executes and checks
  (``name(k=repr(v),…)``, its handlers' ``convert_to_function_call``)."""
  return f"{call['name']}(" + ",".join(f"{k}={v!r}" for k, v in call["arguments"].items()) + ")"


def _instances() -> dict:
  from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
  return vars(multi_turn_utils)


def held(prefix: str = "") -> list[str]:
  """The names of the API instances bfcl-eval holds (as its module's globals) that start with
  ``prefix``: a finished or failed run leaves none of its own."""
  return sorted(k for k, v in list(_instances().items())
                if k.startswith(prefix) and k.endswith("_instance") and not callable(v))


def _forget(prefix: str) -> None:
  """Drop the API instances bfcl-eval keeps (as module globals) for names starting ``prefix``."""
  g = _instances()
  for k in [k for k in g if k.startswith(prefix)]:
    del g[k]


class Rollout:
  """One episode as it runs: the conversation so far, the calls of every answer per turn, the
  generated tokens.  ``name``: a tag unique to the rollout (bfcl-eval keeps each episode's API
  instances in its module's globals under the model name and the episode id; :meth:`score`
  and :meth:`free` drop them)."""

  def __init__(self, ep: Episode, name: str, *, fmt: str, indent: int | None,
               takes_calls: bool, max_steps: int = MAX_STEPS):
    self.ep, self.fmt, self.indent, self.takes_calls = ep, fmt, indent, takes_calls
    self.name = re.sub(r"[^A-Za-z0-9_]", "_", name)
    self.max_steps = max_steps
    self.messages: list[dict] = list(ep.turns[0]) if ep.turns else []
    self.turn, self.step = 0, 0
    self.decoded: list[list[list[str]]] = [[] for _ in ep.turns]
    self.tokens: list[int] = []
    self.texts: list[str] = []
    self.answers = 0
    self.stopped: str | None = None if ep.turns else "done"   # why the episode ended early
    self._n = 0   # call ids

  @property
  def done(self) -> bool:
    return self.stopped is not None

  def feed(self, text: str, tokens: Sequence[int], finish: str) -> None:
    """The model's answer to the conversation so far (``finish``: generate's reason)."""
    from pask_jax.grammar.toolcall import render_calls, split_calls
    self.tokens += [int(t) for t in tokens]
    self.texts.append(text)
    self.answers += 1
    content, calls = split_calls(text, self.fmt) if finish == "stop" else (text, [])
    if not calls:
      self.messages.append({"role": "assistant", "content": content or ""})
      self._next_turn()
      return
    strings = [call_text(c) for c in calls]
    self.decoded[self.turn].append(strings)
    results = self._execute(strings)
    ids = [f"call_{self._n + k}" for k in range(1, len(calls) + 1)]
    self._n += len(calls)
    if self.takes_calls:
      msg = {"role": "assistant", "content": content or "",
             "tool_calls": [{"id": i, "type": "function",
                             "function": {"name": c["name"], "arguments": c["arguments"]}}
                            for i, c in zip(ids, calls)]}
    else:   # the template cannot render calls: the text as the model wrote them
      msg = {"role": "assistant", "content": (content + "\n" if content else "")
             + render_calls(calls, self.fmt, self.indent)}
    self.messages.append(msg)
    self.messages += [{"role": "tool", "content": r, "tool_call_id": i, "name": c["name"]}
                      for i, c, r in zip(ids, calls, results)]
    self.step += 1
    if self.step >= self.max_steps:   # BFCL forces the model to quit and fails the episode
      self.stop("step limit")

  def free(self) -> None:
    """Drop the API instances bfcl-eval keeps for this rollout (and for the checker's replay)."""
    _forget(self.name)

  def stop(self, why: str) -> None:
    """End the episode here (e.g. the conversation no longer fits the context)."""
    self.stopped = why

  def _next_turn(self) -> None:
    self.turn, self.step = self.turn + 1, 0
    if self.turn >= len(self.ep.turns):
      self.stopped = "done"
    else:
      self.messages += list(self.ep.turns[self.turn])

  def _execute(self, strings: list[str]) -> list[str]:
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import (
        execute_multi_turn_func_call)
    e = self.ep.entry
    results, _ = execute_multi_turn_func_call(
        strings, e["initial_config"], e["involved_classes"], self.name, self.ep.id,
        long_context="long_context" in self.ep.category)
    return [str(r) for r in results]

  def score(self) -> dict:
    """bfcl-eval's multi-turn checker over the calls of every turn: {passed, error}; frees the
    API instances of the episode and of the checker's replay."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
    if self.stopped == "step limit":
      self.free()
      return {"passed": False, "error": f"multi_turn:force_quit: more than {self.max_steps} "
                                        f"answers with calls in turn {self.turn}"}
    try:
      r = multi_turn_checker(self.decoded, [list(t) for t in self.ep.ground_truth],
                             self.ep.entry, self.ep.category, self.name)
    finally:
      self.free()
    err = "" if r["valid"] else f"{r.get('error_type', '')}: {r.get('error_message', '')}"
    return {"passed": bool(r["valid"]), "error": err[:500]}


class EpisodeSuite:
  """W3's multi-turn episodes as a harness task (``kind == "episodes"``: the harness runs
  :func:`calibrate.evaluate.run`'s episode loop): cases, the prompt of a rollout's conversation
  and the grammar of its answers.  ``length``: the context an episode may fill."""
  kind = "episodes"
  tool_calls = True

  def __init__(self, tokenizer, arch: str, compiler, *, length: int, seed: int = 0):
    from pask_jax.prompt import style, takes_calls
    self.tok, self.arch, self.compiler, self.length, self.seed = (tokenizer, arch, compiler,
                                                                  length, seed)
    self.name = f"w3mt:L{length}"
    self.fmt, self.indent = style(arch)
    self.takes_calls = takes_calls(tokenizer)
    self._grammars: dict[str, Any] = {}

  def cases(self, split: str, categories: Sequence[str] | None = None,
            max_cases: int | None = None, skip: int = 0) -> list[Episode]:
    from calibrate.evaluate import cap_per_category
    eps = load(tuple(categories) if categories else CATEGORIES, split=split, seed=self.seed)
    return cap_per_category(eps, max_cases, skip)

  def materialize(self, stubs: Sequence[Episode]) -> list[Episode]:
    return list(stubs)

  def rollout(self, ep: Episode, name: str = "pask") -> Rollout:
    """A new rollout of ``ep``, its API instances under a name no other rollout of the process
    has."""
    return Rollout(ep, f"{name}_{next(_RUNS)}", fmt=self.fmt, indent=self.indent,
                   takes_calls=self.takes_calls)

  def prompt(self, r: Rollout, labels: bool = False):
    """The rollout's conversation so far as a :class:`pask_jax.prompt.Prompt` for the model's
    next answer (its grammar, and with ``labels`` PASK's prompt-span tags)."""
    from pask_jax.prompt import Prompt, encode, render
    text = render(self.tok, r.messages, tools=list(r.ep.tools), fmt=self.fmt, choice="auto",
                  merge=True)
    ids, tags = encode(self.tok, text, labels)
    return Prompt(text, ids, tags, self.grammar(r.ep), list(r.ep.tools), self.fmt, r.ep)

  def grammar(self, ep: Episode):
    """The answer's grammar: free text or call blocks of the episode's tools (choice auto)."""
    g = self._grammars.get(ep.key)
    if g is None:
      from pask_jax.grammar.toolcall import tool_call_grammar
      g = self._grammars[ep.key] = tool_call_grammar(
          self.compiler, list(ep.tools), self.fmt, max_calls=MAX_CALLS, indent=self.indent,
          choice="auto")
    return g


__all__ = ["CATEGORIES", "Episode", "EpisodeSuite", "MAX_CALLS", "MAX_STEPS", "Rollout",
           "call_text", "held", "load"]
