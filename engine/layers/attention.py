"""Paged attention layer: stores this step's keys/values, then attends over the cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.forward_context import (
    AttentionMetadata,
    get_attention_metadata,
    get_attention_split,
)
from engine.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Head counts are this rank's. `kv_cache` [2, num_blocks, block_size, num_kv_heads,
    head_dim] is bound by the model runner after it allocates the cache.

    `k_scale` / `v_scale` (float32 scalars, 1.0 unless the checkpoint gives them): an fp8
    cache stores keys / k_scale and values / v_scale and reads them back times the scale;
    a 16-bit cache ignores them. Tensors, so that CUDA graphs read them at replay.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor | None = None
        for name in ("k_scale", "v_scale"):
            # Not in the state dict, which stays the checkpoint's tensors under their names.
            self.register_buffer(name, torch.ones((), dtype=torch.float32), persistent=False)
            getattr(self, name).weight_loader = load_kv_scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        rotary: RotaryEmbedding | None = None,
    ) -> torch.Tensor:
        """q [T, Hq*D], k and v [T, Hkv*D] (or already split into heads) -> [T, Hq*D].

        With `rotary`, q and k are rotated at `positions` first, in the same kernel that
        stores the keys and values. In a forward_context given a split (piecewise graphs),
        the paged attention itself is handed to the split instead of run.
        """
        meta = get_attention_metadata()
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.kv_cache is None:
            self._check_window(meta)
            if rotary is not None:
                rotary(positions, q, k)
            out = _attend_new_tokens(q, k, v, meta, self.scale)
        else:
            if rotary is not None:
                kernels.rotary_store_kv(
                    positions,
                    q,
                    k,
                    v,
                    rotary.cos_sin_cache,
                    self.kv_cache,
                    meta.slot_mapping,
                    self.k_scale,
                    self.v_scale,
                )
            else:
                kernels.store_kv(k, v, self.kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
            split = get_attention_split()
            if split is not None:
                out = split(self, q)
            else:
                out = self.attend(q, meta)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def attend(
        self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Paged attention of q [T, Hq, D], whose keys and values are already stored."""
        self._check_window(meta)
        return kernels.paged_attention(
            q,
            self.kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            self.scale,
            meta.max_query_len,
            meta.max_seq_len,
            meta.num_decodes,
            out=out,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

    def _check_window(self, meta: AttentionMetadata) -> None:
        if self.sliding_window is not None and meta.max_seq_len > self.sliding_window:
            raise ValueError(
                f"a sequence of {meta.max_seq_len} tokens exceeds sliding_window="
                f"{self.sliding_window}, which this attention does not implement; "
                f"use max_model_len <= {self.sliding_window}"
            )

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"


def _attend_new_tokens(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention within each request's new tokens, for forwards without a cache
    (memory profiling); every request must start at position 0."""
    starts = meta.query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    if q_lens != meta.seq_lens.tolist():
        raise RuntimeError("attention without a bound KV cache can only run whole prompts")
    out = torch.empty_like(q)
    for a, b in zip(starts, starts[1:]):
        if a == b:
            continue
        qi, ki, vi = (t[a:b].transpose(0, 1) for t in (q, k, v))
        out[a:b] = F.scaled_dot_product_attention(
            qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
        ).transpose(0, 1)
    return out


def load_kv_scale(buffer: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """A checkpoint's per-layer KV scale (one positive number, any float dtype) into
    `buffer`, the same on every tensor-parallel rank."""
    if loaded.numel() != 1:
        raise ValueError(
            f"a KV cache scale is one number per layer, got shape {tuple(loaded.shape)}"
        )
    value = loaded.reshape(()).float()
    if not (torch.isfinite(value) and value > 0):
        raise ValueError(f"a KV cache scale must be positive and finite, got {value.item()}")
    buffer.copy_(value)


KV_SCALE_NAMES = {
    ("self_attn", "k_scale"): "k_scale",
    ("self_attn", "v_scale"): "v_scale",
    ("k_proj", "output_scale"): "k_scale",
    ("v_proj", "output_scale"): "v_scale",
}
"""The checkpoint's KV cache scale tensors (the last two parts of their names) and the
Attention buffer each loads into."""


def kv_scale_target(name: str) -> str | None:
    """The Attention buffer that checkpoint tensor `name` loads into, for a model whose
    layers name their attention block `self_attn` and its Attention `attn`; None when the
    tensor is no KV scale. "model.layers.3.self_attn.k_proj.output_scale" ->
    "model.layers.3.self_attn.attn.k_scale"."""
    parts = name.split(".")
    buffer = KV_SCALE_NAMES.get(tuple(parts[-2:]))
    if buffer is None:
        return None
    attention = parts[:-1] if parts[-2] == "self_attn" else parts[:-2]
    return ".".join([*attention, "attn", buffer])


def attention_layers(model: nn.Module) -> list[Attention]:
    """This rank's Attention modules in layer order."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def bind_kv_caches(model: nn.Module, kv_caches: list[torch.Tensor | None]) -> None:
    """Give layer i the cache kv_caches[i]; None unbinds it."""
    layers = attention_layers(model)
    if len(kv_caches) != len(layers):
        raise ValueError(f"got {len(kv_caches)} KV caches for {len(layers)} attention layers")
    for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
        if cache is not None and (
            cache.dim() != 5
            or cache.shape[0] != 2
            or tuple(cache.shape[3:]) != (layer.num_kv_heads, layer.head_dim)
        ):
            raise ValueError(
                f"KV cache {i} has shape {tuple(cache.shape)}; expected "
                f"[2, num_blocks, block_size, {layer.num_kv_heads}, {layer.head_dim}]"
            )
        layer.kv_cache = cache
