"""Calibration across processes (issue 28, deliverable 3): one Alg. 1 run over the devices of
several processes — several hosts, or several accelerators each driven by its own process.

Every process runs the same command (same model, task, cases, seed and arguments) and the same
host-side work (grammar trackers of every row, Alg. 1's decisions); the device work of the stacked
step is split: its policy axis ``rows`` is sharded over ``jax.devices()``, the devices of all
processes (:func:`calibrate.stack.runner_factory`), and each process feeds only its own devices'
shards of the step's inputs (:func:`to_global`).  The sampled tokens come back replicated, so every
process's trackers see every row.  Only process 0 reads and writes files under ``--out``: the
saved stages it loads are broadcast to the others (:func:`broadcast_bytes`), so all processes
resume from the same state, and the policy and ``calibration.json`` are its alone; the selected
policy's digest is compared across processes at the end (:func:`check_same`).

:func:`initialize` wraps ``jax.distributed.initialize``; it must run before anything touches a
device.  On the CPU, cross-process collectives use gloo (``jax_cpu_collectives_implementation``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"     # what jax.distributed.initialize reads by default


class DistributedError(RuntimeError):
  """A launch across processes that cannot work (bad arguments, unreachable coordinator, a
  process that disagrees with process 0); the message is one line."""


@dataclasses.dataclass(frozen=True)
class Launch:
  coordinator: str      # HOST:PORT of process 0's coordinator service
  num_processes: int
  process_id: int


def parse(coordinator: str | None, num_processes: int | None, process_id: int | None,
          env: dict | None = None) -> Launch | None:
  """The checked launch of ``--coordinator HOST:PORT --num-processes N --process-id I`` (the
  coordinator may come from ``$JAX_COORDINATOR_ADDRESS``); None when none of them is given (one
  process).  Raises :class:`DistributedError` (one line) for a partial or bad set."""
  env = os.environ if env is None else env
  coord = coordinator or (env.get(COORDINATOR_ENV) if num_processes is not None or
                          process_id is not None else None)
  if coord is None and num_processes is None and process_id is None:
    return None
  missing = [f for f, v in (("--coordinator HOST:PORT (or $" + COORDINATOR_ENV + ")", coord),
                            ("--num-processes N", num_processes), ("--process-id I", process_id))
             if v is None]
  if missing:
    raise DistributedError("calibration across processes needs " + ", ".join(missing))
  host, sep, port = coord.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise DistributedError(f"--coordinator {coord!r}: expected HOST:PORT (e.g. 10.0.0.1:7777)")
  if num_processes < 1:
    raise DistributedError(f"--num-processes {num_processes}: must be at least 1")
  if not 0 <= process_id < num_processes:
    raise DistributedError(f"--process-id {process_id} out of range for --num-processes "
                           f"{num_processes} (0 .. {num_processes - 1})")
  return Launch(coord, num_processes, process_id)


def _reachable(coordinator: str, timeout: float) -> bool:
  host, _, port = coordinator.rpartition(":")
  host = host.strip("[]")
  end = time.monotonic() + timeout
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=min(2.0, timeout)):
        return True
    except OSError:
      if time.monotonic() >= end:
        return False
      time.sleep(0.2)


def initialize(launch: Launch, *, timeout: int = 120, exit_on_timeout: bool = True) -> None:
  """``jax.distributed.initialize`` for ``launch`` (before any device use), with gloo for CPU
  collectives.  A coordinator that does not answer within ``timeout`` seconds is a one-line
  :class:`DistributedError` (process 0 starts the coordinator itself; the others wait for it).
  Should the coordinator answer but not every process join within ``timeout``, the process
  exits with status 1 and one line on stderr (``exit_on_timeout``; XLA would abort it)."""
  import jax
  if launch.num_processes == 1 and launch.process_id == 0:
    return                           # nothing to join: one process, as without the flags
  t0 = time.monotonic()
  if launch.process_id != 0 and not _reachable(launch.coordinator, timeout):
    raise DistributedError(f"coordinator {launch.coordinator} unreachable within {timeout} s "
                           "(is process 0 running, and is the port open from this host?)")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  left = max(1.0, timeout - (time.monotonic() - t0))
  # When not every process joins in time, XLA's coordination client aborts the process from a
  # thread of its own (a fatal log and a stack dump); the watchdog ends it first, in one line.
  joined = threading.Event()

  def watchdog():
    if not joined.wait(left):
      sys.stderr.write(f"error: not all {launch.num_processes} processes joined "
                       f"{launch.coordinator} within {timeout} s (this is process "
                       f"{launch.process_id}; is every process started with the same "
                       "--coordinator and --num-processes?)\n")
      sys.stderr.flush()
      os._exit(1)
  if exit_on_timeout:
    threading.Thread(target=watchdog, daemon=True).start()
  try:              # XLA's own deadline later than the watchdog's
    jax.distributed.initialize(launch.coordinator, launch.num_processes, launch.process_id,
                               initialization_timeout=int(left) + 30)
  except Exception as e:  # noqa: BLE001 — XLA's errors span many lines: keep the first
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise DistributedError(f"joining {launch.num_processes} processes at {launch.coordinator} "
                           f"as process {launch.process_id} failed: {first}") from None
  finally:
    joined.set()
  counts = _allgather_ints([jax.local_device_count()])
  if len(set(counts[:, 0].tolist())) > 1:
    raise DistributedError(f"processes have different numbers of devices "
                           f"({counts[:, 0].tolist()}); every process must drive as many")


def count() -> int:
  import jax
  return jax.process_count()


def is_main() -> bool:
  """Process 0 (or the only process): the one that writes files."""
  import jax
  return jax.process_index() == 0


# ---- arrays across processes -----------------------------------------------------------------

def to_global(x, sharding):
  """``x`` (a host value or a process-local array that EVERY process holds in full, the same)
  as a global ``jax.Array`` of ``sharding``: each process places only its own devices' shards
  (``jax.make_array_from_callback``); an array already global (not fully addressable) is
  returned as is."""
  import jax
  if isinstance(x, jax.Array) and (not x.is_fully_addressable or x.sharding == sharding):
    return x
  a = np.asarray(x)
  return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def fetch(x) -> np.ndarray:
  """A (possibly global) array's whole value on this host."""
  import jax
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def _allgather_ints(values) -> np.ndarray:
  """Every process's int64 vector ``values`` -> ``[processes, len]``."""
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int64)))


def broadcast_bytes(data: bytes | None) -> bytes | None:
  """Process 0's ``data`` (None: nothing) on every process; the others' argument is ignored."""
  if count() == 1:
    return data
  from jax.experimental import multihost_utils
  n = int(multihost_utils.broadcast_one_to_all(
      np.int64(-1 if data is None or not is_main() else len(data))))
  if n < 0:
    return None
  buf = np.frombuffer(data, np.uint8) if is_main() else np.zeros((n,), np.uint8)
  if n == 0:
    return b""
  return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8))


def digest(obj: Any) -> bytes:
  """SHA-256 over a pytree of arrays and scalars (dtype, shape and bytes of every leaf)."""
  import jax
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(obj):
    a = np.asarray(leaf)
    h.update(f"{a.dtype}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).tobytes())
  return h.digest()


def check_same(what: str, obj: Any) -> None:
  """Raise :class:`DistributedError` (on every process) unless ``obj`` has the same
  :func:`digest` on every process."""
  if count() == 1:
    return
  d = np.frombuffer(digest(obj), np.uint8).astype(np.int64)
  every = _allgather_ints(d)
  differ = [i for i in range(every.shape[0]) if not np.array_equal(every[i], every[0])]
  if differ:
    raise DistributedError(f"{what} differs between process 0 and process(es) {differ}: the "
                           "processes must run the same command on the same model and data")


def from_main(read) -> bytes | None:
  """``read()`` (bytes or None) run by process 0 only, its answer on every process.  Should it
  raise, process 0 re-raises it and the others raise :class:`DistributedError` with its message
  (no process is left waiting for the others)."""
  if count() == 1:
    return read()
  err = None
  msg = None
  if is_main():
    try:
      got = read()
      msg = b"N" if got is None else b"S" + got
    except Exception as e:  # noqa: BLE001 — handed to the others, then re-raised here
      err = e
      msg = b"E" + f"process 0: {e}".encode("utf-8", "replace")
  msg = broadcast_bytes(msg)
  if err is not None:
    raise err
  if msg[:1] == b"E":
    raise DistributedError(msg[1:].decode("utf-8", "replace").splitlines()[0])
  return None if msg[:1] == b"N" else msg[1:]
