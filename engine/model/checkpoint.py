"""The checkpoint layout: which Hugging Face tensors make up our fused projections."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

# our fused projection -> its parts in a checkpoint, in the order they are stacked
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def fused_widths(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"qkv_proj": (q, kv, kv), "gate_up_proj": (config.intermediate_size,) * 2}


def to_ours(hf_name: str, config: ModelConfig) -> tuple[str, int | None]:
    name = hf_name.removeprefix("model.")
    if config.family.fused_checkpoint:
        return name, None
    for fused, parts in FUSED.items():
        for slot, part in enumerate(parts):
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), slot
    return name, None


def fused_part(param: torch.Tensor, name: str, slot: int, config: ModelConfig) -> torch.Tensor:
    """The rows of fused parameter `name` that hold part `slot` (a view, to copy into)."""
    widths = fused_widths(config)[_fused_of(name)]
    return param.narrow(0, sum(widths[:slot]), widths[slot])


def expected_parts(name: str, config: ModelConfig) -> list[str]:
    fused = _fused_of(name)
    if fused is None or config.family.fused_checkpoint:
        return [name]
    return [f"{name}#{slot}" for slot in range(len(FUSED[fused]))]


def to_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict in the checkpoint's names and layout (what transformers loads)."""
    widths = fused_widths(config)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        hf_name = name if name.startswith("lm_head") else "model." + name
        fused = _fused_of(name)
        if fused is None or config.family.fused_checkpoint:
            out[hf_name] = tensor
            continue
        for part, piece in zip(FUSED[fused], tensor.split(widths[fused]), strict=True):
            out[hf_name.replace(f".{fused}.", f".{part}.")] = piece
    return out


def _fused_of(name: str) -> str | None:
    return next((fused for fused in FUSED if f".{fused}." in name), None)
