"""Prepared requests: the one path from a conversation to the ids a model is fed.

The Python API (:func:`pask_jax.api.prepare`), the server (``serve.prepare.Preparer``, which adds
the OpenAI protocol: message translation, ``tool_choice``, length checks before labelling) and
the calibration tasks (``calibrate.bfcl.prepare``, ``calibrate.tasks.SyntheticTask``) all
render with :func:`render`, tokenize with :func:`encode` and hand on a :class:`Prompt`; the
serving engine builds its request from one (``serve.engine.Request.of``).

* :func:`style` — the tool-call format and JSON indent: the model family's measured default
  (``DEFAULT_STYLE``; ``json_list`` for other families), or a chosen format (which keeps the
  family's indent only where it is the family's own format).
* :func:`render` — the chat template over the messages, with ``tools`` where the template reads
  them; a template that ignores them gets the tools described in a system message, as a new
  first message or (``merge``) in front of the conversation's own system message.
* :func:`encode` — the ids (``== tokenizer.encode``), with the prompt-span labels of the PASK
  prefill plan when asked.
* :func:`load_chat_template`, :func:`with_chat_template` — a chat template of the user's in place
  of the model's: ``pask-jax serve --chat-template`` and the API's ``chat_template="..."`` resolve
  it alike (a file path, else the template itself, as vLLM does) and refuse it alike.
"""
from __future__ import annotations

import codecs
import copy
import dataclasses
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Prompt:
  """A prepared request: the rendered text, its ids (and prompt-span labels for PASK), the
  grammar constraining the answer, and the tools and tool-call format it is parsed with."""
  text: str
  ids: list[int]
  tags: Any = None                  # prompt-span label candidates int32[len(ids), 4], or None
  grammar: Any = None               # the compiled grammar of the answer, or None (free text)
  tools: list[dict] | None = None
  fmt: str | None = None            # the tool-call format of the answer (with tools)
  case: Any = None                  # what it was prepared from, for scoring (a benchmark case)
  retrieved: Any = None             # bool[len(ids)]: retrieved evidence (a document), or None


def style(arch: str, tool_format: str | None = None) -> tuple[str, int | None]:
  """(tool-call format, JSON indent) for a model family and an optional chosen format: a name
  of :data:`pask_jax.options.TOOL_FORMATS` (vLLM's ``hermes`` is ``tool_call_tags``)."""
  from pask_jax.grammar.toolcall import DEFAULT_STYLE
  from pask_jax.options import resolve_tool_format
  fmt, indent = DEFAULT_STYLE.get(arch, ("json_list", None))
  tool_format = resolve_tool_format(tool_format)
  if tool_format is None or tool_format == fmt:
    return fmt, indent
  return tool_format, None


def render(tokenizer, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
           fmt: str = "json_list", describe: Sequence[dict] | None = None,
           choice: str = "required", merge: bool = False, template: str | None = None,
           **options) -> str:
  """The conversation rendered with the chat template.

  ``tools`` reach a template that reads them.  Otherwise ``describe`` (default: ``tools``) is
  described in a system message (:func:`~pask_jax.grammar.toolcall.tools_system_prompt` with
  ``fmt`` and ``choice``): a new first message, or with ``merge`` the text put before the
  conversation's own system message.  ``template``: a template (text) or a template name in
  place of the tokenizer's default; ``options``: ``apply_chat_template``'s (e.g.
  ``add_generation_prompt``).  The messages are not modified."""
  msgs = [dict(m) for m in messages]
  takes = takes_tools(tokenizer, template)
  shown = tools if describe is None else describe
  if shown and not takes:
    from pask_jax.grammar.toolcall import tools_system_prompt
    text = tools_system_prompt(list(shown), fmt, choice)
    if merge and msgs and msgs[0].get("role") == "system":
      msgs[0]["content"] = text + "\n\n" + msgs[0]["content"]
    else:
      msgs.insert(0, {"role": "system", "content": text})
  if template is not None:
    options["chat_template"] = template
  return tokenizer.apply_chat_template(msgs, tools=list(tools) if (tools and takes) else None,
                                       **options)


def one_line(e: BaseException) -> str:
  """An exception's message as one line (at most 300 characters), or its type's name."""
  return " ".join(str(e).split())[:300] or type(e).__name__


def load_chat_template(value: str, what: str = "--chat-template") -> str:
  """A chat template given as a file path or as the template itself, resolved as vLLM resolves
  ``--chat-template``: a readable file is read; otherwise a value holding ``{``, ``}`` or a
  newline is the template itself (its ``\\n`` escapes decoded, so a template fits on one line).
  ``what`` names the option in the one-line ValueError (``serve``'s flag, the API's keyword)."""
  if not isinstance(value, str) or not value:
    raise ValueError(f"{what} must be a file path or a template (a non-empty string), got "
                     f"{value!r}")
  try:
    with open(value, encoding="utf-8") as f:
      text = f.read()
  except (OSError, ValueError) as e:   # ValueError: not UTF-8, or a NUL in the value
    if any(c in value for c in "{}\n"):
      return codecs.decode(value, "unicode_escape") if value.isascii() else value
    why = (e.strerror if isinstance(e, OSError) else
           "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else one_line(e))
    raise ValueError(f"{what} {value!r} is neither a readable file ({why}) nor a "
                     "template (it has no '{')") from None
  if not text.strip():
    raise ValueError(f"{what} {value!r} is an empty file")
  return text


def with_chat_template(tokenizer, template: str, what: str = "--chat-template"):
  """A copy of ``tokenizer`` whose only (default) chat template is ``template`` (the model's
  tokenizer is not changed); ValueError naming ``what`` if it cannot render a one-message
  conversation."""
  tok = copy.copy(tokenizer)
  tok.chat_template, tok.chat_templates = template, {"default": template}
  try:
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
  except Exception as e:  # noqa: BLE001 — jinja2 raises many kinds; all are a bad template
    raise ValueError(f"{what} cannot render a one-message conversation: {one_line(e)}") from None
  return tok


def takes_tools(tokenizer, template: str | None = None) -> bool:
  """Whether the template reads ``tools`` (``models.tokenizer.Tokenizer.takes_tools``, which
  also sees a named ``tool_use`` template; for another tokenizer: its template's text)."""
  if hasattr(tokenizer, "takes_tools"):
    return tokenizer.takes_tools(template)
  return "tools" in (template or tokenizer.chat_template or "")


def takes_calls(tokenizer, template: str | None = None) -> bool:
  """Whether the chat template renders an assistant message's ``tool_calls`` (else a past
  answer's calls are written into its text, in the model's format)."""
  return "tool_calls" in (template or tokenizer.chat_template or "")


def mark(tokenizer, text: str, spans: Sequence[tuple[int, int]], labels: bool = False
         ) -> tuple[list[int], Any, np.ndarray]:
  """``(ids, tags, marks)`` from one tokenization: ``ids == tokenizer.encode(text)``, ``tags``
  as :func:`encode` gives them (None unless ``labels``), ``marks`` bool[len(ids)] True on each
  token whose characters overlap one of ``spans`` (``[start, end)`` character ranges of
  ``text``: a workload's retrieved evidence)."""
  from pask_jax.grammar import prompt_spans
  ids, offsets = prompt_spans.encode(tokenizer, text)
  off = np.asarray(offsets, np.int64).reshape(-1, 2)
  marks = np.zeros(len(ids), bool)
  for a, b in spans:
    if not 0 <= a <= b <= len(text):
      raise ValueError(f"span [{a}, {b}) is outside the text of {len(text)} characters")
    marks |= (off[:, 0] < b) & (off[:, 1] > a)
  tags = prompt_spans.labels(text, offsets) if labels else None
  return list(ids), tags, marks


def encode(tokenizer, text: str, labels: bool = False) -> tuple[list[int], Any]:
  """(ids, prompt-span labels int32[len(ids), 4] or None): ``ids == tokenizer.encode(text)``."""
  if labels:
    from pask_jax.grammar.prompt_spans import label_prompt
    ids, tags = label_prompt(tokenizer, text)
    return list(ids), tags
  return list(tokenizer.encode(text)), None
