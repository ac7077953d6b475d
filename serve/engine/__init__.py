"""The serving engine: continuous batching of requests over one paged PASK cache.

Parts, each returning decisions to the loop (:mod:`.loop`, run by :mod:`.core`'s
:class:`Engine`): :mod:`.request` (what
a client asks for, and the engine's bookkeeping of it), :mod:`.sizing` (how many pages each pool
gets), :mod:`.pages` (the pools' free lists and every slot's pages), :mod:`.scheduler` (whom to
admit, when prefill pieces run, whom to preempt), :mod:`.step` (the device state and its jitted
functions, paged or dense), :mod:`.batch` (host mirrors of the step's inputs) and
:mod:`.output` (tokens to text, stop sequences, results, counters).
"""
from serve.engine.core import PREEMPTION, DenseEngine, Engine
from serve.engine.output import METRIC_KEYS
from serve.engine.request import Request
from serve.engine.scheduler import STARVE_STEPS
from serve.engine.sizing import (PREFILL_BUCKETS, PREFILL_CHUNKS, Sizing, bucket, expected_mix,
                                 kv_bytes_for_utilization, page_bytes, reachable, size_pools,
                                 slot_bytes, worst_pages)
from serve.engine.step import TOP_LOGPROBS, check_lo_format

__all__ = ["METRIC_KEYS", "PREEMPTION", "PREFILL_BUCKETS", "PREFILL_CHUNKS", "STARVE_STEPS",
           "TOP_LOGPROBS", "DenseEngine", "Engine", "Request", "Sizing", "bucket",
           "check_lo_format", "expected_mix",
           "kv_bytes_for_utilization", "page_bytes", "reachable", "size_pools", "slot_bytes",
           "worst_pages"]
