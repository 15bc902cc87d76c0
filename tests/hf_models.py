"""Tiny random models of every family we serve, saved with transformers' save_pretrained:
the reference for exactness tests (transformers is a test-only dependency).

Windows are short (8-16 tokens) so test prompts cross them, and weights, norms and soft-caps
are drawn large enough that each family's features change the tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3")


def _config(kind: str, kv_heads: int = 2):  # -> transformers.PretrainedConfig
    import transformers

    common = dict(vocab_size=400, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=kv_heads,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, eos_token_id=None,
                  bos_token_id=None, pad_token_id=None)
    if kind == "llama":
        return transformers.LlamaConfig(
            **common, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
            rope_theta=50000.0)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=10000.0)
    if kind == "qwen3":  # layer 0 global, layer 1 windowed; head_dim wider than hidden/heads
        return transformers.Qwen3Config(**common, head_dim=24, tie_word_embeddings=False,
                                        use_sliding_window=True, sliding_window=8,
                                        max_window_layers=1)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=8, rope_theta=1e6)
    if kind == "gemma2":  # windowed and global layers alternate
        return transformers.Gemma2Config(**common, head_dim=16, sliding_window=8,
                                         query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=3.0)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=16, sliding_window=12,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24, rope_local_base_freq=100.0, rope_theta=5e4,
            rope_scaling={"rope_type": "linear", "factor": 4.0})
    if kind == "phi3":
        return transformers.Phi3Config(**common, sliding_window=16, tie_word_embeddings=False)
    raise ValueError(kind)


def save_tiny(kind: str, directory: Path, seed: int = 0, kv_heads: int = 2) -> Path:
    """`kv_heads` of the 4 query heads' keys: 4 is plain multi-head, 1 multi-query."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, kv_heads))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # random init leaves biases at zero; make them matter
                param.normal_(0, 0.1)
            elif "norm" in name:  # and norms at identity
                param.add_(torch.randn_like(param) * 0.1)
            else:  # big enough that windows, scales and soft-caps change the tokens
                sharp = any(part in name for part in ("q_proj", "k_proj", "qkv_proj"))
                param.normal_(0, 0.2 if sharp else 0.06)
    model.eval().save_pretrained(directory)
    return directory


def hf_greedy(directory: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=max_new_tokens,
                                       min_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def hf_last_logits(directory: Path, prompt: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float()
