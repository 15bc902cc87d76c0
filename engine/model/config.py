"""The shape of a model (any family in engine.model.family), the synthetic presets."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.model.family import BY_HF_ARCHITECTURE, FAMILIES, Family

ROPE_SCALINGS = ("llama3", "linear")


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
    rope_scaling: dict[str, Any] | None = None  # llama3 (factor, low/high_freq_factor, ...), linear
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    # Sliding window: a query at p sees keys in (p - window, p], on the layers listed.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3: the RoPE base of the windowed layers
    query_pre_attn_scalar: float | None = None  # Gemma: softmax scale 1/√this, not 1/√head_dim
    attn_softcap: float | None = None  # Gemma 2: scores -> cap·tanh(scores/cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.architecture not in FAMILIES:
            raise ModelLoadError(f"unknown model family {self.architecture!r}; "
                                 f"choose one of {', '.join(FAMILIES)}")
        if self.sliding_layers and not self.sliding_window:
            raise ModelLoadError("sliding_layers needs a sliding_window of at least 1")

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    def window(self, layer: int) -> int | None:
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def windowed_layers(self) -> int:
        return sum(1 for layer in range(self.num_layers) if self.window(layer) is not None)

    @property
    def windowed_share(self) -> float:
        return self.windowed_layers / self.num_layers

    def num_params(self, include_embeddings: bool = True) -> int:
        h, dh = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_heads * dh, self.num_kv_heads * dh
        attn = h * q_out + 2 * h * kv_out + q_out * h
        if self.attention_bias:
            attn += q_out + 2 * kv_out
        if self.family.qk_norm:
            attn += 2 * dh
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + (4 if self.family.gemma else 2) * h
        total = self.num_layers * per_layer + h
        if include_embeddings:
            embed = self.vocab_size * h
            total += embed if self.tie_word_embeddings else 2 * embed
        return total

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element


# Synthetic presets: seeded random weights, a byte tokenizer; tiny for tests, small and 150m
# for CPUs; 1b, 7b, 8b and each other family's larger preset are real shapes for GPUs.
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
    "qwen3-small": ModelConfig(architecture="qwen3", vocab_size=512, hidden_size=512,
                               intermediate_size=1408, num_layers=7, num_heads=8, num_kv_heads=4,
                               head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                               tie_word_embeddings=True, max_position_embeddings=8192),
    "gemma2-small": ModelConfig(architecture="gemma2", vocab_size=512, hidden_size=512,
                                intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=4,
                                head_dim=64, rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
                                sliding_window=256, sliding_layers=(0, 2, 4, 6),
                                query_pre_attn_scalar=64, attn_softcap=50.0, final_softcap=30.0,
                                tie_word_embeddings=True, max_position_embeddings=8192),
    "gemma3-small": ModelConfig(architecture="gemma3", vocab_size=512, hidden_size=512,
                                intermediate_size=1408, num_layers=7, num_heads=8, num_kv_heads=4,
                                head_dim=64, rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
                                sliding_window=256, sliding_layers=(0, 1, 2, 3, 4, 6),
                                rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=64,
                                tie_word_embeddings=True, max_position_embeddings=8192),
    "phi3-small": ModelConfig(architecture="phi3", vocab_size=512, hidden_size=512,
                              intermediate_size=1408, num_layers=7, num_heads=8, num_kv_heads=8,
                              head_dim=64, sliding_window=2047, sliding_layers=tuple(range(7)),
                              max_position_embeddings=8192),
    # Qwen3 0.6B, Gemma 3 1B and Phi-3 mini (4k)
    "qwen3-0.6b": ModelConfig(architecture="qwen3", vocab_size=151936, hidden_size=1024,
                              intermediate_size=3072, num_layers=28, num_heads=16,
                              num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                              tie_word_embeddings=True, max_position_embeddings=40960,
                              dtype="bfloat16"),
    "gemma3-1b": ModelConfig(architecture="gemma3", vocab_size=262144, hidden_size=1152,
                             intermediate_size=6912, num_layers=26, num_heads=4, num_kv_heads=1,
                             head_dim=256, rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
                             sliding_window=512,
                             sliding_layers=tuple(i for i in range(26) if (i + 1) % 6),
                             rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=256,
                             tie_word_embeddings=True, max_position_embeddings=32768,
                             dtype="bfloat16"),
    "phi3-mini": ModelConfig(architecture="phi3", vocab_size=32064, hidden_size=3072,
                             intermediate_size=8192, num_layers=32, num_heads=32,
                             num_kv_heads=32, head_dim=96, sliding_window=2047,
                             sliding_layers=tuple(range(32)), max_position_embeddings=4096,
                             dtype="bfloat16"),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown synthetic preset {name!r}; choose one of {', '.join(PRESETS)}"
        ) from None


def from_hf_config(path: Path) -> ModelConfig:
    """Parse config.json in both its older and newer transformers forms."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} not found: a model directory needs config.json") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path} ({exc.strerror}): a model directory needs "
                             "config.json as a file") from None
    except ValueError as exc:  # not UTF-8, or not JSON
        raise ModelLoadError(f"{path} is not valid JSON ({exc}); re-export the model") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} must hold one JSON object, got "
                             f"{type(raw).__name__}; re-export the model")
    architectures = raw.get("architectures") or []
    family = next((BY_HF_ARCHITECTURE[a] for a in architectures if a in BY_HF_ARCHITECTURE),
                  None)
    if family is None:
        raise ModelLoadError(
            f"{path}: architecture {architectures or raw.get('model_type')} is not supported; "
            f"tokenflow runs {', '.join(BY_HF_ARCHITECTURE)}"
        )
    rope = raw.get("rope_parameters") or {}
    local_theta = raw.get("rope_local_base_freq") if family.name == "gemma3" else None
    if "full_attention" in rope:  # Gemma 3 keys its RoPE by layer type
        local_theta = (rope.get("sliding_attention") or {}).get("rope_theta", local_theta)
        rope = rope["full_attention"] or {}
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(f"{path}: partial rotary embeddings are not supported")
    scaling = raw.get("rope_scaling") or None
    if rope.get("rope_type") not in (None, "default"):
        scaling = rope
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ROPE_SCALINGS:
        raise ModelLoadError(f"{path}: rope scaling {scaling} is not supported "
                             f"(only {', '.join(ROPE_SCALINGS)})")
    if scaling is not None and "rope_type" not in scaling:
        scaling = {**scaling, "rope_type": scaling["type"]}
    heads = raw["num_attention_heads"]
    layers = raw["num_hidden_layers"]
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    window, sliding = _sliding_layers(raw, family, layers)
    return ModelConfig(
        architecture=family.name,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_scaling=dict(scaling) if scaling else None,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.gemma)),
        attention_bias=family.qkv_bias or bool(raw.get("attention_bias", False)),
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
        sliding_window=window,
        sliding_layers=sliding,
        rope_local_theta=None if local_theta is None else float(local_theta),
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
        attn_softcap=raw.get("attn_logit_softcapping"),
        final_softcap=raw.get("final_logit_softcapping"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos_ids,
        dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
    )


def _sliding_layers(raw: dict[str, Any], family: Family,
                    layers: int) -> tuple[int | None, tuple[int, ...]]:
    window = raw.get("sliding_window")
    if family.name in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window they do not use unless told to
    if not window or family.name == "llama":
        return None, ()
    if family.name in ("mistral", "phi3"):  # one window on every layer
        return window, tuple(range(layers))
    types = raw.get("layer_types")
    if types is None:
        if family.name == "gemma2":
            types = ["sliding_attention" if (i + 1) % 2 else "full" for i in range(layers)]
        elif family.name == "gemma3":
            pattern = raw.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full" for i in range(layers)]
        else:
            first = raw.get("max_window_layers", layers)
            types = ["sliding_attention" if i >= first else "full" for i in range(layers)]
    if len(types) != layers:
        raise ModelLoadError(f"layer_types has {len(types)} entries for {layers} layers; "
                             f"fix config.json")
    return window, tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
