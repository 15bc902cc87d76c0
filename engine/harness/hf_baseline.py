"""The `hf` baseline of `tokenflow bench`: transformers' `generate` in static batches."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from engine.errors import EngineError
from engine.harness.driver import RequestRecord, RunResult
from engine.harness.workload import WorkloadRequest
from engine.model.checkpoint import to_hf
from engine.model.config import ModelConfig
from engine.model.transformer import Transformer


def hf_model(model: Transformer, config: ModelConfig) -> torch.nn.Module:
    """The transformers model of `config`'s family carrying our model's exact weights."""
    try:
        import transformers
    except ImportError:
        raise EngineError("the hf baseline needs transformers: pip install -e '.[dev]'") from None
    family = config.family
    hf_config = getattr(transformers, family.hf_config)(**_hf_config_fields(config))
    hf = getattr(transformers, family.hf_architecture)(hf_config)
    result = hf.load_state_dict(to_hf(model.state_dict(), config), strict=False)
    missing = [key for key in result.missing_keys if "rotary" not in key]
    if missing or result.unexpected_keys:
        raise EngineError(f"the hf baseline's {family.hf_architecture} does not match our "
                          f"weights: missing {missing[:3]}, unexpected "
                          f"{result.unexpected_keys[:3]}")
    dtype = next(model.parameters()).dtype
    return hf.to(dtype=dtype, device=next(model.parameters()).device).eval()


def _hf_config_fields(config: ModelConfig) -> dict[str, Any]:
    family = config.family
    fields: dict[str, Any] = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        hidden_act=config.hidden_act, hidden_activation=config.hidden_act,
        sliding_window=config.sliding_window,
    )
    if family.name not in ("mistral", "phi3"):  # these put their window on every layer
        fields["layer_types"] = ["sliding_attention" if config.window(i) else "full_attention"
                                 for i in range(config.num_layers)]
        fields["use_sliding_window"] = bool(config.sliding_layers)
    if family.gemma:
        fields.update(query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
                      attn_logit_softcapping=config.attn_softcap,
                      final_logit_softcapping=config.final_softcap)
    if config.rope_local_theta is not None:
        fields["rope_local_base_freq"] = config.rope_local_theta
    return fields


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
        for row, item in enumerate(batch):
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
