"""Slow-query verdicts in words: the largest part of what the user felt (queue wait, prefill,
a decode stall) with its cause first, ratios against each chunk's own prediction, and the
budget_score's reading second. Three stored slow queries, one of each kind, are read back
through the store and `slow-queries show`."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import pytest

from console.cli.main import main
from engine.events import EventBus, SlowQuery
from engine.ops.timeline import Cause, ChunkView, GapStats, Preemption, QueueContext, Timeline
from engine.store import StoreWriter, list_slow_queries, open_database


def chunk(index: int, tokens: int, duration_s: float, predicted_s: float, decodes: int = 0,
          recomputed: bool = False) -> ChunkView:
    return ChunkView(index=index, start=index * tokens, tokens=tokens, at_s=0.0,
                     duration_s=duration_s, predicted_s=predicted_s, planned_s=predicted_s,
                     step=index, decodes=decodes, other_prefill_tokens=0, mode="NORMAL",
                     throttle_level=0, recomputed=recomputed)


BASE = Timeline(
    admitted_s=0.0, queue_wait_s=0.0, prefill_s=2.31, budgeted_s=0.83, overrun_s=1.48,
    first_token_s=2.31, e2e_s=3.0, outcome="FINISHED: length",
    prefill_parts={"chunks": 1.1, "queued": 1.21},
    e2e_parts={"queue_wait": 0.0, "prefill": 2.31, "decode": 0.69, "tail": 0.0},
    overrun_by_cause={Cause.SLOW_CHUNKS.value: 1.48},
    cause=Cause.SLOW_CHUNKS, cause_share=1.0, queued_behind=0, throttle_level_max=0,
    chunk_throttle_level=0, chunk_ratio=2.8,
    chunks=(chunk(0, 256, 0.40, 0.38, decodes=12), chunk(1, 2, 0.70, 0.50, decodes=136)),
    preemptions=(), decode_gaps=GapStats(count=40, p50_s=0.02, p99_s=0.05, max_s=0.06,
                                         worst_step=90))

# the user waited 21.4 s to be admitted while 52 others were prefilled: the queue wait is
# what they felt, and its cause is the arrival rate
QUEUE_WAIT = replace(BASE, admitted_s=21.4, queue_wait_s=21.4, first_token_s=23.71,
                     e2e_s=43.8,
                     e2e_parts={"queue_wait": 21.4, "prefill": 2.31, "decode": 20.09,
                                "tail": 0.0},
                     queue_wait_parts={Cause.QUEUED.value: 21.0,
                                       Cause.HOST_OVERHEAD.value: 0.4},
                     waited_behind=52, threshold=1.5,
                     queue=QueueContext(arrivals_per_s=38.0, finishes_per_s=2.9,
                                        queued_at_arrival=97, window_s=21.4))
# admitted at once; its prefill overran because a 2-token chunk rode beside 136 decodes
HEAVY_DECODE = BASE
# preempted twice to free KV blocks: it waited to be readmitted and recomputed 512 tokens
PREEMPTED = replace(
    BASE, prefill_s=4.2, overrun_s=3.1, overrun_by_cause={Cause.PREEMPTION.value: 3.1},
    cause=Cause.PREEMPTION,
    chunks=(chunk(0, 256, 0.3, 0.3, recomputed=True), chunk(1, 256, 0.3, 0.3, recomputed=True),
            chunk(2, 256, 0.3, 0.3), chunk(3, 256, 0.3, 0.3)),
    preemptions=(Preemption(0.7, 2.0), Preemption(2.4, 3.3)))


def test_a_queue_wait_leads_with_arrivals_against_finishes_and_budget_score_comes_second(
        ) -> None:
    felt, budget = QUEUE_WAIT.verdict().split("\n")
    assert QUEUE_WAIT.felt() == ("queue wait", 21.4)
    assert felt == ("waited 21.4 s in the queue: arrivals outran finishes, 38.0 arrivals/s "
                    "against 2.9 finishes/s, 97 queued when it arrived")
    assert budget.startswith("budget_score 2.78 (over its threshold 1.5): prefill 2.31 s, "
                             "1.48 s over its 830.0 ms plan: its 2-token chunk")
    pressure = replace(QUEUE_WAIT, queue_wait_parts={Cause.CACHE_PRESSURE.value: 20.0})
    assert pressure.verdict().startswith(
        "waited 21.4 s in the queue behind 52 requests: the KV cache stayed above its high "
        "watermark; arrivals outran finishes, 38.0 arrivals/s against 2.9 finishes/s")


def test_a_queue_wait_in_a_pause_or_on_a_busy_host_names_it() -> None:
    paused = replace(QUEUE_WAIT, queue_wait_parts={Cause.PAUSED.value: 19.9,
                                                   Cause.QUEUED.value: 1.5})
    assert paused.verdict().startswith(
        "waited 21.4 s in the queue: the operator paused the engine for 19.9 s of it; ")
    keeping_up = QueueContext(arrivals_per_s=2.0, finishes_per_s=2.0, queued_at_arrival=3,
                              window_s=21.4)
    busy = replace(QUEUE_WAIT, queue=keeping_up, host_cpus=1.8,
                   queue_wait_parts={Cause.HOST_BUSY.value: 15.0, Cause.QUEUED.value: 6.4})
    assert busy.verdict().startswith(
        "waited 21.4 s in the queue: other processes took the CPU for 15.0 s of it (1.8 CPUs "
        "of their work); the 3 queued when it arrived drained at 2.0 finishes/s against 2.0 "
        "arrivals/s")
    on_the_gpu = replace(busy, host_cpus=0.0, host_gpu=0.4)
    assert on_the_gpu.verdict().startswith(
        "waited 21.4 s in the queue: other processes took the GPU for 15.0 s of it (40% of "
        "the GPU's SM time); ")
    both = replace(busy, host_gpu=0.4)
    assert both.verdict().startswith(
        "waited 21.4 s in the queue: other processes took the CPU and GPU for 15.0 s of it "
        "(1.8 CPUs and 40% of the GPU's SM time); ")


def test_a_prefill_beside_heavy_decode_says_what_shared_its_step_against_its_own_prediction(
        ) -> None:
    verdict = HEAVY_DECODE.verdict()
    assert HEAVY_DECODE.felt() == ("prefill", 2.31)
    # 0.70 s against its own 0.50 s: 1.4×, not the plan's 2.8×
    assert verdict == ("prefill took 2.31 s: its 2-token chunk shared a step with 136 decodes "
                       "(1.4× its own prediction) (+1.48 s, 100% of the overrun)\n"
                       "budget_score 2.78: prefill 2.31 s, 1.48 s over its 830.0 ms plan")
    light = replace(HEAVY_DECODE, chunks=(chunk(0, 256, 0.7, 0.5, decodes=8),))
    assert "its 256-token chunk took 1.4× its own prediction" in light.verdict()


def test_a_preemption_says_how_often_and_what_was_recomputed() -> None:
    assert PREEMPTED.verdict().startswith(
        "prefill took 4.20 s: preempted 2× to free KV blocks: 3.10 s waiting to be readmitted "
        "and recomputing 512 tokens (100% of the overrun)\nbudget_score 5.06")


def test_a_decode_stall_that_outlasts_the_rest_leads() -> None:
    stalled = replace(HEAVY_DECODE, decode_gaps=GapStats(count=40, p50_s=0.02, p99_s=2.0,
                                                         max_s=5.0, worst_step=77))
    stalled = replace(stalled, stall_cause="the operator paused the engine")
    assert stalled.verdict() == (
        "stalled 5.00 s between two tokens at step 77 (usually 20.0 ms): the operator paused "
        "the engine\nbudget_score 2.78: prefill 2.31 s, 1.48 s over its 830.0 ms plan: its "
        "2-token chunk shared a step with 136 decodes (1.4× its own prediction) (+1.48 s, 100% "
        "of the overrun)")


@pytest.mark.parametrize("timeline", [QUEUE_WAIT, HEAVY_DECODE, PREEMPTED])
def test_each_verdict_is_stored_and_shown(timeline: Timeline, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    database = open_database(tmp_path / "store.db")
    bus = EventBus()
    writer = StoreWriter(database, bus)
    bus.publish(SlowQuery(
        request_id="r1", tenant="default", budget_score=timeline.prefill_s / timeline.budgeted_s,
        prompt_tokens=512, prefill_s=timeline.prefill_s, budgeted_s=timeline.budgeted_s,
        chunks=tuple(asdict(c) for c in timeline.chunks), config={}, tag=None,
        timeline={k: v for k, v in timeline.to_dict().items() if k != "chunks"},
        cause=timeline.cause.value, cause_share=timeline.cause_share,
        verdict=timeline.verdict(), cached_tokens=0))
    bus.drain()
    assert writer.close()
    with database.session() as session:
        (record,) = list_slow_queries(session)
    database.close()
    assert record.verdict == timeline.verdict()
    assert main(["slow-queries", "show", "1", "--db", str(tmp_path / "store.db")]) == 0
    out = capsys.readouterr().out
    first, second = timeline.verdict().split("\n")
    assert f"verdict: {first}  [cause" in out and f"\n         {second}\n" in out
    if timeline is QUEUE_WAIT:  # the timeline says what the verdict says, in figures
        assert "queue wait 21.4 s: queued 21.0 s, host overhead 400.0 ms; 52 other requests" \
            in out
