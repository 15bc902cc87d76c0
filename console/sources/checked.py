"""A snapshot or slow query from another process or a file, checked before the console
believes it.

A server may answer anything: `"kv_usage": NaN` (Python's json reads it), a string where a
count belongs, 1e400, or 1.7e308, finite but overflowing to inf as soon as a chart scales it.
Every field is checked against the type its record declares: an optional figure that is not
finite, or beyond any real figure's magnitude, is unknown (None); a required one makes the
whole answer unusable, named in a SourceError, so the console shows the server as failing
with the reason instead of a live figure or a crash (`round(nan)` in a gauge). Figures inside
a record's objects (a slow query's chunks and timeline) are checked the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from console.sources.base import SourceError
from engine.config import EngineConfig
from engine.snapshot import Percentiles, RequestView, Snapshot
from engine.store import SlowQueryRecord

# The settings the panes compute with (watermarks, thresholds): numbers, like their defaults.
NUMERIC_SETTINGS = frozenset(f.name for f in dataclasses.fields(EngineConfig)
                             if type(f.default) in (int, float))
# No real figure comes near these (a byte count of a petabyte-scale fleet is 1e15); beyond,
# a chart's sums and scales overflow to inf and then NaN.
MAX_FIGURE = 1e15
MAX_INTEGER = 2**53


def checked_snapshot(data: object, where: str) -> Snapshot:
    """`data` (a decoded /v1/stats body) as a Snapshot; SourceError naming the first field
    the console cannot use."""
    values = _checked(Snapshot, data, where)
    config = values.get("config", {})
    for name in NUMERIC_SETTINGS & config.keys():
        value = config[name]
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not _in_range(value):
            raise _unusable(where, f"config.{name}", value)
    return Snapshot(**values)


def checked_slow_query(data: object, where: str) -> SlowQueryRecord:
    """`data` (one record of /v1/slow_queries, or of a recording) as a SlowQueryRecord;
    SourceError naming the first field the console cannot use."""
    return SlowQueryRecord(**_checked(SlowQueryRecord, data, where))


STORE_STATES = ("ok", "unreachable", "stopped")


def store_note(data: object, where: str) -> str:
    """What a server's /v1/stats says of its store ("" when it is fine or says nothing):
    "store unreachable 12 s, 340 events held"; SourceError if it is not what serve writes."""
    if data is None:
        return ""
    if not isinstance(data, Mapping) or data.get("state") not in STORE_STATES:
        raise _unusable(where, "store", data)
    state = data["state"]
    if state == "ok":
        return ""
    since = _value(float | None, data.get("since_s"), f"{where} store.since_s")
    held = _value(int | None, data.get("held_events", 0), f"{where} store.held_events")
    words = f"store {state}"
    if since is not None:
        words += f" {since:.0f} s"
    if held:
        words += f", {held} events held"
    return words


def _in_range(value: int | float) -> bool:
    if isinstance(value, int):
        return -MAX_INTEGER <= value <= MAX_INTEGER
    return math.isfinite(value) and -MAX_FIGURE <= value <= MAX_FIGURE


@functools.cache
def _hints(kind: type) -> dict[str, Any]:
    """A row type's resolved annotations: resolving them is most of a row's check."""
    return typing.get_type_hints(kind)


def _checked(kind: type, data: object, where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise SourceError(f"{where}: expected an object for {kind.__name__}, got "
                          f"{type(data).__name__}")
    hints = _hints(kind)
    values: dict[str, Any] = {}
    for item in dataclasses.fields(kind):
        if item.name in data:
            values[item.name] = _value(hints[item.name], data[item.name],
                                       f"{where} {item.name}")
        elif item.default is dataclasses.MISSING and \
                item.default_factory is dataclasses.MISSING:
            raise SourceError(f"{where}: {kind.__name__} without its {item.name}")
    return values


def _value(hint: Any, value: object, where: str) -> object:
    optional = _is_optional(hint)
    base = _without_none(hint)
    if value is None:
        if optional:
            return None
        raise _unusable(where, "", value)
    if base is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _unusable(where, "", value)
        if not _in_range(value):
            if optional:
                return None
            raise _unusable(where, "", value)
        return float(value)
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _unusable(where, "", value)
        if not _in_range(value):
            if optional:
                return None
            raise _unusable(where, "", value)
        return value
    if base in (str, bool):
        if not isinstance(value, base):
            raise _unusable(where, "", value)
        return value
    if base is Percentiles:
        return Percentiles(**_checked(Percentiles, value, where))
    if typing.get_origin(base) is tuple:
        if not isinstance(value, list | tuple):
            raise _unusable(where, "", value)
        (element, _) = typing.get_args(base)
        if element is RequestView:
            return tuple(RequestView(**_checked(RequestView, item, where)) for item in value)
        return tuple(_value(element, item, where) for item in value)
    if typing.get_origin(base) is list:
        if not isinstance(value, list | tuple):
            raise _unusable(where, "", value)
        (element,) = typing.get_args(base)
        return [_value(element, item, where) for item in value]
    if typing.get_origin(base) is dict:
        if not isinstance(value, Mapping):
            raise _unusable(where, "", value)
        _check_figures(value, where)
        return dict(value)
    return value


def _check_figures(mapping: Mapping[Any, Any], where: str) -> None:
    """Every number in `mapping` and the objects and lists it holds is a figure the console can
    draw; keys are text. Walked without recursion, so a deep object cannot exhaust the stack."""
    stack: list[tuple[object, str]] = [(mapping, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise _unusable(where, f"{path}key", key)
                stack.append((item, f"{path}{key}."))
        elif isinstance(value, list | tuple):
            stack.extend((item, path) for item in value)
        elif isinstance(value, int | float) and not isinstance(value, bool) \
                and not _in_range(value):
            raise _unusable(where, path.rstrip("."), value)


def _is_optional(hint: Any) -> bool:
    return isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)


def _without_none(hint: Any) -> Any:
    if not isinstance(hint, types.UnionType):
        return hint
    rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return rest[0]


def _unusable(where: str, name: str, value: object) -> SourceError:
    shown = repr(value)[:40]
    return SourceError(f"{where}{' ' + name if name else ''} is {shown}: not a figure the "
                       "console can show; its figures are unknown until it answers numbers")
