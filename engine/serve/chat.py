"""POST /v1/chat/completions, OpenAI-compatible as vLLM is, tool calls included."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from engine.batch import TokenLogprob
from engine.core.request import CHAT_TAG
from engine.model.chat_template import ChatTemplate, ChatTemplateError
from engine.serve.completions import (
    FINISH_REASONS,
    MIN_LOGPROB,
    Choice,
    Generation,
    Generations,
    Reply,
    continuous_usage,
    include_usage,
    prompt_logprobs,
)
from engine.serve.protocol import ApiError, ChatBody, ChatMessage, read_model
from engine.serve.tools import (
    Parsed,
    ToolCall,
    ToolStream,
    ToolUse,
    template_tools,
    tool_use,
)

NO_TEMPLATE = ("this model has no chat template (no chat_template.jinja, none in "
               "tokenizer_config.json): start the server with --chat-template FILE, or use "
               "/v1/completions")


def render_messages(template: ChatTemplate | None, messages: Sequence[ChatMessage],
                    add_generation_prompt: bool | None,
                    continue_final_message: bool | None = None,
                    extra: dict[str, Any] | None = None) -> str:
    """The prompt text of `messages`, `extra` the template's other variables (tools, and vLLM's
    chat_template_kwargs and documents); ApiError(400) without a template or when it fails.
    `add_generation_prompt` defaults to true, and to false when continuing the final message."""
    if template is None:
        raise ApiError(400, NO_TEMPLATE, param="messages")
    if continue_final_message and add_generation_prompt:
        raise ApiError(400, "Cannot set both `continue_final_message` and "
                            "`add_generation_prompt` to True.", param="continue_final_message")
    try:
        return template.render([_plain(m) for m in messages], add_generation_prompt=(
            not continue_final_message if add_generation_prompt is None
            else add_generation_prompt), continue_final_message=continue_final_message is True,
            extra=extra)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None


def _plain(message: ChatMessage) -> dict[str, Any]:
    """A message as templates read it; a call's arguments as an object, as vLLM passes them."""
    plain: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                             "content": message.text()}
    if message.name is not None:
        plain["name"] = message.name
    if message.tool_call_id is not None:
        plain["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        plain["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": _object(call.function.arguments)}}
            for call in message.tool_calls]
    return plain


def _object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def template_variables(body: ChatBody) -> dict[str, Any]:
    """vLLM's chat_template_kwargs, over `documents`; they may not replace the messages."""
    kwargs = body.chat_template_kwargs or {}
    if "messages" in kwargs:
        raise ApiError(400, "'chat_template_kwargs' must not set 'messages'; send them as "
                            "'messages'", param="chat_template_kwargs")
    documents = {} if body.documents is None else {"documents": body.documents}
    return {**documents, **kwargs}


class Chat:
    def __init__(self, generations: Generations, template: ChatTemplate | None,
                 tool_call_parser: str | None = None) -> None:
        self.generations = generations
        self.template = template
        self.tool_call_parser = tool_call_parser

    async def handle(self, request: Request) -> Response:
        g = self.generations
        body = await read_model(request, ChatBody, g.limits)
        g.check_model(body.model)
        priority = g.check_fields(body, 1)
        tools = tool_use(body, self.tool_call_parser)
        if tools is not None and (schema := tools.schema()) is not None:
            if body.guided_json is not None:
                raise ApiError(400, "'guided_json' cannot be combined with a required or "
                                    "named tool_choice, which constrains the output itself",
                               param="guided_json")
            body = body.model_copy(update={"guided_json": schema})  # vLLM forces it so
        extra = template_variables(body)
        if body.tools:
            extra = {"tools": template_tools(body.tools), **extra}
        asked = extra.pop("add_generation_prompt", body.add_generation_prompt)
        text = render_messages(self.template, body.messages,
                               None if asked is None else asked is not False,
                               body.continue_final_message, extra)
        # the template writes the special tokens it wants, so none are added by default
        prompt = g.token_ids(text, "messages", body.truncate_prompt_tokens,
                             add_special_tokens=body.add_special_tokens is True)
        if body.top_logprobs is not None and body.logprobs is not True:
            raise ApiError(400, "'top_logprobs' needs \"logprobs\": true", param="top_logprobs")
        max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                      else body.max_tokens)
        if max_tokens == 0:
            raise ApiError(400, "'max_completion_tokens' must be at least 1",
                           param="max_completion_tokens")
        # vLLM: unset, generation_config.json's max_new_tokens, then what the context leaves
        params = g.params(body, max_tokens if max_tokens is not None else g.defaults.max_tokens,
                          logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                          prompt_logprobs=body.prompt_logprobs)
        generation = Generation([prompt], params, body.n or 1, body.stream is True,
                                include_usage(body), continuous_usage(body),
                                g.engine_loop.engine.max_model_len, priority)
        reply = _ChatReply.new("chatcmpl", g, params, body, tools=tools)
        return await g.run(request, generation, reply, tag=CHAT_TAG)


@dataclass(frozen=True)
class _ChatReply(Reply):
    tools: ToolUse | None = None
    streams: dict[int, ToolStream] = field(default_factory=dict)  # by choice index

    def _body(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, choice: Choice, text: str, tokens: list[int],
              logprobs: Sequence[TokenLogprob], first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {
            "content": text}
        finish_reason = FINISH_REASONS.get(choice.finish_reason or "")
        if self.tools is not None and self.tools.choice != "none":
            # what of the text is final so far; the whole answer's calls at its end
            delta.pop("content")
            stream = self.streams.setdefault(choice.index, ToolStream(self.tools))
            if choice.output is not None and choice.output.finished:
                content, calls, finish_reason = self._answer(choice)
                found = Parsed(content, calls)
            else:
                found = self.tools.partial(self.texts.visible(choice), stream.scans)
            content_delta, call_deltas = stream.step(found)
            if content_delta is not None or first:  # vLLM's first chunk has content ""
                delta["content"] = content_delta or ""
            if call_deltas:
                delta["tool_calls"] = call_deltas
        return self._body("chat.completion.chunk", [{
            "index": choice.index, "delta": delta,
            "logprobs": None if choice.logprobs is None else self._logprobs(logprobs),
            "finish_reason": finish_reason}])

    def _answer(self, choice: Choice) -> tuple[str | None, tuple[ToolCall, ...], str | None]:
        """The choice's content, tool calls and finish reason (vLLM's "tool_calls" when an
        auto or required choice called tools)."""
        text = self.texts.final(choice)
        finish_reason = FINISH_REASONS.get(choice.finish_reason or "")
        if self.tools is None:
            return text, (), finish_reason
        try:
            parsed = self.tools.parse(text)
        except (ValueError, KeyError, TypeError):  # cut short (max_tokens): the text as it is
            return text, (), finish_reason
        if not parsed.calls:
            return parsed.content, (), finish_reason
        if self.tools.forced:  # vLLM: content "", and finish_reason tool_calls if required
            return "", parsed.calls, ("tool_calls" if self.tools.choice == "required"
                                      and finish_reason == "stop" else finish_reason)
        return parsed.content, parsed.calls, "tool_calls"

    def final(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]:
        rendered = []
        for c in choices:
            content, calls, finish_reason = self._answer(c)
            rendered.append({
                "index": c.index,
                "message": {"role": "assistant", "content": content,
                            "tool_calls": [call.as_json() for call in calls]},
                "logprobs": None if c.logprobs is None else self._logprobs(c.logprobs),
                "finish_reason": finish_reason})
        body = {**self._body("chat.completion", rendered), "usage": usage}
        if self.prompt_logprobs:  # one prompt for every choice: vLLM puts it at the top
            body["prompt_logprobs"] = prompt_logprobs(choices[0], self.token_text)
        return body

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._body("chat.completion.chunk", []), "usage": usage}

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        def item(token: int, value: float) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": max(value, MIN_LOGPROB),
                    "bytes": list(text.encode("utf-8"))}
        return {"content": [{**item(e.token, e.logprob),
                             "top_logprobs": [item(t, v) for t, v in e.top]}
                            for e in entries]}
