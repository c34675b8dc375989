"""Where a model comes from, its HF config, and its weights: safetensors, GGUF or dummy."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from engine.bundled import BUNDLED_MODEL_NAME, bundled_model_path
from engine.config import served_name_list
from engine.layers.linear import LinearBase
from engine.layers.norm import RMSNorm
from engine.layers.quantization.base import QuantConfig
from engine.models.registry import architectures_of, get_model_class
from engine.models.shapes import SHAPE_NAMES, get_shape_config

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf", "gguf", "dummy"]
    """hf: a folder with config.json and safetensors; gguf: one .gguf file; dummy: random weights."""
    path: str
    """The folder or .gguf file; for dummy also a shape name from engine.models.shapes."""


def resolve_model_source(model: str | None, load_format: str = "auto") -> ModelSource:
    """Decide what `model` names. None is the bundled SmolLM2 GGUF."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    if load_format == "dummy" and model in SHAPE_NAMES:
        return ModelSource("dummy", model)
    path = bundled_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        hint = ""
        if model in SHAPE_NAMES:
            hint = f" ({model!r} is a model shape: use load_format='dummy')"
        raise FileNotFoundError(f"model path {str(path)!r} does not exist{hint}")
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if load_format == "dummy":
        return ModelSource("dummy", str(path))
    if load_format == "gguf" and not is_gguf:
        raise ValueError(f"load_format='gguf' needs a .gguf file, got {str(path)!r}")
    if load_format == "safetensors" and not path.is_dir():
        raise ValueError(f"load_format='safetensors' needs a model folder, got {str(path)!r}")
    if is_gguf:
        return ModelSource("gguf", str(path))
    if path.is_dir():
        return ModelSource("hf", str(path))
    raise ValueError(f"model {str(path)!r} is neither a model folder nor a .gguf file")


def default_model_name(model: str | None, load_format: str = "auto") -> str:
    """The API name of `model` when no served_model_name is given: its folder or file name
    (bundled SmolLM2: its own name; dummy weights: the shape name or path). Reads no file,
    so a Serve app can name its models before any replica loads one."""
    if model is None:
        return BUNDLED_MODEL_NAME
    path = Path(model).expanduser()
    if load_format == "dummy":
        return str(path)
    if path.suffix == ".gguf" and _is_bundled(path):
        return BUNDLED_MODEL_NAME
    return path.name.removesuffix(".gguf")


def served_names(
    served_model_name: str | list[str] | None, model: str | None, load_format: str = "auto"
) -> list[str]:
    """Every name requests may give a model, the first the one responses carry (and metrics
    label): its served_model_name's, else its default name."""
    return served_name_list(served_model_name) or [default_model_name(model, load_format)]


def _is_bundled(path: Path) -> bool:
    try:
        return path == bundled_model_path()
    except FileNotFoundError:
        return False


def load_hf_config(source: ModelSource) -> PretrainedConfig:
    """The model's HF config, from local files only (never a hub)."""
    if source.kind == "dummy" and source.path in SHAPE_NAMES:
        return get_shape_config(source.path)
    path = Path(source.path)
    if path.is_file():
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def load_model(
    source: ModelSource,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    max_model_len: int | None = None,
    quant_config: QuantConfig | None = None,
) -> nn.Module:
    """Build the registry's class for hf_config on `device` in `dtype`, fill its weights, eval().

    With max_model_len, a model whose sliding window is shorter raises ValueError (the
    attention kernels have no window). quant_config: how the linear layers hold their weights
    (engine.layers.quantization.build_quant_config); None: 16-bit.
    """
    model = build_model(hf_config, dtype, device, max_model_len, quant_config)
    with torch.no_grad():
        if source.kind == "dummy":
            init_dummy_weights(model, hf_config, seed)
        else:
            path = Path(source.path)
            if source.kind == "gguf":
                weights = quant_config and quant_config.gguf_weights(path, hf_config)
                try:
                    loaded = model.load_weights(weights or iter_gguf_weights(path, hf_config))
                except ValueError as e:
                    raise ValueError(f"{path.name}: {e}") from None
            else:
                loaded = _load_safetensors(model, path)
            if loaded is not None:
                _check_all_loaded(model, loaded, str(path))
        _prepare_quantized_layers(model)
    return model.eval()


def build_model(
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    max_model_len: int | None = None,
    quant_config: QuantConfig | None = None,
) -> nn.Module:
    """The registry's class for hf_config on `device` in `dtype`, its weights not filled."""
    model_cls = get_model_class(architectures_of(hf_config))
    device = torch.device(device)
    with _default_dtype(dtype), device:
        if quant_config is None:
            model = model_cls(hf_config)
        else:
            model = model_cls(hf_config, quant_config=quant_config)
    window = getattr(model, "sliding_window", None)
    if max_model_len is not None and window is not None and max_model_len > window:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's sliding_window={window}, which "
            f"is not implemented; use max_model_len <= {window}"
        )
    return model


def _prepare_quantized_layers(model: nn.Module) -> None:
    """Each quantized layer turns its loaded checkpoint tensors into what it multiplies."""
    for module in model.modules():
        if isinstance(module, LinearBase) and module.quantized:
            module.method.process_weights_after_loading(module)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _check_all_loaded(model: nn.Module, loaded: set[str], source: str) -> None:
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if hasattr(model, "checkpoint_names"):  # name the checkpoint's tensors, not fused ones
        missing = [tensor for name in missing for tensor in model.checkpoint_names(name)]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(f"{source}: no checkpoint weights for {shown}")


def init_dummy_weights(model: nn.Module, hf_config: PretrainedConfig, seed: int = 0) -> None:
    """Seeded N(0, 0.02) weights, norm weights at 1, the same for every TP x PP layout.

    Each full checkpoint tensor (HF names and shapes, from a meta-device transformers model)
    is generated from a seed of its own where the parameters live, then loaded through the
    model's weight loaders, so that shards of TP=2 or stages of PP=2 hold exactly the
    weights of TP=1. Models transformers cannot build get per-parameter weights instead.
    """
    try:
        with torch.device("meta"):
            reference = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError):
        reference = None
    targets = getattr(model, "weight_targets", None)
    if reference is None or targets is None:
        _init_dummy_parameters(model, seed)
        return
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, meta in reference.state_dict().items():
            if not targets(name):
                continue  # another pipeline stage's, or the tied LM head
            if "norm" in name.rsplit(".", 2)[-2]:
                yield name, torch.ones(meta.shape, dtype=dtype, device=device)
                continue
            generator = torch.Generator(device).manual_seed(
                seed * 1_000_003 + zlib.crc32(name.encode())
            )
            tensor = torch.empty(meta.shape, dtype=dtype, device=device)
            yield name, tensor.normal_(0.0, 0.02, generator=generator)

    _check_all_loaded(model, model.load_weights(tensors()), "dummy weights")


def _init_dummy_parameters(model: nn.Module, seed: int) -> None:
    generators: dict[torch.device, torch.Generator] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if isinstance(module, RMSNorm):
                param.data.fill_(1.0)
                continue
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            param.data.normal_(0.0, 0.02, generator=generators[param.device])


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint files of an HF folder: the index's shards, model.safetensors, or *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f.name} listed in {index} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {str(folder)!r}")
    return files


def _load_safetensors(model: nn.Module, folder: Path) -> set[str] | None:
    from safetensors import safe_open

    files = safetensors_files(folder)
    current = files[0].name

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal current
        for file in files:
            current = file.name
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    # One pass over all files: a packed parameter's parts may sit in different shards.
    try:
        return model.load_weights(tensors())
    except ValueError as e:
        raise ValueError(f"{current}: {e}") from None


_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp stores that transformers computes instead.
_GGUF_SKIP = {"rope_freqs"}


def gguf_to_hf_name(name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None to skip."""
    parts = name.split(".")
    if parts[0] in _GGUF_SKIP:
        return None
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"unknown GGUF tensor {name!r}")


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows (interleaved rope pairs) back to rotate-half."""
    return (
        w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def iter_gguf_weights(path: Path, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized float32 tensors of a GGUF file under HF names, one at a time."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch_field = reader.fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        # llama.cpp permutes Q/K rows for its interleaved rope only in the llama architecture.
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            weights = _unpermute_rope_rows(weights, num_heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            weights = _unpermute_rope_rows(weights, num_kv_heads)
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        if not weights.flags.writeable:  # unquantized tensors are views of the read-only mmap
            weights = weights.copy()
        yield hf_name, torch.from_numpy(weights)
