"""What the client sees of a request: accepted tokens, text deltas, stop sequences, log-probs,
the final result, and the engine's counters.

Stop sequences are matched on the decoded text after every accepted token, so a sequence split
across tokens is found; the text is cut before it (the tokens stay counted).  Streamed text holds
back the longest tail that could still begin a stop sequence, and an incomplete UTF-8 sequence.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from serve.detok import Detokenizer

METRIC_KEYS = ("queue_wait_s", "prefill_s", "prefills", "decode_steps", "decode_step_s",
               "decode_rows", "requests_stop", "requests_length", "requests_cancelled",
               "requests_error", "prompt_tokens", "completion_tokens", "tpot_s_sum", "tpot_count",
               "overflow", "payload_bits", "full_kv_bits", "actions_R", "actions_L", "actions_H",
               "admission_blocked_pages", "preemptions", "resumed", "replay_steps",
               "plan_s", "admit_s", "alloc_s", "hi_used_peak", "lo_used_peak",
               # where a decode step's wall time goes on the host (sum over steps)
               "fill_s", "dispatch_s", "join_s", "wait_s", "accept_s")


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What an accepted token means for its request: ``finish`` ("stop", "length", "error") or
  None to continue, fed next with ``tag`` / ``sid``."""
  finish: str | None = None
  error: str | None = None
  tag: object = None
  sid: int = -1


class Output:

  def __init__(self, tokenizer):
    self.tok = tokenizer
    self.stops = set(tokenizer.stop_ids)

  def accept(self, r, tok: int, lp=None) -> Verdict:
    """The host half of a step for one request (as in ``decode.generate``): the grammar, the
    token, its log-probs, stop sequences, and the text delta."""
    now = time.perf_counter()
    r.t_first = r.t_first or now
    r.t_last = now
    try:
      tag, sid = r.tracker.accept(tok)
    except Exception as e:  # noqa: BLE001
      return Verdict("error", f"grammar: {e}")
    stop = tok in self.stops or r.tracker.terminated
    if tok not in self.stops:
      r.out.append(tok)
      if r.logprobs is not None and lp is not None:
        r.lps.append(logprobs(lp, r.logprobs))
      if r.stop:
        stop = self._stop_text(r) or stop
      self.send(r)
    if stop:
      return Verdict("stop")
    if len(r.out) >= r.max_tokens:
      return Verdict("length")
    return Verdict(None, None, tag, sid)

  def _text(self, r) -> str:
    """The request's output text so far, decoded incrementally (:mod:`serve.detok`)."""
    if r.detok is None:
      r.detok = Detokenizer(self.tok)
    return r.detok.text(r.out)

  def _stop_text(self, r) -> bool:
    """Cut the text at the first stop sequence that the newest token completed."""
    text = self._text(r)
    longest = max(len(x) for x in r.stop)
    lo = max(0, len(r.sent) - longest)
    hits = [i for i in (text.find(x, lo) for x in r.stop) if i >= 0]
    if hits:
      r.cut = min(hits)
      return True
    return False

  def send(self, r, final: bool = False) -> None:
    """Emit the text not sent yet (all of it if ``final``)."""
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

  def result(self, r, finish: str, row: dict | None, overflow: bool, pages: list[int]) -> dict:
    """The result of a request that completed ("stop" or "length"); the rest of its text is
    sent first."""
    self.send(r, final=True)
    n = len(r.out)
    text = self.tok.decode(r.out)
    return {"tokens": list(r.out), "text": text if r.cut is None else text[:r.cut],
            "finish": finish, "prompt_tokens": len(r.ids), "ledger": row,
            "overflow": overflow, "tpot_s": (r.t_last - r.t_first) / (n - 1) if n > 1 else None,
            "logprobs": r.lps,
            "ttft_s": (r.t_first - r.t_submit) if r.t_first else None,
            "queue_s": (r.t_admit - r.t_submit) if r.t_admit else None,
            "preemptions": r.preemptions, "pages": pages}


def count_finish(m, finish: str, result: dict | None) -> None:
  """A request ended with ``finish`` (and ``result`` if it completed): the counters ``m``."""
  m["requests_" + finish] += 1
  if result is None:
    return
  m["prompt_tokens"] += result["prompt_tokens"]
  m["completion_tokens"] += len(result["tokens"])
  if result["tpot_s"] is not None:
    m["tpot_s_sum"] += result["tpot_s"]
    m["tpot_count"] += 1
  m["overflow"] += result["overflow"]
  row = result["ledger"]
  if row is not None:
    # Aggregate measured B: payload sums, not a mean of ratios.
    m["payload_bits"] += row["prefill_bits"] + row["decode_bits"]
    m["full_kv_bits"] += row["full_kv_bits"]
    for part in ("prefill_counts", "decode_counts"):
      for g in row[part].values():
        for a, cnt in g.items():
          m["actions_" + a] += cnt


def count_peak(m, used: tuple[int, int]) -> None:
  """Pages in use now (``PagePools.used``) into the peak counters."""
  m["hi_used_peak"] = max(m["hi_used_peak"], used[0])
  m["lo_used_peak"] = max(m["lo_used_peak"], used[1])


def logprobs(lp, k: int) -> tuple:
  """(chosen log-prob, [(id, log-prob)] of the top ``k`` alternatives that the mask allows)."""
  chosen, ids, top = lp
  alts = [(int(i), float(v)) for i, v in zip(ids[:k], top[:k]) if np.isfinite(v)]
  return chosen, alts
