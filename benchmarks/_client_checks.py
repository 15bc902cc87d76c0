"""The clients' side of benchmarks/vs_vllm_fields.py, run by an interpreter that has them
(langchain-openai, litellm: not tokenflow dependencies; this file imports nothing of ours):

    CLIENTS/bin/python benchmarks/_client_checks.py --url URL --model DIR

Prints one JSON object: what each client call returned, or the exception's class and text.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    base = f"{args.url}/v1"

    def langchain_structured() -> Any:
        from langchain_openai import ChatOpenAI

        schema = {"title": "Pick", "type": "object", "additionalProperties": False,
                  "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["n"]}
        llm = ChatOpenAI(model=args.model, base_url=base, api_key="none", temperature=0,
                         max_tokens=40)
        return llm.with_structured_output(schema, method="json_schema").invoke("w5 w6")

    def langchain_tools() -> Any:
        from langchain_openai import ChatOpenAI

        tool = {"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}},
            "required": ["n"], "additionalProperties": False}}}
        llm = ChatOpenAI(model=args.model, base_url=base, api_key="none", temperature=0,
                         max_tokens=60)
        message = llm.bind_tools([tool], tool_choice="any").invoke("w5 w6")
        return [(call["name"], call["args"]) for call in message.tool_calls]

    def litellm_completion() -> Any:
        import litellm

        reply = litellm.completion(model=f"hosted_vllm/{args.model}", api_base=base,
                                   messages=[{"role": "user", "content": "w5 w6"}],
                                   max_tokens=4, temperature=0)
        return reply.choices[0].finish_reason, reply.usage.prompt_tokens

    def litellm_context() -> Any:
        import litellm

        litellm.completion(model=f"hosted_vllm/{args.model}", api_base=base,
                           messages=[{"role": "user", "content": "w5 " * 2100}],
                           max_tokens=4)
        return "no error"

    def openai_models() -> Any:
        import openai

        card = openai.OpenAI(base_url=base, api_key="none").models.list().data[0]
        return card.root == args.model, card.parent  # type: ignore[attr-defined]

    checks: dict[str, Callable[[], Any]] = {
        "LangChain with_structured_output (json_schema)": langchain_structured,
        "LangChain bind_tools (tool_choice any)": langchain_tools,
        "LiteLLM completion (hosted_vllm)": litellm_completion,
        "LiteLLM, a prompt over the context": litellm_context,
        "openai models.list root, parent": openai_models,
    }
    results: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
