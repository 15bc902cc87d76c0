"""The engine's settings as the panes read them: from the snapshot, else EngineConfig's default.

Widgets never re-type a default (0.85, 1.5, ...): a snapshot from an older server, or a record
stored before a setting existed, falls back to the one place the engine defines it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engine.config import EngineConfig

DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(EngineConfig)
                            if f.default is not dataclasses.MISSING}


def setting(config: Mapping[str, Any], name: str) -> float:
    """The numeric setting `name` from `config`, else EngineConfig's default for it."""
    return float(config.get(name, DEFAULTS[name]))
