"""On the vLLM peer's path under the benchmarks' --avx2-stand-in: vLLM picks its C++ kernels
and attention ISA from the CPU's flags, not from ATEN_CPU_CAPABILITY, so on an AVX-512
machine it is told there is no AVX-512 (nor AMX), as on an AVX2-only CPU."""

import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
