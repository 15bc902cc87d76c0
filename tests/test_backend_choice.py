"""The CPU backend choice (engine/core/backend_choice.py): the candidates the flags leave, the
pick on injected timings, the rounds it times, and the cache that spares later starts."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from engine.config import ConfigError, EngineConfig
from engine.core import backend_choice
from engine.core.backend_choice import (
    KERNELS,
    PAGED,
    TORCH,
    Backends,
    Candidates,
    Choice,
    DecodePath,
    StepProbe,
    cache_key,
    candidates,
    interleaved,
    load_cached,
    pick,
    store,
)
from engine.core.model_runner import ModelRunner
from engine.kernels.layers import PanelLinear

EAGER_TORCH = DecodePath(TORCH, TORCH, False)
KERNELS_EAGER = DecodePath(PAGED, "kernels", False)
GRAPHS = DecodePath(PAGED, "kernels", True)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Choices cached in a fresh directory (the kernels' library stays where it was built)."""
    monkeypatch.setattr(backend_choice, "cache_dir", lambda: tmp_path)
    return tmp_path


def test_auto_times_every_path_and_the_flags_narrow_them() -> None:
    auto = candidates("auto", None, kernels=True, graphable=True, prefill_fits=True)
    assert len(auto.decode) == 5 and set(auto.prefill) == {TORCH, PAGED}
    assert candidates("torch", None, True, True, True) == Candidates((EAGER_TORCH,), (TORCH,))
    assert candidates("auto", None, False, True, True) == Candidates((EAGER_TORCH,), (TORCH,))
    paged = candidates("paged", None, True, True, True)
    assert paged == Candidates((KERNELS_EAGER, GRAPHS), (PAGED,))
    assert candidates("paged", True, True, True, True) == Candidates((GRAPHS,), (PAGED,))
    assert GRAPHS not in candidates("auto", False, True, True, True).decode
    assert candidates("auto", True, True, True, True).decode == (GRAPHS,)
    # bfloat16 steps cannot replay; a head size the prefill tiles do not fit stays on SDPA
    assert GRAPHS not in candidates("auto", None, True, False, True).decode
    assert candidates("auto", None, True, True, False).prefill == (TORCH,)
    assert candidates("paged", None, True, True, False).prefill == (TORCH,)


def test_the_pick_is_the_simplest_path_within_the_margin_of_the_fastest() -> None:
    rank = lambda path: path.rank  # noqa: E731
    # the kernels win by 2%: within the margin, torch's plain path is kept
    close = {EAGER_TORCH: [10.0, 10.2, 9.9], GRAPHS: [9.8, 9.8, 9.9]}
    assert pick(close, rank) == EAGER_TORCH
    # by 20%: the kernels
    assert pick({EAGER_TORCH: [10.0] * 3, GRAPHS: [8.0] * 3}, rank) == GRAPHS
    # medians, so one stalled round does not decide
    assert pick({EAGER_TORCH: [10.0, 10.1, 95.0], GRAPHS: [12.0, 12.0, 12.1]},
                rank) == EAGER_TORCH
    # equally simple and both within the margin: the faster
    paged_torch = DecodePath(PAGED, TORCH, False)
    assert pick({DecodePath(TORCH, "kernels", False): [9.0] * 3, paged_torch: [8.9] * 3,
                 GRAPHS: [20.0] * 3}, rank) == paged_torch
    assert pick({TORCH: [5.0], PAGED: [4.0]}, lambda a: a == PAGED) == PAGED


def test_candidates_run_interleaved_after_an_untimed_round_within_the_budget() -> None:
    ran: list[str] = []
    ticks = itertools.count()

    def run(candidate: str) -> float:
        ran.append(candidate)
        return {"a": 1.0, "b": 2.0}[candidate]

    # a clock that moves a second per read: the budget is spent after the first round
    times = interleaved(["a", "b"], run, clock=lambda: float(next(ticks)), budget_s=0.5)
    assert ran[:2] == ["a", "b"] and ran[2:] == ["a", "b"] * backend_choice.MIN_ROUNDS
    assert times == {"a": [1.0] * backend_choice.MIN_ROUNDS,
                     "b": [2.0] * backend_choice.MIN_ROUNDS}
    ran.clear()
    still = interleaved(["a", "b"], run, clock=lambda: 0.0)
    assert len(still["a"]) == backend_choice.MAX_ROUNDS


def test_the_cache_key_holds_the_kernels_the_shapes_and_the_candidates() -> None:
    auto = candidates("auto", None, True, True, True)
    key = cache_key("k1", {"hidden": 64}, auto)
    assert key == cache_key("k1", {"hidden": 64}, auto)
    assert key != cache_key("k2", {"hidden": 64}, auto)  # another build, CPU or compiler
    assert key != cache_key("k1", {"hidden": 128}, auto)
    assert key != cache_key("k1", {"hidden": 64}, candidates("auto", False, True, True, True))


def test_a_choice_round_trips_and_a_damaged_one_is_measured_again(_own_cache: Path) -> None:
    choice = Choice(Backends(GRAPHS, TORCH), "measured", {"paged/kernels/graphs": 1.5},
                    {"torch": 3.0, "paged": 3.5}, seconds=1.0)
    store("abc", choice)
    assert load_cached("abc") == Choice(choice.backends, "cached", choice.decode_ms,
                                        choice.prefill_ms)
    assert load_cached("missing") is None
    (_own_cache / "backends-abc.json").write_text("{not json")
    assert load_cached("abc") is None


def _timings(decode: dict[DecodePath, float], prefill: dict[str, float]):
    """StepProbe._time answering from fixed figures, for the step each candidate runs."""
    def fake(self: StepProbe, backends: Backends, steps: list) -> float:
        if steps is self.decode_steps:
            return decode[backends.decode]
        return prefill[backends.prefill_attention]
    return fake


def test_a_runner_takes_what_measures_fastest_says_so_and_a_later_start_reads_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                          kv_cache_bytes=1 << 22)
    slow = {path: 2.0 for path in candidates("auto", None, True, True, True).decode}
    monkeypatch.setattr(StepProbe, "_time", _timings({**slow, EAGER_TORCH: 1.0},
                                                     {TORCH: 1.0, PAGED: 0.5}))
    runner = ModelRunner(config)
    assert runner.choice is not None and runner.choice.how == "measured"
    assert runner.choice.backends == Backends(EAGER_TORCH, PAGED)
    assert not runner.backend.paged_decode and runner.backend.paged_prefill
    assert runner.graphs is None
    assert KERNELS not in runner.swap.built  # linear_rows's copy of the weights dropped
    assert not any(isinstance(m, PanelLinear) for m in runner.model.modules())
    assert runner.attention_note.startswith(
        "CPU backends (measured in ") and "decode torch/torch/eager, prefill paged [decode" \
        in runner.attention_note and "torch/torch/eager 1000.0" in runner.attention_note

    def refuse(*_: object) -> float:
        raise AssertionError("a cached choice is not measured again")

    monkeypatch.setattr(StepProbe, "_time", refuse)
    again = ModelRunner(config)
    assert again.choice is not None and again.choice.how == "cached"
    assert again.choice.backends == runner.choice.backends
    # a flag that narrows the candidates to one forces it, untimed
    forced = ModelRunner(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                      kv_cache_bytes=1 << 22, attention_backend="paged",
                                      cpu_graphs=False))
    assert forced.choice is not None and forced.choice.how == "forced"
    assert forced.backend.paged_decode and forced.graphs is None


def test_graphs_win_when_they_measure_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = {path: 2.0 for path in candidates("auto", None, True, True, True).decode}
    monkeypatch.setattr(StepProbe, "_time", _timings({**slow, GRAPHS: 1.0},
                                                     {TORCH: 1.0, PAGED: 1.01}))
    runner = ModelRunner(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                      kv_cache_bytes=1 << 22))
    assert runner.choice is not None and runner.choice.backends == Backends(GRAPHS, TORCH)
    assert runner.backend.paged_decode and not runner.backend.paged_prefill
    assert runner.graphs is not None


def test_graphs_forced_on_beside_torch_attention_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match="needs attention_backend auto or paged"):
        EngineConfig(device="cpu", attention_backend="torch", cpu_graphs=True).validate()
