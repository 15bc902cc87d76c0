"""Loading models: both config.json forms, sharded safetensors, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, ModelLoadError, SamplingParams
from engine.model.checkpoint import to_hf
from engine.model.config import PRESETS, from_hf_config
from tests.hf_models import FAMILIES, hf_greedy, save_tiny


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


@pytest.mark.parametrize(("files", "said"), [
    ({"model.safetensors": b"garbage\xff"},
     "model.safetensors is not a safetensors file the loader reads"),
    ({"model.safetensors.index.json": b'{"weight_map":'},
     "model.safetensors.index.json is not a safetensors index with a weight_map"),
    ({"model.safetensors.index.json": b'{"weight_map": 5}'}, "with a weight_map"),
    ({"model.safetensors.index.json": b'{"weight_map": {"w": "gone.safetensors"}}'},
     "gone.safetensors is not a safetensors file the loader reads"),
])
def test_weight_files_the_loader_cannot_read_name_the_file_and_the_fix(
        files: dict[str, bytes], said: str, tmp_path: Path) -> None:
    """A broken checkpoint is refused like a broken config.json: the file, then the fix."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
         "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1,
         "vocab_size": 300, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}))
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ModelLoadError, match=f"{said}.*re-save the model"):
        Engine(EngineConfig(model=str(tmp_path), device="cpu"))


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ModelLoadError, match="tiny"):
        Engine(EngineConfig(model="synthetic:huge"))


def test_presets_have_the_advertised_sizes() -> None:
    assert 18e6 < PRESETS["small"].num_params() < 24e6
    assert 130e6 < PRESETS["150m"].num_params() < 170e6
    assert 7.5e9 < PRESETS["8b"].num_params() < 8.5e9
    assert 6.5e9 < PRESETS["7b"].num_params() < 7e9
    for family in ("qwen3", "gemma2", "gemma3", "phi3"):
        assert 18e6 < PRESETS[f"{family}-small"].num_params() < 24e6, family
    assert 0.55e9 < PRESETS["qwen3-0.6b"].num_params() < 0.65e9
    assert 0.95e9 < PRESETS["gemma3-1b"].num_params() < 1.05e9
    assert 3.7e9 < PRESETS["phi3-mini"].num_params() < 3.9e9


@pytest.mark.parametrize("name", ["qwen3-small", *(pytest.param(name, marks=pytest.mark.slow)
                                                  for name in ("gemma2-small", "gemma3-small",
                                                               "phi3-small"))])
def test_family_presets_serve_without_download(name: str) -> None:
    """A prompt longer than the preset's window, in chunks, equals it in one prefill."""
    prompt = [(7 * i) % 500 for i in range(300)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    outputs = [Engine(EngineConfig(model=f"synthetic:{name}", device="cpu", chunk_tile=1,
                                   max_num_batched_tokens=budget)).generate([prompt], params)
               for budget in (97, 4096)]
    assert outputs[0] == outputs[1]
    assert len(outputs[0][0]) == 3


@pytest.mark.slow  # builds a model of every family
def test_family_config_fields_parse(tmp_path: Path) -> None:
    """Each family's windows, norms and caps as transformers decides them from config.json."""
    layouts = {}
    for family in FAMILIES:
        config = from_hf_config(save_tiny(family, tmp_path / family) / "config.json")
        assert config.architecture == family
        layouts[family] = (config.sliding_window, config.sliding_layers)
    assert layouts == {"llama": (None, ()), "qwen2": (None, ()), "qwen3": (8, (1,)),
                       "mistral": (8, (0, 1)), "gemma2": (8, (0,)), "gemma3": (12, (0, 1)),
                       "phi3": (16, (0, 1))}
    gemma3 = from_hf_config(tmp_path / "gemma3" / "config.json")
    assert (gemma3.rope_local_theta, gemma3.rope_theta) == (100.0, 5e4)
    assert gemma3.rope_scaling is not None and gemma3.rope_scaling["rope_type"] == "linear"
    gemma2 = from_hf_config(tmp_path / "gemma2" / "config.json")
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (2.0, 3.0)
    assert gemma2.hidden_act == "gelu_pytorch_tanh" and gemma2.query_pre_attn_scalar == 24


def _write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def test_older_gemma3_and_qwen_config_forms(tmp_path: Path) -> None:
    base = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 6, "num_attention_heads": 4}
    gemma3 = from_hf_config(_write(tmp_path, {
        **base, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 16,
        "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 3}))
    assert gemma3.sliding_layers == (0, 1, 3, 4) and gemma3.rope_local_theta == 1e4
    # real Qwen2 checkpoints carry a window they do not use
    qwen = from_hf_config(_write(tmp_path, {
        **base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32768,
        "use_sliding_window": False, "max_window_layers": 2}))
    assert (qwen.sliding_window, qwen.sliding_layers) == (None, ())
    qwen = from_hf_config(_write(tmp_path, {
        **base, "architectures": ["Qwen3ForCausalLM"], "sliding_window": 64,
        "use_sliding_window": True, "max_window_layers": 4}))
    assert qwen.sliding_layers == (4, 5)


@pytest.mark.parametrize(("extra", "message"), [
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "only llama3, linear"),
    ({"partial_rotary_factor": 0.5}, "partial rotary"),
    ({"hidden_act": "relu"}, "activation 'relu'"),
])
def test_unsupported_family_features_are_clear_errors(tmp_path: Path, extra: dict,
                                                      message: str) -> None:
    raw = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 100, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "sliding_window": 8, **extra}
    _write(tmp_path, raw)
    with pytest.raises(ModelLoadError, match=message):
        Engine(EngineConfig(model=str(tmp_path), device="cpu"))


def test_fused_checkpoint_keeps_its_layout(tmp_path: Path) -> None:
    """Phi-3 stores qkv_proj fused; Llama stores q/k/v apart. One map says which."""
    phi3 = Engine(EngineConfig(model=str(save_tiny("phi3", tmp_path / "phi3")), device="cpu"))
    llama = Engine(EngineConfig(model=str(save_tiny("llama", tmp_path / "llama")),
                                device="cpu"))
    phi3_names = set(to_hf(phi3.runner.model.state_dict(), phi3.model_config))
    llama_names = set(to_hf(llama.runner.model.state_dict(), llama.model_config))
    assert "model.layers.0.self_attn.qkv_proj.weight" in phi3_names
    assert {"model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.gate_proj.weight"} <= llama_names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in llama_names)


def test_text_prompts_round_trip_through_the_byte_tokenizer() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny"))
    ids = engine.tokenizer.encode("héllo")
    assert engine.tokenizer.decode(ids) == "héllo"
    assert engine.generate(["héllo"], SamplingParams(max_tokens=2, ignore_eos=True))


def test_a_model_the_host_cannot_build_is_refused_before_torch_allocates_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.model import loader
    from engine.model.config import preset

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25165824 kB\nMemAvailable:   20000000 kB\n")
    monkeypatch.setattr(loader, "MEMINFO", meminfo)
    assert loader.available_host_bytes() == 20_000_000 * 1024
    eight = preset("8b")
    with pytest.raises(ModelLoadError, match=r"synthetic:8b needs about 32\.1 GB of memory for "
                                             r"its weights \(8\.03B parameters of 4 bytes\).*"
                                             r"has 20\.5 GB available; choose a smaller model"):
        loader.check_memory("synthetic:8b", eight, 4, loader.available_host_bytes())
    # in bfloat16 it is built in its dtype: 16 GB fits
    loader.check_memory("synthetic:8b", eight, 2, loader.available_host_bytes())
    loader.check_memory("synthetic:8b", eight, 4, 33 * 10**9)  # room: nothing said
    loader.check_memory("synthetic:8b", eight, 4, None)  # no reading (not Linux): no check
    monkeypatch.setattr(loader, "MEMINFO", tmp_path / "none")
    assert loader.available_host_bytes() is None
    meminfo.write_text("MemTotal:       25165824 kB\nMemAvailable:   10 kB\n")
    monkeypatch.setattr(loader, "MEMINFO", meminfo)
    with pytest.raises(ModelLoadError, match="synthetic:tiny needs"):
        Engine(EngineConfig(model="synthetic:tiny"))
    # a GPU (a double of the CUDA driver's free bytes: no GPU here) is read the same way
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * 10**9, 80 * 10**9))
    assert loader.free_memory(torch.device("cuda:0")) == (10 * 10**9, "cuda:0")
    with pytest.raises(ModelLoadError, match=r"16\.1 GB of memory for its weights .* and "
                                             r"cuda:0 has 10\.0 GB available"):
        loader.load_model("synthetic:8b", torch.device("cuda:0"), torch.bfloat16, 1024)


def test_a_model_is_built_in_its_serving_dtype_with_the_same_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No float32 copy at the peak, and the weights, norms and rope tables a float32 build
    cast to bfloat16 gives, bit for bit."""
    from engine.model import loader
    from engine.model.config import preset
    from engine.model.transformer import Transformer

    config = preset("gemma2-small")
    built = loader._build(config, 256, torch.device("cpu"), torch.bfloat16)
    made: list[torch.dtype] = []
    monkeypatch.setattr(torch.nn.Linear, "reset_parameters",
                        lambda self: made.append(self.weight.dtype))
    loader._build(config, 256, torch.device("cpu"), torch.bfloat16)
    assert made and set(made) == {torch.bfloat16}  # each weight made in bfloat16
    monkeypatch.undo()
    assert torch.get_default_dtype() == torch.float32  # left as it was
    loader._init_random(built, 3)
    cast = Transformer(config, 256).to(dtype=torch.bfloat16)
    loader._init_random(cast, 3)
    ours, theirs = built.state_dict(), cast.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert all(torch.equal(a, b) and a.dtype == b.dtype
               for a, b in zip(built.buffers(), cast.buffers(), strict=True))
