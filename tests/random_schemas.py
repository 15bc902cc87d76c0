"""Random JSON schemas of the kinds clients send (objects of typed, bounded fields, nested
objects and arrays, enums, numbers with ranges), and a check that an output matches one."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema; strings, arrays and nesting are bounded so outputs stay short even
    when the logits are random."""
    fields = {f"f{i}": _value(rng, depth) for i in range(rng.randint(1, 4))}
    required = [name for name in fields if rng.random() < 0.7]
    return {"type": "object", "properties": fields, "required": required,
            "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "object",
                       "null", "const"] if depth < 2 else
                      ["string", "integer", "boolean", "enum", "null"])
    if kind == "string":
        schema: dict[str, Any] = {"type": "string", "maxLength": rng.randint(0, 8)}
        if rng.random() < 0.3:
            schema["pattern"] = rng.choice(["^[a-z]+$", "^[0-9]{2,4}$", "^(yes|no)$"])
            schema.pop("maxLength")
        return schema
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", "ü", "7"], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["x", 1, True])}
    if kind == "array":
        return {"type": "array", "items": _value(rng, depth + 1),
                "minItems": 0, "maxItems": rng.randint(1, 3)}
    if kind == "object":
        return random_schema(rng, depth + 1)
    return {"type": kind}


def matches(text: str, schema: dict[str, Any]) -> str | None:
    """Why `text` is not a JSON document valid under `schema`, or None."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        return f"not JSON ({exc}): {text!r}"
    try:
        jsonschema.validate(document, schema)
    except jsonschema.ValidationError as exc:
        return f"invalid ({exc.message}): {text!r}"
    return None
