"""The per-step shortcuts (bus fan-out by kind, shared quiet guard decisions, hot-path
constructors, shared shape counts) keep what the plain code did."""

from __future__ import annotations

import dataclasses

import pytest

from engine.batch import RequestOutput, ScheduledChunk, StepShape
from engine.budget.cost_model import BudgetModel
from engine.budget.peaks import DevicePeaks
from engine.config import EngineConfig
from engine.events import EventBus, FailCause, Failed, StepComplete, TokensGenerated
from engine.harness.driver import OutputTokens, Recorder
from engine.harness.workload import WorkloadRequest
from engine.model.config import preset
from engine.ops.guards import GuardInputs, Guards
from engine.ops.metrics import Metrics


def test_a_subscriber_that_leaves_mid_drain_hears_no_later_event() -> None:
    bus = EventBus()
    heard: list[str] = []
    leave = None

    def once(event: TokensGenerated) -> None:
        heard.append(f"once {event.request_ids[0]}")
        assert leave is not None
        leave()

    leave = bus.subscribe(once)
    bus.subscribe(lambda e: heard.append(f"all {e.request_ids[0]}"))
    for rid in ("a", "b"):
        bus.publish(TokensGenerated(request_ids=(rid,), token_ids=(1,)))
    assert bus.drain() == 2
    assert heard == ["once a", "all a", "all b"]


def test_a_subscriber_to_some_kinds_hears_only_those_in_order_with_the_others() -> None:
    bus = EventBus()
    heard: list[str] = []
    bus.subscribe(lambda e: heard.append(f"all {e.kind}"))
    leave = bus.subscribe(lambda e: heard.append(f"steps {e.kind}"), (StepComplete,))
    bus.subscribe(lambda e: heard.append(f"faults {e.kind}"), (Failed,))
    bus.publish(TokensGenerated(request_ids=("a",), token_ids=(1,)))
    bus.publish(StepComplete(step=1, prefill_tokens=0, decode_seqs=1, duration_s=0.1))
    bus.publish(Failed(request_id="a", reason="x", cause=FailCause.FAULT))
    bus.drain()
    assert heard == ["all tokens", "all step_complete", "steps step_complete", "all failed",
                     "faults failed"]
    heard.clear()
    leave()  # the routes are rebuilt without it
    bus.publish(StepComplete(step=2, prefill_tokens=0, decode_seqs=1, duration_s=0.1))
    bus.drain()
    assert heard == ["all step_complete"]


def test_a_steps_output_tokens_enter_the_rate_window_with_its_step() -> None:
    metrics, bus = Metrics(), EventBus()
    metrics.subscribe_to(bus)
    for step in range(1, 4):
        bus.publish(TokensGenerated(request_ids=("a", "b"), token_ids=(step, step),
                                    ts=float(step)))
        bus.publish(StepComplete(step=step, prefill_tokens=5, decode_seqs=2, duration_s=1.0,
                                 ts=float(step)))
        bus.drain()
    # 3 steps of 7 tokens, 2 of them output, over the 3 s since the first began
    assert metrics.rates(3.0) == (21 / 3, 6 / 3)
    assert metrics.generation_tokens_total == 6 and metrics.itl.count == 4


def _output(new: tuple[int, ...], finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=new, finished=finished,
                         finish_reason="length" if finished else None,
                         state="FINISHED" if finished else "DECODING")


def test_the_recorder_holds_every_token_of_new_token_outputs() -> None:
    recorder = Recorder()
    recorder.expect(WorkloadRequest("r", 0.0, (1, 2, 3), 4), 0.0)
    record = recorder.records["r"]
    recorder.settle(_output((9,)))
    recorder.settle(_output((10,)))
    recorder.settle(_output((), finished=True))  # e.g. failed: no new token
    assert record.token_ids == [9, 10]
    assert (record.state, record.reason) == ("FINISHED", "length")


def test_output_tokens_start_a_resumed_request_from_its_generated_tokens() -> None:
    tokens = OutputTokens({"r": (7, 8)})
    assert tokens.add(_output((9,))) == [7, 8, 9]
    assert tokens.add(_output((10,), finished=True)) == [7, 8, 9, 10]
    assert tokens.add(_output((5,))) == [5]  # ended: forgotten, a new one starts afresh


def test_quiet_evaluations_share_one_decision_and_a_change_still_speaks() -> None:
    guards, config = Guards(), EngineConfig()
    quiet = GuardInputs(now=1.0, config=config, throttle_level=0, bandwidth_util=0.1)
    first, second = guards.evaluate(quiet), guards.evaluate(quiet)
    assert first is second and not first.events and not first.prefill_paused
    throttled = GuardInputs(now=2.0, config=config, throttle_level=2, bandwidth_util=0.96)
    engaged = guards.evaluate(throttled)
    assert [(e.layer, e.engaged) for e in engaged.events] == [("throttle", True)]
    assert "bandwidth 5 s average 96%: throttle level 2" in engaged.events[0].detail
    assert guards.engaged() == ("throttle",)
    released = guards.evaluate(quiet)
    assert [(e.layer, e.detail) for e in released.events] == [("throttle", "released")]


def test_the_hot_path_constructors_make_what_the_dataclass_constructors_make() -> None:
    pairs = [
        (RequestOutput.of("r", (3,), False, None, "DECODING"),
         RequestOutput(request_id="r", new_token_ids=(3,), finished=False,
                       finish_reason=None, state="DECODING")),
        (ScheduledChunk.of("r", 2, 1, (4,), True, True, 0),
         ScheduledChunk("r", 2, 1, (4,), is_decode=True, samples=True, scored_rows=0)),
        (TokensGenerated.of(("r",), (3,), 1.5),
         TokensGenerated(request_ids=("r",), token_ids=(3,), ts=1.5)),
    ]
    for fast, plain in pairs:
        # every field set, in the constructor's order, and still frozen
        assert fast == plain and list(vars(fast)) == list(vars(plain))
        assert hash(fast) == hash(plain) and repr(fast) == repr(plain)
        with pytest.raises(dataclasses.FrozenInstanceError):
            fast.state = "x"  # type: ignore[misc, union-attr]


def test_models_that_count_alike_share_a_shapes_counts_and_others_count_their_own() -> None:
    small = preset("small")
    peaks, faster = DevicePeaks("x", 1e12, 1e11, "test"), DevicePeaks("y", 2e12, 3e11, "test")
    engine_model = BudgetModel(small, bytes_per_element=2, peaks=peaks)
    predictor_model = BudgetModel(small, bytes_per_element=2, peaks=faster)
    wider = BudgetModel(small, bytes_per_element=4, peaks=peaks)

    def fresh() -> StepShape:
        return StepShape(prefill=((64, 32),), decode_contexts=(10, 200))

    shape = fresh()
    predictor_model.predict(shape)  # counts the shape once
    assert engine_model.flops(shape) == engine_model.flops(fresh())
    assert engine_model.bytes_moved(shape) == engine_model.bytes_moved(fresh())
    # fp32 moves more bytes than bf16 over the same shape: not taken from the memo
    assert wider.bytes_moved(shape) > engine_model.bytes_moved(shape)
    assert wider.bytes_moved(shape) == wider.bytes_moved(fresh())
    assert shape == fresh() and hash(shape) == hash(fresh())  # the memo is no field
    counts: list[StepShape] = []

    def count(counted: StepShape) -> float:
        counts.append(counted)
        return 2.5

    assert shape.counted("k", count) == shape.counted("k", count) == 2.5 and len(counts) == 1
