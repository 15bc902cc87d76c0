"""vLLM 0.11's chat front end parses the model's chat template on every request: its CPU time.

    python -m benchmarks.vllm_template_parse TEMPLATE [--requests N] [--repeats R]

TEMPLATE is a chat template: a .jinja file, or a model's tokenizer_config.json (its
"chat_template"). vLLM 0.11.0's `apply_hf_chat_template` calls `resolve_chat_template_kwargs`
(vllm/entrypoints/chat_utils.py) for each chat request, which builds a fresh sandboxed Jinja
environment and parses the whole template to find its variables, uncached; later vLLM caches it
(`_cached_resolve_chat_template_kwargs`), so `request_s`, measured on a later vLLM, leaves it
out. This runs the same three calls and prints the CPU seconds a request, the median of R
repeats of N requests. What the twin does with it: docs/twin.md, "The front end".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import ClassVar

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox


class AssistantTracker(jinja2.ext.Extension):
    """The `{% generation %}` tag vLLM's environment knows (as transformers' does)."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_generation_support")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)


def template_variables(template: str) -> set[str]:
    """What vLLM 0.11 does for each chat request: a new environment, a parse, a walk."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    return jinja2.meta.find_undeclared_variables(env.parse(template))


def read_template(path: Path) -> str:
    text = path.read_text()
    if path.suffix != ".json":
        return text
    template = json.loads(text).get("chat_template")
    if not isinstance(template, str):
        raise SystemExit(f"{path} has no single chat_template string; pass a .jinja file")
    return template


def cpu_s_per_request(template: str, requests: int) -> float:
    start = time.process_time()
    for _ in range(requests):
        template_variables(template)
    return (time.process_time() - start) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("template", type=Path)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    template = read_template(args.template)
    cpu_s_per_request(template, 20)
    runs = [cpu_s_per_request(template, args.requests) for _ in range(args.repeats)]
    print(f"{args.template}: {len(template):,} characters, "
          f"{statistics.median(runs) * 1e3:.2f} ms CPU a request (runs: "
          + ", ".join(f"{r * 1e3:.2f}" for r in runs) + " ms)")


if __name__ == "__main__":
    main()
