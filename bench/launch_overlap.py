"""Can the engine's Python work run while a jitted step is being launched (issue 24)?

On the GPU host the serving engine's decode step is host-bound: launching the forward (one CUDA
graph of ~400 nodes) takes ~2 ms of host time, the per-token Python work (grammar accept, tags,
detokenization) ~1 ms, one after the other.  They could overlap on two threads only if the
launch releases the GIL.  This measures it with a stand-in step (``--kernels`` chained small
GEMMs over as many weight arrays, so also ~that many arguments) and a stand-in of the Python
work (``--py-us`` µs of pure-Python loop):

* launch alone: the host time of one call (it returns once launched), median over ``--iters``;
* Python alone: the time of one unit of Python work;
* both at once: the launch on a second thread while this one runs the Python work, per pair;
  ≈ max(launch, python) if the launch releases the GIL, ≈ their sum if it does not;
* ``device_put`` of a small int32 array (the engine uploads three per step), alone and while a
  step runs on the device.

    python bench/launch_overlap.py --kernels 400 --py-us 1000 --iters 200
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def make_step(kernels: int, width: int):
  """A jitted stand-in step: ``kernels`` dependent small GEMMs, one weight argument each."""
  def step(x, ws):
    for w in ws:
      x = jnp.tanh(x @ w)
    return x
  ws = [jnp.asarray(np.random.default_rng(i).standard_normal((width, width), np.float32) / width)
        for i in range(kernels)]
  x = jnp.ones((8, width), jnp.float32)
  return jax.jit(step), x, ws


def python_work(us: float) -> int:
  """About ``us`` µs of pure-Python work (dict and list traffic, as a parser's accept is)."""
  end, n, d = time.perf_counter() + us * 1e-6, 0, {}
  while time.perf_counter() < end:
    for i in range(50):
      d[i & 15] = d.get(i & 7, 0) + i
    n += 1
  return n


def median_us(ts) -> float:
  return 1e6 * statistics.median(ts)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--kernels", type=int, default=400)
  ap.add_argument("--width", type=int, default=64)
  ap.add_argument("--py-us", type=float, default=1000.0)
  ap.add_argument("--iters", type=int, default=200)
  a = ap.parse_args()
  f, x, ws = make_step(a.kernels, a.width)
  jax.block_until_ready(f(x, ws))
  res = {"device": jax.devices()[0].device_kind, "kernels": a.kernels, "py_us": a.py_us}

  launch, device = [], []
  for _ in range(a.iters):
    t0 = time.perf_counter()
    y = f(x, ws)
    t1 = time.perf_counter()
    jax.block_until_ready(y)
    launch.append(t1 - t0)
    device.append(time.perf_counter() - t0)
  res["launch_us"], res["call_and_wait_us"] = median_us(launch), median_us(device)

  py = []
  for _ in range(a.iters):
    t0 = time.perf_counter()
    python_work(a.py_us)
    py.append(time.perf_counter() - t0)
  res["python_us"] = median_us(py)

  # Both at once: the launch on a worker thread, the Python work here; a pair ends when both have.
  pool = concurrent.futures.ThreadPoolExecutor(1)
  pairs, worker_launch = [], []

  def launch_one():
    t0 = time.perf_counter()
    y = f(x, ws)
    worker_launch.append(time.perf_counter() - t0)
    return y
  for _ in range(a.iters):
    t0 = time.perf_counter()
    fut = pool.submit(launch_one)
    python_work(a.py_us)
    y = fut.result()
    pairs.append(time.perf_counter() - t0)
    jax.block_until_ready(y)
  pool.shutdown()
  res["pair_us"], res["launch_on_worker_us"] = median_us(pairs), median_us(worker_launch)
  res["pair_if_serial_us"] = res["launch_us"] + res["python_us"]
  res["pair_if_overlapped_us"] = max(res["launch_us"], res["python_us"])

  # Small uploads: alone, and while the device runs a step.
  small = np.arange(8 * 18, dtype=np.int32).reshape(8, 18)
  idle, busy = [], []
  for _ in range(a.iters):
    t0 = time.perf_counter()
    u = jax.device_put(small)
    idle.append(time.perf_counter() - t0)
    jax.block_until_ready(u)
  for _ in range(a.iters):
    y = f(x, ws)
    t0 = time.perf_counter()
    u = jax.device_put(small)
    busy.append(time.perf_counter() - t0)
    jax.block_until_ready((u, y))
  res["device_put_idle_us"], res["device_put_busy_us"] = median_us(idle), median_us(busy)
  print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in res.items()}))


if __name__ == "__main__":
  main()
