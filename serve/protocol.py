"""The request bodies as pydantic models (validated by FastAPI): OpenAI's chat completions and
(legacy) completions, vLLM's ``/tokenize`` and ``/detokenize``; and the OpenAI-style error body
every 4xx carries.

One schema layer: every field of the official ``openai`` client's ``CompletionCreateParams`` is
declared here, in strict mode (``"5"`` is not an integer, ``1`` is not a string), with unknown
fields forbidden (``Unrecognized request argument supplied: top_k``).  A field is either honoured
or refused with a 400 that names it; the fields that have no effect on what is generated
(identifiers and cache hints: ``user``, ``safety_identifier``, ``metadata``,
``prompt_cache_key``, ``prompt_cache_options``, ``prompt_cache_retention``) are accepted.
The README's serving table lists every field and what happens to it.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

MAX_STOP = 16           # stop sequences per request (OpenAI allows 4, vLLM any number)
MAX_TOP_LOGPROBS = 20   # as OpenAI; the engine computes this many alternatives at most


class _Model(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)


def _unsupported(what: str, hint: str = "") -> PydanticCustomError:
  return PydanticCustomError("unsupported", "{what} is not supported by this server{hint}",
                             {"what": what, "hint": f"; {hint}" if hint else ""})


def _text_content(v: Any, required: bool = True) -> Any:
  """A string, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
  if v is None and not required:
    return None
  if isinstance(v, str):
    return v
  if isinstance(v, list):
    parts = []
    for i, p in enumerate(v):
      if not isinstance(p, dict):
        raise PydanticCustomError("content", "content[{i}] must be an object", {"i": i})
      if p.get("type") != "text":
        raise PydanticCustomError(
            "content", "content[{i}] has type {t}: only text content parts are supported",
            {"i": i, "t": repr(p.get("type"))})
      if set(p) - {"type", "text"} or not isinstance(p.get("text"), str):
        raise PydanticCustomError("content", "content[{i}] must be {{\"type\": \"text\", "
                                  "\"text\": <string>}}", {"i": i})
      parts.append(p["text"])
    return "".join(parts)
  raise PydanticCustomError("content", "content must be a string or a list of text parts", {})


class _Message(_Model):
  name: str | None = None


class _TextMessage(_Message):
  content: Any

  @field_validator("content", mode="before")
  @classmethod
  def _c(cls, v):
    return _text_content(v)


class SystemMessage(_TextMessage):
  role: Literal["system", "developer"]


class UserMessage(_TextMessage):
  role: Literal["user"]


class FunctionCall(_Model):
  name: str
  arguments: str


class ToolCall(_Model):
  id: str
  type: Literal["function"] = "function"
  function: FunctionCall


class AssistantMessage(_Message):
  role: Literal["assistant"]
  content: Any = None
  refusal: str | None = None
  tool_calls: list[ToolCall] | None = None
  audio: Any = None
  function_call: Any = None

  @field_validator("content", mode="before")
  @classmethod
  def _c(cls, v):
    return _text_content(v, required=False)

  @field_validator("audio", "function_call")
  @classmethod
  def _no(cls, v, info):
    if v is not None:
      raise _unsupported(f"'{info.field_name}'", "use 'tool_calls'" if
                         info.field_name == "function_call" else "")
    return v


class ToolMessage(_Model):
  role: Literal["tool"]
  content: Any
  tool_call_id: str

  @field_validator("content", mode="before")
  @classmethod
  def _c(cls, v):
    return _text_content(v)


Message = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage],
                    Field(discriminator="role")]


class FunctionDef(_Model):
  name: str = Field(min_length=1, max_length=256)
  description: str | None = None
  parameters: dict[str, Any] | None = None
  strict: bool | None = None


class Tool(_Model):
  type: Literal["function"]
  function: FunctionDef


class NamedFunction(_Model):
  name: str


class NamedToolChoice(_Model):
  type: Literal["function"]
  function: NamedFunction


def _choice_kind(v: Any) -> str:
  return "mode" if isinstance(v, str) else "named"


ToolChoice = Annotated[Union[Annotated[Literal["none", "auto", "required"], Tag("mode")],
                             Annotated[NamedToolChoice, Tag("named")]],
                       Discriminator(_choice_kind)]


class JsonSchemaSpec(_Model):
  name: str = Field(min_length=1, max_length=64)
  description: str | None = None
  schema_: Any = Field(default=None, alias="schema")
  strict: bool | None = None
  model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

  @field_validator("schema_")
  @classmethod
  def _schema(cls, v):
    if v is None:
      raise PydanticCustomError("missing", "response_format.json_schema.schema is required", {})
    if not isinstance(v, (dict, bool)):
      raise PydanticCustomError("schema", "a JSON schema must be an object or a boolean", {})
    return v


class TextFormat(_Model):
  type: Literal["text"]


class JsonObjectFormat(_Model):
  type: Literal["json_object"]


class JsonSchemaFormat(_Model):
  type: Literal["json_schema"]
  json_schema: JsonSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat],
                           Field(discriminator="type")]


class StreamOptions(_Model):
  include_usage: bool | None = None
  include_obfuscation: bool | None = None

  @field_validator("include_obfuscation")
  @classmethod
  def _obf(cls, v):
    if v:
      raise _unsupported("stream obfuscation", "the server never pads stream chunks")
    return v


def _one_choice(v, info):
  if v not in (None, 1):
    raise _unsupported(f"{info.field_name} > 1", "send one request per choice")
  return v


def _stops(v):
  if v is None:
    return None
  stops = [v] if isinstance(v, str) else v
  if len(stops) > MAX_STOP:
    raise PydanticCustomError("stop", "at most {n} stop sequences", {"n": MAX_STOP})
  if any(not s for s in stops):
    raise PydanticCustomError("stop", "a stop sequence must not be empty", {})
  return stops


def _no_penalty(v, info):
  if v:
    raise _unsupported(f"a nonzero '{info.field_name}'")
  return v


def _no_bias(v):
  if v:
    raise _unsupported("'logit_bias'")
  return v


class ChatCompletionRequest(_Model):
  """``POST /v1/chat/completions`` (every field of the official client, see module doc)."""

  messages: list[Message] = Field(min_length=1)
  model: str
  # generation
  max_completion_tokens: int | None = Field(default=None, ge=1)
  max_tokens: int | None = Field(default=None, ge=1)
  temperature: float | None = Field(default=None, ge=0, le=2)
  top_p: float | None = Field(default=None, gt=0, le=1)
  seed: int | None = Field(default=None, ge=-2**63, lt=2**64)
  n: int | None = Field(default=None, ge=1)
  stop: str | list[str] | None = None
  logprobs: bool | None = None
  top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
  stream: bool | None = None
  stream_options: StreamOptions | None = None
  # structure
  tools: list[Tool] | None = None
  tool_choice: ToolChoice | None = None
  parallel_tool_calls: bool | None = None
  response_format: ResponseFormat | None = None
  # accepted without effect on the output (identifiers, cache hints)
  user: str | None = None
  safety_identifier: str | None = None
  metadata: dict[str, str] | None = None
  prompt_cache_key: str | None = None
  prompt_cache_options: Any = None
  prompt_cache_retention: Literal["in_memory", "24h"] | None = None
  # refused unless absent / at their neutral value
  frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
  presence_penalty: float | None = Field(default=None, ge=-2, le=2)
  logit_bias: dict[str, Any] | None = None
  store: bool | None = None
  service_tier: str | None = None
  modalities: list[str] | None = None
  audio: Any = None
  prediction: Any = None
  reasoning_effort: Any = None
  verbosity: Any = None
  web_search_options: Any = None
  moderation: Any = None
  functions: Any = None
  function_call: Any = None

  @field_validator("n")
  @classmethod
  def _n(cls, v, info):
    return _one_choice(v, info)

  @field_validator("stop")
  @classmethod
  def _stop(cls, v):
    return _stops(v)

  @field_validator("frequency_penalty", "presence_penalty")
  @classmethod
  def _penalty(cls, v, info):
    return _no_penalty(v, info)

  @field_validator("logit_bias")
  @classmethod
  def _bias(cls, v):
    return _no_bias(v)

  @field_validator("store")
  @classmethod
  def _store(cls, v):
    if v:
      raise _unsupported("store=true", "completions are not stored")
    return v

  @field_validator("service_tier")
  @classmethod
  def _tier(cls, v):
    if v not in (None, "auto", "default"):
      raise _unsupported(f"service_tier {v!r}")
    return v

  @field_validator("modalities")
  @classmethod
  def _modalities(cls, v):
    if v not in (None, ["text"]):
      raise _unsupported(f"modalities {v!r}", "only ['text']")
    return v

  @field_validator("audio", "prediction", "reasoning_effort", "verbosity", "web_search_options",
                   "moderation", "functions", "function_call")
  @classmethod
  def _absent(cls, v, info):
    if v is not None:
      hint = "use 'tools' and 'tool_choice'" if info.field_name.startswith("function") else ""
      raise _unsupported(f"'{info.field_name}'", hint)
    return v

  @model_validator(mode="after")
  def _together(self):
    if self.top_logprobs is not None and not self.logprobs:
      raise PydanticCustomError("top_logprobs", "'top_logprobs' requires 'logprobs': true", {})
    if self.stream_options is not None and not self.stream:
      raise PydanticCustomError("stream_options",
                                "'stream_options' is only allowed when 'stream' is true", {})
    return self


def _one_prompt(v: Any) -> Any:
  """``prompt``: a string or a list of token ids; a batch of one is unwrapped (``[str]``,
  ``[[ids]]``), a larger batch is refused (one request per prompt)."""
  if isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
    if len(v) > 1:
      raise _unsupported("a batch of prompts", "send one request per prompt")
    v = v[0]
  if isinstance(v, str):
    if not v:
      raise PydanticCustomError("prompt", "the prompt must not be empty", {})
    return v
  if isinstance(v, list):
    if not v:
      raise PydanticCustomError("prompt", "the prompt must not be empty", {})
    if not all(type(x) is int for x in v):
      raise PydanticCustomError("prompt", "a token prompt must be a list of integers", {})
    return v
  raise PydanticCustomError("prompt", "prompt must be a string or a list of token ids", {})


class CompletionRequest(_Model):
  """``POST /v1/completions``: plain text in, text out (no chat template)."""

  model: str
  prompt: Any
  max_tokens: int | None = Field(default=16, ge=1)   # OpenAI's and vLLM's default
  temperature: float | None = Field(default=None, ge=0, le=2)
  top_p: float | None = Field(default=None, gt=0, le=1)
  seed: int | None = Field(default=None, ge=-2**63, lt=2**64)
  stop: str | list[str] | None = None
  stream: bool | None = None
  stream_options: StreamOptions | None = None
  logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
  echo: bool | None = None
  n: int | None = Field(default=None, ge=1)
  best_of: int | None = Field(default=None, ge=1)
  user: str | None = None
  frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
  presence_penalty: float | None = Field(default=None, ge=-2, le=2)
  logit_bias: dict[str, Any] | None = None
  suffix: str | None = None

  @field_validator("prompt", mode="before")
  @classmethod
  def _prompt(cls, v):
    return _one_prompt(v)

  @field_validator("n", "best_of")
  @classmethod
  def _n(cls, v, info):
    return _one_choice(v, info)

  @field_validator("stop")
  @classmethod
  def _stop(cls, v):
    return _stops(v)

  @field_validator("frequency_penalty", "presence_penalty")
  @classmethod
  def _penalty(cls, v, info):
    return _no_penalty(v, info)

  @field_validator("logit_bias")
  @classmethod
  def _bias(cls, v):
    return _no_bias(v)

  @field_validator("suffix")
  @classmethod
  def _suffix(cls, v):
    if v:
      raise _unsupported("'suffix'")
    return v

  @model_validator(mode="after")
  def _together(self):
    if self.stream_options is not None and not self.stream:
      raise PydanticCustomError("stream_options",
                                "'stream_options' is only allowed when 'stream' is true", {})
    if self.echo and self.logprobs is not None:
      raise _unsupported("'echo' with 'logprobs'", "the prompt's log-probs are not computed")
    return self


class TokenizeRequest(_Model):
  """``POST /tokenize`` (vLLM's shape): a ``prompt``, or ``messages`` rendered with the chat
  template (as a chat completion would render them, ``tools`` included)."""

  model: str | None = None
  prompt: str | None = None
  messages: list[Message] | None = None
  tools: list[Tool] | None = None
  add_special_tokens: bool | None = None   # default: True for a prompt, False for messages
  add_generation_prompt: bool = True
  continue_final_message: bool = False
  return_token_strs: bool = False

  @model_validator(mode="after")
  def _one(self):
    if (self.prompt is None) == (self.messages is None):
      raise PydanticCustomError("prompt", "give exactly one of 'prompt' and 'messages'", {})
    if self.messages is not None and not self.messages:
      raise PydanticCustomError("messages", "'messages' must not be empty", {})
    if self.prompt is not None and (self.tools is not None or self.continue_final_message):
      raise PydanticCustomError("prompt", "'tools' and 'continue_final_message' need "
                                "'messages'", {})
    if self.continue_final_message and self.add_generation_prompt:
      raise PydanticCustomError("continue_final_message", "'continue_final_message' needs "
                                "'add_generation_prompt': false", {})
    return self


class DetokenizeRequest(_Model):
  """``POST /detokenize`` (vLLM's shape)."""

  model: str | None = None
  tokens: list[int]


# ---- error bodies ---------------------------------------------------------------------------

def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_ROLE_TAGS = {"system", "developer", "user", "assistant", "tool"}
_UNION_TAGS = {"tool_choice": {"mode", "named"}, "stop": {"str", "list[str]"},
               "response_format": {"text", "json_object", "json_schema"}}


def param_of(loc: tuple) -> str | None:
  """pydantic loc -> OpenAI ``param`` (``messages[0].content``), without union tags."""
  out, prev = "", None
  for seg in loc:
    if isinstance(seg, int):
      out += f"[{seg}]"
    elif (isinstance(prev, int) and loc[:1] == ("messages",) and seg in _ROLE_TAGS) or \
        seg in _UNION_TAGS.get(prev, ()):
      pass
    else:
      out += ("." if out else "") + str(seg)
    prev = seg
  return out or None


def validation_error(errors: list[dict]) -> tuple[dict, int]:
  """FastAPI's RequestValidationError errors -> (OpenAI error body, status)."""
  e = errors[0]
  loc = tuple(e.get("loc") or ())
  if loc and loc[0] == "body":
    loc = loc[1:]
  kind = e.get("type")
  if kind == "json_invalid":
    err = (e.get("ctx") or {}).get("error", "")
    pos = loc[0] if loc and isinstance(loc[0], int) else None
    return error_body(f"malformed JSON body: {err}" + (f" at byte {pos}" if pos is not None
                                                       else "")), 400
  param = param_of(loc)
  msg = str(e.get("msg", "invalid value"))
  for prefix in ("Value error, ", "Assertion failed, "):
    msg = msg.removeprefix(prefix)
  if kind == "extra_forbidden":
    name = str(loc[-1]) if loc else "?"
    where = param_of(loc[:-1])
    return error_body(f"Unrecognized request argument supplied: {name}"
                      + (f" (in {where})" if where else ""), param=param), 400
  if kind == "missing":
    return error_body(f"Missing required parameter: {param!r}.", param=param,
                      code="missing_required_parameter"), 400
  if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
    return error_body("the request body must be a JSON object"), 400
  if kind == "unsupported":
    return error_body(msg, param=param, code="unsupported_parameter"), 400
  if param is None and kind in ("top_logprobs", "stream_options", "prompt", "messages",
                                 "continue_final_message"):
    param = kind
  return error_body(f"Invalid value for {param!r}: {msg}" if param else msg, param=param), 400


__all__ = ["ChatCompletionRequest", "CompletionRequest", "TokenizeRequest", "DetokenizeRequest",
           "ValidationError", "error_body", "validation_error",
           "param_of", "MAX_TOP_LOGPROBS", "MAX_STOP"]
