"""Each request costs at most its share, refused before anything is built for it, and vLLM's
extensions are applied as vLLM defines them or refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine import Engine, EngineConfig
from engine.serve.app import create_app
from engine.serve.loop import EngineLoop
from engine.serve.shares import RequestShare
from engine.serve.thread import ServerThread

MODEL = "synthetic:tiny"
GREEDY = {"temperature": 0, "ignore_eos": True}
TEMPLATE = ("{{ greeting }}{% for d in documents or [] %}[{{ d['title'] }}]{% endfor %}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% if boom %}{{ 1 / 0 }}{% endif %}")


@pytest.fixture(scope="module")
def loop() -> Iterator[EngineLoop]:
    engine = Engine(EngineConfig(model=MODEL, device="cpu", dtype="float32",
                                 max_num_batched_tokens=64))
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def http(loop: EngineLoop, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    app = create_app(loop, admin_token=None, max_queue=64, chat_template=template)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def refused(http: httpx.Client, body: dict[str, object], param: str,
            route: str = "/v1/completions") -> str:
    response = http.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    return error["message"]


def test_an_enormous_n_is_refused_by_name_before_any_choice_is_built(
        http: httpx.Client) -> None:
    body = b'{"prompt":"hello","n":9223372036854775808}'
    response = http.post("/v1/completions", content=body,
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "n" and f"at most {RequestShare().max_n}" in error["message"]


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"prompt": ["a"] * 10, "n": 100}, "prompt", "1000 choices"),
    ({"prompt": "a", "stop": ["x"] * 65}, "stop", "65 strings"),
    ({"prompt": "a", "stop": ["x" * 3000, "y" * 3000]}, "stop", "4096 characters"),
    ({"prompt": "a", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1025"),
    ({"prompt": "a", "logit_bias": {"07": 1}}, "logit_bias", "'07'"),
    ({"prompt": "a", "logit_bias": {"\u0667": 1}}, "logit_bias", "plain ASCII digits"),
    ({"prompt": "a", "logit_bias": {"+7": 1}}, "logit_bias", "'+7'"),
    ({"prompt": "a", "logit_bias": {"7": 101}}, "logit_bias", "[-100, 100]"),
    ({"prompt": "a" * 2000, "echo": True, "logprobs": 20, "n": 50, "max_tokens": 1},
     "logprobs", "entries"),
    ({"prompt": "a", "logprobs": 20, "n": 128, "max_tokens": 100}, "logprobs", "entries"),
])
def test_each_share_is_refused_with_the_limit_named(http: httpx.Client, body: dict[str, object],
                                                    param: str, says: str) -> None:
    assert says in refused(http, body, param)


def test_a_request_within_its_share_is_served(http: httpx.Client) -> None:
    body = {"prompt": "a", "max_tokens": 2, "n": 4, "stop": ["zz"] * 64, "logprobs": 5,
            "logit_bias": {"0": 1, "10": -1}, **GREEDY}
    answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 4


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(http: httpx.Client,
                                                              loop: EngineLoop) -> None:
    prompt = [40 + i for i in range(30)]
    body = {"prompt": prompt, "max_tokens": 1, "echo": True, "truncate_prompt_tokens": 8,
            **GREEDY}
    answer = http.post("/v1/completions", json=body).json()
    assert answer["usage"]["prompt_tokens"] == 8
    assert answer["choices"][0]["token_ids"] == prompt[-8:] or answer["choices"][0]["text"]
    whole = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == 30  # -1: the context length, which it fits
    over = loop.engine.max_model_len + 1
    assert "greater than the context" in refused(
        http, {**body, "truncate_prompt_tokens": over}, "truncate_prompt_tokens")
    refused(http, {**body, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens")
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "abcdefghij"}], "max_tokens": 1,
        "truncate_prompt_tokens": 3, **GREEDY}).json()
    assert chat["usage"]["prompt_tokens"] == 3


def test_priority_lower_first_as_vllm_reaches_the_engine_reversed(http: httpx.Client,
                                                                   loop: EngineLoop) -> None:
    for priority in (-7, 7):
        answer = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1,
                                                    "priority": priority, **GREEDY}).json()
        request = next(r for r in reversed(loop.engine.scheduler.recent)
                       if r.id == answer["id"].split("-", 1)[1])
        assert request.priority == -priority
    refused(http, {"prompt": "a", "priority": 2**63}, "priority")


def test_chat_template_kwargs_and_documents_reach_the_template(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Q"}], "max_tokens": 1,
            "chat_template_kwargs": {"greeting": "HELLO"},
            "documents": [{"title": "T1", "text": "x"}], **GREEDY}
    rendered = http.post("/tokenize", json={"prompt": "HELLO[T1]Q"}).json()["count"]
    answer = http.post("/v1/chat/completions", json=body).json()
    assert answer["usage"]["prompt_tokens"] == rendered
    plain = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": None,
                                                    "documents": None}).json()
    assert plain["usage"]["prompt_tokens"] == len("Q")
    refused(http, {**body, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs",
            "/v1/chat/completions")


def test_a_template_runtime_error_answers_the_openai_error_body(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Q"}], "chat_template_kwargs": {"boom": True}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "ZeroDivisionError" in error["message"]


@pytest.mark.parametrize(("field", "value"), [
    ("chat_template", "{{ 1 }}"), ("length_penalty", 2.0), ("length_penalty", "1"),
])
def test_extensions_tokenflow_does_not_apply_are_refused_by_name(
        http: httpx.Client, field: str, value: object) -> None:
    body = {"messages": [{"role": "user", "content": "Q"}], field: value}
    assert field in refused(http, body, field, "/v1/chat/completions")


def test_length_penalty_one_means_not_used(http: httpx.Client) -> None:
    answer = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1,
                                                "length_penalty": 1.0, **GREEDY})
    assert answer.status_code == 200


def test_return_tokens_as_token_ids_names_tokens_by_id(http: httpx.Client) -> None:
    body = {"prompt": "ab", "max_tokens": 2, "logprobs": 2, "echo": True,
            "return_tokens_as_token_ids": True, **GREEDY}
    answer = http.post("/v1/completions", json=body).json()["choices"][0]
    ids = [ord("a") + 3, ord("b") + 3, *answer["token_ids"]]  # the echoed prompt leads
    assert answer["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(key.startswith("token_id:") for top in answer["logprobs"]["top_logprobs"][1:]
               for key in top)
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Q"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 1, "return_tokens_as_token_ids": True, **GREEDY}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert all(entry["token"].startswith("token_id:") for entry in content)


def test_serve_help_names_each_limit(capsys: pytest.CaptureFixture[str]) -> None:
    from console.cli.main import main
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--max-running-per-address N choices from one client address" in shown
    share = RequestShare()
    for limit in (share.max_n, share.max_choices, share.max_stop_strings, share.max_stop_chars,
                  share.max_logit_bias, share.max_logprob_entries):
        assert str(limit) in shown
    assert Path(__file__).resolve().parents[1].joinpath("docs/serve.md").read_text().count(
        f"{share.max_logprob_entries:,}") >= 1
