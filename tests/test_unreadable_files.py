"""Every file a user names is refused with its name and the fix when it is not UTF-8 text or
is a directory: never a traceback (a GPU profile's bytes ended bench with UnicodeDecodeError,
a model directory's config.json folder with IsADirectoryError, a tokenizer.json's bytes with
the tokenizers library's bare Exception)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from console.sources.replay import ReplaySource
from engine.errors import EngineError
from engine.harness.conversations import load_conversations
from engine.harness.trace import load_trace
from engine.model.config import from_hf_config
from engine.model.tokenizer import HFTokenizer
from engine.serve.auth import load_token
from engine.sim.profiles import profile

NOT_UTF8 = b"\xff\xfe{}\n"

READERS: dict[str, tuple[Callable[[Path], object], str]] = {
    "model config": (from_hf_config, "re-export the model"),
    "tokenizer": (lambda p: HFTokenizer(p, (2,)), "re-export the model's tokenizer"),
    "trace": (load_trace, "trace"),
    "conversations": (lambda p: load_conversations(p, None), "conversation file"),
    "gpu profile": (lambda p: profile("h100", p), "gpu profile"),
    "token file": (lambda p: load_token(p, env="TF_TEST_UNSET_TOKEN", flag="--token-file",
                                        what="test"), "token file"),
    "recording": (ReplaySource, "recording"),
}


@pytest.mark.parametrize("reader", READERS)
def test_a_file_that_is_not_utf8_is_refused_naming_it(reader: str, tmp_path: Path) -> None:
    read, said = READERS[reader]
    path = tmp_path / "given"
    path.write_bytes(NOT_UTF8)
    with pytest.raises(EngineError) as raised:
        read(path)
    message = str(raised.value)
    assert str(path) in message and said in message
    assert "UTF-8" in message or "utf-8" in message


@pytest.mark.parametrize("reader", READERS)
def test_a_directory_where_a_file_belongs_is_refused_naming_it(reader: str,
                                                               tmp_path: Path) -> None:
    read, _ = READERS[reader]
    path = tmp_path / "given"
    path.mkdir()
    with pytest.raises(EngineError) as raised:
        read(path)
    assert str(path) in str(raised.value)


def test_a_model_config_that_is_not_an_object_names_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[1]")
    with pytest.raises(EngineError, match="must hold one JSON object, got list; re-export"):
        from_hf_config(path)
