"""The `hf` baseline of `tokenflow bench`: Hugging Face transformers' `generate` in static
batches, on the same weights and the same requests (transformers is a benchmark and test
dependency, imported only here).

Static batching as a plain HF server does it: when the model is free it takes the requests
that have arrived (up to `batch_size`, waiting for the next arrival if none has), left-pads
them, and generates until the longest output of the batch is done. Token times come from a
logits processor, called once per generated position.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from engine.errors import EngineError
from engine.harness.driver import RequestRecord, RunResult
from engine.harness.workload import WorkloadRequest
from engine.model.config import ModelConfig
from engine.model.llama import LlamaModel


def hf_model(model: LlamaModel, config: ModelConfig) -> torch.nn.Module:
    """An HF LlamaForCausalLM / Qwen2ForCausalLM carrying our model's exact weights."""
    try:
        import transformers
    except ImportError:
        raise EngineError("the hf baseline needs transformers: pip install -e '.[dev]'") from None
    common = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                  intermediate_size=config.intermediate_size,
                  num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
                  num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
                  rms_norm_eps=config.rms_norm_eps,
                  max_position_embeddings=config.max_position_embeddings,
                  tie_word_embeddings=config.tie_word_embeddings, rope_theta=config.rope_theta,
                  rope_scaling=config.rope_scaling, pad_token_id=0)
    if config.architecture == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    hf.load_state_dict(_split_fused(model, config), strict=False)
    dtype = next(model.parameters()).dtype
    return hf.to(dtype=dtype, device=next(model.parameters()).device).eval()


def _split_fused(model: LlamaModel, config: ModelConfig) -> dict[str, torch.Tensor]:
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]),
                                   strict=True):
                state["model." + name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            gate, up = tensor.split(config.intermediate_size)
            state["model." + name.replace("gate_up_proj", "gate_proj")] = gate
            state["model." + name.replace("gate_up_proj", "up_proj")] = up
        elif name.startswith("lm_head"):
            state[name] = tensor
        else:
            state["model." + name] = tensor
    return state


class _StepClock:
    """A logits processor that only notes when each position's logits arrive."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(self.clock())
        return scores


def run_hf(model: torch.nn.Module, workload: list[WorkloadRequest], batch_size: int = 8,
           clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> RunResult:
    pending = deque(sorted(workload, key=lambda w: w.arrival_s))
    records: dict[str, RequestRecord] = {}
    device = next(model.parameters()).device
    start = clock()
    while pending:
        now = clock() - start
        if pending[0].arrival_s > now:
            sleep(pending[0].arrival_s - now)
            now = clock() - start
        batch = []
        while pending and len(batch) < batch_size and pending[0].arrival_s <= now:
            batch.append(pending.popleft())
        longest = max(len(w.prompt_token_ids) for w in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, item in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[row, longest - len(item.prompt_token_ids):] = torch.tensor(item.prompt_token_ids)
            mask[row, longest - len(item.prompt_token_ids):] = 1
        steps = _StepClock(clock)
        new_tokens = max(w.max_tokens for w in batch)
        with torch.inference_mode():
            out = model.generate(ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0, logits_processor=[steps])
        for row, item in enumerate(batch):
            record = RequestRecord(item.request_id, item.tenant, start + item.arrival_s,
                                   len(item.prompt_token_ids))
            record.token_ids = out[row, longest:longest + item.max_tokens].tolist()
            record.token_times = steps.times[:item.max_tokens]
            record.state = "FINISHED"
            records[item.request_id] = record
    return RunResult(records, [], clock() - start)
