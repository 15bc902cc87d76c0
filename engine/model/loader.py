"""Build a model from `synthetic:<preset>` or a local Hugging Face directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.model.config import ModelConfig, from_hf_config, preset
from engine.model.llama import LlamaModel
from engine.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

SYNTHETIC_PREFIX = "synthetic:"


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: Tokenizer


def model_config_for(name: str) -> ModelConfig:
    """The shape of `name` without loading weights (budget model, roofline)."""
    if name.startswith(SYNTHETIC_PREFIX):
        return preset(name.removeprefix(SYNTHETIC_PREFIX))
    return from_hf_config(_model_dir(name) / "config.json")


def load_model(name: str, device: torch.device, dtype: torch.dtype, max_positions: int,
               seed: int = 0, use_flash: bool = False) -> LoadedModel:
    config = model_config_for(name)
    if name.startswith(SYNTHETIC_PREFIX):
        model = _build(config, max_positions, use_flash, device, dtype)
        _init_random(model, seed)
        return LoadedModel(model, config, tokenizer_for(name, config))
    model = _build(config, max_positions, use_flash, device, dtype)
    _load_safetensors(model, _model_dir(name), config)
    return LoadedModel(model, config, tokenizer_for(name, config))


def tokenizer_for(name: str, config: ModelConfig) -> Tokenizer:
    """A model directory's tokenizer.json, else bytes (synthetic models, or a directory
    without one)."""
    if not name.startswith(SYNTHETIC_PREFIX):
        tokenizer_file = _model_dir(name) / "tokenizer.json"
        if tokenizer_file.exists():
            return HFTokenizer(tokenizer_file, config.eos_token_id)
    return ByteTokenizer(config.vocab_size)


def _model_dir(name: str) -> Path:
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model {name!r} not found: pass a local Hugging Face directory (config.json and "
            f"*.safetensors) or synthetic:<preset> (tiny, small, 150m, 1b, 7b, 8b)"
        )
    return path


def _build(config: ModelConfig, max_positions: int, use_flash: bool, device: torch.device,
           dtype: torch.dtype) -> LlamaModel:
    with torch.device(device):
        model = LlamaModel(config, max_positions, use_flash)
    # rope tables stay fp32; everything else in the serving dtype
    return model.to(dtype=dtype).eval().requires_grad_(False)


def _init_random(model: LlamaModel, seed: int) -> None:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                continue
            values = torch.randn(param.shape, generator=generator) * 0.02
            param.copy_(values.to(param.dtype))


def _hf_to_ours(name: str) -> tuple[str, int | None]:
    """Map a Hugging Face weight name to ours, with the slot in a fused projection."""
    name = name.removeprefix("model.")
    for part, (fused, slot) in _FUSED.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), slot
    return name, None


_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _load_safetensors(model: LlamaModel, directory: Path, config: ModelConfig) -> None:
    files = _weight_files(directory)
    params = dict(model.named_parameters())
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [config.intermediate_size] * 2}
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for hf_name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    tied_head = config.tie_word_embeddings and hf_name == "lm_head.weight"
                    if "rotary_emb" in hf_name or tied_head:
                        continue
                    name, slot = _hf_to_ours(hf_name)
                    if name not in params:
                        raise ModelLoadError(f"{file}: unexpected weight {hf_name}")
                    tensor = handle.get_tensor(hf_name)
                    target = params[name]
                    if slot is not None:
                        fused = name.split(".")[-2]
                        offset = sum(sizes[fused][:slot])
                        target = target.narrow(0, offset, sizes[fused][slot])
                        loaded.add(f"{name}#{slot}")
                    else:
                        loaded.add(name)
                    if target.shape != tensor.shape:
                        raise ModelLoadError(
                            f"{file}: {hf_name} has shape {tuple(tensor.shape)}, config.json "
                            f"implies {tuple(target.shape)}"
                        )
                    target.copy_(tensor.to(target.dtype))
    expected = set()
    for name in params:
        fused = name.split(".")[-2] if name.count(".") else ""
        if fused in sizes:
            expected.update(f"{name}#{slot}" for slot in range(len(sizes[fused])))
        else:
            expected.add(name)
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"{directory}: weights missing from the safetensors files: "
                             f"{', '.join(missing[:5])}")


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({directory / f for f in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors files; save the model with "
                             f"safe_serialization (the default of save_pretrained)")
    return files
