"""The seams between the project's packages, checked on the source (``ast``; imports nothing).

* No module reaches into another module's private names (``_x``): not by ``from m import _x``,
  not by ``m._x`` on an imported module.  A private module (``pkg/_m.py``) is shared inside its
  package only.  Tests too: they use public names and the testing packages
  (``pask_jax.testing``, ``pallas_kernels.testing``).
* No import loop among the project's modules (counting imports inside functions too: a lazy
  import that closes a loop still ties the two modules together).
* No ``sys.path`` edit anywhere: packages come from the install, tests from pytest's rootdir.
* Inside ``pask_jax`` only the face (``__init__``, ``api``, ``cli``) imports ``serve`` and
  ``calibrate``: the method does not depend on its server or its offline tools.  And nothing but
  the face and tests imports ``pask_jax.cli``: the command line is an end, not a library.
"""
from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("pask_jax", "pallas_kernels", "models", "calibrate", "serve", "bench", "scripts", "tests",
        "policies")
FACE = {"pask_jax", "pask_jax.api", "pask_jax.cli"}
SERVER_SIDE = ("serve", "calibrate")

# (importer's top package, private name) pairs let through.
ALLOWED_PRIVATE: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
  """Dotted module name -> file, for every project module."""
  out = {}
  for top in TOPS:
    for dirpath, dirnames, files in os.walk(ROOT / top):
      dirnames[:] = [d for d in dirnames if not d.startswith((".", "__pycache__"))]
      for f in files:
        if f.endswith(".py"):
          rel = (Path(dirpath) / f).relative_to(ROOT).with_suffix("")
          parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
          out[".".join(parts)] = Path(dirpath) / f
  return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _is_package(name: str) -> bool:
  return MODULES.get(name, Path()).name == "__init__.py"


def _resolve(importer: str, name: str, level: int = 0) -> str | None:
  """The project module an import names, or None for a third-party one."""
  if level:
    base = importer.split(".")
    base = base[:len(base) - level + (1 if _is_package(importer) else 0)]
    name = ".".join(base + ([name] if name else []))
  if name in MODULES:
    return name
  if importer.startswith("tests.") and f"tests.{name}" in MODULES:
    return f"tests.{name}"   # pytest puts tests/ on the path (rootdir conftest)
  return None


def _imports(importer: str, nodes):
  """(imported project module, imported name or None, node, local binding or None) for every
  import among ``nodes``; the binding is the local name of an imported module."""
  for node in nodes:
    if isinstance(node, ast.Import):
      for alias in node.names:
        mod = _resolve(importer, alias.name)
        if mod:
          yield mod, None, node, alias.asname   # `import a.b` binds `a`: matched as a chain
    elif isinstance(node, ast.ImportFrom):
      mod = _resolve(importer, node.module or "", node.level)
      if mod is None:
        continue
      for alias in node.names:
        sub = f"{mod}.{alias.name}"
        if sub in MODULES:
          yield sub, None, node, alias.asname or alias.name
        else:
          yield mod, alias.name, node, None


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def _where(module: str, node) -> str:
  return f"{MODULES[module].relative_to(ROOT)}:{node.lineno}"


def private_reaches() -> list[str]:
  bad = []
  for importer, tree in TREES.items():
    aliases = {}    # local name -> project module it is bound to
    for mod, name, node, local in _imports(importer, ast.walk(tree)):
      if local:
        aliases[local] = mod
      if mod == importer:
        continue
      if name is not None and _private(name):
        bad.append((importer, f"{mod}.{name}", node))
      # a private module is its package's own
      parts = mod.split(".")
      first = next((i for i, p in enumerate(parts) if _private(p)), None)
      if name is None and first is not None:
        owner = ".".join(parts[:first])
        if not (importer == owner or importer.startswith(owner + ".")):
          bad.append((importer, mod, node))
    for node in ast.walk(tree):
      if not (isinstance(node, ast.Attribute) and _private(node.attr)):
        continue
      chain = ast.unparse(node.value)
      mod = aliases.get(chain) or (chain if chain in MODULES else None)
      if mod and mod != importer:
        bad.append((importer, f"{mod}.{node.attr}", node))
  return sorted(f"{_where(imp, node)}: {imp} uses {what}" for imp, what, node in bad
                if (imp.split(".")[0], what.rsplit(".", 1)[-1]) not in ALLOWED_PRIVATE)


def import_graph() -> dict[str, set[str]]:
  """Module -> the project modules it imports, anywhere in it: an import inside a function
  that closes a loop still ties the two modules together (and only works by import order)."""
  return {importer: {mod for mod, _, _, _ in _imports(importer, ast.walk(tree)) if mod != importer}
          for importer, tree in TREES.items()}


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan, iterative)."""
  index, low, on_stack, stack, loops = {}, {}, set(), [], []
  counter = 0
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = counter
    counter += 1
    stack.append(root)
    on_stack.add(root)
    while work:
      v, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = counter
          counter += 1
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph.get(child, ())))))
        elif child in on_stack:
          low[v] = min(low[v], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        comp = []
        while True:
          w = stack.pop()
          on_stack.discard(w)
          comp.append(w)
          if w == v:
            break
        if len(comp) > 1:
          loops.append(sorted(comp))
  return loops


_PATH_EDIT = re.compile(r"\bsys\.path\s*(\.\s*(insert|append|extend|remove|pop|clear)\b|[+\[]|=)")


def sys_path_edits() -> list[str]:
  """``sys.path`` changed (in code, or in code run from a string) or ``PYTHONPATH`` set."""
  bad = []
  for module, tree in TREES.items():
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path":
        bad.append(f"{_where(module, node)}: {module} touches sys.path")
      elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
          _PATH_EDIT.search(node.value)) and module != "tests.test_structure":
        bad.append(f"{_where(module, node)}: {module} runs code that edits sys.path")
      elif isinstance(node, ast.keyword) and node.arg == "PYTHONPATH" or (
          isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
          and ast.unparse(node.slice) == "'PYTHONPATH'"):
        bad.append(f"{_where(module, node)}: {module} sets PYTHONPATH")
  return bad


def face_only_imports() -> list[str]:
  bad = []
  for module, tree in TREES.items():
    for mod, _, node, _ in _imports(module, ast.walk(tree)):
      if (module.startswith("pask_jax") and module not in FACE
          and mod.split(".")[0] in SERVER_SIDE):
        bad.append(f"{_where(module, node)}: {module} imports {mod}")
      if mod == "pask_jax.cli" and module not in FACE and not module.startswith("tests."):
        bad.append(f"{_where(module, node)}: {module} imports {mod}")
  return bad


def test_modules_found():
  assert {"pask_jax.api", "pask_jax.grammar.matcher", "serve.app", "tests.test_structure"} <= set(
      MODULES)
  assert _resolve("pask_jax.grammar.toolcall", "matcher", 1) == "pask_jax.grammar.matcher"
  assert _resolve("pask_jax.grammar", "toolcall", 1) == "pask_jax.grammar.toolcall"


def test_no_private_reach():
  assert private_reaches() == []


def test_no_import_loop():
  assert import_loops(import_graph()) == []


def test_no_sys_path_edit():
  assert sys_path_edits() == []


def test_only_the_face_imports_serve_and_calibrate():
  assert face_only_imports() == []


def test_checks_catch_violations():
  """Each check fails on a made-up violation, so the tests above cannot pass vacuously."""
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert import_loops(graph) == [["a", "b", "c"]]
  assert import_loops({"a": {"b"}, "b": set()}) == []
  src = {"pask_jax.grammar.sql": "from pask_jax.grammar.matcher import _xgr\n",
         "pask_jax.ledger": "import sys\nsys.path.insert(0, 'x')\nfrom serve import app\n",
         "pask_jax.policy": "from pask_jax import cli as c\nc._pick()\n",
         "bench.bench_soak": "env = dict(PYTHONPATH='.')\nrun('import sys; sys.path[:0] = [1]')\n",
         "pask_jax.tags": "from pask_jax import policy\n",   # policy imports tags: a loop
         "pask_jax.api": "from pask_jax.baselines import _rank\n",
         "pask_jax.baselines.h2o": "from pask_jax.baselines import _rank\n",
         "calibrate.stages": "def f():\n  from pask_jax.cli import main\n"}
  saved = {m: TREES[m] for m in src}
  try:
    TREES.update({m: ast.parse(s) for m, s in src.items()})
    reaches = private_reaches()
    assert any("pask_jax.grammar.matcher._xgr" in r for r in reaches)
    assert any("pask_jax.cli._pick" in r for r in reaches)
    assert any("pask_jax.api uses pask_jax.baselines._rank" in r for r in reaches)
    assert not any("h2o" in r for r in reaches)      # a private module is its package's own
    assert any({"pask_jax.policy", "pask_jax.tags"} <= set(loop)
               for loop in import_loops(import_graph()))
    edits = sys_path_edits()
    assert any("pask_jax.ledger touches sys.path" in r for r in edits)
    assert any("bench.bench_soak sets PYTHONPATH" in r for r in edits)
    assert any("bench.bench_soak runs code that edits sys.path" in r for r in edits)
    face = face_only_imports()
    assert any("pask_jax.ledger imports serve" in r for r in face)
    assert any("calibrate.stages imports pask_jax.cli" in r for r in face)
  finally:
    TREES.update(saved)
