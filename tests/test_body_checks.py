"""A JSON body's depth and Unicode checks: every lone surrogate is still refused by name,
while a body that cannot hold one (no \\uD800-\\uDFFF escape) has only its containers walked."""

from __future__ import annotations

import json

import pytest

from engine.serve import protocol
from engine.serve.protocol import ApiError, BodyLimits, _decoded


def refusal(body: bytes) -> str:
    with pytest.raises(ApiError) as caught:
        _decoded(body, BodyLimits())
    assert caught.value.status == 400
    return caught.value.message


@pytest.mark.parametrize(("body", "named"), [
    (rb'{"prompt": "\ud800"}', "'prompt'"),
    (rb'{"stop": ["a", "b", "x\uDFFF"]}', "'stop[2]'"),
    (rb'{"\udbff": 1}', "'a key'"),
    (rb'{"messages": [{"content": "\uDc00"}]}', "'messages[0].content'"),
])
def test_every_lone_surrogate_is_refused_by_where_it_is(body: bytes, named: str) -> None:
    assert refusal(body).startswith(f"{named} is not valid Unicode")


def test_an_escaped_backslash_before_u_d800_is_text_not_a_surrogate() -> None:
    assert _decoded(rb'{"prompt": "\\ud800", "stop": ["\\\\uDFFF"]}', BodyLimits()) == {
        "prompt": "\\ud800", "stop": ["\\\\uDFFF"]}


@pytest.mark.parametrize("leaf", ["1", '"x"', "[]"])
def test_a_value_past_the_depth_limit_is_refused_whatever_it_holds(leaf: str) -> None:
    limit = BodyLimits().max_depth
    body = ('{"a": ' * (limit + 1) + leaf + "}" * (limit + 1)).encode()
    assert "nests JSON deeper than" in refusal(body)
    at_limit = ('{"a": ' * limit + leaf + "}" * limit).encode()
    assert _decoded(at_limit, BodyLimits()) is not None


def test_strings_of_a_body_without_surrogate_escapes_are_not_visited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[str] = []
    real = protocol._check_text

    def counted(text: str, where: str) -> None:
        checked.append(where)
        real(text, where)

    monkeypatch.setattr(protocol, "_check_text", counted)
    stops = [f"{i:x}\u00e9" for i in range(110_000)]
    body = json.dumps({"prompt": "hello", "stop": stops}).encode()
    assert _decoded(body, BodyLimits())["stop"] == stops and checked == []
    body = json.dumps({"prompt": "hello\ud800", "stop": stops[:3]}).encode()
    assert "'prompt' is not valid Unicode" in refusal(body)
    assert len(checked) >= 1
