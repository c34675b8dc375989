"""How a Llama-family model takes its checkpoint's tensors: HF names to parameters (fused
q/k/v and gate/up shards, pipeline stages that skip other stages' layers, a tied LM head,
the KV cache scales), and the names of what a checkpoint failed to give.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from engine.layers.attention import kv_scale_target
from engine.layers.linear import default_weight_loader


class CheckpointWeights:
    """Weight loading of a model with `model` (start_layer, end_layer, is_first_stage,
    norm), `lm_head` and `tie_word_embeddings`, mixed into its nn.Module class."""

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    stacked_params_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    """Checkpoint module -> (packed module, shard_id passed to its weight_loader)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of the parameters that were loaded.

        Tensors of layers on other pipeline stages are skipped; an unknown name or a wrong
        shape raises ValueError naming the tensor.
        """
        params = dict(self.named_parameters())
        # Buffers that take checkpoint tensors (the KV cache scales) carry a weight_loader.
        params |= {n: b for n, b in self.named_buffers() if hasattr(b, "weight_loader")}
        shards_seen: dict[str, set] = {}
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            for param_name, shard_id in self.weight_targets(name):
                param = params.get(param_name)
                if param is None:
                    raise ValueError(f"unknown weight {name!r} for {type(self).__name__}")
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    loader(param, tensor, shard_id)
                except ValueError as e:
                    raise ValueError(f"weight {name!r}: {e}") from None
                shards_seen.setdefault(param_name, set()).add(shard_id)
        self.shards_loaded = shards_seen
        return {name for name, seen in shards_seen.items() if len(seen) == self._num_shards(name)}

    def checkpoint_names(self, param_name: str) -> list[str]:
        """The checkpoint tensors a parameter still lacks: a fused parameter's missing shards
        under their own names ("...v_proj.weight_scale"), else the parameter's name."""
        parts = param_name.split(".")
        if len(parts) < 2:
            return [param_name]
        seen = getattr(self, "shards_loaded", {}).get(param_name, set())
        shards = [
            (name, shard_id)
            for name, (packed, shard_id) in self.stacked_params_mapping.items()
            if packed == parts[-2]
        ]
        if not shards:
            return [param_name]
        return [".".join([*parts[:-2], n, parts[-1]]) for n, sid in shards if sid not in seen]

    def _num_shards(self, param_name: str) -> int:
        module = param_name.split(".")[-2] if "." in param_name else ""
        return len(self.packed_modules_mapping.get(module, [None]))

    def weight_targets(self, name: str) -> list[tuple[str, Any]]:
        """The (parameter, shard_id) pairs a checkpoint tensor feeds; [] to skip it here."""
        tied, model = self.tie_word_embeddings, self.model
        if name == "lm_head.weight":
            return [] if tied or self.lm_head is None else [(name, None)]
        if name == "model.embed_tokens.weight":
            targets = [(name, None)] if model.is_first_stage else []
            if tied and self.lm_head is not None and not model.is_first_stage:
                targets.append(("lm_head.weight", None))  # a last stage's own copy of the tie
            return targets
        if name.startswith("model.norm.") and model.norm is None:
            return []
        parts = name.split(".")
        if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            if not model.start_layer <= int(parts[2]) < model.end_layer:
                return []
        kv_scale = kv_scale_target(name)
        if kv_scale is not None:
            return [(kv_scale, None)]
        if len(parts) >= 2 and parts[-2] in self.stacked_params_mapping:
            packed, shard_id = self.stacked_params_mapping[parts[-2]]
            return [(".".join([*parts[:-2], packed, parts[-1]]), shard_id)]
        return [(name, None)]
