"""The CPU attention kernels (paged_attention.cpp): built once per machine, loaded with
ctypes, and called per layer and step: once with every decode of the batch, and once per
prefill chunk.

They read each request's cached keys and values in place through its block table, where the
torch path copies the whole history per layer (index_select) before SDPA reads the copy. It
is C++ without torch headers, so the system compiler builds it once (8.4 s here); the shared
object is cached under ~/.cache/tokenflow/kernels (or $TOKENFLOW_KERNEL_CACHE), keyed by the
source, the flags, the compiler and the CPU (it is built with -march=native). Where no compiler
works, `load()` says why and the engine keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_attention.cpp")
# -ffast-math lets the compiler vectorise the reductions and exp (glibc's vector expf needs
# all of it); the kernels never make an infinity (decode reads only real keys, prefill masks
# with a finite -1e30). It is
# a compile flag only: linked with it, GCC adds crtfastmath, which flushes subnormals to zero
# for the whole process (torch included) the moment the library loads.
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")
FLAGS = COMPILE_FLAGS + LINK_FLAGS  # what the cached build is keyed on
BUILD_TIMEOUT_S = 120
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_DECODE_ARGS = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
                ctypes.c_float, _I64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
_PREFILL_ARGS = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
                 ctypes.c_float, _I64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
DTYPES = (torch.float32, torch.bfloat16)
# paged_prefill's vector tiles: head sizes in steps of 16 floats, up to MAX_HEAD_DIM
PREFILL_HEAD_DIM_STEP, PREFILL_MAX_HEAD_DIM = 16, 256


@dataclass(frozen=True)
class Kernels:
    decode: ctypes._CFuncPtr
    prefill: ctypes._CFuncPtr


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here; the message says why and what to do."""


def cache_dir() -> Path:
    override = os.environ.get("TOKENFLOW_KERNEL_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenflow" / "kernels"


def _compiler() -> str:
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler ({compiler!r} not found); install g++ or set "
                                "CXX, or use attention_backend=torch")
    return compiler


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=BUILD_TIMEOUT_S).stdout
    key = hashlib.sha256("\0".join((SOURCE.read_text(), " ".join(FLAGS), version,
                                    platform.machine(), _cpu_signature())).encode())
    target = cache_dir() / f"paged_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: a concurrent engine never loads a half-written file
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    objects = partial[:-3] + ".o"
    try:
        for command in ([compiler, *COMPILE_FLAGS, "-o", objects, str(SOURCE)],
                        [compiler, *LINK_FLAGS, "-o", partial, objects]):
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                tail = "\n".join(done.stderr.strip().splitlines()[-5:])
                raise KernelUnavailable(f"building {SOURCE.name} with {compiler} failed:\n"
                                        f"{tail}\nuse attention_backend=torch")
        os.replace(partial, target)
    finally:
        for leftover in (partial, objects):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


@functools.cache
def load() -> Kernels:
    """The kernels' entry points, built on first use; raises KernelUnavailable."""
    try:
        library = ctypes.CDLL(str(_build(_compiler())))
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"cannot build or load {SOURCE.name}: {exc}; "
                                "use attention_backend=torch") from exc
    for entry, argtypes in ((library.paged_decode, _DECODE_ARGS),
                            (library.paged_prefill, _PREFILL_ARGS)):
        entry.argtypes = argtypes
        entry.restype = None
    return Kernels(decode=library.paged_decode, prefill=library.paged_prefill)


def prefill_supports(head_dim: int) -> bool:
    """Whether paged_prefill's tiles fit this head size (else prefill stays on SDPA)."""
    return head_dim % PREFILL_HEAD_DIM_STEP == 0 and head_dim <= PREFILL_MAX_HEAD_DIM


def _check_operands(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"the paged kernels take float32 or bfloat16 alike, got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the paged kernels need contiguous caches")


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, lengths: torch.Tensor, scale: float,
                 window: int | None, softcap: float | None) -> torch.Tensor:
    """Attention of one query token per request over its cached keys.

    q [B, Hq, D] (Hq a multiple of the KV heads), one layer's caches [Hkv, blocks, block_size,
    D], block_tables int64 [B, W], lengths int64 [B] (keys per request: position + 1).
    `window` keeps each request's last `window` keys; `softcap` caps scores by tanh (Gemma 2).
    -> [B, Hq, D].
    """
    _check_operands(q, k_cache, v_cache)
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    batch, q_heads, _ = q.shape
    q = q.contiguous()
    tables = block_tables.contiguous()
    lengths = lengths.contiguous()
    out = torch.empty_like(q)
    load().decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                  tables.data_ptr(), lengths.data_ptr(), batch, tables.shape[1], kv_heads,
                  q_heads // kv_heads, head_dim, num_blocks, block_size, scale, window or 0,
                  softcap or 0.0, int(q.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, start: int, scale: float, window: int | None,
                  softcap: float | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one prefill chunk: q [C, Hq, D] at positions start.., causal over its
    request's cached keys [0, start + C), which already hold the chunk's own (the layer
    wrote them first). block_table int64 [>= blocks used]; `window` and `softcap` as in
    paged_decode. Writes into `out` ([C, Hq, D], contiguous) when given. -> [C, Hq, D].
    """
    _check_operands(q, k_cache, v_cache)
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    if not prefill_supports(head_dim):
        raise ValueError(f"paged_prefill takes head sizes in steps of {PREFILL_HEAD_DIM_STEP} "
                         f"up to {PREFILL_MAX_HEAD_DIM}, got {head_dim}")
    chunk, q_heads, _ = q.shape
    if block_table.numel() * block_size < start + chunk:
        raise ValueError(f"a block table of {block_table.numel()} blocks holds "
                         f"{block_table.numel() * block_size} keys, not {start + chunk}")
    q = q.contiguous()
    table = block_table.contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif not out.is_contiguous() or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError("paged_prefill's out must be contiguous and shaped like q")
    load().prefill(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                   table.data_ptr(), start, chunk, kv_heads, q_heads // kv_heads, head_dim,
                   num_blocks, block_size, scale, window or 0, softcap or 0.0,
                   int(q.dtype == torch.bfloat16), torch.get_num_threads())
    return out
