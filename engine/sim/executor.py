"""The simulated executor: the model runner's surface, no model behind it, on the engine's clock."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.batch import Batch, ModelRunnerOutput, StepShape
from engine.clock import SIM_SPEEDS, VirtualClock
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.model.loader import model_config_for, tokenizer_for
from engine.ops.equipped import Engine
from engine.sim.target import SimTarget

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PacedClock:
    """Simulated seconds at `speed` times wall-clock pace. While the engine has work the clock
    holds at its last step's end, so this host's own time (scheduling, bookkeeping, the
    console) is never simulated time: a host that cannot keep pace slows the pace, never the
    steps or the waits between them. Idle, it runs with the wall clock from where it held."""

    def __init__(self, speed: float = 1.0, *, wall: Callable[[], float] = time.monotonic,
                 pause: Callable[[float], None] = time.sleep) -> None:
        if not SIM_SPEEDS[0] <= speed <= SIM_SPEEDS[1]:
            raise EngineError(f"simulation speed must be in [{SIM_SPEEDS[0]:g}, "
                              f"{SIM_SPEEDS[1]:g}], got {speed}")
        self.speed = speed
        self._wall, self._pause = wall, pause
        self._origin = wall()
        # simulated seconds the wall clock ran while the clock held
        self._held_back = 0.0
        self._held: float | None = None
        self._last = self._free()
        self._busy: Callable[[], bool] = lambda: False
        self._unpaced = False
        self._lock = threading.Lock()

    @contextmanager
    def unpaced(self) -> Iterator[None]:
        """Within the block the clock holds and steps take no wall time: the twin's own
        calibration sweep is simulated time only, and the panes wait on no GPU."""
        busy, self._busy = self._busy, lambda: True
        self._unpaced = True
        try:
            yield
        finally:
            self._busy, self._unpaced = busy, False

    def hold_while(self, busy: Callable[[], bool]) -> None:
        """Hold between steps while `busy()`: the engine has unfinished requests to step (and,
        under a loop, the loop is not paused)."""
        self._busy = busy

    def _free(self) -> float:
        return self._origin + (self._wall() - self._origin) * self.speed - self._held_back

    def __call__(self) -> float:
        with self._lock:
            if self._busy():
                if self._held is None:  # work came: the time last read, its arrival's
                    self._held = self._last
                return self._held
            if self._held is not None:  # idle again: the wall clock goes on from the hold
                self._held_back += self._free() - self._held
                self._held = None
            self._last = self._free()
            return self._last

    def advance_to(self, t: float) -> None:
        ahead = t - self._free()
        if ahead > 0 and not self._unpaced:
            self._pause(ahead / self.speed)
        with self._lock:
            self._held = t if self._held is None else max(self._held, t)

    def sleep(self, seconds: float) -> None:
        self._pause(max(0.0, seconds) / self.speed)


Clock = VirtualClock | PacedClock


@dataclass(frozen=True)
class SimulatedDevice:
    """Stands where a torch.device does: `type` is never "cuda", so nothing reaches for NVML."""

    label: str
    type: str = "sim"
    index: int | None = None

    def __str__(self) -> str:
        return self.label


class SimulatedExecutor:
    """The surface of ModelRunner that the engine uses, sized from the model's config."""

    def __init__(self, config: EngineConfig, target: SimTarget, clock: Clock) -> None:
        self.target = target
        self.clock = clock
        self.model_config = target.model_config or model_config_for(config.model)
        self.tokenizer = tokenizer_for(config.model, self.model_config)
        self.max_model_len = config.context_length(self.model_config.max_position_embeddings)
        self.device = SimulatedDevice(target.device, target.device_type)
        # the activations' precision by name: the twin holds no tensor, so it imports no torch
        self.dtype = target.dtype if target.dtype in ELEMENT_BYTES else "bfloat16"
        self.peaks = target.peaks
        self.block_size = config.block_size
        per_block = self.model_config.kv_bytes_per_token(self.bytes_per_element) * self.block_size
        self.num_blocks = target.kv_cache_bytes // per_block
        if self.num_blocks < 1:
            raise EngineError(f"the KV budget ({target.kv_cache_bytes} bytes) holds no block of "
                              f"{per_block} bytes; raise kv_cache_bytes or use a larger GPU")
        self._never = frozenset(self.model_config.eos_token_id)
        # the stop tokens of each request the scheduler's batches brought in, until it leaves
        self.stops: dict[str, tuple[int, ...]] = {}
        # the calibrated host's time after the last step: run_fleet moves a virtual clock on by it
        self.host_s = 0.0

    @property
    def bytes_per_element(self) -> int:
        if self.target.kv_bytes_per_element is not None:
            return self.target.kv_bytes_per_element
        return ELEMENT_BYTES[self.dtype]

    def zero_blocks(self, blocks: list[int]) -> None:
        """There is no KV tensor to zero; allocation is still the block manager's."""

    def move_blocks(self, source: list[int], target: list[int]) -> None:
        """Compaction renumbers block tables (the block manager's); no KV rows to move."""

    def run(self, batch: Batch) -> ModelRunnerOutput:
        """Advance the clock by the predicted step time; a placeholder token per sampling chunk."""
        stops = self.stops
        for request_id in (*batch.finished, *batch.preempted):
            stops.pop(request_id, None)
        for new in batch.new_requests:
            stops[new.id] = new.params.stop_token_ids
        if not (batch.prefills or batch.decodes):
            return ModelRunnerOutput()
        start = self.clock()
        shape = batch.shape()
        target = self.target
        seconds = target.predict(shape)
        served, drift = target.served, target.drift
        if served is not None:
            self.host_s = served.host_seconds(shape)
        if drift is not None:
            seconds *= drift.prefill if shape.prefill else drift.decode
        elif served is not None:
            seconds = served.forward_seconds(shape, seconds)
        self.clock.advance_to(start + seconds)
        vocab, never = self.model_config.vocab_size, self._never
        tokens = {}
        for c in batch.sampling:
            # a deterministic token that never ends a request early, as in ignore-EOS workloads
            token, stop = (c.start + c.num_tokens) % vocab, stops[c.request_id]
            while token in never or token in stop:
                token = (token + 1) % vocab
            tokens[c.request_id] = token
        return ModelRunnerOutput(token_ids=tokens)


@dataclass(frozen=True)
class Simulation:
    """A live simulated engine: target spec, tensor-parallel GPUs, simulated seconds per second,
    the KV cache's precision and a profile file over (or beside) the shipped ones."""

    target: str
    tp: int = 1
    speed: float = 1.0
    kv_cache_dtype: str = "auto"
    gpu_profile: Path | None = None


class _LastShape:
    """Keeps its answer for the last shape it priced (by identity), so a step is priced once."""

    def __init__(self, predict: Callable[[StepShape], float]) -> None:
        self._predict = predict
        # one tuple, swapped whole: another thread never pairs a shape with another's time
        self._last: tuple[StepShape | None, float] = (None, 0.0)

    def __call__(self, shape: StepShape) -> float:
        last = self._last
        if last[0] is shape:
            return last[1]
        seconds = self._predict(shape)
        self._last = (shape, seconds)
        return seconds


def simulated_engine(config: EngineConfig, target: SimTarget, clock: Clock) -> Engine:
    """An Engine whose runner is simulated, budgeting with the target's own step times."""
    target = dataclasses.replace(target, predict=_LastShape(target.predict))
    engine = Engine(config, runner=SimulatedExecutor(config, target, clock), clock=clock)
    if isinstance(clock, PacedClock):
        clock.hold_while(engine.has_unfinished)
    if target.calibration is not None:
        engine.apply_calibration(target.calibration)
    engine.scheduler.controller.price_with(target.predict)
    return engine
