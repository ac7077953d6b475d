"""Calibration stages on disk, each keyed by a fingerprint of what produced it.

A stage file ``OUT/work/<stage>.npz`` holds ``__meta__`` (UTF-8 JSON: format, stage name, the
fingerprint, the payload with arrays replaced by references) and the payload's numpy arrays —
read with ``allow_pickle=False``: no pickles, nothing executes on load.  The fingerprint names
what the stage depends on (see :meth:`calibrate.alg1.Calibration._fingerprints`): the model
(config, parameter dtype, weight digest — :func:`models.fingerprint`), the tokenizer, each split's
task (kind, request count, categories, a digest of every request's prompt ids, prompt labels,
grammar source and case identity, and the oracle), and the arguments that change the stage's
numbers.  Resuming with anything different is refused with a message naming every field that
differs (:class:`StageMismatch`), instead of silently reusing another run's numbers.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from typing import Any

import numpy as np

FORMAT = "pask-jax-calibration-stage/1"


class StageMismatch(ValueError):
  """A saved stage was computed for another model, task, split or arguments."""


# --- fingerprints ---------------------------------------------------------------------------------

def _case_key(case: Any) -> str:
  if case is None:
    return ""
  if hasattr(case, "id"):
    return f"{getattr(case, 'category', '')}/{case.id}"
  return json.dumps(case, sort_keys=True, default=str)


def task_fingerprint(task) -> dict:
  """Kind, size, categories and a digest of every request (ids, prompt labels, grammar source,
  case identity) and of the oracle's expected answers when the task has them."""
  h = hashlib.sha256()
  cats: dict[str, int] = {}
  for i, r in enumerate(task.requests):
    h.update(json.dumps([int(t) for t in r.ids]).encode())
    if r.tags is not None:
      h.update(np.ascontiguousarray(np.asarray(r.tags, np.int32)).tobytes())
    h.update(hashlib.sha256(str(getattr(r.grammar, "source", "") or "").encode()).digest())
    h.update(_case_key(r.case).encode())
    if hasattr(task, "category"):
      c = str(task.category(i))
      cats[c] = cats.get(c, 0) + 1
  exp = getattr(task, "expected", None)
  if exp is not None:
    h.update(json.dumps(list(exp), sort_keys=True, default=str).encode())
  return {"kind": type(task).__name__, "requests": len(task.requests),
          "categories": dict(sorted(cats.items())), "digest": h.hexdigest()[:20]}


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(d, dict):
    out: dict[str, Any] = {}
    for k, v in d.items():
      out.update(_flat(v, f"{prefix}{k}."))
    return out or {prefix[:-1]: {}}
  return {prefix[:-1]: d}


def _short(v: Any) -> str:
  s = json.dumps(v, sort_keys=True, default=str)
  return s if len(s) <= 40 else s[:37] + "..."


def differences(saved: dict, now: dict) -> list[str]:
  """``["model.weights (saved "ab…", now "cd…")", ...]`` for every differing leaf."""
  a, b = _flat(saved), _flat(now)
  out = []
  for k in sorted(set(a) | set(b)):
    if a.get(k, "<absent>") != b.get(k, "<absent>"):
      out.append(f"{k} (saved {_short(a.get(k, '<absent>'))}, now {_short(b.get(k, '<absent>'))})")
  return out


# --- encoding: JSON plus numpy arrays, no pickle --------------------------------------------------

def _enc(x: Any, arrays: dict[str, np.ndarray]) -> Any:
  from calibrate.stack import Outcome
  if isinstance(x, np.ndarray):
    name = f"a{len(arrays)}"
    arrays[name] = x
    return {"__array__": name}
  if isinstance(x, Outcome):
    return {"__outcome__": {f.name: _enc(getattr(x, f.name), arrays)
                            for f in dataclasses.fields(x)}}
  if isinstance(x, dict):
    if all(isinstance(k, str) for k in x):
      return {"__dict__": {k: _enc(v, arrays) for k, v in x.items()}}
    return {"__items__": [[_enc(k, arrays), _enc(v, arrays)] for k, v in x.items()]}
  if isinstance(x, tuple):
    return {"__tuple__": [_enc(v, arrays) for v in x]}
  if isinstance(x, list):
    return [_enc(v, arrays) for v in x]
  if isinstance(x, (np.integer, np.bool_)):
    return x.item()
  if isinstance(x, np.floating):
    return float(x)
  if x is None or isinstance(x, (str, int, float, bool)):
    return x
  raise TypeError(f"cannot store a {type(x).__name__} in a calibration stage")


def _dec(x: Any, arrays) -> Any:
  from calibrate.stack import Outcome
  if isinstance(x, list):
    return [_dec(v, arrays) for v in x]
  if not isinstance(x, dict):
    return x
  if "__array__" in x:
    return np.asarray(arrays[x["__array__"]])
  if "__outcome__" in x:
    return Outcome(**{k: _dec(v, arrays) for k, v in x["__outcome__"].items()})
  if "__dict__" in x:
    return {k: _dec(v, arrays) for k, v in x["__dict__"].items()}
  if "__items__" in x:
    return {_dec(k, arrays): _dec(v, arrays) for k, v in x["__items__"]}
  if "__tuple__" in x:
    return tuple(_dec(v, arrays) for v in x["__tuple__"])
  raise ValueError(f"unknown stage record {sorted(x)}")


# --- files ----------------------------------------------------------------------------------------

def path(work: str, stage: str) -> str:
  return os.path.join(work, f"{stage}.npz")


def read_meta(file: str) -> dict:
  try:
    with np.load(file, allow_pickle=False) as z:
      meta = json.loads(bytes(z["__meta__"]).decode("utf-8"))
  except Exception as e:  # noqa: BLE001 — truncated, foreign or pickled: say which
    raise StageMismatch(f"{file} is not a readable calibration stage ({type(e).__name__}: {e}); "
                        "delete it to recompute") from None
  if meta.get("format") != FORMAT:
    raise StageMismatch(f"{file}: stage format {meta.get('format')!r}, expected {FORMAT!r}; "
                        "delete it to recompute")
  return meta


def check(file: str, stage: str, fingerprint: dict) -> None:
  """Refuse a saved stage whose fingerprint differs from ``fingerprint`` (names the fields)."""
  meta = read_meta(file)
  diff = differences(meta.get("fingerprint", {}), json.loads(json.dumps(fingerprint)))
  if meta.get("stage") != stage:
    diff.insert(0, f"stage (saved {meta.get('stage')!r}, now {stage!r})")
  if diff:
    raise StageMismatch(
        f"{file} was computed for a different " + "; ".join(diff[:8]) +
        (f"; and {len(diff) - 8} more" if len(diff) > 8 else "") +
        f". Refusing to resume from it: use another --out, or delete "
        f"{os.path.dirname(file) or '.'} to recompute.")


def load(work: str, stage: str, fingerprint: dict) -> Any:
  """The stage's payload, or None when it was not saved yet (a mismatch raises)."""
  file = path(work, stage)
  if not os.path.exists(file):
    return None
  check(file, stage, fingerprint)
  with open(file, "rb") as f:
    return decode(f.read())


def read(work: str, stage: str, fingerprint: dict) -> bytes | None:
  """The saved stage's bytes after the fingerprint check (:func:`decode` gives its payload), or
  None when it was not saved yet: what process 0 hands the others (calibrate.distributed)."""
  file = path(work, stage)
  if not os.path.exists(file):
    return None
  check(file, stage, fingerprint)
  with open(file, "rb") as f:
    return f.read()


def decode(blob: bytes) -> Any:
  """A stage's payload from its file's bytes."""
  with np.load(io.BytesIO(blob), allow_pickle=False) as z:
    meta = json.loads(bytes(z["__meta__"]).decode("utf-8"))
    arrays = {k: z[k] for k in z.files if k != "__meta__"}
  return _dec(meta["payload"], arrays)


def save(work: str, stage: str, fingerprint: dict, payload: Any) -> None:
  """Write atomically (temporary file, then rename)."""
  arrays: dict[str, np.ndarray] = {}
  meta = {"format": FORMAT, "stage": stage, "fingerprint": fingerprint,
          "payload": _enc(payload, arrays)}
  blob = np.frombuffer(json.dumps(meta, sort_keys=True).encode("utf-8"), np.uint8)
  file = path(work, stage)
  tmp = file + ".tmp.npz"
  np.savez(tmp, __meta__=blob, **arrays)
  os.replace(tmp, file)
