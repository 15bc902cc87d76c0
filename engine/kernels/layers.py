"""CPU stand-ins for a model's plain torch modules, with their call signatures."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels import cpu_kernels
from engine.kernels.cpu_kernels import PANEL_MAX_ROWS, Rotation

PACKED_ROWS = 8  # the rows oneDNN lays packed weights out for (any count runs)
MIN_ROWS = 4  # oneDNN's fp32 GEMMs run fewer rows slower than this many: pad


def packable(linear: nn.Linear) -> bool:
    weight = linear.weight
    return weight.device.type == "cpu" and (
        weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                          and torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class PackedLinear(nn.Module):
    """An nn.Linear on a copy of its weight packed once for oneDNN; `weight` stays the parameter."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                              PACKED_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows < MIN_ROWS:
            x = torch.cat((x, x.new_zeros(MIN_ROWS - rows, x.shape[1])))
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out[:rows]


class PanelLinear(PackedLinear):
    """A float32 PackedLinear whose steps of up to PANEL_MAX_ROWS rows run linear_rows."""

    def __init__(self, packed: PackedLinear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.weight, self.bias, self.packed = packed.weight, packed.bias, packed.packed
        self.panels = cpu_kernels.pack_panels(packed.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= PANEL_MAX_ROWS:
            return cpu_kernels.linear_rows(x, self.panels, self.out_features, self.bias)
        return super().forward(x)


class KernelRMSNorm(nn.Module):

    def __init__(self, weight: nn.Parameter, eps: float, offset: float) -> None:
        super().__init__()
        self.weight, self.eps, self.offset = weight, eps, offset

    def add_and_norm(self, residual: torch.Tensor,
                     delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return residual, cpu_kernels.rms_norm(delta, self.weight, self.eps, self.offset,
                                              residual=residual)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.rms_norm(x, self.weight, self.eps, self.offset)


class KernelRotate(nn.Module):

    def forward(self, x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        return cpu_kernels.rope(x, rotation)


class KernelSiluMul(nn.Module):

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_mul(gate_up)
