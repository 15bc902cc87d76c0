"""The engine loop: intake, then schedule -> run -> update -> drain, on one thread."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from engine.batch import Batch, ModelRunnerOutput, RequestOutput, StepShape, StepTiming
from engine.budget.controller import BudgetController
from engine.budget.cost_model import BudgetModel
from engine.budget.predictor import StepTimePredictor, StepTimeRatio
from engine.clock import Clock
from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.core import intake, observation
from engine.core.block_manager import BlockManager
from engine.core.equipment import Equipment, GuardDecisions, GuardInputs
from engine.core.executor import Executor
from engine.core.request import Ending, Request, RequestState
from engine.core.scheduler import Scheduler
from engine.errors import RequestError
from engine.events import (
    ConfigChanged,
    EventBus,
    FailCause,
    GuardAction,
    PauseChanged,
    RequestAdded,
)
from engine.snapshot import Snapshot

__all__ = ["EngineCore", "RequestOutput"]

if TYPE_CHECKING:
    from engine.core.model_runner import ModelRunner


class EngineCore:
    def __init__(self, config: EngineConfig | None, equipment: Equipment, *,
                 clock: Clock = time.monotonic, runner: Executor | None = None) -> None:
        """`runner` swaps in a simulated executor (engine.sim); `clock` is then its clock."""
        config = config or EngineConfig()
        config.validate()
        self.config = config
        self.budget_ceiling = config.budget_ceiling()  # fixed at start, as the pool is
        self.clock = clock
        self.bus = EventBus(clock)
        # a simulated device's steps take simulated time: this machine's load is not theirs
        simulated = runner is not None  # asked before a runner of the real model is built
        if runner is None:
            # the model's code and torch, imported only by an engine that runs a model
            from engine.core.model_runner import ModelRunner
            runner = ModelRunner(config)
        self.runner: ModelRunner | Executor = runner
        self.model_config = self.runner.model_config
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = self.runner.max_model_len
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                   enable_caching=config.enable_prefix_caching)
        self.peaks = self.runner.peaks  # a model runner measures them before its KV pool
        model = BudgetModel(self.model_config, self.runner.bytes_per_element, self.peaks)
        # one KV block's bytes, from the model's shape: a simulated executor holds no KV tensor
        self.block_bytes = (self.model_config.kv_bytes_per_token(self.runner.bytes_per_element)
                            * self.runner.block_size)
        self.bandwidth = equipment.bandwidth(self.runner.device, self.peaks.bandwidth, clock)
        self.scheduler = Scheduler(config, self.blocks, self.bandwidth,
                                   BudgetController(model.predict, model), self.bus.publish,
                                   clock, watch=equipment.prefill_watch(self.bus.publish),
                                   eos_token_ids=self.tokenizer.eos_token_ids,
                                   max_model_len=self.max_model_len,
                                   decode=self.tokenizer.decode)
        self.metrics = equipment.metrics(config)
        # a run summarised from its own recorder alone (a simulated fleet's) stops them
        self.stop_metrics = self.metrics.subscribe_to(self.bus)
        self.host = equipment.host(clock, self.runner.device, simulated=simulated)
        self.held = False  # the operator's pause (a serving loop's), as the engine was told
        self.guards = equipment.guards(self.runner.device)
        self.guards.subscribe_to(self.bus)
        self._out_of_band: list[RequestOutput] = []  # ended outside a step, returned by the next
        self._config_lock = threading.Lock()
        self._pending_config: tuple[EngineConfig, str] | None = None
        self.stepping: tuple[str, ...] = ()

    @property
    def predict(self) -> Callable[[StepShape], float]:
        """The step-time predictor in force (the budget model's until a calibration)."""
        return self.scheduler.controller.predict

    @property
    def budget(self) -> BudgetModel:
        return self.scheduler.controller.model

    @property
    def step_ratio(self) -> StepTimeRatio:
        return self.scheduler.controller.step_ratio

    def add_request(self, prompt: Sequence[int] | str, params: SamplingParams | None = None, *,
                    tenant: str = "default", priority: int = 0, request_id: str | None = None,
                    tag: str | None = None, arrival: float | None = None,
                    generated: Sequence[int] = (), resumed: bool = False) -> str:
        """Queue a request (malformed: RequestError; unservable: REJECTED) with pre-crash tokens."""
        params = params or SamplingParams()
        try:  # the server checks this at its edge; the Python API and resumes meet it here
            params.check_vocab(self.model_config.vocab_size)
        except ConfigError as exc:
            raise RequestError(str(exc)) from None
        if params.structured_output is not None:
            # the grammar library, imported only by an engine asked for structured output
            from engine.core.logits_processors import check_grammar
            if error := check_grammar(params.structured_output):
                raise RequestError(
                    f"structured_output: llguidance refuses the grammar: {error}")
        token_ids = self.prompt_token_ids(prompt)
        already = self.prompt_token_ids(generated) if generated else []
        rid = request_id or uuid.uuid4().hex[:16]
        if rid in self.scheduler.requests:
            raise RequestError(f"request id {rid!r} is already in flight; use a unique id")
        request = Request(id=rid, prompt_token_ids=token_ids, params=params,
                          arrival=self.clock() if arrival is None else arrival, tenant=tenant,
                          priority=priority, tag=tag, output_token_ids=already,
                          resumed_tokens=len(already) if resumed else None)
        self.bus.publish(RequestAdded(request_id=rid, prompt_token_ids=tuple(token_ids),
                                      sampling=_params_dict(params), tenant=tenant,
                                      priority=priority, tag=tag,
                                      generated_token_ids=tuple(already)))
        rejection = self.rejection(len(token_ids), params.max_tokens)
        if rejection:
            self._owe(self.scheduler.end(Ending(request, RequestState.REJECTED,
                                                rejection.message, rejection.cause)))
            return rid
        self.scheduler.add(request)
        ended = self.scheduler.stop_reason(request, already[-1]) if already else None
        if ended:  # it had ended before the crash; only its record was lost
            self._owe(self.scheduler.end(Ending(request, RequestState.FINISHED, ended)))
        return rid

    def prompt_token_ids(self, prompt: Sequence[int] | str, *,
                         add_special_tokens: bool = False) -> list[int]:
        """Token ids of a prompt; RequestError if it is malformed (no state changes). Text gets
        the tokenizer's special tokens (its BOS) only with `add_special_tokens`."""
        return intake.prompt_token_ids(
            prompt, functools.partial(self.tokenizer.encode, add_special_tokens=add_special_tokens),
            self.model_config.vocab_size)

    def rejection(self, prompt_tokens: int, max_tokens: int) -> intake.Rejection | None:
        """Why a request of this size can never be served, or None (no engine work done)."""
        return intake.rejection(prompt_tokens, max_tokens, self.config, self.max_model_len,
                                self.blocks)

    def rejection_reason(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """`rejection`'s message alone (what the HTTP server answers with)."""
        rejection = self.rejection(prompt_tokens, max_tokens)
        return None if rejection is None else rejection.message

    def abort(self, request_id: str) -> bool:
        """End a live request at the client's word; False if it is not live."""
        return self._end(request_id, RequestState.FINISHED, "aborted")

    def fail(self, request_id: str, reason: str) -> bool:
        """Fail a live request for its own fault found outside the step; False if not live."""
        return self._end(request_id, RequestState.FAILED, reason, FailCause.FAULT)

    def _end(self, request_id: str, state: RequestState, reason: str,
             cause: FailCause | None = None) -> bool:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        self._owe(self.scheduler.end(Ending(request, state, reason, cause)))
        return True

    def _owe(self, output: RequestOutput | None) -> None:
        """Keep the output of a request ended between steps for the next step to return."""
        if output is not None:
            self._out_of_band.append(output)

    def restart(self, fail: Mapping[str, str] | None = None
                ) -> tuple[list[Request], list[RequestOutput]]:
        """After a half-done step: fail `fail`, empty the KV pool; returns (to resume, owed)."""
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                   enable_caching=self.config.enable_prefix_caching)
        kept, failed = self.scheduler.reset(self.blocks, fail or {})
        owed, self._out_of_band = self._out_of_band + failed, []
        self.stepping = ()
        return kept, owed

    def close(self) -> None:
        """Stop what runs beside the steps (the bandwidth sampler's thread, the host's NVML
        session); idempotent."""
        self.bandwidth.close()
        self.host.close()

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests) or bool(self._out_of_band)

    def generate(self, prompts: Sequence[Sequence[int] | str],
                 params: SamplingParams | None = None) -> list[list[int]]:
        results: dict[str, list[int]] = {self.add_request(p, params): [] for p in prompts}
        left = len(results)
        while left:
            for out in self.step():
                tokens = results.get(out.request_id)
                if tokens is None:
                    continue
                tokens += out.new_token_ids
                if out.finished:
                    if out.state != RequestState.FINISHED:
                        raise RequestError(f"request {out.request_id} {out.state}: "
                                           f"{out.finish_reason}")
                    left -= 1
        return list(results.values())

    def update_config(self, source: str = "api", **changes: object) -> EngineConfig:
        """Validate now (ConfigError), apply at the next step boundary; any thread."""
        with self._config_lock:
            base = self._pending_config[0] if self._pending_config else self.config
            candidate = base.replace(**changes)
            if candidate.max_num_batched_tokens > self.budget_ceiling:
                raise ConfigError("max_num_batched_tokens", (
                    f"must be at most {self.budget_ceiling}, the step the memory was sized "
                    "for; start with a larger max_num_batched_tokens_cap"))
            self._pending_config = (candidate, source)
            return candidate

    def apply_pending_config(self) -> None:
        """Make a validated update current; called at step boundaries (and by idle loops)."""
        if self._pending_config is None:  # most steps: no lock (one landing now waits a step)
            return
        with self._config_lock:  # taken and applied at once: a PATCH now is checked against it
            pending, self._pending_config = self._pending_config, None
            if pending is None:
                return
            new, source = pending
            old, self.config = self.config, new
        changed = {name: (getattr(old, name), getattr(new, name))
                   for name in new.live_values() if getattr(old, name) != getattr(new, name)}
        self.scheduler.set_config(new)
        if changed:
            self.bus.publish(ConfigChanged(changes=changed, source=source))
        if not new.chunked_prefill:  # a prefill over the new budget would wait forever
            for request in list(self.scheduler.requests.values()):
                left = request.num_pending
                if left > new.max_num_batched_tokens:
                    self._end(request.id, RequestState.FAILED, (
                        f"the config changed ({source}): chunked prefill off and "
                        f"max_num_batched_tokens {new.max_num_batched_tokens}, under the "
                        f"{left} tokens it has left to prefill"), FailCause.CONFIG)

    def apply_calibration(self, predictor: StepTimePredictor) -> None:
        """Budget prefill time with `predictor` and recommend C*; both switch at the next step."""
        self.scheduler.controller.calibrate(predictor.predict, predictor.budget_model(
            self.model_config, self.runner.bytes_per_element, self.peaks))

    @property
    def calibrated(self) -> bool:
        """Whether a calibrated predictor is applied: until then no budget_score or C*."""
        return self.scheduler.controller.calibrated

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: the outputs of the requests it moved or ended."""
        outputs = self._intake()
        batch = self.scheduler.schedule()
        if batch.prefills or batch.decodes:
            output, timing = self._run(batch)
            outputs += self.scheduler.update(batch, output, timing)
        self._drain()
        return outputs

    def _intake(self) -> list[RequestOutput]:
        self.stepping = ()
        self.apply_pending_config()
        outputs, self._out_of_band = self._out_of_band, []
        return outputs

    def _run(self, batch: Batch) -> tuple[ModelRunnerOutput, StepTiming]:
        self.stepping = tuple([c.request_id for c in batch.chunks])
        self.runner.zero_blocks(self.blocks.take_newly_allocated())
        predicted = self.predict(batch.shape())
        start = self.clock()
        output = self.runner.run(batch)
        end = self.clock()
        return output, StepTiming(end, end - start, predicted, self.host.mark(end))

    def _drain(self) -> None:
        self.bus.drain()
        s = self.scheduler
        fragmentation = (self.blocks.fragmentation(s.requests.values()) if self.stepping
                         else None)
        self._apply(self.guards.evaluate(GuardInputs(
            self.clock(), self.config, s.throttle_level, s.bandwidth_util, fragmentation)))
        self.bus.drain()

    def _apply(self, decisions: GuardDecisions) -> None:
        for request_id, reason in decisions.fail:
            self._end(request_id, RequestState.FAILED, reason, FailCause.CHUNK_TIMEOUT)
        if decisions.compact:
            moved = self.blocks.compact(list(self.scheduler.requests.values()),
                                        self.runner.move_blocks)
            detail = (f"fragmentation {self.guards.fragmentation:.0%}: compacted, "
                      f"{moved} KV blocks moved")
            if self.runner.device.type == "cuda":
                import torch
                torch.cuda.empty_cache()
                detail += ", torch.cuda.empty_cache()"
            self.bus.publish(GuardAction(layer="defrag", engaged=True, detail=detail,
                                         ts=self.clock()))
        self.scheduler.pause_prefill(decisions.prefill_paused)
        for event in decisions.events:
            self.bus.publish(event)

    def hold(self, held: bool) -> None:
        """The operator paused (or resumed) stepping: the time between is a pause, not a
        stall; called on the thread that steps the engine."""
        if held != self.held:
            self.held = held
            self.scheduler.watch.hold(self.clock(), held)
            self.scheduler.controller.paused()
            self.bus.publish(PauseChanged(paused=held, ts=self.clock()))  # stored for history

    def snapshot(self) -> Snapshot:
        return observation.snapshot(self)


def _params_dict(params: SamplingParams) -> dict[str, object]:
    """Every field, so a resumed request samples as it was asked to (tuples: JSON lists).
    Flat, not `dataclasses.asdict`: a validated SamplingParams holds only immutable values,
    so its deep copy would make equal ones."""
    return {name: getattr(params, name) for name in _PARAM_FIELDS}


_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
