"""The one place a loaded model's dense modules are swapped for the CPU's, and back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.backend_choice import KERNELS
from engine.kernels.attention import index_copy_write
from engine.kernels.cpu_kernels import cache_write
from engine.kernels.layers import (
    KernelRMSNorm,
    KernelRotate,
    KernelSiluMul,
    PackedLinear,
    PanelLinear,
    packable,
)
from engine.model.transformer import ActAndMul, Attention, RMSNorm, Rotate, Transformer

# what a model's dense ops run on
PLAIN = "plain"  # the modules as loaded: CUDA, and compiled models (Inductor packs its own)
PACKED = "packed"  # eager CPU steps: GEMMs on oneDNN's packed weights
# and KERNELS: eager CPU steps on the C++ layer ops, GEMMs of few rows on linear_rows
_SWAPPED = (nn.Linear, RMSNorm, Rotate, ActAndMul)


class KernelSwap:
    """A model's swappable modules as loaded, and their stand-ins, built once per kind."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.plain = {name: module for name, module in model.named_modules()
                      if isinstance(module, _SWAPPED)}
        self.attentions = [m.attn for m in model.modules() if isinstance(m, Attention)]
        self.built: dict[str, dict[str, nn.Module]] = {PLAIN: self.plain}
        self.current = PLAIN

    def use(self, kind: str) -> None:
        """Run the model's dense ops on `kind` (PLAIN, PACKED or KERNELS) from now on."""
        if kind == KERNELS and PACKED not in self.built:
            self.use(PACKED)  # the larger steps' GEMMs: one oneDNN copy serves both kinds
        if kind not in self.built:
            self.built[kind] = {name: self._stand_in(kind, name, module)
                                for name, module in self.plain.items()}
        for name, module in self.built[kind].items():
            self.model.set_submodule(name, module)
        for attention in self.attentions:
            attention.write = cache_write if kind == KERNELS else index_copy_write
        self.current = kind

    def drop(self, kind: str) -> None:
        if kind not in (PLAIN, self.current):
            self.built.pop(kind, None)

    def _stand_in(self, kind: str, name: str, module: nn.Module) -> nn.Module:
        if isinstance(module, nn.Linear):
            if not packable(module):
                return module
            if kind == PACKED:
                return PackedLinear(module)
            packed = self.built[PACKED][name]
            assert isinstance(packed, PackedLinear)
            return PanelLinear(packed) if module.weight.dtype == torch.float32 else packed
        if kind != KERNELS:
            return module
        if isinstance(module, RMSNorm):
            return KernelRMSNorm(module.weight, module.eps, module.offset)
        if isinstance(module, Rotate):
            return KernelRotate()
        if isinstance(module, ActAndMul) and module.act is F.silu:
            return KernelSiluMul()
        return module
