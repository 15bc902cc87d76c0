"""Which attention path an engine runs: the one asked, or on CUDA the fastest on a timed step.

`auto` on the CPU is the gather path, whose paged kernels engine.core.backend_choice picks; on
CUDA every path the guards leave is timed on one representative step, as the CPU backends are."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.core.backend_choice import interleaved, medians_ms, pick

# the simpler path wins within the margin: fewer moving parts for the same speed
SIMPLICITY = {"torch": 0, "flex": 1, "flash": 2}
EXPLICIT = tuple(SIMPLICITY)


@dataclass(frozen=True)
class AttentionChoice:
    """The path picked, how (measured or forced), and each candidate's median step in ms."""

    name: str
    how: str  # measured | forced
    step_ms: dict[str, float]

    def line(self) -> str:
        if self.how != "measured":
            return f"attention {self.name} ({self.how})"
        figures = ", ".join(f"{name} {ms:.2f}" for name, ms in self.step_ms.items())
        return f"attention {self.name} (measured, step ms: {figures})"


def attention_candidates(asked: str, device_type: str, flash_fits: bool) -> tuple[str, ...]:
    """The paths a start may pick from: the one asked, else on CUDA all the guards allow."""
    if asked in EXPLICIT:
        return (asked,)
    if device_type != "cuda":
        return ("torch",)
    return ("torch", "flex", "flash") if flash_fits else ("torch", "flex")


def choose_attention(found: Sequence[str], time_step: Callable[[str], float],
                     clock: Callable[[], float]) -> AttentionChoice:
    """Time each candidate's step (seconds, from `time_step`) and keep the simplest of the
    fastest; a single candidate is taken untimed."""
    if len(found) == 1:
        return AttentionChoice(found[0], "forced", {})
    timings = interleaved(found, time_step, clock=clock)
    return AttentionChoice(pick(timings, SIMPLICITY.__getitem__), "measured",
                           medians_ms(timings, str))
