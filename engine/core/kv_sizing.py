"""How many bytes a GPU's KV pool gets: what is left of the device once the weights, the worst
step the engine allows and its CUDA graphs have had theirs.

The warm-up step measures the dense half at the largest budget; the attention spikes that a
warm-up at position 0 never meets are counted from the model's shape: a later chunk's scores
over the deepest context (SDPA), the per-layer gather of the KV a step reads (SDPA decode,
the gathered FlexAttention view), and the sampler's rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kernels.attention import SCORE_BYTES, SCORE_ELEMENT_BYTES
from engine.model.config import ModelConfig

GIB = 2**30
# how much wider the padded decode gather is than the keys it holds (its groups pad to 1.25x)
DECODE_PADDING = 1.25
SAMPLER_FLOATS_PER_LOGIT = 8  # the sampler's [rows, vocab] temporaries, in float32 each


@dataclass(frozen=True)
class MemoryReading:
    """A device's memory in bytes after the warm-up step (free: once its scratch went back)."""

    total: int
    free: int
    activations: int  # the warm-up's peak over what stayed allocated


@dataclass(frozen=True)
class WorstStep:
    """The largest step the engine allows, whatever the live settings become."""

    tokens: int  # the live token budget's ceiling (max_num_batched_tokens_cap)
    context: int  # the deepest context: max_model_len
    rows: int  # the most rows a step samples: max_num_seqs, at most `tokens`
    attention: str  # flash, flex or torch: which of them gathers or scores what
    graph_tokens: int = 0  # the largest decode batch held as a CUDA graph (0: none)
    # what that graph's attention gathers and masks, whole tables wide (SDPA in a graph), in
    # bytes: the graphs' private pool keeps it, apart from the eager steps' memory
    graph_gather: int = 0


@dataclass(frozen=True)
class StepScratch:
    """The worst step's transient bytes: fixed ones, and the gather's share of the pool."""

    parts: dict[str, int]
    per_pool_byte: float  # gathered bytes per byte of KV pool (one layer's worth, padded)

    @property
    def fixed(self) -> int:
        return sum(self.parts.values())


def worst_step_scratch(mc: ModelConfig, element_bytes: int, worst: WorstStep) -> StepScratch:
    """The transient bytes of `worst` on a model shaped `mc` with `element_bytes` weights."""
    per_token = (mc.num_heads * mc.head_dim + 2 * mc.num_kv_heads * mc.head_dim
                 + 3 * mc.intermediate_size + 4 * mc.hidden_size) * element_bytes
    rows = min(worst.rows, worst.tokens)
    parts = {"dense": worst.tokens * per_token,
             "sampler": rows * mc.vocab_size * (SAMPLER_FLOATS_PER_LOGIT * 4 + element_bytes)}
    if worst.attention == "torch":  # a chunk at the deepest context: its scores, in slices
        chunk = min(worst.tokens, worst.context)
        scores = mc.num_heads * chunk * worst.context * SCORE_ELEMENT_BYTES
        parts["chunk_scores"] = (min(scores, SCORE_BYTES)
                                 + chunk * worst.context)  # and its bool mask
    if worst.graph_tokens:  # the graphs' private pool: their largest batch's temporaries
        parts["cuda_graphs"] = worst.graph_tokens * per_token + worst.graph_gather
    gathers = worst.attention in ("torch", "flex")
    return StepScratch(parts, DECODE_PADDING / mc.num_layers if gathers else 0.0)


@dataclass(frozen=True)
class KvBudget:
    bytes: int
    line: str  # the arithmetic, for the start-up log


def kv_budget(reading: MemoryReading, utilization: float, block_bytes: int,
              scratch: StepScratch | None = None) -> KvBudget:
    """`utilization` of the device's memory, less what is in use and the worst step's scratch
    (the measured warm-up peak where it is larger than the counted fixed part)."""
    scratch = scratch or StepScratch({}, 0.0)
    used = reading.total - reading.free
    fixed = max(reading.activations, scratch.fixed)
    left = max(0, int(reading.total * utilization) - used - fixed)
    budget = int(left / (1 + scratch.per_pool_byte))
    counted = ", ".join(f"{name} {size / GIB:.2f}" for name, size in scratch.parts.items())
    gather = (f" / (1 + {scratch.per_pool_byte:.3g} gathered per pool byte)"
              if scratch.per_pool_byte else "")
    line = (f"KV cache: {utilization:g} x {reading.total / GIB:.2f} GiB - "
            f"{used / GIB:.2f} GiB in use - {fixed / GIB:.2f} GiB worst step "
            f"(warm-up peak {reading.activations / GIB:.2f}"
            f"{'; ' + counted if counted else ''}){gather} = {budget / GIB:.2f} GiB, "
            f"{budget // block_bytes} blocks of {block_bytes / 2**20:.2f} MiB")
    return KvBudget(budget, line)


def read_cuda_memory(device: torch.device, warm_up: Callable[[], Callable[[], None]]
                     ) -> MemoryReading:
    """The device's memory around `warm_up`, which returns what frees its scratch memory."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    release = warm_up()
    torch.cuda.synchronize(device)
    activations = (torch.cuda.max_memory_allocated(device)
                   - torch.cuda.memory_allocated(device))
    release()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryReading(total=total, free=free, activations=activations)
