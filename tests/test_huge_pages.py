"""engine.kernels.huge_pages: the KV cache's and the GEMM panels' memory."""

import gc
import mmap
from pathlib import Path

import pytest
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



def resident_bytes(address: int) -> int:
    """Rss of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(end, 16) for end in head.split("-"))
            inside = low <= address < high
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's smaps")
def test_zeros_faults_every_page_in_at_allocation() -> None:
    """Serving never pays the first touch: the whole tensor is resident when it is returned
    (counted, not timed), by one write a page rather than a second write of all of it."""
    nbytes = 2048 * mmap.PAGESIZE
    t = huge_pages.zeros((nbytes // 4,), torch.float32)
    assert resident_bytes(t.data_ptr()) >= nbytes
    assert torch.count_nonzero(t) == 0
