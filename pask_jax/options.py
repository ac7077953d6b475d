"""What ``pask-jax serve`` and the Python API (:func:`pask_jax.start_engine`) share, in one place
so they cannot drift: the serving engine's option defaults and their checks, and the names of
the tool-call formats.  Cheap to import (no JAX).

* :data:`ENGINE` — the defaults: ``serve``'s flags and ``start_engine``'s keywords both read
  them (``tests/test_api.py`` compares the two against the ``serve`` parser).
* :func:`check_engine` — one-line ``ValueError``s for bad engine options (``start_engine``
  raises them; ``serve`` turns them into argparse errors naming its flags).
* :data:`DEFAULT_MAX_TOKENS` — the new tokens of a request that sets no ``max_tokens``, capped
  by the room its prompt leaves in the context: ``serve --default-max-tokens``'s default (chat
  completions) and the API's (``SamplingParams(max_tokens=None)``, ``pask-jax generate``).
* :data:`TOOL_FORMATS` — the tool-call format names every front end accepts (``serve
  --tool-call-parser``, ``generate --tool-format``, ``tool_format=`` of the API) -> the format
  of :mod:`pask_jax.grammar.toolcall`.  ``hermes`` is vLLM's name (``--tool-call-parser hermes``)
  for the ``<tool_call>`` blocks of Qwen2.5 and Hermes, ``tool_call_tags`` pask-jax's own.
"""
from __future__ import annotations

import dataclasses

TOOL_FORMATS = {"hermes": "tool_call_tags", "tool_call_tags": "tool_call_tags",
                "fenced_json": "fenced_json", "json_list": "json_list"}

DEFAULT_MAX_TOKENS = 256                  # --default-max-tokens; the API's max_tokens=None

PREEMPTION = ("replay", "recompute")     # the engine's too (serve.engine imports both)
PREFILL_CHUNKS = (64, 128, 256, 512)      # prefill piece sizes, each one of the engine's buckets
LO_FORMATS = ("bytes", "int4")            # as pallas_kernels.int4's formats
# "auto": what the step's kernels read fastest (serve.engine.check_lo_format): the int4 format
# where the Mosaic GPU kernel runs (Hopper) and takes the model, else bytes
LO_FORMAT_CHOICES = ("auto",) + LO_FORMATS


@dataclasses.dataclass(frozen=True)
class EngineDefaults:
  """The defaults of the serving engine's options (API keyword = ``serve`` flag)."""
  slots: int = 4                          # --max-num-seqs
  context: int = 2048                     # --max-model-len
  page: int = 16                          # --page
  preemption: str = "replay"              # --preemption
  prefill_chunk: int = 512                # --prefill-chunk
  prefill_share: float = 1 / 3            # --prefill-share
  lo_format: str = "auto"                 # --lo-format
  lo_page: int | None = None              # --lo-page (None: --page, or 128 for int4 on a GPU)
  tensor_parallel_size: int = 1           # --tensor-parallel-size
  policy: str = "all-high"                # --policy


ENGINE = EngineDefaults()

# start_engine's keyword -> serve's flag, for messages that name the flag on the command line
FLAGS = {"slots": "--max-num-seqs", "context": "--max-model-len", "page": "--page",
         "hi_pages": "--hi-pages", "lo_pages": "--lo-pages", "kv_memory": "--kv-memory",
         "gpu_memory_utilization": "--gpu-memory-utilization", "kv_mix": "--kv-mix",
         "preemption": "--preemption", "prefill_chunk": "--prefill-chunk",
         "prefill_share": "--prefill-share", "lo_format": "--lo-format", "lo_page": "--lo-page",
         "tensor_parallel_size": "--tensor-parallel-size", "tool_format": "--tool-call-parser"}


def resolve_tool_format(name: str | None, what: str = "tool format") -> str | None:
  """A tool-call format name (:data:`TOOL_FORMATS`) -> the grammar's format; None stays None
  (the model family's default)."""
  if name is None:
    return None
  if name not in TOOL_FORMATS:
    raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(TOOL_FORMATS)}")
  return TOOL_FORMATS[name]


def check_engine(*, slots=ENGINE.slots, context=ENGINE.context, page=ENGINE.page, hi_pages=None,
                 lo_pages=None, kv_memory=None, gpu_memory_utilization=None, kv_mix=None,
                 preemption=ENGINE.preemption, prefill_chunk=ENGINE.prefill_chunk,
                 prefill_share=ENGINE.prefill_share, lo_format=ENGINE.lo_format,
                 tensor_parallel_size=ENGINE.tensor_parallel_size, tool_format=None,
                 lo_page=ENGINE.lo_page, flags: bool = False) -> None:
  """The checks of the engine options, as one-line ValueErrors naming the keyword (``flags``:
  naming ``serve``'s flag instead)."""
  n = (lambda k: FLAGS[k]) if flags else (lambda k: k)
  whole = lambda x: isinstance(x, int) and not isinstance(x, bool)
  num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
  for k, v in (("slots", slots), ("context", context), ("page", page),
               ("tensor_parallel_size", tensor_parallel_size)):
    if not (whole(v) and v > 0):
      raise ValueError(f"{n(k)} must be a positive int, got {v!r}")
  for k, v in (("hi_pages", hi_pages), ("lo_pages", lo_pages), ("lo_page", lo_page)):
    if v is not None and not (whole(v) and v > 0):
      raise ValueError(f"{n(k)} must be None or a positive int, got {v!r}")
  if kv_memory is not None and gpu_memory_utilization is not None:
    raise ValueError(f"give {n('kv_memory')} or {n('gpu_memory_utilization')}, not both")
  if kv_memory is not None and not (num(kv_memory) and 0 < kv_memory < float("inf")):
    raise ValueError(f"{n('kv_memory')} must be a positive number of GB, got {kv_memory!r}")
  if gpu_memory_utilization is not None and not (
      num(gpu_memory_utilization) and 0 < gpu_memory_utilization <= 1):
    raise ValueError(f"{n('gpu_memory_utilization')} must be in (0, 1], got "
                     f"{gpu_memory_utilization!r}")
  if kv_mix is not None and not (
      isinstance(kv_mix, (list, tuple)) and len(kv_mix) == 2
      and all(num(x) and 0 <= x <= 1 for x in kv_mix) and 0 < sum(kv_mix) <= 1 + 1e-9):
    raise ValueError(f"{n('kv_mix')} must be two fractions (H, L) in [0, 1], not both 0, summing "
                     f"to at most 1, got {kv_mix!r}")
  if preemption not in PREEMPTION:
    raise ValueError(f"{n('preemption')} must be 'replay' or 'recompute', got {preemption!r}")
  if prefill_chunk not in PREFILL_CHUNKS or not whole(prefill_chunk):
    raise ValueError(f"{n('prefill_chunk')} must be one of 64, 128, 256, 512, got "
                     f"{prefill_chunk!r}")
  if not (num(prefill_share) and 0 < prefill_share < 1):
    raise ValueError(f"{n('prefill_share')} must be in (0, 1), got {prefill_share!r}")
  if lo_format not in LO_FORMAT_CHOICES:
    raise ValueError(f"{n('lo_format')} must be 'auto', 'bytes' or 'int4', got {lo_format!r}")
  resolve_tool_format(tool_format, "tool-call parser" if flags else "tool format")
