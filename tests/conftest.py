import atexit
import gc
import json
import os
import shutil
import tempfile

import pytest

# The CUDA plugin and libtpu are installed for ahead-of-time compile tests; run everything else on
# the CPU unless the caller chose a platform.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch (XGrammar imports it; the live transformers parity test runs a model on it) uses OpenMP,
# whose idle threads spin after each parallel region: on 2 cores beside a second worker that
# spinning took a third of the parity test's CPU (perf: libgomp) and doubled its wall time.
# Passive waiting changes no result.  Set before libgomp loads (the xgrammar import below), so
# this process, the xdist workers and every subprocess wait passively.  Measured (2026-12-05):
# test_live_against_transformers 33-37 -> 14-16 s of CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# XLA:CPU's fusion emitters (the MLIR code generator for loops and fusions, its default) cost
# about 25 ms of compile per small program, the legacy elemental emitter 15 ms; the suite
# compiles ~12,700 programs, most of them small (eager ops, interpret-mode kernels).  The same
# HLO passes and fusions run either way; only the loop code differs.  Measured on this 2-core
# host (user CPU, 2026-12-05): test_spherical_format 53 -> 38 s, test_decode_pask 86 -> 71 s,
# test_api (the real SmolLM2, default optimization level) 103 -> 93 s.  The CPU client reads
# XLA_FLAGS when it starts, so the flag is in XLA_FLAGS only until the client exists (below):
# libtpu, which the ahead-of-time TPU compile tests load later, reads XLA_FLAGS too and aborts
# on a flag it does not know.  Subprocesses that start a CPU client get it from
# pask_jax.testing.xla_flags ($PASK_TEST_XLA_FLAGS).  PASK_TEST_FUSION_EMITTERS=on keeps XLA's
# defaults (of this flag and the next).
# XLA:CPU also cuts each program's LLVM module into up to 32 parts to compile them on parallel
# threads (--xla_cpu_parallel_codegen_split_count); the suite's programs are small and its two
# workers already fill the two cores, so the parts only add their fixed cost.  One part: the same
# functions, compiled in one module.  Measured on this 2-core host (2026-12-06, three alternating
# runs of tests/test_spherical_format.py + test_mgpu_pool.py, ~2,500 compiles): user CPU 69.0 ->
# 62.0 s, backend compile 33.1 -> 29.6 s.
if (os.environ.get("PASK_TEST_FUSION_EMITTERS", "off") != "on"
    and os.environ["JAX_PLATFORMS"] == "cpu"):
  os.environ.setdefault("PASK_TEST_XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false "
                        "--xla_cpu_parallel_codegen_split_count=1")
_XLA_FLAGS = os.environ.get("XLA_FLAGS")
os.environ["XLA_FLAGS"] = " ".join(filter(None, [_XLA_FLAGS,
                                                 os.environ.get("PASK_TEST_XLA_FLAGS")]))

import jax  # noqa: E402

from pask_jax.grammar.matcher import import_xgrammar  # noqa: E402
from pask_jax.testing import fast_compile  # noqa: E402

jax.devices()   # the CPU client starts here, with the flags above
if _XLA_FLAGS is None:
  del os.environ["XLA_FLAGS"]
else:
  os.environ["XLA_FLAGS"] = _XLA_FLAGS

# xgrammar first, here: its SIGSEGV handler is replaced by faulthandler's (import_xgrammar), so a
# crash ends the run with a traceback instead of hanging it.
import_xgrammar()

# Python's full (generation 2) garbage collections walk every tracked object: in a test process
# that holds JAX, XLA's jit caches, models and tracers that is a few million, ~250 ms a time, and
# the default thresholds ran one every ~9 s of CPU: 7.1 s of 225 s on tests/test_api.py +
# test_engine.py + test_spherical_format.py + test_calibrate_overlap.py (gc.callbacks,
# 2026-12-05).  The objects imported so far are frozen (never garbage: modules, classes,
# functions; a full collection skips them) and a full collection waits for 50 collections of
# generation 1 instead of 10: 2.9 s, peak RSS 3.7 -> 4.0 GB.  Each test file still ends with a
# full collection (_drop_compiled_programs).
gc.freeze()
gc.set_threshold(*gc.get_threshold()[:2], 50)

# Each compiled XLA:CPU program holds about three memory mappings for as long as a jit cache
# keeps it.  The whole suite compiles over 20,000 programs; kept, they reached Linux's
# vm.max_map_count (65,530) at test 732, where a compile's mmap failed and the process hung
# (2026-12-02).  Programs are dropped after each test file (pask_jax.traces.clear_caches), and a
# file that nears the limit fails with a message instead.
MAPS_LIMIT = 0.8

# Programs dropped after a file (below) are compiled again by later files that build the same
# model, engine or kernel; JAX's persistent compilation cache in a directory new for each session
# (removed at exit) lets such a compile load the executable instead.  Every program is written: no
# minimum compile time, no minimum entry size.  Cache hits do not touch the jit caches nor the
# trace counters the tests check, and the programs a file holds (its memory mappings) are the
# same.  On tests/test_decode_pask.py + test_engine.py + test_serve.py: 150 of 627 compiles hit,
# 250 s -> 186 s (2026-12-02).  PASK_TEST_CACHE_DIR=off turns it off; a path keeps the cache there.
# Under pytest-xdist the controller makes the directory and its workers (started after this
# import, with its environment) share it; the controller removes it at exit.
_CACHE_DIR = os.environ.get("PASK_TEST_CACHE_DIR")
if not _CACHE_DIR:
  _CACHE_DIR = os.environ["PASK_TEST_CACHE_DIR"] = tempfile.mkdtemp(prefix="pask-jax-xla-")
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
if _CACHE_DIR != "off":
  jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


# A test file marked ``pytestmark = pytest.mark.fast_compile`` (or one test marked
# ``@pytest.mark.fast_compile``; ``fast_compile(False)`` exempts a test of a marked file) compiles
# with XLA's most expensive optimizations off (jax_disable_most_optimizations: backend
# optimization level 0, no expensive LLVM passes).  For files and tests whose time is compiling
# many small programs (tiny random models, kernel references and interpret-mode kernels on small
# shapes); never for one that executes the real SmolLM2 model (its O0 code runs slower than it
# compiles faster) or compiles for a GPU/TPU to check its resources.  CPU memory analysis is the
# same at either level (buffer assignment precedes LLVM: tests/test_masked_memory.py).
# The flag is read at compile time and is not part of the jit cache key: the programs a file
# compiled are dropped at its end (_drop_compiled_programs), so no other file runs them (a test
# marked alone shares its file's jit caches), and the persistent cache keys programs by their
# compile options.  PASK_TEST_FAST_COMPILE=off compiles everything at the default level.
FAST_COMPILE = os.environ.get("PASK_TEST_FAST_COMPILE", "on") != "off"


def _fast_wanted(node) -> bool:
  m = node.get_closest_marker("fast_compile")
  return FAST_COMPILE and m is not None and bool(m.args[0] if m.args else True)


@pytest.fixture(autouse=True, scope="module")
def _fast_compile_file(request):
  """A marked file: from before its module-scoped fixtures to the end of its last test."""
  with fast_compile(_fast_wanted(request.node)):
    yield


@pytest.fixture(autouse=True)
def _fast_compile_test(request):
  """A test's own mark, ``fast_compile`` or ``fast_compile(False)``, over its file's."""
  with fast_compile(_fast_wanted(request.node)):
    yield


def _maps() -> tuple[int, int]:
  try:
    with open("/proc/self/maps") as f:
      n = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      return n, int(f.read())
  except OSError:   # not Linux
    return 0, 1


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  yield
  from pask_jax.traces import clear_caches
  n, limit = _maps()
  clear_caches()   # trace counters zeroed with the programs: a shared engine's next file
  gc.collect()     # counts its first compile as the first
  assert n < MAPS_LIMIT * limit, (
      f"this test file left {n} memory mappings of vm.max_map_count {limit}: its compiled "
      "programs would exhaust the process's mappings; compile fewer (shared shapes, fewer "
      "static arguments)")


# ---- test order: heaviest files first -------------------------------------------------------
# `pytest -n 2 --dist loadfile` hands whole files to the workers in the order the items arrive,
# the next file to whichever worker is nearly done.  Files in descending time (tests/durations.json:
# seconds per file under the CI line, from `--durations=0`; scripts/test_durations.py rebuilds
# it) are a longest-first schedule: the long files start at once and the short ones fill the end,
# so both workers finish together (a file's own tests keep their order).  A file missing from
# the table goes first (unknown: maybe long).  xdist's own reordering (files by number of tests)
# is turned off so it keeps this one.
#
# Files of one GROUPS entry are one unit of that schedule (their summed time; one worker runs
# them, one after the other, heaviest first): the tests/test_serve*.py files share one loopback
# server (tests/serve_helpers.py: started once per process, model load and warmup compiles about
# 37 s), which a worker then starts once instead of each worker starting it.  (`--dist
# loadgroup` would say this with marks, but it does not group under pytest 9: xdist 3.8 renames
# the node ids through an attribute pytest 9 no longer reads.)
DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
GROUPS = {f: "serve" for f in ("test_serve.py", "test_serve_vllm.py", "test_serve_openai.py",
                               "test_serve_hostile.py")}
# libtpu (the ahead-of-time TPU compiles) holds a lock file per machine: two worker processes
# that both load it fail with "Internal error when accessing libtpu multi-process lockfile", so
# the files that compile for TPU run in one worker.
GROUPS.update({f: "libtpu" for f in ("test_pallas_aot.py", "test_pallas_sph_tpu.py",
                                     "test_pallas_compare.py")})


def _unit(nodeid: str) -> str:
  """The schedule unit of a node id: its file, or its file's group."""
  f = nodeid.split("::", 1)[0]
  return GROUPS.get(os.path.basename(f), f)


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True, optionalhook=True)   # before xdist's own (firstresult)
def pytest_xdist_make_scheduler(config, log):
  if config.getvalue("dist") != "loadfile":
    return None
  from pask_jax.testing.schedule import grouped_files
  return grouped_files(config, log, _unit)   # and a crashed worker ends the run, not hangs it


def pytest_collection_modifyitems(config, items):
  if config.getoption("failedfirst", False) or config.getoption("newfirst", False):
    return   # --ff / --nf chose the order
  try:
    with open(DURATIONS) as f:
      secs = json.load(f)["seconds"]
  except (OSError, ValueError, KeyError):
    return
  file_s = lambda f: secs.get(os.path.basename(f), float("inf"))
  first: dict[str, int] = {}
  unit_s: dict[str, float] = {}
  for i, it in enumerate(items):
    f = it.nodeid.split("::", 1)[0]
    if f not in first:
      first[f] = i
      unit_s[_unit(f)] = unit_s.get(_unit(f), 0.0) + file_s(f)
  unit_first = {}
  for f in sorted(first, key=first.get):
    unit_first.setdefault(_unit(f), first[f])
  key = lambda f: (-unit_s[_unit(f)], unit_first[_unit(f)], -file_s(f), first[f])
  rank = {f: r for r, f in enumerate(sorted(first, key=key))}
  items.sort(key=lambda it: rank[it.nodeid.split("::", 1)[0]])
