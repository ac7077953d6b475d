"""Total-B variants derived offline from what a calibration measured (``pask-jax policy derive``).

    pask-jax policy derive runs/cal/policy --target-b 0.30 [--out DIR] [--calibration FILE]

A calibrated policy directory holds rows measured on the development split: the top-level
policy's (``calibration.json`` ``composed``, found beside the directory as ``pask-jax
calibrate`` writes it, or given with ``--calibration``) and each ``B<t>/`` variant's
(``extra.variant`` of its ``policy.json``).  A measured row gives the total, prefill and decode B
of one composition; since total = s · B_P^m + (1 − s) · B_D^m with s the prompt share of the
tokens, s = (total − B_D^m) / (B_P^m − B_D^m) exactly.  The variant at total B ``X`` keeps a
measured composition's decode stage, prefill floors and priorities and re-aims its prefill budget:
B_P = (X − (1 − s) · B_D^m) / s (:func:`calibrate.alg1.aim_prefill`, the rule calibration aims its
target candidates by), clipped to 1.  The base is the usable measured composition whose total is
nearest ``X`` (least extrapolation of s and B_D^m); usable means B_P > 0 and the prefill floors fit
under B_P: floors released (prefill thresholds ``(1, 1)``) or B_P at least the lowest prefill cost
measured on dev under the same prefill thresholds (floors cost no more than any measured plan).

No model is loaded and nothing is measured, so the written B is a prediction: the prefill plan
promotes while it fits, so the prefill cost stays at or just under B_P (the committed 1.5B
variants, aimed this way and then measured, landed 0.0001-0.0003 under B_P), and s and B_D^m move
a little with the generated lengths under the new B_P (B_D^m 0.1806-0.1814 over those variants).
Its dev accuracy is unknown: ``pask-jax eval --budget X`` measures it.  The record
(``extra.variant``) says all of this: source policy and calibration record (paths relative to the
variant's directory), base, requested and predicted B, the rule.
"""
from __future__ import annotations

import json
import math
import os
import re

RULE = "aim_prefill"
RULE_TEXT = ("B_P = (B - (1 - s) * B_D) / s, clipped to 1, with the prompt share s and decode cost "
             "B_D measured on dev for the base composition (the usable measured composition "
             "whose total B is nearest B); the base's decode stage, prefill floors and "
             "priorities are kept")
EXACTNESS = ("predicted, not measured: the prefill plan stays at or just under B_P; s and B_D "
             "move with the generated lengths under the new B_P; dev accuracy unknown (measure "
             "with pask-jax eval --budget B)")
NO_FLOOR = [1.0, 1.0]   # calibrate.alg1.NO_FLOOR: prefill thresholds under which every floor is R
_VARIANT = re.compile(r"B\d+(?:\.\d+)?")


def prompt_share(total: float, prefill: float, decode: float) -> float | None:
  """s from total = s · prefill + (1 − s) · decode; None where prefill and decode are too close
  for s to be determined (or s falls outside (0, 1])."""
  if abs(prefill - decode) < 1e-3:
    return None
  s = (total - decode) / (prefill - decode)
  return s if 0.0 < s <= 1.0 else None


def _num(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _row(total, prefill, decode, accuracy) -> dict | None:
  if not all(_num(x) for x in (total, prefill, decode)):
    return None
  return {"total": float(total), "prefill": float(prefill), "decode": float(decode),
          "accuracy": float(accuracy) if _num(accuracy) else None}


def _tau(x):
  return None if x is None else [float(v) for v in x]


def read_calibration(policy_dir: str, path: str | None) -> tuple[dict | None, str | None]:
  """(calibration record, where) for ``policy_dir``: ``path`` when given (must describe this
  policy), else ``calibration.json`` beside the directory or inside it when it describes this
  policy (the same budgets), else (None, None)."""
  from pask_jax import policy as P
  budgets = P.read_record(policy_dir).get("budgets") or {}
  found = [path] if path is not None else [
      p for p in (os.path.join(os.path.dirname(os.path.abspath(policy_dir)), "calibration.json"),
                  os.path.join(policy_dir, "calibration.json")) if os.path.isfile(p)]
  for p in found:
    if not os.path.isfile(p):
      raise ValueError(f"calibration record not found: {p}")
    rec = P.read_json(p, "calibration record")
    comp = rec.get("composed") if isinstance(rec, dict) else None
    same = isinstance(comp, dict) and all(
        _num(comp.get(k)) and _num(budgets.get(k)) and abs(comp[k] - budgets[k]) < 1e-6
        for k in ("b_d", "b_p"))
    if same:
      return rec, p
    if path is not None:
      raise ValueError(f"calibration record {p} does not describe policy {policy_dir} (its "
                       f"composed policy has other budgets B_D, B_P)")
  return None, None


def measured(policy_dir: str, calibration: dict | None) -> tuple[list[dict], list[dict]]:
  """(bases, rows): the measured compositions that have a saved policy (the top-level one via
  ``calibration`` ``composed``, each ``B<t>`` variant via its record), each with its directory,
  prefill thresholds and row; and every measured row with its prefill thresholds (those too, plus
  ``calibration``'s prefill and target candidates) for the floors' bound."""
  from calibrate.evaluate import policy_variants
  from pask_jax import policy as P
  bases, rows = [], []
  if calibration is not None:
    c = calibration["composed"]
    r = _row(c.get("measured_B_total"), c.get("measured_B_prefill"), c.get("measured_B_decode"),
             c.get("dev_accuracy"))
    tau = (P.read_record(policy_dir).get("thresholds") or {}).get("prefill")
    if r is not None:
      bases.append({"dir": policy_dir, "name": "top-level", "tau": _tau(tau), "row": r})
    for pc in calibration.get("prefill_candidates") or []:
      d = pc.get("dev") or {}
      if _num(d.get("cost")):
        rows.append({"tau": _tau(pc.get("tau")), "prefill": float(d["cost"])})
    for tc in calibration.get("target_candidates") or []:
      pre = (tc.get("source") or {}).get("prefill")
      d = tc.get("dev") or {}
      if isinstance(pre, dict) and _num(d.get("prefill")):
        rows.append({"tau": _tau(pre.get("tau")), "prefill": float(d["prefill"])})
  for _, where in sorted(policy_variants(policy_dir).items()):
    rec = P.read_record(where)
    v = (rec.get("extra") or {}).get("variant")
    if not isinstance(v, dict) or v.get("measured") is False:   # derived ones are predictions
      continue
    r = _row(v.get("measured_B_total"), v.get("measured_B_prefill"), v.get("measured_B_decode"),
             v.get("dev_accuracy"))
    if r is not None:
      bases.append({"dir": where, "name": os.path.basename(where),
                    "tau": _tau((rec.get("thresholds") or {}).get("prefill")), "row": r})
  rows += [{"tau": b["tau"], "prefill": b["row"]["prefill"]} for b in bases]
  return bases, rows


def aim(base: dict, rows: list[dict], target: float) -> dict | None:
  """The prefill budget re-aimed at ``target`` from ``base`` (see the module docstring), or None
  when the base cannot say (no prompt share).  ``ok``: B_P > 0 and the floors fit under it."""
  from calibrate.alg1 import aim_prefill
  r = base["row"]
  s = prompt_share(r["total"], r["prefill"], r["decode"])
  if s is None:
    return None
  floor = 0.0 if base["tau"] == NO_FLOOR else min(x["prefill"] for x in rows
                                                   if x["tau"] == base["tau"])
  b_p = aim_prefill(target, s, r["decode"])
  fits = b_p > 0 and b_p >= floor - 1e-9
  b_p = min(b_p, 1.0)
  return {"share": s, "b_p": b_p, "floor": floor, "ok": fits,
          "total": s * b_p + (1 - s) * r["decode"], "lowest": s * floor + (1 - s) * r["decode"]}


def derive(policy_dir: str, target: float, *, out: str | None = None,
           calibration: str | None = None) -> dict:
  """Write the variant of ``policy_dir`` at total B ``target`` (default ``policy_dir/B<t>``,
  where ``pask-jax eval --budget t`` finds it) without loading a model; returns its
  ``extra.variant`` record plus ``out``.  Bad input is a one-line ValueError or
  FileNotFoundError."""
  import jax.numpy as jnp

  from calibrate.alg1 import check_targets
  from calibrate.evaluate import policy_variants
  from pask_jax import policy as P
  (target,) = check_targets([target])
  P.read_record(policy_dir)
  root = os.path.normpath(policy_dir)
  parent = os.path.dirname(os.path.abspath(root))
  if _VARIANT.fullmatch(os.path.basename(root)) and os.path.isfile(
      os.path.join(parent, "policy.json")):
    raise ValueError(f"{root} is a variant of the policy {parent}: derive from {parent}")
  cal, cal_path = read_calibration(root, calibration)
  bases, rows = measured(root, cal)
  if not bases:
    raise ValueError(f"{root} has no calibration record: no calibration.json beside it (pask-jax "
                     "calibrate's OUT/calibration.json; or give --calibration FILE) and no B<t> "
                     "variant with dev-measured B")
  aims = [(b, a) for b in bases if (a := aim(b, rows, target)) is not None]
  ok = [(b, a) for b, a in aims if a["ok"]]
  if not ok:
    low = min((a["lowest"] for _, a in aims), default=float("nan"))
    raise ValueError(f"total B {target:g} is not reachable offline from the measured "
                     f"compositions of {root} (the lowest predicted total B is {low:.3f}); "
                     f"calibrate with --target-b {target:g} to measure candidates for it")
  base, a = min(ok, key=lambda ba: (abs(ba[0]["row"]["total"] - target),
                                    -(ba[0]["row"]["accuracy"] or 0.0), ba[0]["row"]["total"]))
  name = f"B{target:.2f}"
  if out is None:
    have = [b for b in policy_variants(root) if abs(b - target) < 5e-3]
    if have:
      raise ValueError(f"{root} already has the variant B{have[0]:.2f}; remove it or write "
                       "elsewhere with --out DIR")
    out = os.path.join(root, name)
  elif os.path.exists(os.path.join(out, "policy.json")):
    raise ValueError(f"{out} already holds a policy; remove it or choose another --out")
  elif (_VARIANT.fullmatch(os.path.basename(os.path.normpath(out))) and
        abs(float(os.path.basename(os.path.normpath(out))[1:]) - target) >= 5e-3):
    raise ValueError(f"--out {out} names another budget than {target:g} (eval --budget reads "
                     f"B<b> names); call it {name}")
  pol = P.load(base["dir"])
  rec = pol.record
  r = base["row"]
  info = {
      "target": target, "requested_B": target, "reached": True, "measured": False,
      "policy": name if out == os.path.join(root, name) else os.path.abspath(out),
      # Paths relative to the variant's directory: the record stays true in any clone.
      "source_policy": os.path.relpath(root, out), "base": base["name"],
      "calibration_record": None if cal_path is None else os.path.relpath(cal_path, out),
      "rule": RULE, "rule_text": RULE_TEXT, "exactness": EXACTNESS,
      "prompt_share": a["share"], "floor_bound_B_prefill": a["floor"],
      "base_measured": {"B_total": r["total"], "B_prefill": r["prefill"], "B_decode": r["decode"],
                        "dev_accuracy": r["accuracy"], "b_p": float(pol.b_p)},
      "predicted_B_total": a["total"], "predicted_B_prefill": a["b_p"],
      "predicted_B_decode": r["decode"], "measured_B_total": None, "measured_B_prefill": None,
      "measured_B_decode": None, "dev_accuracy": None,
      "b_d": float(pol.b_d), "b_p": a["b_p"]}
  rec["budgets"] = {**(rec.get("budgets") or {}), "b_p": a["b_p"]}
  rec["extra"] = {**(rec.get("extra") or {}), "name": f"derived {name}", "variant": info}
  P.save(pol.replace(b_p=jnp.float32(a["b_p"]), record_json=json.dumps(rec, sort_keys=True)),
         out)
  return {**info, "out": out}
