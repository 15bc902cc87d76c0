"""engine.kernels.huge_pages: the KV cache's and the GEMM panels' memory."""

import gc

import torch

from engine.kernels import huge_pages


def test_zeros_gives_a_writable_zero_tensor_that_keeps_its_mapping() -> None:
    t = huge_pages.zeros((3, 5, 7), torch.float32)
    assert t.shape == (3, 5, 7) and t.dtype == torch.float32 and t.is_contiguous()
    assert torch.count_nonzero(t) == 0
    gc.collect()  # nothing but the tensor holds the mapping
    t[1, 2, 3] = 4.0
    assert t.sum().item() == 4.0


def test_zeros_takes_any_dtype_and_an_empty_shape() -> None:
    assert torch.equal(huge_pages.zeros((4,), torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16))
    assert huge_pages.zeros((0, 3), torch.float32).shape == (0, 3)
