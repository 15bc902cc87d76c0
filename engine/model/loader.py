"""Build a model from `synthetic:<preset>` or a local Hugging Face directory."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import ModelLoadError
from engine.model.checkpoint import expected_parts, fused_part, to_ours
from engine.model.config import PRESETS, ModelConfig, from_hf_config, preset
from engine.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    import torch

    from engine.model.transformer import Transformer

# torch, safetensors and the model's code are imported by the functions that build a model:
# a model's shape and tokenizer (the twin's whole need) come without them.
SYNTHETIC_PREFIX = "synthetic:"


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer: Tokenizer


def model_config_for(name: str) -> ModelConfig:
    """The shape of `name` without loading weights (budget model, roofline)."""
    if name.startswith(SYNTHETIC_PREFIX):
        return preset(name.removeprefix(SYNTHETIC_PREFIX))
    return from_hf_config(_model_dir(name) / "config.json")


MEMINFO = Path("/proc/meminfo")


def load_model(name: str, device: torch.device, dtype: torch.dtype, max_positions: int,
               seed: int = 0) -> LoadedModel:
    config = model_config_for(name)
    check_memory(name, config, dtype.itemsize, *free_memory(device))
    if name.startswith(SYNTHETIC_PREFIX):
        model = _build(config, max_positions, device, dtype)
        _init_random(model, seed)
        return LoadedModel(model, config, tokenizer_for(name, config))
    model = _build(config, max_positions, device, dtype)
    _load_safetensors(model, _model_dir(name), config)
    return LoadedModel(model, config, tokenizer_for(name, config))


TWIN_FIX = "price it on the GPU twin (bench --simulate GPU)"


def check_memory(name: str, config: ModelConfig, element_bytes: int, available: int | None,
                 where: str = "this host", fix: str = TWIN_FIX) -> None:
    """ModelLoadError for weights that `where` cannot hold, before torch allocates them: past
    a host's memory the kernel's OOM killer ends the process without a word (synthetic:8b in
    float32 asks 32 GB of a 24 GiB host), and a GPU's ends in a CUDA out-of-memory trace."""
    params = config.num_params()
    needed = params * element_bytes
    if available is not None and needed > available:
        raise ModelLoadError(
            f"{name} needs about {needed / 1e9:.1f} GB of memory for its weights "
            f"({params / 1e9:.2f}B parameters of {element_bytes} bytes) and "
            f"{where} has {available / 1e9:.1f} GB available; choose a smaller model or dtype, "
            f"free memory, or {fix}")


def free_memory(device: torch.device) -> tuple[int | None, str]:
    """What `device` has free for weights, and its name: MemAvailable for a CPU, the CUDA
    driver's free bytes for a GPU (None where neither can be read)."""
    if device.type == "cuda":
        import torch
        return torch.cuda.mem_get_info(device)[0], str(device)
    return (available_host_bytes() if device.type == "cpu" else None), "this host"


def available_host_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (Linux), or None."""
    try:
        lines = MEMINFO.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def tokenizer_for(name: str, config: ModelConfig) -> Tokenizer:
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
            f"*.safetensors) or synthetic:<preset> ({', '.join(PRESETS)})"
        )
    return path


def _build(config: ModelConfig, max_positions: int, device: torch.device,
           dtype: torch.dtype) -> Transformer:
    import torch

    from engine.model.transformer import Transformer
    # Parameters are made in the serving dtype: no float32 copy of the whole model at the peak
    # (an 8B model in bfloat16 builds in 16 GB, not 32). Rope tables are computed in float32
    # either way, then cast with everything else.
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Transformer(config, max_positions)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype=dtype).eval().requires_grad_(False)


def _init_random(model: Transformer, seed: int) -> None:
    import torch
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # norms keep their identity init
                continue
            values = torch.randn(param.shape, generator=generator) * 0.02
            param.copy_(values.to(param.dtype))


def _load_safetensors(model: Transformer, directory: Path, config: ModelConfig) -> None:
    import torch
    files = _weight_files(directory)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with _opened(file) as handle:
                for hf_name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    tied_head = config.tie_word_embeddings and hf_name == "lm_head.weight"
                    if "rotary_emb" in hf_name or tied_head:
                        continue
                    name, slot = to_ours(hf_name, config)
                    if name not in params:
                        raise ModelLoadError(f"{file}: unexpected weight {hf_name}")
                    tensor = handle.get_tensor(hf_name)
                    target = params[name]
                    if slot is not None:
                        target = fused_part(target, name, slot, config)
                        loaded.add(f"{name}#{slot}")
                    else:
                        loaded.add(name)
                    if target.shape != tensor.shape:
                        raise ModelLoadError(
                            f"{file}: {hf_name} has shape {tuple(tensor.shape)}, config.json "
                            f"implies {tuple(target.shape)}"
                        )
                    target.copy_(tensor.to(target.dtype))
    expected = {key for name in params for key in expected_parts(name, config)}
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"{directory}: weights missing from the safetensors files: "
                             f"{', '.join(missing[:5])}")


@contextlib.contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """safe_open(file), its every read's failure a ModelLoadError naming the file."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(file), framework="pt") as handle:
            yield handle
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{file} is not a safetensors file the loader reads ({exc}); "
                             "re-save the model with save_pretrained") from None


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({directory / f for f in weight_map.values()})
        except (OSError, ValueError, LookupError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is not a safetensors index with a weight_map "
                                 f"({type(exc).__name__}: {exc}); re-save the model with "
                                 "save_pretrained") from None
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors files; save the model with "
                             f"safe_serialization (the default of save_pretrained)")
    return files
