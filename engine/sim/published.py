"""Published GPU measurements as test cases for the twin's step prices."""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.batch import StepShape
from engine.budget.operations import OperationEfficiency
from engine.model.config import ModelConfig
from engine.sim.profiles import profile, vllm_defaults
from engine.sim.target import Deployment

if TYPE_CHECKING:
    from engine.harness.driver import RunResult

PUBLISHED_CASES = Path(__file__).with_name("published_gpu_cases.json")
# A served case's own requests, where its source lists every one (prompt and generated tokens)
PUBLISHED_REQUESTS = Path(__file__).with_name("published_gpu_requests.json")
# The server flags a source may state, over vLLM's defaults for its GPU
SERVER_FLAGS = ("max_num_seqs", "gpu_memory_utilization", "max_num_batched_tokens")
KINDS = ("ttft", "decode", "static_throughput", "static_latency", "layer", "served")
# GPUs whose held-back rows are judged, never fitted: the H200 and L40S rounds (docs/twin.md)
NEVER_FITTED_GPUS = ("h200", "l40s")
# Sources no table had used, judged as the twin stands, never fitted: the Lambda round
NEVER_FITTED_SOURCES = ("lambda",)
# A decode run's mean step, from this many evenly spaced contexts: the price is linear in the
# context between the roofline's kinks, and a case decoding 2,048 tokens prices 2,047 steps.
DECODE_SAMPLES = 8
# A burst's requests reach the engine in the order sent, this far apart.
ORDER_S = 1e-6


@dataclass(frozen=True)
class PublishedCase:
    id: str
    source: str
    gpu: str
    model: ModelConfig
    tp: int
    dtype: str
    kv_cache_dtype: str
    kind: str
    measured: float
    unit: str
    held_back: bool
    conditions: str
    harness: str = "offline"
    # the source's server's CPU a chat request beyond `request_s`: vLLM 0.11 parses the model's
    # chat template anew for each (benchmarks/vllm_template_parse.py), measured, not fitted
    template_parse_s: float = 0.0
    # the tokens the server's chat template wraps each prompt in: the client counts its prompt
    # without them (vLLM's RandomDataset), the engine prefills them too
    template_tokens: int = 0
    # the source's engine's own factors, fitted (its host time a step, its decode attention's
    # share): none for vLLM's sources, whose are the GPU profile's
    engine: tuple[tuple[str, float], ...] = ()
    input: int = 0
    output: int = 0
    batch: int = 1
    tokens: int = 0
    # a served case's per-request latencies as its source printed them (medians, P99 ITL),
    # to tell a schedule's error from a step's: not fitted on, not judged
    printed_ms: tuple[tuple[str, float], ...] = ()
    # the source's server flags over vLLM's defaults for the GPU (SERVER_FLAGS), and its
    # context length: 0 for the longest request
    server: tuple[tuple[str, float], ...] = ()
    max_model_len: int = 0
    # every request's (prompt tokens, generated tokens), where the source lists them (as many
    # as `batch`); else `batch` requests of `input` and `output`
    requests: tuple[tuple[int, int], ...] = ()

    def efficiency(self) -> OperationEfficiency:
        """The shipped factors for this case: its GPU's, with its engine's step cost."""
        return dataclasses.replace(profile(self.gpu).efficiency, **dict(self.engine))

    def deployment(self, efficiency: OperationEfficiency | None = None) -> Deployment:
        gpu = dataclasses.replace(profile(self.gpu), efficiency=efficiency or self.efficiency())
        return Deployment(self.model, gpu, self.tp, self.dtype, self.kv_cache_dtype)

    def kv_fits(self) -> bool:
        """Whether the batch's whole KV fits the pool: a static case does not model preemption."""
        if self.kind not in ("static_throughput", "static_latency", "decode"):
            return True
        deployment = self.deployment()
        need = self.batch * (self.input + self.output) * deployment.budget.kv_bytes_per_token
        defaults = vllm_defaults(deployment.gpu, offline=True)
        return need <= deployment.kv_cache_bytes(defaults["gpu_memory_utilization"],
                                                 int(defaults["max_num_batched_tokens"]),
                                                 int(defaults["max_num_seqs"]))

    def predicted(self, efficiency: OperationEfficiency | None = None) -> float:
        """The twin's figure for this case, in the case's unit."""
        if self.kind == "served":
            return self._served(efficiency)
        e = efficiency or self.efficiency()
        price = self.deployment(efficiency).step_price()
        if self.kind == "ttft":
            return price.predict(StepShape(prefill=((self.input, 0),))) * 1e3
        if self.kind == "layer":
            ops = price.operations(StepShape(prefill=((self.tokens, 0),)))
            return ((ops["gemm"] + ops["elementwise"]) / self.model.num_layers
                    + e.layer_s) * 1e3
        steps = self.output - 1
        samples = min(steps, DECODE_SAMPLES)
        contexts = [self.input + int((i + 0.5) * steps / samples) for i in range(samples)]
        # one output token is the prefill's own: no decode step
        decode_s = steps * statistics.fmean(
            price.predict(StepShape(decode_contexts=(context,) * self.batch))
            for context in contexts) if steps else 0.0
        if self.kind == "decode":
            step_s = decode_s / steps
            return 1 / step_s if self.unit == "tok/s" else step_s * 1e3
        prefill_s = price.predict(StepShape(prefill=((self.input, 0),) * self.batch))
        if self.kind == "static_latency":
            return prefill_s + decode_s
        return self.batch * self.output / (prefill_s + decode_s)

    def _served(self, efficiency: OperationEfficiency | None) -> float:
        return self.served_run(efficiency).wall_s

    def served_run(self, efficiency: OperationEfficiency | None = None) -> RunResult:
        """The twin's engine serving the case's requests, sent at once, as vLLM would."""
        from engine.config import EngineConfig
        from engine.harness.workload import WorkloadRequest
        from engine.sim.fleet import run_fleet
        from engine.sim.router import RoutePolicy
        from engine.sim.target import deployment_target

        deployment = self.deployment(efficiency)
        lengths = [(prompt + self.template_tokens, output) for prompt, output in self.lengths()]
        flags = {**vllm_defaults(deployment.gpu), **dict(self.server)}
        flags["max_prefill_chunks"] = flags["max_num_seqs"]
        config = EngineConfig(model="synthetic:tiny",
                              max_model_len=self.max_model_len or max(p + o for p, o in lengths),
                              **flags)
        target = deployment_target(deployment, config, self.gpu)
        arrival_s = self.front_end_s(deployment.gpu.efficiency)
        vocab = self.model.vocab_size
        # distinct prompts from the first block on, as random datasets are: no prefix hits;
        # in the order sent, a microsecond apart, as the engine takes them one message at a
        # time: its first-come queue then puts a preempted request back before every later
        # one, as V1 prepends it
        workload = [WorkloadRequest(f"r{i}", arrival_s + i * ORDER_S,
                                    tuple((i * 7919 + j) % vocab for j in range(prompt)),
                                    output, ignore_eos=True)
                    for i, (prompt, output) in enumerate(lengths)]
        return run_fleet(config, target, workload, 1, RoutePolicy("round-robin")).merged

    def lengths(self) -> list[tuple[int, int]]:
        """Each request's prompt and generated tokens: a request that received no text
        generated one, the token that ended it (docs/twin.md, the Lambda round)."""
        if self.requests:
            return [(prompt, max(output, 1)) for prompt, output in self.requests]
        return [(self.input, self.output)] * self.batch

    def front_end_s(self, efficiency: OperationEfficiency | None = None) -> float:
        """What an HTTP harness's burst waits before the engine sees any of it: vLLM's API
        server renders each request's chat template in its handler, then awaits the
        one-thread, micro-batching tokenizer (AsyncMicrobatchTokenizer, vllm/utils), so the
        event loop runs every handler's first half before any reaches the engine
        (docs/twin.md). Offline harnesses have no front end."""
        if self.harness == "offline":
            return 0.0
        e = efficiency or self.efficiency()
        return self.batch * (e.request_s + self.template_parse_s)

    def error(self, efficiency: OperationEfficiency | None = None) -> float:
        """predicted / measured − 1, on the case's own figure."""
        return self.error_of(self.predicted(efficiency))

    def error_of(self, predicted: float) -> float:
        return predicted / self.measured - 1

    @property
    def duration_like(self) -> bool:
        """Whether the figure grows as the twin slows (a time), or shrinks (a rate)."""
        return self.unit in ("ms", "s")


def load_cases(path: Path, *, fitting_only: bool = True) -> list[PublishedCase]:
    """The cases of `path`, without those the hold-out rules leave out (docs/twin.md)."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    models = {name: ModelConfig(**{k: v for k, v in m.items() if k != "source"})
              for name, m in data["models"].items()}
    sources = data["sources"]
    for name, source in sources.items():
        server = source.get("server", {})
        if set(server) - set(SERVER_FLAGS) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and v > 0
                for v in server.values()):
            raise ValueError(f"source {name}: server holds positive values of "
                             f"{', '.join(SERVER_FLAGS)}; got {server!r}")
        parse_s = source.get("template_parse_s", 0.0)
        if not (isinstance(parse_s, int | float) and 0 <= parse_s < 1):
            raise ValueError(f"source {name}: template_parse_s is a server's CPU seconds a "
                             f"chat request, >= 0 and under 1; got {parse_s!r}")
        wrap = source.get("template_tokens", 0)
        if not (isinstance(wrap, int) and not isinstance(wrap, bool) and 0 <= wrap < 1024):
            raise ValueError(f"source {name}: template_tokens is the whole number of tokens a "
                             f"chat template adds to each prompt, 0 to 1023; got {wrap!r}")
    listed = _listed_requests(data["cases"])
    cases = []
    for c in data["cases"]:
        if c["source"] not in sources or c["kind"] not in KINDS:
            raise ValueError(f"case {c['id']}: unknown source or kind")
        cases.append(PublishedCase(
            id=c["id"], source=c["source"], gpu=c["gpu"], model=models[c["model"]],
            tp=c["tp"], dtype="bfloat16" if c["dtype"] == "float16" else c["dtype"],
            kv_cache_dtype=c.get("kv_cache_dtype", "auto"), kind=c["kind"],
            measured=float(c["measured"]), unit=c["unit"], held_back=c["held_back"],
            conditions=c["conditions"], harness=sources[c["source"]].get("harness", "offline"),
            template_parse_s=float(sources[c["source"]].get("template_parse_s", 0.0)),
            template_tokens=sources[c["source"]].get("template_tokens", 0),
            engine=tuple(sorted(sources[c["source"]].get("fitted", {}).items())),
            input=c.get("input", 0), output=c.get("output", 0),
            batch=c.get("batch", 1), tokens=c.get("tokens", 0),
            printed_ms=tuple(c.get("printed_ms", {}).items()),
            server=tuple(sorted(sources[c["source"]].get("server", {}).items())),
            max_model_len=c.get("max_model_len", 0), requests=listed.get(c["id"], ())))
    return [c for c in cases if c.kv_fits()] if fitting_only else cases


def _listed_requests(cases: list[dict[str, Any]]) -> dict[str, tuple[tuple[int, int], ...]]:
    """The requests of each case marked `per_request`, from PUBLISHED_REQUESTS: as many as
    its batch, whole token counts (a prompt of at least one)."""
    wanted = [c for c in cases if c.get("per_request")]
    if not wanted:
        return {}
    lists: dict[str, Any] = json.loads(PUBLISHED_REQUESTS.read_text())
    listed = {}
    for c in wanted:
        entry = lists.get(c["id"], {})
        inputs, outputs = entry.get("input_lens", []), entry.get("output_lens", [])
        whole = all(isinstance(n, int) and not isinstance(n, bool) for n in (*inputs, *outputs))
        if not (whole and len(inputs) == len(outputs) == c.get("batch")
                and min(inputs, default=0) >= 1 and min(outputs, default=0) >= 0):
            raise ValueError(f"case {c['id']}: {PUBLISHED_REQUESTS.name} needs its batch "
                             f"({c.get('batch')}) of input_lens (>= 1) and output_lens (>= 0)")
        listed[c["id"]] = tuple(zip(inputs, outputs, strict=True))
    return listed


@dataclass(frozen=True)
class Agreement:
    """Relative errors of a set of cases (predicted / measured − 1)."""

    errors: dict[str, float]

    @property
    def median_abs(self) -> float:
        return statistics.median(abs(e) for e in self.errors.values())

    @property
    def worst_abs(self) -> float:
        return max(abs(e) for e in self.errors.values())


def agreement(cases: list[PublishedCase], efficiency: OperationEfficiency | None = None
              ) -> Agreement:
    return Agreement({c.id: c.error(efficiency) for c in cases})


def too_fast(case: PublishedCase, error: float) -> bool:
    """The twin ran faster than the publication: a shorter time, or a higher rate."""
    return error < 0 if case.duration_like else error > 0
