"""What keeps a decode step's launch cheap: logits written into the previous call's logits buffer
(:class:`Recycler`), and host inputs sent as transfers, not programs (:func:`upload`).

Why (issue 24, measured on an H100 with jax 0.11.2; bench/RESULTS.md, "Session of 2026-12-07
(fourth)"): XLA runs a decode step as one CUDA graph and, before each launch, re-parameterizes
every graph node that touches a buffer whose address changed since the previous launch.  The
logits ``[B, V]`` are the step's one large fresh output, and XLA's buffer assignment places
intermediates of every layer in that allocation (97 values at the Qwen 0.5B shape: GEMM
outputs, attention partials) while the logits are not yet live.  The caller still holds the
previous step's logits when the next step allocates, so the allocation moves every step and
~260 of the 0.5B step's 373 nodes were updated per launch: 0.5-1.1 ms of host time.  Donating
the previous logits makes the new logits alias them: one address, no node updated.

The contract this adds: the logits (the output at ``out``) that call n returned are donated
by call n + 1, so read them (or launch what reads them) before the next call; keep a host copy
(``np.asarray``) to hold them longer.  Everything else is ``jax.jit``'s.  On one GPU the runners'
``step`` (so ``advance_logits``) recycle (:func:`step_jit`); on a CPU, a TPU or a mesh they are
plain ``jax.jit`` and their logits stay valid.
"""
from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class Recycler:
  """``jax.jit(fn, donate_argnums=...)`` that also donates the buffer of its previous result's
  logits (``result[out]``, an array of ``like``'s shape and dtype) to the next call.

  ``like``: a ``jax.ShapeDtypeStruct`` of the logits (with its sharding on a mesh); the first
  call donates zeros of it.  ``in_shardings``: ``fn``'s, without the recycled buffer (``like``'s
  sharding is added for it).  ``static_argnames``: ``fn``'s static arguments (a runner step's
  ``how``), by position or by keyword.  Calls take and return exactly what ``fn`` does."""

  def __init__(self, fn: Callable, like: jax.ShapeDtypeStruct, *,
               donate_argnums: Sequence[int] = (), out: int = 0,
               in_shardings: Any = None, out_shardings: Any = None,
               static_argnames: Sequence[str] = ()):
    def inner(spent, *args, **static):
      del spent   # donated: XLA writes the new logits into its buffer
      return fn(*args, **static)
    # the compiled module's name (profiles, dumps): the step's own
    inner.__name__ = inner.__qualname__ = getattr(fn, "__name__", "step")

    kw = {}
    if in_shardings is not None:
      kw["in_shardings"] = (like.sharding,) + tuple(in_shardings)
    if out_shardings is not None:
      kw["out_shardings"] = out_shardings
    # ``inner`` takes ``fn``'s arguments as ``*args``: their static positions from ``fn``'s
    static_argnums = () if not static_argnames else tuple(
        i + 1 for i, name in enumerate(inspect.signature(fn).parameters)
        if name in static_argnames)
    # keep_unused: an unused argument is otherwise pruned, and with it the donation
    self._jit = jax.jit(inner, donate_argnums=(0,) + tuple(i + 1 for i in donate_argnums),
                        keep_unused=True, static_argnums=static_argnums,
                        static_argnames=tuple(static_argnames), **kw)
    self.like, self.out = like, out
    self._spent = None
    self._lock = threading.Lock()   # one caller at a time takes and replaces the buffer

  def _fresh(self):
    z = jnp.zeros(self.like.shape, self.like.dtype)
    sharding = getattr(self.like, "sharding", None)
    return z if sharding is None else jax.device_put(z, sharding)

  def __call__(self, *args, **static):
    with self._lock:
      spent, self._spent = self._spent, None   # a failed call leaves none to donate twice
      if spent is None or spent.is_deleted():   # first call, or a caller donated it itself
        spent = self._fresh()
      result = self._jit(spent, *args, **static)
      self._spent = _at(result, self.out)
      return result

  def lower(self, *args, **static):
    """``jax.jit``'s ``lower`` of one call (with a fresh recycled buffer)."""
    return self._jit.lower(self._fresh(), *args, **static)

  @property
  def jitted(self):
    """The underlying ``jax.jit`` object; its first argument is the recycled buffer (for
    ahead-of-time compiles: pass ``like`` there)."""
    return self._jit


def _at(result, out: int):
  """The logits inside a step's result: ``result[out]``, or the first leaf under it (a step
  that returns ``((logits, actions), state)`` names ``out=0`` and gets ``logits``)."""
  x = result[out]
  while isinstance(x, (tuple, list)):
    x = x[0]
  return x


def graphs() -> bool:
  """Whether jitted steps run here as CUDA graphs (the default backend is a GPU): where a moving
  logits buffer costs launch time, so where the runners recycle it."""
  return jax.default_backend() == "gpu"


def step_jit(fn: Callable, like: jax.ShapeDtypeStruct, *, donate_argnums: Sequence[int],
             static_argnames: Sequence[str] = ("how",)):
  """A runner's single-device ``step`` (``-> (next tokens, logits, state)``) jitted with
  ``donate_argnums`` and ``static_argnames`` (the sampler's ``how``: by position or keyword):
  on a GPU a :class:`Recycler` of its logits (valid until the next step; ``generate`` and the
  scoring loops read them before), elsewhere plain ``jax.jit``."""
  if not graphs():
    return jax.jit(fn, donate_argnums=donate_argnums, static_argnames=static_argnames)
  return Recycler(fn, like, donate_argnums=donate_argnums, out=1,
                  static_argnames=static_argnames)


def logits_like(batch: int, vocab: int, sharding=None) -> jax.ShapeDtypeStruct:
  """A step's logits: float32 ``[batch, vocab]`` (``models.decoder``'s head)."""
  return jax.ShapeDtypeStruct((batch, vocab), jnp.float32, sharding=sharding)


def upload(x, sharding=None) -> jax.Array:
  """A host value (NumPy array, list, scalar) on the device for a jitted step: a transfer only.

  Why: ``jnp.asarray`` of a NumPy array runs XLA's ``stage`` program -- one more executable per
  input per step (on an H100, three of the serving engine's five executables per decode step,
  each ~0.2 ms of host time in ``ExecuteThunks``).  ``jax.device_put`` only copies.  The value
  is copied on the host first: on a CPU ``device_put`` aliases a NumPy buffer, and the loops
  rewrite theirs in place.  Dtypes are canonicalized as ``jnp.asarray`` does (int64 -> int32
  without x64).  ``sharding``: where to put it (on a mesh: replicated, as the step takes it)."""
  x = np.array(x)
  return jax.device_put(x) if sharding is None else jax.device_put(x, sharding)
