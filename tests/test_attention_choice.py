"""Which attention path a start runs: the one asked, today's gather path for auto on the CPU,
and on CUDA the fastest candidate on a timed step (timings injected here, never real)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine import EngineConfig
from engine.core.attention_choice import attention_candidates, choose_attention
from engine.core.model_runner import ModelRunner


def _ticking(step_s: dict[str, float], current: Callable[[], str]) -> Callable[[], float]:
    """A clock that advances, on each read, by the step time of the path `current` names:
    a step's two reads are that time apart."""
    now = [0.0]

    def clock() -> float:
        now[0] += step_s[current()]
        return now[0]

    return clock


def test_candidates_follow_the_flag_and_the_device() -> None:
    assert attention_candidates("auto", "cpu", False) == ("torch",)
    assert attention_candidates("paged", "cpu", False) == ("torch",)
    assert attention_candidates("flex", "cpu", False) == ("flex",)
    assert attention_candidates("auto", "cuda", False) == ("torch", "flex")
    assert attention_candidates("auto", "cuda", True) == ("torch", "flex", "flash")
    assert attention_candidates("torch", "cuda", True) == ("torch",)


def test_the_fastest_path_is_chosen_and_its_figures_logged() -> None:
    step_s = {"torch": 0.030, "flex": 0.010, "flash": 0.012}
    calls: list[str] = []

    def time_step(name: str) -> float:
        calls.append(name)
        return step_s[name]

    choice = choose_attention(("torch", "flex", "flash"), time_step, _ticking(step_s,
                                                                             lambda: "torch"))
    assert choice.name == "flex" and choice.how == "measured"
    assert choice.step_ms == {"torch": 30.0, "flex": 10.0, "flash": 12.0}
    assert choice.line() == "attention flex (measured, step ms: torch 30.00, flex 10.00, " \
                            "flash 12.00)"
    assert set(calls) == {"torch", "flex", "flash"}


def test_a_simpler_path_within_the_margin_wins() -> None:
    step_s = {"torch": 0.0101, "flex": 0.0100}
    choice = choose_attention(("torch", "flex"), step_s.__getitem__,
                              _ticking(step_s, lambda: "torch"))
    assert choice.name == "torch"


def test_one_candidate_is_taken_untimed() -> None:
    def never(name: str) -> float:
        raise AssertionError("a single candidate needs no timing")

    choice = choose_attention(("flex",), never, lambda: 0.0)
    assert (choice.name, choice.how, choice.line()) == ("flex", "forced", "attention flex (forced)")


@pytest.mark.parametrize("asked", ["auto", "torch", "flex"])
def test_a_cpu_start_keeps_the_path_it_ran(asked: str) -> None:
    runner = ModelRunner(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                      kv_cache_bytes=1 << 22, attention_backend=asked,
                                      cpu_graphs=False))
    want = "flex" if asked == "flex" else "torch"
    assert runner.attention.how == "forced" and runner.backend.name == want


def test_the_step_timer_runs_each_path_and_the_faster_is_picked() -> None:
    """The start-up timer runs a real mixed step on each path's own pool; the injected clock
    makes flex the faster, and the choice follows it."""
    config = EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                          kv_cache_bytes=1 << 22, attention_backend="torch")
    runner = ModelRunner(config)
    step_s = {"torch": 0.4, "flex": 0.1}
    clock = _ticking(step_s, lambda: runner.backend.name)
    seen: list[str] = []
    timer = runner.attention_timer(config, clock)

    def time_step(name: str) -> float:
        seen.append(name)
        return timer(name)

    choice = choose_attention(("torch", "flex"), time_step, clock)
    assert choice.name == "flex"
    assert choice.step_ms == {"torch": 400.0, "flex": 100.0}
    assert set(seen) == {"torch", "flex"}
    assert not runner.requests.held  # the probe's requests were lent, and given back
