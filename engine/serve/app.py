"""The HTTP app: DESIGN.md's routes over one EngineLoop; handlers never touch engine state."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from engine.config import ConfigError
from engine.model.chat_template import load_chat_template
from engine.model.loader import SYNTHETIC_PREFIX
from engine.serve.auth import TOKEN_ENV, require_admin
from engine.serve.chat import Chat, render_messages
from engine.serve.completions import Completions, Generations
from engine.serve.hosts import LOOPBACK_HOSTS, HostAllowList
from engine.serve.loop import EngineLoop
from engine.serve.prometheus import CONTENT_TYPE, render_metrics
from engine.serve.protocol import (
    ApiError,
    BodyLimits,
    ConfigPatch,
    DetokenizeBody,
    TokenizeBody,
    api_error_handler,
    json_response,
    parse_model,
    read_json,
)
from engine.serve.shares import RequestShare
from engine.serve.turns import ClientTurns
from engine.snapshot import Snapshot
from engine.store import SlowQueryRecord
from engine.store.writer import WriterHealth

SlowQueriesReader = Callable[[int], list[SlowQueryRecord]]
StoreHealth = Callable[[], WriterHealth]
DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_BODY_BYTES = BodyLimits.max_bytes
DEFAULT_BODY_TIMEOUT_S = BodyLimits.read_timeout_s
MAX_SLOW_QUERIES = 5000
DEFAULT_SHARE = RequestShare()


def create_app(loop: EngineLoop, *, admin_token: str | None,
               max_queue: int = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               slow_queries_reader: SlowQueriesReader | None = None, public_stats: bool = False,
               allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
               chat_template: Path | None = None,
               tool_call_parser: str | None = None,
               share: RequestShare = DEFAULT_SHARE,
               turns: ClientTurns | None = None,
               store_health: StoreHealth | None = None) -> Starlette:
    """The starlette app; the caller owns `loop` (started before serving, stopped after).
    `turns`: each client address's share of the engine (ClientTurns' default)."""
    started = int(time.time())
    limits = BodyLimits(max_bytes=max_body_bytes, read_timeout_s=body_timeout_s)
    generations = Generations(loop, max_queue=max_queue, limits=limits, share=share,
                              turns=turns or ClientTurns())
    completions = Completions(generations)
    model = loop.engine.config.model
    template = load_chat_template(model, chat_template,
                                  synthetic=model.startswith(SYNTHETIC_PREFIX))
    chat = Chat(generations, template, tool_call_parser)  # a parser: auto tool choice is on

    def require_reader(request: Request) -> None:
        if public_stats:
            return
        if admin_token is None:
            raise ApiError(403, "this endpoint shows request ids and tenants: start the server "
                                f"with {TOKEN_ENV} set (and send it as a bearer token) or "
                                "--public-stats", kind="permission_error")
        require_admin(request, admin_token)

    def snapshot() -> Snapshot:
        return dataclasses.replace(loop.snapshot(), paused=loop.paused)

    async def models(_request: Request) -> Response:
        engine = loop.engine
        return JSONResponse({"object": "list", "data": [{
            "id": engine.config.model, "object": "model", "created": started,
            "owned_by": "tokenflow", "root": engine.config.model, "parent": None,
            "max_model_len": engine.max_model_len, "permission": [{
                "id": f"modelperm-{engine.config.model}", "object": "model_permission",
                "created": started, "allow_create_engine": False, "allow_sampling": True,
                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                "allow_fine_tuning": False, "organization": "*", "group": None,
                "is_blocking": False}]}]})

    async def health(_request: Request) -> Response:
        if loop.error is not None:
            return JSONResponse({"status": "error", "error": str(loop.error) or repr(loop.error),
                                 "restarts": loop.health().restarts}, status_code=503)
        if loop.paused:  # alive, but an operator holds it: not serving until resumed
            return JSONResponse({"status": "paused", "detail": "an operator paused the "
                                 "engine; POST /v1/admin/resume serves again"}, status_code=503)
        if store_health is None:
            return JSONResponse({"status": "ok"})
        store = store_health()  # unreachable: still serving, from memory, and said here
        return JSONResponse({"status": "ok" if store.state == "ok" else "degraded",
                             "store": store.to_dict()})

    def stats_body() -> dict[str, Any]:
        body = snapshot().to_dict()
        if store_health is not None:
            body["store"] = store_health().to_dict()
        return body

    async def metrics(_request: Request) -> Response:
        return PlainTextResponse(render_metrics(loop.engine, snapshot(), loop.health(),
                                                generations.queue_full),
                                 media_type=CONTENT_TYPE)

    async def stats(request: Request) -> Response:
        require_reader(request)
        return json_response(stats_body())

    async def get_config(request: Request) -> Response:
        require_admin(request, admin_token)
        return json_response({"config": loop.engine.config.live_values()})

    async def patch_config(request: Request) -> Response:
        require_admin(request, admin_token)
        changes = await read_json(request, limits)
        if not isinstance(changes, dict) or not changes:
            raise ApiError(400, "send a JSON object of live fields to change, e.g. "
                                '{"max_num_batched_tokens": 512}')
        parse_model(ConfigPatch, changes, status=422)
        try:
            config = loop.update_config("api", **changes)
        except ConfigError as exc:
            raise ApiError(422, exc.message, param=exc.field) from None
        return json_response({"config": config.live_values()})

    def pause_or_resume(action: Callable[[], None]) -> Callable[[Request], Any]:
        async def handler(request: Request) -> Response:
            require_admin(request, admin_token)
            action()
            return JSONResponse({"paused": loop.paused})
        return handler

    async def slow_queries(request: Request) -> Response:
        require_reader(request)
        if slow_queries_reader is None:
            raise ApiError(404, "this server keeps no slow-query store; start it with --db",
                           kind="not_found_error")
        try:
            limit = int(request.query_params.get("limit", "500"))
        except ValueError:
            raise ApiError(400, "'limit' must be an integer", param="limit") from None
        if not 1 <= limit <= MAX_SLOW_QUERIES:
            raise ApiError(400, f"'limit' must be in [1, {MAX_SLOW_QUERIES}]", param="limit")
        records = await run_in_threadpool(slow_queries_reader, limit)  # SQLite blocks
        return json_response({"data": [dataclasses.asdict(r) for r in records]})

    async def tokenize(request: Request) -> Response:
        body = parse_model(TokenizeBody, await read_json(request, limits))
        generations.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send either 'prompt' or 'messages'", param="prompt")
        if body.messages is None:
            text, special = body.prompt, body.add_special_tokens is not False
        else:  # vLLM: a chat template writes its own special tokens
            text = render_messages(template, body.messages, body.add_generation_prompt,
                                   body.continue_final_message)
            special = body.add_special_tokens is True
        tokens = generations.token_ids(text or "", add_special_tokens=special)
        pieces = ([loop.engine.tokenizer.piece(t) for t in tokens] if body.return_token_strs
                  else None)
        return JSONResponse({"count": len(tokens), "max_model_len": loop.engine.max_model_len,
                             "tokens": tokens, "token_strs": pieces})

    async def detokenize(request: Request) -> Response:
        body = parse_model(DetokenizeBody, await read_json(request, limits))
        generations.check_model(body.model)
        vocab = loop.engine.model_config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocab})",
                           param="tokens")
        return JSONResponse({"prompt": loop.engine.tokenizer.decode(body.tokens)})

    async def version(_request: Request) -> Response:
        return JSONResponse({"version": importlib.metadata.version("tokenflow")})

    routes = [
        Route("/v1/completions", completions.handle, methods=["POST"]),
        Route("/v1/chat/completions", chat.handle, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/stats", stats, methods=["GET"]),
        Route("/v1/admin/config", get_config, methods=["GET"]),
        Route("/v1/admin/config", patch_config, methods=["PATCH"]),
        Route("/v1/admin/pause", pause_or_resume(loop.pause), methods=["POST"]),
        Route("/v1/admin/resume", pause_or_resume(loop.resume), methods=["POST"]),
        Route("/v1/slow_queries", slow_queries, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={ApiError: api_error_handler,
                                                        HTTPException: _http_error},
                     middleware=[Middleware(HostAllowList, allowed=allowed_hosts)])



async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, wrong method) in the OpenAI error body."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.url.path!r}; see GET /v1/models and docs/serve.md"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path!r}"
    else:
        message = str(exc.detail)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return ApiError(exc.status_code, message, kind=kind, headers=dict(exc.headers or {})
                    ).response()
