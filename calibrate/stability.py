"""Stability of a method's generations against the Full-KV (dense) run of the same cases: the G5
metrics of docs/SPHERICAL_KV.md §4, from the per-case rows an evaluation stores
(``cases.jsonl`` of ``pask-jax eval`` and of campaign cells).  Pure functions over rows.

Cases are matched by (category, id); over the matched cases:

* **length drift** Δ_tok = (generated tokens − dense's) / max(dense's, 1) per case: the median
  of |Δ_tok| and the signed mean;
* **greedy trajectory disagreement**: the fraction of cases whose generated tokens differ from
  dense's, and the median first-divergence position (the first index where the two token lists
  differ, or the shorter length when one is a prefix of the other) over the cases that differ.
  Rows written before the token ids were stored (``tokens`` absent) compare their texts, and
  give no divergence position;
* **failure counts**: *looping* — the run did not stop by itself (``finish`` is not ``stop``)
  and its text ends in one unit of at most :data:`LOOP_PERIOD` characters repeated: a periodic
  tail at least :data:`LOOP_REPEATS` periods and :data:`LOOP_CHARS` characters long (the last
  period may be cut); *early stop* — fewer than :data:`EARLY` × dense's generated tokens;
  *malformed call* — where the task scores tool calls, an output that parses to no call
  (unparseable, or cut off at max_tokens: ``calls`` is null); *derailed* — where both outputs
  parse to calls, the method's call a different multiset of functions than dense's (another
  tool, or another number of calls) **[ours: §4 names derailment without defining it; a
  grammar-constrained call cannot leave the tool format, so derailment is choosing another
  course of action than dense did]**; *invalid* — where the task scores tool calls and the rows
  say (``valid``, written since schema validity was added), an output whose calls do not parse
  and validate against the case's tool schemas (:func:`pask_jax.grammar.call_problem`): §4's
  schema validity, which an unconstrained run (``pask-jax eval --unconstrained``, a campaign
  split's ``constrained = false``) measures; under the grammar only a cut-off output is invalid.

Runs that sample (``pask-jax eval --temperature``, a campaign split's ``sampling``) compare
each seed's run with Full KV's run of the same seed (the sampling key is the same, so the two
draw the same noise where their distributions agree), and :func:`seed_disagreement` measures
§4's **seed disagreement**: the fraction of cases whose generated tokens are not the same
under every seed — a method's own trajectory instability, compared in the report with Full
KV's (G5: at most Full KV's + 5 points).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

LOOP_PERIOD = 64    # longest repeated unit, in characters
LOOP_REPEATS = 4    # a looping tail spans at least this many periods ...
LOOP_CHARS = 16     # ... and at least this many characters
EARLY = 0.5         # early stop: fewer than this fraction of dense's generated tokens


def periodic_tail(text: str, period: int) -> int:
  """Length of the longest suffix of ``text`` with period ``period`` (every character equal to
  the one ``period`` places after it, within the suffix)."""
  if period < 1:
    raise ValueError(f"period must be >= 1, got {period}")
  n = len(text)
  if n <= period:
    return n
  j = n - period - 1
  while j >= 0 and text[j] == text[j + period]:
    j -= 1
  return n - 1 - j


def looping(text: str, finish: str | None = None) -> bool:
  """Whether an output is stuck in a loop (module docstring): not stopped by itself, and its
  text ends in a unit of 1..:data:`LOOP_PERIOD` characters repeated over at least
  :data:`LOOP_REPEATS` periods and :data:`LOOP_CHARS` characters."""
  if finish == "stop":
    return False
  for p in range(1, min(LOOP_PERIOD, len(text) // LOOP_REPEATS) + 1):
    if periodic_tail(text, p) >= max(LOOP_REPEATS * p, LOOP_CHARS):
      return True
  return False


def first_divergence(a: Sequence, b: Sequence) -> int | None:
  """The first index where ``a`` and ``b`` differ (the shorter length when one is a prefix of
  the other); None when they are equal."""
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def compare(rows: Sequence[dict], dense: Sequence[dict], *, calls: bool) -> dict | None:
  """The stability of ``rows`` (one run's per-case rows) against ``dense`` (the Full-KV run's)
  over the cases both hold; ``calls``: the task scores tool calls (malformed calls counted).
  None when no case is shared.  Keys: n, dtok_abs_median, dtok_mean, disagree (fraction),
  diverge_median (tokens; None without token ids or without a differing case), by_tokens
  (every pair compared by token ids), looping, early_stop, malformed and derailed (None when
  ``calls`` is off), invalid (None when ``calls`` is off or a row does not say)."""
  ref = {(d["category"], d["id"]): d for d in dense}
  pairs = [(r, ref[(r["category"], r["id"])]) for r in rows if (r["category"], r["id"]) in ref]
  if not pairs:
    return None
  drift = [(r["gen_len"] - d["gen_len"]) / max(d["gen_len"], 1) for r, d in pairs]
  differ, where = 0, []
  by_tokens = all("tokens" in r and "tokens" in d for r, d in pairs)
  for r, d in pairs:
    if "tokens" in r and "tokens" in d:
      i = first_divergence(r["tokens"], d["tokens"])
      if i is not None:
        differ += 1
        where.append(i)
    elif r["text"] != d["text"]:
      differ += 1
  return {"n": len(pairs),
          "dtok_abs_median": float(np.median(np.abs(drift))),
          "dtok_mean": float(np.mean(drift)),
          "disagree": differ / len(pairs),
          "diverge_median": float(np.median(where)) if where else None,
          "by_tokens": by_tokens,
          "looping": sum(looping(r["text"], r.get("finish")) for r, _ in pairs),
          "early_stop": sum(r["gen_len"] < EARLY * d["gen_len"] for r, d in pairs),
          "malformed": sum(r.get("calls") is None for r, _ in pairs) if calls else None,
          "derailed": sum(_names(r) != _names(d) for r, d in pairs
                          if r.get("calls") is not None and d.get("calls") is not None)
          if calls else None,
          "invalid": sum(not r["valid"] for r, _ in pairs)
          if calls and all(r.get("valid") is not None for r, _ in pairs) else None}


def _names(row: dict) -> list[str]:
  """The functions a row's parsed calls name, sorted (a call is ``{name: arguments}``)."""
  out = []
  for c in row["calls"] if isinstance(row["calls"], list) else [row["calls"]]:
    out += sorted(c) if isinstance(c, dict) else [repr(c)]
  return sorted(out)


def seed_disagreement(runs: Sequence[Sequence[dict]]) -> dict | None:
  """Over the cases every run of ``runs`` holds (one run per sampling seed of one method and
  budget: its per-case rows), the fraction whose generated tokens (texts for rows without
  token ids) differ between at least two seeds.  None for fewer than two runs or no shared
  case.  Keys: seeds, n, disagree."""
  if len(runs) < 2:
    return None
  by = [{(r["category"], r["id"]): r for r in rs} for rs in runs]
  shared = set(by[0]).intersection(*by[1:])
  if not shared:
    return None
  out = lambda r: tuple(r["tokens"]) if "tokens" in r else r["text"]
  differ = sum(len({out(b[k]) for b in by}) > 1 for k in shared)
  return {"seeds": len(runs), "n": len(shared), "disagree": differ / len(shared)}


FIELDS = ("n", "dtok_abs_median", "dtok_mean", "disagree", "diverge_median", "looping",
          "early_stop", "malformed", "derailed", "invalid")
HEAD = ("n", "median \\|Δ_tok\\|", "mean Δ_tok", "disagreement", "median first divergence",
        "looping", "early stop", "malformed", "derailed", "invalid")


def cells(s: dict | None) -> list[str]:
  """One row's stability as markdown table cells (:data:`HEAD`; – where not measured)."""
  if s is None:
    return ["–"] * len(HEAD)
  pct = lambda x, sign="": f"{100 * x:{sign}.1f}%"
  div = s["diverge_median"]
  return [str(s["n"]), pct(s["dtok_abs_median"]), pct(s["dtok_mean"], "+"),
          pct(s["disagree"]) + ("" if s["by_tokens"] else " (text)"),
          "–" if div is None or (isinstance(div, float) and math.isnan(div)) else f"{div:g}",
          str(s["looping"]), str(s["early_stop"]),
          "–" if s["malformed"] is None else str(s["malformed"]),
          "–" if s.get("derailed") is None else str(s["derailed"]),
          "–" if s.get("invalid") is None else str(s["invalid"])]


__all__ = ["EARLY", "FIELDS", "HEAD", "LOOP_CHARS", "LOOP_PERIOD", "LOOP_REPEATS", "cells",
           "compare", "first_divergence", "looping", "periodic_tail", "seed_disagreement"]
