"""The vLLM side of benchmarks/vs_vllm.py, run by the peer's own interpreter (vLLM is never a
dependency of tokenflow, and this file imports nothing of ours):

    VLLM_CPU_KVCACHE_SPACE=2 ~/vllm-peer/bin/python benchmarks/_vllm_peer.py \
        --model DIR --requests requests.jsonl --out result.json [--max-num-batched-tokens 256]

Offline `LLM(model=DIR)` with its defaults but for dtype float32 (`--dtype auto` lets vLLM
downcast to bfloat16) and prefix caching off; greedy, ignore_eos, each
request's max_tokens and prompt token ids from the file (so tokenization cannot differ). Only
`generate()` is timed: start-up (weight load, compile, JIT) is not. Writes JSON: per-request
output token ids, wall time, output tok/s and TPOT p50.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    # vLLM's "auto" downcasts a float32 checkpoint to bfloat16 on CPU: a different model from
    # the fp32 one tokenflow runs, so the comparison pins the dtype unless told otherwise.
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    requests = [json.loads(line) for line in args.requests.read_text().splitlines() if line]
    options: dict = {"enable_prefix_caching": False, "dtype": args.dtype,
                     # per-request first/last token times, for TPOT (off by default offline)
                     "disable_log_stats": False}
    if args.max_num_batched_tokens is not None:
        options.update(enable_chunked_prefill=True,
                       max_num_batched_tokens=args.max_num_batched_tokens)
    started = time.monotonic()
    llm = LLM(model=args.model, **options)
    startup_s = time.monotonic() - started
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in requests]
    began = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.monotonic() - began

    tokens = {r["id"]: list(o.outputs[0].token_ids)
              for r, o in zip(requests, outputs, strict=True)}
    tpots = [(o.metrics.last_token_ts - o.metrics.first_token_ts) / (n - 1)
             for o in outputs if o.metrics is not None
             and (n := len(o.outputs[0].token_ids)) > 1]
    output_tokens = sum(len(t) for t in tokens.values())
    args.out.write_text(json.dumps({
        "startup_s": startup_s,
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / wall_s,
        "tpot_s": tpots,  # per request; the caller takes the p50 as tokenflow's summary does
        "dtype": str(llm.llm_engine.vllm_config.model_config.dtype),
        "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config
        .max_num_batched_tokens,
        "tokens": tokens,
    }))


if __name__ == "__main__":
    main()
