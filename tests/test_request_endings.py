"""One way to end a request: every finish path (stop, length, abort, a faulty token, a preempted
request aborted, a rejection, a failure between steps, an engine restart) goes through
`Scheduler.end` once, publishes one end, and gives the request's KV blocks back once."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from engine import Engine
from engine.batch import ModelRunnerOutput, RequestOutput, StepTiming
from engine.config import EngineConfig, SamplingParams
from engine.core.request import Ending, Request, RequestState
from engine.core.scheduler import Scheduler
from engine.events import CacheEvict, Event, Failed, Finished, Rejected
from tests.test_scheduler import STEP_S, TOKEN, SchedulerRig, sim

ROOT = Path(__file__).resolve().parents[1]
ENDS = (Finished, Failed, Rejected)


class EndSpy:
    """Counts, per request, the `end` calls that ended it and the block releases it met."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.ends: Counter[str] = Counter()
        self.releases: Counter[str] = Counter()
        end, blocks = scheduler.end, scheduler.blocks
        release = blocks.release

        def spied_end(ending: Ending) -> RequestOutput | None:
            output = end(ending)
            if output is not None:
                self.ends[ending.request.id] += 1
            return output

        def spied_release(request: Request) -> int:
            self.releases[request.id] += 1
            return release(request)

        scheduler.end = spied_end  # type: ignore[method-assign]
        blocks.release = spied_release  # type: ignore[method-assign]


def ends_published(events: list[Event]) -> Counter[str]:
    return Counter(e.request_id for e in events if isinstance(e, ENDS))


def test_every_finish_path_goes_through_one_end_and_frees_blocks_once() -> None:
    s: SchedulerRig = sim(num_blocks=8, max_num_batched_tokens=64, chunk_tile=4,
                          cache_high_watermark=0.99, cache_low_watermark=0.9)
    spy = EndSpy(s.scheduler)
    stop = s.add(4, max_tokens=20)
    stop.params = SamplingParams(max_tokens=20, stop_token_ids=(TOKEN,))
    length = s.add(4, max_tokens=2)
    fault = s.add(4, max_tokens=20)
    s.step()  # every prefill runs and samples its first token
    assert stop.reason == "stop" and length.state is RequestState.DECODING
    # a faulty token fails its request alone
    batch = s.scheduler.schedule()
    s.now += STEP_S
    s.scheduler.update(batch, ModelRunnerOutput(
        token_ids={c.request_id: TOKEN for c in batch.sampling if c.request_id != fault.id},
        errors={fault.id: "the sampler broke"}), StepTiming(s.now, STEP_S, 1e-3, s.host))
    assert fault.state is RequestState.FAILED and length.reason == "length"
    # two long decodes outgrow the pool: the later one is preempted, then aborted
    first, later = s.add(8, max_tokens=20), s.add(8, max_tokens=20)  # 7 blocks each, of 8
    for _ in range(20):
        s.step()
        if later.num_preemptions:
            break
    assert later.state is RequestState.PREEMPTED and not later.block_table
    s.finish(later, "aborted")
    s.finish(first, "aborted")  # aborted mid-decode, holding its blocks
    assert s.scheduler.end(Ending(first, RequestState.FINISHED, "aborted")) is None
    s.run()

    ended = [stop, length, fault, first, later]
    assert all(r.state.is_final for r in ended)
    assert [r.reason for r in ended] == ["stop", "length", "the sampler broke", "aborted",
                                         "aborted"]
    assert spy.ends == Counter(r.id for r in ended)
    assert ends_published(s.events) == spy.ends
    assert Counter(e.request_id for e in s.of(CacheEvict)) == spy.ends
    # blocks go back once at the end, and once more at each preemption before it
    assert spy.releases == Counter({r.id: 1 + r.num_preemptions for r in ended})
    s.blocks.check_consistent([])
    assert s.blocks.num_used == 0


def test_the_engine_ends_requests_between_steps_through_the_scheduler() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 kv_cache_bytes=1 << 20, max_num_batched_tokens=32,
                                 chunk_tile=8))
    events: list[Event] = []
    engine.bus.subscribe(events.append)
    spy = EndSpy(engine.scheduler)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    rejected = engine.add_request([3] * 100_000, params)
    aborted, failed, crashed, resumed = (engine.add_request([3, 4, 5, 6], params)
                                         for _ in range(4))
    done = {o.request_id: o.state for o in engine.step() if o.finished}
    assert engine.abort(aborted) and engine.fail(failed, "its grammar broke")
    assert not engine.abort(aborted)  # ended already: nothing changes
    _, owed = engine.restart({crashed: "the engine failed twice in its step"})
    engine.bus.drain()
    done |= ({o.request_id: o.state for o in owed if o.finished}
             | {o.request_id: o.state for o in engine.step() if o.finished})
    assert done == {rejected: "REJECTED", aborted: "FINISHED", failed: "FAILED",
                    crashed: "FAILED"}
    assert spy.ends == Counter(list(done)) and ends_published(events) == spy.ends
    assert resumed not in spy.ends  # a restart leaves the rest to be resumed afresh
    assert engine.blocks.num_used == 0


def test_only_the_scheduler_s_end_sets_a_final_state() -> None:
    """A request reaches FINISHED, FAILED or REJECTED, and gets its finish time, in one place:
    every `set_state` elsewhere names a live state, and no other function sets finish_time.
    The store's rows (state names as text) and calibration's probes are not requests the
    engine runs."""
    finals = {"FINISHED", "FAILED", "REJECTED"}
    setters = set()
    for path in sorted((ROOT / "engine").rglob("*.py")):
        if {"harness", "calibration", "store"} & set(path.relative_to(ROOT).parts):
            continue
        for func in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(func, ast.FunctionDef):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr == "set_state":
                    state = node.args[0]
                    live = (isinstance(state, ast.Attribute) and isinstance(state.value, ast.Name)
                            and state.value.id == "RequestState" and state.attr not in finals)
                    if not live:
                        setters.add(f"{path.relative_to(ROOT)}:{func.name}")
                elif isinstance(node, ast.Assign) and any(
                        isinstance(t, ast.Attribute) and t.attr == "finish_time"
                        for t in node.targets):
                    setters.add(f"{path.relative_to(ROOT)}:{func.name}")
    assert setters == {"engine/core/scheduler.py:end"}
