"""The decode cadence: a step with many decodes starts new prefills only when they are worth
it, on the scheduler rig's scripted clock (each step takes STEP_S)."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, EngineConfig
from engine.core.cadence import DecodeCadence
from engine.core.request import Request
from tests.test_scheduler import STEP_S, SchedulerRig, prefill_sizes, sim


def test_the_policy_holds_only_steps_with_enough_decodes_and_no_prefill_under_way() -> None:
    cadence = DecodeCadence(min_decodes=4, max_wait_s=0.05)
    assert cadence.holds(4, prefilling=False)
    assert not cadence.holds(3, prefilling=False)
    assert not cadence.holds(8, prefilling=True)
    assert not DecodeCadence(0, 0.05).holds(100, prefilling=False)
    assert not cadence.admits(waiting_tokens=10, room=20, oldest_wait_s=0.049)
    assert cadence.admits(waiting_tokens=20, room=20, oldest_wait_s=0.0)
    assert cadence.admits(waiting_tokens=1, room=20, oldest_wait_s=0.05)
    assert DecodeCadence.of(EngineConfig(cadence_min_decodes=3, cadence_max_wait_ms=40)) == \
        DecodeCadence(3, 0.04)


def running(min_decodes: int, decoders: int = 6, wait_ms: float = 50.0) -> SchedulerRig:
    s = sim(max_num_batched_tokens=64, chunk_tile=4, max_prefill_chunks=8,
            cadence_min_decodes=min_decodes, cadence_max_wait_ms=wait_ms)
    for _ in range(decoders):
        s.add(4, max_tokens=1000)
    s.step()
    return s


def steps_until_prefilled(s: SchedulerRig, request: Request) -> int:
    for step in range(1, 1000):
        if request.id in prefill_sizes(s.step()):
            return step
    raise AssertionError("never prefilled")


def test_a_short_prompt_waits_beside_many_decodes_at_most_the_wait() -> None:
    s = running(min_decodes=4, wait_ms=50.0)
    short = s.add(8)
    # held while it waited 0, 10, ... 40 ms; admitted at the step that finds 50 ms
    assert steps_until_prefilled(s, short) == round(0.05 / STEP_S) + 1


def test_a_step_worth_of_prompts_goes_in_at_once() -> None:
    s = running(min_decodes=4)
    prompts = [s.add(20) for _ in range(3)]  # 60 tokens: more than 64 - 6 decodes
    batch = s.step()
    assert set(prefill_sizes(batch)) == {p.id for p in prompts}
    assert batch.num_tokens <= 64


def test_off_or_few_decodes_or_a_prefill_under_way_never_hold() -> None:
    off = running(min_decodes=0)
    assert steps_until_prefilled(off, off.add(8)) == 1
    few = running(min_decodes=7)  # six decodes
    assert steps_until_prefilled(few, few.add(8)) == 1
    busy = running(min_decodes=4)
    long = busy.add(80)  # a step's worth: it starts at once, and takes two steps
    assert prefill_sizes(busy.step()) == {long.id: 56}
    joining = busy.add(8)  # the next step pays for a prefill already: this one joins it
    assert prefill_sizes(busy.step()) == {long.id: 24, joining.id: 8}


def test_a_wait_longer_than_the_window_admits_at_once() -> None:
    s = running(min_decodes=4, wait_ms=50.0)
    short = s.add(8)
    s.now += 3600.0  # the engine was paused an hour: the clock jumps past every window
    assert steps_until_prefilled(s, short) == 1


def test_the_policy_is_live_tunable_and_refuses_bad_values() -> None:
    s = running(min_decodes=4, wait_ms=10_000.0)
    held = s.add(8)
    s.step()
    assert held.id not in prefill_sizes(s.step())
    s.set_config(cadence_min_decodes=0)
    assert held.id in prefill_sizes(s.step())
    for name, value in (("cadence_min_decodes", -1), ("cadence_max_wait_ms", -5.0),
                        ("cadence_max_wait_ms", float("inf"))):
        with pytest.raises(ConfigError) as error:
            EngineConfig().replace(**{name: value})
        assert error.value.field == name
