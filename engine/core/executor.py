"""What the engine needs of an executor other than its own ModelRunner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from engine.batch import Batch, ModelRunnerOutput
from engine.budget.peaks import DevicePeaks
from engine.model.config import ModelConfig
from engine.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch


class Device(Protocol):
    @property
    def type(self) -> str: ...  # "cuda" switches on CUDA-only paths; a simulated one is not


class Executor(Protocol):
    device: Device
    dtype: torch.dtype | str  # a simulated executor names its precision
    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    num_blocks: int
    block_size: int
    peaks: DevicePeaks

    @property
    def bytes_per_element(self) -> int: ...

    def zero_blocks(self, blocks: list[int]) -> None: ...

    def move_blocks(self, source: list[int], target: list[int]) -> None: ...

    def run(self, batch: Batch) -> ModelRunnerOutput: ...
