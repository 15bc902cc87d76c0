"""What every endpoint shares: bounded JSON bodies, typed request models, OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import re
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    create_model,
    field_validator,
)
from pydantic import ValidationError as PydanticValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.config import INT64_MAX, LIVE_FIELDS, EngineConfig
from engine.serve.log_limit import RateLimitedLog

JSON_TYPE = "application/json"
M = TypeVar("M", bound=BaseModel)

# Unknown request fields are ignored, as OpenAI's server and vLLM ignore them; vLLM says so in
# its log, and so does this, at a bounded rate (the names are the client's).
ignored_fields_log = logging.getLogger("tokenflow.serve.fields")
RateLimitedLog.install(ignored_fields_log)
IGNORED_NAMES_SHOWN = 8
IGNORED_NAME_CHARS = 64


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.headers = headers or {}

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


async def api_error_handler(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


OFF_LOOP_BYTES = 64 * 1024  # bodies this large are decoded on a worker thread


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = 1 << 20
    read_timeout_s: float = 10.0
    max_depth: int = 32  # OpenAI bodies nest 3 deep; 100,000 would exhaust the parser's stack


async def read_json(request: Request, limits: BodyLimits) -> Any:
    """The body as JSON: 415 not JSON, 408 late, 413 too large, 400 malformed or too deep."""
    body = await _json_body(request, limits)
    if len(body) < OFF_LOOP_BYTES:
        return _decoded(body, limits)
    return await run_in_threadpool(_decoded, body, limits)


async def read_model(request: Request, model: type[M], limits: BodyLimits,
                     status: int = 400) -> M:
    """read_json's body as `model` (parse_model). A large body is decoded, checked and
    validated on a worker thread: 110,000 stop strings (0.9 MB) held the event loop, and
    every client's request on it, for 270 ms before the share refused them."""
    body = await _json_body(request, limits)
    if len(body) < OFF_LOOP_BYTES:
        return parse_model(model, _decoded(body, limits), status)
    return await run_in_threadpool(lambda: parse_model(model, _decoded(body, limits), status))


async def _json_body(request: Request, limits: BodyLimits) -> bytes:
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != JSON_TYPE:
        raise ApiError(415, f"send the body as JSON with 'Content-Type: {JSON_TYPE}'"
                            f"{f', not {media_type!r}' if media_type else ''}")
    return await read_body(request, limits.max_bytes, limits.read_timeout_s,
                           ApiError(413, f"request body is over the limit of {limits.max_bytes} "
                                         "bytes; send a shorter prompt or raise the server's "
                                         "body limit"))


def _decoded(body: bytes, limits: BodyLimits) -> Any:
    try:
        data = json.loads(body)
    except RecursionError:
        raise _too_deep(limits, "the body") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc}); send a JSON object") from None
    _check_tree(data, limits, texts=_may_hold_surrogates(body))
    return data


async def read_body(request: Request, max_bytes: int, timeout_s: float,
                    too_large: ApiError) -> bytes:
    """The raw body, refused while reading past `max_bytes` (a bomb is never held whole) or late."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                body += part
                if len(body) > max_bytes:
                    raise too_large
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive within {timeout_s:g} s; "
                            "send all the bytes that Content-Length declares",
                       headers={"Connection": "close"}) from None
    return bytes(body)


# A lone surrogate reaches decoded JSON only through a \\uD800-\\uDFFF escape (UTF-8 bytes
# cannot encode one): a body without such an escape has no text to check, only its depth.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _may_hold_surrogates(body: bytes) -> bool:
    return _SURROGATE_ESCAPE.search(body) is not None


def _check_tree(data: Any, limits: BodyLimits, texts: bool = True) -> None:
    """Depth of every value, and with `texts` the Unicode of every string and key, without
    recursion (depth is what is checked). Without `texts` only containers are walked: 110,000
    stop strings cost the walk 50-80 ms of the GIL when each string was visited."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    nested = (str, list, dict) if texts else (list, dict)
    while stack:
        value, path, depth = stack.pop()
        if depth > limits.max_depth:
            raise _too_deep(limits, f"'{path}'")
        if isinstance(value, str):
            _check_text(value, path or "the body")
        elif isinstance(value, dict):
            for key, item in value.items():
                if texts:
                    _check_text(key, f"{path}.{{key}}" if path else "a key")
                if isinstance(item, nested) or depth >= limits.max_depth:  # too deep itself
                    stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list) and not set(map(type, value)).isdisjoint(nested):
            # (the set is found in C: a long list of numbers or unchecked strings is skipped)
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)
                         if isinstance(item, nested))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{where}' is not valid Unicode (it holds a lone surrogate); "
                            "send UTF-8 text", param=where) from None


def _too_deep(limits: BodyLimits, where: str) -> ApiError:
    return ApiError(400, f"{where} nests JSON deeper than {limits.max_depth} levels; "
                         "completions need 3")


NonEmpty = Field(min_length=1)
Prompt = (StrictStr | Annotated[list[StrictInt], NonEmpty] | Annotated[list[StrictStr], NonEmpty]
          | Annotated[list[Annotated[list[StrictInt], NonEmpty]], NonEmpty])
Number = StrictFloat
# OpenAI fields we do not implement, with the values that mean "not used".
Unused = Literal[None, "", False] | Annotated[list[Any], Field(max_length=0)]
UNSUPPORTED = "is not supported by tokenflow; leave it out"
# Messages for fields whose pydantic error would name a union member instead of the rule.
HINTS = {
    "prompt": "must be text, a list of integer token ids, or a list of either (one choice "
              "per prompt)",
    "temperature": "must be a finite number", "top_p": "must be a finite number",
    "best_of": f"{UNSUPPORTED} (or set it to 1): choosing the best of several samples is "
               "not implemented; use n to get several",
    "suffix": f"{UNSUPPORTED}: insertion needs a fill-in-the-middle model",
    "stop": "must be a string or a list of strings",
    "functions": f"{UNSUPPORTED}: it is OpenAI's older form; send 'tools'",
    "tool_choice": "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}",
    "function_call": "must be 'none' or left out: send 'tools' and 'tool_choice'",
    "parallel_tool_calls": "must be true or false",
    "logprobs": "must be an integer from 0 (completions) or true/false (chat)",
    **{name: f"{UNSUPPORTED} (a vLLM extension tokenflow does not implement)"
       for name in ("allowed_token_ids", "bad_words", "use_beam_search")},
    "length_penalty": "must be 1 or left out: it weighs beam search's candidates, and "
                      "tokenflow has no beam search (vLLM ignores it without one)",
    "chat_template": "is refused: a template sent with a request is not trusted (vLLM refuses "
                     "it too unless started with --trust-request-chat-template); start the "
                     "server with --chat-template FILE",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)
    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one constraint, and how JSON may be laid out."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    json_: StrictStr | dict[str, Any] | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool | None = None
    disable_fallback: StrictBool | None = None  # one backend here: nothing to fall back from


class SamplingFields(BaseModel):
    """vLLM's sampling fields; unknown fields are ignored, JSON null means "the default"."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    seed: StrictInt | None = None
    ignore_eos: StrictBool | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    prompt_logprobs: StrictInt | None = None
    # the tokenizer's special tokens: added to a text prompt (default: true for completions,
    # false for chat, whose template writes them), left out of the output text
    add_special_tokens: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    min_tokens: StrictInt | None = None
    # structured output (engine.serve.structured): one of these at a time
    response_format: ResponseFormat | None = None
    guided_json: StrictStr | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: StructuredOutputs | None = None
    truncate_prompt_tokens: StrictInt | None = None
    priority: StrictInt | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    # vLLM extensions tokenflow does not implement, refused rather than ignored
    length_penalty: Literal[None, 1] | Annotated[StrictFloat, Field(ge=1.0, le=1.0)] = None
    allowed_token_ids: Unused = None
    bad_words: Unused = None
    use_beam_search: Literal[None, False] = None

    @field_validator("stream_options")
    @classmethod
    def _options_need_a_stream(cls, options: StreamOptions | None,
                               info: ValidationInfo) -> StreamOptions | None:
        """vLLM's 400: options for a stream that a reply without one would drop."""
        given = options is not None and options.model_fields_set
        if given and info.data.get("stream") is not True:
            raise ValueError("stream options can only be defined when `stream=True`; set "
                             "stream to true, or leave stream_options out")
        return options

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionBody(SamplingFields):

    prompt: Prompt
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: Literal[1] | None = None
    suffix: Unused = None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str | list):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    type: Literal["text"]
    text: StrictStr


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    name: StrictStr
    arguments: StrictStr


class ToolCallIn(BaseModel):
    """A call an assistant message in the history made."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """A part that is not text is named, not reported as "input should be a string"."""
        if isinstance(content, list):
            for index, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"part {index} is of type {json.dumps(kind)[:40]}: this server reads "
                        "text parts ({\"type\": \"text\", \"text\": ...}) only; images, audio "
                        "and files need a multimodal model")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatBody(SamplingFields):
    """POST /v1/chat/completions: text messages in, an assistant message out."""

    messages: Annotated[list[ChatMessage], NonEmpty]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most, as vLLM
    functions: Unused = None
    function_call: Literal[None, "none"] = None
    echo: Literal[None, False] = None
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    documents: list[dict[StrictStr, StrictStr]] | None = None
    chat_template: Literal[None] = None


class TokenizeBody(BaseModel):
    """POST /tokenize: a prompt, or chat messages rendered with the template (vLLM's)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    # one text, as vLLM's /tokenize takes it: the completions' lists of ids are already tokens
    hints: ClassVar[dict[str, str]] = {
        "prompt": "must be one string (or send 'messages' instead); token ids need no "
                  "tokenizing"}
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages
    return_token_strs: StrictBool | None = None  # each token's vocabulary string, as vLLM's


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    model: StrictStr | None = None
    tokens: list[StrictInt]


def _live_field_model() -> type[BaseModel]:
    """PATCH /v1/admin/config's types from EngineConfig's live fields: wrong types get 422."""
    finite = Field(allow_inf_nan=False)
    types: dict[str, Any] = {
        "int": Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)],
        "float": Annotated[float, finite],
        "bool": bool,
        "dict[str, float]": dict[StrictStr, Annotated[StrictFloat, finite]],
        "dict[str, int]": dict[StrictStr, Annotated[StrictInt, Field(ge=-INT64_MAX - 1,
                                                                     le=INT64_MAX)]],
    }
    fields = {f.name: (types.get(str(f.type), Any) | None, None)
              for f in dataclasses.fields(EngineConfig) if f.name in LIVE_FIELDS}
    return create_model("ConfigPatch", __config__=ConfigDict(extra="allow"), **fields)


ConfigPatch = _live_field_model()


def parse_model(model: type[M], data: Any, status: int = 400) -> M:
    try:
        parsed = model.model_validate(data)
    except PydanticValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        error = errors[0]
        loc = error["loc"]
        if not loc:
            raise ApiError(status, f"the body must be a JSON object ({error['msg']})") from None
        name = str(loc[0])
        hint = getattr(model, "hints", {}).get(name) or HINTS.get(name)
        if hint is not None:
            raise ApiError(status, f"'{name}' {hint}", param=name) from None
        where = _field_path(loc)
        # a union's branches fail together, each under its type's tag ('guided_json.str'):
        # say what the field may be, once, at the field's own path
        messages = list(dict.fromkeys(_said(e["msg"]) for e in errors
                                      if _field_path(e["loc"]) == where))
        said = " or ".join([messages[0], *(m.removeprefix("input should be ")
                                           for m in messages[1:])])
        raise ApiError(status, f"'{where}': {said}", param=name) from None
    if model.model_config.get("extra") == "ignore":  # a body vLLM's API shapes
        _log_ignored(model, data)
    return parsed


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|bytes)$|[\[\]]|^[A-Z]")


def _field_path(loc: tuple[int | str, ...]) -> str:
    """An error's path as the body writes it (`messages[0].content`), without the tags a
    union's branches add (`str`, `list[TextPart]`, `StructuredOutputs`)."""
    parts = [part for part in loc[1:] if isinstance(part, int) or not _TYPE_TAG.search(part)]
    return str(loc[0]) + "".join(f"[{part}]" if isinstance(part, int) else f".{part}"
                                 for part in parts)


def _said(message: str) -> str:
    message = message.removeprefix("Value error, ")  # a validator's own words
    return message[0].lower() + message[1:]


@functools.cache
def _known_fields(model: type[BaseModel]) -> frozenset[str]:
    """The names a body of `model` may use: its fields and their aliases."""
    return frozenset(name for field_name, field in model.model_fields.items()
                     for name in (field_name, field.alias) if name is not None)


def _log_ignored(model: type[BaseModel], data: dict[str, Any]) -> None:
    """Say which of a request's fields `model` does not know, as vLLM's log does."""
    known = _known_fields(model)
    ignored = sorted(key for key in data if key not in known)
    if ignored:
        shown = ", ".join(json.dumps(name[:IGNORED_NAME_CHARS])
                          for name in ignored[:IGNORED_NAMES_SHOWN])
        more = len(ignored) - IGNORED_NAMES_SHOWN
        ignored_fields_log.warning("fields present in the request but ignored: %s%s", shown,
                                   f" and {more} more" if more > 0 else "")


def json_response(data: Any, status: int = 200) -> Response:
    """JSON that keeps non-finite floats (Python's json reads them back) instead of failing."""
    return Response(json.dumps(data), status_code=status, media_type="application/json")
