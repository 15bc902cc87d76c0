"""POST /v1/completions, OpenAI-compatible: a prompt of text or token ids in, text and ids out.

Everything that can be refused is refused before the engine sees the request: malformed
fields (400), an unknown model (404), a prompt the engine could never serve, the circuit
breaker included (422), a full queue (429) or a dead engine (503). Outputs cross from the
engine thread to the event loop through `call_soon_threadsafe`; a client that goes away
aborts its request so its KV blocks are freed at the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.config import ConfigError, SamplingParams
from engine.core.engine import RequestOutput
from engine.core.request import RequestState
from engine.errors import RequestError
from engine.serve.loop import EngineLoop
from engine.serve.protocol import ApiError, read_json

RETRY_AFTER_S = 1  # what a refused client is told to wait before trying again
ERROR_CHECK_S = 1.0  # how often a waiting request checks that the engine thread is alive
FINISH_REASONS = {"stop": "stop", "length": "length", "aborted": "abort"}
# OpenAI fields we do not implement, with the value that means "not used".
UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "stop": None,
               "suffix": None}


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str | None


def parse_completion(body: Any) -> CompletionRequest:
    """Validate a request body; ApiError(400) names the offending field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object with at least 'prompt'")
    for name, unused in UNSUPPORTED.items():
        if body.get(name) not in (None, unused, [], ""):
            raise ApiError(400, f"'{name}' is not supported by tokenflow; leave it out"
                           + ("; use stop_token_ids" if name == "stop" else ""), param=name)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise ApiError(400, "'stop_token_ids' must be a list of integers", param="stop_token_ids")
    try:
        params = SamplingParams(
            max_tokens=_field(body, "max_tokens", int, 16),
            temperature=_field(body, "temperature", float, 0.0),
            top_p=_field(body, "top_p", float, 1.0),
            top_k=_field(body, "top_k", int, 0),
            seed=_field(body, "seed", int, None),
            ignore_eos=_field(body, "ignore_eos", bool, False),
            stop_token_ids=tuple(stop_ids),
        )
    except ConfigError as exc:
        raise ApiError(400, f"'{exc.field}' {exc.message}", param=exc.field) from None
    return CompletionRequest(prompt=_prompt(body.get("prompt")), params=params,
                             stream=_field(body, "stream", bool, False),
                             include_usage=stream_options.get("include_usage") is True,
                             model=model)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = _is_int(value)
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise ApiError(400, f"'{name}' must be {kind.__name__}, got {value!r}", param=name)
    return kind(value)


def _prompt(prompt: Any) -> str | list[int]:
    """Text, a list of token ids, or a list holding exactly one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be text or a list of integer token ids, one prompt per "
                        "request", param="prompt")


class _Bridge:
    """Engine-thread outputs of one request, delivered to the event loop in order."""

    def __init__(self, engine_loop: EngineLoop, on_finish: Callable[[], None],
                 final_only: bool) -> None:
        self.engine_loop = engine_loop
        self.aio = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.on_finish = on_finish
        self.final_only = final_only
        self.finished = False

    def push(self, output: RequestOutput) -> None:  # on the engine thread
        if output.finished:
            self.aio.call_soon_threadsafe(self.on_finish)
        if output.finished or not self.final_only:
            self.aio.call_soon_threadsafe(self.queue.put_nowait, output)

    async def next(self) -> RequestOutput:
        output = self.queue.get_nowait() if not self.queue.empty() else await self._wait()
        self.finished = output.finished
        return output

    async def _wait(self) -> RequestOutput:
        """The next output; a dead engine thread never sends one, so check it now and then."""
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), ERROR_CHECK_S)
            except TimeoutError:
                if self.engine_loop.error is not None:
                    raise _engine_down(self.engine_loop) from None


class Completions:
    """The endpoint, with its admission state: requests accepted and not yet finished."""

    def __init__(self, engine_loop: EngineLoop, *, max_queue: int, max_body_bytes: int) -> None:
        self.engine_loop = engine_loop
        self.max_queue = max_queue
        self.max_body_bytes = max_body_bytes
        self.in_flight = 0

    async def handle(self, request: Request) -> Response:
        body = parse_completion(await read_json(request, self.max_body_bytes))
        engine = self.engine_loop.engine
        served = engine.config.model
        if body.model is not None and body.model != served:
            raise ApiError(404, f"model {body.model!r} is not served here; use {served!r}",
                           kind="not_found_error", param="model")
        try:
            token_ids = engine.prompt_token_ids(body.prompt)
        except RequestError as exc:
            raise ApiError(400, str(exc), param="prompt") from None
        reason = engine.rejection_reason(len(token_ids), body.params.max_tokens)
        if reason:
            raise ApiError(422, reason, param="prompt")
        self._admit()
        bridge = _Bridge(self.engine_loop, self._release, final_only=not body.stream)
        self.in_flight += 1
        try:
            request_id = self.engine_loop.submit(token_ids, body.params, on_output=bridge.push)
        except BaseException:
            self.in_flight -= 1
            raise
        reply = _Reply(f"cmpl-{request_id}", served, len(token_ids), engine.tokenizer.decode,
                       int(time.time()))
        if body.stream:
            events = self._events(request_id, bridge, reply, body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._complete(request, request_id, bridge, reply)

    def _admit(self) -> None:
        if self.engine_loop.error is not None:
            raise _engine_down(self.engine_loop)
        if self.in_flight >= self.max_queue:
            raise ApiError(429, f"the server queue is full ({self.max_queue} requests in "
                                f"flight); retry after {RETRY_AFTER_S} s",
                           kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})

    def _release(self) -> None:
        self.in_flight -= 1

    async def _complete(self, request: Request, request_id: str, bridge: _Bridge,
                        reply: _Reply) -> Response:
        disconnect = asyncio.create_task(_disconnected(request))
        result = asyncio.create_task(bridge.next())
        try:
            await asyncio.wait({disconnect, result}, return_when=asyncio.FIRST_COMPLETED)
            if not result.done():
                self.engine_loop.abort(request_id)
                return Response(status_code=499)  # nobody is listening any more
            output = result.result()
        finally:
            disconnect.cancel()
            result.cancel()
        _raise_if_refused(self.engine_loop, output)
        return JSONResponse(reply.body(_decode_all(reply, output), list(output.token_ids),
                                       FINISH_REASONS.get(output.finish_reason or ""),
                                       usage=True, completion_tokens=len(output.token_ids)))

    async def _events(self, request_id: str, bridge: _Bridge, reply: _Reply,
                      include_usage: bool) -> AsyncIterator[str]:
        """SSE chunks as tokens arrive; the text is held back while it ends mid-character."""
        sent, pending = "", []
        try:
            while not bridge.finished:
                output = await bridge.next()
                _raise_if_refused(self.engine_loop, output)
                pending += output.new_token_ids
                text = _decode_all(reply, output)
                if not output.finished and text.endswith("\ufffd"):
                    continue
                reason = FINISH_REASONS.get(output.finish_reason or "")
                yield _sse(reply.body(text[len(sent):], pending, reason))
                sent, pending = text, []
                if output.finished and include_usage:
                    yield _sse({**reply.body("", [], None, usage=True,
                                             completion_tokens=len(output.token_ids)),
                                "choices": []})
        except ApiError as exc:
            yield _sse({"error": json.loads(exc.response().body)["error"]})
        finally:
            if not bridge.finished:  # the client went away (or the engine died): free the slot
                self.engine_loop.abort(request_id)
        yield "data: [DONE]\n\n"


@dataclass(frozen=True)
class _Reply:
    id: str
    model: str
    prompt_tokens: int
    decode: Callable[[list[int]], str]
    created: int

    def body(self, text: str, token_ids: list[int], finish_reason: str | None, *,
             usage: bool = False, completion_tokens: int = 0) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "text": text, "token_ids": token_ids, "logprobs": None,
                         "finish_reason": finish_reason}],
        }
        if usage:
            body["usage"] = {"prompt_tokens": self.prompt_tokens,
                             "completion_tokens": completion_tokens,
                             "total_tokens": self.prompt_tokens + completion_tokens}
        return body


def _decode_all(reply: _Reply, output: RequestOutput) -> str:
    return reply.decode(list(output.token_ids))


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _raise_if_refused(engine_loop: EngineLoop, output: RequestOutput) -> None:
    """A request the engine rejected or failed after admission becomes an HTTP error."""
    if output.state == RequestState.REJECTED.value:
        raise ApiError(422, output.finish_reason or "rejected by the engine", param="prompt")
    if output.state == RequestState.FAILED.value:
        raise ApiError(500, f"the request failed: {output.finish_reason}", kind="server_error")


def _engine_down(engine_loop: EngineLoop) -> ApiError:
    return ApiError(503, f"the engine has stopped ({engine_loop.error!r}); restart the server",
                    kind="server_error", headers={"Retry-After": str(RETRY_AFTER_S)})


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
