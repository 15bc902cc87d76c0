"""Loading models: both config.json forms, sharded safetensors, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, ModelLoadError, SamplingParams
from engine.model.config import PRESETS, from_hf_config
from tests.hf_models import hf_greedy, save_tiny


def test_old_and_new_config_forms_parse_the_same(tmp_path: Path) -> None:
    new = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "dtype": "bfloat16",
           "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    old = {**{k: v for k, v in new.items() if k not in ("dtype", "rope_parameters")},
           "torch_dtype": "bfloat16", "rope_theta": 500000.0}
    (tmp_path / "new.json").write_text(json.dumps(new))
    (tmp_path / "old.json").write_text(json.dumps(old))
    parsed_new, parsed_old = (from_hf_config(tmp_path / n) for n in ("new.json", "old.json"))
    assert parsed_new == parsed_old
    assert parsed_new.rope_theta == 500000.0 and parsed_new.dtype == "bfloat16"
    assert parsed_new.head_dim == 8


def test_sharded_safetensors_load_exactly(tmp_path: Path) -> None:
    import transformers

    directory = save_tiny("llama", tmp_path / "one")
    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    prompts = [[5, 6, 7, 8, 9], [11] * 20]
    engine = Engine(EngineConfig(model=str(sharded), device="cpu", chunk_tile=1,
                                 max_num_batched_tokens=8))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert outputs == hf_greedy(directory, prompts, 4)


def test_missing_path_names_the_fix() -> None:
    with pytest.raises(ModelLoadError, match="synthetic:<preset>"):
        Engine(EngineConfig(model="/no/such/model"))


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="not supported"):
        Engine(EngineConfig(model=str(tmp_path)))


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ModelLoadError, match="tiny"):
        Engine(EngineConfig(model="synthetic:huge"))


def test_presets_have_the_advertised_sizes() -> None:
    assert 18e6 < PRESETS["small"].num_params() < 24e6
    assert 130e6 < PRESETS["150m"].num_params() < 170e6
    assert 7.5e9 < PRESETS["8b"].num_params() < 8.5e9
    assert 6.5e9 < PRESETS["7b"].num_params() < 7e9


def test_text_prompts_round_trip_through_the_byte_tokenizer() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny"))
    ids = engine.tokenizer.encode("héllo")
    assert engine.tokenizer.decode(ids) == "héllo"
    assert engine.generate(["héllo"], SamplingParams(max_tokens=2, ignore_eos=True))
