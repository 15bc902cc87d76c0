"""Structured output requests as vLLM takes them, made into one llguidance grammar:
`response_format` (json_object, json_schema), the `guided_*` fields and `structured_outputs`."""

from __future__ import annotations

import json
from typing import Any

import llguidance

from engine.core.logits_processors import check_grammar
from engine.serve.protocol import ApiError, ResponseFormat, SamplingFields, StructuredOutputs

ANY_OBJECT = {"type": "object"}


def structured_grammar(body: SamplingFields) -> str | None:
    """The llguidance grammar `body` asks its output to match, or None; ApiError(400) names
    the field when it is malformed, refused, or one of several."""
    asked = _constraints(body)
    if not asked:
        return None
    if len(asked) > 1:
        raise ApiError(400, "You can only use one kind of structured outputs constraint but "
                            f"multiple are specified: {', '.join(name for name, _, _ in asked)}",
                       param=asked[1][0])
    name, kind, value = asked[0]
    flexible = not (body.structured_outputs is not None
                    and body.structured_outputs.disable_any_whitespace)
    try:
        grammar = _grammar(kind, value, flexible)
    except (ValueError, TypeError) as exc:
        raise ApiError(400, f"'{name}' is not a valid {kind}: {exc}", param=name) from None
    error = check_grammar(grammar)
    if error is not None:
        raise ApiError(400, f"'{name}' is not a valid {kind}: {error}", param=name)
    return grammar


def _constraints(body: SamplingFields) -> list[tuple[str, str, Any]]:
    """(field, kind, value) of every constraint given."""
    asked: list[tuple[str, str, Any]] = []
    fmt: ResponseFormat | None = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", "json", ANY_OBJECT))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise ApiError(400, "'response_format' of type json_schema needs "
                                "\"json_schema\": {\"name\": ..., \"schema\": {...}}",
                           param="response_format")
        asked.append(("response_format", "json", fmt.json_schema.json_schema))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            asked.append((name, kind, value))
    outputs: StructuredOutputs | None = body.structured_outputs
    if outputs is not None:
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(outputs, "json_" if kind == "json" else kind)
            if value is not None:
                asked.append((f"structured_outputs.{kind}", kind, value))
        if outputs.json_object:
            asked.append(("structured_outputs.json_object", "json", ANY_OBJECT))
    return asked


def _grammar(kind: str, value: Any, flexible_whitespace: bool) -> str:
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema is an object")
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": flexible_whitespace})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not value:
            raise ValueError("give at least one choice")
        return llguidance.grammar_from("choice", json.dumps(value))
    return llguidance.grammar_from("grammar", value)  # Lark, or GBNF/EBNF as vLLM takes
