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
from kernels.fp8_ref import DEFAULT_BLOCK, fp8_block_linear_ref, fp8_linear_ref, quantize_fp8
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
    "fp8_linear": ("kernels.triton_fp8:fp8_linear_triton", fp8_linear_ref),
    "fp8_block_linear": ("kernels.triton_fp8:fp8_block_linear_triton", fp8_block_linear_ref),
    "woq_linear": ("kernels.triton_woq:woq_linear", woq_linear_ref),
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


def store_kv(key, value, kv_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """An fp8 cache (float8_e4m3fn) stores key / k_scale and value / v_scale, saturated to
    +-448; the scales are float32 one-element tensors (None: 1.0), ignored by other caches."""
    return _pick("store_kv", use_triton(key))(
        key, value, kv_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
    )


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
    k_scale=None,
    v_scale=None,
):
    """num_decodes: how many leading requests have one query token (a GPU batch splits them
    off to the decode kernel); the reference does not need it. out: write the result there
    (a contiguous tensor like query) rather than in a new tensor. k_scale / v_scale: an fp8
    cache's keys and values read as stored * scale (float32 one-element tensors, so that a
    CUDA graph reads them at replay; None: 1.0)."""
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
        k_scale=k_scale,
        v_scale=v_scale,
    )


def rms_norm(x, weight, eps):
    return _pick("rms_norm", use_triton(x))(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    return _pick("fused_add_rms_norm", use_triton(x))(x, residual, weight, eps)


def apply_rotary(positions, query, key, cos_sin_cache) -> None:
    return _pick("apply_rotary", use_triton(query))(positions, query, key, cos_sin_cache)


def rotary_store_kv(
    positions, query, key, value, cos_sin_cache, kv_cache, slot_mapping, k_scale=None, v_scale=None
) -> None:
    """apply_rotary on query and key, then store_kv of the rotated key and value."""
    return _pick("rotary_store_kv", use_triton(query))(
        positions,
        query,
        key,
        value,
        cos_sin_cache,
        kv_cache,
        slot_mapping,
        k_scale=k_scale,
        v_scale=v_scale,
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


def _fp8_eligible(x: torch.Tensor) -> bool:
    return x.dtype in (torch.bfloat16, torch.float16) and use_triton(x)


def fp8_linear(x, weight, weight_scale, input_scale=None, bias=None):
    """x @ (weight * weight_scale[:, None]).T + bias for an fp8 weight [N, K] with float32
    scales per channel [N] or per tensor [1]; input_scale: the static activation scale, or
    None (per-token). Which batches quantize their activations: kernels/fp8_ref.py. A
    16-bit x on a GPU takes the Triton / torch._scaled_mm path."""
    return _pick("fp8_linear", _fp8_eligible(x))(x, weight, weight_scale, input_scale, bias)


def fp8_block_linear(x, weight, weight_scale_inv, bias=None, block=DEFAULT_BLOCK):
    """x @ W.T + bias for an fp8 weight [N, K] with one float32 scale per block of `block`
    (rows, columns): weight_scale_inv [ceil(N / rows), ceil(K / columns)]."""
    return _pick("fp8_block_linear", _fp8_eligible(x))(x, weight, weight_scale_inv, bias, block)


def woq_linear(x, qweight, scales, mins, bits, group_size, bias=None):
    """F.linear by a weight-only quantized weight in the layout of kernels/woq_ref.py; a
    16-bit input on a GPU takes the Triton kernels (kernels/triton_woq)."""
    triton = use_triton(x) and x.dtype in (torch.bfloat16, torch.float16)
    return _pick("woq_linear", triton)(x, qweight, scales, mins, bits, group_size, bias)


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


def warm_up_decode(
    kv_cache: torch.Tensor, num_heads: int, scale: float, dtype: torch.dtype | None = None
) -> None:
    """Compiles every decode attention kernel variant for this cache's shape and the query
    dtype `dtype` (None: the cache's; an fp8 cache needs it) now."""
    from kernels.triton_attention import warm_up_decode as warm_up

    warm_up(kv_cache, num_heads, scale, dtype)


def prefill_tile_query_lens(group: int, float32: bool) -> list[int]:
    """The shortest longest-query that takes each prefill attention tile size."""
    from kernels.triton_attention import prefill_tile_query_lens as tile_query_lens

    return tile_query_lens(group, float32)


__all__ = [
    "KERNELS",
    "apply_rotary",
    "argmax",
    "fp8_block_linear",
    "fp8_linear",
    "fused_add_rms_norm",
    "gumbel_sample",
    "linear",
    "paged_attention",
    "prefill_tile_query_lens",
    "quantize_fp8",
    "read_kernel_switch",
    "rms_norm",
    "rotary_store_kv",
    "silu_and_mul",
    "store_kv",
    "use_triton",
    "warm_up_decode",
    "woq_linear",
]
