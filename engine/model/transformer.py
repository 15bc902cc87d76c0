"""The decoder-only transformer of every family we serve, in plain PyTorch over a packed batch."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.kernels.attention import AttentionMetadata, PagedAttention
from engine.kernels.cpu_kernels import Rotation
from engine.model.config import ModelConfig

# Dynamo's per-function limit, shared by every model of a process: room for several models
RECOMPILE_LIMIT = 64
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """Llama's x̂·w, or Gemma's x̂·(1 + w) with `offset` 1 (its weights are stored that way)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def add_and_norm(self, residual: torch.Tensor,
                     delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + delta
        return residual, self(residual)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32 like the reference implementations; Gemma scales in fp32, Llama after the cast
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling.get("rope_type") == "linear":
        return inv_freq / factor
    # Llama 3: leave high frequencies alone, divide low ones by `factor`, blend in between.
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original / low, original / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32),
                            rope_inv_freq(head_dim, theta, scaling))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


def rotate(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    cos, sin = rotation
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Rotate(nn.Module):

    def forward(self, x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        return rotate(x, rotation)


class ActAndMul(nn.Module):

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"activation {hidden_act!r} is not supported; "
                                 f"tokenflow runs {', '.join(ACTIVATIONS)}")
        self.hidden_act = hidden_act
        self.act = ACTIVATIONS[hidden_act]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return self.act(gate) * up


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        family = config.family
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        if family.qk_norm:
            offset = 1.0 if family.gemma else 0.0
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, offset)
        self.qk_norm = family.qk_norm
        self.rope = rope
        self.rotate = Rotate()
        self.window = window
        scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.attn = PagedAttention(config.num_heads, config.num_kv_heads, config.head_dim,
                                   scale=scale, window=window,
                                   softcap=config.attn_softcap)

    def project(self, x: torch.Tensor,
                rotation: Rotation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> q [N, Hq, D] and k, v [N, Hkv, D], normed and rotated where due."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        heads = self.num_heads + self.num_kv_heads
        if self.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            qk = torch.cat((self.q_norm(q.view(n, self.num_heads, self.head_dim)),
                            self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))), dim=1)
        else:  # q and k sit side by side in the projection: rotate them in one pass
            qk = qkv[:, :self.q_size + self.kv_size].view(n, heads, self.head_dim)
        q, k = self.rotate(qk, rotation).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=False)
        self.act_and_mul = ActAndMul(config.hidden_act)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual blocks; Gemma also norms each block's output before adding it."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.gemma = config.family.gemma
        offset = 1.0 if self.gemma else 0.0
        self.input_layernorm = RMSNorm(h, eps, offset)
        self.self_attn = Attention(config, rope, window)
        self.post_attention_layernorm = RMSNorm(h, eps, offset)
        if self.gemma:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(h, eps, offset)
        self.mlp = MLP(config)

    # the dense halves either side of attention: what Transformer.compile compiles
    def before_attention(self, x: torch.Tensor, residual: torch.Tensor | None,
                         rotation: Rotation) -> tuple[torch.Tensor, ...]:
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_and_norm(residual, x)
        return (*self.self_attn.project(h, rotation), residual)

    def after_attention(self, attn: torch.Tensor,
                        residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn.o_proj(attn.flatten(1))
        if self.gemma:
            residual, h = self.pre_feedforward_layernorm.add_and_norm(
                residual, self.post_attention_layernorm(attn))
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        residual, h = self.post_attention_layernorm.add_and_norm(residual, attn)
        return self.mlp(h), residual


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                               max_positions)
        # Gemma 3's windowed layers rotate with their own base and no scaling
        local_rope = (rope if config.rope_local_theta is None else
                      RotaryEmbedding(config.head_dim, config.rope_local_theta, None,
                                      max_positions))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # Gemma multiplies embeddings by √hidden, rounded to the weights' dtype as it does
        self.embed_scale = config.hidden_size ** 0.5 if config.family.gemma else None
        self.layers = nn.ModuleList(
            DecoderLayer(config, local_rope if config.window(i) else rope, config.window(i))
            for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                            1.0 if config.family.gemma else 0.0)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # the dense halves either side of attention: plain, or compiled (compile())
        self._before: Callable[..., Any] = DecoderLayer.before_attention
        self._after: Callable[..., Any] = DecoderLayer.after_attention

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        return self.decoder(x, self.rotations(positions, x.dtype), kv_cache, meta)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def decoder(self, x: torch.Tensor, rotations: list[Rotation], kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        before, after = self._before, self._after
        residual = None
        for index, (layer, rotation) in enumerate(zip(self.layers, rotations, strict=True)):
            q, k, v, residual = before(layer, x, residual, rotation)
            attn = layer.self_attn.attn(q, k, v, kv_cache[0, index], kv_cache[1, index], meta)
            x, residual = after(layer, attn, residual)
        return self.norm.add_and_norm(residual, x)[1]

    def compile(self) -> None:  # type: ignore[override]
        """Each layer's dense halves through torch.compile, the token count dynamic; CUDA
        graphs hold whole decode steps (engine.core.cuda_graphs), not layers."""
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   RECOMPILE_LIMIT)
        self._before = torch.compile(DecoderLayer.before_attention, dynamic=True)
        self._after = torch.compile(DecoderLayer.after_attention, dynamic=True)

    def warm_up(self) -> None:
        """Compile now, not in the first request: one token, two, and any count."""
        weight = self.embed_tokens.weight
        for n in (1, 2, 17):
            x = torch.zeros(n, self.config.hidden_size, dtype=weight.dtype, device=weight.device)
            positions = torch.zeros(n, dtype=torch.int64, device=weight.device)
            rotations = self.rotations(positions, weight.dtype)
            residual = None
            for layer, rotation in zip(self.layers, rotations, strict=True):
                q, _, _, residual = self._before(layer, x, residual, rotation)
                x, residual = self._after(layer, q, residual)  # q: shaped as attention's output

    def rotations(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rotation]:
        tables: dict[int, Rotation] = {}
        rotations = []
        for layer in self.layers:
            rope = layer.self_attn.rope
            if id(rope) not in tables:
                tables[id(rope)] = rope.at(positions, dtype)
            rotations.append(tables[id(rope)])
        return rotations

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)
