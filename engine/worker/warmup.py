"""The requests an engine runs before serving, so that Triton compiles its kernels then.

A kernel variant first launched during serving is compiled in a user's request. The prefill
attention kernel picks its tile from the batch's longest query (a short prompt or a chunk's
short remainder takes a smaller tile than a long one), the decode kernel has a variant for
the decodes of a batch that mixes them with a prefill, and the sampling kernel one for each
mix of greedy and random rows: the requests here reach each of them.
"""

from __future__ import annotations

from typing import Any

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

WARM_UP_MAX_TOKENS = 4


def warm_up_requests(
    config: EngineConfig, hf_config: Any
) -> list[tuple[list[int], SamplingParams]]:
    """(prompt token ids, SamplingParams) of each warm-up request, in the order to add them:
    a random one alone first, then beside greedy ones, then greedy ones alone, one for each
    prefill attention tile size. Each is added once the ones before it decode, so its
    prefill shares a step with their decodes. Empty where max_model_len leaves no room for a
    prompt and its tokens."""
    from kernels import prefill_tile_query_lens

    room = config.scheduler_config.max_model_len - WARM_UP_MAX_TOKENS
    if room <= 0:
        return []
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    group = hf_config.num_attention_heads // kv_heads
    tiles = prefill_tile_query_lens(group, config.model.dtype == "float32")
    token = min(hf_config.vocab_size - 2 - len(tiles), 100)
    prompts = [(17, 1.0), (40, 0.0)] + [(length, 0.0) for length in tiles]
    return [
        (
            [token + i] * min(length, room),
            SamplingParams(temperature=temperature, max_tokens=WARM_UP_MAX_TOKENS, ignore_eos=True),
        )
        for i, (length, temperature) in enumerate(prompts)
    ]
