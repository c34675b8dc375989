"""Llama-family decoder: Llama 2/3/3.1, Mistral, Qwen2 and Qwen3 differ only in a few switches.

Written in total sizes; the parallel layers keep this rank's shard. With pipeline parallel a
stage builds only its own decoder layers (others stay `None` so checkpoint indices hold),
the embedding on the first stage and the final norm and head on the last.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.distributed import (
    get_pp_layer_range,
    get_pp_rank,
    get_pp_size,
    sequence_gather,
    sequence_parallel_enabled,
    sequence_shard,
)
from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from engine.layers.norm import RMSNorm
from engine.layers.quantization.base import LinearMethod, QuantConfig
from engine.layers.rotary import RotaryEmbedding, get_rope
from engine.models.checkpoint_weights import CheckpointWeights

IntermediateTensors = dict[str, torch.Tensor]
"""What a pipeline stage hands the next: {"hidden_states", "residual"}."""


def linear_method(quant_config: QuantConfig | None, prefix: str) -> LinearMethod | None:
    """The quantization method of the linear layer at `prefix`; None: 16-bit weights."""
    if quant_config is None:
        return None
    parent, module = prefix.rsplit(".", 1)
    parts = LlamaForCausalLM.packed_modules_mapping.get(module, [module])
    return quant_config.linear_method(prefix, [f"{parent}.{part}" for part in parts])


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size, intermediate_size],
            bias=bias,
            method=linear_method(quant_config, f"{prefix}.gate_up_proj"),
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=bias,
            name="intermediate_size",
            method=linear_method(quant_config, f"{prefix}.down_proj"),
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, gathered_tokens: int | None = None) -> torch.Tensor:
        """gathered_tokens: the batch's size when x is this rank's sequence-parallel rows."""
        if gathered_tokens is None:
            return self.down_proj(self.act_fn(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj.forward_gathered(x, gathered_tokens)
        return self.down_proj.forward_scattered(self.act_fn(gate_up))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        rotary_emb: RotaryEmbedding,
        arch: type[LlamaForCausalLM],
        quant_config: QuantConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = head_dim_of(config)
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            num_heads,
            num_kv_heads,
            bias=arch.qkv_bias or bias,
            method=linear_method(quant_config, f"{prefix}.qkv_proj"),
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            num_heads * head_dim,
            config.hidden_size,
            bias=bias and arch.o_proj_bias,
            name="num_attention_heads * head_dim",
            method=linear_method(quant_config, f"{prefix}.o_proj"),
            prefix=f"{prefix}.o_proj",
        )
        self.head_dim = head_dim
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        if arch.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb  # one table shared by every layer
        self.attn = Attention(
            self.qkv_proj.num_heads,
            head_dim,
            head_dim**-0.5,
            self.qkv_proj.num_kv_heads,
            sliding_window=arch.sliding_window_of(config),
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, sequence_parallel: bool = False
    ) -> torch.Tensor:
        num_tokens = positions.shape[0]
        if sequence_parallel:
            qkv = self.qkv_proj.forward_gathered(hidden_states, num_tokens)
        else:
            qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, -1, self.head_dim)
        k = k.reshape(num_tokens, -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        out = self.attn(q, k, v, positions, self.rotary_emb)
        return self.o_proj.forward_scattered(out) if sequence_parallel else self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        rotary_emb: RotaryEmbedding,
        arch: type[LlamaForCausalLM],
        quant_config: QuantConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.self_attn = LlamaAttention(
            config, rotary_emb, arch, quant_config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            getattr(config, "mlp_bias", False),
            quant_config,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        sequence_parallel: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With sequence_parallel, hidden_states and residual are this rank's rows of the
        batch (engine.distributed.sequence_shard) in and out."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, sequence_parallel)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        gathered_tokens = positions.shape[0] if sequence_parallel else None
        return self.mlp(hidden_states, gathered_tokens), residual


class LlamaModel(nn.Module):
    def __init__(
        self, config: Any, arch: type[LlamaForCausalLM], quant_config: QuantConfig | None = None
    ):
        super().__init__()
        self.is_first_stage = get_pp_rank() == 0
        self.is_last_stage = get_pp_rank() == get_pp_size() - 1
        self.start_layer, self.end_layer = get_pp_layer_range(config.num_hidden_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size)
            if self.is_first_stage
            else None
        )
        self.rotary_emb = get_rope(config, head_dim_of(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary_emb, arch, quant_config, f"model.layers.{i}")
            if self.start_layer <= i < self.end_layer
            else None
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        num_tokens = positions.shape[0]
        sequence_parallel = sequence_parallel_enabled(num_tokens)
        if self.is_first_stage:
            hidden_states, residual = self.embed_tokens(input_ids, sequence_parallel), None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
            if sequence_parallel:
                hidden_states, residual = sequence_shard(hidden_states), sequence_shard(residual)
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual, sequence_parallel)
        if not self.is_last_stage:
            if sequence_parallel:
                hidden_states = sequence_gather(hidden_states, num_tokens)
                residual = sequence_gather(residual, num_tokens)
            return {"hidden_states": hidden_states, "residual": residual}
        hidden_states, _ = self.norm(hidden_states, residual)
        return sequence_gather(hidden_states, num_tokens) if sequence_parallel else hidden_states


class LlamaForCausalLM(CheckpointWeights, nn.Module):
    """model(input_ids [T], positions [T]) -> hidden [T, H], reading attention metadata from
    engine.forward_context; compute_logits(hidden [N, H]) -> [N, vocab] float32."""

    qkv_bias = False
    """Bias on q/k/v even when the config says no attention_bias (Qwen2)."""
    o_proj_bias = True
    """Whether config.attention_bias also puts a bias on o_proj (Llama) or not (Qwen2)."""
    qk_norm = False
    """Per-head RMSNorm on q and k before rope (Qwen3)."""

    def __init__(self, config: Any, quant_config: QuantConfig | None = None):
        """quant_config: how the linear layers' weights are stored; None: 16-bit."""
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, type(self), quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.sliding_window = type(self).sliding_window_of(config)
        self.lm_head = None
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings and self.model.is_first_stage:
                self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def sliding_window_of(cls, config: Any) -> int | None:
        """The attention window of the model's layers; None when attention is global."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("compute_logits runs on the last pipeline stage only")
        return self.lm_head(hidden_states).float()


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def sliding_window_of(cls, config: Any) -> int | None:
        return getattr(config, "sliding_window", None)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_proj_bias = False

    @classmethod
    def sliding_window_of(cls, config: Any) -> int | None:
        if not getattr(config, "use_sliding_window", False):
            return None
        return getattr(config, "sliding_window", None)


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    qkv_bias = False
    o_proj_bias = True
    qk_norm = True


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
