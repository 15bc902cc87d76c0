"""Chat templates render as transformers' apply_chat_template does, come from the file the
operator names, chat_template.jinja or tokenizer_config.json in that order, and a broken one
fails at start; generation_config.json supplies the HTTP sampling defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.model.chat_template import ChatTemplateError, load_chat_template
from engine.serve.sampling import SamplingDefaults, load_defaults

# a Llama-3-style template: special tokens, loop controls, raise_exception, tojson
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}{{ {'n': messages | length} | tojson }}"
)
MESSAGES = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "héllo"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "<b>x</b>"}]


def _model_dir(tmp_path: Path, **config: object) -> Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                         bos_token="<s>", eos_token="</s>",
                                         chat_template=TEMPLATE).save_pretrained(tmp_path)
    path = tmp_path / "tokenizer_config.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**data, **config}))
    return tmp_path


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(tmp_path: Path, add_generation_prompt: bool) -> None:
    import transformers

    directory = _model_dir(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    template = load_chat_template(str(directory))
    assert template is not None
    assert template.render(MESSAGES, add_generation_prompt) == theirs
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        template.render([{"role": "tool", "content": "x"}])


def test_where_the_template_comes_from(tmp_path: Path) -> None:
    directory = _model_dir(tmp_path)
    (directory / "chat_template.jinja").write_text("jinja file")
    override = tmp_path / "mine.jinja"
    override.write_text("{{ messages[0]['content'] }}!")
    assert load_chat_template(str(directory)).render(MESSAGES) == "jinja file"
    assert load_chat_template(str(directory), override).render(MESSAGES) == " be brief !"
    (directory / "chat_template.jinja").unlink()
    (directory / "tokenizer_config.json").write_text("{}")
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    assert load_chat_template(str(directory)) is None  # the server answers 400 then
    override.write_text("{% if %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_chat_template(str(directory), override)
    sandboxed = tmp_path / "escape.jinja"
    sandboxed.write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute escapes
        load_chat_template(str(directory), sandboxed).render(MESSAGES)


def test_generation_config_sets_the_http_defaults(tmp_path: Path) -> None:
    assert load_defaults("synthetic:tiny") == SamplingDefaults(temperature=1.0)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "max_new_tokens": 64,
         "repetition_penalty": 1.1, "do_sample": True}))
    assert load_defaults(str(tmp_path)) == SamplingDefaults(
        temperature=0.6, top_p=0.9, top_k=50, repetition_penalty=1.1, max_tokens=64)


def test_serve_refuses_a_missing_chat_template_file(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from console.cli.main import main

    assert main(["serve", "--no-db", "--chat-template", str(tmp_path / "none.jinja")]) == 2
    assert "--chat-template" in capsys.readouterr().err


def test_create_app_takes_the_operators_template(tmp_path: Path) -> None:
    """`--chat-template FILE` reaches the chat endpoint: the rendered prompt is the file's."""
    import httpx

    from engine import Engine, EngineConfig
    from engine.serve.app import create_app
    from engine.serve.loop import EngineLoop
    from engine.serve.thread import ServerThread

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    loop = EngineLoop(Engine(EngineConfig(model="synthetic:tiny", device="cpu",
                                          dtype="float32"))).start()
    try:
        with ServerThread(create_app(loop, admin_token=None, chat_template=template)) as server, \
                httpx.Client(base_url=server.url, timeout=60) as http:
            counted = http.post("/tokenize", json={"messages": [{"role": "user",
                                                                 "content": "abc"}]}).json()
            assert counted["tokens"] == loop.engine.tokenizer.encode("[abc]")
            reply = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "abc"}], "max_tokens": 2}).json()
            assert reply["usage"]["prompt_tokens"] == len("[abc]")
    finally:
        loop.stop()
