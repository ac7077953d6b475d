"""TriAxialKV's calibration (:mod:`pask_jax.baselines.triaxial`): per-tag attention-output
distortion on Full-KV reference trajectories of the calibration split, then the budget-constrained
allocation.  Only the calibration split is read; the allocation is frozen before the development
and test runs that use it.

References: the calibration cases, prepared with the PASK prompt labels, generated greedily under
Full KV with the structural-tag adapter (the same tags the runner sees at evaluation time).  They
and their distortion tables (per prefix, window and width) are kept in a :class:`Calibration` on
the evaluation session, so a tuning grid computes each table once.
"""
from __future__ import annotations

import numpy as np

from pask_jax import tags as T
from pask_jax.baselines import triaxial as TX

SPLIT = "cal"
BATCH = 8          # references per captured forward


class Calibration:
  """The references of one session (split ``cal``, one max_tokens and case cap) and their
  distortion tables by (prefix, window) and width."""

  def __init__(self, seqs: list[list[int]], cands: list[np.ndarray], n_prompt: list[int]):
    self.seqs, self.cands, self.n_prompt = seqs, cands, n_prompt
    self.tables: dict[tuple[int, int], dict[int, dict]] = {}   # (prefix, window) -> width -> D
    units = sorted({int(u) for c in cands for u in TX.single(c) if u >= 0})
    self.units = units
    index = {u: a for a, u in enumerate(units)}
    self.unit_of = [np.array([index.get(int(u), -1) for u in TX.single(c)], np.int32)
                    for c in cands]

  def distortions(self, model, prefix: int, window: int, widths: tuple[int, ...]) -> dict:
    """``{(tag id, group, width): D}`` summed over the references, for ``widths`` (cached per
    prefix, window and width: a tuning grid computes each once)."""
    have = self.tables.setdefault((prefix, window), {})
    todo = tuple(w for w in sorted(set(widths)) if w not in have)
    if todo:
      have.update(zip(todo, self._compute(model, prefix, window, todo)))
    return {k: v for w in widths for k, v in have[w].items()}

  def _compute(self, model, prefix: int, window: int, widths: tuple[int, ...]) -> list[dict]:
    from calibrate.distortion import capture
    cfg = model.cfg
    G = 3
    group_of = T.group_of_layer(cfg.n_layers, G)
    tot = np.zeros((len(self.units), len(widths), G), np.float64)
    U = max(32, -(-max(len(s) - p for s, p in zip(self.seqs, self.n_prompt)) // 32) * 32)
    for s in range(0, len(self.seqs), BATCH):
      part = list(range(s, min(s + BATCH, len(self.seqs))))
      caps = capture(model, [self.seqs[i] for i in part], bucket=256)
      for i, (q, k, v) in zip(part, caps):
        tot += TX.distortion(q, k, v, self.unit_of[i], self.n_prompt[i], prefix=prefix,
                             window=window, widths=widths, n_units=len(self.units),
                             group_of=group_of, n_groups=G, U=U)
    return [{(u, g, w): float(tot[a, wi, g]) for a, u in enumerate(self.units) for g in range(G)}
            for wi, w in enumerate(widths)]


def references(session, *, max_tokens: int, max_cases: int | None = None) -> Calibration:
  """Full-KV greedy generations of the calibration split with their tag candidates."""
  from calibrate.stack import Recorder
  from pask_jax.decode import Sampling, generate
  from pask_jax.grammar.fc_adapter import FCAdapter
  cases = session.task.cases(SPLIT, None, max_cases)
  if not cases:
    raise ValueError("triaxial calibration: the calibration split has no cases")
  preps = session.task.prepare(cases, prompt_labels=True)
  session.ensure_capacity(preps, max_tokens)
  k = -(-len(preps) // session.batch)          # as few balanced batches as the session allows
  batch = -(-len(preps) // k)
  runner = session.runner("full", batch)
  seqs, cands, n_prompt = [], [], []
  for s in range(0, len(preps), batch):
    ps = preps[s:s + batch]
    recs = [Recorder(p.grammar, FCAdapter(p.grammar, session.tok)) for p in ps]
    res = generate(runner, session.tok, [p.ids for p in ps], trackers=recs,
                   sampling=Sampling(max_tokens=max_tokens))
    for p, r, rec in zip(ps, res, recs):
      n = len(p.ids)
      pt = (np.asarray(p.tags, np.int32) if p.tags is not None
            else np.full((n, T.N_CAND), T.PAD, np.int32))
      gt = np.asarray(rec.tags[:len(r.tokens)], np.int32).reshape(-1, T.N_CAND)
      seqs.append(list(p.ids) + list(r.tokens))
      cands.append(np.concatenate([pt, gt]))
      n_prompt.append(n)
  return Calibration(seqs, cands, n_prompt)


def calibrate(session, knobs: TX.Knobs, budget: float, *, max_tokens: int,
              max_cases: int | None = None) -> dict:
  """The frozen allocation for ``knobs`` at target ``budget`` (references and distortion tables
  cached on the session)."""
  key = (max_tokens, max_cases)
  cal = session.calibrations.get(("triaxial", key))
  if cal is None:
    cal = session.calibrations[("triaxial", key)] = references(
        session, max_tokens=max_tokens, max_cases=max_cases)
  d = cal.distortions(session.m.model, knobs.prefix, knobs.window, (knobs.low, knobs.high))
  cfg = session.cfg
  costs = TX.group_costs(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
  refs = TX.Refs.of(cal.cands, knobs.prefix, knobs.window)
  alloc = TX.allocate(d, refs, knobs, budget, costs)
  alloc.update(split=SPLIT, references=len(cal.seqs), max_tokens=max_tokens)
  return alloc
