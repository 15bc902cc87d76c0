import itertools
import json
import math
import random
from pathlib import Path

import pytest

import engine.harness
from engine.errors import EngineError
from engine.harness.trace import (
    SHIPPED_TRACES,
    TraceError,
    TraceRow,
    load_trace,
    sample_trace,
    shipped_trace,
    shipped_trace_summaries,
)
from engine.harness.workload import (
    CPU_LENGTH_SCALE,
    FIRST_PROMPT_TOKEN_ID,
    PROFILES,
    WorkloadError,
    WorkloadRequest,
    build_workload,
    describe,
    load_requests_jsonl,
    prompt_ids,
    steady_traffic,
)

MODEL = {"vocab_size": 512, "max_model_len": 8192}


def build(spec: str, **kwargs) -> list[WorkloadRequest]:
    return build_workload(spec, **{**MODEL, **kwargs})


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def test_long_doc_has_long_prompts_and_short_outputs():
    requests = build("long-doc", length_scale=1.0)
    assert len(requests) == PROFILES["long-doc"].num_requests
    assert 6000 <= mean(len(r.prompt_token_ids) for r in requests) <= 10000
    assert all(len(r.prompt_token_ids) > 10 * r.max_tokens for r in requests)
    assert all(r.ignore_eos and r.tag == "long-doc" for r in requests)


def test_chat_has_short_prompts_long_outputs_and_higher_rate():
    chat = build("chat", length_scale=1.0)
    assert all(r.max_tokens > 2 * len(r.prompt_token_ids) for r in chat)
    assert 600 <= mean(r.max_tokens for r in chat) <= 1000
    chat_rate = describe(chat).rate_per_s
    long_rate = describe(build("long-doc")).rate_per_s
    assert chat_rate is not None and long_rate is not None and chat_rate > 4 * long_rate


def test_mixed_puts_long_docs_in_batch_tenant_and_chats_in_interactive():
    requests = build("mixed", length_scale=1.0)
    batch = [r for r in requests if r.tenant == "batch"]
    interactive = [r for r in requests if r.tenant == "interactive"]
    assert len(batch) + len(interactive) == len(requests)
    assert 1 <= len(batch) < len(interactive)
    assert min(len(r.prompt_token_ids) for r in batch) > 5 * max(
        len(r.prompt_token_ids) for r in interactive)
    # Even a tiny mixed run holds one long document.
    assert {r.tenant for r in build("mixed", num_requests=2)} == {"batch", "interactive"}


def test_cpu_scale_shrinks_lengths_and_ids_avoid_special_tokens():
    full = build("long-doc", length_scale=1.0, seed=3)
    small = build("long-doc", length_scale=CPU_LENGTH_SCALE, seed=3)
    ratio = mean(len(r.prompt_token_ids) for r in small) / mean(
        len(r.prompt_token_ids) for r in full)
    assert ratio == pytest.approx(CPU_LENGTH_SCALE, rel=0.05)
    ids = [t for r in small for t in r.prompt_token_ids]
    assert min(ids) >= FIRST_PROMPT_TOKEN_ID and max(ids) < MODEL["vocab_size"]


def test_max_model_len_caps_prompt_plus_output():
    requests = build("long-doc", length_scale=1.0, max_model_len=1000)
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 1000 for r in requests)
    assert all(r.max_tokens >= 1 for r in requests)


def test_same_seed_same_workload_and_different_seed_differs():
    assert build("mixed", seed=7) == build("mixed", seed=7)
    assert build("mixed", seed=7) != build("mixed", seed=8)
    assert build("conv", seed=7) == build("conv", seed=7)


def test_poisson_rate_and_all_at_once():
    requests = build("chat", num_requests=400, rate=20.0)
    stats = describe(requests)
    assert stats.rate_per_s == pytest.approx(20.0, rel=0.15)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    burst = build("chat", num_requests=10, rate=math.inf)
    assert {r.arrival_s for r in burst} == {0.0}
    assert describe(burst).rate_per_s is None


def test_time_scale_stretches_arrivals():
    base = build("chat", seed=1)
    slow = build("chat", seed=1, time_scale=2.0)
    assert [r.arrival_s * 2 for r in base] == pytest.approx([r.arrival_s for r in slow])


def test_unknown_spec_lists_choices():
    with pytest.raises(WorkloadError, match="long-doc, chat, mixed, multiturn, "
                                            "conversations:PATH, conv, code, trace:PATH"):
        build("chatty")
    with pytest.raises(EngineError, match="rate must be > 0"):
        build("chat", rate=0)


@pytest.mark.parametrize("name, rows", [("conv", 19366), ("code", 8819)])
def test_shipped_traces_load(name, rows):
    trace = load_trace(shipped_trace(name))
    assert len(trace) == rows
    assert trace[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(trace))
    assert 50 * 60 < trace[-1].arrival_s < 60 * 60  # about an hour of traffic
    assert all(r.context_tokens >= 1 and r.generated_tokens >= 1 for r in trace)


def test_trace_window_keeps_pattern_and_rate_rescales_it():
    rows = [TraceRow(t, 100 + t, 10) for t in (0.0, 1.0, 3.0, 7.0, 15.0)]
    window = sample_trace(rows, 3, "window", random.Random(0))
    assert [r.arrival_s for r in window] in ([0, 1, 3], [1, 3, 7], [3, 7, 15])
    strata = sample_trace(rows, 5, "stratified", random.Random(0))
    assert strata == rows
    with pytest.raises(TraceError, match="only 5 rows"):
        sample_trace(rows, 6, "window", random.Random(0))


def test_steady_traffic_repeats_the_sample_at_the_rate_for_the_duration():
    sample = [WorkloadRequest(f"r{i}", t, (5, 6), 4) for i, t in enumerate((0.0, 1.0, 4.0))]
    traffic = steady_traffic(sample, rate=2.0, duration_s=5.0)
    assert len(traffic) == 10
    assert len({w.request_id for w in traffic}) == 10
    assert [w.request_id for w in traffic[:4]] == ["r0", "r1", "r2", "r0-1"]
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(traffic)]
    # the sample's gaps 1 and 3 (mean 2, wrap 2) scaled to a mean of 0.5 s
    assert gaps[:4] == pytest.approx([0.25, 0.75, 0.5, 0.25])
    assert mean(gaps[:3]) == pytest.approx(0.5)
    assert len(steady_traffic(sample, rate=2.0, duration_s=0.0, min_requests=3)) == 3
    at_once = steady_traffic([WorkloadRequest("a", 0.0, (5,), 1)] * 2, rate=4.0, duration_s=1.0)
    assert [w.arrival_s for w in at_once] == pytest.approx([0.0, 0.25, 0.5, 0.75])
    with pytest.raises(WorkloadError):
        steady_traffic(sample, rate=0.0, duration_s=1.0)
    with pytest.raises(WorkloadError):
        steady_traffic([], rate=1.0, duration_s=1.0)


def test_trace_replay_scales_time_and_length(tmp_path: Path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:17:03.0000000,800,80\n"
                    "2023-11-16 18:17:04.0000000,4000,4\n"
                    "2023-11-16 18:17:07.0000000,1,1\n")
    spec = f"trace:{path}"
    plain = build(spec, num_requests=3, length_scale=1.0)
    assert [r.arrival_s for r in plain] == [0.0, 1.0, 4.0]
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in plain] == [(800, 80), (4000, 4),
                                                                          (1, 1)]
    assert all(r.ignore_eos and r.tag == "t" for r in plain)
    scaled = build(spec, num_requests=3, length_scale=0.1, time_scale=0.5, max_model_len=300)
    assert [r.arrival_s for r in scaled] == [0.0, 0.5, 2.0]
    # 80 -> 8, 4000 -> 400 clamped to the model's length, 1 stays at least 1.
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in scaled] == [(80, 8), (299, 1),
                                                                           (1, 1)]
    at_rate = build(spec, num_requests=3, rate=1.0)
    assert [r.arrival_s for r in at_rate] == pytest.approx([0.0, 0.5, 2.0])


def test_shipped_trace_shortcuts():
    conv = build("conv", num_requests=32, sample="stratified")
    assert len(conv) == 32 and all(r.request_id.startswith("conv-") for r in conv)
    code = build("code", num_requests=8)
    assert len(code) == 8 and all(r.tag == "code" for r in code)
    with pytest.raises(TraceError, match="choose one of conv, code"):
        shipped_trace("chat")


def test_shipped_traces_are_package_data_with_their_attribution():
    """The traces and their CC-BY README sit inside the engine package, not beside the repo."""
    package = Path(engine.harness.__file__).parent
    for trace in SHIPPED_TRACES.values():
        assert Path(str(shipped_trace(trace.name))).parent == package / "traces"
    readme = (package / "traces" / "README.md").read_text()
    assert "CC-BY 4.0" in readme and "Splitwise" in readme


def test_shipped_trace_summaries_describe_each_trace():
    summaries = {s.name: s for s in shipped_trace_summaries()}
    assert list(summaries) == ["conv", "code"]
    conv = summaries["conv"]
    assert conv.requests == 19366
    assert conv.duration_s == load_trace(shipped_trace("conv"))[-1].arrival_s
    assert conv.rate_per_s == pytest.approx((conv.requests - 1) / conv.duration_s)
    assert conv.prompt_tokens.p50 <= conv.prompt_tokens.p90 <= conv.prompt_tokens.max
    assert conv.license == "CC-BY 4.0"
    assert conv.to_dict()["output_tokens"]["total"] == sum(
        r.generated_tokens for r in load_trace(shipped_trace("conv")))


@pytest.mark.parametrize("content, problem", [
    ("a,b,c\n1,2,3\n", "missing column"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", ":2: bad row"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no rows"),
])
def test_bad_trace_names_file_and_columns(tmp_path: Path, content, problem):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(TraceError, match=problem) as info:
        load_trace(path)
    assert str(path) in str(info.value)


def test_missing_trace_names_file_and_columns(tmp_path: Path):
    path = tmp_path / "absent.csv"
    with pytest.raises(TraceError, match="TIMESTAMP, ContextTokens, GeneratedTokens") as info:
        load_trace(path)
    assert str(path) in str(info.value)


def write_lines(path: Path, objects: list) -> Path:
    path.write_text("\n".join(o if isinstance(o, str) else json.dumps(o) for o in objects))
    return path


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_jsonl_loads_ids_and_text_sorted_by_arrival(tmp_path: Path):
    path = write_lines(tmp_path / "r.jsonl", [
        {"id": "b", "prompt": "hi", "max_tokens": 4, "arrival_s": 2.5, "tenant": "t1",
         "tag": "x", "priority": 2},
        "",
        {"id": "a", "prompt_token_ids": [5, 6, 7], "max_tokens": 1, "ignore_eos": True},
    ])
    requests = load_requests_jsonl(path, encode)
    assert requests == [
        WorkloadRequest("a", 0.0, (5, 6, 7), 1, ignore_eos=True),
        WorkloadRequest("b", 2.5, (104, 105), 4, tenant="t1", tag="x", priority=2),
    ]
    assert requests[0].sampling_params().ignore_eos


@pytest.mark.parametrize("bad, message", [
    ("{not json", ":2: not valid JSON"),
    ([1, 2], ":2: expected a JSON object"),
    ({"prompt": "x", "max_tokens": 1}, ":2: field 'id'"),
    ({"id": "q", "max_tokens": 1}, ":2: give exactly one of 'prompt'"),
    ({"id": "q", "prompt_token_ids": [1, -1], "max_tokens": 1}, ":2: field 'prompt_token_ids'"),
    ({"id": "q", "prompt": "x", "max_tokens": 0}, ":2: field 'max_tokens'"),
    ({"id": "q", "prompt": "x", "max_tokens": True}, ":2: field 'max_tokens'"),
    ({"id": "q", "prompt": "x", "max_tokens": 1, "arrival_s": -1}, ":2: field 'arrival_s'"),
    ({"id": "q", "prompt": "x", "max_tokens": 1, "tenant": 3}, ":2: field 'tenant'"),
    ({"id": "q", "prompt": "x", "max_tokens": 1, "priority": 1.5}, ":2: field 'priority'"),
    ({"id": "ok", "prompt": "x", "max_tokens": 1}, ":2: field 'id': 'ok' repeats"),
])
def test_jsonl_errors_name_line_and_field(tmp_path: Path, bad, message):
    path = write_lines(tmp_path / "r.jsonl", [{"id": "ok", "prompt": "x", "max_tokens": 1}, bad])
    with pytest.raises(WorkloadError, match=message) as info:
        load_requests_jsonl(path, encode)
    assert str(path) in str(info.value)


def test_jsonl_missing_file(tmp_path: Path):
    with pytest.raises(WorkloadError, match="cannot read request file"):
        load_requests_jsonl(tmp_path / "none.jsonl", encode)


def test_describe_reports_lengths_tenants_and_rate():
    requests = [WorkloadRequest(f"r{i}", float(i), (3,) * (i + 1), 10 * (i + 1),
                                tenant="a" if i < 3 else "b") for i in range(5)]
    stats = describe(requests).to_dict()
    assert stats["requests"] == 5 and stats["tenants"] == {"a": 3, "b": 2}
    assert stats["prompt_tokens"] == {"p50": 3, "p90": 4.6, "p99": 4.96, "max": 5, "mean": 3,
                                      "total": 15}
    assert stats["output_tokens"]["total"] == 150
    assert stats["duration_s"] == 4.0 and stats["rate_per_s"] == 1.0
    json.dumps(stats)
    with pytest.raises(WorkloadError, match="empty"):
        describe([])


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3])
@pytest.mark.parametrize("vocab_size", [4, 5, 32000, 128256, 1 << 20])
def test_prompt_ids_are_the_ids_and_the_rng_state_of_python_choices(seed, vocab_size):
    ours, pythons = random.Random(seed), random.Random(seed)
    ours.gauss(0, 1), pythons.gauss(0, 1)  # a pending gauss value survives too
    for count in (0, 1, 2, 17, 3000):
        assert prompt_ids(ours, vocab_size, count).tolist() == pythons.choices(
            range(FIRST_PROMPT_TOKEN_ID, vocab_size), k=count)
        assert ours.getstate() == pythons.getstate()
    assert ours.gauss(0, 1) == pythons.gauss(0, 1)


@pytest.mark.parametrize("name", ["length_scale", "time_scale"])
@pytest.mark.parametrize("value", [math.inf, math.nan, 0.0, -1.0])
def test_a_scale_must_be_a_finite_number_above_zero(name, value):
    with pytest.raises(WorkloadError, match=f"{name} must be a finite number > 0"):
        build("chat", **{name: value})


@pytest.mark.parametrize("count", [0, -3, 100_001, 10**9])
def test_a_workload_holds_one_to_a_hundred_thousand_requests(count):
    """A billion chat requests were drawn for minutes, filling memory, before any refusal."""
    with pytest.raises(WorkloadError, match=rf"num_requests must be in \[1, 100000\], got "
                                            rf"{count}: a run keeps every request"):
        build("chat", num_requests=count)


def test_prompts_past_the_token_bound_are_refused_before_they_are_drawn():
    """100,000 long documents at full length total 0.8 billion prompt tokens."""
    with pytest.raises(WorkloadError, match=r"the workload's prompts total \d+ tokens, past "
                                            r"the 100000000 one run holds"):
        build("long-doc", num_requests=100_000, length_scale=1.0, max_model_len=131072)
    with pytest.raises(WorkloadError, match="past the 100000000"):
        prompt_ids(random.Random(0), 512, 100_000_001)


@pytest.mark.parametrize("spec", ["chat", "conv", "multiturn"])
def test_a_scale_past_any_integer_is_clipped_to_the_model_not_overflowed(spec):
    requests = build(spec, num_requests=2, length_scale=1e300) if spec != "multiturn" else None
    if requests is not None:
        assert all(len(r.prompt_token_ids) == MODEL["max_model_len"] - 1 and r.max_tokens == 1
                   for r in requests)
    else:  # no turn of a context's length leaves room for its reply
        with pytest.raises(WorkloadError, match=r"no conversation's first turn fits the "
                                                r"model's 8192 tokens .*lower --length-scale"):
            build(spec, num_requests=2, length_scale=1e300)


def test_conversations_none_of_which_fits_are_refused_with_the_fix(tmp_path: Path):
    path = write_lines(tmp_path / "long.jsonl", [
        {"id": "a", "turns": [{"user_token_ids": [5] * 100, "max_tokens": 50}]},
        {"id": "b", "turns": [{"user_token_ids": [5] * 90, "max_tokens": 30}]}])
    with pytest.raises(WorkloadError, match=r"64 tokens \(the shortest needs 120 with its "
                                            r"reply\).*raise --max-model-len"):
        build_workload(f"conversations:{path}", vocab_size=512, max_model_len=64)


@pytest.mark.parametrize("spec, kwargs", [
    ("chat", {"rate": 1e-9}),
    ("chat", {"time_scale": 1e300}),
    ("conv", {"num_requests": 4, "rate": 1e-9}),
    ("multiturn", {"num_requests": 2, "rate": 1e-9}),
])
def test_a_workload_past_the_longest_span_is_refused_at_every_source(spec, kwargs):
    with pytest.raises(WorkloadError, match=r"past the 1e\+06 s \(11.6 days\) a workload may "
                                            r"span: raise --rate, lower --time-scale"):
        build(spec, **kwargs)


def test_a_trace_spanning_decades_is_refused_and_one_within_the_span_replays(tmp_path: Path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,100,10\n"
                    "2093-11-16 18:17:04,100,10\n")
    with pytest.raises(WorkloadError, match=r"would arrive at 2\.209e"):
        build(f"trace:{path}", num_requests=2, length_scale=1.0)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,100,10\n"
                    "2023-11-27 18:17:03,100,10\n")  # 11 days
    assert build(f"trace:{path}", num_requests=2, length_scale=1.0)[-1].arrival_s == 11 * 86400


@pytest.mark.parametrize("rows, problem", [
    ("2023-11-16 18:17:03,100,10\n2023-11-16 18:17:04+00:00,100,10\n",
     "line 3 gives TIMESTAMP a UTC offset and line 2 does not; give every row one, or none"),
    ("2023-11-16 18:17:03+01:00,100,10\n2023-11-16 18:17:04,100,10\n",
     "line 2 gives TIMESTAMP a UTC offset and line 3 does not"),
    ("2023-11-16 18:17:03,-100,10\n", ":2: bad row .*GeneratedTokens >= 1"),
    ("2023-11-16 18:17:03,100,0\n", ":2: bad row .*GeneratedTokens >= 1"),
])
def test_a_trace_row_no_request_could_be_made_of_is_named(tmp_path: Path, rows, problem):
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    with pytest.raises(TraceError, match=problem):
        load_trace(path)


def test_a_zoned_trace_replays_in_time_order(tmp_path: Path):
    path = tmp_path / "zoned.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:05+00:00,1,2\n"
                    "2023-11-16 19:17:03+01:00,3,4\n")
    assert [(r.arrival_s, r.context_tokens) for r in load_trace(path)] == [(0.0, 3), (2.0, 1)]


@pytest.mark.parametrize("field, turn", [("arrival_s", None), ("think_s", 0)])
@pytest.mark.parametrize("value", ["Infinity", "NaN", "1e300", "-1"])
def test_a_conversation_waits_no_longer_than_a_requests_file_may(tmp_path: Path, field, turn,
                                                                  value):
    think = f', "think_s": {value}' if turn is not None else ""
    arrival = f'"arrival_s": {value}, ' if turn is None else ""
    line = f'{{"id": "a", {arrival}"turns": [{{"user_token_ids": [5], "max_tokens": 1{think}}}]}}'
    path = write_lines(tmp_path / "c.jsonl", [line])
    where = field if turn is None else f"turns\\[{turn}\\].{field}"
    with pytest.raises(EngineError, match=f"c.jsonl:1: field '{where}': must be a number of "
                                          r"seconds in \[0, 1e\+06\]"):
        build_workload(f"conversations:{path}", vocab_size=512, max_model_len=64)
