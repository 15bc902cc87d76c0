"""The model families tokenflow serves, and what sets each one's transformer apart from Llama's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    hf_architecture: str  # `architectures` in config.json, and the transformers model class
    hf_config: str
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE
    # Gemma: (1 + w) RMSNorm, norms around attention and the MLP, embeddings scaled by √hidden
    gemma: bool = False
    fused_checkpoint: bool = False


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM", "LlamaConfig"),
    Family("mistral", "MistralForCausalLM", "MistralConfig"),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", qkv_bias=True),
    Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config", qk_norm=True),
    Family("gemma2", "Gemma2ForCausalLM", "Gemma2Config", gemma=True),
    Family("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", qk_norm=True, gemma=True),
    Family("phi3", "Phi3ForCausalLM", "Phi3Config", fused_checkpoint=True),
)}

BY_HF_ARCHITECTURE: dict[str, Family] = {f.hf_architecture: f for f in FAMILIES.values()}
