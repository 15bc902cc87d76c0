"""The decoder-only transformer of every family we serve (Llama 2/3, Mistral, Qwen2/3,
Gemma 2/3, Phi-3) in plain PyTorch, over a packed batch.

Input is a flat list of tokens from several requests (no batch dimension, no padding);
positions are global per request (pitfall 1), so a chunk starting at token 512 is rotated
as tokens 512.. not 0... The q/k/v and gate/up projections are fused into one matmul each
(engine.model.checkpoint maps a checkpoint onto them). What a family changes is switched on
by its `Family` and sized by its `ModelConfig`: q/k norms (Qwen3, Gemma 3), Gemma's (1 + w)
norms around both attention and the MLP, scaled embeddings and soft-caps, and sliding-window
layers (Mistral, Phi-3, Gemma, Qwen with use_sliding_window).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.kernels import cpu_kernels
from engine.kernels.attention import AttentionMetadata, PagedAttention
from engine.kernels.cpu_kernels import PANEL_MAX_ROWS, Rotation
from engine.model.config import ModelConfig

# On CUDA, steps of at most this many tokens replay as CUDA graphs (Transformer.compile)
CUDA_GRAPH_MAX_TOKENS = 64
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


# oneDNN lays packed weights out for this many rows per GEMM; the layout serves any row count.
# 8 (a decode batch) read weights as fast at 8 rows as a 256-row layout and also ran 256-row
# prefill GEMMs faster than MKL; a 1-row layout halved the speed at 8 rows (synthetic:small, fp32).
_PACKED_ROWS = 8
# oneDNN's fp32 kernels run fewer than 4 rows slower than 4 to 6 (synthetic:small's GEMMs at
# one thread: 7.3 and 7.7 ms at 1 and 2 rows, 6.1 at 3, 5.5 at 4 to 6), so a small decode
# step computes zero rows up to 4: 11-17% off the whole step at 1 and 2 decodes (where
# linear_rows does not take the step: bf16, or the CPU kernels off).
_MIN_ROWS = 4


class Linear(nn.Linear):
    """nn.Linear whose weight can be packed once for the CPU's GEMM kernels.

    On an AMD EPYC, MKL's sgemm read a decode step's weights at 5-6 GB/s whatever their
    layout; oneDNN on weights reordered into its blocked layout read them at 9-15 GB/s
    (16 to 4 rows, fp32, one thread; a copy streams ~20). On a Xeon with AMX, oneDNN read
    synthetic:small's at 8.6 GB/s at 8 rows, where our linear_rows (cpu_kernels) reads them
    at 12.3, as fast as a plain read: steps of up to PANEL_MAX_ROWS rows take it, larger
    ones oneDNN. The dense `weight` stays the parameter (checkpoints, the transformers
    baseline); the packed copies are what forward reads. bfloat16 weights are packed for
    oneDNN where it has bf16 kernels: synthetic:small's GEMMs took 4.2 against 7.4 ms at 8
    rows, 15.5 against 19.3 at 64 and 55 against 59 at 256 (EPYC). On CUDA nothing is
    packed: cuBLAS reads the plain layout at full bandwidth."""

    packed: torch.Tensor | None = None
    panels: torch.Tensor | None = None  # cpu_kernels.linear_rows's layout
    kernel = False  # small steps take linear_rows (set with panels; Transformer.use_cpu_kernels)

    def pack(self, panels: bool = False) -> None:
        """Pack the weight as it is now (call after loading; a later change to `weight` is
        not seen); with `panels`, an fp32 weight also in linear_rows's layout for steps of
        up to PANEL_MAX_ROWS rows."""
        if self.weight.device.type != "cpu":
            return
        if self.weight.dtype == torch.float32 or (
                self.weight.dtype == torch.bfloat16
                and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                                  _PACKED_ROWS)
        self.panels = (cpu_kernels.pack_panels(self.weight)
                       if panels and self.weight.dtype == torch.float32 else None)
        self.kernel = self.panels is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.kernel and rows <= PANEL_MAX_ROWS:
            return cpu_kernels.linear_rows(x, self.panels, self.out_features, self.bias)
        if self.packed is None:
            return super().forward(x)
        if rows < _MIN_ROWS:
            x = torch.cat((x, x.new_zeros(_MIN_ROWS - rows, x.shape[1])))
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out[:rows]


class RMSNorm(nn.Module):
    """Llama's x̂·w, or Gemma's x̂·(1 + w) with `offset` 1 (its weights are stored that way)."""

    kernel = False  # cpu_kernels.rms_norm (Transformer.use_cpu_kernels)

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def add_and_norm(self, x: torch.Tensor,
                     delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x plus a block's output, and its norm: one pass on the CPU
        kernel, which adds into x in place."""
        if self.kernel:
            return x, cpu_kernels.rms_norm(delta, self.weight, self.eps, self.offset, residual=x)
        x = x + delta
        return x, self(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return cpu_kernels.rms_norm(x, self.weight, self.eps, self.offset)
        # Normalise in fp32 like the reference implementations, then cast back; Gemma scales
        # in fp32 too, Llama after the cast.
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
    """cos/sin tables for every position up to max_positions, computed once."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32),
                            rope_inv_freq(head_dim, theta, scaling))  # [P, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The step's cos/sin rows, gathered once and shared by every layer (a gather per
        layer and per q and k cost 2% of a CPU run)."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


def rotate(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """x [N, H, D] rotated by its global position (rotate-half layout); rotation is
    RotaryEmbedding.at's ([N, 1, D/2] each)."""
    cos, sin = rotation
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    kernel = False  # cpu_kernels.rope (Transformer.use_cpu_kernels)

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, window: int | None,
                 use_flash: bool) -> None:
        super().__init__()
        family = config.family
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        if family.qk_norm:
            offset = 1.0 if family.gemma else 0.0
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, offset)
        self.qk_norm = family.qk_norm
        self.rope = rope
        self.window = window
        scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.attn = PagedAttention(config.num_heads, config.num_kv_heads, config.head_dim,
                                   use_flash, scale=scale, window=window,
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
        rotated = cpu_kernels.rope(qk, rotation) if self.kernel else rotate(qk, rotation)
        q, k = rotated.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        return q, k, v


class MLP(nn.Module):
    kernel = False  # cpu_kernels.silu_mul for SiLU (Transformer.use_cpu_kernels)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"activation {config.hidden_act!r} is not supported; "
                                 f"tokenflow runs {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[config.hidden_act]
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size,
                                   bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return self.down_proj(cpu_kernels.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual blocks; Gemma also norms each block's output before adding it
    (its `post_attention_layernorm` is that output norm, where Llama's is the MLP's input)."""

    kernel = False  # the MLP's residual add by cpu_kernels.add_ (Transformer.use_cpu_kernels)

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, window: int | None,
                 use_flash: bool) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.gemma = config.family.gemma
        offset = 1.0 if self.gemma else 0.0
        self.input_layernorm = RMSNorm(h, eps, offset)
        self.self_attn = Attention(config, rope, window, use_flash)
        self.post_attention_layernorm = RMSNorm(h, eps, offset)
        if self.gemma:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(h, eps, offset)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rotation: Rotation, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.before_attention(x, rotation)
        return self.after_attention(x, self.self_attn.attn(q, k, v, k_cache, v_cache, meta))

    # The two dense halves of a layer, either side of attention over the paged cache: what
    # `Transformer.compile` hands to torch.compile (attention's per-step Python structure
    # stays eager, as vLLM splits its graphs at attention).
    def before_attention(self, x: torch.Tensor, rotation: Rotation
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.project(self.input_layernorm(x), rotation)

    def after_attention(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [N, H] the layer's input, attn [N, Hq, D] attention's output -> [N, H]."""
        attn = self.self_attn.o_proj(attn.flatten(1))
        if self.gemma:
            x, h = self.pre_feedforward_layernorm.add_and_norm(
                x, self.post_attention_layernorm(attn))
            return x + self.post_feedforward_layernorm(self.mlp(h))
        x, h = self.post_attention_layernorm.add_and_norm(x, attn)
        # in place on the kernel path, as add_and_norm's add: a step of kernel calls alone
        # replays as a CPU graph (engine.kernels.cpu_graph)
        return cpu_kernels.add_(x, self.mlp(h)) if self.kernel else x + self.mlp(h)


class Transformer(nn.Module):
    panels_packed = False  # the Linears hold linear_rows's panels (pack_weights(panels=True))

    def __init__(self, config: ModelConfig, max_positions: int, use_flash: bool = False) -> None:
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
            DecoderLayer(config, local_rope if config.window(i) else rope, config.window(i),
                         use_flash)
            for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                            1.0 if config.family.gemma else 0.0)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # (largest token count or 0 for any, before_attention, after_attention), in order
        self._regions: list[tuple[int, Callable[..., Any], Callable[..., Any]]] = [
            (0, DecoderLayer.before_attention, DecoderLayer.after_attention)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids/positions [N]; kv_cache [2, L, ...] (attention.cache_shape) -> [N, H]."""
        x = self.embed(input_ids)
        return self.decoder(x, self.rotations(positions, x.dtype), kv_cache, meta)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> the residual stream's input [N, H]."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def decoder(self, x: torch.Tensor, rotations: list[Rotation], kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The layers and the final norm over embedded tokens x [N, H] (on the kernel path
        x is updated in place), with `rotations` (Transformer.rotations) -> [N, H]."""
        before, after = self._dense_halves(x.shape[0])
        for index, (layer, rotation) in enumerate(zip(self.layers, rotations, strict=True)):
            q, k, v = before(layer, x, rotation)
            attn = layer.self_attn.attn(q, k, v, kv_cache[0, index], kv_cache[1, index], meta)
            x = after(layer, x, attn)
        return self.norm(x)

    def pack_weights(self, panels: bool = False) -> None:
        """Pack every GEMM's weight for the device's kernel (Linear.pack), for eager steps:
        Inductor cannot trace packed weights and packs its own when it freezes a graph."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(panels)
        self.panels_packed = panels

    def use_cpu_kernels(self, enabled: bool = True) -> None:
        """Run eager CPU steps on engine.kernels.cpu_kernels: small fp32 GEMMs in linear_rows,
        and the norms, SiLU·mul, RoPE and cache writes as one call each. Call instead of
        pack_weights; the torch ops stay the path everywhere else. `enabled=False` goes back
        to the torch ops (the backend choice times both; the panels stay packed for a switch
        back, and pack_weights() drops them)."""
        if enabled and not self.panels_packed:
            self.pack_weights(panels=True)
        for module in self.modules():
            if isinstance(module, Linear):
                module.kernel = enabled and module.panels is not None
            elif isinstance(module, RMSNorm | DecoderLayer):
                module.kernel = enabled
            elif isinstance(module, Attention):
                module.kernel = module.attn.kernel = enabled
            elif isinstance(module, MLP):
                module.kernel = enabled and module.act is F.silu

    def compile(self) -> None:  # type: ignore[override]
        """Run each layer's two dense halves through torch.compile with the token count
        dynamic: Inductor fuses the norms, RoPE, SiLU·mul and residual adds around the GEMMs.
        Parameters are graph inputs, so one graph serves every layer of the same shape and
        compile time does not grow with depth.

        On CUDA, steps of up to CUDA_GRAPH_MAX_TOKENS tokens (decode batches) also replay
        as CUDA graphs ("reduce-overhead", one graph per token count, recorded at its first
        step), where launch overhead dominates; longer steps run the compiled kernels."""
        before = torch.compile(DecoderLayer.before_attention, dynamic=True)
        after = torch.compile(DecoderLayer.after_attention, dynamic=True)
        self._regions = [(0, before, after)]
        if self.embed_tokens.weight.is_cuda:
            graphed_before = torch.compile(DecoderLayer.before_attention, dynamic=True,
                                           mode="reduce-overhead")
            graphed_after = torch.compile(DecoderLayer.after_attention, dynamic=True,
                                          mode="reduce-overhead")
            # A graph's outputs live in memory its next replay overwrites, and the next
            # layer replays the same graph: keep copies (a few rows each).
            self._regions.insert(0, (
                CUDA_GRAPH_MAX_TOKENS,
                lambda *a: tuple(t.clone() for t in graphed_before(*a)),
                lambda *a: graphed_after(*a).clone()))

    def warm_up(self) -> None:
        """Compile now rather than in the first request: at one token (torch.compile
        specialises a size of 1) and at two, whose graph serves every larger count."""
        weight = self.embed_tokens.weight
        for n in (1, 2, CUDA_GRAPH_MAX_TOKENS + 1):
            x = torch.zeros(n, self.config.hidden_size, dtype=weight.dtype, device=weight.device)
            positions = torch.zeros(n, dtype=torch.int64, device=weight.device)
            before, after = self._dense_halves(n)
            rotations = self.rotations(positions, weight.dtype)
            for layer, rotation in zip(self.layers, rotations, strict=True):
                q, _, _ = before(layer, x, rotation)
                after(layer, x, q)  # q has the shape of attention's output

    def rotations(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rotation]:
        """Each layer's cos/sin for this step's positions, gathered once per table."""
        tables: dict[int, Rotation] = {}
        rotations = []
        for layer in self.layers:
            rope = layer.self_attn.rope
            if id(rope) not in tables:
                tables[id(rope)] = rope.at(positions, dtype)
            rotations.append(tables[id(rope)])
        return rotations

    def _dense_halves(self, num_tokens: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The two dense halves of a layer (compiled or not) that run `num_tokens` tokens."""
        for limit, before, after in self._regions:
            if limit == 0 or num_tokens <= limit:
                return before, after
        raise AssertionError("the last region takes any token count")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)
