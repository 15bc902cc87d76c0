"""The model runner: owns the model and KV tensor, runs each batch and samples its tokens."""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence

import torch

from engine.batch import Batch, ModelRunnerOutput, ScheduledChunk, lent
from engine.budget.peaks import measure_peaks
from engine.config import EngineConfig
from engine.core.attention_choice import (
    AttentionChoice,
    attention_cache_key,
    attention_candidates,
    choose_attention,
)
from engine.core.backend_choice import (
    DECODE_CONTEXT,
    DECODES,
    KERNELS,
    PAGED,
    PREFILL_CHUNK,
    PREFILL_HISTORY,
    TORCH,
    Backends,
    Choice,
    DecodePath,
    StepProbe,
    cache_key,
    candidates,
    load_cached,
    scratch,
    store,
)
from engine.core.cuda_graphs import CudaGraphs, capture_sizes
from engine.core.kernel_swap import PACKED, PLAIN, KernelSwap
from engine.core.kv_sizing import WorstStep, kv_budget, read_cuda_memory, worst_step_scratch
from engine.core.logits_processors import LogitsProcessors
from engine.core.runner_requests import RunnerRequest, RunnerRequests
from engine.core.sampler import SamplingInputs, StepSampling, sample, token_logprobs
from engine.core.staging import Staging
from engine.core.step_inputs import StepInputs, prepare
from engine.errors import EngineError
from engine.kernels import huge_pages
from engine.kernels.attention import (
    EAGER_FLEX_ON_CPU,
    block_masked,
    describe_gpu,
    flash_refusal,
)
from engine.kernels.attention import flash_available as flash_importable
from engine.kernels.backends import AttentionBackend, FlashBackend, FlexBackend, TorchBackend
from engine.kernels.cpu_graph import DecodeGraphs
from engine.kernels.cpu_kernels import KernelUnavailable, prefill_supports
from engine.kernels.cpu_kernels import load as load_cpu_kernels
from engine.model.loader import load_model, model_config_for

log = logging.getLogger(__name__)

CPU_KV_BYTES_DEFAULT = 256 * 2**20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
# GEMM primitives oneDNN keeps compiled (its default is 1,024): see _bound_onednn_caches
ONEDNN_CACHE_ENTRIES = 256
# the capacities of oneDNN's primitive cache and of torch's ideep cache in front of it
ONEDNN_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise EngineError(f"device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {name!r} asked for but CUDA is not available; use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise EngineError(f"dtype {name!r} is not supported; choose {', '.join(DTYPES)}")
    if device.type == "cpu" and name == "float16":
        raise EngineError("float16 matmuls are extremely slow on CPU; use float32 or bfloat16")
    return DTYPES[name]


def compiles(config: EngineConfig) -> bool:
    """Whether an engine of `config` compiles its model: as asked, else on CUDA only."""
    if config.compile is not None:
        return config.compile
    return resolve_device(config.device).type == "cuda"


def _reuse_freed_memory() -> None:
    """Keep freed memory in glibc's heap, so each step's temporaries are not faulted afresh."""
    path = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(path), "mallopt", None) if path else None
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, 1 << 30)
        mallopt(M_TRIM_THRESHOLD, 1 << 30)


def _bound_onednn_caches() -> None:
    """Bound oneDNN's per-size GEMM caches (chunked prefill makes every size) before first use."""
    for name in ONEDNN_CACHE_ENV:
        os.environ.setdefault(name, str(ONEDNN_CACHE_ENTRIES))


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            # spinning OpenMP threads stall when preempted: leave a core to the other threads
            torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 2) - 1))
            _reuse_freed_memory()
            _bound_onednn_caches()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.processed_logprobs = config.logprobs_mode == "processed_logprobs"
        self.requests = RunnerRequests()
        self.staging = Staging(self.device)
        shape = model_config_for(config.model)
        flash = self._flash(config, shape.head_dim)
        # where a start's seconds go, phase by phase (`tokenflow run --json`'s cold start)
        self.startup_s: dict[str, float] = {}
        mark = time.perf_counter()
        kernels, self.attention_note = self._kernels(config, flash)
        self.startup_s["kernels"], mark = time.perf_counter() - mark, time.perf_counter()
        self.max_model_len = config.context_length(shape.max_position_embeddings)
        loaded = load_model(config.model, self.device, self.dtype, self.max_model_len,
                            seed=config.seed)
        self.model, self.model_config, self.tokenizer = (loaded.model, loaded.config,
                                                         loaded.tokenizer)
        self.logits_processors = LogitsProcessors(self.tokenizer, self.model_config.vocab_size)
        self.sampling = StepSampling(self.model_config.vocab_size)
        self.startup_s["model_load"], mark = time.perf_counter() - mark, time.perf_counter()
        self.graphs: DecodeGraphs | None = None
        self._graphs: DecodeGraphs | None = None  # made once, kept while the choice is timed
        self.choice: Choice | None = None  # CPU eager steps only
        self.swap = KernelSwap(self.model)
        # eager CPU steps read packed weights; compiled models and CUDA keep the plain modules
        self.eager_cpu = self.device.type == "cpu" and not compiles(config)
        # compiled first: the KV pool of a GPU is sized after a warm-up step on the real path
        self.compile_s = self._compile() if compiles(config) else 0.0
        mark += self.compile_s
        # the one attention path this runner runs: its KV layout and its step metadata, timed
        # on the compiled model where auto leaves a choice
        found = attention_candidates(config.attention_backend, self.device.type, flash)
        self.attention: AttentionChoice = choose_attention(
            found, self.attention_timer(config, time.perf_counter), time.perf_counter,
            key=self.attention_key(config, found) if len(found) > 1 else None)
        self.backend = self._backend(config, self.attention.name)
        self.block_size = self.backend.block_size
        if self.backend.name == "flex" and compiles(config) and not block_masked(self.device):
            log.info("%s", EAGER_FLEX_ON_CPU)
        if self.block_size != config.block_size:
            log.info("KV blocks of %d tokens, not the %d asked: flash-attn's paged KV needs "
                     "multiples of %d", self.block_size, config.block_size, self.block_size)
        if self.attention.how == "measured":
            del self.kv_cache  # the last probe's pool: the KV sizing below must not count it
        if self.attention.how != "forced":
            self.attention_note = self.attention.name
            log.info("%s", self.attention.line())
        self.startup_s["attention"], mark = time.perf_counter() - mark, time.perf_counter()
        # before the pool: the copy probe's scratch (GiBs on a GPU) must not meet a full device
        self.peaks = measure_peaks(str(self.device), self.dtype)
        self.startup_s["peaks"], mark = time.perf_counter() - mark, time.perf_counter()
        self.num_blocks = self._num_blocks(config)
        self.kv_cache = self._allocate_kv()
        self.cuda_graphs = (self._cuda_graphs(config)
                            if self.device.type == "cuda" and compiles(config) else None)
        self.startup_s["kv_cache"], mark = time.perf_counter() - mark, time.perf_counter()
        if compiles(config):
            if kernels:  # Inductor's fused dense ops around the paged attention kernels
                fits = prefill_supports(self.model_config.head_dim)
                self.choice = Choice(Backends(DecodePath(PAGED, TORCH, False),
                                              PAGED if fits else TORCH), "compiled", {}, {})
                self.apply(self.choice.backends)
                self.attention_note = self.choice.line()
        elif kernels:
            self.choice = self._choose(config)
            self.apply(self.choice.backends)
            self._graphs = self.graphs  # the probe's graphs and arena go unless chosen
            self.swap.drop(KERNELS)  # linear_rows's copy of the weights, unless chosen
            self.attention_note = self.choice.line()
            log.info("%s", self.attention_note)
        elif self.eager_cpu:
            self.swap.use(PACKED)
        # a measured choice's seconds include the probe's graph capture
        self.startup_s["backends"] = time.perf_counter() - mark
        self.startup_s["compile"] = self.compile_s

    def _flash(self, config: EngineConfig, head_dim: int) -> bool:
        """Whether flash-attn is a candidate: asked or auto, installed, and able to run here."""
        if config.attention_backend not in ("auto", "flash"):
            return False
        if not flash_importable(self.device):
            if config.attention_backend == "flash":
                raise EngineError("attention_backend=flash needs CUDA and the flash-attn package "
                                  "(pip install 'tokenflow[gpu]'); use auto, flex or torch")
            return False
        refusal = flash_refusal(describe_gpu(self.device), self.dtype, head_dim)
        if refusal is None:
            return True
        if config.attention_backend == "flash":
            raise EngineError(f"attention_backend=flash: {refusal}; use auto, flex or torch")
        log.info("flash-attn is installed but no candidate: %s", refusal)
        return False

    def _backend(self, config: EngineConfig, name: str) -> AttentionBackend:
        mc = self.model_config
        window = mc.sliding_window if mc.sliding_layers else None
        if name == "flash":
            return FlashBackend(window)
        if name == "flex":
            return FlexBackend(config.block_size, window, self.dtype,
                               block_masks=block_masked(self.device))
        return TorchBackend(config.block_size, window, self.dtype)

    def attention_timer(self, config: EngineConfig,
                         clock: Callable[[], float]) -> Callable[[str], float]:
        """Seconds of one mixed step (a chunk over history beside a batch of decodes) on a
        path, each path over its own small KV pool, freed once the choice is made."""
        pools: dict[str, tuple[AttentionBackend, int, torch.Tensor]] = {}

        def time_step(name: str) -> float:
            if name not in pools:
                self.backend = self._backend(config, name)
                self.block_size = self.backend.block_size
                per_decode = -(-(DECODE_CONTEXT + 1) // self.block_size)
                self.num_blocks = DECODES * per_decode
                pools[name] = (self.backend, self.num_blocks, self._allocate_kv())
            self.backend, self.num_blocks, self.kv_cache = pools[name]
            self.block_size = self.backend.block_size
            probe = StepProbe(self)
            with lent(self.run, probe.lent):
                self._synchronize()
                start = clock()
                self.forward(probe.prefill_step + probe.decode_steps[0])
                self._synchronize()
                return clock() - start

        return time_step

    def attention_key(self, config: EngineConfig, found: Sequence[str]) -> str:
        """The cached attention choice's key: this device, the model, and what the probe
        times it on (compiled or not, its block size and shapes)."""
        device = (describe_gpu(self.device).name if self.device.type == "cuda"
                  else platform.processor() or platform.machine())
        shapes = {"model": dataclasses.asdict(self.model_config), "compiled": compiles(config),
                  "block_size": config.block_size, "max_model_len": self.max_model_len,
                  "probe": [DECODES, DECODE_CONTEXT, PREFILL_CHUNK, PREFILL_HISTORY]}
        return attention_cache_key(device, shapes, str(self.dtype), found)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _kernels(self, config: EngineConfig, flash: bool) -> tuple[bool, str]:
        """Whether the C++ kernels are candidates here and, if not, why (for the start-up log)."""
        if self.device.type != "cpu" or config.attention_backend not in ("auto", "paged"):
            if config.attention_backend == "paged":
                raise EngineError("attention_backend=paged is the CPU kernel; on CUDA use auto, "
                                  "flash or torch")
            if flash:
                return False, "flash"
            return False, "flex" if config.attention_backend == "flex" else "torch"
        try:
            load_cpu_kernels()
        except KernelUnavailable as exc:
            if config.attention_backend == "paged":
                raise EngineError(str(exc)) from None
            return False, f"torch (the paged kernels are unavailable: {exc})"
        return True, ""

    def _choose(self, config: EngineConfig) -> Choice:
        """The CPU backends for this model: cached, forced by the flags, or measured now."""
        mc = self.model_config
        found = candidates(config.attention_backend, config.cpu_graphs, True,
                           graphable=self.dtype == torch.float32,
                           prefill_fits=prefill_supports(mc.head_dim))
        if len(found.decode) == 1 and len(found.prefill) == 1:
            return Choice(Backends(found.decode[0], found.prefill[0]), "forced", {}, {})
        probe = StepProbe(self)
        key = cache_key(load_cpu_kernels().tools.key,
                        {"model": dataclasses.asdict(mc), "dtype": str(self.dtype),
                         "block_size": self.block_size, "probe": probe.shapes}, found)
        cached = load_cached(key)
        if cached is not None:
            return cached
        choice = probe.choose(found)
        store(key, choice)
        return choice

    def apply(self, backends: Backends) -> None:
        """Run the CPU backends chosen: the paged kernels are the gather path's to take."""
        if not isinstance(self.backend, TorchBackend):
            raise EngineError(f"the CPU backends apply to the torch attention path, not "
                              f"{self.backend.name}")
        self.backend.paged_decode = backends.decode.attention == PAGED
        self.backend.paged_prefill = backends.prefill_attention == PAGED
        dense = KERNELS if backends.decode.dense == KERNELS else PACKED
        self.swap.use(dense if self.eager_cpu else PLAIN)
        if backends.decode.graphs and self._graphs is None:
            self._graphs = DecodeGraphs(self.model.decoder, self.kv_cache,
                                        -(-self.max_model_len // self.block_size))
        self.graphs = self._graphs if backends.decode.graphs else None

    def _compile(self) -> float:
        """Compile and warm up the model so the first request does not pay; returns seconds."""
        start = time.perf_counter()
        self.model.compile()
        with torch.inference_mode():  # the mode forward runs in, or its guards would not hold
            self.model.warm_up()
        return time.perf_counter() - start

    @property
    def bytes_per_element(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def _num_blocks(self, config: EngineConfig) -> int:
        mc = self.model_config
        per_block = (2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim
                     * self.bytes_per_element)
        if config.kv_cache_bytes is not None:
            budget = config.kv_cache_bytes
        elif self.device.type == "cuda":
            budget = self._measured_budget(config, per_block)
        else:
            budget = CPU_KV_BYTES_DEFAULT
        blocks = budget // per_block
        if blocks < 1:
            raise EngineError(f"the KV budget ({budget} bytes) holds no block of {per_block} "
                              f"bytes; raise kv_cache_bytes or gpu_memory_utilization")
        return int(blocks)

    def _measured_budget(self, config: EngineConfig, block_bytes: int) -> int:
        """A GPU's KV bytes, sized after a warm-up step (called before the pool exists)."""
        # earlier engines' pools sit in torch's cache, which mem_get_info counts as used
        gc.collect()
        torch.cuda.empty_cache()
        reading = read_cuda_memory(self.device, lambda: self._warm_up(config))
        scratch = worst_step_scratch(self.model_config, self.bytes_per_element,
                                     self.worst_step(config))
        sized = kv_budget(reading, config.gpu_memory_utilization, block_bytes, scratch)
        log.info("%s", sized.line)
        return sized.bytes

    def _cuda_graphs(self, config: EngineConfig) -> CudaGraphs:
        """Whole-model decode graphs; captured as their sizes are first met, on the engine's
        thread. SDPA gathers whole tables in them: fewer sizes where that is large."""
        return CudaGraphs(self.model, self.kv_cache, device=self.device, backend=self.backend,
                          max_model_len=self.max_model_len, pad_block=self.num_blocks,
                          sizes=self.graph_sizes(config))

    def _graph_row_bytes(self) -> int:
        """What one graphed decode's attention gathers in a layer: its whole table's K and V."""
        mc = self.model_config
        return 0 if not self.backend.gathers else (2 * self.max_model_len * mc.num_kv_heads
                                                   * mc.head_dim * self.bytes_per_element)

    def graph_sizes(self, config: EngineConfig) -> tuple[int, ...]:
        return capture_sizes(config.max_num_seqs, self._graph_row_bytes())

    def worst_step(self, config: EngineConfig) -> WorstStep:
        """The largest step a live change of the budget may make: what the pool leaves room for."""
        graphs = gather = 0
        if self.device.type == "cuda" and compiles(config):
            graphs = self.graph_sizes(config)[-1]
            if self.backend.gathers:  # one layer's K and V, and its length masks (a window's too)
                masks = 1 + (self.backend.window is not None)
                gather = graphs * (self._graph_row_bytes()
                                   + masks * self.max_model_len * self.bytes_per_element)
        return WorstStep(tokens=config.budget_ceiling(), context=self.max_model_len,
                         rows=config.max_num_seqs, attention=self.backend.name,
                         graph_tokens=graphs, graph_gather=gather)

    def _allocate_kv(self) -> torch.Tensor:
        mc = self.model_config
        # one spare block past the pool's: CUDA graphs' padding rows write there
        layout = self.backend.cache_shape(mc.num_layers, self.num_blocks + 1, mc.num_kv_heads,
                                          mc.head_dim)
        if self.device.type == "cpu":
            return huge_pages.zeros(layout, self.dtype)
        return torch.zeros(layout, dtype=self.dtype, device=self.device)

    def _warm_up(self, config: EngineConfig) -> Callable[[], None]:
        """A forward of the largest step over a just-large-enough KV pool; returns what frees it."""
        length = min(self.max_model_len, config.max_num_batched_tokens)
        lengths = [min(length, config.max_num_batched_tokens - start)
                   for start in range(0, config.max_num_batched_tokens, length)]
        lengths = lengths[:config.max_num_seqs]
        per_sequence = -(-length // self.block_size)
        self.num_blocks = per_sequence * len(lengths)
        self.kv_cache = self._allocate_kv()
        scratches = [scratch(f"warm-up-{i}", self.block_size, [0] * n, i * per_sequence, 0, n)
                     for i, n in enumerate(lengths)]
        with lent(self.run, [new for new, _ in scratches]):
            self.forward([chunk for _, chunk in scratches])

        def release() -> None:
            del self.kv_cache

        return release

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero the KV rows of `blocks`: one slice per run of consecutive ids, each a memset
        per row of the pool (index_fill_ walked them element by element)."""
        if not blocks:
            return
        rows = self._block_rows()
        ordered = sorted(blocks)
        first = last = ordered[0]
        for block in ordered[1:]:
            if block != last + 1:
                rows[:, first:last + 1].zero_()
                first = block
            last = block
        rows[:, first:last + 1].zero_()

    def move_blocks(self, source: list[int], target: list[int]) -> None:
        """Copy the KV rows of blocks `source` to `target` (compaction); renumber held tables."""
        src = torch.tensor(source, dtype=torch.int64, device=self.device)
        dst = torch.tensor(target, dtype=torch.int64, device=self.device)
        rows = self._block_rows()
        rows.index_copy_(1, dst, rows.index_select(1, src))
        self.requests.renumber(dict(zip(source, target, strict=True)))

    def _block_rows(self) -> torch.Tensor:
        """The KV tensor as [outside a block, blocks, a block's elements]: contiguous blocks."""
        return self.kv_cache.flatten(0, self.backend.block_dim - 1).flatten(2)

    @torch.inference_mode()
    def run(self, batch: Batch) -> ModelRunnerOutput:
        """Apply the batch's message, forward its chunks, sample; an error fails its request."""
        chunks = batch.chunks
        rows = self.requests.update(batch)
        if not chunks:
            return ModelRunnerOutput()
        scoring = [c for c in batch.prefills if c.scored_rows]
        sampling = [row for chunk, row in zip(chunks, rows, strict=True) if chunk.samples]
        host = self.sampling.inputs(sampling)
        graphs = self.cuda_graphs
        if graphs is not None and graphs.covers(chunks):  # every decode samples, in order
            graphed, on_device = self.staging.upload((graphs.host_inputs(chunks, rows), host))
            logits = self.model.logits(graphs.run(graphed)[:len(chunks)])
            scored: list[torch.Tensor] = []
        else:
            inputs = self.prepare(chunks, rows, host)
            logits, scored = self.forward(chunks, scoring, inputs=inputs)
            on_device = inputs.sampling
        output = sample(logits, sampling, self.processed_logprobs, on_device,
                        self.logits_processors)
        self.requests.sampled(sampling, output)
        for chunk, logit_rows in zip(scoring, scored, strict=True):
            request = self.requests.held[chunk.request_id]
            first = chunk.start + 1  # row i predicts the token at position start + i + 1
            targets = request.token_ids[first:first + len(logit_rows)]
            try:
                output.prompt_logprobs[request.id] = (first, token_logprobs(
                    torch.log_softmax(logit_rows.float(), dim=-1), targets,
                    request.params.prompt_logprobs or 0))
            except Exception as exc:  # this request's alone, as its sampling is
                output.errors[request.id] = f"scoring its prompt failed: {exc!r}"
        return output

    @torch.inference_mode()
    def forward(self, chunks: list[ScheduledChunk], scoring: Sequence[ScheduledChunk] = (),
                rows: list[RunnerRequest] | None = None, inputs: StepInputs | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Sampling logits in `chunks` order, and each `scoring` chunk's prompt-token logits."""
        if inputs is None:
            inputs = self.prepare(chunks, rows)
        if self.graphs is not None and self.graphs.covers(inputs.meta, len(inputs.input_ids)):
            x = self.model.embed(inputs.input_ids)
            hidden = self.graphs.run(x, self.model.rotations(inputs.positions, x.dtype),
                                     inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        logits = self.model.logits(hidden.index_select(0, inputs.sample_rows))
        scored = []
        for chunk in scoring:
            last = inputs.last_rows[id(chunk)]
            first = last - chunk.num_tokens + 1
            scored.append(self.model.logits(hidden[first:first + chunk.scored_rows]))
        return logits, scored

    def prepare(self, chunks: list[ScheduledChunk], rows: list[RunnerRequest] | None = None,
                sampling: SamplingInputs | None = None) -> StepInputs:
        """The step's inputs on the device: built on the host, sent in one upload."""
        inputs = prepare(chunks, self.requests.rows(chunks) if rows is None else rows,
                         self.backend)
        return self.staging.upload(dataclasses.replace(inputs, sampling=sampling))
