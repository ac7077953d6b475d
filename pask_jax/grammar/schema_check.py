"""JSON schemas checked against what XGrammar enforces, before they are compiled.

XGrammar 0.2.9 (``strict_mode=True``) compiles many schemas whose constraints it silently drops,
so a constrained output could violate the schema it was constrained by.  Measured (every row was
checked by accepting strings on the compiled grammar; ``tests/test_schema_check.py`` pins them):

* ignored, output may violate: ``not``, ``if``/``then``/``else``, ``allOf`` (all branches dropped),
  ``uniqueItems``, ``contains``, ``dependentRequired``/``dependencies``/``dependentSchemas``,
  ``propertyNames``, ``multipleOf`` on non-integers, every keyword *beside* ``anyOf``/``oneOf``
  or ``$ref``, the other constraints of a schema with ``enum``/``const`` (``{"type": "string",
  "enum": [1]}`` emits ``1``), ``required`` keys that ``properties`` does not declare (dropped),
  ``type: []`` (anything), non-local ``$ref`` (anything), and ``oneOf`` is read as ``anyOf``;
* refused by XGrammar itself (a 400 with its message): ``false`` anywhere, an empty ``enum``,
  empty numeric/length/item/property ranges, ``maxProperties`` below the required count;
* accepts nothing (the model would be stuck): empty ``anyOf``/``oneOf``, a required self-reference
  (no finite instance).

:func:`prepare` therefore returns an equivalent schema that XGrammar enforces exactly, or raises
:class:`SchemaError` naming the keyword and its JSON pointer:

* refs: only local ones (``#`` or ``#/…``); each is rewritten to ``#`` or ``#/$defs/NAME`` (other
  targets are copied into ``$defs``) so the restructuring below cannot break a pointer;
* ``allOf`` is merged into its parent (types intersected, properties merged recursively, bounds
  tightened, ``required`` united; ``additionalProperties: false`` in a branch restricts the other
  branches' keys); what cannot be merged exactly (two different patterns, two schema-valued
  ``additionalProperties``, …) is refused;
* keywords beside ``anyOf``/``oneOf`` are distributed into every branch; beside ``$ref`` they are
  merged with the target (a recursive target with siblings is refused);
* ``enum``/``const`` values that fail the sibling constraints are dropped;
* ``required`` keys missing from ``properties`` are added with the schema that governs them
  (``patternProperties`` / ``additionalProperties``), or make the schema unsatisfiable when
  ``additionalProperties`` is ``false``; optional properties whose schema is ``false`` are dropped;
* ``oneOf`` is kept only when its branches are provably disjoint (types, finite value sets, or a
  required property with disjoint values — a discriminator); otherwise it is refused (use
  ``anyOf``);
* the unenforced keywords above are refused unless trivially true (``not`` of an unsatisfiable
  schema, ``uniqueItems`` with ``maxItems <= 1``, ``multipleOf`` under ``type: integer``);
* ``minLength``/``maxLength`` beside a ``pattern`` or a ``format`` XGrammar knows are refused
  (XGrammar drops the length there with only a log warning), and so are those keywords and
  ``pattern``/``format`` on a schema without ``type`` (XGrammar reads it as any value); beside
  ``enum``/``const`` they stay (the listed values are checked against them);
* finally a least-fixed-point satisfiability check over ``$ref``: a schema with no finite
  instance (``not: {}``, contradictory ``allOf`` types, ``required`` vs ``additionalProperties:
  false``, a required self-reference, …) is refused up front.

Unknown (non-standard) keywords are annotations under JSON Schema and are left alone; so is a
``format`` XGrammar does not know (format is an annotation by default).  XGrammar's strict mode
also forbids undeclared properties when ``additionalProperties`` is absent: that only narrows
the outputs, which stay valid.
"""
from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from pask_jax.grammar.errors import GrammarError

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
    "writeOnly", "contentMediaType", "contentEncoding", "$schema", "$id", "$anchor", "nullable",
    "discriminator", "example", "strict"})
# Standard assertions XGrammar does not enforce (see the module docstring).
UNENFORCED = ("not", "if", "then", "else", "uniqueItems", "contains", "minContains",
              "maxContains", "dependentRequired", "dependencies", "dependentSchemas",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems",
              "$dynamicRef", "$recursiveRef", "$dynamicAnchor", "$recursiveAnchor")
# String formats XGrammar 0.2.9 turns into a grammar (the others are annotations); beside one of
# them, or beside a pattern, it ignores minLength/maxLength with a warning.
XGRAMMAR_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")


class SchemaError(GrammarError):
  """A schema that is invalid, unsatisfiable, or uses a constraint XGrammar cannot enforce."""


class _Unsat(Exception):
  def __init__(self, why: str):
    super().__init__(why)
    self.why = why


FALSE = False   # the normalized form of an unsatisfiable schema


def _ptr(path: str, *parts) -> str:
  for p in parts:
    path += "/" + str(p).replace("~", "~0").replace("/", "~1")
  return path


# ---- refs -----------------------------------------------------------------------------------

def _resolve(root: Any, ref: str, where: str) -> Any:
  if ref == "#" or ref == "":
    return root
  if not ref.startswith("#/"):
    raise SchemaError(f"{where}: only local '$ref's ('#' or '#/...') are supported, got {ref!r}")
  node = root
  for raw in ref[2:].split("/"):
    key = unquote(raw).replace("~1", "/").replace("~0", "~")
    if isinstance(node, dict) and key in node:
      node = node[key]
    elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
      node = node[int(key)]
    else:
      raise SchemaError(f"{where}: $ref {ref!r} points nowhere in the schema")
  if not isinstance(node, (dict, bool)):
    raise SchemaError(f"{where}: $ref {ref!r} does not point at a schema")
  return node


def _defs_key(schema: dict) -> str:
  return "$defs" if "$defs" in schema or "definitions" not in schema else "definitions"


_SUB = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUB_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")


def _walk(s: Any, fn, at: str) -> Any:
  """A copy of schema ``s`` with ``fn(node, at)`` applied to every subschema, bottom-up."""
  if not isinstance(s, dict):
    return fn(s, at)
  out = {}
  for k, v in s.items():
    p = _ptr(at, k)
    if k in _SUB_MAP and isinstance(v, dict):
      out[k] = {n: _walk(x, fn, _ptr(p, n)) for n, x in v.items()}
    elif k in _SUB_LIST and isinstance(v, list) or k == "items" and isinstance(v, list):
      out[k] = [_walk(x, fn, _ptr(p, i)) for i, x in enumerate(v)]
    elif k in _SUB:
      out[k] = _walk(v, fn, p)
    else:
      out[k] = v
  return fn(out, at)


def local_refs(schema: Any, where: str = "#") -> Any:
  """A copy of ``schema`` whose every ``$ref`` is ``#`` or ``#/$defs/NAME`` (one level; also for
  ``definitions``): other targets are copied into ``$defs`` under fresh names.  Raises
  SchemaError for a non-local or dangling ref."""
  if not isinstance(schema, dict):
    return schema
  defs: dict[str, Any] = {}
  for key in ("definitions", "$defs"):
    if isinstance(schema.get(key), dict):
      defs.update(schema[key])
  hoisted: dict[str, str] = {}   # original pointer -> "#/$defs/NAME"
  pending: list[str] = []

  def target(ref: str, at: str) -> str:
    if ref in ("#", ""):
      return "#"
    for base in ("#/$defs/", "#/definitions/"):
      if ref.startswith(base) and "/" not in ref[len(base):]:
        name = unquote(ref[len(base):]).replace("~1", "/").replace("~0", "~")
        if name not in defs:
          raise SchemaError(f"{at}: $ref {ref!r} points nowhere in the schema")
        return _ptr("#/$defs", name)
    if ref not in hoisted:
      node = _resolve(schema, ref, at)
      name = f"__ref{len(hoisted)}"
      while name in defs:
        name += "_"
      hoisted[ref] = _ptr("#/$defs", name)
      defs[name] = node
      pending.append(name)
    return hoisted[ref]

  def fix(node, at):
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
      node["$ref"] = target(node["$ref"], at)
    return node

  body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
  out = _walk(body, fix, where)
  done: dict[str, Any] = {}
  pending[:0] = list(defs)
  while pending:
    name = pending.pop()
    if name not in done:
      done[name] = _walk(defs[name], fix, _ptr(where + "/$defs", name))
  if done:
    out["$defs"] = {k: done[k] for k in defs}
  return out


# ---- normalization --------------------------------------------------------------------------

def _types(s: dict) -> set[str] | None:
  t = s.get("type")
  if t is None:
    return None
  return {t} if isinstance(t, str) else set(t)


def _is_true(s: Any) -> bool:
  return s is True or (isinstance(s, dict) and all(k in ANNOTATIONS for k in s))


def _canon(v: Any) -> str:
  return json.dumps(v, sort_keys=True)


def _name(ref: str) -> str:
  return unquote(ref[len("#/$defs/"):]).replace("~1", "/").replace("~0", "~")


def scoped(params: Any, prefix: str, defs: dict) -> Any:
  """``params`` with its own ``$defs`` moved into ``defs`` (as ``PREFIX.NAME``) and every local
  ``$ref`` rewritten to point there, so refs resolve against the parameters, not an object that
  wraps them (``#`` becomes the parameters themselves, kept as ``defs[prefix]`` if used)."""
  if not isinstance(params, dict):
    return params
  params = local_refs(params)
  own = params.pop("$defs", {})

  def fix(node, at):
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
      r = node["$ref"]
      node["$ref"] = _ptr("#/$defs", prefix) if r == "#" else _ptr(
          "#/$defs", f"{prefix}.{_name(r)}")
    return node

  body = _walk(params, fix, "#")
  for k, v in own.items():
    defs[f"{prefix}.{k}"] = _walk(v, fix, "#")
  if json.dumps(_ptr("#/$defs", prefix)) in json.dumps(body) + json.dumps(own):
    defs[prefix] = body
  return body


class _Norm:
  """One normalization pass over a :func:`local_refs` schema (see the module docstring)."""

  def __init__(self, root: dict):
    self.root = root
    self.defs = root.get("$defs", {})
    self.inlining: list[str] = []
    self._validator = None
    self.why: dict[str, str] = {}   # JSON pointer -> why that subschema admits no value

  def deref(self, ref: str) -> Any:
    return {k: v for k, v in self.root.items() if k != "$defs"} if ref == "#" \
        else self.defs[_name(ref)]

  def validator(self, sub: Any):
    import jsonschema
    if self._validator is None:
      cls = jsonschema.validators.validator_for(self.root, default=jsonschema.Draft202012Validator)
      self._validator = cls(self.root)
    return self._validator.evolve(schema=sub)

  def values_ok(self, values: list, s: dict) -> list:
    """The enum/const values that satisfy the sibling constraints of ``s``."""
    sib = {k: v for k, v in s.items() if k not in ("enum", "const") and k not in ANNOTATIONS}
    if not sib:
      return values
    if set(sib) == {"type"}:   # fast path (large enums)
      ts = _types(sib)
      return [v for v in values if _json_type_ok(v, ts)]
    v = self.validator(sib)
    return [x for x in values if v.is_valid(x)]

  # -- the pass --

  def norm(self, s: Any, at: str) -> Any:
    """The normalized schema, or FALSE when it admits no value (the reason in ``self.why``)."""
    try:
      out = self._norm(s, at)
    except _Unsat as e:
      self.why.setdefault(at, e.why)
      return FALSE
    if out is FALSE:
      self.why.setdefault(at, f"{at}: admits no value")
    return out

  def _norm(self, s: Any, at: str) -> Any:
    if s is True:
      return {}
    if s is False:
      return FALSE
    if not isinstance(s, dict):
      raise SchemaError(f"{at}: a schema must be an object or a boolean")
    s = dict(s)
    for k in UNENFORCED:
      if k in s:
        s = self.unenforced(s, k, at)
        if s is FALSE:
          return FALSE
    if isinstance(s.get("type"), list) and not s["type"]:
      return FALSE
    if "allOf" in s:
      merged = {k: v for k, v in s.items() if k != "allOf"}
      for i, b in enumerate(s["allOf"]):
        merged = self.merge(merged, self.expand(b, _ptr(at, "allOf", i)), _ptr(at, "allOf", i))
        if merged is FALSE:
          return FALSE
      return self.norm(merged, at)
    if "$ref" in s and any(k not in ANNOTATIONS and k != "$ref" for k in s):
      ref = s.pop("$ref")
      if ref in self.inlining:
        raise SchemaError(f"{at}: keywords beside a recursive $ref {ref!r} are not supported")
      self.inlining.append(ref)
      try:
        merged = self.merge(s, self.deref(ref), at)
        return FALSE if merged is FALSE else self.norm(merged, at)
      finally:
        self.inlining.pop()
    for comb in ("anyOf", "oneOf"):
      if comb in s:
        return self.combinator(s, comb, at)
    out = {}
    for k, v in s.items():
      p = _ptr(at, k)
      if k in ("properties", "patternProperties"):
        if not isinstance(v, dict):
          raise SchemaError(f"{p}: must be an object")
        out[k] = {name: sub if sub is True else self.norm(sub, _ptr(p, name))
                  for name, sub in v.items()}
      elif k in ("items", "additionalProperties"):
        out[k] = self.norm(v, p) if isinstance(v, dict) or v is False else v
      elif k == "prefixItems":
        out[k] = [self.norm(sub, _ptr(p, i)) for i, sub in enumerate(v)]
      else:
        out[k] = v
    if "properties" in out or "required" in out:
      out = self.object_keys(out, at)
    for k in ("enum", "const"):
      if k in out:
        keep = self.values_ok(out[k] if k == "enum" else [out[k]], out)
        if not keep:
          raise _Unsat(f"{at}: no {k} value satisfies the other constraints")
        if k == "enum":
          out[k] = keep
    return out

  def expand(self, b: Any, at: str) -> Any:
    """A schema for merging: normalized, with a top-level $ref inlined once."""
    b = self.norm(b, at)
    if isinstance(b, dict) and "$ref" in b:
      ref = b["$ref"]
      if ref in self.inlining:
        raise SchemaError(f"{at}: allOf over a recursive $ref {ref!r} is not supported")
      self.inlining.append(ref)
      try:
        b = self.norm(self.deref(ref), at)
      finally:
        self.inlining.pop()
    return b

  def unenforced(self, s: dict, k: str, at: str):
    v = s[k]
    p = _ptr(at, k)
    if k == "not":
      sub = self.norm(v, p)
      self.why.pop(p, None)
      if sub is FALSE:               # not(unsatisfiable) is always true
        del s[k]
        return s
      if _is_true(sub):
        raise _Unsat(f"{p}: 'not' of a schema that accepts everything admits no value")
    elif k == "uniqueItems" and (v is False or s.get("maxItems", 2) <= 1):
      del s[k]
      return s
    elif k == "unevaluatedProperties" and v is False and not any(
        c in s for c in ("allOf", "anyOf", "oneOf", "$ref")):
      del s[k]                       # strict mode forbids undeclared keys already
      return s
    elif k in ("dependentRequired", "dependencies", "dependentSchemas") and isinstance(v, dict) \
        and not any(v.values()):
      del s[k]
      return s
    raise SchemaError(f"{p}: the JSON-schema keyword {k!r} is not supported "
                      "(XGrammar cannot enforce it)")

  def object_keys(self, s: dict, at: str) -> dict:
    props = dict(s.get("properties") or {})
    req = list(dict.fromkeys(s.get("required") or []))
    for k in req:
      if k not in props:
        sub = self.governing(s, k)
        if sub is FALSE:
          raise _Unsat(f"{at}: property {k!r} is required but additionalProperties is false")
        props[k] = sub
    for k in list(props):
      if props[k] is FALSE:
        if k in req:
          inner = self.why.get(_ptr(at, "properties", k), "")
          raise _Unsat(f"{at}: required property {k!r} admits no value"
                       + (f" ({inner})" if inner and "admits no value" not in inner else ""))
        del props[k]
    s = dict(s)
    s["properties"] = props
    if req:
      s["required"] = req
    return s

  def governing(self, s: dict, key: str) -> Any:
    """The normalized schema that ``s`` applies to an undeclared property ``key``."""
    import re
    for pat, sub in (s.get("patternProperties") or {}).items():
      try:
        if re.search(pat, key):
          return sub
      except re.error:
        raise SchemaError(f"patternProperties: {pat!r} is not a valid regex") from None
    addl = s.get("additionalProperties", True)
    return {} if addl is True else addl

  def combinator(self, s: dict, comb: str, at: str):
    branches = s.pop(comb)
    if any(c in s for c in ("anyOf", "oneOf")):
      raise SchemaError(f"{at}: 'anyOf' and 'oneOf' in one schema are not supported")
    sib = {k: v for k, v in s.items() if k not in ANNOTATIONS}
    out = []
    whys = []
    for i, b in enumerate(branches):
      p = _ptr(at, comb, i)
      try:
        nb = self.norm(b, p)
        if nb is not FALSE and sib:
          # XGrammar ignores keywords beside anyOf/oneOf: push them into every branch.
          nb = self.merge(sib, self.expand(nb, p), p)
          nb = FALSE if nb is FALSE else self.norm(nb, p)
      except _Unsat as e:
        nb = FALSE
        self.why.setdefault(p, e.why)
      if nb is FALSE or not _sat(nb, {})[0]:
        whys.append(self.why.get(p, f"{p}: admits no value"))
        continue
      out.append(nb)
    if not out:
      raise _Unsat(f"{_ptr(at, comb)}: no branch can be satisfied"
                   + (f" ({whys[0]})" if len(whys) == 1 else ""))
    if comb == "oneOf":
      for i in range(len(out)):
        for j in range(i + 1, len(out)):
          if not self.disjoint(out[i], out[j]):
            raise SchemaError(f"{_ptr(at, 'oneOf')}: branches {i} and {j} can match the same "
                              "value; XGrammar reads oneOf as anyOf, so use anyOf or make the "
                              "branches disjoint (e.g. a required 'const' discriminator)")
    keep = {k: v for k, v in s.items() if k in ANNOTATIONS}
    if len(out) == 1:
      return {**keep, **out[0]}
    return {**keep, "anyOf": out}

  # -- allOf merge --

  def merge(self, a: Any, b: Any, at: str):
    """The schema of the values that satisfy both ``a`` and ``b`` (exactly), FALSE, or
    SchemaError when that cannot be written for XGrammar."""
    if a is FALSE or b is FALSE:
      return FALSE
    a, b = dict(a), dict(b)
    if any(c in a for c in ("anyOf", "oneOf")) and any(c in b for c in ("anyOf", "oneOf")):
      raise SchemaError(f"{at}: allOf of two schemas that both use anyOf/oneOf is not supported")
    out = dict(a)
    for k, v in b.items():
      if k in ANNOTATIONS:
        out.setdefault(k, v)
      elif k in ("properties", "additionalProperties", "patternProperties"):
        continue   # below
      elif k not in out:
        out[k] = v
      elif k == "type":
        ta, tb = _types(a), _types(b)
        both = ta & tb
        if ("integer" in ta and "number" in tb) or ("number" in ta and "integer" in tb):
          both |= {"integer"}
        if not both:
          raise _Unsat(f"{at}: allOf requires types {sorted(ta)} and {sorted(tb)} at once")
        out[k] = sorted(both) if len(both) > 1 else next(iter(both))
      elif k in _LOWER:
        out[k] = max(out[k], v)
      elif k in _UPPER:
        out[k] = min(out[k], v)
      elif k == "required":
        out[k] = list(dict.fromkeys(list(out[k]) + list(v)))
      elif k == "enum":
        bv = {_canon(x) for x in v}
        out[k] = [x for x in out[k] if _canon(x) in bv]
        if not out[k]:
          raise _Unsat(f"{at}: allOf enums have no value in common")
      elif k == "const":
        if _canon(out[k]) != _canon(v):
          raise _Unsat(f"{at}: allOf requires two different constants")
      elif k == "items":
        m = self.merge(self.expand(out[k], at), self.expand(v, at), _ptr(at, "items"))
        out[k] = m
      elif _canon(out[k]) != _canon(v):
        raise SchemaError(f"{at}: allOf with two different {k!r} values is not supported")
    if any(k in x for x in (a, b) for k in ("properties", "additionalProperties",
                                             "patternProperties")):
      if "patternProperties" in a or "patternProperties" in b:
        if not ("patternProperties" in a) ^ ("patternProperties" in b) or \
            any(k in x for x in (a, b) for k in ("properties", "additionalProperties")):
          raise SchemaError(f"{at}: allOf with patternProperties is not supported")
        out["patternProperties"] = a.get("patternProperties") or b["patternProperties"]
        return out
      pa, pb = a.get("properties") or {}, b.get("properties") or {}
      aa, ab = a.get("additionalProperties", True), b.get("additionalProperties", True)
      aa, ab = ({} if x is True else x for x in (aa, ab))
      if aa and ab and aa is not FALSE and ab is not FALSE and _canon(aa) != _canon(ab):
        raise SchemaError(f"{at}: allOf with two schema-valued additionalProperties is not "
                          "supported")
      req = set(out.get("required") or ())
      props = {}
      for key in dict.fromkeys(list(pa) + list(pb)):
        sa = pa[key] if key in pa else aa
        sb = pb[key] if key in pb else ab
        m = self.merge(self.expand(sa, at), self.expand(sb, at), _ptr(at, "properties", key))
        if m is FALSE:
          if key in req:
            raise _Unsat(f"{at}: property {key!r} is required but allOf forbids it")
          continue
        props[key] = m
      out["properties"] = props
      addl = FALSE if (aa is FALSE or ab is FALSE) else (aa or ab)
      if addl == {}:
        out.pop("additionalProperties", None)
      else:
        out["additionalProperties"] = addl
    return out

  # -- oneOf disjointness --

  def disjoint(self, a: Any, b: Any) -> bool:
    if isinstance(a, dict) and "$ref" in a:
      a = self.expand(a, "#")
    if isinstance(b, dict) and "$ref" in b:
      b = self.expand(b, "#")
    if a is FALSE or b is FALSE:
      return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None:
      return not ({_canon(x) for x in va} & {_canon(x) for x in vb})
    if va is not None:
      return not any(self.validator(b).is_valid(x) for x in va)
    if vb is not None:
      return not any(self.validator(a).is_valid(x) for x in vb)
    ta, tb = _value_types(a), _value_types(b)
    if not (ta & tb):
      return True
    if ta & tb <= {"object"}:
      pa, pb = a.get("properties") or {}, b.get("properties") or {}
      common = set(a.get("required") or ()) & set(b.get("required") or ()) & set(pa) & set(pb)
      return any(self.disjoint(pa[k], pb[k]) for k in sorted(common))
    return False


def _values(s: dict):
  if "const" in s:
    return [s["const"]]
  if "enum" in s:
    return s["enum"]
  return None


def _kinds(s: dict) -> set[str]:
  """The JSON types XGrammar can generate for ``s`` (an untyped schema with object or array
  keywords generates only that kind — measured)."""
  t = _types(s)
  if t is not None:
    return t
  if any(k in s for k in ("properties", "required", "additionalProperties", "patternProperties",
                          "minProperties", "maxProperties")):
    return {"object"}
  if any(k in s for k in ("items", "prefixItems", "minItems", "maxItems")):
    return {"array"}
  return set(_TYPES)


def _value_types(s: dict) -> set[str]:
  t = _kinds(s)
  return t | {"integer"} if "number" in t else t


def _json_type_ok(v: Any, types: set[str]) -> bool:
  for t in types:
    if (t == "null" and v is None or t == "boolean" and isinstance(v, bool)
        or t == "string" and isinstance(v, str) or t == "object" and isinstance(v, dict)
        or t == "array" and isinstance(v, list)):
      return True
    if not isinstance(v, bool) and isinstance(v, (int, float)) and (
        t == "number" or t == "integer" and float(v).is_integer()):
      return True
  return False


# ---- satisfiability (least fixed point over $ref) -------------------------------------------

def _sat(s: Any, env: dict[str, bool]) -> tuple[bool, str]:
  """(has a finite instance, why not) of a normalized schema; ``env``: the current
  approximation per ref target (a missing target counts as satisfiable)."""
  if s is FALSE:
    return False, "false"
  if not isinstance(s, dict):
    return True, ""
  if "$ref" in s:
    ok = env.get(s["$ref"], True)
    return ok, "" if ok else f"$ref {s['$ref']!r} has no finite instance"
  if "anyOf" in s:
    if any(_sat(b, env)[0] for b in s["anyOf"]):
      return True, ""
    return False, "no anyOf branch can be satisfied"
  if "enum" in s or "const" in s:
    return bool(s.get("enum", [0])), "empty enum"
  why = ""
  for t in sorted(_kinds(s)):
    if t == "object":
      props = s.get("properties") or {}
      bad = [(k, _sat(props.get(k, {}), env)) for k in s.get("required") or ()]
      bad = [(k, w) for k, (ok, w) in bad if not ok]
      if not bad:
        return True, ""
      why = f"required property {bad[0][0]!r}: {bad[0][1]}"
    elif t == "array":
      n = int(s.get("minItems", 0))
      pre = s.get("prefixItems") or []
      ok = all(_sat(pre[i], env)[0] for i in range(min(n, len(pre))))
      if ok and n > len(pre):
        ok = _sat(s.get("items", {}), env)[0]
      if ok:
        return True, ""
      why = f"minItems {n} but the items admit no value"
    else:
      return True, ""
  return False, why


def _fixpoint(out: Any, defs: dict[str, Any]) -> dict[str, bool]:
  """Least fixed point: every target starts unsatisfiable and grows (finite instances only)."""
  env = {"#": False, **{_ptr("#/$defs", k): False for k in defs}}
  for _ in range(len(env) + 1):
    new = {"#": _sat(out, env)[0], **{_ptr("#/$defs", k): _sat(v, env)[0]
                                      for k, v in defs.items()}}
    if new == env:
      break
    env = new
  return env


def _uses(s: Any, refs: set[str]) -> bool:
  found = []
  _walk(s, lambda n, at: found.append(1) if isinstance(n, dict) and n.get("$ref") in refs
        else None or n, "#")
  return bool(found)


def prepare(schema: Any, where: str = "schema") -> Any:
  """``schema`` checked and rewritten so that XGrammar enforces it exactly (module docstring);
  raises :class:`SchemaError` with a one-line reason that names ``where`` and the JSON pointer."""
  if isinstance(schema, bool):
    if schema is False:
      raise SchemaError(f"{where}: unsatisfiable schema: 'false' admits no value")
    return {}
  if not isinstance(schema, dict):
    raise SchemaError(f"{where}: a JSON schema must be an object or a boolean")
  import jsonschema
  cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
  try:
    cls.check_schema(schema)
  except jsonschema.SchemaError as e:
    loc = "".join(f"/{p}" for p in e.path)
    raise SchemaError(f"{where}: invalid JSON schema at #{loc}: {e.message}") from None
  except RecursionError:
    raise SchemaError(f"{where}: the schema is nested too deeply") from None
  try:
    root = local_refs(schema, "#")
    for _ in range(3):
      n = _Norm(root)
      defs = {k: n.norm(v, _ptr("#/$defs", k)) for k, v in root.get("$defs", {}).items()}
      out = n._norm({k: v for k, v in root.items() if k != "$defs"}, "#")
      env = _fixpoint(out, defs)
      dead = {r for r, ok in env.items() if not ok and r != "#"}
      if not dead or not _uses(root, dead):
        break
      # Refs to targets without a finite instance are 'false': prune and normalize again.
      root = _walk(root, lambda nd, at: FALSE if isinstance(nd, dict) and nd.get("$ref") in dead
                   else nd, "#")
      root["$defs"] = {k: v for k, v in root.get("$defs", {}).items()
                       if _ptr("#/$defs", k) not in dead}
  except _Unsat as e:
    raise SchemaError(f"{where}: unsatisfiable schema: {e.why}") from None
  except RecursionError:
    raise SchemaError(f"{where}: the schema is nested too deeply") from None
  except SchemaError as e:
    raise SchemaError(f"{where}: {e}") from None
  if out is FALSE:
    raise SchemaError(f"{where}: unsatisfiable schema: no JSON value satisfies it")
  ok, why = _sat(out, env)
  if not ok:
    raise SchemaError(f"{where}: unsatisfiable schema: "
                      f"{why or 'no finite JSON value satisfies it'}")
  if defs:
    out["$defs"] = {k: v for k, v in defs.items() if v is not FALSE}
  try:
    _walk(out, _leaf_check, "#")   # after every merge: the types a keyword applies to are known
  except SchemaError as e:
    raise SchemaError(f"{where}: {e}") from None
  return out


def _leaf_check(s: Any, at: str) -> Any:
  if not isinstance(s, dict):
    return s
  if "multipleOf" in s and _types(s) != {"integer"}:
    raise SchemaError(f"{at}: 'multipleOf' is only enforced under type 'integer' "
                      "(XGrammar cannot enforce it on numbers)")
  if "enum" in s or "const" in s:
    return s            # XGrammar emits the listed values, already checked against the siblings
  # the string keywords XGrammar acts on (an unknown format is an annotation, minLength 0 true)
  acts = {"pattern": "pattern" in s, "format": s.get("format") in XGRAMMAR_FORMATS,
          "minLength": bool(s.get("minLength")), "maxLength": "maxLength" in s}
  shaped = [k for k, on in acts.items() if on]
  if not shaped:
    return s
  types = _types(s)
  if types is None:
    raise SchemaError(f"{at}: {shaped[0]!r} without a 'type' is not enforced (XGrammar reads "
                      "the schema as any value); add \"type\": \"string\"")
  bounded = [k for k in shaped if k in ("minLength", "maxLength")]
  if "string" in types and bounded and shaped[0] in ("pattern", "format"):
    fix = ("bound the length inside the pattern" if shaped[0] == "pattern" else
           "use a pattern instead of the format, or drop the length")
    raise SchemaError(f"{at}: {bounded[0]!r} beside {shaped[0]!r} is not supported (XGrammar "
                      f"drops the length there); {fix}")
  return s
