"""The CPU decode-attention kernel (paged_decode.cpp): built once per machine, loaded with
ctypes, called once per layer and step with every decode of the batch.

It reads each request's cached keys and values in place through its block table, where the
torch path copies the whole history per layer (index_select) before SDPA reads the copy. It
is C++ without torch headers, so the system compiler builds it in about a second; the shared
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
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_decode.cpp")
# -ffast-math lets the compiler vectorise the reductions and exp (glibc's vector expf needs
# all of it); the kernel never makes an infinity (no masking: it reads only real keys). It is
# a compile flag only: linked with it, GCC adds crtfastmath, which flushes subnormals to zero
# for the whole process (torch included) the moment the library loads.
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")
FLAGS = COMPILE_FLAGS + LINK_FLAGS  # what the cached build is keyed on
BUILD_TIMEOUT_S = 120
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
             ctypes.c_float, _I64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
DTYPES = (torch.float32, torch.bfloat16)


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
    target = cache_dir() / f"paged_decode-{key.hexdigest()[:16]}.so"
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
def load() -> ctypes._CFuncPtr:
    """The kernel's entry point, built on first use; raises KernelUnavailable."""
    try:
        library = ctypes.CDLL(str(_build(_compiler())))
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"cannot build or load {SOURCE.name}: {exc}; "
                                "use attention_backend=torch") from exc
    entry = library.paged_decode
    entry.argtypes = _ARGTYPES
    entry.restype = None
    return entry


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, lengths: torch.Tensor, scale: float,
                 window: int | None, softcap: float | None) -> torch.Tensor:
    """Attention of one query token per request over its cached keys.

    q [B, Hq, D] (Hq a multiple of the KV heads), one layer's caches [Hkv, blocks, block_size,
    D], block_tables int64 [B, W], lengths int64 [B] (keys per request: position + 1).
    `window` keeps each request's last `window` keys; `softcap` caps scores by tanh (Gemma 2).
    -> [B, Hq, D].
    """
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"paged_decode takes float32 or bfloat16 alike, got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_decode needs contiguous caches")
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    batch, q_heads, _ = q.shape
    q = q.contiguous()
    tables = block_tables.contiguous()
    lengths = lengths.contiguous()
    out = torch.empty_like(q)
    load()(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
           tables.data_ptr(), lengths.data_ptr(), batch, tables.shape[1], kv_heads,
           q_heads // kv_heads, head_dim, num_blocks, block_size, scale, window or 0,
           softcap or 0.0, int(q.dtype == torch.bfloat16), torch.get_num_threads())
    return out
