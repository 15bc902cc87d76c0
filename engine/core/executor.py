"""What the engine needs of an executor other than its own ModelRunner: the surface the
simulated executor (engine.sim) provides. After a step it hands back sampled tokens, not
logits, and it brings the peaks of the device it stands for."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.budget.peaks import DevicePeaks
from engine.core.scheduler import Batch
from engine.model.config import ModelConfig
from engine.model.tokenizer import Tokenizer


class StepOutput(Protocol):
    @property
    def token_ids(self) -> dict[str, int]: ...  # request id -> its sampled token


class Device(Protocol):
    @property
    def type(self) -> str: ...


class Executor(Protocol):
    device: Device
    dtype: torch.dtype
    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    num_blocks: int
    block_size: int
    peaks: DevicePeaks

    @property
    def bytes_per_element(self) -> int: ...

    def zero_blocks(self, blocks: list[int]) -> None: ...

    def run(self, batch: Batch) -> StepOutput: ...
