"""Kernels behind one signature each: Triton on CUDA tensors, torch references elsewhere.

The switch `kvray_env.TORCH_KERNELS` forces the references on a GPU too (the oracle path);
it is read on import, and again by `read_kernel_switch()`. The Triton modules are imported
on first use, so CPU-only installs never load triton.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

import kvray_env
from kernels.activation_ref import silu_and_mul_ref
from kernels.attention_ref import paged_attention_ref, store_kv_ref
from kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary_ref import apply_rotary_ref, rotary_store_kv_ref
from kernels.woq_ref import woq_linear_ref

# Kernel name -> (its Triton function as "module:function", its torch reference). Both
# take the same arguments.
KERNELS: dict[str, tuple[str, Callable]] = {
    "store_kv": ("kernels.triton_attention:store_kv_triton", store_kv_ref),
    "paged_attention": ("kernels.triton_attention:paged_attention_triton", paged_attention_ref),
    "rms_norm": ("kernels.triton_norm:rms_norm_triton", rms_norm_ref),
    "fused_add_rms_norm": ("kernels.triton_norm:fused_add_rms_norm_triton", fused_add_rms_norm_ref),
    "apply_rotary": ("kernels.triton_rotary:apply_rotary_triton", apply_rotary_ref),
    "rotary_store_kv": ("kernels.triton_rotary:rotary_store_kv_triton", rotary_store_kv_ref),
    "linear": ("kernels.triton_gemv:gemv_triton", F.linear),
    "silu_and_mul": ("kernels.triton_activation:silu_and_mul_triton", silu_and_mul_ref),
    "woq_linear": ("kernels.triton_woq:woq_linear_triton", woq_linear_ref),
}

_torch_only = False


def read_kernel_switch() -> None:
    """Reads `kvray_env.torch_kernels()` (the references on every device) into the switch
    that the dispatchers below consult. A process that changes the variable calls this
    after."""
    global _torch_only
    _torch_only = kvray_env.torch_kernels()


read_kernel_switch()


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and not _torch_only


@functools.cache
def _triton_function(name: str) -> Callable:
    module, function = KERNELS[name][0].split(":")
    return getattr(importlib.import_module(module), function)


def _pick(name: str, triton: bool) -> Callable:
    return _triton_function(name) if triton else KERNELS[name][1]


def store_kv(key, value, kv_cache, slot_mapping) -> None:
    return _pick("store_kv", use_triton(key))(key, value, kv_cache, slot_mapping)


def paged_attention(
    query,
    kv_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    scale,
    max_query_len,
    max_seq_len,
    num_decodes=0,
    out=None,
):
    """num_decodes: how many leading requests have one query token (a GPU batch splits them
    off to the decode kernel); the reference does not need it. out: write the result there
    (a contiguous tensor like query) rather than in a new tensor."""
    return _pick("paged_attention", use_triton(query))(
        query,
        kv_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        max_query_len,
        max_seq_len,
        num_decodes=num_decodes,
        out=out,
    )


def rms_norm(x, weight, eps):
    return _pick("rms_norm", use_triton(x))(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    return _pick("fused_add_rms_norm", use_triton(x))(x, residual, weight, eps)


def apply_rotary(positions, query, key, cos_sin_cache) -> None:
    return _pick("apply_rotary", use_triton(query))(positions, query, key, cos_sin_cache)


def rotary_store_kv(positions, query, key, value, cos_sin_cache, kv_cache, slot_mapping) -> None:
    """apply_rotary on query and key, then store_kv of the rotated key and value."""
    return _pick("rotary_store_kv", use_triton(query))(
        positions, query, key, value, cos_sin_cache, kv_cache, slot_mapping
    )


def _gemv_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and use_triton(x)
    )


def linear(x, weight, bias=None):
    """F.linear; a one-row 16-bit input on a GPU takes the Triton GEMV."""
    return _pick("linear", _gemv_eligible(x, weight))(x, weight, bias)


def silu_and_mul(x):
    return _pick("silu_and_mul", use_triton(x))(x)


def woq_linear(x, qweight, scales, mins, bits, group_size, bias=None):
    """x @ w.T (+ bias) for a weight-only quantized w in the WOQ layout (kernels/woq_ref.py):
    uint8 qweight [N, K * bits // 8], float16 scales and mins [N, K // group_size]."""
    return _pick("woq_linear", use_triton(x))(x, qweight, scales, mins, bits, group_size, bias)


# Triton only (no reference): the caller decides when they apply.


def gumbel_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    greedy: torch.Tensor | None,
    seed: int,
    vocab_size: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """kernels.triton_sampling.gumbel_sample_triton; chunk None: that module's CHUNK."""
    from kernels.triton_sampling import CHUNK, gumbel_sample_triton

    return gumbel_sample_triton(logits, temperature, greedy, seed, vocab_size, chunk or CHUNK)


def argmax(logits: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """kernels.triton_sampling.argmax_triton: logits[:, :vocab_size].argmax(dim=1)."""
    from kernels.triton_sampling import argmax_triton

    return argmax_triton(logits, vocab_size)


def warm_up_decode(kv_cache: torch.Tensor, num_heads: int, scale: float) -> None:
    """Compiles every decode attention kernel variant for this cache's shape now."""
    from kernels.triton_attention import warm_up_decode as warm_up

    warm_up(kv_cache, num_heads, scale)


def prefill_tile_query_lens(group: int, float32: bool) -> list[int]:
    """The shortest longest-query that takes each prefill attention tile size."""
    from kernels.triton_attention import prefill_tile_query_lens as tile_query_lens

    return tile_query_lens(group, float32)


__all__ = [
    "KERNELS",
    "apply_rotary",
    "argmax",
    "fused_add_rms_norm",
    "gumbel_sample",
    "linear",
    "paged_attention",
    "prefill_tile_query_lens",
    "read_kernel_switch",
    "rms_norm",
    "rotary_store_kv",
    "silu_and_mul",
    "store_kv",
    "use_triton",
    "warm_up_decode",
    "woq_linear",
]
