"""The clients' side of benchmarks/vs_vllm_tools.py: structured output and tool calls through
the openai client, LangChain (langchain-openai) and LiteLLM, run by an interpreter that has
them (none is a tokenflow dependency; this file imports nothing of ours):

    CLIENTS/bin/python benchmarks/_tool_checks.py --url URL --model DIR

Prints one JSON object: per check, what the call returned (ids left out: they are random),
or the error's class, HTTP status and message.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network here

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["a"], "additionalProperties": False}
PICK = {"title": "Pick", "type": "object", "additionalProperties": False,
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Rome"]},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
HISTORY = [*ASK,
           {"role": "assistant", "content": None, "tool_calls": [{
               "id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees"}]
# the hermes parser's form, forced by a regex so both servers' parsers get a call to find
HERMES_CALL = (r'It is\.<tool_call>\n\{"name": "get_time", "arguments": \{"zone": -?[0-9]\}\}'
               r"\n</tool_call>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    base = f"{args.url}/v1"
    import openai

    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)

    def chat(**body: Any) -> Any:
        asked = {"model": args.model, "messages": ASK, "temperature": 0, "max_tokens": 40,
                 **body}
        choice = client.chat.completions.create(**asked).choices[0]
        return _message(choice.message, choice.finish_reason)

    def streamed(**body: Any) -> Any:
        """The stream as the openai client accumulates it, and each call's deltas: how many,
        whether the first alone names the call and has its id, how many carry arguments."""
        from openai.lib.streaming.chat import ChatCompletionStreamState

        asked = {"model": args.model, "messages": ASK, "temperature": 0, "max_tokens": 40,
                 **body, "stream": True}
        state = ChatCompletionStreamState()
        shape: dict[int, list[str]] = {}
        for chunk in client.chat.completions.create(**asked):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or ():
                    shape.setdefault(call.index, []).append(
                        ("id" if call.id else "") + ("+name" if call.function
                                                    and call.function.name else "")
                        + ("+args" if call.function and call.function.arguments else ""))
            state.handle_chunk(chunk)
        choice = state.current_completion_snapshot.choices[0]
        pieces = {index: {"deltas": len(kinds), "first": kinds[0],
                          "later_name_or_id": sum("id" in k or "name" in k for k in kinds[1:]),
                          "argument_pieces": sum("args" in k for k in kinds)}
                  for index, kinds in shape.items()}
        return {**_message(choice.message, choice.finish_reason), "deltas": pieces}

    def usage(**body: Any) -> Any:
        asked = {"model": args.model, "messages": ASK, "temperature": 0, "max_tokens": 1,
                 **body}
        return client.chat.completions.create(**asked).usage.prompt_tokens

    def json_schema(schema: dict[str, Any], strict: bool | None = None) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": schema, **({} if strict is None else {"strict": strict})}}

    def langchain(max_tokens: int = 60) -> Any:
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(model=args.model, base_url=base, api_key="none", temperature=0,
                          max_tokens=max_tokens, max_retries=0)

    def langchain_calls(message: Any) -> Any:
        return [(call["name"], call["args"]) for call in message.tool_calls]

    def langchain_stream(tool_choice: str) -> Any:
        merged = None
        for chunk in langchain().bind_tools(TOOLS, tool_choice=tool_choice).stream(ASK):
            merged = chunk if merged is None else merged + chunk
        assert merged is not None
        return langchain_calls(merged), [(c["name"], c["args"]) for c in
                                         merged.tool_call_chunks]

    def litellm(**body: Any) -> Any:
        import litellm as lite

        asked = {"model": f"hosted_vllm/{args.model}", "api_base": base, "messages": ASK,
                 "max_tokens": 40, "temperature": 0, **body}
        if body.get("stream"):
            chunks = list(lite.completion(**asked))
            reply = lite.stream_chunk_builder(chunks, messages=ASK)
        else:
            reply = lite.completion(**asked)
        choice = reply.choices[0]
        return _message(choice.message, choice.finish_reason)

    named = {"type": "function", "function": {"name": "get_weather"}}
    regex = {"structured_outputs": {"regex": HERMES_CALL}}
    checks: dict[str, Callable[[], Any]] = {
        # openai client: structured output
        "openai response_format json_object": lambda: chat(
            response_format={"type": "json_object"}),
        "openai response_format json_schema": lambda: chat(
            response_format=json_schema(SCHEMA)),
        "openai response_format json_schema, strict": lambda: chat(
            response_format=json_schema(PICK, strict=True)),
        "openai response_format json_schema without a schema": lambda: chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        "openai response_format text": lambda: chat(response_format={"type": "text"},
                                                    max_tokens=4),
        "openai structured_outputs.json": lambda: chat(
            extra_body={"structured_outputs": {"json": SCHEMA}}),
        "openai structured_outputs.regex": lambda: chat(
            extra_body={"structured_outputs": {"regex": "(yes|no), [0-9]{2}"}}),
        "openai structured_outputs.choice": lambda: chat(
            extra_body={"structured_outputs": {"choice": ["Oslo", "Rome", "Paris"]}}),
        "openai structured_outputs.grammar (Lark)": lambda: chat(
            extra_body={"structured_outputs": {"grammar": 'start: "a" ("b" | "c")+ "."'}}),
        "openai structured_outputs, two kinds": lambda: chat(
            extra_body={"structured_outputs": {"regex": "a+", "choice": ["a"]}}),
        "openai structured_outputs.json, not a schema": lambda: chat(
            extra_body={"structured_outputs": {"json": {"type": "nonsense"}}}),
        "openai guided_json (dropped in vLLM 0.32)": lambda: chat(
            extra_body={"guided_json": SCHEMA}, max_tokens=8),
        "openai completions structured_outputs.choice": lambda: client.completions.create(
            model=args.model, prompt="The capital of Norway is", max_tokens=8, temperature=0,
            extra_body={"structured_outputs": {"choice": [" Oslo", " Rome"]}}
        ).choices[0].text,
        "openai streamed json_schema": lambda: streamed(response_format=json_schema(SCHEMA)),
        # openai client: tools
        "openai tools, prompt tokens (template renders tools)": lambda: usage(tools=TOOLS),
        "openai tool-role messages, prompt tokens": lambda: usage(messages=HISTORY,
                                                                   tools=TOOLS),
        "openai tool-role messages, answer": lambda: chat(messages=HISTORY, tools=TOOLS,
                                                          max_tokens=8),
        "openai tool_choice none": lambda: chat(tools=TOOLS, tool_choice="none", max_tokens=8),
        "openai tool_choice auto (no call made)": lambda: chat(tools=TOOLS, tool_choice="auto",
                                                               max_tokens=8),
        "openai tool_choice auto, hermes call": lambda: chat(
            tools=TOOLS, tool_choice="auto", max_tokens=60, extra_body=regex),
        "openai tool_choice required": lambda: chat(tools=TOOLS, tool_choice="required",
                                                    max_tokens=80),
        "openai tool_choice named": lambda: chat(tools=TOOLS, tool_choice=named,
                                                 max_tokens=60),
        "openai tool_choice named, not a tool": lambda: chat(tools=TOOLS, tool_choice={
            "type": "function", "function": {"name": "nope"}}),
        "openai tool_choice without tools": lambda: chat(tool_choice="required"),
        "openai parallel_tool_calls false": lambda: chat(
            tools=TOOLS, tool_choice="required", max_tokens=80, parallel_tool_calls=False),
        "openai streamed auto, hermes call": lambda: streamed(
            tools=TOOLS, tool_choice="auto", max_tokens=60, extra_body=regex),
        "openai streamed required": lambda: streamed(tools=TOOLS, tool_choice="required",
                                                     max_tokens=80),
        "openai streamed named": lambda: streamed(tools=TOOLS, tool_choice=named,
                                                  max_tokens=60),
        "openai streamed none": lambda: streamed(tools=TOOLS, tool_choice="none", max_tokens=8),
        # LangChain
        "LangChain with_structured_output json_schema": lambda: langchain(
            ).with_structured_output(PICK, method="json_schema").invoke(ASK),
        "LangChain with_structured_output json_mode": lambda: langchain(
            ).with_structured_output(PICK, method="json_mode").invoke(ASK),
        "LangChain with_structured_output function_calling": lambda: langchain(
            ).with_structured_output(PICK, method="function_calling").invoke(ASK),
        "LangChain bind_tools any (required)": lambda: langchain_calls(
            langchain().bind_tools(TOOLS, tool_choice="any").invoke(ASK)),
        "LangChain bind_tools named": lambda: langchain_calls(
            langchain().bind_tools(TOOLS, tool_choice="get_time").invoke(ASK)),
        "LangChain bind_tools auto": lambda: langchain_calls(
            langchain(8).bind_tools(TOOLS).invoke(ASK)),
        "LangChain bind_tools any, streamed": lambda: langchain_stream("any"),
        "LangChain bind_tools named, streamed": lambda: langchain_stream("get_time"),
        # LiteLLM
        "LiteLLM response_format json_schema": lambda: litellm(
            response_format=json_schema(SCHEMA)),
        "LiteLLM tools required": lambda: litellm(tools=TOOLS, tool_choice="required",
                                                  max_tokens=80),
        "LiteLLM tools named, streamed": lambda: litellm(tools=TOOLS, tool_choice=named,
                                                         max_tokens=60, stream=True),
        "LiteLLM tool-role messages": lambda: litellm(messages=HISTORY, tools=TOOLS,
                                                      max_tokens=8),
    }
    results: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception as exc:
            status = getattr(exc, "status_code", None)
            results[name] = f"{type(exc).__name__} {status}: {str(exc)[:300]}"
    print(json.dumps(results, default=str))


def _message(message: Any, finish_reason: str | None) -> dict[str, Any]:
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    return {"content": message.content, "tool_calls": calls, "finish_reason": finish_reason}


if __name__ == "__main__":
    main()
