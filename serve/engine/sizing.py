"""KV memory sizing: how many pages each pool gets, and what a request can need.

The budget (``kv_bytes``, or ``gpu_memory_utilization`` x the device's free memory after the
weights, less the prefill scratch; on a mesh the least free memory of its devices) first pays
every slot's fixed state (its BF16 recent window, page tables and position maps); the rest is
split between the BF16 and INT4 pools in proportion to the bytes the expected H/L mix puts in
each: a fraction ``h`` of the (token, layer group) entries that leave the window goes to the BF16
pool, ``l`` to the INT4 pool.  The mix is, in order: the ``mix`` argument (``--kv-mix``), the
policy record's ``extra.kv_mix``, or :func:`expected_mix`.  Each pool keeps at least one page per
slot (sinks are H forever; every sequence has a partial page).  Without a budget the pools hold
every slot at full context; ``hi_pages``/``lo_pages`` override either pool.  Page ids are per layer
group, and a pool gives every group as many ids as its heaviest group needs, so ``h`` and ``l``
are the heaviest group's.  The two pools may page differently: ``page`` rows per BF16 page,
``lo_page`` per INT4 page (the Mosaic GPU INT4 kernel reads pages of 64 or 128 rows; the BF16
pool's small pages waste less of a short request).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from pask_jax import actions as Act
from pask_jax.decode import PREFILL_CHUNK
# PREFILL_CHUNKS: the prefill piece sizes (each one of the buckets below), serve's choices too
from pask_jax.options import PREFILL_CHUNKS

# Padded lengths of a one-piece prompt: steps of 1.5x and 2x, so padding is at most a third of
# a prefill, at one compile per bucket.
PREFILL_BUCKETS = (32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket(n: int, chunk: int = PREFILL_CHUNK) -> int:
  """Padded prefill length of ``n`` prompt tokens prefilled in pieces of ``chunk``: the least of
  :data:`PREFILL_BUCKETS` that holds them (one piece), or past one piece the least multiple of
  ``chunk`` (every piece but the last is full, and none is all padding)."""
  if n > chunk:
    return -(-n // chunk) * chunk
  return next(b for b in PREFILL_BUCKETS if b >= n)


def page_bytes(cfg, page: int, shards: int = 1) -> tuple[int, int]:
  """Bytes of one page (all layers) of the BF16 pool (K and V) and of the INT4 pool (K and V
  codes, D/2 bytes per row each, plus the fp16 K and V scales), on each of ``shards`` devices
  (tensor parallelism splits the pools by KV head)."""
  L, H, D = cfg.n_layers, cfg.n_kv_heads // shards, cfg.head_dim
  return 2 * L * page * H * D * 2, L * page * H * (D + 4)


def slot_bytes(cfg, *, window: int, n_groups: int, context: int, page: int,
               shards: int = 1, lo_page: int | None = None) -> int:
  """Fixed cache bytes of one slot: BF16 window K/V, window positions and pending actions,
  page tables and entry positions of both pools (``lo_page`` rows per INT4 page, None:
  ``page``), count/overflow; on each of ``shards`` devices (the window split by KV head, the
  tables and positions replicated)."""
  L, H, D = cfg.n_layers, cfg.n_kv_heads // shards, cfg.head_dim
  tables = 0
  for pg in (page, page if lo_page is None else lo_page):
    n = math.ceil(context / pg)
    tables += n_groups * n * 4 + n_groups * n * pg * 4       # page table + entry positions
  return 2 * L * window * H * D * 2 + window * (4 + n_groups) + tables + 2 * n_groups * 4 + 8


def reachable(policy) -> tuple[bool, bool]:
  """(H reachable, L reachable) beyond the sinks: an entry can take any level between its floor
  and max(base, floor), plus the promotions that have a score.  Unknown tags resolve to H."""
  a = np.asarray(policy.action).astype(np.int32)
  f = np.asarray(policy.floor).astype(np.int32)
  p = np.asarray(policy.prio)
  top = np.maximum(a, f)
  top = np.where((top == Act.R) & np.isfinite(p[..., 0]), Act.L, top)
  top = np.where((top == Act.L) & np.isfinite(p[..., 1]), Act.H, top)
  return bool(np.any(top == Act.H)), bool(np.any((f <= Act.L) & (top >= Act.L)))


def worst_pages(policy, n_tokens: int, page: int, lo_page: int | None = None) -> tuple[int, int]:
  """Pages (BF16 pool, INT4 pool) per layer group that a request of ``n_tokens`` can need at
  most: every token beyond the window in that pool; only the sinks' for a BF16 pool the policy
  never reaches beyond them, none for an INT4 pool it never reaches.  ``lo_page``: rows per
  INT4 page (None: ``page``)."""
  can_h, can_l = reachable(policy)
  t = max(0, n_tokens - int(policy.window))
  need = math.ceil(t / page)
  sinks = math.ceil(min(t, int(policy.sink)) / page)
  return (need if can_h else sinks), (math.ceil(t / (lo_page or page)) if can_l else 0)


def expected_mix(policy) -> tuple[float, float, str]:
  """(h, l, source): the expected fractions of window-leaving (token, group) entries stored H
  and L: the policy record's ``extra.kv_mix``; else H only for a policy that never reaches L;
  else the budget B = max(B_P, B_D) spent with no R (the mix that needs the most pages):
  ``h = (B - rho)/(1 - rho)``, ``l = 1 - h`` with rho = m(L)/m(H) (0.26 at head_dim 128)."""
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
  rho = float(cost[Act.L].sum() / cost[Act.H].sum()) if cost[Act.H].sum() > 0 else 0.26
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
  shards: int = 1              # devices the pools are split over by KV head (bytes: per device)
  lo_page: int | None = None   # rows per INT4 page (None: ``page``)

  @property
  def pages(self) -> tuple[int, int]:
    """Rows per page of the BF16 and the INT4 pool."""
    return self.page, self.page if self.lo_page is None else self.lo_page

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
    hp, lp = self.pages
    return (math.ceil(h * t / hp) + 1, math.ceil(l * t / lp) + 1 if l > 0 else 0)

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
    if self.shards > 1:
      head += f" per device ({self.shards} devices, pools and windows split by KV head)"
    (hp, lp), n = self.pages, self.context
    return (f"{head}: BF16 pool {self.hi_pages:,} pages x {hp} tokens "
            f"({gb(self.hi_pages * self.hi_page_bytes)}), INT4 pool {self.lo_pages:,} pages x "
            f"{lp} tokens ({gb(self.lo_pages * self.lo_page_bytes)}), windows and tables "
            f"{gb(self.fixed_bytes)} for {self.slots} slots; expected mix H {h:.3f} / L {l:.3f} "
            f"({self.mix_source}); about {self.requests_fit(n)} concurrent requests "
            f"of {n:,} tokens fit (Full KV in the same memory: {self.full_kv_fit(n)})")


def size_pools(cfg, policy, *, slots: int, context: int, page: int = 16,
               kv_bytes: int | None = None, mix: tuple[float, float] | None = None,
               hi_pages: int | None = None, lo_pages: int | None = None,
               shards: int = 1, lo_page: int | None = None) -> Sizing:
  """Pool sizes from a KV memory budget (bytes) and the policy (the module docstring).
  ``shards``: tensor parallelism over that many devices; then ``kv_bytes`` is each device's
  budget and every byte figure is per device (a page costs 1/``shards`` of its bytes there).
  ``lo_page``: rows per INT4 page (None: ``page``)."""
  lp = page if lo_page is None else lo_page
  if slots < 1 or context < 1 or page < 1 or lp < 1:
    raise ValueError("slots, context and page must be positive")
  window, G = int(policy.window), int(policy.n_groups)
  hb, lb = page_bytes(cfg, page, shards)[0], page_bytes(cfg, lp, shards)[1]
  fixed = slots * slot_bytes(cfg, window=window, n_groups=G, context=context, page=page,
                             shards=shards, lo_page=lo_page)
  if mix is not None:
    h, l = (float(x) for x in mix)
    if not (0 <= h <= 1 and 0 <= l <= 1 and h + l > 0):
      raise ValueError(f"kv mix must be two fractions in [0, 1] (H, L), not both 0; got {mix}")
    why = "given"
  else:
    h, l, why = expected_mix(policy)
  lo_min = slots if l > 0 else 1
  if kv_bytes is None:
    hi = hi_pages or slots * math.ceil(context / page)
    lo = lo_pages or (slots * math.ceil(context / lp) if l > 0 else 1)
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
      share = h * hb / page / (h * hb / page + l * lb / lp)    # of the bytes per entry
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
                mix_source=why, source=source, shards=shards,
                lo_page=None if lp == page else int(lp))


def memory_stats(device) -> dict | None:
  """``device.memory_stats()``; None where the device reports none (CPU)."""
  return device.memory_stats() if hasattr(device, "memory_stats") else None


def free_memory(devices) -> int:
  """The least free memory (``bytes_limit - bytes_in_use``) over ``devices``: on a mesh every
  device holds the same pools, so the one with the least room sizes them.  A device that
  reports no memory: ValueError (one line)."""
  free = []
  for dev in devices:
    stats = memory_stats(dev)
    if not stats or "bytes_limit" not in stats:
      raise ValueError(f"--gpu-memory-utilization needs a device that reports its memory; "
                       f"{dev.platform} device {dev.id} does not: give the KV budget with "
                       "--kv-memory GB")
    free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
  if not free:
    raise ValueError("--gpu-memory-utilization needs at least one device")
  return min(free)


def kv_bytes_for_utilization(fraction: float, cfg, context: int, devices=None,
                             shards: int = 1) -> int:
  """``fraction`` of the free memory (after whatever is already allocated, e.g. the weights) of
  the device with the least of it among ``devices`` (default: the first device;
  :func:`free_memory`), less the transient prefill scratch of one ``context`` prompt (dense BF16
  K/V and one chunk's attention scores); with ``shards`` > 1 each device's budget (the weights,
  the scratch and the scores split by head over the devices)."""
  if not 0 < fraction <= 1:
    raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
  free = free_memory([jax.devices()[0]] if devices is None else list(devices))
  n = max(bucket(context, c) for c in PREFILL_CHUNKS)   # the longest padding of any piece size
  scratch = 2 * cfg.n_layers * n * cfg.n_kv_heads // shards * cfg.head_dim * 2
  scores = min(n, PREFILL_CHUNK) * n * cfg.n_heads // shards * 4
  return int(fraction * free) - scratch - scores


def dense_sizing(cfg, *, slots: int, context: int, page: int, window: int,
                 kv_bytes: int | None, shards: int = 1) -> Sizing:
  """The layout of the dense Full-KV cache (one row of ``context`` BF16 slots per sequence, no
  pools), checked against the budget (per device with ``shards`` > 1)."""
  hb, _ = page_bytes(cfg, page, shards)
  tok_bytes = hb // page
  sizing = Sizing(slots=slots, context=context, page=page, window=window,
                  hi_pages=slots * math.ceil(context / page), lo_pages=0, hi_page_bytes=hb,
                  lo_page_bytes=0, fixed_bytes=0,
                  kv_bytes=None if kv_bytes is None else int(kv_bytes), mix=(1.0, 0.0),
                  mix_source="dense Full KV", source="dense rows", shards=shards)
  if kv_bytes is not None and slots * context * tok_bytes > kv_bytes:
    raise ValueError(f"{slots} dense rows of {context} tokens need "
                     f"{slots * context * tok_bytes / 1e9:.2f} GB, over the KV "
                     f"budget of {kv_bytes / 1e9:.2f} GB")
  return sizing
