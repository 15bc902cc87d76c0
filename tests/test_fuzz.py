"""Fuzzing the front doors of a real server: 1,500 random and malformed /v1/completions bodies
(poison sampling values among them) and 500 live-configuration updates. The engine keeps
serving, nothing answers 5xx, and every request that got 200 completed with its tokens.
benchmarks/fuzz_server.py sends the same bodies, 10,000 of them, to `tokenflow serve`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig
from engine.serve.app import create_app
from engine.serve.loop import EngineLoop
from engine.serve.thread import ServerThread
from tests.test_server_edge import POISON

TOKEN = "fuzz-admin-token"
MAX_MODEL_LEN = 24  # every accepted request is short, so 1,500 of them run in seconds
COMPLETIONS = 1500
CONFIGS = 500
FUZZ = {"deadline": None, "database": None, "derandomize": True, "phases": [Phase.generate],
        "suppress_health_check": list(HealthCheck)}
REFUSED = {400, 404, 413, 415, 422, 429}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=8)
small_ints = st.integers(-3, 12)
huge_ints = st.integers(-(2**1400), 2**1400)  # past float's range: 1e400 written as an int
lone_surrogates = st.text(max_size=8).map(lambda text: text + "\ud800")
completion_fields = {
    "prompt": st.text(max_size=30) | st.lists(st.integers(-3, 330), max_size=30)
    | st.lists(st.lists(st.integers(0, 319), max_size=5), max_size=2) | lone_surrogates
    | json_values,
    "max_tokens": small_ints | st.integers(-2**64, 2**64) | json_values,
    "temperature": st.floats(-1, 3) | st.floats() | huge_ints | json_values,
    "top_p": st.floats(-0.5, 1.5) | st.floats(0, 1e-40) | st.floats() | huge_ints | json_values,
    "top_k": small_ints | st.integers(-2**70, 2**70) | json_values,
    "seed": st.integers(-2**70, 2**70) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "ignore_eos": st.booleans() | json_values,
    "stop_token_ids": st.lists(st.integers(-5, 400) | st.integers(-2**70, 2**70), max_size=3)
    | json_values,
    "model": st.sampled_from(["synthetic:tiny", "gpt-4", ""]) | lone_surrogates | json_values,
    "n": st.integers(0, 3) | json_values,
    "echo": st.booleans(),
}
well_formed = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=12) | st.lists(st.integers(0, 319), min_size=1,
                                                           max_size=20)},
    optional={"max_tokens": st.integers(1, 8), "temperature": st.floats(0, 2),
              "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 50),
              "seed": st.integers(0, 2**31), "stream": st.booleans(),
              "ignore_eos": st.booleans(), "stop_token_ids": st.lists(st.integers(0, 319),
                                                                       max_size=2)})
bodies = st.one_of(
    well_formed.map(json.dumps),
    st.fixed_dictionaries({}, optional=completion_fields).map(json.dumps),
    st.dictionaries(st.text(max_size=10), json_values, max_size=5).map(json.dumps),
    json_values.map(json.dumps),
    st.integers(1, 200_000).map(lambda depth: "[" * depth + "]" * depth),
).map(str.encode) | st.binary(max_size=80) | st.sampled_from([body for body, _ in POISON])

live_names = sorted(EngineConfig().live_values())
config_changes = st.dictionaries(
    st.sampled_from([*live_names, "model", "block_size", "no_such_field"]) | st.text(max_size=8),
    st.integers(-10, 5000) | st.floats(-2, 2) | st.floats() | st.booleans()
    | st.sampled_from(["512", "0.9", "yes", "off", "-1", ""]) | json_values,
    max_size=4)
config_bodies = config_changes.map(json.dumps).map(str.encode) | st.binary(max_size=40)


@dataclasses.dataclass
class Server:
    client: httpx.Client
    loop: EngineLoop
    accepted: int = 0
    sent: int = 0


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 kv_cache_bytes=1 << 20, max_model_len=MAX_MODEL_LEN))
    loop = EngineLoop(engine).start()
    app = create_app(loop, admin_token=TOKEN)
    thread = ServerThread(app)
    with thread, httpx.Client(base_url=thread.url, timeout=60) as client:
        yield Server(client, loop)
    loop.stop()


def check_completion(response: httpx.Response, body: bytes,
                     tokens: Callable[[str, bool], list[int]]) -> bool:
    """True when the request was accepted (and then completed with its tokens). `tokens`: a
    text prompt's ids as serve reads it (with its BOS unless add_special_tokens is false)."""
    assert response.status_code == 200 or response.status_code in REFUSED, response.text
    if response.status_code != 200:
        assert "error" in response.json()
        return False
    request = json.loads(body)
    limit = request.get("max_tokens") or 16
    if request.get("echo") is True:  # an echoed prompt's ids lead its choice's token ids
        prompt = request["prompt"]
        prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], list | str) \
            else [prompt]
        limit += sum(len(tokens(p, request.get("add_special_tokens") is not False))
                     if isinstance(p, str) else len(p) for p in prompts)
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks
        token_ids = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
        reasons = [choice["finish_reason"] for c in chunks for choice in c["choices"]]
        assert reasons[-1] in ("stop", "length")
    else:
        choice = response.json()["choices"][0]
        token_ids = choice["token_ids"]
        assert choice["finish_reason"] in ("stop", "length")
    assert 1 <= len(token_ids) <= limit
    return True


@pytest.mark.slow  # 2,000 bodies
@pytest.mark.soak
def test_fuzz_completions_then_live_config(server: Server) -> None:
    @settings(max_examples=COMPLETIONS, **FUZZ)
    @given(body=bodies)
    def completions(body: bytes) -> None:
        response = server.client.post("/v1/completions", content=body,
                                      headers={"content-type": "application/json"})
        server.sent += 1
        server.accepted += check_completion(response, body, lambda text, special: (
            server.loop.engine.prompt_token_ids(text, add_special_tokens=special)))

    @settings(max_examples=CONFIGS, **FUZZ)
    @given(body=config_bodies)
    def live_config(body: bytes) -> None:
        response = server.client.patch("/v1/admin/config", content=body,
                                       headers={"authorization": f"Bearer {TOKEN}",
                                                "content-type": "application/json"})
        server.sent += 1
        assert response.status_code in (200, 400, 422), response.text

    completions()
    assert server.accepted > 200  # the fuzz reached the engine, not only the parser
    baseline = EngineConfig().live_values()
    live_config()
    assert server.sent >= COMPLETIONS + CONFIGS
    restored = server.client.patch("/v1/admin/config", json=baseline,
                                   headers={"authorization": f"Bearer {TOKEN}"})
    assert restored.status_code == 200, restored.text
    final = server.client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4,
                                                        "ignore_eos": True})
    assert final.status_code == 200, final.text
    assert len(final.json()["choices"][0]["token_ids"]) == 4
    assert server.loop.error is None
    assert server.client.get("/health").json() == {"status": "ok"}
