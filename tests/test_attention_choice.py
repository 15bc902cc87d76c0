"""Which attention path a start runs: the one asked, today's gather path for auto on the CPU,
and on CUDA the fastest candidate on a timed step (timings injected here, never real)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import EngineConfig
from engine.core import backend_choice, model_runner
from engine.core.attention_choice import (
    AttentionChoice,
    attention_cache_key,
    attention_candidates,
    choose_attention,
)
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


@pytest.fixture
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(backend_choice, "cache_dir", lambda: tmp_path)
    return tmp_path


def _never(name: str) -> float:
    raise AssertionError("a cached choice is not timed again")


def test_a_measured_choice_is_cached_and_a_later_start_takes_it_untimed(
        _own_cache: Path) -> None:
    step_s = {"torch": 0.030, "flex": 0.010}
    found = ("torch", "flex")
    first = choose_attention(found, step_s.__getitem__, _ticking(step_s, lambda: "torch"),
                             key="k1")
    assert (first.name, first.how) == ("flex", "measured")
    again = choose_attention(found, _never, lambda: 0.0, key="k1")
    assert again == AttentionChoice("flex", "cached", first.step_ms)
    assert again.line() == "attention flex (cached, step ms: torch 30.00, flex 10.00)"
    # another key (another GPU, model or torch) measures afresh
    other = choose_attention(found, {"torch": 0.01, "flex": 0.03}.__getitem__,
                             _ticking(step_s, lambda: "torch"), key="k2")
    assert (other.name, other.how) == ("torch", "measured")


def test_a_damaged_or_foreign_cached_choice_is_measured_again(
        _own_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    step_s = {"torch": 0.010, "flex": 0.030}
    (_own_cache / "attention-bad.json").write_text("{not json")
    (_own_cache / "attention-gone.json").write_text('{"name": "flash", "step_ms": {}}')
    with caplog.at_level(logging.WARNING):
        for key in ("bad", "gone"):
            choice = choose_attention(("torch", "flex"), step_s.__getitem__,
                                      _ticking(step_s, lambda: "torch"), key=key)
            assert choice.how == "measured"
    assert sum("ignoring the cached" in r.getMessage() for r in caplog.records) == 2


def test_the_attention_cache_key_holds_device_torch_shapes_dtype_and_candidates() -> None:
    key = attention_cache_key("NVIDIA H100 80GB HBM3", {"hidden": 64}, "torch.bfloat16",
                              ("torch", "flex"))
    assert key == attention_cache_key("NVIDIA H100 80GB HBM3", {"hidden": 64},
                                      "torch.bfloat16", ("torch", "flex"))
    assert key != attention_cache_key("NVIDIA A100-SXM4-80GB", {"hidden": 64},
                                      "torch.bfloat16", ("torch", "flex"))
    assert key != attention_cache_key("NVIDIA H100 80GB HBM3", {"hidden": 128},
                                      "torch.bfloat16", ("torch", "flex"))
    assert key != attention_cache_key("NVIDIA H100 80GB HBM3", {"hidden": 64},
                                      "torch.float16", ("torch", "flex"))
    assert key != attention_cache_key("NVIDIA H100 80GB HBM3", {"hidden": 64},
                                      "torch.bfloat16", ("torch", "flex", "flash"))


def test_a_runner_caches_its_timed_attention_choice_for_the_next_start(
        _own_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two candidates on the CPU stand in for a GPU's: the first start times both on real
    steps, the second takes the cached path without a probe; another model measures."""
    monkeypatch.setattr(model_runner, "attention_candidates",
                        lambda asked, device_type, flash: ("torch", "flex"))
    config = EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                          kv_cache_bytes=1 << 22, attention_backend="torch")  # no CPU kernels
    first = ModelRunner(config).attention
    assert first.how == "measured" and set(first.step_ms) == {"torch", "flex"}
    monkeypatch.setattr(ModelRunner, "attention_timer", lambda self, config, clock: _never)
    again = ModelRunner(config)
    assert again.attention == AttentionChoice(first.name, "cached", first.step_ms)
    assert again.backend.name == first.name and again.attention_note == first.name
    assert list(_own_cache.glob("attention-*.json"))
    with pytest.raises(AssertionError, match="not timed again"):
        ModelRunner(EngineConfig(model="synthetic:tiny", device="cpu", dtype="bfloat16",
                                 kv_cache_bytes=1 << 22, attention_backend="torch"))
