"""Reference FP8 checkpoint writers: float weights -> the tensors FP8 checkpoints ship.

Each returns (checkpoint tensors, quantization_config, the float weights they stand for) so a
test can build the float model of exactly the quantized values.
"""

from __future__ import annotations

import torch

from tests.support.bundled_checkpoints import is_quantized_linear

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _to_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, scalar scale, dequantized float weight)."""
    scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12).float()
    q = _to_fp8(w, scale)
    return q, scale, q.float() * scale


def per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale [N, 1], dequantized float weight)."""
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12).float()
    q = _to_fp8(w, scale)
    return q, scale, q.float() * scale


def per_block(w: torch.Tensor, block: int = 128):
    """(fp8 weight, scale_inv [ceil(N/b), ceil(K/b)], dequantized float weight); the last
    blocks of a row or column may be partial."""
    n, k = w.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.zeros(rows * block, cols * block, dtype=w.dtype)
    padded[:n, :k] = w
    blocks = padded.reshape(rows, block, cols, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12).float()
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    q = _to_fp8(w, full)
    return q, scale, q.float() * full


def fp8_checkpoint(weights: dict[str, torch.Tensor], scheme: str):
    """scheme: "fp8-tensor" (HF fp8, per-tensor weight_scale), "fp8-block" (HF fp8,
    weight_scale_inv of 128 x 128 blocks), "ct-channel" / "ct-tensor" (compressed-tensors).
    Returns (tensors, quantization_config, float weights)."""
    tensors, floats = {}, {}
    for name, w in weights.items():
        if not is_quantized_linear(name):
            tensors[name] = floats[name] = w
            continue
        base = name.removesuffix(".weight")
        if scheme == "fp8-block":
            q, scale, deq = per_block(w)
            tensors[f"{base}.weight_scale_inv"] = scale
        elif scheme == "ct-channel":
            q, scale, deq = per_channel(w)
            tensors[f"{base}.weight_scale"] = scale
        else:
            q, scale, deq = per_tensor(w)
            tensors[f"{base}.weight_scale"] = scale.reshape(1) if scheme == "ct-tensor" else scale
        tensors[name], floats[name] = q, deq
    if scheme.startswith("fp8"):
        config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if scheme == "fp8-block":
            config["weight_block_size"] = [128, 128]
    else:
        strategy = scheme.removeprefix("ct-")
        config = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": strategy},
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "dynamic": True,
                    },
                }
            },
            "ignore": ["lm_head"],
        }
    return tensors, config, floats
