"""POST /v1/completions, OpenAI-compatible: a prompt of text or token ids in, text and ids out.

Everything that can be refused is refused before the engine sees the request: malformed
fields (400), an unknown model (404), a prompt the engine could never serve, the circuit
breaker included (422), a full queue (429) or a dead engine (503). Outputs cross from the
engine thread to the event loop through `call_soon_threadsafe`; a client that goes away
aborts its request so its KV blocks are freed at the next step (and the journal records it
aborted). With a journal, a request's first output leaves only once its journal row is
committed, and its last once its end is: a client never holds tokens of a request the
journal does not know, nor a whole answer the journal would run again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.config import ConfigError, SamplingParams
from engine.core.engine import RequestOutput
from engine.core.request import RequestState
from engine.errors import RequestError
from engine.serve.loop import EngineLoop
from engine.serve.protocol import ApiError, BodyLimits, CompletionBody, parse_model, read_json

RETRY_AFTER_S = 1  # what a refused client is told to wait before trying again
ERROR_CHECK_S = 1.0  # how often a waiting request checks that the engine thread is alive
JOURNAL_WAIT_S = 10.0  # an output waits this long for the journal to commit it
FINISH_REASONS = {"stop": "stop", "length": "length", "aborted": "abort"}


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str | None


def parse_completion(data: Any, vocab_size: int) -> CompletionRequest:
    """Validate a request body: types here, ranges in SamplingParams; ApiError(400) names the
    offending field."""
    body = parse_model(CompletionBody, data)
    defaults = SamplingParams()
    try:
        params = SamplingParams(
            max_tokens=_given(body.max_tokens, defaults.max_tokens),
            temperature=_given(body.temperature, defaults.temperature),
            top_p=_given(body.top_p, defaults.top_p),
            top_k=_given(body.top_k, defaults.top_k),
            seed=body.seed,
            ignore_eos=_given(body.ignore_eos, defaults.ignore_eos),
            stop_token_ids=tuple(body.stop_token_ids or ()),
        )
        params.check_vocab(vocab_size)
    except ConfigError as exc:
        raise ApiError(400, f"'{exc.field}' {exc.message}", param=exc.field) from None
    options = body.stream_options
    return CompletionRequest(prompt=body.single_prompt(), params=params,
                             stream=body.stream is True,
                             include_usage=options is not None and options.include_usage is True,
                             model=body.model)


def _given(value: Any, default: Any) -> Any:
    """JSON null means "the default", as OpenAI reads it."""
    return default if value is None else value


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

    def __init__(self, engine_loop: EngineLoop, *, max_queue: int, limits: BodyLimits) -> None:
        self.engine_loop = engine_loop
        self.max_queue = max_queue
        self.limits = limits
        self.in_flight = 0

    async def handle(self, request: Request) -> Response:
        engine = self.engine_loop.engine
        body = parse_completion(await read_json(request, self.limits),
                                engine.model_config.vocab_size)
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
            self.engine_loop.failed_while_down += 1
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
        await _journaled(self.engine_loop)
        return JSONResponse(reply.body(_decode_all(reply, output), list(output.token_ids),
                                       FINISH_REASONS.get(output.finish_reason or ""),
                                       usage=True, completion_tokens=len(output.token_ids)))

    async def _events(self, request_id: str, bridge: _Bridge, reply: _Reply,
                      include_usage: bool) -> AsyncIterator[str]:
        """One SSE chunk per generated token, as vLLM sends them; a chunk whose token leaves
        a character incomplete carries its token id and no text (see _decode_all)."""
        sent, journaled = "", False
        try:
            while not bridge.finished:
                output = await bridge.next()
                _raise_if_refused(self.engine_loop, output)
                if not journaled or output.finished:
                    await _journaled(self.engine_loop)
                    journaled = True
                text = _decode_all(reply, output)
                reason = FINISH_REASONS.get(output.finish_reason or "")
                yield _sse(reply.body(text[len(sent):], list(output.new_token_ids), reason))
                sent = text
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
    """The text of the tokens so far, less a trailing U+FFFD: the bytes of a character not
    yet complete (a multi-byte UTF-8 sequence split across tokens) are held back until it
    completes, and never sent if it does not (vLLM's detokenizer does the same)."""
    return reply.decode(list(output.token_ids)).rstrip("\ufffd")


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _raise_if_refused(engine_loop: EngineLoop, output: RequestOutput) -> None:
    """A request the engine rejected or failed after admission becomes an HTTP error."""
    if output.state == RequestState.REJECTED.value:
        raise ApiError(422, output.finish_reason or "rejected by the engine", param="prompt")
    if output.state == RequestState.FAILED.value:
        raise ApiError(500, f"the request failed: {output.finish_reason}", kind="server_error")


async def _journaled(engine_loop: EngineLoop) -> None:
    """Wait until the journal holds everything the engine has published so far."""
    flush = engine_loop.journal_flush
    if flush is not None and not await run_in_threadpool(flush, JOURNAL_WAIT_S):
        raise ApiError(503, f"the request journal did not commit within {JOURNAL_WAIT_S:g} s; "
                            "retry", kind="server_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)})


def _engine_down(engine_loop: EngineLoop) -> ApiError:
    return ApiError(503, f"the engine has stopped: {engine_loop.error}",
                    kind="server_error", headers={"Retry-After": str(RETRY_AFTER_S)})


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
