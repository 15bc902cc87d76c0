"""Chat templates: a model directory's Jinja template turns chat messages into prompt text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import EngineError

# For models without their own template (synthetic ones): role-prefixed lines.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(EngineError):
    """The template could not be read, compiled or rendered; the message says why."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str]

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False,
               extra: dict[str, Any] | None = None) -> str:
        """The prompt text; `extra` variables (a request's) override the special tokens;
        `continue_final_message` ends it inside the last message's text, where the model goes
        on writing (transformers' rule: a tag marks where it ends)."""
        if continue_final_message:
            messages = _tagged_final(messages)
        variables = {**self.special_tokens, **(extra or {}), "messages": messages,
                     "add_generation_prompt": add_generation_prompt}
        try:
            text = _compiled(self.source).render(**variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None
        except Exception as exc:
            # a runtime error inside the template (1/0, a bad index) is the template's fault,
            # answered as such, never a server error
            raise ChatTemplateError(f"the chat template failed on these messages: "
                                    f"{type(exc).__name__}: {exc}") from None
        if not continue_final_message:
            return text
        at = text.rfind(CONTINUE_TAG.strip())
        if at < 0:
            raise ChatTemplateError("continue_final_message is set but the chat template drops "
                                    "the final message's text; leave continue_final_message out")
        # a template that trims the message's trailing space trimmed the tag's too
        return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tagged_final(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not messages or not isinstance(messages[-1].get("content"), str):
        raise ChatTemplateError("continue_final_message needs a final message with text to "
                                "continue")
    return [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + CONTINUE_TAG}]


def load_chat_template(model: str, override: Path | None = None,
                       synthetic: bool = False) -> ChatTemplate | None:
    directory = None if synthetic else Path(model).expanduser()
    special = _special_tokens(directory) if directory else {}
    if override is not None:
        source = _read(override)
    elif directory is None:
        source = DEFAULT_TEMPLATE
    elif (directory / "chat_template.jinja").is_file():
        source = _read(directory / "chat_template.jinja")
    else:
        template = _tokenizer_config(directory).get("chat_template")
        if isinstance(template, list):  # named templates: transformers takes "default"
            template = next((t.get("template") for t in template
                             if isinstance(t, dict) and t.get("name") == "default"), None)
        if not isinstance(template, str):
            return None
        source = template
    _compiled(source)  # a broken template fails at start, not on the first chat
    return ChatTemplate(source, special)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"cannot read the chat template {str(path)!r}: {exc}") from None


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"cannot read {str(path)!r}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _special_tokens(directory: Path) -> dict[str, str]:
    config = _tokenizer_config(directory)
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        tokens[name] = value if isinstance(value, str) else ""
    return tokens


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


_CACHE: dict[str, jinja2.Template] = {}


def _compiled(source: str) -> jinja2.Template:
    template = _CACHE.get(source)
    if template is None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            template = _CACHE[source] = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
    return template
