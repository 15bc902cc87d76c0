"""Each request's output callback and what it has heard, delivered on the loop's thread;
outputs a consumer fell behind on, merged."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from engine.core.engine_core import EngineCore, RequestOutput
from engine.core.request import RequestState

OutputCallback = Callable[[RequestOutput], None]


def failed(request_id: str, reason: str) -> RequestOutput:
    """The last output of a request that ended outside the engine's steps."""
    return RequestOutput(request_id, (), True, reason, RequestState.FAILED.value)


def coalesced(outputs: Sequence[tuple[int, RequestOutput]]) -> list[tuple[int, RequestOutput]]:
    """(choice index, output) pairs with each choice's outputs merged into one, in the order of
    each choice's first: a stream behind its engine sends what piled up as one chunk instead of
    one a token, as vLLM's output collector merges outputs its consumer has not taken."""
    merged: dict[int, RequestOutput] = {}
    for index, output in outputs:
        earlier = merged.get(index)
        merged[index] = output if earlier is None else _joined(earlier, output)
    return list(merged.items())


def _joined(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: the tokens (and logprobs) of both, the
    prompt's logprobs of the first, the state, finish and text end of the second."""
    logprobs = (None if first.logprobs is None and then.logprobs is None
                else (*(first.logprobs or ()), *(then.logprobs or ())))
    return dataclasses.replace(
        then, new_token_ids=first.new_token_ids + then.new_token_ids, logprobs=logprobs,
        prompt_logprobs=(first.prompt_logprobs if first.prompt_logprobs is not None
                         else then.prompt_logprobs))


class Outputs:
    """The listeners of the requests submitted with a callback, by request id, and what
    sends their outputs on once delivered (`senders`, run by `sent`)."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self._listeners: dict[str, _Listener] = {}
        # replaced, never changed in place: the loop's thread reads it while others add
        self.senders: tuple[Callable[[], None], ...] = ()

    def add_sender(self, send: Callable[[], None]) -> None:
        self.senders = (*self.senders, send)

    def remove_sender(self, send: Callable[[], None]) -> None:
        self.senders = tuple(s for s in self.senders if s != send)

    def sent(self) -> None:
        """The outputs delivered so far go on: each sender passes its batch along."""
        for send in self.senders:
            send()

    def listen(self, request_id: str, callback: OutputCallback) -> None:
        self._listeners[request_id] = _Listener(callback)

    def deliver(self, output: RequestOutput) -> None:
        listener = self._listeners.get(output.request_id)
        if listener is None:
            return
        if output.finished:
            del self._listeners[output.request_id]
        try:
            listener.hear(output)
        except Exception as exc:  # a fault in one request's output fails that request alone
            self._listeners.pop(output.request_id, None)
            self.engine.fail(output.request_id, f"delivering its output failed: "
                                                f"{type(exc).__name__}: {exc}")

    def resumed(self, generated: Mapping[str, Sequence[int]]) -> list[RequestOutput]:
        """After a resume with these tokens per request: the outputs of those not yet heard."""
        return [output for rid, tokens in generated.items()
                if (listener := self._listeners.get(rid)) is not None
                and (output := listener.resumed(rid, tokens)) is not None]


class _Listener:
    """A request's callback and the tokens it heard: a resumed request may have more or fewer."""

    def __init__(self, callback: OutputCallback) -> None:
        self.callback = callback
        self.heard = 0
        self.repeats = 0  # tokens the resumed request generates again, already heard

    def hear(self, output: RequestOutput) -> None:
        if self.repeats:
            new = output.new_token_ids
            dropped = min(self.repeats, len(new))
            self.repeats -= dropped
            logprobs = output.logprobs
            output = dataclasses.replace(
                output, new_token_ids=new[dropped:],
                logprobs=None if logprobs is None else logprobs[dropped:])
        self.heard += len(output.new_token_ids)
        self.callback(output)

    def resumed(self, request_id: str, generated: Sequence[int]) -> RequestOutput | None:
        """After a resume with `generated`: an output of the tokens not yet heard, or None."""
        self.repeats = max(0, self.heard - len(generated))
        unheard = tuple(generated[self.heard:])
        if not unheard:
            return None
        return RequestOutput(request_id, unheard, False, None, RequestState.WAITING.value)
