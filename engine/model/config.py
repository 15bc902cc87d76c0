"""The shape of a Llama-family model, the synthetic presets, and config.json parsing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str = "llama"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # llama3 scaling: factor, low/high_freq_factor, ...
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v bias
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    dtype: str = "float32"

    def num_params(self, include_embeddings: bool = True) -> int:
        h, dh = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_heads * dh, self.num_kv_heads * dh
        attn = h * q_out + 2 * h * kv_out + q_out * h
        if self.attention_bias:
            attn += q_out + 2 * kv_out
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        total = self.num_layers * per_layer + h
        if include_embeddings:
            embed = self.vocab_size * h
            total += embed if self.tie_word_embeddings else 2 * embed
        return total

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """k = 2 · L · H_kv · d_h · b (seed 003 §2)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element


# Synthetic presets: seeded random weights with these shapes and a byte-level tokenizer.
# tiny is for tests, small (~20M) the CPU console default, 150m for CPU benchmarks; the
# rest are the real shapes of Llama 3.2 1B, Llama 2 7B and Llama 3 8B for GPUs.
_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048),
    "small": ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=1408, num_layers=7,
                         num_heads=8, num_kv_heads=4, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=8192),
    "150m": ModelConfig(vocab_size=512, hidden_size=1024, intermediate_size=3072, num_layers=12,
                        num_heads=16, num_kv_heads=4, head_dim=64, tie_word_embeddings=True,
                        max_position_embeddings=8192),
    "1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                      num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
                      rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072,
                      tie_word_embeddings=True, dtype="bfloat16"),
    "7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                      num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096,
                      dtype="bfloat16"),
    "8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                      rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
                      max_position_embeddings=131072, dtype="bfloat16"),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown synthetic preset {name!r}; choose one of {', '.join(PRESETS)}"
        ) from None


def from_hf_config(path: Path) -> ModelConfig:
    """Parse config.json in both the older (torch_dtype, rope_theta) and newer
    (dtype, rope_parameters) forms written by transformers."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} not found: a model directory needs config.json") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}); re-export the model") from None
    architectures = raw.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in architectures
                 if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{path}: architecture {architectures or raw.get('model_type')} is not supported; "
            f"tokenflow runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or None
    if rope.get("rope_type") not in (None, "default"):
        scaling = rope
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ModelLoadError(f"{path}: rope scaling {scaling} is not supported (llama3 only)")
    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_scaling=dict(scaling) if scaling else None,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos_ids,
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
    )
