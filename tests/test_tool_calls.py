"""Tool calls as vLLM makes them: tools and tool messages through the model's template,
`required` and named choices forced through the grammar (so they always parse), and the
hermes and llama3_json parsers for `auto`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.serve import tools
from engine.serve.tools import PARSE, ToolCall, ToolStream, ToolUse

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"],
        "additionalProperties": False}}}
# Hermes 2 Pro's way of showing tools and tool results, shortened
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "\n</tool_call>{% endfor %}{% elif m['role'] == 'tool' %}<tool_response>\n"
    "{{ m['content'] }}\n</tool_response>{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HISTORY = [
    {"role": "user", "content": "weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from engine import Engine, EngineConfig
    from engine.serve.app import create_app
    from engine.serve.loop import EngineLoop
    from engine.serve.thread import ServerThread

    template = tmp_path_factory.mktemp("tools") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    loop = EngineLoop(Engine(EngineConfig(model="synthetic:tiny", device="cpu",
                                          dtype="float32"))).start()
    try:
        with ServerThread(create_app(loop, admin_token=None, chat_template=template,
                                     tool_call_parser="hermes")) as running:
            yield running.url
    finally:
        loop.stop()


def test_tools_and_tool_messages_render_as_vllm_passes_them(tmp_path: Path) -> None:
    import transformers
    from tokenizers import Tokenizer, models

    from engine.model.chat_template import load_chat_template
    from engine.serve.chat import render_messages
    from engine.serve.protocol import ChatBody
    from engine.serve.tools import template_tools

    transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        chat_template=HERMES_TEMPLATE).save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    history = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if "tool_calls" in m else m
        for m in HISTORY]  # templates read the arguments as an object, as vLLM passes them
    # vLLM passes a tool without a description as "description": null
    function = TIME["function"]
    as_vllm = [WEATHER, {**TIME, "function": {"name": function["name"], "description": None,
                                              "parameters": function["parameters"]}}]
    theirs = hf.apply_chat_template(history, tools=as_vllm, tokenize=False,
                                    add_generation_prompt=True)
    body = ChatBody.model_validate({"messages": HISTORY, "tools": [WEATHER, TIME]})
    ours = render_messages(load_chat_template(str(tmp_path)), body.messages, True, None,
                           {"tools": template_tools(body.tools or [])})
    assert ours == theirs


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_choices_always_parse(server: str, stream: bool) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    for seed in range(4):
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            asked = dict(model="synthetic:tiny", messages=HISTORY[:1], tools=[WEATHER, TIME],
                         tool_choice=choice, temperature=1.0, seed=seed, max_tokens=400)
            if stream:
                reply = streamed(client, asked)
                finish = reply.finish_reason
                found = [{"name": c.function.name, "arguments": c.function.arguments}
                         for c in reply.message.tool_calls or ()]
            else:
                reply = client.chat.completions.create(**asked).choices[0]
                finish = reply.finish_reason
                found = [{"name": c.function.name, "arguments": c.function.arguments}
                         for c in reply.message.tool_calls or ()]
            assert found, (choice, seed)
            for call in found:
                arguments = json.loads(call["arguments"])
                if call["name"] == "get_weather":
                    assert set(arguments) == {"city", "unit"} and arguments["unit"] in "cf"
                else:
                    assert call["name"] == "get_time" and -12 <= arguments["zone"] <= 14
            assert finish == ("tool_calls" if choice == "required" else "stop")
            if choice != "required":
                assert [c["name"] for c in found] == ["get_weather"]


def streamed(client: Any, asked: dict[str, Any]) -> Any:
    """The streamed answer as the openai client accumulates it, after checking each tool-call
    delta's shape: a call's first delta has its id, type and name; the later ones arguments
    alone, so an accumulator that concatenates strings keeps one id and one name."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    seen: set[int] = set()
    for chunk in client.chat.completions.create(**asked, stream=True):
        for call in chunk.choices[0].delta.tool_calls or ():
            if call.index in seen:
                assert call.id is None and call.type is None and call.function.name is None
            else:
                assert call.id and call.type == "function" and call.function.name
                seen.add(call.index)
        state.handle_chunk(chunk)
    return state.current_completion_snapshot.choices[0]


@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_streamed_calls_concatenate_to_the_answer_not_streamed(server: str,
                                                              choice: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    tool_choice: Any = {"required": "required", "auto": "auto", "named": {
        "type": "function", "function": {"name": "get_weather"}}}[choice]
    # how many pieces the arguments come in is the event loop's pace: a stream behind its
    # engine sends what piled up as one chunk; the pieces themselves are the parser's
    # (_streams_as_parsed, a character at a time)
    for seed in range(3):
        asked: dict[str, Any] = dict(
            model="synthetic:tiny", messages=HISTORY[:1], tools=[WEATHER, TIME],
            tool_choice=tool_choice, temperature=1.0, seed=seed, max_tokens=400)
        if choice == "auto":  # the hermes parser's form, forced so the calls are found
            asked["extra_body"] = {"structured_outputs": {"regex": (
                r'Sure\.<tool_call>\{"name": "get_time", "arguments": \{"zone": -?[0-9]\}\}'
                r"</tool_call>")}}
        whole = client.chat.completions.create(**asked).choices[0]
        parts = streamed(client, asked)
        assert parts.finish_reason == whole.finish_reason
        assert parts.message.content == whole.message.content
        assert [(c.function.name, c.function.arguments) for c in parts.message.tool_calls] \
            == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert whole.message.tool_calls


def test_none_answers_in_text_and_auto_needs_a_parser(server: str) -> None:
    import httpx

    from engine import Engine, EngineConfig
    from engine.serve.app import create_app
    from engine.serve.loop import EngineLoop
    from engine.serve.thread import ServerThread

    with httpx.Client(base_url=server, timeout=60) as http:
        none = http.post("/v1/chat/completions", json={
            "messages": HISTORY, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 3,
            "temperature": 0}).json()["choices"][0]
        assert none["message"]["tool_calls"] == [] and isinstance(
            none["message"]["content"], str)
        unknown = http.post("/v1/chat/completions", json={
            "messages": HISTORY, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tool_choice"
    loop = EngineLoop(Engine(EngineConfig(model="synthetic:tiny", device="cpu",
                                          dtype="float32"))).start()
    try:
        with ServerThread(create_app(loop, admin_token=None)) as plain, \
                httpx.Client(base_url=plain.url, timeout=60) as http:
            auto = http.post("/v1/chat/completions", json={"messages": HISTORY[:1],
                                                           "tools": [WEATHER]})
            assert auto.status_code == 400
            assert auto.json()["error"]["message"] == (
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set")
    finally:
        loop.stop()


def test_the_parsers_find_the_calls_vllms_find() -> None:
    hermes = PARSE["hermes"]('Let me look.<tool_call>\n{"name": "get_weather", "arguments": '
                             '{"city": "Oslo", "unit": "c"}}\n</tool_call><tool_call>'
                             '{"name": "get_time", "arguments": {"zone": 1}}</tool_call>')
    assert hermes.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in hermes.calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {"zone": 1})]
    assert PARSE["hermes"]("no calls here").calls == ()
    assert PARSE["hermes"]("<tool_call>{broken").content == "<tool_call>{broken"
    llama = PARSE["llama3_json"]('<|python_tag|>{"name": "get_time", "parameters": {"zone": 2}}; '
                                 '{"name": "get_weather", "parameters": {"city": "Rome", '
                                 '"unit": "f"}}')
    assert llama.content is None
    assert [(c.name, json.loads(c.arguments)) for c in llama.calls] == [
        ("get_time", {"zone": 2}), ("get_weather", {"city": "Rome", "unit": "f"})]
    assert PARSE["llama3_json"]("It is sunny.").calls == ()


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Os\\u006co",  "unit":"c"}}\n</tool_call><tool_call>{"arguments": {"zone": 1.50},'
               ' "name": "get_time"}</tool_call>'),
    ("hermes", "no calls, only a < sign and <tool"),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, {}]}"}</tool_call>'),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": 2}}; '
                    '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}'),
    ("llama3_json", '  {"name": "get_time", "parameters": {"zone": [1e2, true, null]}}'),
    ("llama3_json", "It is sunny, {not a call}."),
])
def test_a_parsers_stream_concatenates_to_its_parse(parser: str, text: str) -> None:
    _streams_as_parsed(ToolUse(_tools(), "auto", parser), text)


@pytest.mark.parametrize(("choice", "text"), [
    ("required", '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}},'
                 '\n {"name": "get_time" , "parameters":{"zone":-3}}]'),
    ("get_weather", '{"city": "Oslo", "unit": "c"}'),
])
def test_a_forced_choices_stream_concatenates_to_its_parse(choice: str, text: str) -> None:
    _streams_as_parsed(ToolUse(_tools(), choice, None), text)


def _tools() -> tuple[Any, ...]:
    from engine.serve.protocol import Tool

    return Tool.model_validate(WEATHER), Tool.model_validate(TIME)


def _streams_as_parsed(use: ToolUse, text: str) -> None:
    """Fed one character at a time and then the whole answer, the stream's content and each
    call's name and argument pieces concatenate to what parse gives the whole text."""
    stream = ToolStream(use)
    content, calls = "", {}
    for end in [*range(len(text) + 1), None]:
        found = (use.partial(text[:end], stream.scans) if end is not None
                 else use.parse(text))
        if end is not None:  # read on from the last text, as read afresh
            assert found == use.partial(text[:end])
        delta, deltas = stream.step(found)
        content += delta or ""
        for call in deltas:
            if "id" in call:
                assert call["index"] not in calls and call["type"] == "function"
                calls[call["index"]] = [call["function"]["name"], call["function"]["arguments"]]
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {
                    "arguments"}
                calls[call["index"]][1] += call["function"]["arguments"]
    whole = use.parse(text)
    assert content == (whole.content or "")
    assert [tuple(calls[i]) for i in sorted(calls)] == [(c.name, c.arguments)
                                                        for c in whole.calls]


def test_parallel_tool_calls_false_makes_one_call_at_most(server: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    counts = []
    for seed in range(4):
        asked: dict[str, Any] = dict(
            model="synthetic:tiny", messages=HISTORY[:1], tools=[WEATHER, TIME],
            tool_choice="required", temperature=1.0, seed=seed, max_tokens=400,
            parallel_tool_calls=False)
        whole = client.chat.completions.create(**asked).choices[0]
        parts = streamed(client, asked)
        assert [(c.function.name, c.function.arguments) for c in parts.message.tool_calls] \
            == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        counts.append(len(whole.message.tool_calls))
    assert counts == [1] * 4
    assert ToolUse(_tools(), "auto", "hermes", parallel=False).parse(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>').calls == (ToolCall("a", "{}"),)


def test_required_hoists_the_tools_defs_where_their_references_point(server: str) -> None:
    import httpx

    place = {"type": "function", "function": {"name": "go", "parameters": {
        "type": "object", "$defs": {"city": {"enum": ["Oslo", "Rome"]}},
        "properties": {"to": {"$ref": "#/$defs/city"}}, "required": ["to"],
        "additionalProperties": False}}}
    other = {"type": "function", "function": {"name": "stay", "parameters": {
        "type": "object", "$defs": {"city": {"enum": ["Paris"]}},
        "properties": {"at": {"$ref": "#/$defs/city"}}}}}
    with httpx.Client(base_url=server, timeout=60) as http:
        for seed in range(3):
            reply = http.post("/v1/chat/completions", json={
                "messages": HISTORY[:1], "tools": [place], "tool_choice": "required",
                "temperature": 1.0, "seed": seed, "max_tokens": 200}).json()
            calls = reply["choices"][0]["message"]["tool_calls"]
            assert calls and all(json.loads(c["function"]["arguments"])["to"] in (
                "Oslo", "Rome") for c in calls)
        clash = http.post("/v1/chat/completions", json={
            "messages": HISTORY[:1], "tools": [place, other], "tool_choice": "required"})
        assert clash.status_code == 400 and clash.json()["error"]["param"] == "tools"
        assert "'city' has multiple schemas" in clash.json()["error"]["message"]


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"xs": [%s]}}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"xs": [%s]}}'),
])
def test_a_long_streamed_argument_is_read_once(monkeypatch: pytest.MonkeyPatch, parser: str,
                                               text: str) -> None:
    """Streamed a character at a time, each JSON token of a call is read once, not again at
    every chunk: the work is linear in the argument's length."""
    text %= ", ".join(str(i) for i in range(400))
    reads = [0]
    token = tools._token

    def counted(text: str, pos: int) -> tuple[str, str, int] | None:
        reads[0] += 1
        return token(text, pos)

    monkeypatch.setattr(tools, "_token", counted)
    use = ToolUse(_tools(), "auto", parser)
    stream = ToolStream(use)
    for end in range(len(text) + 1):
        stream.step(use.partial(text[:end], stream.scans))
    assert stream.calls[0].arguments == use.parse(text).calls[0].arguments
    assert reads[0] <= 4 * len(text)  # afresh at every chunk: over 100 times as many


def test_serves_banner_says_what_the_tool_flags_turned_on() -> None:
    from argparse import Namespace

    from console.cli.serve import _tools_note

    assert _tools_note(Namespace(tool_call_parser=None, enable_auto_tool_choice=False)) == ""
    assert _tools_note(Namespace(tool_call_parser="hermes", enable_auto_tool_choice=True)) \
        == ", auto tool choice (hermes)"
    # vLLM takes a parser alone; a drop-in takes it too and says it does nothing here
    assert "--tool-call-parser llama3_json unused without --enable-auto-tool-choice" in \
        _tools_note(Namespace(tool_call_parser="llama3_json", enable_auto_tool_choice=False))
