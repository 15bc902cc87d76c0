"""POST /v1/chat/completions, OpenAI-compatible as vLLM is; tools and functions are refused."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
from engine.serve.protocol import ApiError, ChatBody, ChatMessage, parse_model, read_json

NO_TEMPLATE = ("this model has no chat template (no chat_template.jinja, none in "
               "tokenizer_config.json): start the server with --chat-template FILE, or use "
               "/v1/completions")


def render_messages(template: ChatTemplate | None, messages: Sequence[ChatMessage],
                    add_generation_prompt: bool, extra: dict[str, Any] | None = None) -> str:
    """The prompt text of `messages`, `extra` the template's other variables (vLLM's
    chat_template_kwargs and documents); ApiError(400) without a template or when it fails."""
    if template is None:
        raise ApiError(400, NO_TEMPLATE, param="messages")
    plain = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
              **({"name": m.name} if m.name is not None else {})} for m in messages]
    try:
        return template.render(plain, add_generation_prompt, extra or {})
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None


def template_variables(body: ChatBody) -> dict[str, Any]:
    """vLLM's chat_template_kwargs, over `documents`; they may not replace the messages."""
    kwargs = body.chat_template_kwargs or {}
    if "messages" in kwargs:
        raise ApiError(400, "'chat_template_kwargs' must not set 'messages'; send them as "
                            "'messages'", param="chat_template_kwargs")
    documents = {} if body.documents is None else {"documents": body.documents}
    return {**documents, **kwargs}


class Chat:
    def __init__(self, generations: Generations, template: ChatTemplate | None) -> None:
        self.generations = generations
        self.template = template

    async def handle(self, request: Request) -> Response:
        g = self.generations
        body = parse_model(ChatBody, await read_json(request, g.limits))
        g.check_model(body.model)
        priority = g.check_fields(body, 1)
        extra = template_variables(body)
        add_generation_prompt = extra.pop("add_generation_prompt",
                                          body.add_generation_prompt is not False)
        prompt = g.token_ids(render_messages(self.template, body.messages,
                                             add_generation_prompt is not False, extra),
                             "messages", body.truncate_prompt_tokens)
        if body.top_logprobs is not None and body.logprobs is not True:
            raise ApiError(400, "'top_logprobs' needs \"logprobs\": true", param="top_logprobs")
        max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                      else body.max_tokens)
        if max_tokens is None and g.defaults.max_tokens is None:
            # vLLM: what the context leaves after the prompt
            max_tokens = max(1, g.engine_loop.engine.max_model_len - len(prompt))
        if max_tokens == 0:
            raise ApiError(400, "'max_completion_tokens' must be at least 1",
                           param="max_completion_tokens")
        params = g.params(body, max_tokens,
                          logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                          prompt_logprobs=body.prompt_logprobs)
        generation = Generation([prompt], params, body.n or 1, body.stream is True,
                                include_usage(body), continuous_usage(body), priority)
        reply = _ChatReply.new("chatcmpl", g, params, body)
        return await g.run(request, generation, reply, tag=CHAT_TAG)


@dataclass(frozen=True)
class _ChatReply(Reply):
    def _body(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, choice: Choice, text: str, tokens: list[int],
              logprobs: Sequence[TokenLogprob], first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {
            "content": text}
        return self._body("chat.completion.chunk", [{
            "index": choice.index, "delta": delta,
            "logprobs": None if choice.logprobs is None else self._logprobs(logprobs),
            "finish_reason": FINISH_REASONS.get(choice.finish_reason or "")}])

    def final(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]:
        rendered = [{
            "index": c.index,
            "message": {"role": "assistant", "content": self.texts.final(c),
                        "tool_calls": []},
            "logprobs": None if c.logprobs is None else self._logprobs(c.logprobs),
            "finish_reason": FINISH_REASONS.get(c.finish_reason or "")}
            for c in choices]
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
