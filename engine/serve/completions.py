"""POST /v1/completions, OpenAI-compatible as vLLM is, and the machinery chat shares."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.batch import TokenLogprob
from engine.config import INT64_MAX, ConfigError, SamplingParams
from engine.core.engine_core import RequestOutput
from engine.core.request import SCORE_TAG, RequestState
from engine.errors import RequestError
from engine.model.detokenizer import IncrementalDetokenizer
from engine.serve.loop import EngineLoop
from engine.serve.mailbox import Mailbox
from engine.serve.memory import IdleTrim
from engine.serve.outputs import coalesced
from engine.serve.protocol import (
    ApiError,
    BodyLimits,
    CompletionBody,
    SamplingFields,
    read_model,
)
from engine.serve.sampling import (
    DEFAULT_MAX_TOKENS,
    SamplingDefaults,
    load_defaults,
    sampling_params,
)
from engine.serve.shares import RequestShare
from engine.serve.turns import ClientTurns

RETRY_AFTER_S = 1
ERROR_CHECK_S = 1.0
JOURNAL_WAIT_S = 10.0
FINISH_REASONS = {"stop": "stop", "length": "length", "aborted": "abort"}
MIN_LOGPROB = -9999.0  # vLLM's floor: JSON has no -inf
# An answer of this many entries (answer_entries) or more is built on the answer thread.
OFF_LOOP_ENTRIES = 4096
ANSWER_THREAD = "tokenflow-answers"


@dataclass(frozen=True)
class Generation:
    """What one HTTP request asks of the engine: `n` choices of each prompt, in order."""

    prompts: list[list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    max_model_len: int
    priority: int = 0  # the engine's: higher goes first

    def choices(self) -> list[tuple[list[int], SamplingParams]]:
        """(prompt, params) per choice, choice i from prompt i // n; ApiError(400): a bad seed
        or a prompt that fills the context. max_tokens is cut to what the context leaves.
        Only a prompt's first choice scores it (prompt_logprobs): its n choices share one
        prompt, and the others then share its prefix-cached blocks instead of prefilling
        and scoring it again."""
        seed = self.params.seed
        try:
            per_choice = [self.params if seed is None or j == 0
                          else dataclasses.replace(self.params, seed=seed + j)
                          for j in range(self.n)]
        except ConfigError as exc:
            raise ApiError(400, f"'seed' + n - 1 {exc.message}", param="seed") from None
        if self.params.prompt_logprobs is not None:
            per_choice[1:] = [dataclasses.replace(params, prompt_logprobs=None)
                              for params in per_choice[1:]]
        return [(prompt, self._fitted(params, len(prompt)))
                for prompt in self.prompts for params in per_choice]

    def _fitted(self, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
        """vLLM's get_max_tokens: the prompt must leave room, and max_tokens takes what is left."""
        if prompt_tokens >= self.max_model_len:
            raise context_length_error(self.max_model_len, prompt_tokens)
        left = self.max_model_len - prompt_tokens
        if params.max_tokens <= left:
            return params
        try:
            return dataclasses.replace(params, max_tokens=left)
        except ConfigError as exc:  # min_tokens over what the context leaves
            raise ApiError(400, f"'{exc.field}' {exc.message} ({left}, what the context "
                                "leaves after the prompt)", param=exc.field) from None


def context_length_error(max_model_len: int, prompt_tokens: int) -> ApiError:
    """vLLM's words, status, type and param: LiteLLM maps them to ContextWindowExceededError."""
    return ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                         f"However, your prompt contains {prompt_tokens} input tokens, which "
                         "exceeds this limit even without any output tokens. Please reduce the "
                         f"length of the input prompt. (parameter=input_tokens, "
                         f"value={prompt_tokens})",
                    kind="BadRequestError", param="input_tokens")


@dataclass
class Choice:
    """One choice's output so far: the engine's outputs carry new tokens, this keeps them all.
    A prompt's later choices read its logprobs from its first (`scorer`), which alone scores
    it (Generation.choices)."""

    index: int
    prompt: list[int]
    output: RequestOutput | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # None: not asked for
    scorer: Choice | None = None
    scored: tuple[TokenLogprob, ...] | None = None

    def add(self, output: RequestOutput) -> None:
        self.output = output
        self.token_ids += output.new_token_ids
        if output.logprobs is not None:
            self.logprobs = self.logprobs or []
            self.logprobs += output.logprobs
        if output.prompt_logprobs is not None:
            self.scored = output.prompt_logprobs

    @property
    def prompt_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        return self.scored if self.scorer is None else self.scorer.scored

    @property
    def awaits_scorer(self) -> bool:
        """Whether the prompt's logprobs this choice shows are not in yet: its scorer's first
        output, which carries them, has not come."""
        return self.scorer is not None and self.scorer.output is None

    @property
    def finish_reason(self) -> str | None:
        return None if self.output is None else self.output.finish_reason


class ReplyFormat(Protocol):
    """How an endpoint renders choices: streamed chunks and the final body."""

    id: str
    texts: Texts

    def chunk(self, choice: Choice, text: str, tokens: list[int],
              logprobs: Sequence[TokenLogprob], first: bool) -> dict[str, Any]: ...

    def final(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]: ...

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]: ...


class _Bridge:
    """Engine-thread outputs of one choice, in order onto the HTTP request's shared queue
    through the step's mailbox; with `final_only`, only the last crosses, the choice gathered
    on the engine thread."""

    def __init__(self, choice: Choice, queue: asyncio.Queue[tuple[int, RequestOutput]],
                 on_finish: Callable[[], None], final_only: bool, mailbox: Mailbox) -> None:
        self.choice = choice
        self.mailbox = mailbox
        self.queue = queue
        self.on_finish = on_finish
        self.final_only = final_only

    def push(self, output: RequestOutput) -> None:  # on the engine thread
        if self.final_only:
            self.choice.add(output)
        if output.finished:
            self.mailbox.post(self.on_finish)
        if output.finished or not self.final_only:
            self.mailbox.post(self.queue.put_nowait, (self.choice.index, output))


class Generations:
    """The engine side of both endpoints, with its admission state."""

    def __init__(self, engine_loop: EngineLoop, *, max_queue: int, limits: BodyLimits,
                 share: RequestShare, turns: ClientTurns | None = None) -> None:
        self.engine_loop = engine_loop
        self.max_queue = max_queue
        self.turns = turns or ClientTurns()
        self.limits = limits
        self.share = share
        self.in_flight = 0
        self.queue_full = 0  # requests refused with 429: vLLM's admission_rejections
        self.trim = IdleTrim()
        self.defaults: SamplingDefaults = load_defaults(engine_loop.engine.config.model)
        self._mailbox: Mailbox | None = None
        # large answers are built one at a time on a thread of their own: four built at once
        # on the worker pool each took the GIL in turn with the engine's thread and the event
        # loop, so every other client waited behind all four
        self.answers = ThreadPoolExecutor(1, thread_name_prefix=ANSWER_THREAD)

    @property
    def served(self) -> str:
        return self.engine_loop.engine.config.model

    def mailbox(self) -> Mailbox:
        """The running asyncio loop's mailbox, sent once a step by the engine loop (a new
        loop, as a restarted test client's, gets a new one)."""
        aio = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.aio is not aio:
            if self._mailbox is not None:
                self.engine_loop.outputs.remove_sender(self._mailbox.send)
            self._mailbox = Mailbox(aio)
            self.engine_loop.outputs.add_sender(self._mailbox.send)
        return self._mailbox

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served:
            raise ApiError(404, f"model {model!r} is not served here; use {self.served!r}",
                           kind="not_found_error", param="model")

    def token_ids(self, prompt: str | list[int], param: str = "prompt",
                  keep: int | None = None, add_special_tokens: bool = False) -> list[int]:
        """The prompt's token ids, cut to the last `keep` (vLLM's truncate_prompt_tokens)."""
        try:
            tokens = self.engine_loop.engine.prompt_token_ids(
                prompt, add_special_tokens=add_special_tokens)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=param) from None
        if keep is None:
            return tokens
        max_len = self.engine_loop.engine.max_model_len
        if keep == -1:
            keep = max_len
        if keep < 1:
            raise ApiError(400, "'truncate_prompt_tokens' must be at least 1, or -1 for the "
                                "model's context length", param="truncate_prompt_tokens")
        if keep > max_len:
            raise ApiError(400, f"'truncate_prompt_tokens' {keep} is greater than the context "
                                f"length {max_len}; select a smaller truncation size",
                           param="truncate_prompt_tokens")
        return tokens[-keep:]

    def check_fields(self, body: SamplingFields, prompts: int) -> int:
        """The request's engine priority, once its share and fields pass (ApiError(400))."""
        self.share.check_fields(body, prompts)
        priority = body.priority or 0
        if not -INT64_MAX <= priority <= INT64_MAX:
            raise ApiError(400, f"'priority' must be in [-{INT64_MAX}, {INT64_MAX}]",
                           param="priority")
        return -priority  # vLLM's: a lower value is served first; the engine's is the reverse

    def params(self, body: SamplingFields, max_tokens: int | None, **logprobs: int | None
               ) -> SamplingParams:
        return sampling_params(body, self.defaults, self.engine_loop.engine.model_config
                               .vocab_size, max_tokens=max_tokens, **logprobs)

    async def run(self, request: Request, generation: Generation, reply: ReplyFormat,
                  tag: str | None = None) -> Response:
        """Submit every choice and answer: one JSON body, or SSE chunks as tokens come."""
        engine = self.engine_loop.engine
        self.share.check_logprobs(generation.prompts, generation.params, generation.n,
                                  engine.max_model_len)
        choices = generation.choices()
        for prompt, params in choices:
            reason = engine.rejection_reason(len(prompt), params.max_tokens)
            if reason:
                raise ApiError(422, reason, param="prompt")
        self._admit(len(choices))
        address = request.client.host if request.client is not None else ""
        self.in_flight += len(choices)  # waiting for its address's turn counts as in flight
        try:
            await self.turns.take(address, len(choices))
        except BaseException:
            self.in_flight -= len(choices)
            raise
        release = functools.partial(self._release, address)
        queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        request_ids: list[str] = []
        chosen = [Choice(index, prompt) for index, (prompt, _) in enumerate(choices)]
        mailbox = self.mailbox()
        if generation.params.prompt_logprobs is not None:
            for choice in chosen:
                if choice.index % generation.n:
                    choice.scorer = chosen[choice.index - choice.index % generation.n]
        try:
            base = reply.id.split("-", 1)[1]
            for index, (prompt, params) in enumerate(choices):
                bridge = _Bridge(chosen[index], queue, release,
                                 final_only=not generation.stream, mailbox=mailbox)
                request_ids.append(self.engine_loop.submit(
                    prompt, params, tag=tag, on_output=bridge.push,
                    priority=generation.priority,
                    request_id=base if len(choices) == 1 else f"{base}-{index}"))
        except BaseException:
            for _ in range(len(choices) - len(request_ids)):  # never submitted: never finish
                release()
            for request_id in request_ids:
                self.engine_loop.abort(request_id)
            raise
        for _ in generation.prompts:  # vLLM's request_params_n: one per prompt, its n choices
            engine.metrics.observe_n(generation.n)  # type: ignore[attr-defined]
        if generation.stream:
            events = self._events(request_ids, queue, chosen, reply, reply.texts,
                                  generation)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._complete(request, request_ids, queue, chosen, reply,
                                    generation.n)

    def _admit(self, count: int) -> None:
        if self.engine_loop.error is not None:
            self.engine_loop.failed_while_down += 1
            raise _engine_down(self.engine_loop)
        if self.in_flight + count > self.max_queue:
            self.queue_full += 1
            raise ApiError(429, f"the server queue is full ({self.in_flight} of "
                                f"{self.max_queue} requests in flight, this one needs "
                                f"{count}); retry after {RETRY_AFTER_S} s",
                           kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})

    def _release(self, address: str) -> None:
        self.in_flight -= 1
        self.turns.give_back(address)
        if self.in_flight == 0:
            self.trim.idle()

    async def _next(self, queue: asyncio.Queue[tuple[int, RequestOutput]]
                    ) -> tuple[int, RequestOutput]:
        """The next output of any choice; a dead engine thread never sends one, so check it.
        A timeout scope, not wait_for: no task a wait, which each stream paid once a step."""
        while True:
            try:
                async with asyncio.timeout(ERROR_CHECK_S):
                    return await queue.get()
            except TimeoutError:
                if self.engine_loop.error is not None:
                    raise _engine_down(self.engine_loop) from None

    async def _complete(self, request: Request, request_ids: list[str],
                        queue: asyncio.Queue[tuple[int, RequestOutput]],
                        choices: list[Choice], reply: ReplyFormat, n: int) -> Response:
        finals: dict[int, RequestOutput] = {}

        async def collect() -> None:
            while len(finals) < len(request_ids):
                index, output = await self._next(queue)
                finals[index] = output

        disconnect = asyncio.create_task(_disconnected(request))
        result = asyncio.create_task(collect())
        try:
            await asyncio.wait({disconnect, result}, return_when=asyncio.FIRST_COMPLETED)
            if not result.done():
                for index, request_id in enumerate(request_ids):
                    if index not in finals:
                        self.engine_loop.abort(request_id)
                return Response(status_code=499)
            result.result()
        finally:
            disconnect.cancel()
            result.cancel()
        for output in finals.values():
            _raise_if_refused(self.engine_loop, output)
        await _journaled(self.engine_loop)
        def build() -> bytes:
            return _json_bytes(reply.final(choices, _usage(choices, n)))

        # a large answer (logprobs of many choices) is built off the event loop; a small one
        # on it, where another thread's two hand-offs would cost more than building it
        body = (build() if answer_entries(choices) < OFF_LOOP_ENTRIES
                else await asyncio.get_running_loop().run_in_executor(self.answers, build))
        return Response(body, media_type="application/json")

    async def _events(self, request_ids: list[str],
                      queue: asyncio.Queue[tuple[int, RequestOutput]],
                      choices: list[Choice], reply: ReplyFormat,
                      texts: Texts, generation: Generation) -> AsyncIterator[str]:
        """One SSE chunk per choice per step's output (see Texts). What a slow client or a busy
        event loop left queued goes as one chunk a choice (`coalesced`): the loop formats and
        sends once what the engine made in several steps, and falls no further behind."""
        started: set[int] = set()
        finished: set[int] = set()
        parked: dict[int, list[tuple[int, RequestOutput]]] = {}  # by scorer: until it is heard
        try:
            while len(finished) < len(request_ids):
                waiting = [await self._next(queue)]
                while not queue.empty():
                    waiting.append(queue.get_nowait())
                ready: list[tuple[int, RequestOutput]] = []
                for heard in coalesced(waiting):
                    _raise_if_refused(self.engine_loop, heard[1])
                    scorer = heard[0] - heard[0] % generation.n
                    # a scorer heard in this same batch goes out first: no need to park
                    if choices[heard[0]].awaits_scorer and all(i != scorer for i, _ in ready):
                        parked.setdefault(scorer, []).append(heard)
                    else:
                        ready += coalesced([heard, *parked.pop(heard[0], ())])
                for index, output in ready:
                    if index not in started or output.finished:
                        await _journaled(self.engine_loop)
                    choice = choices[index]
                    choice.add(output)
                    chunk = reply.chunk(choice, texts.delta(choice),
                                        list(output.new_token_ids), output.logprobs or (),
                                        first=index not in started)
                    if generation.continuous_usage:
                        chunk["usage"] = _usage([choice], 1)
                    yield _sse(chunk)
                    started.add(index)
                    if output.finished:
                        finished.add(index)
            if generation.include_usage:
                yield _sse(reply.usage_chunk(_usage(choices, generation.n)))
        except ApiError as exc:
            yield _sse({"error": json.loads(exc.response().body)["error"]})
        finally:
            for index, request_id in enumerate(request_ids):
                if index not in finished:
                    self.engine_loop.abort(request_id)
        yield "data: [DONE]\n\n"


class Texts:
    """A choice's text so far, less incomplete UTF-8 characters and possible stop strings.
    The token that stopped a choice (a stop token id, or EOS) has no text, as in vLLM, unless
    `include_stop_str_in_output`; its id stays in the token ids. Each choice's text is
    detokenized incrementally, so a streamed token costs the same however long the output."""

    def __init__(self, decode: Callable[[list[int]], str], params: SamplingParams,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.decode = decode
        stops = params.stop
        self.holdback = (max(map(len, stops)) - 1
                         if stops and not params.include_stop_str_in_output else 0)
        self.silent_stops = frozenset(() if params.include_stop_str_in_output else (
            *params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)))
        self._read: dict[int, IncrementalDetokenizer] = {}  # by choice index
        self._sent: dict[int, int] = {}  # characters streamed, by choice index

    def delta(self, choice: Choice) -> str:
        """The text to stream for `choice` since the last call: the new complete characters,
        less the stop strings' holdback while the choice runs; its cut text once it ends."""
        read = self._fed(choice)
        output = choice.output
        if output is not None and (output.text_end is not None or output.finished):
            text = self.final(choice)
            new, self._sent[choice.index] = text[self._sent[choice.index]:], len(text)
            return new
        sent = self._sent[choice.index]
        pending = read.pending().rstrip("\ufffd")
        end = read.length + len(pending) - self.holdback
        if end <= sent:
            return ""
        self._sent[choice.index] = end
        start = min(sent, read.length)  # what was sent may reach into the pending characters
        return (read.since(start) + pending)[sent - start:end - start]

    def visible(self, choice: Choice) -> str:
        """The choice's text so far, less the stop strings' holdback while it runs."""
        text = self.final(choice)
        output = choice.output
        if output is not None and output.text_end is None and not output.finished \
                and self.holdback:
            return text[:max(0, len(text) - self.holdback)]
        return text

    def final(self, choice: Choice) -> str:
        text_end = None if choice.output is None else choice.output.text_end
        read = self._fed(choice)
        # only the unfinished tail is held back: what the detokenizer took was already streamed
        text = read.text + read.pending().rstrip("\ufffd")
        return text if text_end is None else text[:text_end]

    def _fed(self, choice: Choice) -> IncrementalDetokenizer:
        """The choice's detokenizer, given the tokens it has not read (but a silent stop)."""
        tokens = choice.token_ids
        read = len(tokens)
        if (choice.output is not None and choice.output.text_end is None and tokens
                and tokens[-1] in self.silent_stops and choice.finish_reason == "stop"):
            read -= 1
        detokenizer = self._read.get(choice.index)
        if detokenizer is None:
            detokenizer = self._read[choice.index] = IncrementalDetokenizer(self.decode,
                                                                            choice.prompt)
            self._sent[choice.index] = 0
        detokenizer.extend(tokens[len(detokenizer.tokens):read])
        return detokenizer


def answer_entries(choices: Sequence[Choice]) -> int:
    """What building an answer costs, in entries: each choice's prompt and output tokens,
    and each logprob alternative it shows. Read from counts, not by walking the entries."""
    total = 0
    for choice in choices:
        total += len(choice.prompt) + len(choice.token_ids)
        for entries in (choice.logprobs, choice.prompt_logprobs):
            if entries:
                total += len(entries) * (1 + len(entries[-1].top))
    return total


def _usage(choices: list[Choice], n: int) -> dict[str, int]:
    """Prompt tokens once per prompt (its n choices share it), as vLLM counts them."""
    prompt_tokens = sum(len(c.prompt) for c in choices if c.index % n == 0)
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


class Completions:

    def __init__(self, generations: Generations) -> None:
        self.generations = generations

    async def handle(self, request: Request) -> Response:
        g = self.generations
        body = await read_model(request, CompletionBody, g.limits)
        g.check_model(body.model)
        priority = g.check_fields(body, len(body.prompts()))
        echo = body.echo is True
        if body.max_tokens == 0 and not echo:
            raise ApiError(400, "'max_tokens' 0 generates nothing: add \"echo\": true to score "
                                "the prompt, or ask for at least 1 token", param="max_tokens")
        # vLLM's CompletionRequest defaults max_tokens to 16, so generation_config.json's
        # max_new_tokens never applies here
        params = g.params(body, DEFAULT_MAX_TOKENS if body.max_tokens is None
                          else body.max_tokens, logprobs=body.logprobs,
                          prompt_logprobs=(body.prompt_logprobs if body.prompt_logprobs
                                           is not None else body.logprobs if echo else None))
        prompts = [g.token_ids(p, keep=body.truncate_prompt_tokens,
                               add_special_tokens=body.add_special_tokens is not False)
                   for p in body.prompts()]
        generation = Generation(prompts, params, body.n or 1, body.stream is True,
                                include_usage(body), continuous_usage(body),
                                g.engine_loop.engine.max_model_len, priority)
        reply = _CompletionReply.new("cmpl", g, params, body, echo=echo,
                                     logprobs=body.logprobs is not None)
        return await g.run(request, generation, reply,
                           tag=SCORE_TAG if params.prefill_only else None)


def include_usage(body: SamplingFields) -> bool:
    options = body.stream_options
    return options is not None and options.include_usage is True


def continuous_usage(body: SamplingFields) -> bool:
    """vLLM's continuous_usage_stats, which counts only together with include_usage."""
    options = body.stream_options
    return include_usage(body) and options is not None and (
        options.continuous_usage_stats is True)


@dataclass(frozen=True)
class Reply:
    """What every reply of one HTTP request shares: id, model, creation time, decode, texts."""

    id: str
    model: str
    created: int
    decode: Callable[[list[int]], str]
    texts: Texts
    prompt_logprobs: bool
    token_text: Callable[[int], str]  # a token as logprobs name it

    @classmethod
    def new(cls, prefix: str, generations: Generations, params: SamplingParams,
            body: SamplingFields, **more: Any) -> Any:
        tokenizer = generations.engine_loop.engine.tokenizer
        decode = functools.partial(tokenizer.decode,
                                   skip_special_tokens=params.skip_special_tokens)

        @functools.cache  # the reply's own: a large answer names the same tokens again and again
        def token_text(token: int) -> str:
            return decode([token])

        def token_id_text(token: int) -> str:  # vLLM's return_tokens_as_token_ids
            return f"token_id:{token}"

        return cls(f"{prefix}-{uuid.uuid4().hex[:16]}", generations.served, int(time.time()),
                   decode, Texts(decode, params, tokenizer.eos_token_ids),
                   body.prompt_logprobs is not None,
                   token_id_text if body.return_tokens_as_token_ids else token_text, **more)


@dataclass(frozen=True)
class _CompletionReply(Reply):
    echo: bool = False
    logprobs: bool = False

    def _body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}

    def chunk(self, choice: Choice, text: str, tokens: list[int],
              logprobs: Sequence[TokenLogprob], first: bool) -> dict[str, Any]:
        entries = _scored(logprobs)
        if first and self.echo:  # the prompt leads the first chunk, as vLLM streams it
            text = self.decode(choice.prompt) + text
            tokens = choice.prompt + tokens
            entries = _prompt_scored(choice) + entries
        scored = completion_logprobs(entries, self.token_text) if self.logprobs else None
        return self._body([{"index": choice.index, "text": text, "token_ids": tokens,
                            "logprobs": scored,
                            "finish_reason": FINISH_REASONS.get(choice.finish_reason or "")}])

    def final(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]:
        rendered = []
        # a prompt's n choices show the same echo and prompt logprobs: rendered once, shared
        echoes: dict[int, tuple[str, dict[str, Any] | None]] = {}
        prompts: dict[int, list[dict[str, dict[str, Any]] | None]] = {}
        for choice in choices:
            first = choice.scorer or choice
            text = self.texts.final(choice)
            entries = _scored(choice.logprobs or ())
            scored = None
            if self.echo:
                if first.index not in echoes:
                    echoes[first.index] = (self.decode(first.prompt), completion_logprobs(
                        _prompt_scored(first), self.token_text) if self.logprobs else None)
                echoed, echoed_scored = echoes[first.index]
                if echoed_scored is not None:
                    scored = joined_logprobs(echoed_scored, completion_logprobs(
                        entries, self.token_text, offset=len(echoed)))
                text = echoed + text
            elif self.logprobs:
                scored = completion_logprobs(entries, self.token_text)
            extra = {}
            if self.prompt_logprobs:
                if first.index not in prompts:
                    prompts[first.index] = prompt_logprobs(first, self.token_text)
                extra["prompt_logprobs"] = prompts[first.index]
            rendered.append({"index": choice.index, "text": text,
                             "token_ids": list(choice.token_ids), "logprobs": scored,
                             "finish_reason": FINISH_REASONS.get(choice.finish_reason or ""),
                             **extra})
        return {**self._body(rendered), "usage": usage}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._body([]), "usage": usage}


Scored = list[tuple[int, TokenLogprob | None]]


def _scored(logprobs: Sequence[TokenLogprob]) -> Scored:
    return [(entry.token, entry) for entry in logprobs]


def _prompt_scored(choice: Choice) -> Scored:
    """An echoed prompt's tokens and logprobs, the first unscored; none if it was not scored."""
    if choice.prompt_logprobs is None:
        return []
    return [(choice.prompt[0], None), *_scored(choice.prompt_logprobs)]


def prompt_logprobs(choice: Choice, token_text: Callable[[int], str]
                    ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: logprob, rank, text}."""
    def logprob(token: int, value: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": max(value, MIN_LOGPROB), "rank": rank,
                "decoded_token": token_text(token)}

    scored: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in choice.prompt_logprobs or ():
        top = {str(token): logprob(token, value, rank)
               for rank, (token, value) in enumerate(entry.top, start=1)}
        top[str(entry.token)] = logprob(entry.token, entry.logprob, entry.rank)
        scored.append(top)
    return scored


def completion_logprobs(entries: Scored, token_text: Callable[[int], str], offset: int = 0
                        ) -> dict[str, Any]:
    """The completions API's logprobs object: per token its text, logprob, top N and offset
    (in the text, from `offset`)."""
    tokens, values, tops, offsets = [], [], [], []
    for token, entry in entries:
        text = token_text(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        top = {text: max(entry.logprob, MIN_LOGPROB)}
        for other, value in entry.top:
            top.setdefault(token_text(other), max(value, MIN_LOGPROB))
        values.append(max(entry.logprob, MIN_LOGPROB))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def joined_logprobs(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    """Two logprobs objects of consecutive text as one; the head's entries are shared."""
    return {key: head[key] + tail[key] for key in head}


def _json_bytes(data: Any) -> bytes:
    """UTF-8 JSON, as starlette's JSONResponse renders a body, by orjson: a JSON encoder holds
    the GIL while it runs, and the standard library's held the engine's thread and the event
    loop for 20-40 ms a choice of a large answer (orjson: 1 ms)."""
    return orjson.dumps(data)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {orjson.dumps(data).decode()}\n\n"


def _raise_if_refused(engine_loop: EngineLoop, output: RequestOutput) -> None:
    """A request the engine rejected or failed after admission becomes an HTTP error."""
    if output.state == RequestState.REJECTED.value:
        raise ApiError(422, output.finish_reason or "rejected by the engine", param="prompt")
    if output.state == RequestState.FAILED.value:
        raise ApiError(500, f"the request failed: {output.finish_reason}", kind="server_error")


async def _journaled(engine_loop: EngineLoop) -> None:
    """Wait until the journal holds everything the engine has published so far. The writer
    wakes this loop itself: a worker thread that only waited would take the interpreter's
    lock once more for each answer, behind the engine's steps."""
    served = engine_loop.journal_served
    if served is None:
        return
    loop = asyncio.get_running_loop()
    heard: asyncio.Future[bool] = loop.create_future()

    def settle(answerable: bool) -> None:
        if not heard.done():
            heard.set_result(answerable)

    def tell(answerable: bool) -> None:  # on the writer's thread
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, answerable)

    served(tell)
    try:
        async with asyncio.timeout(JOURNAL_WAIT_S):
            answerable = await heard
    except TimeoutError:
        answerable = False
    if not answerable:
        raise ApiError(503, f"the request journal did not commit within {JOURNAL_WAIT_S:g} s; "
                            "retry", kind="server_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)})


def _engine_down(engine_loop: EngineLoop) -> ApiError:
    return ApiError(503, f"the engine has stopped: {engine_loop.error}",
                    kind="server_error", headers={"Retry-After": str(RETRY_AFTER_S)})


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
