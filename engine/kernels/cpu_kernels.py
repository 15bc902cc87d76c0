"""The CPU kernels (paged attention, a layer's dense ops), built once per machine."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.kernels import huge_pages

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("paged_attention.cpp", "layer_ops.cpp", "cpu_vectors.h"))
# -ffast-math vectorises the reductions and exp (the kernels make no infinities); compile
# only: linked, GCC's crtfastmath would flush subnormals for the whole process.
WIDE_FLAGS = ("-mprefer-vector-width=512",)
BASE_FLAGS = ("-O3", "-fopenmp", "-ffast-math", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")
MARCH_ENV = "TOKENFLOW_KERNEL_MARCH"  # a -march target instead of native (part of the key)
BUILD_TIMEOUT_S = 120
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ENTRIES = {
    "paged_decode": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
                     _I64, _I64, ctypes.c_float, _I64, ctypes.c_float, ctypes.c_int,
                     ctypes.c_int],
    "paged_prefill": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
                      ctypes.c_float, _I64, ctypes.c_float, ctypes.c_int, ctypes.c_int],
    "linear_rows": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, ctypes.c_int],
    "rms_norm": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, ctypes.c_float,
                 ctypes.c_int, ctypes.c_int],
    "silu_mul": [_PTR, _PTR, _I64, _I64, ctypes.c_int, ctypes.c_int],
    "rope": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int, ctypes.c_int],
    "cache_write": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64,
                    ctypes.c_int],
}
DTYPES = (torch.float32, torch.bfloat16)
# Steps of at most this many rows run fp32 GEMMs in linear_rows; larger ones oneDNN's.
PANEL_MAX_ROWS = 64
Rotation = tuple[torch.Tensor, torch.Tensor]  # RoPE's cos, sin [N, 1, D/2] for one step
PREFILL_HEAD_DIM_STEP, PREFILL_MAX_HEAD_DIM = 16, 256


@dataclass(frozen=True)
class Toolchain:

    compiler: str
    march: str
    wide: bool
    compile_flags: tuple[str, ...]
    key: str


@dataclass(frozen=True)
class Kernels:
    tools: Toolchain
    lanes: int
    panel: int
    paged_decode: ctypes._CFuncPtr
    paged_prefill: ctypes._CFuncPtr
    linear_rows: ctypes._CFuncPtr
    rms_norm: ctypes._CFuncPtr
    silu_mul: ctypes._CFuncPtr
    rope: ctypes._CFuncPtr
    cache_write: ctypes._CFuncPtr


Call = tuple[ctypes._CFuncPtr, tuple[Any, ...]]
# per thread: engines stepping in other threads are not recorded into another's graph
_recording = threading.local()


def _call(name: str, *args: Any) -> None:
    entry = getattr(load(), name)
    entry(*args)
    calls = getattr(_recording, "calls", None)
    if calls is not None:
        calls.append((entry, args))


@contextmanager
def recording() -> Iterator[list[Call]]:
    """Every kernel call this thread makes inside, in order, as it was made."""
    if getattr(_recording, "calls", None) is not None:
        raise RuntimeError("kernel calls are already being recorded")
    _recording.calls = calls = []
    try:
        yield calls
    finally:
        _recording.calls = None


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
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _macros(compiler: str, march: str) -> str:
    run = subprocess.run([compiler, f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull],
                         capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if run.returncode != 0:
        raise KernelUnavailable(f"{compiler} does not take -march={march} "
                                f"({run.stderr.strip().splitlines()[-1:]}); fix ${MARCH_ENV} "
                                "or unset it")
    return run.stdout


def toolchain() -> Toolchain:
    compiler = _compiler()
    march = os.environ.get(MARCH_ENV) or "native"
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=BUILD_TIMEOUT_S).stdout
    wide = "__AVX512F__" in _macros(compiler, march)
    flags = (*BASE_FLAGS, f"-march={march}", *(WIDE_FLAGS if wide else ()))
    key = hashlib.sha256("\0".join((*(source.read_text() for source in SOURCES),
                                    " ".join(flags + LINK_FLAGS), version, platform.machine(),
                                    _cpu_signature())).encode()).hexdigest()[:16]
    return Toolchain(compiler, march, wide, flags, key)


def _build(tools: Toolchain) -> Path:
    compiler = tools.compiler
    target = cache_dir() / f"cpu_kernels-{tools.key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: a concurrent engine never loads a half-written file
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    units = [source for source in SOURCES if source.suffix == ".cpp"]
    objects = [f"{partial[:-3]}-{source.stem}.o" for source in units]
    try:
        _run_all(compiler, [[compiler, *tools.compile_flags, "-o", obj, str(source)]
                            for source, obj in zip(units, objects, strict=True)])
        _run_all(compiler, [[compiler, *LINK_FLAGS, "-o", partial, *objects]])
        os.replace(partial, target)
    finally:
        for leftover in (partial, *objects):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


def _run_all(compiler: str, commands: list[list[str]]) -> None:
    running = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True) for command in commands]
    failures = []
    for process in running:
        try:
            _, stderr = process.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
        if process.returncode != 0:
            failures.append("\n".join(stderr.strip().splitlines()[-5:]))
    if failures:
        raise KernelUnavailable(f"building the CPU kernels with {compiler} failed:\n"
                                f"{failures[0]}\nuse attention_backend=torch")


@functools.cache
def load() -> Kernels:
    """The kernels' entry points, built on first use; raises KernelUnavailable."""
    try:
        tools = toolchain()
        library = ctypes.CDLL(str(_build(tools)))
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"cannot build or load the CPU kernels: {exc}; "
                                "use attention_backend=torch") from exc
    entries = {}
    for name, argtypes in _ENTRIES.items():
        entry = getattr(library, name)
        entry.argtypes = argtypes
        entry.restype = None
        entries[name] = entry
    layout = (ctypes.c_int64 * 2)()
    library.vector_layout(layout)
    return Kernels(tools=tools, lanes=layout[0], panel=layout[1], **entries)


def prefill_supports(head_dim: int) -> bool:
    return head_dim % PREFILL_HEAD_DIM_STEP == 0 and head_dim <= PREFILL_MAX_HEAD_DIM


def _check_operands(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"the paged kernels take float32 or bfloat16 alike, got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the paged kernels need contiguous caches")


# Each entry point is a torch operator, tokenflow::NAME, visible to profiler and dispatcher.
_LIBRARY = torch.library.Library("tokenflow", "DEF")


def _operator(schema: str) -> Callable[[Callable[..., None]], Any]:
    def register(kernel: Callable[..., None]) -> Any:
        name = schema.split("(", 1)[0]
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, kernel, "CPU")
        return getattr(torch.ops.tokenflow, name).default
    return register


@_operator("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
           "Tensor lengths, float scale, int window, float softcap, Tensor(a!) out) -> ()")
def _paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  tables: torch.Tensor, lengths: torch.Tensor, scale: float, window: int,
                  softcap: float, out: torch.Tensor) -> None:
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    batch, q_heads, _ = q.shape
    _call("paged_decode", q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
          out.data_ptr(), tables.data_ptr(), lengths.data_ptr(), batch, tables.shape[1],
          kv_heads, q_heads // kv_heads, head_dim, num_blocks, block_size, scale, window,
          softcap, _bf16(q), torch.get_num_threads())


@_operator("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
           "int start, float scale, int window, float softcap, Tensor(a!) out) -> ()")
def _paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   table: torch.Tensor, start: int, scale: float, window: int, softcap: float,
                   out: torch.Tensor) -> None:
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    chunk, q_heads, _ = q.shape
    _call("paged_prefill", q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
          table.data_ptr(), start, chunk, kv_heads, q_heads // kv_heads, head_dim, num_blocks,
          block_size, scale, window, softcap, _bf16(q), torch.get_num_threads())


@_operator("linear_rows(Tensor x, Tensor panels, Tensor? bias, Tensor(a!) out) -> ()")
def _linear_rows(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor) -> None:
    rows, k = x.shape
    _call("linear_rows", x.data_ptr(), rows, k, panels.data_ptr(), out.shape[1], out.data_ptr(),
          None if bias is None else bias.data_ptr(), torch.get_num_threads())


@_operator("rms_norm(Tensor x, Tensor(b!)? residual, Tensor weight, float eps, float offset, "
           "Tensor(a!) out) -> ()")
def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float, offset: float, out: torch.Tensor) -> None:
    _call("rms_norm", x.data_ptr(), None if residual is None else residual.data_ptr(),
          weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, offset,
          _bf16(x), torch.get_num_threads())


@_operator("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()")
def _silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    rows, inter = out.shape
    _call("silu_mul", gate_up.data_ptr(), out.data_ptr(), rows, inter, _bf16(gate_up),
          torch.get_num_threads())


@_operator("rope(Tensor(a!) x, Tensor cos, Tensor sin) -> ()")
def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    rows, heads, head_dim = x.shape
    _call("rope", x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, heads, head_dim,
          x.stride(0), _bf16(x), torch.get_num_threads())


@_operator("cache_write(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
           "Tensor slots) -> ()")
def _cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    _call("cache_write", k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
          slots.data_ptr(), k.shape[0], kv_heads, head_dim, k.stride(0), v.stride(0),
          num_blocks * block_size, _bf16(k))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, lengths: torch.Tensor, scale: float,
                 window: int | None, softcap: float | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    _check_operands(q, k_cache, v_cache)
    if q.stride()[1:] != (k_cache.shape[-1], 1):
        q = q.contiguous()
    out = _output(out, q)
    _paged_decode(q, k_cache, v_cache, block_tables.contiguous(), lengths.contiguous(), scale,
                  window or 0, softcap or 0.0, out)
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, start: int, scale: float, window: int | None,
                  softcap: float | None, out: torch.Tensor | None = None) -> torch.Tensor:
    _check_operands(q, k_cache, v_cache)
    block_size, head_dim = k_cache.shape[2:]
    if not prefill_supports(head_dim):
        raise ValueError(f"paged_prefill takes head sizes in steps of {PREFILL_HEAD_DIM_STEP} "
                         f"up to {PREFILL_MAX_HEAD_DIM}, got {head_dim}")
    if block_table.numel() * block_size < start + q.shape[0]:
        raise ValueError(f"a block table of {block_table.numel()} blocks holds "
                         f"{block_table.numel() * block_size} keys, not {start + q.shape[0]}")
    q = q.contiguous()
    out = _output(out, q)
    _paged_prefill(q, k_cache, v_cache, block_table.contiguous(), start, scale, window or 0,
                   softcap or 0.0, out)
    return out


def _output(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not out.is_contiguous() or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError("an attention kernel's out must be contiguous and shaped like q")
    return out


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """An nn.Linear weight [N, K] (float32) laid out for linear_rows, flat."""
    n, k = weight.shape
    kernels = load()
    panel, lanes = kernels.panel, kernels.lanes
    weight = weight.detach()
    whole = n - n % panel
    tail = torch.nn.functional.pad(weight[whole:], (0, 0, 0, -(n - whole) % lanes))
    parts = (weight[:whole].view(-1, panel, k).transpose(1, 2).flatten(), tail.t().flatten())
    panels = huge_pages.zeros((sum(p.numel() for p in parts),), weight.dtype)
    return torch.cat(parts, out=panels)


def linear_rows(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, K] float32 @ W^T (+ bias), W packed by pack_panels -> [rows, out_features]."""
    rows, k = x.shape
    padded = out_features + -out_features % load().lanes
    if x.dtype != torch.float32 or panels.numel() != k * padded:
        raise ValueError(f"linear_rows takes float32 rows of {panels.numel() // padded}, got "
                         f"{x.dtype} rows of {k}")
    out = torch.empty(rows, out_features)
    _linear_rows(x.contiguous(), panels, bias, out)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None and (not residual.is_contiguous() or residual.shape != x.shape
                                 or residual.dtype != x.dtype):
        raise ValueError("rms_norm's residual must be contiguous and shaped like x")
    _bf16(x)
    x = x.contiguous()
    out = torch.empty_like(x)
    _rms_norm(x, residual, weight, eps, offset, out)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    _bf16(gate_up)
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    _silu_mul(gate_up, out)
    return out


def rope(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    _bf16(x)
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError("rope rotates rows whose heads are contiguous")
    cos, sin = (t.contiguous() for t in rotation)
    _rope(x, cos, sin)
    return x


def cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    _check_operands(k, k_cache, v_cache)
    kv_heads, _, _, head_dim = k_cache.shape
    rows = k.shape[0]
    if (k.shape != (rows, kv_heads, head_dim) or v.shape != k.shape or v.dtype != k.dtype
            or k.stride()[1:] != (head_dim, 1) or v.stride()[1:] != (head_dim, 1)
            or slots.shape != (rows,)):
        raise ValueError(f"cache_write takes k, v [rows, {kv_heads}, {head_dim}] alike, each "
                         f"row's heads contiguous, and a slot per row")
    _cache_write(k, v, k_cache, v_cache, slots.contiguous())


def _bf16(t: torch.Tensor) -> int:
    if t.dtype not in DTYPES:
        raise ValueError(f"the CPU kernels take float32 or bfloat16, got {t.dtype}")
    return int(t.dtype == torch.bfloat16)
