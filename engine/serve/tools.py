"""Tool calls as vLLM makes them: the grammar that forces a `required` or named call, and the
parsers (`--tool-call-parser hermes | llama3_json`) that find calls in free text (`auto`)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.serve.protocol import ApiError, ChatBody, Tool

PARSERS = ("hermes", "llama3_json")
HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_json(self, index: int | None = None) -> dict[str, Any]:
        return {**({"index": index} if index is not None else {}),
                "id": self.id or f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    """An answer's text split into its content and the tool calls it made."""

    content: str | None
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class ToolUse:
    """How one chat request uses its tools: `choice` is none, auto, required or a name."""

    tools: tuple[Tool, ...]
    choice: str
    parser: str | None

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced choice's output must match (vLLM's), else None. A call
        holds its name and parameters alone: vLLM's schema allows more keys, which a model
        that has not learned the form fills with text that may never end."""
        if self.choice == "required":
            return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
                {"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                "parameters": t.function.parameters or {"type": "object"}},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for t in self.tools]}}
        if self.forced:
            tool = next(t for t in self.tools if t.function.name == self.choice)
            return tool.function.parameters or {"type": "object"}
        return None

    def parse(self, text: str) -> Parsed:
        """The answer `text` as content and tool calls, by this request's rule."""
        if self.choice == "none" or not self.tools:
            return Parsed(text, ())
        if self.choice == "required":
            calls = json.loads(text)
            return Parsed(None, tuple(ToolCall(c["name"], _arguments(c["parameters"]))
                                      for c in calls))
        if self.forced:
            return Parsed(None, (ToolCall(self.choice, text),))
        assert self.parser is not None
        return PARSE[self.parser](text)


def tool_use(body: ChatBody, parser: str | None) -> ToolUse | None:
    """The request's tool use, or None without tools; ApiError(400) as vLLM refuses it."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "When using `tool_choice`, `tools` must be set.",
                           param="tool_choice")
        return None
    if choice is None:
        choice = "auto"
    elif not isinstance(choice, str):
        if choice.function.name not in {t.function.name for t in body.tools}:
            raise ApiError(400, "The tool specified in `tool_choice` does not match any of "
                                "the specified `tools`", param="tool_choice")
        choice = choice.function.name
    if choice == "auto" and parser is None:
        raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                            "--tool-call-parser to be set", param="tool_choice")
    return ToolUse(tuple(body.tools), choice, parser)


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _hermes(text: str) -> Parsed:
    """Hermes 2 Pro / Qwen: `<tool_call>{"name", "arguments"}</tool_call>` blocks."""
    if "<tool_call>" not in text:
        return Parsed(text, ())
    try:
        calls = [json.loads(a or b) for a, b in HERMES_CALL.findall(text)]
        found = tuple(ToolCall(c["name"], _arguments(c.get("arguments", {}))) for c in calls)
    except (ValueError, KeyError, TypeError):
        return Parsed(text, ())  # not a call after all: the text is the answer, as vLLM's
    content = text[:text.find("<tool_call>")]
    return Parsed(content or None, found)


def _llama3_json(text: str) -> Parsed:
    """Llama 3.x JSON calls: `{"name", "parameters"}` objects, `;`-separated, at the start
    (after `<|python_tag|>` if there is one)."""
    start = text.find(PYTHON_TAG)
    body = text[start + len(PYTHON_TAG):] if start >= 0 else text
    if not body.lstrip().startswith("{"):
        return Parsed(text, ())
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    rest = body.lstrip()
    try:
        while rest:
            call, end = decoder.raw_decode(rest)
            arguments = call.get("parameters", call.get("arguments"))
            calls.append(ToolCall(call["name"], _arguments(arguments if arguments is not None
                                                           else {})))
            rest = rest[end:].lstrip().removeprefix(";").lstrip()
    except (ValueError, KeyError, TypeError, AttributeError):
        return Parsed(text, ())
    return Parsed(text[:start] if start > 0 else None, tuple(calls))


PARSE: dict[str, Callable[[str], Parsed]] = {"hermes": _hermes, "llama3_json": _llama3_json}


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The tools as the chat template reads them (transformers' `tools`, as vLLM passes)."""
    return [tool.model_dump(exclude_none=True) for tool in tools]
