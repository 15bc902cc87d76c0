"""Structured output: grammar masks on the logits make every output match its JSON schema,
regex, choice or grammar, even when the logits are random (a synthetic model sampled at
temperature 1); the request fields are vLLM's; min_tokens holds back stop tokens."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator

import pytest
import torch

from engine import Engine, EngineConfig
from engine.config import SamplingParams
from engine.core.logits_processors import LogitsProcessors
from engine.core.runner_requests import RunnerRequest
from engine.model.tokenizer import ByteTokenizer
from engine.serve.protocol import SamplingFields
from engine.serve.structured import structured_grammar
from tests.random_schemas import matches, random_schema


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))


def test_every_output_matches_its_random_schema(engine: Engine) -> None:
    """All in flight at once, so each step masks a batch of different grammars."""
    rng = random.Random(7)
    asked: dict[str, tuple[dict[str, object], list[int]]] = {}
    for i in range(60):
        schema = random_schema(rng)
        grammar = structured_grammar(SamplingFields(guided_json=schema))
        request_id = engine.add_request("{", SamplingParams(
            max_tokens=2000, temperature=1.0, seed=i, structured_output=grammar))
        asked[request_id] = (schema, [])
    finished = 0
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id not in asked:
                continue
            schema, tokens = asked[output.request_id]
            tokens += output.new_token_ids
            if output.finished:
                finished += 1
                assert output.finish_reason == "stop"
                assert matches(engine.tokenizer.decode(tokens), schema) is None
    assert finished == 60


@pytest.mark.parametrize(("fields", "check"), [
    ({"guided_regex": r"[0-9]{3}-[a-z]{2}"},
     lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
    ({"guided_choice": ["yes", "no", "maybe so"]}, lambda text: text in ("yes", "no", "maybe so")),
    ({"guided_grammar": 'start: "a" ("b" | "c")* "d"'},
     lambda text: re.fullmatch("a[bc]*d", text)),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9]+ "y"'}},
     lambda text: re.fullmatch("x[0-9]+y", text)),
    ({"response_format": {"type": "json_object"}},
     lambda text: isinstance(json.loads(text), dict)),
    ({"structured_outputs": {"choice": ["ü", "b"], "disable_any_whitespace": True}},
     lambda text: text in ("ü", "b")),
])
def test_each_kind_of_constraint_holds(engine: Engine, fields: dict[str, object],
                                       check: object) -> None:
    grammar = structured_grammar(SamplingFields.model_validate(fields))
    for seed in range(3):
        [tokens] = engine.generate(["go"], SamplingParams(
            max_tokens=500, temperature=1.0, seed=seed, structured_output=grammar))
        assert check(engine.tokenizer.decode(tokens)), engine.tokenizer.decode(tokens)  # type: ignore[operator]


def test_a_bad_constraint_is_refused_by_name() -> None:
    from engine.serve.protocol import ApiError

    for fields, param in (({"guided_regex": "(unclosed"}, "guided_regex"),
                          ({"guided_json": "{not json"}, "guided_json"),
                          ({"guided_choice": []}, "guided_choice"),
                          ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                          ({"response_format": {"type": "json_schema"}}, "response_format")):
        with pytest.raises(ApiError) as refused:
            structured_grammar(SamplingFields.model_validate(fields))
        assert refused.value.status == 400 and refused.value.param == param, fields


def test_a_recomputed_request_is_masked_from_where_it_was() -> None:
    """A preempted request comes back as a new runner request holding every token so far:
    its grammar state catches up with them, so its mask is the one it had."""
    grammar = structured_grammar(SamplingFields(guided_regex="ab+c"))
    processors = LogitsProcessors(ByteTokenizer(320), 320)
    params = SamplingParams(max_tokens=9, structured_output=grammar)
    prompt = [b + 3 for b in b"go"]
    before = RunnerRequest("r", [*prompt, ord("a") + 3], len(prompt), params, [])
    masked = torch.zeros(1, 320)
    refused = processors.apply(masked, [before])
    again = RunnerRequest("r", [*prompt, ord("a") + 3], len(prompt), params, [])
    remasked = torch.zeros(1, 320)
    processors.apply(remasked, [again])
    assert torch.equal(remasked, masked)
    assert masked[0].isfinite().nonzero().flatten().tolist() == [ord("b") + 3]
    assert refused == {}


def test_sentencepiece_pieces_are_read_as_text(tmp_path) -> None:
    """A tokenizer llguidance cannot read from tokenizer.json (a Metaspace decoder alone):
    its pieces, "▁" read as a space, make the grammar's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from engine.model.tokenizer import HFTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁yes": 3, "▁no": 4, "▁maybe": 5, "yes": 6,
             "▁": 7}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    processors = LogitsProcessors(HFTokenizer(tmp_path / "tokenizer.json", (2,)), 8)
    grammar = structured_grammar(SamplingFields(guided_regex=" (yes|no)"))
    request = RunnerRequest("r", [1], 1, SamplingParams(structured_output=grammar), [])
    masked = torch.zeros(1, 8)
    refused = processors.apply(masked, [request])
    assert refused == {} and masked[0].isfinite().nonzero().flatten().tolist() == [3, 4, 7]


def test_min_tokens_holds_back_eos_and_stop_tokens(engine: Engine) -> None:
    [free] = engine.generate(["hi"], SamplingParams(max_tokens=6, temperature=0))
    stop = free[0]
    [stopped] = engine.generate(["hi"], SamplingParams(max_tokens=6, temperature=0,
                                                       stop_token_ids=(stop,)))
    assert stopped == free[:1]
    [held] = engine.generate(["hi"], SamplingParams(max_tokens=6, temperature=0, min_tokens=4,
                                                    stop_token_ids=(stop,)))
    assert len(held) >= 4 and stop not in held[:4]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    from engine.serve.app import create_app
    from engine.serve.loop import EngineLoop
    from engine.serve.thread import ServerThread

    loop = EngineLoop(Engine(EngineConfig(model="synthetic:tiny", device="cpu",
                                          dtype="float32"))).start()
    try:
        with ServerThread(create_app(loop, admin_token=None)) as running:
            yield running.url
    finally:
        loop.stop()


def test_the_openai_client_gets_json_that_matches_its_schema(server: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model="synthetic:tiny", messages=[{"role": "user", "content": "who?"}],
        temperature=1.0, seed=3, max_tokens=300,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema, "strict": True}})
    assert matches(reply.choices[0].message.content or "", schema) is None
    completion = client.completions.create(
        model="synthetic:tiny", prompt="n=", max_tokens=20, temperature=1.0, seed=1,
        extra_body={"guided_regex": "[1-9][0-9]?", "min_tokens": 1})
    assert re.fullmatch("[1-9][0-9]?", completion.choices[0].text)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="synthetic:tiny", prompt="x", max_tokens=5,
                                  extra_body={"structured_outputs": {"regex": "a",
                                                                     "json_object": True}})
    assert refused.value.body["param"] == "structured_outputs.json_object"  # type: ignore[index]


def test_a_grammar_may_spell_an_added_token_that_is_not_special(tmp_path) -> None:
    """Hermes's `<tool_call>` is an added token that is not special: a grammar that spells it
    is followed to the end, the tag written as text, never refused as a special token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from engine.model.tokenizer import HFTokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["It is, call a tool."] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    hf = HFTokenizer(tmp_path / "tokenizer.json", (0,))
    processors = LogitsProcessors(hf, vocab)
    grammar = structured_grammar(SamplingFields(guided_regex=r"It is\.<tool_call>\{\}"))
    request = RunnerRequest("r", [0], 1, SamplingParams(structured_output=grammar), [])
    tag = tokenizer.token_to_id("<tool_call>")
    for _ in range(64):
        logits = torch.zeros(1, vocab)
        logits[0, tag] = 1.0  # the model wants the tag wherever the grammar allows it
        assert processors.apply(logits, [request]) == {}
        token = int(logits[0].argmax())
        if token == 0:  # EOS: the grammar is done
            break
        request.token_ids.append(token)
    assert hf.decode(request.output_token_ids) == "It is.<tool_call>{}"


def test_a_grammar_the_vocabulary_cannot_follow_fails_its_request_alone(tmp_path) -> None:
    """No token spells the forced text " w" on its own here, and llguidance gives up: that
    request fails with llguidance's reason; the batch's other rows are sampled as ever."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from engine.core.sampler import sample
    from engine.model.tokenizer import HFTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"▁w{i}": i for i in range(3, 16)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    processors = LogitsProcessors(HFTokenizer(tmp_path / "tokenizer.json", (2,)), 16)
    grammar = structured_grammar(SamplingFields(guided_regex="( w[0-9]+){2}"))
    stuck = RunnerRequest("stuck", [1], 1, SamplingParams(structured_output=grammar), [])
    free = RunnerRequest("free", [1], 1, SamplingParams(), [])
    logits = torch.zeros(2, 16)
    logits[1, 7] = 5.0
    output = sample(logits, [stuck, free], processors=processors)
    assert output.errors["stuck"].startswith("structured output failed: ")
    assert output.token_ids == {"free": 7}
