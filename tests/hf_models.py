"""Tiny random Llama and Qwen2 models saved with transformers' save_pretrained: the
reference for exactness tests (transformers is a test-only dependency)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny(kind: str, directory: Path, seed: int = 0) -> Path:
    import transformers

    common = dict(vocab_size=400, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    if kind == "llama":
        config = transformers.LlamaConfig(
            **common, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
            rope_theta=50000.0)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True,
                                          rope_theta=10000.0)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # random init leaves biases at zero; make qkv bias matter
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
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
