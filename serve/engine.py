"""The serving engine: continuous batching of requests over one paged PASK cache.

One engine thread owns every device call.  The decode batch has ``slots`` sequence slots
(``--max-num-seqs``) that share one :class:`pask_jax.cache.Cache` (``cache.init_paged``) whose
BF16 and INT4 pools are sized from a KV memory budget (:func:`size_pools`).  Choices, in the
order a request meets them:

* **Pool sizing** (:func:`size_pools`, reported at startup by :meth:`Sizing.describe`).  The
  budget (``kv_bytes``, or ``gpu_memory_utilization`` × the device's free memory after the
  weights, less the prefill scratch) first pays every slot's fixed state (its BF16 recent window,
  page tables and position maps); the rest is split between the pools in proportion to the bytes
  the expected H/L mix puts in each: a fraction ``h`` of the (token, layer group) entries that
  leave the window goes to the BF16 pool, ``l`` to the INT4 pool.  The mix is, in order: the
  ``mix`` argument (``--kv-mix``; e.g. from a run's ``pask_actions_total`` counters), the
  policy record's ``extra.kv_mix``, or :func:`expected_mix` — H only for a policy that never
  reaches L; otherwise the budget B = max(B_P, B_D) spent with no R (the mix that needs the most
  pages): ``h = (B − ρ)/(1 − ρ)``, ``l = 1 − h`` with ρ = m(L)/m(H) (0.26 at head_dim 128).  Each
  pool keeps at least one page per slot (sinks are H forever; every sequence has a partial
  page).  Without a budget the pools hold every slot at full context (the old default);
  ``hi_pages``/``lo_pages`` override either pool.  Page ids are per layer group: a page id names
  one page in each layer of the pool, and layer groups own disjoint layers, so each group has
  its own free list over the same ids (a group's demand never blocks another's).  The pools are
  ``[L, P]`` arrays, so a pool must give every group as many ids as its heaviest group needs:
  ``h`` and ``l`` are the fractions of the heaviest group (a policy whose mix differs between
  groups leaves the lighter groups' share of the pool unused).
* **Admission** is strict FIFO (no overtaking, so a large request is never starved): the queue
  head is admitted when a slot is free and both pools hold, for every layer group, the pages of
  its *prompt plan* — known exactly before prefill, because the prefill plan depends only on the
  prompt-span labels and the policy: the R/L/H decisions of the prompt tokens that leave the
  window, counted per group (tokens still in the window need no page yet) — plus a watermark
  of ``watermark`` × pool pages while other requests run (headroom for their decode growth, as
  vLLM's 1 %).  A request is refused at submit only if it could not complete even alone
  (:meth:`Engine.worst_case`: every token beyond the window in one pool exceeds that pool).
* **Prefill** runs at full precision for one request (batch 1, padded to one of
  :data:`PREFILL_BUCKETS` or a chunk multiple: :func:`bucket`), then ``cache.insert_slot``
  materializes the plan into the slot and its pages (slot and page rows are traced inputs: one
  compile per bucket).
* **Decode pages on demand.**  The host mirrors every slot's per-position actions (the prompt
  plan, then the actions each step returns), so it knows W steps ahead what the token leaving
  the window at the next step needs: a page is taken exactly when the first entry that needs it
  is materialized, and the step receives the new page ids as a traced ``int32[G, B]`` input per
  pool (``cache.assign_pages``): the decode step compiles once.  Free lists are numpy stacks
  (one per pool and layer group); a step's allocation is a few vector ops, no per-page loops.
* **Preemption.**  When a pool (of some group) cannot give the pages this step needs, the
  youngest running request (latest arrival) is preempted — repeatedly, until the step fits:
  its slot and pages are freed and it goes back to the head of the queue; admission then pauses
  until a request ends (else the request just preempted would be readmitted and preempted again
  at every step).  A preempted request keeps its grammar matcher and adapter (host objects that
  already accepted every generated token), its streamed text (nothing is re-sent), its sampling
  step counter and, per position, the R/L/H actions it was given.  Its KV is recomputed, in one
  of two ways (``preemption=``):

  - ``"replay"`` (default): the prompt is prefilled again (same plan, fresh ledger and balance)
    and the generated tokens are re-fed through the decode step with the tags and parser states
    they had, their samples ignored; the last one's step samples the next new token.  The cache,
    controller balance and ledger are rebuilt by the very computation that built them, so the
    output continues bit for bit as in an unpreempted run, under any policy.  Cost: the
    request's slot re-runs its generated steps (other requests keep decoding meanwhile).
  - ``"recompute"`` (vLLM-style): prompt + generated tokens (all but the last, which the next
    step feeds) are prefilled in one go and materialized with their recorded actions; balance
    and ledger are restored.  Decisions and measured B continue exactly, but the generated
    tokens' K/V now come from a full-precision prefill instead of attention over the compressed
    cache (and unrounded attention outputs), so a greedy continuation can differ after a near
    tie, even under Full KV.

  No request fails for lack of pages (the oldest running request can always finish alone:
  :meth:`Engine.worst_case`) and every page comes back.
* **Interleaving**: each engine iteration admits requests into free slots, then runs one decode
  step for all running slots.  A prompt is prefilled in pieces of ``prefill_chunk`` tokens
  (``--prefill-chunk``, default 512; a prompt of at most that many tokens is one piece, and a
  longer one attends to the pieces before it, ``Runner.prefill_chunks``).  A prompt of one piece
  is prefilled when it is admitted; an iteration admits such prompts until their prefills took
  about one decode step (a moving average; at least one).  A long prompt's pieces run between
  decode steps, paced so that while other requests decode they take at most
  ``prefill_share`` of the time (``--prefill-share``, default 1/3;
  :class:`serve.schedule.PrefillPacer`); with nothing decoding it runs at full speed.  A 32K
  prompt thus neither stalls the running streams for its whole prefill nor holds up the
  requests behind it: one long prompt is prefilled at a time, and shorter prompts that arrive
  meanwhile are admitted and prefilled before its remaining pieces (vLLM's partial-prefill rule:
  admission is FIFO except that a one-piece prompt may pass a long one; pages stay FIFO).
* **Decode**: ONE jitted step for the whole batch (``PaskRunner._decode_step`` + per-row
  sampling); inactive slots are masked by ``active`` (neither charged nor written), so it
  compiles once per batch shape.  Sampling keys are per request: fold_in(key(seed), token
  index), so a seeded request samples the same tokens whatever else shares the batch.
* **Overlap** (``overlap=True``, the default where it applies): the host's half of a step
  (launching the ~thousand kernels of the unrolled model: 7 ms per step on the H200 host, which
  the device otherwise waits for; the grammar's accept, tags and next-token masks) runs while
  the device computes the previous step.  A step is split into a forward (cache update +
  logits) and a pick (masked sampling); the next forward is launched right after the pick, fed
  with the token the pick will produce (a device array), before the host has seen it.  What
  that token is matters to the host only through its structural tags, which the controller
  needs — so the forward decides the actions of the token fed one step *earlier*
  (``PaskRunner._deferred_step``, ``cache.set_pending``): every token is decided before it
  leaves the window, from the same tags in the same order, so outputs, actions, balances and
  ledgers are those of the serial engine.  A request that ends (stop token, stop text, length)
  has had its last token fed speculatively; nothing of it is charged, and the slot is released.
  The host knows a token's actions two steps after feeding it, so page growth needs a window
  of at least 3; with ``preemption="recompute"`` or a smaller window the engine runs serially.
* **Per request**: its own grammar matcher + adapter (:class:`pask_jax.decode.Tracker`, with
  ``FCAdapter`` for tools) and its ledger row (reset on insert, read at completion).
* **Stop sequences** (``Request.stop``) are matched on the decoded text after every accepted
  token, so a sequence split across tokens is found; the text is cut before it (the tokens stay
  counted) and the request finishes "stop".  Streamed text holds back the longest tail that could
  still begin a stop sequence.
* **Log-probabilities** (``Request.logprobs``: None, or how many alternatives): inside the jitted
  sampling function, the log-softmax of the grammar-masked logits (before temperature) gives the
  chosen token's log-prob and the top :data:`TOP_LOGPROBS`; computed only when some row asks
  (``lax.cond``), one compile whatever the per-request count.
* **Release**: on completion, cancellation (client disconnect) and error the slot is emptied
  (``cache.release_slot``) and its pages go back to the free lists.

:class:`DenseEngine` is the same engine over the plain-XLA dense Full-KV cache (one row of
``context`` slots per sequence, no pools): the baseline of ``bench/bench_serving.py``.

Events go back to the caller through ``Request.emit(kind, payload)``, called on the engine
thread (the app forwards them to its event loop).  kinds: ``"delta"`` (text), ``"done"``
(result dict), ``"error"`` (message).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pask_jax import cache as pcache
from pask_jax import controller, kv_dense, ledger
from pask_jax import tags as T
from pask_jax.decode import FREE_TAG, PREFILL_CHUNK, PaskRunner, Runner, Tracker, prompt_candidates
from pask_jax.grammar.matcher import new_bitmask
from pask_jax.sample import _nucleus, apply_bitmask
from serve.detok import Detokenizer
from serve.schedule import PREFILL_SHARE, PrefillPacer

_ids = itertools.count(1)
TOP_LOGPROBS = 20   # alternatives computed per step when a request asks for logprobs
METRIC_KEYS = ("queue_wait_s", "prefill_s", "prefills", "decode_steps", "decode_step_s",
               "decode_rows", "requests_stop", "requests_length", "requests_cancelled",
               "requests_error", "prompt_tokens", "completion_tokens", "tpot_s_sum", "tpot_count",
               "overflow", "payload_bits", "full_kv_bits", "actions_R", "actions_L", "actions_H",
               "admission_blocked_pages", "preemptions", "resumed", "replay_steps",
               "plan_s", "admit_s", "alloc_s", "hi_used_peak", "lo_used_peak",
               # where a decode step's wall time goes on the host (sum over steps)
               "fill_s", "dispatch_s", "wait_s", "accept_s")
PREEMPTION = ("recompute", "replay")
PREFILL_CHUNKS = (64, 128, 256, 512)   # prefill piece sizes (each one of the buckets below)
# Padded lengths of a one-piece prompt: steps of 1.5x and 2x, so padding is at most a third of
# a prefill (powers of two >= 64 padded the 33-token chat prompt to 64, a 146-token tool prompt
# to 256: a 64-token piece of nothing but padding), at one compile per bucket.
PREFILL_BUCKETS = (32, 48, 64, 96, 128, 192, 256, 384, 512)
STARVE_STEPS = 16   # a long prompt in progress gets a piece at least every this many decode steps
HI, LO = 0, 1           # pool index of the host-side page bookkeeping
_CODE = (T.H, T.L)      # the action stored in each pool


@dataclasses.dataclass(eq=False)
class Request:
  ids: list[int]
  max_tokens: int
  tracker: Tracker = dataclasses.field(default_factory=Tracker)
  tags: np.ndarray | None = None    # prompt-span label candidates int32[n, 4]
  temperature: float = 0.0
  top_p: float = 1.0
  seed: int = 0
  stop: tuple[str, ...] = ()        # stop sequences (text), matched across token boundaries
  logprobs: int | None = None       # None, or the number of top alternatives to return (<= 20)
  emit: Callable[[str, Any], None] = lambda kind, payload: None
  rid: int = dataclasses.field(default_factory=lambda: next(_ids))
  cancelled: bool = False
  # engine-side state
  slot: int | None = None
  out: list[int] = dataclasses.field(default_factory=list)
  sent: str = ""
  lps: list = dataclasses.field(default_factory=list)   # per token: (logprob, [(id, logprob)])
  cut: int | None = None            # text length before the stop sequence that ended it
  detok: Any = None                 # serve.detok.Detokenizer of ``out`` (engine thread)
  t_submit: float = 0.0
  t_admit: float | None = None
  t_first: float | None = None
  t_last: float | None = None
  seq: int = 0                      # arrival order (preemption takes the largest)
  prompt_plan: np.ndarray | None = None   # int8 [n_prompt, G] prefill plan (host)
  plan: np.ndarray | None = None    # int8 [n, G] actions of the positions its next prefill stores
  resume: dict | None = None        # what a preempted request needs to continue
  replay: int | None = None         # replay mode: index of the generated token being re-fed
  pre: Any = None                   # the prefill in progress (chunks left, length, bucket, rows)
  fed: list = dataclasses.field(default_factory=list)   # (tag ids, state id) of every out token
  preemptions: int = 0

  def cancel(self) -> None:
    """Thread-safe (a flag the engine polls every iteration)."""
    self.cancelled = True


def bucket(n: int, chunk: int = PREFILL_CHUNK) -> int:
  """Padded prefill length of ``n`` prompt tokens prefilled in pieces of ``chunk``: the least of
  :data:`PREFILL_BUCKETS` that holds them (one piece), or past one piece the least multiple of
  ``chunk`` (every piece but the last is full, and none is all padding)."""
  if n > chunk:
    return -(-n // chunk) * chunk
  return next(b for b in PREFILL_BUCKETS if b >= n)


# ---- pool sizing ------------------------------------------------------------------------------

def page_bytes(cfg, page: int) -> tuple[int, int]:
  """Bytes of one page (all layers) of the BF16 pool (K and V) and of the INT4 pool (K and V
  codes, D/2 bytes per row each, plus the fp16 K and V scales)."""
  L, H, D = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
  return 2 * L * page * H * D * 2, L * page * H * (D + 4)


def slot_bytes(cfg, *, window: int, n_groups: int, context: int, page: int) -> int:
  """Fixed cache bytes of one slot: BF16 window K/V, window positions and pending actions,
  page tables and entry positions of both pools, count/overflow."""
  L, H, D = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
  n = math.ceil(context / page)
  return (2 * L * window * H * D * 2 + window * (4 + n_groups) + 2 * n_groups * n * 4
          + 2 * n_groups * n * page * 4 + 2 * n_groups * 4 + 8)


def reachable(policy) -> tuple[bool, bool]:
  """(H reachable, L reachable) beyond the sinks: an entry can take any level between its floor
  and max(base, floor), plus the promotions that have a score.  Unknown tags resolve to H."""
  a = np.asarray(policy.action).astype(np.int32)
  f = np.asarray(policy.floor).astype(np.int32)
  p = np.asarray(policy.prio)
  top = np.maximum(a, f)
  top = np.where((top == T.R) & np.isfinite(p[..., 0]), T.L, top)
  top = np.where((top == T.L) & np.isfinite(p[..., 1]), T.H, top)
  return bool(np.any(top == T.H)), bool(np.any((f <= T.L) & (top >= T.L)))


def worst_pages(policy, n_tokens: int, page: int) -> tuple[int, int]:
  """Pages (BF16 pool, INT4 pool) per layer group that a request of ``n_tokens`` can need at
  most: every token beyond the window in that pool; only the sinks' for a BF16 pool the policy
  never reaches beyond them, none for an INT4 pool it never reaches."""
  can_h, can_l = reachable(policy)
  need = math.ceil(max(0, n_tokens - int(policy.window)) / page)
  sinks = math.ceil(min(need * page, int(policy.sink)) / page)
  return (need if can_h else sinks), (need if can_l else 0)


def expected_mix(policy) -> tuple[float, float, str]:
  """(h, l, source): the expected fractions of window-leaving (token, group) entries stored H
  and L (see the module docstring for the rule)."""
  rec = policy.record.get("extra") or {}
  if "kv_mix" in rec:
    h, l = (float(x) for x in rec["kv_mix"])
    return h, l, "policy record extra.kv_mix"
  can_h, can_l = reachable(policy)
  B = float(min(1.0, max(float(policy.b_p), float(policy.b_d))))
  if not can_l:
    return 1.0, 0.0, "policy never stores L: all H"
  if not can_h:
    return 0.0, 1.0, "policy never stores H beyond sinks: all L"
  cost = np.asarray(policy.cost, np.float64)
  rho = float(cost[T.L].sum() / cost[T.H].sum()) if cost[T.H].sum() > 0 else 0.26
  h = min(1.0, max(0.0, (B - rho) / (1.0 - rho)))
  return h, 1.0 - h, f"policy budget B={B:.2f} spent with no R (rho={rho:.3f})"


@dataclasses.dataclass(frozen=True)
class Sizing:
  """How the KV cache is laid out (pool pages, bytes) and what it holds."""
  slots: int
  context: int
  page: int
  window: int
  hi_pages: int
  lo_pages: int
  hi_page_bytes: int
  lo_page_bytes: int
  fixed_bytes: int             # every slot's window, tables and maps
  kv_bytes: int | None         # the budget (None: sized in pages)
  mix: tuple[float, float]
  mix_source: str
  source: str                  # "budget", "pages" or "full context per slot"

  @property
  def pool_bytes(self) -> int:
    return self.hi_pages * self.hi_page_bytes + self.lo_pages * self.lo_page_bytes

  @property
  def total_bytes(self) -> int:
    return self.pool_bytes + self.fixed_bytes

  def request_pages(self, n_tokens: int, mix: tuple[float, float] | None = None) -> tuple[int, int]:
    """Expected pages (per layer group) of one request of ``n_tokens`` at ``mix``: its share
    of each pool plus one partial page."""
    h, l = mix or self.mix
    t = max(0, n_tokens - self.window)
    return (math.ceil(h * t / self.page) + 1, math.ceil(l * t / self.page) + 1 if l > 0 else 0)

  def requests_fit(self, n_tokens: int, mix: tuple[float, float] | None = None) -> int:
    """Requests of ``n_tokens`` tokens whose expected pages the pools hold at once (memory
    only: the slot count is a separate limit)."""
    h, l = self.request_pages(n_tokens, mix)
    fit = [self.hi_pages // h] + ([self.lo_pages // l] if l else [])
    return int(min(fit))

  def full_kv_fit(self, n_tokens: int) -> int:
    """Requests of ``n_tokens`` a dense BF16 Full-KV cache holds in the same bytes."""
    per = n_tokens * self.hi_page_bytes / self.page
    return int(self.total_bytes // per) if per else 0

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(pool_bytes=self.pool_bytes, total_bytes=self.total_bytes,
             requests_fit=self.requests_fit(self.context),
             full_kv_fit=self.full_kv_fit(self.context))
    return d

  def describe(self) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.2f} MB"
    h, l = self.mix
    head = (f"KV memory {gb(self.kv_bytes)} (budget)" if self.kv_bytes is not None
            else f"KV memory {gb(self.total_bytes)} ({self.source})")
    return (f"{head}: BF16 pool {self.hi_pages:,} pages x {self.page} tokens "
            f"({gb(self.hi_pages * self.hi_page_bytes)}), INT4 pool {self.lo_pages:,} pages "
            f"({gb(self.lo_pages * self.lo_page_bytes)}), windows and tables "
            f"{gb(self.fixed_bytes)} for {self.slots} slots; expected mix H {h:.3f} / L {l:.3f} "
            f"({self.mix_source}); about {self.requests_fit(self.context)} concurrent requests "
            f"of {self.context:,} tokens fit (Full KV in the same memory: "
            f"{self.full_kv_fit(self.context)})")


def size_pools(cfg, policy, *, slots: int, context: int, page: int = 16,
               kv_bytes: int | None = None, mix: tuple[float, float] | None = None,
               hi_pages: int | None = None, lo_pages: int | None = None) -> Sizing:
  """Pool sizes from a KV memory budget (bytes) and the policy (module docstring)."""
  if slots < 1 or context < 1 or page < 1:
    raise ValueError("slots, context and page must be positive")
  window, G = int(policy.window), int(policy.n_groups)
  hb, lb = page_bytes(cfg, page)
  fixed = slots * slot_bytes(cfg, window=window, n_groups=G, context=context, page=page)
  if mix is not None:
    h, l = (float(x) for x in mix)
    if not (0 <= h <= 1 and 0 <= l <= 1 and h + l > 0):
      raise ValueError(f"kv mix must be two fractions in [0, 1] (H, L), not both 0; got {mix}")
    why = "given"
  else:
    h, l, why = expected_mix(policy)
  n_pages = math.ceil(context / page)
  lo_min = slots if l > 0 else 1
  if kv_bytes is None:
    hi = hi_pages or slots * n_pages
    lo = lo_pages or (slots * n_pages if l > 0 else 1)
    source = "pages" if (hi_pages or lo_pages) else "full context per slot"
  else:
    avail = int(kv_bytes) - fixed
    if hi_pages and lo_pages:
      hi, lo = hi_pages, lo_pages
    elif lo_pages:
      hi, lo = (avail - lo_pages * lb) // hb, lo_pages
    elif hi_pages:
      hi, lo = hi_pages, ((avail - hi_pages * hb) // lb if l > 0 else 1)
    elif l == 0:
      hi, lo = (avail - lb) // hb, 1
    else:
      share = h * hb / (h * hb + l * lb)
      hi = int(avail * share // hb)
      lo = int((avail - hi * hb) // lb)
    hi, lo = int(hi), int(lo)
    if hi < slots or lo < lo_min:
      need = fixed + slots * hb + lo_min * lb
      raise ValueError(f"KV memory budget of {kv_bytes / 1e9:.3f} GB is too small for {slots} "
                       f"slots of context {context} (needs at least {need / 1e9:.3f} GB: each "
                       f"slot's window and tables plus one page per slot in each pool)")
    source = "budget"
  return Sizing(slots=slots, context=context, page=page, window=window, hi_pages=int(hi),
                lo_pages=int(max(lo, 1)), hi_page_bytes=hb, lo_page_bytes=lb, fixed_bytes=fixed,
                kv_bytes=None if kv_bytes is None else int(kv_bytes), mix=(h, l),
                mix_source=why, source=source)


def kv_bytes_for_utilization(fraction: float, cfg, context: int, device=None) -> int:
  """``fraction`` of the device's free memory (after whatever is already allocated, e.g. the
  weights), less the transient prefill scratch of one ``context`` prompt (dense BF16 K/V and one
  chunk's attention scores)."""
  if not 0 < fraction <= 1:
    raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
  dev = device or jax.devices()[0]
  stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  if not stats or "bytes_limit" not in stats:
    raise ValueError(f"--gpu-memory-utilization needs a device that reports its memory; "
                     f"{dev.platform} does not: give the KV budget with --kv-memory GB")
  free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  n = max(bucket(context, c) for c in PREFILL_CHUNKS)   # the longest padding of any piece size
  scratch = 2 * cfg.n_layers * n * cfg.n_kv_heads * cfg.head_dim * 2
  scores = min(n, PREFILL_CHUNK) * n * cfg.n_heads * 4
  return int(fraction * free) - scratch - scores


# ---- the engine -------------------------------------------------------------------------------

class Engine:
  paged = True

  def __init__(self, model, tokenizer, policy, *, slots: int = 4, context: int = 1024,
               page: int = 16, hi_pages: int | None = None, lo_pages: int | None = None,
               kv_bytes: int | None = None, gpu_memory_utilization: float | None = None,
               mix: tuple[float, float] | None = None, watermark: float = 0.01,
               preemption: str = "replay", backend: str = "auto",
               prefiller: Runner | None = None, overlap: bool = True,
               prefill_chunk: int = PREFILL_CHUNK, prefill_share: float = PREFILL_SHARE):
    """``slots``: decode batch (``--max-num-seqs``); ``context``: the most tokens (prompt +
    max_tokens) one request may take (``--max-model-len``); ``kv_bytes`` or
    ``gpu_memory_utilization``: the KV memory budget (:func:`size_pools`); ``hi_pages`` /
    ``lo_pages``: pool sizes in pages (override the budget's); ``mix``: expected (H, L)
    fractions; ``preemption``: "recompute" or "replay" (module docstring); ``prefiller``: a
    batch-1 dense :class:`Runner` to share between engines; ``overlap``: overlap the host's
    work with the device step (module docstring; off where it does not apply);
    ``prefill_chunk``: tokens per prefill piece run between decode steps (one of
    :data:`PREFILL_CHUNKS`; a prompt of at most this many tokens is one piece);
    ``prefill_share``: the most of the engine's time a long prompt's prefill takes while others
    decode (:class:`serve.schedule.PrefillPacer`)."""
    if prefill_chunk not in PREFILL_CHUNKS:
      raise ValueError(f"prefill_chunk must be one of {PREFILL_CHUNKS}, got {prefill_chunk!r}")
    self.prefill_chunk = int(prefill_chunk)
    self.pacer = PrefillPacer(prefill_share)
    self.prefilling: Request | None = None   # the long prompt whose prefill is in progress
    # Between two decode steps' completions: prefill seconds spent on the host and the long
    # prompt's pieces run (the pacer charges what the interval cost beyond a decode step).
    self.pre_s = 0.0
    self.pre_pieces = 0
    self.piece_ema = 0.0   # seconds one long-prompt piece adds to an interval (moving average)
    self.since_piece = STARVE_STEPS   # decode steps since a long prompt's pieces last ran
    if preemption not in PREEMPTION:
      raise ValueError(f"preemption must be one of {PREEMPTION}, got {preemption!r}")
    self.preemption = preemption
    self.model, self.cfg, self.tok, self.policy = model, model.cfg, tokenizer, policy
    self.slots, self.context, self.page = slots, context, page
    self.window, self.G = int(policy.window), int(policy.n_groups)
    self.n_pages = math.ceil(context / page)
    self.watermark = float(watermark)
    if prefiller is None:
      prefiller = Runner(model, batch=1, capacity=context, cache_dtype=jnp.bfloat16)
    self.dense = prefiller
    if gpu_memory_utilization is not None:
      if kv_bytes is not None:
        raise ValueError("give either a KV memory budget or a memory utilization, not both")
      kv_bytes = kv_bytes_for_utilization(gpu_memory_utilization, self.cfg, context)
    self._build(backend, hi_pages, lo_pages, kv_bytes, mix)
    self._first = jax.jit(self._pick)
    self.overlap_wanted = bool(overlap)
    self._pick_rows = jax.jit(self._pick_packed)
    # Host mirrors of the step inputs.
    B, V, G = slots, self.cfg.vocab_size, self.G
    self.tokens = np.zeros((B,), np.int32)
    self.tag_ids = np.broadcast_to(FREE_TAG, (B, T.N_CAND)).copy()
    self.state_ids = np.full((B,), -1, np.int32)
    self.active = np.zeros((B,), bool)
    self.seeds = np.zeros((B,), np.uint32)
    self.temp = np.zeros((B,), np.float32)
    self.top_p = np.ones((B,), np.float32)
    self.want_lp = np.zeros((B,), bool)
    self.bits = new_bitmask(B, V)
    self.bits1 = new_bitmask(1, V)
    # Host mirror of the cache's bookkeeping: tokens written per slot, the action of every
    # cached position, entries per (pool, group, slot), and every slot's pages.
    self.count = np.zeros((B,), np.int64)
    self.acts = np.zeros((B, context, G), np.int8)
    self.lens = np.zeros((2, G, B), np.int64)
    self.npg = np.zeros((2, G, B), np.int64)
    self.tbl = np.zeros((2, G, B, self.n_pages), np.int32)
    self.free = [np.tile(np.arange(n, dtype=np.int32)[::-1], (G, 1)) for n in self.totals]
    self.top = np.array([[n] * G for n in self.totals], np.int64)   # free pages [pool, group]
    self.running: list[Request | None] = [None] * B
    self.waiting: collections.deque[Request] = collections.deque()
    self.inbox: list[Request] = []
    self.stops = set(tokenizer.stop_ids)
    self.cv = threading.Condition()
    self.stopping = False
    self.thread: threading.Thread | None = None
    self.crashed: BaseException | None = None
    self.step_ema = 0.0   # seconds per decode step (moving average): the prefill budget
    self._seq = itertools.count()
    # After a preemption nothing is admitted until a request ends (and frees pages): otherwise
    # the request just preempted would be readmitted at once and preempted again every step.
    self.pressure = False
    # Metrics, written by the engine thread and read by the app's: every key exists from the
    # start (a dict that grows while another thread iterates it raises).
    self.m = collections.Counter(dict.fromkeys(METRIC_KEYS, 0))
    # Overlap state: the last forward launched (logits, the (slot, request) rows it fed), the
    # pick launched after it (tokens, log-probs, rows), the forwards whose decided actions the
    # host has not read yet, and per slot the token still to be decided (tags, state id).
    self.fly_fwd = None
    self.fly_pick = None
    self.fly_acts: collections.deque = collections.deque()
    self.on_device = np.zeros((B,), bool)      # the next token to feed is the pick's output
    self.pend = np.zeros((B,), bool)
    self.pend_tags = self.tag_ids.copy()
    self.pend_sids = self.state_ids.copy()
    self.t_land = None

  @property
  def overlap(self) -> bool:
    """Whether iterations overlap the host with the device (module docstring, "Overlap"); read
    at every iteration, so ``preemption`` may be changed while the engine is idle."""
    return self.overlap_wanted and self.preemption == "replay" and (
        not self.paged or self.window >= 3)

  # --- construction hooks (DenseEngine overrides them) ---------------------------------------

  def _build(self, backend, hi_pages, lo_pages, kv_bytes, mix) -> None:
    c, pol = self.cfg, self.policy
    self.sizing = size_pools(c, pol, slots=self.slots, context=self.context, page=self.page,
                             kv_bytes=kv_bytes, mix=mix, hi_pages=hi_pages, lo_pages=lo_pages)
    self.reach = reachable(pol)
    self.hi_total, self.lo_total = self.sizing.hi_pages, self.sizing.lo_pages
    self.totals = (self.hi_total, self.lo_total)
    self.runner = PaskRunner(self.model, pol, batch=self.slots, capacity=self.context,
                             page=self.page, backend=backend)
    self.traces = self.runner.traces
    cache = pcache.init_paged(c.n_layers, self.slots, c.n_kv_heads, c.head_dim,
                              capacity=self.context, window=self.window,
                              hi_pool_pages=self.hi_total, lo_pool_pages=self.lo_total,
                              sink=pol.sink, n_groups=self.G, page=self.page)
    self.state = (cache, jnp.zeros((self.slots,), jnp.float32), ledger.init(self.slots, self.G))
    self._plan = jax.jit(self._plan_fn)
    self._insert = jax.jit(self._insert_fn, donate_argnums=(1,))
    self._restore = jax.jit(self._restore_fn, donate_argnums=(0,))
    self._release = jax.jit(self._release_fn, donate_argnums=(0,))
    self._step = jax.jit(self._step_fn, donate_argnums=(2,))
    self._fwd = jax.jit(self._fwd_fn, donate_argnums=(2,))

  # --- jitted pieces ------------------------------------------------------------------------

  def _plan_fn(self, policy, cands, length):
    self.traces["plan"] += 1
    return controller.plan_prefill(policy, cands, length)[0]

  def _insert_fn(self, policy, state, k, v, plan, length, slot, hi_rows, lo_rows):
    """Prefill K/V of one request [L, 1, T, Hkv, D] and its plan [1, T, G] -> materialized
    into ``slot``; the slot's ledger row and balance are reset."""
    self.traces["insert"] += 1
    cache, budget, led = state
    cache = pcache.insert_slot(cache, slot, k, v, plan, length, hi_rows, lo_rows)
    one = ledger.record_prefill(ledger.init(1, policy.n_groups), plan, length, sink=policy.sink)
    put = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, slot, 0)
    led = jax.tree.map(put, led, one)
    led = ledger.record_live(led, cache, policy.cost, policy.c_full)
    budget = budget.at[slot].set(controller.initial_balance(policy))
    return cache, budget, led

  def _restore_fn(self, state, slot, balance, led_row):
    """A resumed request's controller balance and ledger row back into ``slot``."""
    self.traces["restore"] += 1
    cache, budget, led = state
    led = jax.tree.map(lambda full, row: full.at[slot].set(row), led, led_row)
    return cache, budget.at[slot].set(balance), led

  def _release_fn(self, state, slot):
    cache, budget, led = state
    return pcache.release_slot(cache, slot), budget, led

  def _pick(self, logits, bits, seeds, steps, temperature, top_p, want_lp):
    """Per-row sampling: row b uses key fold_in(key(seeds[b]), steps[b]).  -> (tokens [B],
    (chosen log-prob [B], top ids [B, K], top log-probs [B, K])); the log-probs are of the
    masked logits and are zeros unless some row wants them."""
    masked = apply_bitmask(logits, bits)
    greedy = jnp.argmax(masked, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, steps)
    row = lambda l, k, t, p, g: _nucleus(l[None], k, t[None], p[None], g[None])[0]
    tok = jax.lax.cond(jnp.any(temperature > 0),
                       lambda: jax.vmap(row)(masked, keys, temperature, top_p, greedy),
                       lambda: greedy)
    B, K = logits.shape[0], TOP_LOGPROBS

    def lp():
      ls = jax.nn.log_softmax(masked.astype(jnp.float32), axis=-1)
      top, ids = jax.lax.top_k(ls, K)
      return jnp.take_along_axis(ls, tok[:, None], axis=-1)[:, 0], ids.astype(jnp.int32), top

    none = lambda: (jnp.zeros((B,), jnp.float32), jnp.zeros((B, K), jnp.int32),
                    jnp.zeros((B, K), jnp.float32))
    return tok, jax.lax.cond(jnp.any(want_lp), lp, none)

  def _step_fn(self, params, policy, state, tokens, tag_ids, state_ids, active, bits, seeds,
               steps, temperature, top_p, want_lp, new_hi, new_lo):
    """-> ((int32 [B, 1 + G]: next token and the actions decided for the token fed, log-prob
    outputs of the sampler), state)."""
    cache, budget, led = state
    cache = pcache.assign_pages(cache, new_hi, new_lo)
    logits, cache, budget, led, actions = self.runner._decode_step(
        params, policy, cache, budget, led, tokens, tag_ids, state_ids, active)
    nxt, lps = self._pick(logits, bits, seeds, steps, temperature, top_p, want_lp)
    out = jnp.concatenate([nxt[:, None], actions.astype(jnp.int32)], axis=1)
    return (out, lps), (cache, budget, led)

  def _fwd_fn(self, params, policy, state, dev_tok, host, pages):
    """The overlapping engine's forward.  ``dev_tok [B]``: the last pick's tokens (device);
    ``host`` int32 [B, 9] (one transfer): token, use it instead of dev_tok, the previous token's
    4 tags, its state id, decide it, active; ``pages`` int32 [2, G, B]: new page ids per pool.
    -> ((logits [B, V], actions [B, G] of the previous tokens), state)."""
    cache, budget, led = state
    tokens = jnp.where(host[:, 1] > 0, host[:, 0], dev_tok)
    cache = pcache.assign_pages(cache, pages[0], pages[1])
    logits, cache, budget, led, actions = self.runner._deferred_step(
        params, policy, cache, budget, led, tokens, host[:, 2:6], host[:, 6], host[:, 7] > 0,
        host[:, 8] > 0)
    return (logits, actions.astype(jnp.int32)), (cache, budget, led)

  def _pick_packed(self, logits, packed):
    """:meth:`_pick` with its per-row inputs in one int32 array [B, words + 5] (one transfer):
    the bitmask words, then seed (uint32 bits), step, wants log-probs, temperature and top_p
    (float32 bits)."""
    nw = packed.shape[1] - 5
    f32 = lambda c: jax.lax.bitcast_convert_type(packed[:, c], jnp.float32)
    return self._pick(logits, packed[:, :nw],
                      jax.lax.bitcast_convert_type(packed[:, nw], jnp.uint32), packed[:, nw + 1],
                      f32(nw + 3), f32(nw + 4), packed[:, nw + 2] > 0)

  # --- public, thread-safe ------------------------------------------------------------------

  def worst_case(self, n_prompt: int, max_tokens: int) -> tuple[int, int]:
    """Pages (BF16 pool, INT4 pool) per layer group that one request can need at most: every
    token beyond the window stored in that pool (0 for a pool the policy never uses)."""
    return worst_pages(self.policy, n_prompt + max_tokens, self.page)

  def fits_ever(self, n_prompt: int, max_tokens: int) -> str | None:
    """Why a request can never run here, or None."""
    if n_prompt < 1:
      return "empty prompt"
    if n_prompt + max_tokens > self.context:
      return (f"prompt of {n_prompt} tokens + max_tokens {max_tokens} exceeds the server's "
              f"context of {self.context} tokens")
    h, l = self.worst_case(n_prompt, max_tokens)
    if h > self.hi_total or l > self.lo_total:
      return ("the request could need more KV pages than the server's pools hold "
              f"({h} BF16 / {l} INT4 pages per layer group at most; the pools have "
              f"{self.hi_total} / {self.lo_total})")
    return None

  def submit(self, req: Request) -> Request:
    why = self.fits_ever(len(req.ids), req.max_tokens)
    if why:
      raise ValueError(why)
    req.t_submit = time.perf_counter()
    with self.cv:
      req.seq = next(self._seq)
      self.inbox.append(req)
      self.cv.notify()
    return req

  def start(self) -> "Engine":
    self.thread = threading.Thread(target=self._main, name="pask-engine", daemon=True)
    self.thread.start()
    return self

  def stop(self, timeout: float = 10.0) -> None:
    with self.cv:
      self.stopping = True
      self.cv.notify()
    if self.thread is not None:
      self.thread.join(timeout)

  @property
  def alive(self) -> bool:
    return self.thread is not None and self.thread.is_alive() and self.crashed is None

  def pages_free(self) -> tuple[int, int]:
    """Free pages of each pool in its scarcest layer group."""
    return int(self.top[HI].min()), int(self.top[LO].min())

  def snapshot(self) -> dict:
    """Gauges for /metrics (racy reads of host counters are fine for monitoring).  Pool gauges
    are per layer group's free list; ``*_free`` is the scarcest group's."""
    hf, lf = self.pages_free()
    return {"queue_depth": len(self.waiting) + len(self.inbox),
            "running": sum(r is not None for r in self.running), "slots": self.slots,
            "hi_free": hf, "hi_total": self.hi_total, "lo_free": lf, "lo_total": self.lo_total,
            **self.m}

  def reset_metrics(self) -> None:
    for k in self.m:   # back to zero, keys kept
      self.m[k] = 0

  def idle(self) -> bool:
    return not (self.inbox or self.waiting or any(x is not None for x in self.running))

  def run_until_idle(self, max_iterations: int | None = None) -> None:
    """Drive the engine on the calling thread (no engine thread: tests, benchmarks)."""
    n = 0
    while not self.idle():
      self._iterate()
      n += 1
      if max_iterations is not None and n >= max_iterations:
        raise RuntimeError(f"engine not idle after {n} iterations")

  def warmup(self) -> None:
    """Compile the decode step and every prefill bucket up to ``PREFILL_CHUNK`` tokens (and the
    context) before serving (call before :meth:`start`): one dummy request per bucket, of two
    new tokens.  Otherwise the first prompt of each bucket would compile its prefill pieces,
    plan and insert on the engine thread while every running stream waits (seconds on a CPU,
    tens of seconds for a 4B model).  Longer buckets (chunk multiples) compile on first use."""
    tok = self.tok.stop_ids[0] if self.tok.stop_ids else 0
    n, sizes = 1, []
    while n + 2 <= self.context and n <= PREFILL_CHUNK:
      sizes.append(n)
      n = bucket(n, self.prefill_chunk) + 1   # the first length of the next bucket
    for n in sizes:
      self.submit(Request(ids=[tok] * n, max_tokens=2))
      self.run_until_idle()
    self.reset_metrics()

  # --- the engine thread --------------------------------------------------------------------

  def _main(self) -> None:
    try:
      while True:
        with self.cv:
          while not (self.stopping or self.inbox or self.waiting
                     or any(r is not None for r in self.running)):
            self.cv.wait()
          if self.stopping:
            break
        self._iterate()
    except BaseException as e:   # noqa: BLE001 — keep the reason for /health, fail requests
      self.crashed = e
      for r in list(self.waiting) + self.inbox + [x for x in self.running if x is not None]:
        r.emit("error", f"engine failure: {e!r}")
      raise

  def _iterate(self) -> None:
    with self.cv:
      self.waiting.extend(self.inbox)
      self.inbox.clear()
    for b, r in enumerate(self.running):
      if r is not None and r.cancelled:
        self._finish(r, "cancelled")
    if self.overlap:
      return self._iterate_overlap()
    self._admit()
    if self.active.any():
      self._decode()
    else:
      self.t_land = None

  def _pace(self, t: float) -> None:
    """A decode step finished at ``t``.  An interval between two such moments without prefill
    work is a decode step (its moving average ``step_ema`` is the short prompts' budget per
    iteration).  What an interval with prefill work took beyond one is charged to the pacer —
    short prompts' prefills too, so all prefill stays near the share while a long prompt is in
    progress (not charging them lengthened the soak probe's tail; :data:`STARVE_STEPS` bounds
    the wait) — and, per long-prompt piece less the short prompts' host-timed prefills, gives
    ``piece_ema``.  Measured between completions, not around the host's calls: the calls only
    launch the work, and a piece's device time shows in the interval it ran in."""
    if self.t_land is not None:
      dt = t - self.t_land
      if not self.pre_pieces and not self.pre_s:
        self.step_ema = dt if not self.step_ema else 0.8 * self.step_ema + 0.2 * dt
      else:
        extra = max(dt - self.step_ema, 0.0)
        self.pacer.spent(extra)
        if self.pre_pieces:
          per = max(extra - self.pre_s, 0.0) / self.pre_pieces
          self.piece_ema = per if not self.piece_ema else 0.8 * self.piece_ema + 0.2 * per
      self.pacer.step(self.step_ema or dt)
    self.t_land = t
    self.pre_s, self.pre_pieces = 0.0, 0
    self.since_piece += 1

  # --- overlapped decode (module docstring, "Overlap") -----------------------------------------

  def _iterate_overlap(self) -> None:
    if self.fly_pick is not None:
      self._land()
    for b, r in enumerate(self.running):
      if r is not None and r.cancelled:
        self._finish(r, "cancelled")
    self._admit()
    self._launch()

  def _land(self) -> None:
    """Wait for the last pick's tokens (the device meanwhile runs the forward fed with them)
    and give them to their requests."""
    tok, lp, rows = self.fly_pick
    self.fly_pick = None
    t0 = time.perf_counter()
    tok = np.asarray(tok)
    lps = tuple(np.asarray(x) for x in lp) if any(r.logprobs is not None for _, r in rows) \
        else None
    t1 = time.perf_counter()
    self.m["wait_s"] += t1 - t0
    if self.t_land is not None:   # a step = the time between two landings
      self.m["decode_step_s"] += t1 - self.t_land
    self._pace(t1)
    while len(self.fly_acts) > 1:   # every forward before the one in flight has finished
      self._read_actions(*self.fly_acts.popleft())
    for b, r in rows:
      if self.running[b] is r:
        self._accept(r, int(tok[b]), _row(lps, b))
        if self.running[b] is r:   # continues: its token was fed already, decide it next
          self.pend[b] = True
          self.pend_tags[b], self.pend_sids[b] = self.tag_ids[b], self.state_ids[b]
    self.m["accept_s"] += time.perf_counter() - t1

  def _read_actions(self, acts, rows) -> None:
    """A forward's decided actions -> the host mirror (for page growth)."""
    if not self.paged or not rows:
      return
    a = np.asarray(acts).astype(np.int8)
    for b, r, p in rows:
      if self.running[b] is r:
        self.acts[b, p] = T.H if p < self.policy.sink else a[b]

  def _launch(self) -> None:
    """The pick of the forward in flight, then the next forward (fed with the pick's output)."""
    t0 = time.perf_counter()
    tok_dev = None
    self.on_device[:] = False
    if self.fly_fwd is not None:
      logits, fed = self.fly_fwd
      self.fly_fwd = None
      live = [(b, r) for b, r in fed if self.running[b] is r]
      if live:
        self.bits[:] = -1
        picked = []
        for b, r in live:
          if r.replay is None:   # a real sample; a replayed token's sample is ignored
            r.tracker.fill(self.bits, b)
            picked.append((b, r))
        nw = self.bits.shape[1]
        packed = np.zeros((self.slots, nw + 5), np.int32)
        packed[:, :nw] = self.bits
        packed[:, nw] = self.seeds.view(np.int32)
        packed[:, nw + 1] = [len(r.out) if r is not None else 0 for r in self.running]
        packed[:, nw + 2] = self.want_lp & self.active
        packed[:, nw + 3] = self.temp.view(np.int32)
        packed[:, nw + 4] = self.top_p.view(np.int32)
        t1 = time.perf_counter()
        self.m["fill_s"] += t1 - t0
        tok_dev, lp = self._pick_rows(logits, jnp.asarray(packed))
        self.m["dispatch_s"] += time.perf_counter() - t1
        for b, r in picked:
          self.on_device[b] = True
        self.fly_pick = (tok_dev, lp, picked)
        for b, r in live:
          if r.replay is not None:   # the next replayed token, from the host
            self.m["replay_steps"] += 1
            self._feed(r, r.replay + 1)
    rows_run = [b for b, r in enumerate(self.running) if r is not None and r.pre is None]
    if not rows_run:
      self.fly_acts.clear()
      self.t_land = None
      return
    t2 = time.perf_counter()
    # A request whose pick gives its last token (max_tokens) is not fed again; its previous
    # token is still decided.  (A stop token cannot be known ahead: it is fed, never decided.)
    self.active[:] = False
    for b in rows_run:
      r = self.running[b]
      self.active[b] = not (self.on_device[b] and len(r.out) + 1 >= r.max_tokens)
    grow = self._grow() if self.paged else None   # may preempt (replay): rows leave
    self.m["alloc_s"] += time.perf_counter() - t2
    rows = np.flatnonzero(self.active)
    decide = self.pend & np.array([r is not None for r in self.running])
    if not len(rows) and not decide.any():
      return
    B = self.slots
    host = np.zeros((B, 9), np.int32)
    host[:, 0] = self.tokens
    host[:, 1] = ~self.on_device
    host[:, 2:6] = self.pend_tags
    host[:, 6] = self.pend_sids
    host[:, 7] = decide
    host[:, 8] = self.active
    dec = [(b, self.running[b], int(self.count[b]) - 1) for b in np.flatnonzero(decide)]
    if tok_dev is None:
      tok_dev = jnp.zeros((B,), jnp.int32)
    t3 = time.perf_counter()
    (logits, acts), self.state = self._fwd_call(tok_dev, host, grow)
    self.m["dispatch_s"] += time.perf_counter() - t3
    self.fly_acts.append((acts, dec))
    self.fly_fwd = (logits, [(b, self.running[b]) for b in rows])
    self.m["decode_steps"] += 1
    self.m["decode_rows"] += len(rows)
    self.count[rows] += 1
    self.pend[decide] = False
    # The tokens fed from the host (first tokens, replays) have known tags: decided next step.
    # A token fed from the pick gets its tags when it lands.
    for b in rows:
      self.pend[b] = not self.on_device[b]
      if self.pend[b]:
        self.pend_tags[b], self.pend_sids[b] = self.tag_ids[b], self.state_ids[b]

  def _fwd_call(self, tok_dev, host, grow):
    return self._fwd(self.runner.params, self.policy, self.state, tok_dev, jnp.asarray(host),
                     jnp.asarray(np.stack(grow)))

  # --- admission ----------------------------------------------------------------------------

  def _prompt_plan(self, r: Request) -> np.ndarray:
    """int8 [n, G]: the prefill plan of a new request (one small jitted call per bucket)."""
    n, Tn = len(r.ids), bucket(len(r.ids), self.prefill_chunk)
    cands = prompt_candidates([r.tags], np.array([n]), Tn)
    plan = np.asarray(self._plan(self.policy, jnp.asarray(cands), jnp.asarray([n], jnp.int32)))
    plan = plan[0, :n].copy()
    plan[:self.policy.sink] = T.H   # the cache forces sinks H
    return plan

  def _need(self, plan: np.ndarray) -> np.ndarray:
    """Pages [pool, group] for the entries of ``plan`` that have left the window."""
    done = plan[:max(0, len(plan) - self.window)]
    counts = np.stack([(done == c).sum(0) for c in _CODE])           # [2, G]
    return -(-counts // self.page)

  def _fits(self, need: np.ndarray, busy: bool) -> bool:
    if not busy:
      return bool((need <= self.top).all())
    wm = np.ceil(self.watermark * np.array(self.totals, np.float64))[:, None]
    used = np.array(self.totals)[:, None] > 1       # an unused 1-page pool has no headroom
    return bool((need + np.where(used, wm, 0) <= self.top).all())

  def _admit(self) -> None:
    if any(r.cancelled for r in self.waiting):   # gone before admission: drop, nothing held
      for r in [r for r in self.waiting if r.cancelled]:
        self.m["requests_cancelled"] += 1
        r.emit("done", None)
      self.waiting = collections.deque(r for r in self.waiting if not r.cancelled)
    busy = bool(self.active.any())
    running = any(x is not None for x in self.running)
    if self.pressure and running:
      if self.waiting and None in self.running:
        self.m["admission_blocked_pages"] += 1
      return
    self.pressure = False
    # New requests first, in arrival order.  A prompt of one piece is prefilled now, even while a
    # long prompt is in progress (it passes it); one long prompt is prefilled at a time, and a
    # long one waiting for that lets the shorter ones behind it go first.  Pages stay FIFO: a
    # request whose pages are not free stops admission until some are.
    spent, i = 0.0, 0
    while i < len(self.waiting) and None in self.running and not (busy and spent and
                                                                   spent >= self.step_ema):
      r = self.waiting[i]
      long = len(self._prefill_ids(r)) > self.prefill_chunk
      if long and self.prefilling is not None:
        i += 1
        continue
      t0 = time.perf_counter()
      if self.paged:
        if r.plan is None:
          t1 = time.perf_counter()
          try:
            r.plan = r.prompt_plan = self._prompt_plan(r)
          except Exception as e:  # noqa: BLE001 — a bad request must not take the engine down
            del self.waiting[i]
            self.m["requests_error"] += 1
            r.emit("error", f"prefill plan failed: {e}")
            continue
          self.m["plan_s"] += time.perf_counter() - t1
          t0 += time.perf_counter() - t1   # admission overhead is host bookkeeping only
        need = self._need(r.plan)
        running = any(x is not None for x in self.running)
        if not self._fits(need, running):
          self.m["admit_s"] += time.perf_counter() - t0
          if not running:   # cannot happen after fits_ever; never wait forever on it
            del self.waiting[i]
            self.m["requests_error"] += 1
            r.emit("error", "the KV pools are too small for this request")
            continue
          self.m["admission_blocked_pages"] += 1   # a slot is free, the pages are not
          break   # FIFO for pages: nothing behind it goes first
      del self.waiting[i]
      r.slot = b = self.running.index(None)
      self.running[b] = r
      rows = self._take(b, need) if self.paged else None
      self.m["admit_s"] += time.perf_counter() - t0
      if r.resume is None:
        r.t_admit = time.perf_counter()
        self.m["queue_wait_s"] += r.t_admit - r.t_submit
      try:
        self._prefill(r, rows)
      except Exception as e:  # noqa: BLE001 — a bad request must not take the engine down
        self._finish(r, "error", f"prefill failed: {e}")
        continue
      if r is not self.prefilling:   # one piece: prefilled now, and it decodes from next step
        spent += self._prefill_some(r, busy=False)
    # The long prompt's pieces.  While streams decode (the short prompts just admitted too),
    # the pacer says when and how many — never right after a short prompt's prefill, whose first
    # decode step would wait for them (a flood of short prompts cannot starve it: STARVE_STEPS);
    # with nothing decoding it runs to its end, unless a new request arrives (it may be short:
    # it goes first, at the next iteration).
    r = self.prefilling
    if r is not None:
      busy = bool(self.active.any())
      starved = self.since_piece >= STARVE_STEPS
      if (not spent or starved) and (not busy or self.pacer.ready() or starved):
        self.since_piece = 0
        self._prefill_some(r, busy)

  def _prefill_ids(self, r: Request) -> list[int]:
    """The tokens the next prefill of ``r`` runs (a request resumed by recompute: all but the
    last generated token too; the next step feeds that one)."""
    return r.ids + r.out[:-1] if r.resume and "ledger" in r.resume else r.ids

  # --- page bookkeeping (host) ----------------------------------------------------------------

  def _pop(self, X: int, g: int, k: int) -> np.ndarray:
    t = self.top[X, g]
    assert k <= t, "page free list underflow"
    self.top[X, g] = t - k
    return self.free[X][g, t - k:t]

  def _take(self, b: int, need: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Give slot ``b`` its prompt pages ``need [2, G]`` -> device page rows [G, n_pages]."""
    rows = []
    for X in (HI, LO):
      tbl = np.full((self.G, self.n_pages), self.totals[X], np.int32)
      for g in range(self.G):
        k = int(need[X, g])
        if k:
          ids = self._pop(X, g, k)
          tbl[g, :k] = ids
          self.tbl[X, g, b, :k] = ids
        self.npg[X, g, b] = k
      rows.append(jnp.asarray(tbl))
    self._peak()
    return rows[0], rows[1]

  def _peak(self) -> None:
    used = np.array(self.totals)[:, None] - self.top
    self.m["hi_used_peak"] = max(self.m["hi_used_peak"], int(used[HI].max()))
    self.m["lo_used_peak"] = max(self.m["lo_used_peak"], int(used[LO].max()))

  def _give_back(self, b: int) -> None:
    """Every page of slot ``b`` back to the free lists; its host mirror emptied."""
    if self.paged:
      for X in (HI, LO):
        for g in range(self.G):
          k = int(self.npg[X, g, b])
          if k:
            t = self.top[X, g]
            self.free[X][g, t:t + k] = self.tbl[X, g, b, :k]
            self.top[X, g] = t + k
      self.npg[:, :, b] = 0
      self.lens[:, :, b] = 0
    self.count[b] = 0

  def _grow(self) -> tuple[np.ndarray, np.ndarray]:
    """Pages the tokens leaving the window at this step need -> new page ids [G, B] per pool
    (-1: none); preempts the youngest requests while a free list is short."""
    W, G = self.window, self.G
    while True:
      rows = np.flatnonzero(self.active)
      p = self.count[rows]
      er = rows[p >= W]
      a = self.acts[er, p[p >= W] - W].T                             # [G, k] evicted actions
      sel = np.stack([a == c for c in _CODE])                        # [2, G, k]
      need = sel & (self.lens[:, :, er] % self.page == 0)
      short = need.sum(-1) > self.top
      if not short.any():
        break
      live = [r for r in self.running if r is not None]
      young = max(live, key=lambda r: r.seq)
      if len(live) == 1:   # alone and still short: the pool cannot hold it (see worst_case)
        self._finish(young, "error", "the KV pools are too small for this request alone "
                     f"(free pages per pool and layer group: {self.top.tolist()})")
      else:
        self._preempt(young)
    new = np.full((2, G, self.slots), -1, np.int32)
    for X, g in zip(*np.nonzero(need.any(-1))):
      rs = er[need[X, g]]
      ids = self._pop(X, g, len(rs))
      new[X, g, rs] = ids
      self.tbl[X, g, rs, self.lens[X, g, rs] // self.page] = ids
      self.npg[X, g, rs] += 1
    if len(er):
      self.lens[:, :, er] += sel
      if need.any():
        self._peak()
    return new[HI], new[LO]

  def _preempt(self, r: Request) -> None:
    """Free ``r``'s slot and pages, keep what it needs to continue (per ``self.preemption``),
    and put it back at the head of the queue."""
    b = r.slot
    if r is self.prefilling:   # nothing generated here yet: back to the queue as it came
      pass
    elif self.preemption == "recompute" and r.replay is None:
      cache, budget, led = self.state
      r.resume = {"balance": np.asarray(budget[b]),
                  "ledger": jax.tree.map(lambda x: np.asarray(x[b]), led),
                  "token": int(self.tokens[b]), "tag": self.tag_ids[b].copy(),
                  "state": int(self.state_ids[b])}
      r.plan = self.acts[b, :self.count[b]].copy()
    else:   # replay: only the prompt is prefilled again
      r.resume, r.plan = {"replay": True}, r.prompt_plan
    r.replay = None
    r.preemptions += 1
    self.m["preemptions"] += 1
    self.pressure = True
    self._vacate(b)
    r.slot = None
    self.waiting.appendleft(r)

  def _vacate(self, b: int) -> None:
    if self.prefilling is not None and self.prefilling is self.running[b]:
      self.prefilling.pre, self.prefilling = None, None   # dropped mid-prefill
    self.active[b] = False
    self.pend[b] = self.on_device[b] = False
    self.running[b] = None
    self.state = self._release(self.state, jnp.int32(b))
    self._give_back(b)

  # --- prefill and decode ---------------------------------------------------------------------

  def _prefill(self, r: Request, rows) -> None:
    """Start ``r``'s prefill (a long prompt becomes :attr:`prefilling`); :meth:`_prefill_some`
    runs it."""
    ids = self._prefill_ids(r)
    n, Tn = len(ids), bucket(len(ids), self.prefill_chunk)
    toks = np.zeros((1, Tn), np.int32)
    toks[0, :n] = ids
    c = self.cfg
    dense = kv_dense.init(c.n_layers, 1, Tn, c.n_kv_heads, c.head_dim, jnp.bfloat16)
    r.pre = (self.dense.prefill_chunks(dense, toks, np.array([n], np.int32), self.prefill_chunk,
                                       ahead=1), n, Tn, rows)
    if n > self.prefill_chunk:
      self.prefilling = r

  def _prefill_some(self, r: Request, busy: bool) -> float:
    """Run ``r``'s prefill piece by piece and finish it when its last piece is done -> host
    seconds.  One piece: whole.  The long prompt: while others decode, as many pieces as the
    pacer's credit covers (at least one); else to its end or until a new request arrives."""
    long = r is self.prefilling
    k = max(1, int(self.pacer.credit // self.piece_ema)) if busy and self.piece_ema else 1
    t0 = time.perf_counter()
    try:
      while True:
        logits, dense = next(r.pre[0])
        self.pre_pieces += long
        k -= 1
        if logits is not None or (busy and k <= 0):
          break
        if not busy and long:   # to its end, but a request that arrives waits for this piece only
          jax.block_until_ready(dense)   # (with the next one queued it waited for two)
          if self.inbox:
            break
      if logits is not None:
        if long:
          self.prefilling = None
        (_, n, Tn, rows), r.pre = r.pre, None
        self._prefill_done(r, logits, dense, n, Tn, rows)
    except Exception as e:  # noqa: BLE001 — a bad request must not take the engine down
      if long:
        self.prefilling = None
      r.pre = None
      self._finish(r, "error", f"prefill failed: {e}")
    dt = time.perf_counter() - t0
    self.m["prefill_s"] += dt
    if not long:
      self.pre_s += dt
    return dt

  def _prefill_done(self, r: Request, logits, dense, n: int, Tn: int, rows) -> None:
    """The prompt's K/V into the slot; a resumed request continues, a new one gets its first
    token from the prefill's logits."""
    resume = r.resume
    b = r.slot
    self._insert_slot(r, dense, n, Tn, rows)
    self.count[b] = n
    if self.paged:
      self.acts[b, :n] = r.plan
      done = r.plan[:max(0, n - self.window)]
      for X, code in enumerate(_CODE):
        self.lens[X, :, b] = (done == code).sum(0)
    self.seeds[b], self.temp[b], self.top_p[b] = r.seed, r.temperature, r.top_p
    if resume and "ledger" in resume:   # recompute: the next step feeds its last token
      self.tokens[b], self.tag_ids[b], self.state_ids[b] = resume["token"], resume["tag"], \
          resume["state"]
    if resume:
      if "replay" in resume:   # re-feed the generated tokens through the decode step
        r.replay = 0
        self._feed(r, 0)
      self.active[b] = True
      r.resume = None
      self.m["resumed"] += 1
      return
    self.bits1[:] = -1
    r.tracker.fill(self.bits1, 0)
    tok, lp = self._first(logits, jnp.asarray(self.bits1), jnp.asarray([r.seed], jnp.uint32),
                          jnp.asarray([0], jnp.int32),
                          jnp.asarray([r.temperature], jnp.float32),
                          jnp.asarray([r.top_p], jnp.float32),
                          jnp.asarray([r.logprobs is not None]))
    self.m["prefills"] += 1
    lp = tuple(np.asarray(x) for x in lp) if r.logprobs is not None else None
    self._accept(r, int(tok[0]), _row(lp, 0))

  def _insert_slot(self, r: Request, dense, n: int, Tn: int, rows) -> None:
    plan = np.zeros((1, Tn, self.G), np.int8)
    plan[0, :n] = r.plan
    self.state = self._insert(self.policy, self.state, dense.k, dense.v, jnp.asarray(plan),
                              jnp.asarray([n], jnp.int32), jnp.int32(r.slot), *rows)
    if r.resume and "ledger" in r.resume:
      self.state = self._restore(self.state, jnp.int32(r.slot),
                                 jnp.asarray(r.resume["balance"]),
                                 jax.tree.map(jnp.asarray, r.resume["ledger"]))

  def _run_step(self, steps, grow, want):
    return self._step(self.runner.params, self.policy, self.state, jnp.asarray(self.tokens),
                      jnp.asarray(self.tag_ids), jnp.asarray(self.state_ids),
                      jnp.asarray(self.active), jnp.asarray(self.bits), jnp.asarray(self.seeds),
                      jnp.asarray(steps), jnp.asarray(self.temp), jnp.asarray(self.top_p),
                      jnp.asarray(want), jnp.asarray(grow[0]), jnp.asarray(grow[1]))

  def _decode(self) -> None:
    t0 = time.perf_counter()
    grow = self._grow() if self.paged else None
    t1 = time.perf_counter()
    self.m["alloc_s"] += t1 - t0
    rows = np.flatnonzero(self.active)
    if not len(rows):
      return
    self.bits[:] = -1
    for b in rows:
      if self.running[b].replay is None:   # a replayed token's sample is not used
        self.running[b].tracker.fill(self.bits, b)
    steps = np.array([len(r.out) if r is not None else 0 for r in self.running], np.int32)
    want = self.want_lp & self.active
    t_fill = time.perf_counter()
    (out, lp), self.state = self._run_step(steps, grow, want)
    t_disp = time.perf_counter()
    lps = tuple(np.asarray(x) for x in lp) if want.any() else None
    out = np.asarray(out)
    t_wait = time.perf_counter()
    self.m["fill_s"] += t_fill - t1
    self.m["dispatch_s"] += t_disp - t_fill
    self.m["wait_s"] += t_wait - t_disp
    dt = t_wait - t1
    self.m["decode_steps"] += 1
    self.m["decode_step_s"] += dt
    self._pace(t_wait)
    self.m["decode_rows"] += len(rows)
    t2 = time.perf_counter()
    p = self.count[rows]
    if self.paged:   # the actions of the tokens just written (sinks are H), for later evictions
      a = out[rows, 1:].astype(np.int8)
      self.acts[rows, p] = np.where((p < self.policy.sink)[:, None], np.int8(T.H), a)
    self.count[rows] = p + 1
    t3 = time.perf_counter()
    self.m["alloc_s"] += t3 - t2
    for b in rows:
      r = self.running[b]
      if r.replay is None:
        self._accept(r, int(out[b, 0]), _row(lps, b))
      else:
        self.m["replay_steps"] += 1
        self._feed(r, r.replay + 1)
    self.m["accept_s"] += time.perf_counter() - t3

  def _feed(self, r: Request, i: int) -> None:
    """Replay: the next step feeds generated token ``i`` with the tags it was fed with; the
    last one ends the replay (its step samples the next new token)."""
    b = r.slot
    tag, sid = r.fed[i]
    self.tokens[b], self.tag_ids[b], self.state_ids[b] = r.out[i], tag, sid
    r.replay = None if i == len(r.out) - 1 else i

  def _accept(self, r: Request, tok: int, lp=None) -> None:
    """The host half of a step for one request (as in ``decode.generate``), with stop
    sequences and log-probs (module docstring)."""
    b = r.slot
    self.active[b] = False
    self.want_lp[b] = r.logprobs is not None
    now = time.perf_counter()
    r.t_first = r.t_first or now
    r.t_last = now
    try:
      tag, sid = r.tracker.accept(tok)
    except Exception as e:  # noqa: BLE001
      return self._finish(r, "error", f"grammar: {e}")
    stop = tok in self.stops or r.tracker.terminated
    if tok not in self.stops:
      r.out.append(tok)
      if r.logprobs is not None and lp is not None:
        r.lps.append(_logprobs(lp, r.logprobs))
      if r.stop:
        stop = self._stop_text(r) or stop
      self._send(r)
    if stop:
      return self._finish(r, "stop")
    if len(r.out) >= r.max_tokens:
      return self._finish(r, "length")
    r.fed.append((np.array(tag, np.int32), int(sid)))   # what a replay feeds with it
    self.tokens[b], self.tag_ids[b], self.state_ids[b] = tok, tag, sid
    self.active[b] = True

  def _text(self, r: Request) -> str:
    """The request's output text so far, decoded incrementally (:mod:`serve.detok`)."""
    if r.detok is None:
      r.detok = Detokenizer(self.tok)
    return r.detok.text(r.out)

  def _stop_text(self, r: Request) -> bool:
    """Cut the text at the first stop sequence that the newest token completed."""
    text = self._text(r)
    longest = max(len(x) for x in r.stop)
    lo = max(0, len(r.sent) - longest)
    hits = [i for i in (text.find(x, lo) for x in r.stop) if i >= 0]
    if hits:
      r.cut = min(hits)
      return True
    return False

  def _send(self, r: Request, final: bool = False) -> None:
    text = self._text(r)
    if r.cut is not None:
      text, final = text[:r.cut], True
    elif r.stop and not final:
      # Hold back the longest tail that could still begin a stop sequence.
      hold = max((k for x in r.stop for k in range(min(len(x) - 1, len(text)), 0, -1)
                  if text.endswith(x[:k])), default=0)
      text = text[:len(text) - hold]
    # Hold back an incomplete UTF-8 sequence (decoded as U+FFFD) until its bytes arrive.
    if (final or not text.endswith("\ufffd")) and text.startswith(r.sent) and text != r.sent:
      r.emit("delta", text[len(r.sent):])
      r.sent = text

  def _ledger_row(self, b: int) -> tuple[dict | None, bool]:
    led = jax.tree.map(lambda x: np.asarray(x[b:b + 1]), self.state[2])
    return ledger.summary(led, self.policy)[0], bool(np.asarray(self.state[0].overflow[b]))

  def _finish(self, r: Request, finish: str, error: str | None = None) -> None:
    b = r.slot
    result = None
    if finish in ("stop", "length"):
      self._send(r, final=True)
      row, overflow = self._ledger_row(b)
      n = len(r.out)
      tpot = (r.t_last - r.t_first) / (n - 1) if n > 1 else None
      # pages held at the end (the most of any layer group) = its peak: pools are append-only
      pages = [int(self.npg[HI, :, b].max()), int(self.npg[LO, :, b].max())]
      text = self.tok.decode(r.out)
      result = {"tokens": list(r.out), "text": text if r.cut is None else text[:r.cut],
                "finish": finish, "prompt_tokens": len(r.ids), "ledger": row,
                "overflow": overflow, "tpot_s": tpot, "logprobs": r.lps,
                "ttft_s": (r.t_first - r.t_submit) if r.t_first else None,
                "queue_s": (r.t_admit - r.t_submit) if r.t_admit else None,
                "preemptions": r.preemptions, "pages": pages}
      self.m["requests_" + finish] += 1
      self.m["prompt_tokens"] += len(r.ids)
      self.m["completion_tokens"] += n
      if tpot is not None:
        self.m["tpot_s_sum"] += tpot
        self.m["tpot_count"] += 1
      self.m["overflow"] += overflow
      if row is not None:
        # Aggregate measured B: payload sums, not a mean of ratios.
        self.m["payload_bits"] += row["prefill_bits"] + row["decode_bits"]
        self.m["full_kv_bits"] += row["full_kv_bits"]
        for part in ("prefill_counts", "decode_counts"):
          for g in row[part].values():
            for a, cnt in g.items():
              self.m["actions_" + a] += cnt
    else:
      self.m["requests_" + finish] += 1
    self._vacate(b)
    self.pressure = False   # pages came back: admission may resume
    r.slot = None
    if error is not None:
      r.emit("error", error)
    else:
      r.emit("done", result)


def _row(lp, b: int):
  """Row ``b`` of the sampler's log-prob outputs (host arrays), or None."""
  if lp is None:
    return None
  return float(lp[0][b]), np.asarray(lp[1][b]), np.asarray(lp[2][b])


def _logprobs(lp, k: int) -> tuple:
  """(chosen log-prob, [(id, log-prob)] of the top ``k`` alternatives that the mask allows)."""
  chosen, ids, top = lp
  alts = [(int(i), float(v)) for i, v in zip(ids[:k], top[:k]) if np.isfinite(v)]
  return chosen, alts


class DenseEngine(Engine):
  """The engine over the plain-XLA dense Full-KV cache (``kv_dense``: one row of ``context``
  BF16 slots per sequence, ``kv_dense.attend`` in the step): admission by free slot only, no
  pages, no ledger (measured B is 1 by definition).  The baseline of ``bench/bench_serving.py``;
  the server uses :class:`Engine`."""
  paged = False

  def _build(self, backend, hi_pages, lo_pages, kv_bytes, mix) -> None:
    c = self.cfg
    hb, _ = page_bytes(c, self.page)
    tok_bytes = hb // self.page
    self.sizing = Sizing(slots=self.slots, context=self.context, page=self.page,
                         window=self.window, hi_pages=self.slots * self.n_pages, lo_pages=0,
                         hi_page_bytes=hb, lo_page_bytes=0, fixed_bytes=0,
                         kv_bytes=None if kv_bytes is None else int(kv_bytes), mix=(1.0, 0.0),
                         mix_source="dense Full KV", source="dense rows")
    if kv_bytes is not None and self.slots * self.context * tok_bytes > kv_bytes:
      raise ValueError(f"{self.slots} dense rows of {self.context} tokens need "
                       f"{self.slots * self.context * tok_bytes / 1e9:.2f} GB, over the KV "
                       f"budget of {kv_bytes / 1e9:.2f} GB")
    self.reach = (True, False)
    self.hi_total, self.lo_total = self.sizing.hi_pages, 0
    self.totals = (0, 0)
    self.graphdef, params = nnx.split(self.model)
    self.runner = self.dense   # params and traces live on the shared prefill runner
    self.traces = collections.Counter()
    self.state = kv_dense.init(c.n_layers, self.slots, self.context, c.n_kv_heads, c.head_dim,
                               jnp.bfloat16)
    self._insert = jax.jit(self._dense_insert, donate_argnums=(0,))
    self._release = jax.jit(self._dense_release, donate_argnums=(0,))
    self._step = jax.jit(self._dense_step, donate_argnums=(1,))
    self._fwd = jax.jit(self._dense_fwd, donate_argnums=(1,))

  def _dense_forward(self, params, cache, tokens, active):
    """tokens [B] written at each active row's next slot, the model over the dense cache ->
    (logits [B, V], cache)."""
    model = nnx.merge(self.graphdef, params)
    cap = cache.k.shape[2]
    pos = jnp.where(active, cache.length, cap)[:, None]      # inactive rows write nothing
    cache = cache._replace(length=cache.length + active.astype(jnp.int32))
    logits, cache = model(tokens[:, None], pos, cache, kv_dense.attend)
    return logits[:, 0], cache

  def _dense_fwd(self, params, cache, dev_tok, host):
    """The overlapping engine's forward (``Engine._fwd_fn``'s ``host`` layout; no actions)."""
    self.traces["fwd"] += 1
    tokens = jnp.where(host[:, 1] > 0, host[:, 0], dev_tok)
    logits, cache = self._dense_forward(params, cache, tokens, host[:, 8] > 0)
    return (logits, jnp.zeros((tokens.shape[0], self.G), jnp.int32)), cache

  def _fwd_call(self, tok_dev, host, grow):
    return self._fwd(self.dense.params, self.state, tok_dev, jnp.asarray(host))

  def _dense_insert(self, cache, k, v, length, slot):
    self.traces["insert"] += 1
    Tn = min(k.shape[2], cache.k.shape[2])
    at = (0, slot, 0, 0, 0)
    kc = jax.lax.dynamic_update_slice(cache.k, k[:, :, :Tn].astype(cache.k.dtype), at)
    vc = jax.lax.dynamic_update_slice(cache.v, v[:, :, :Tn].astype(cache.v.dtype), at)
    return kv_dense.DenseCache(kc, vc, cache.length.at[slot].set(length[0]))

  def _dense_release(self, cache, slot):
    return cache._replace(length=cache.length.at[slot].set(0))

  def _dense_step(self, params, cache, tokens, active, bits, seeds, steps, temperature, top_p,
                  want_lp):
    self.traces["step"] += 1
    logits, cache = self._dense_forward(params, cache, tokens, active)
    nxt, lps = self._pick(logits, bits, seeds, steps, temperature, top_p, want_lp)
    out = jnp.concatenate([nxt[:, None], jnp.zeros((nxt.shape[0], self.G), jnp.int32)], axis=1)
    return (out, lps), cache

  def _insert_slot(self, r, dense, n, Tn, rows) -> None:
    self.state = self._insert(self.state, dense.k, dense.v, jnp.asarray([n], jnp.int32),
                              jnp.int32(r.slot))

  def _run_step(self, steps, grow, want):
    return self._step(self.dense.params, self.state, jnp.asarray(self.tokens),
                      jnp.asarray(self.active), jnp.asarray(self.bits), jnp.asarray(self.seeds),
                      jnp.asarray(steps), jnp.asarray(self.temp), jnp.asarray(self.top_p),
                      jnp.asarray(want))

  def _ledger_row(self, b: int):
    return None, False

  def worst_case(self, n_prompt: int, max_tokens: int) -> tuple[int, int]:
    return 0, 0
