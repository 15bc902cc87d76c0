"""Which attention path an engine runs: the one asked, or on CUDA the fastest on a timed step.

`auto` on the CPU is the gather path, whose paged kernels engine.core.backend_choice picks; on
CUDA every path the guards leave is timed on one representative step, as the CPU backends are,
and the choice is cached per machine the same way (keyed by the GPU, torch, flash-attn, the
model's shape and dtype), so a later start of the same model takes it untimed."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.core.backend_choice import (
    cache_path,
    interleaved,
    medians_ms,
    pick,
    read_cached,
    write_cached,
)

log = logging.getLogger(__name__)

# the simpler path wins within the margin: fewer moving parts for the same speed
SIMPLICITY = {"torch": 0, "flex": 1, "flash": 2}
EXPLICIT = tuple(SIMPLICITY)
CACHE_KIND = "attention"


@dataclass(frozen=True)
class AttentionChoice:
    """The path picked, how (measured, cached or forced), and each candidate's median step
    in ms."""

    name: str
    how: str  # measured | cached | forced
    step_ms: dict[str, float]

    def line(self) -> str:
        if not self.step_ms:
            return f"attention {self.name} ({self.how})"
        figures = ", ".join(f"{name} {ms:.2f}" for name, ms in self.step_ms.items())
        return f"attention {self.name} ({self.how}, step ms: {figures})"


def attention_candidates(asked: str, device_type: str, flash_fits: bool) -> tuple[str, ...]:
    """The paths a start may pick from: the one asked, else on CUDA all the guards allow."""
    if asked in EXPLICIT:
        return (asked,)
    if device_type != "cuda":
        return ("torch",)
    return ("torch", "flex", "flash") if flash_fits else ("torch", "flex")


def flash_attn_version() -> str | None:
    try:
        return importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        return None


def attention_cache_key(device_name: str, shapes: Mapping[str, object], dtype: str,
                        found: Sequence[str]) -> str:
    """What a cached choice is keyed by: the device, torch and flash-attn, the model's shape
    (and the probe's), the dtype and the candidates the guards left."""
    text = json.dumps({"device": device_name, "torch": torch.__version__,
                       "flash_attn": flash_attn_version(), "shapes": shapes, "dtype": dtype,
                       "candidates": list(found)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_cached_attention(key: str, found: Sequence[str]) -> AttentionChoice | None:
    data = read_cached(cache_path(key, CACHE_KIND))
    if data is None:
        return None
    name, step_ms = data.get("name"), data.get("step_ms")
    if name not in found or not isinstance(step_ms, dict):
        log.warning("ignoring the cached attention choice %s: %r is no candidate",
                    cache_path(key, CACHE_KIND), name)
        return None
    return AttentionChoice(name, "cached", step_ms)


def store_attention(key: str, choice: AttentionChoice) -> None:
    write_cached(cache_path(key, CACHE_KIND), {"name": choice.name, "step_ms": choice.step_ms})


def choose_attention(found: Sequence[str], time_step: Callable[[str], float],
                     clock: Callable[[], float], key: str | None = None) -> AttentionChoice:
    """Time each candidate's step (seconds, from `time_step`) and keep the simplest of the
    fastest; a single candidate is taken untimed, and a choice cached under `key` unmeasured."""
    if len(found) == 1:
        return AttentionChoice(found[0], "forced", {})
    if key is not None:
        cached = load_cached_attention(key, found)
        if cached is not None:
            return cached
    timings = interleaved(found, time_step, clock=clock)
    choice = AttentionChoice(pick(timings, SIMPLICITY.__getitem__), "measured",
                             medians_ms(timings, str))
    if key is not None:
        store_attention(key, choice)
    return choice
