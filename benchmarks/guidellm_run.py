"""guidellm's default chat mode (`/v1/chat/completions`, streamed) against `tokenflow serve`,
offline: a local model directory is both the served model and guidellm's tokenizer, and the
prompts are guidellm's synthetic text.

    python3 -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install guidellm
    python -m benchmarks.guidellm_run [--guidellm /tmp/guidellm-venv/bin/guidellm] [--work DIR]

The model is benchmarks/vs_vllm.py's random Llama with a word-level tokenizer, served with
benchmarks/plain_chat_template.jinja. guidellm writes its prompts with Faker's English word
list and cuts them to length with the tokenizer, so that list (read from guidellm's venv)
leads the vocabulary, with each word capitalised too and the punctuation Faker writes:
otherwise every word is unknown and the prompts decode to empty text.

guidellm prints its own summary (requests completed and errored, TTFT, ITL, throughput);
its JSON report is written under the work directory.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from benchmarks.lm_eval_run import serve
from benchmarks.vs_vllm import save_model

TEMPLATE = Path(__file__).parent / "plain_chat_template.jinja"


def faker_words(guidellm: str) -> list[str]:
    """The words of Faker's en_US lorem provider (what guidellm's synthetic text is made
    of), as they are and capitalised, and the punctuation between them."""
    python = Path(guidellm).with_name("python")
    listed = subprocess.run(
        [str(python), "-c", "from faker.providers.lorem.en_US import Provider; "
                            "print('\\n'.join(Provider.word_list))"],
        check=True, capture_output=True, text=True).stdout.split()
    return [*listed, *(word.capitalize() for word in listed), ".", ","]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guidellm", default="/tmp/guidellm-venv/bin/guidellm",
                        help="the guidellm command, from its own venv")
    parser.add_argument("--work", type=Path, default=None, help="where the model is saved")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="tokenflow-guidellm-"))
    model = work / "model"
    if not (model / "config.json").exists():
        save_model(model, seed=0, words=faker_words(args.guidellm))
    server, address = serve(model, "--chat-template", str(TEMPLATE))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        done = subprocess.run(
            [args.guidellm, "run",
             "--backend", f"kind=openai_http,target=http://{address},model={model}",
             "--tokenizer", f"kind=hf_auto,model={model}",
             "--profile", f"kind=constant,rate={args.rate}",
             "--constraint", f"kind=max_requests,count={args.requests}",
             "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                       f"output_tokens={args.output_tokens}",
             "--output", "kind=console",
             "--output", f"kind=json,path={work / 'guidellm.json'}",
             "--disable-progress"],
            env=env, check=False)
    finally:
        server.terminate()
        server.wait(timeout=60)
    raise SystemExit(done.returncode)


if __name__ == "__main__":
    main()
