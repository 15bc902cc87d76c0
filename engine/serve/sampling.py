"""From an HTTP body's sampling fields to SamplingParams, with vLLM's defaults."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import INT64_MAX, ConfigError, SamplingParams
from engine.serve.protocol import ApiError, SamplingFields
from engine.serve.structured import structured_grammar

DEFAULT_MAX_TOKENS = 16
# generation_config.json keys vLLM takes as request defaults, by SamplingParams field
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                   "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None


def load_defaults(model: str) -> SamplingDefaults:
    """The defaults for `model`: its generation_config.json over vLLM's own, when there is one."""
    path = Path(model).expanduser() / "generation_config.json"
    if not path.is_file():
        return SamplingDefaults()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return SamplingDefaults()
    values: dict[str, Any] = {}
    for key, name in GENERATION_KEYS.items():
        value = data.get(key) if isinstance(data, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            values[name] = value
    if "top_k" in values:
        values["top_k"] = max(0, int(values["top_k"]))
    if "max_tokens" in values:
        values["max_tokens"] = int(values["max_tokens"])
    return dataclasses.replace(SamplingDefaults(), **values)


def sampling_params(body: SamplingFields, defaults: SamplingDefaults, vocab_size: int, *,
                    max_tokens: int | None, logprobs: int | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams of one choice of `body`; ApiError(400) names the offending field.
    `max_tokens` is the endpoint's resolved value (its own default applied), None for all."""
    given = {name: value for name in ("temperature", "top_p", "top_k", "min_p",
                                      "repetition_penalty", "presence_penalty",
                                      "frequency_penalty", "ignore_eos",
                                      "include_stop_str_in_output")
             if (value := getattr(body, name)) is not None}
    base = {name: getattr(defaults, name) for name in ("temperature", "top_p", "top_k",
                                                       "min_p", "repetition_penalty")}
    try:
        bias = tuple((_token_id(key), value) for key, value in (body.logit_bias or {}).items())
        params = SamplingParams(
            **{**base, **given},
            # unset: all the context leaves (Generation cuts it to that, per prompt)
            max_tokens=INT64_MAX if max_tokens is None else max_tokens,
            seed=body.seed, stop_token_ids=tuple(body.stop_token_ids or ()),
            stop=body.stop_strings(), logit_bias=bias, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, min_tokens=body.min_tokens or 0,
            skip_special_tokens=body.skip_special_tokens is not False,
            structured_output=structured_grammar(body))
        params.check_vocab(vocab_size)
    except ConfigError as exc:
        raise ApiError(400, f"'{exc.field}' {exc.message}", param=exc.field) from None
    return params


def _token_id(key: str) -> int:
    """logit_bias keys are token ids as JSON strings."""
    try:
        return int(key)
    except ValueError:
        raise ConfigError("logit_bias", f"keys must be token ids, got {key!r}") from None
