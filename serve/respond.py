"""Engine results to OpenAI responses: messages, logprobs, usage with the KV ledger, metrics,
and the SSE streams."""
from __future__ import annotations

import asyncio
import json
import time
import uuid


from pask_jax import actions as Act
from serve.engine import Request
from serve.metrics import Metrics
from serve.prepare import finite
from serve.protocol import (error_body)


# ---- responses ----------------------------------------------------------------------------

def usage_of(result: dict) -> dict:
  led = finite(result["ledger"])
  totals = {a: sum(g[a] for part in ("prefill_counts", "decode_counts")
                   for g in led[part].values()) for a in Act.NAMES}
  n_p, n_c = result["prompt_tokens"], len(result["tokens"])
  return {"prompt_tokens": n_p, "completion_tokens": n_c, "total_tokens": n_p + n_c,
          "pask": {"prompt_kv_bits": led["prefill_bits"], "decode_kv_bits": led["decode_bits"],
                   "full_kv_bits": led["full_kv_bits"], "measured_B": led["measured_B"],
                   "prefill_B": led["prefill_B"], "decode_B": led["decode_B"],
                   "actions": totals, "prefill_counts": led["prefill_counts"],
                   "decode_counts": led["decode_counts"], "overflow": result["overflow"]}}


class Responder:
  """Turns engine results into OpenAI messages, logprobs and stream chunks."""

  def __init__(self, tok, fmt: str, calls: bool):
    self.tok, self.fmt, self.calls = tok, fmt, calls

  def message(self, result: dict) -> tuple[dict, str]:
    """(assistant message, finish_reason) of a finished request."""
    from pask_jax.grammar.toolcall import split_calls
    text, finish = result["text"], result["finish"]
    if self.calls:
      content, calls = split_calls(text, self.fmt)
      if calls:
        tc = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
               "function": {"name": c["name"],
                            "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
              for c in calls]
        return ({"role": "assistant", "content": content, "tool_calls": tc, "refusal": None},
                "tool_calls" if finish == "stop" else finish)
    return {"role": "assistant", "content": text, "refusal": None}, finish

  def kept(self, result: dict) -> list[tuple[int, float, list, int]] | None:
    """(token, logprob, alternatives, character offset) of the tokens that start inside the
    returned text (a stop sequence's tokens go with it); None without logprobs."""
    lps = result.get("logprobs")
    if lps is None or result.get("want_logprobs") is None:
      return None
    toks = result["tokens"][:len(lps)]
    out, n_text = [], len(result["text"])
    for k in range(len(toks)):
      at = len(self.tok.decode(toks[:k])) if k else 0
      if at >= n_text and k > 0:
        break
      out.append((toks[k], lps[k][0], lps[k][1], at))
    return out

  def logprobs(self, result: dict) -> dict | None:
    """Chat completions' ``logprobs``."""
    kept = self.kept(result)
    if kept is None:
      return None
    tb = self.tok.token_bytes()
    entry = lambda i, lp: {"token": tb[i].decode("utf-8", "replace"), "logprob": lp,
                           "bytes": list(tb[i])}
    content = [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in alts]}
               for t, lp, alts, _ in kept]
    return {"content": content, "refusal": None}

  def text_logprobs(self, result: dict) -> dict | None:
    """Completions' (legacy) ``logprobs``: tokens, token_logprobs, top_logprobs (token text ->
    logprob; tokens of the same text collapse, as in OpenAI's format), text_offset."""
    kept = self.kept(result)
    if kept is None:
      return None
    tb = self.tok.token_bytes()
    text = lambda i: tb[i].decode("utf-8", "replace")
    return {"tokens": [text(t) for t, *_ in kept],
            "token_logprobs": [lp for _, lp, _, _ in kept],
            "top_logprobs": [{text(i): v for i, v in alts} for _, _, alts, _ in kept],
            "text_offset": [at for *_, at in kept]}


# ---- the app ------------------------------------------------------------------------------


def observe(metrics: Metrics, result: dict, t_arrive: float) -> None:
  now = time.perf_counter()
  metrics.e2e.observe(now - t_arrive)
  if result.get("ttft_s") is not None:
    metrics.ttft.observe(result["ttft_s"])
  if result.get("tpot_s") is not None:
    metrics.tpot.observe(result["tpot_s"])
  if result.get("queue_s") is not None:
    metrics.queue.observe(result["queue_s"])


async def sse_chunks(req: Request, q: asyncio.Queue, resp: Responder, meta: dict, usage: bool,
                     metrics: Metrics):
  """SSE chunks.  Text deltas stream as they decode; with tools, the text before a call block
  streams too (the tail that could begin the block's trigger is held back), the calls arrive
  as ``tool_calls`` deltas once complete."""
  from pask_jax.grammar.toolcall import BLOCKS, TRIGGERS

  def chunk(delta: dict, finish=None, logprobs=None, choices=True, use=None) -> str:
    c = {"id": meta["id"], "object": "chat.completion.chunk", "created": meta["created"],
         "model": meta["model"], "system_fingerprint": None,
         "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                      "logprobs": logprobs}] if choices else []}
    if usage:
      c["usage"] = use
    return f"data: {json.dumps(c, ensure_ascii=False)}\n\n"

  trigger = TRIGGERS[resp.fmt] if resp.calls else None
  begin = BLOCKS[resp.fmt][0] if resp.calls else None
  text, sent, held = "", 0, False   # held: a call block has begun, content streaming stopped
  finished = False
  try:
    yield chunk({"role": "assistant", "content": ""})
    while True:
      kind, payload = await q.get()
      if kind == "delta":
        text += payload
        if not resp.calls:
          yield chunk({"content": payload})
          sent = len(text)
          continue
        if held:
          continue
        j = min((i for i in (text.find(trigger, sent), text.find(begin, sent)) if i >= 0),
                default=-1)
        if j >= 0:
          held = True
          safe = j
        else:
          safe = len(text) - max((k for k in range(min(len(trigger) - 1, len(text)), 0, -1)
                                  if text.endswith(trigger[:k])), default=0)
        if safe > sent:
          yield chunk({"content": text[sent:safe]})
          sent = safe
      elif kind == "error":
        finished = True
        metrics.http.labels("500").inc()
        yield f"data: {json.dumps(error_body(payload, 'server_error'))}\n\n"
        return
      else:   # done (a cancelled request never reaches here: its client is gone)
        finished = True
        observe(metrics, payload, meta["t_arrive"])
        payload["want_logprobs"] = meta["logprobs"]
        msg, finish = resp.message(payload)
        lp = resp.logprobs(payload)
        if resp.calls:
          content = msg.get("content") or ""
          streamed = text[:sent]
          if content.startswith(streamed) and len(content) > len(streamed):
            yield chunk({"content": content[len(streamed):]})
          if msg.get("tool_calls"):
            yield chunk({"tool_calls": [dict(tc, index=i)
                                        for i, tc in enumerate(msg["tool_calls"])]})
        elif sent < len(payload["text"]):
          yield chunk({"content": payload["text"][sent:]})
        yield chunk({}, finish, lp)
        if usage:
          yield chunk({}, choices=False, use=usage_of(payload))
        yield "data: [DONE]\n\n"
        return
  finally:
    if not finished:   # the client went away mid-stream (the generator was closed/cancelled)
      metrics.disconnects.inc()
      req.cancel()


async def stream_text(req: Request, q: asyncio.Queue, resp: Responder, meta: dict, usage: bool,
                       metrics: Metrics):
  """SSE chunks of a completion (``text_completion`` objects): the echoed prompt, the text
  deltas as they decode, then a chunk with the finish_reason and logprobs."""

  def chunk(text: str, finish=None, logprobs=None, choices=True, use=None) -> str:
    c = {"id": meta["id"], "object": "text_completion", "created": meta["created"],
         "model": meta["model"], "system_fingerprint": None,
         "choices": [{"index": 0, "text": text, "finish_reason": finish,
                      "logprobs": logprobs}] if choices else []}
    if usage:
      c["usage"] = use
    return f"data: {json.dumps(c, ensure_ascii=False)}\n\n"

  sent, finished = 0, False
  try:
    if meta["echo"]:
      yield chunk(meta["echo"])
    while True:
      kind, payload = await q.get()
      if kind == "delta":
        sent += len(payload)
        yield chunk(payload)
      elif kind == "error":
        finished = True
        metrics.http.labels("500").inc()
        yield f"data: {json.dumps(error_body(payload, 'server_error'))}\n\n"
        return
      else:   # done
        finished = True
        observe(metrics, payload, meta["t_arrive"])
        payload["want_logprobs"] = meta["logprobs"]
        if sent < len(payload["text"]):
          yield chunk(payload["text"][sent:])
        yield chunk("", payload["finish"], resp.text_logprobs(payload))
        if usage:
          yield chunk("", choices=False, use=usage_of(payload))
        yield "data: [DONE]\n\n"
        return
  finally:
    if not finished:
      metrics.disconnects.inc()
      req.cancel()


