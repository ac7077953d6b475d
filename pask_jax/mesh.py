"""Tensor parallelism on a 1-D ``model`` mesh (issue 28, stage 1): where each weight and cache is.

Megatron-style, written as shardings only: the runner jits its step with these in/out shardings
and XLA's SPMD partitioner inserts the collectives.  Per layer (N = devices on the axis):

===============================  ============================  ================================
weight / array                   PartitionSpec                 why
===============================  ============================  ================================
``wq`` ``wk`` ``wv`` [L, d, H·D]  ``(None, None, "model")``     column parallel, by head: device
``bq`` ``bk`` ``bv`` [L, H·D]     ``(None, "model")``           i holds KV heads [i·Hkv/N, …) and
                                                               the query heads of those GQA
                                                               groups (query head h belongs to
                                                               KV head h // group, so a
                                                               contiguous split keeps groups
                                                               whole)
``wo`` [L, Hq·D, d]              ``(None, "model", None)``     row parallel: partial sums, one
                                                               all-reduce after the o-projection
``w_gate`` ``w_up`` [L, d, f]    ``(None, None, "model")``     column parallel
``w_down`` [L, f, d]             ``(None, "model", None)``     row parallel: one all-reduce
``k_center`` [L, Hkv, D]         ``(None, "model", None)``     by KV head, like the keys
``embed`` [V, d]                 ``("model", None)``           by vocabulary (see below)
``lm_head`` [d, V]               ``(None, "model")``           by vocabulary
norms, ``inv_freq``              replicated                    small; every device needs them
dense KV cache [L, B, S, Hkv, D] ``(…, "model", None)``        by KV head: attention is local
===============================  ============================  ================================

Embeddings and lm_head are sharded over the vocabulary (``shard_vocab=True``, the default), not
replicated: for the models this project serves they are a large share of the weights (Qwen3-14B:
two 1.5 GB tables of 28 GB; Qwen2.5-0.5B: 0.27 of 0.99 GB tied) and the lm_head matmul reads its
whole table every step, so sharding it divides both bytes and time by N.  Costs: the embedding
lookup becomes a masked local gather plus one all-reduce of ``[B, T, d]``, and the logits come
out vocabulary-sharded; the runner applies the grammar bitmask to its shard and then gathers the
masked logits ``[B, V]`` (one all-gather; sampling then runs replicated, the same draw on every
device).  ``shard_vocab=False`` replicates both tables (a vocabulary that N does not divide).

Both layer layouts (``models.decoder``) run on a mesh; a runner takes the one it would take on
one device (:func:`prepare_model`: the unrolled one on GPU/TPU, ``$PASK_LAYER_LAYOUT`` or an
explicit ``models.decoder.set_layout`` choice overriding).  The table is the stacked layout's;
the unrolled layout holds each layer's arrays without the leading layer axis, split the same
way, and fuses ``wq|wk|wv`` (``w_qkv``, biases ``b_qkv``) and ``w_gate|w_up`` (``w_gu``) into one
matmul each.  Their columns are ordered shard-major for the mesh's size N
(``models.decoder.fuse``: block i = device i's query, key and value heads; its gate and up
columns), so the contiguous split ``(None, "model")`` gives each device whole heads, and the
model splits the fused output by a reshape to ``[…, N, C/N]`` plus slices of the unsharded last
axis: no collective.  The compiled step has the same collectives in either layout, two
all-reduces per layer (the stacked layout's in the scan's body, the unrolled one's in line).
Why the unrolled layout: the scan copies each layer's slice of every stacked weight before its
matmul (H200, Qwen3-4B shape, one device: 9.82 ms per PASK step stacked, 5.59 ms unrolled).

The PASK attention kernels (Pallas: "gpu", "tpu") are opaque to the SPMD partitioner, so
:func:`attention_per_shard` calls them per device through ``jax.shard_map``: each device runs the
kernel on its own KV heads (its slice of the window and both pools) and the query heads of those
GQA groups, with the page tables and lengths replicated (the controller's decisions are per token
and layer group, the same for every head); the output stays sharded by query head, which is what
the row-parallel o-projection takes.  Nothing is gathered.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models import decoder
from pask_jax import recycle
from models.config import ModelConfig

AXIS = "model"

_HEADS_OUT = P(None, None, AXIS)    # [L, d, H·D] / [L, d, f]: output columns
_ROWS = P(None, AXIS, None)         # [L, in, d]: input rows (partial sums)
SPECS: dict[str, P] = {
    "wq": _HEADS_OUT, "wk": _HEADS_OUT, "wv": _HEADS_OUT,
    "bq": P(None, AXIS), "bk": P(None, AXIS), "bv": P(None, AXIS),
    "wo": _ROWS,
    "w_gate": _HEADS_OUT, "w_up": _HEADS_OUT, "w_down": _ROWS,
    "k_center": P(None, AXIS, None),
}
VOCAB_SPECS: dict[str, P] = {"embed": P(AXIS, None), "lm_head": P(None, AXIS)}
REPLICATED = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "norm", "inv_freq", "embed",
              "lm_head")
# The attention and MLP weights: each device holds 1/N of them.
SHARDED_WEIGHTS = tuple(SPECS)


def model_mesh(n: int | None = None, devices: Sequence[Any] | None = None) -> Mesh:
  """A 1-D mesh named ``model`` over ``devices`` (default: the first ``n`` of ``jax.devices()``,
  all of them when ``n`` is None)."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices) if n is None else n
  if not 0 < n <= len(devices):
    raise ValueError(f"a model mesh of {n} devices asked, {len(devices)} available")
  return Mesh(np.asarray(devices[:n]), (AXIS,))


def serving_mesh(n, cfg: ModelConfig | None = None, *, shard_vocab: bool = True) -> Mesh | None:
  """The mesh of ``--tensor-parallel-size n`` (vLLM's name): the first ``n`` local devices, None
  for ``n = 1``; ``cfg`` checked against it (:func:`check`).  Bad values: one-line ValueError."""
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"tensor_parallel_size must be a positive int, got {n!r}")
  devices = jax.local_devices()
  if n > len(devices):
    raise ValueError(f"tensor_parallel_size {n} is more than the {len(devices)} local "
                     f"{devices[0].platform} device{'s' * (len(devices) > 1)} of this process")
  if cfg is not None:
    check(cfg, int(n), shard_vocab=shard_vocab)
  return None if n == 1 else model_mesh(int(n), devices)


def check(cfg: ModelConfig, n: int, *, shard_vocab: bool = True) -> None:
  """Refuse (ValueError, one line) a model whose groups do not split over ``n`` devices."""
  if cfg.n_kv_heads % n or cfg.n_heads % n:
    raise ValueError(
        f"tensor parallelism over {n} devices: {cfg.n_kv_heads} KV heads (GQA groups of "
        f"{cfg.group} query heads, {cfg.n_heads} query heads in all) do not split into whole "
        f"groups per device; the KV heads must be a multiple of {n}")
  if cfg.intermediate % n:
    raise ValueError(f"tensor parallelism over {n} devices: the MLP's intermediate size "
                     f"{cfg.intermediate} is not a multiple of {n}")
  if shard_vocab and cfg.vocab_size % n:
    raise ValueError(f"tensor parallelism over {n} devices: the vocabulary of {cfg.vocab_size} "
                     f"tokens is not a multiple of {n} (shard_vocab=False replicates the "
                     "embeddings and lm_head)")


def spec(name: str, *, shard_vocab: bool = True, stacked: bool = True) -> P:
  """The PartitionSpec of the model weight ``name``: a stacked weight, or (``stacked=False``)
  one layer's array of the unrolled layout, the fused ``w_qkv`` / ``b_qkv`` / ``w_gu`` split
  like their parts (their columns shard-major: ``models.decoder.fuse``)."""
  if shard_vocab and name in VOCAB_SPECS:
    return VOCAB_SPECS[name]
  name = decoder.FUSED.get(name, (name,))[0]
  if name in SPECS:
    return SPECS[name] if stacked else P(*SPECS[name][1:])   # no leading layer axis
  if name in REPLICATED:
    return P()
  raise ValueError(f"no tensor-parallel sharding rule for the model weight {name!r}")


def _name(path) -> tuple[str, bool]:
  """A parameter's weight name and whether it is stacked: ``(name, …)`` at the top, or
  ``("layers", i, name, …)`` in the unrolled layout."""
  keys = [k.key if hasattr(k, "key") else getattr(k, "name", str(k)) for k in path]
  return (str(keys[2]), False) if keys[0] == "layers" else (str(keys[0]), True)


def param_shardings(params, mesh: Mesh, *, shard_vocab: bool = True):
  """The NamedSharding of every leaf of an ``nnx.split`` state or its plain dict
  (``models.decoder.split``; either layer layout), same tree."""
  def one(path, _):
    name, stacked = _name(path)
    return NamedSharding(mesh, spec(name, shard_vocab=shard_vocab, stacked=stacked))
  return jax.tree_util.tree_map_with_path(one, params)


def sharded_weights(params) -> list:
  """The attention and MLP weights of an ``nnx.split`` state or its plain dict (either layout):
  what each of N devices holds 1/N of."""
  names = set(SHARDED_WEIGHTS) | set(decoder.FUSED)
  return [x for path, x in jax.tree_util.tree_leaves_with_path(params)
          if _name(path)[0] in names]


def prepare_model(model, mesh: Mesh, *, shard_vocab: bool = True, layout: str = "auto"):
  """Check ``model`` against the mesh, put it in ``layout`` (``models.decoder.prepare``: "auto"
  is the layout a single-device runner would take, its fused columns ordered for the mesh's
  size) and its parameters where :func:`param_shardings` places them (both in place) and
  return ``(graphdef, params)``.  In place, so the model keeps no unsharded copy and every
  runner made from it (an engine's prefill runner, its PASK runner's dense half) shares one
  placed copy: placing an array where it already is copies nothing."""
  from flax import nnx
  check(model.cfg, mesh.size, shard_vocab=shard_vocab)
  decoder.prepare(model, layout, tp=mesh.size)
  graphdef, params = nnx.split(model)
  params = jax.device_put(params, param_shardings(params, mesh, shard_vocab=shard_vocab))
  nnx.update(model, params)
  return graphdef, nnx.to_pure_dict(params)   # the jits' form: models.decoder.split


def attention_per_shard(attn, mesh: Mesh):
  """``attn(q, window, hi, lo, maps, *, layer, sph=None, return_lse=False)``
  (``pallas_kernels.decode_attention`` with its backend and knobs bound) run per device of
  ``mesh``'s ``model`` axis by ``jax.shard_map``: q [B, Hq, D] and the output (and the LSE
  [B, Hq]) by query head, the window and both pools (either INT4 storage format, with or without
  the leading layer axis) by KV head, ``maps`` and ``layer`` replicated.

  ``sph`` (Spherical KV's tier partitions, ``pallas_kernels.sph_types.SphInputs``): each tier
  pool split on its page axis, the page tables and lengths and the centering means by KV head,
  the rotation signs replicated.  A page holds one KV head's rows, and the tables of device i's
  heads name pages of block i of the pool only (:func:`pask_jax.spherical.cache.init` with
  ``shards``), so in the body a global page id minus i·(pages per device) is the local one."""
  def kv(x, axis):   # ``axis`` counted from the end, so a leading layer axis changes nothing
    return P(*[AXIS if i == x.ndim + axis else None for i in range(x.ndim)])

  def run(q, window, hi, lo, maps, *, layer=None, sph=None, return_lse=False):
    head = -2 if lo.format == "bytes" else -3    # pallas_kernels.types.LowPool's two layouts
    specs = (P(None, AXIS, None),
             type(window)(kv(window.k, -2), kv(window.v, -2), P()),
             type(hi)(kv(hi.k, -2), kv(hi.v, -2)),
             type(lo)(kv(lo.k, head), kv(lo.v, head), kv(lo.scale, head)),
             type(maps)(*(P() for _ in maps)))
    args = [q, window, hi, lo, maps]
    if sph is not None:
      page_axis = 0 if layer is None else 1      # [(L,) P, page, ...]
      by_page = lambda x: P(*[AXIS if i == page_axis else None for i in range(x.ndim)])
      pools = tuple(type(p)(*(by_page(a) for a in p)) for p in sph.pools)
      maps_s = type(sph.maps)(tuple(kv(x, -2) for x in sph.maps.pages),
                              tuple(kv(x, -1) for x in sph.maps.length))
      specs += (type(sph)(pools, maps_s, type(sph.consts)(P(), kv(sph.consts.mu, -2)),
                          sph.spec),)
      args.append(sph)
    if layer is not None:
      specs += (P(),)
      args.append(jnp.asarray(layer, jnp.int32))

    def body(*a):
      kw = dict(return_lse=True) if return_lse else {}
      if sph is not None:
        s = a[5]
        base = [jax.lax.axis_index(AXIS) * p.ang.shape[-3] for p in s.pools]   # local pages
        local = type(s.maps)(tuple(t - b for t, b in zip(s.maps.pages, base)), s.maps.length)
        kw["sph"] = type(s)(s.pools, local, s.consts, s.spec)
      if layer is not None:
        kw["layer"] = a[-1]
      return attn(*a[:5], **kw)
    out = P(None, AXIS, None)
    # check_vma=False: a pallas_call's outputs carry no varying-axes type; every output here
    # varies over the axis (each device its own heads), as out_specs says
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, check_vma=False,
                      out_specs=(out, P(None, AXIS)) if return_lse else out)
    return f(*args)
  return run


def on_every_device(fn, mesh: Mesh):
  """``fn`` run whole on every device of ``mesh`` (``jax.shard_map``, every input and output
  replicated): a decision that reads every KV head (Spherical KV's routes, page tables) computed
  the same on each device, where the SPMD partitioner would split it by head and gather the
  pieces back (one small collective per map).  Inputs split over the mesh are gathered first."""
  def run(*args):
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(),
                         check_vma=False)(*args)
  return run


def pask_cache_sharding(mesh: Mesh, shapes, *, lo_format: str = "bytes"):
  """The shardings of a PASK cache (``pask_jax.cache.Cache``; ``shapes``: it or its
  ``jax.eval_shape``): every K/V pool and the window by KV head, the page tables, lengths and
  positions replicated.  ``lo_format``: the INT4 pool's storage ("bytes": its head axis third,
  else second)."""
  axis = 3 if lo_format == "bytes" else 2
  per = lambda name, x: by_kv_head(mesh, x.ndim, 3 if name in (
      "win_k", "win_v", "hi_k", "hi_v") else axis)
  layers = type(shapes.layers)(**{f: per(f, getattr(shapes.layers, f))
                                  for f in shapes.layers.__dataclass_fields__})
  rep = replicated(mesh)
  return jax.tree.map(lambda _: rep, shapes).replace(layers=layers)


def prepare(model, mesh: Mesh | None, *, shard_vocab: bool = True):
  """A runner's model and mesh: ``(tp_mesh, graphdef, params)``.  ``tp_mesh`` is None for no
  mesh or a mesh of one device (then the model takes its backend's layout, unsharded);
  otherwise :func:`prepare_model` (checked, the same layout rule, parameters placed)."""
  if mesh is None or mesh.size == 1:
    decoder.prepare(model)
    return (None,) + decoder.split(model)
  return (mesh,) + prepare_model(model, mesh, shard_vocab=shard_vocab)


def step_shardings(mesh: Mesh, params, *, shard_vocab: bool = True):
  """``(params' shardings, replicated, logits' sharding)``: what a runner's jits name."""
  return (jax.tree.map(lambda x: x.sharding, params), replicated(mesh),
          logits_sharding(mesh, shard_vocab=shard_vocab))


def compressing_jits(fns, mesh: Mesh | None, params, state_sharding, *, shard_vocab: bool,
                     step_inputs: int, logits: jax.ShapeDtypeStruct):
  """``fns = (prefill, compress, step, select)`` of a runner whose per-head state is compressed
  after prefill (the masked baselines, TriAxialKV), jitted with the state donated: plain jits
  without a mesh; on one, the parameters', state's (``state_sharding()``) and logits' shardings
  named, so each compiles once.  ``step_inputs``: the step's replicated inputs after the
  parameters and the state; ``logits``: the step's logits, recycled on one GPU
  (:func:`pask_jax.recycle.step_jit`).  The step's and the select's ``how`` (the sampler's
  branches, :func:`pask_jax.sample.sample`) are static; on a mesh both take it by position."""
  prefill, compress, step, select = fns
  if mesh is None:
    return (jax.jit(prefill, donate_argnums=(1,)), jax.jit(compress, donate_argnums=(0,)),
            recycle.step_jit(step, logits, donate_argnums=(1,)),
            jax.jit(select, static_argnames=("how",)))
  ps, rep, lg = step_shardings(mesh, params, shard_vocab=shard_vocab)
  ss = state_sharding()
  return (jax.jit(prefill, donate_argnums=(1,), in_shardings=(ps, ss, rep, rep, rep),
                  out_shardings=(lg, ss)),
          jax.jit(compress, donate_argnums=(0,), in_shardings=(ss,), out_shardings=ss),
          jax.jit(step, donate_argnums=(1,), in_shardings=(ps, ss) + (rep,) * step_inputs,
                  out_shardings=(rep, lg, ss), static_argnames=("how",)),
          jax.jit(select, in_shardings=(lg,) + (rep,) * 4, out_shardings=rep,
                  static_argnames=("how",)))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def by_kv_head(mesh: Mesh, ndim: int, axis: int) -> NamedSharding:
  """An ``ndim``-D array sharded on ``axis`` (its KV-head axis) and replicated elsewhere."""
  return NamedSharding(mesh, P(*[AXIS if i == axis % ndim else None for i in range(ndim)]))


def logits_sharding(mesh: Mesh, *, shard_vocab: bool = True) -> NamedSharding:
  """``[B, V]`` logits as the lm_head makes them."""
  return NamedSharding(mesh, P(None, AXIS) if shard_vocab else P())


def shard_fraction(arrays) -> float:
  """Bytes on the first device / bytes in all, over a pytree of placed arrays (1/N when every
  leaf is split evenly over N devices; 1 when replicated)."""
  leaves = jax.tree.leaves(arrays)
  dev = leaves[0].sharding.device_set
  first = min(dev, key=lambda d: d.id)
  mine = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == first)
  return mine / sum(x.nbytes for x in leaves)
