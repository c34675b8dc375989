"""A small llama GGUF file of random weights in a mix of quantized types, for tests that
must not depend on the bundled model (the GPU machine has none).

Its sizes are multiples of 256 where a layer's inputs are (the K-quants' blocks need it).
It carries a byte-level tokenizer of its vocabulary (each byte one token, two merges,
then named tokens), enough for the engine to load one; tests prompt it with token ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from tests.support.gguf_checkpoints import write_gguf

T = GGMLQuantizationType
V = GGUFValueType
LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2, 256, 512, 4, 2, 64, 512
# Every type the kernels run, and fused layers whose shards differ: layer 0's q/k/v
# (Q4_K, Q4_K, Q6_K) and gate/up (Q4_1, Q8_0), layer 1's gate/up (Q5_K, Q4_K).
MIXED_TYPES = {
    "blk.0.attn_q.weight": T.Q4_K,
    "blk.0.attn_k.weight": T.Q4_K,
    "blk.0.attn_v.weight": T.Q6_K,
    "blk.0.attn_output.weight": T.Q4_0,
    "blk.0.ffn_gate.weight": T.Q4_1,
    "blk.0.ffn_up.weight": T.Q8_0,
    "blk.0.ffn_down.weight": T.Q5_K,
    "blk.1.attn_q.weight": T.Q8_0,
    "blk.1.attn_k.weight": T.Q8_0,
    "blk.1.attn_v.weight": T.Q8_0,
    "blk.1.attn_output.weight": T.Q6_K,
    "blk.1.ffn_gate.weight": T.Q5_K,
    "blk.1.ffn_up.weight": T.Q4_K,
    "blk.1.ffn_down.weight": T.Q4_0,
    "token_embd.weight": T.F16,
    "output.weight": T.Q8_0,  # the LM head: dequantized at load by either path
}


def _metadata() -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    # GPT-2's byte-to-character table: byte-level BPE vocabularies spell bytes this way.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelled = {b: chr(b) for b in printable}
    spelled.update(
        {b: chr(256 + i) for i, b in enumerate(x for x in range(256) if x not in spelled)}
    )
    tokens = [spelled[b] for b in range(256)] + ["ab", "cd"]
    tokens += [f"<tok{i}>" for i in range(len(tokens), VOCAB)]
    return [
        ("general.name", "random-llama", V.STRING, None),
        ("llama.block_count", LAYERS, V.UINT32, None),
        ("llama.context_length", 1024, V.UINT32, None),
        ("llama.embedding_length", HIDDEN, V.UINT32, None),
        ("llama.feed_forward_length", INTERMEDIATE, V.UINT32, None),
        ("llama.attention.head_count", HEADS, V.UINT32, None),
        ("llama.attention.head_count_kv", KV_HEADS, V.UINT32, None),
        ("llama.rope.dimension_count", HEAD_DIM, V.UINT32, None),
        ("llama.rope.freq_base", 10000.0, V.FLOAT32, None),
        ("llama.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32, None),
        ("llama.vocab_size", VOCAB, V.UINT32, None),
        ("tokenizer.ggml.model", "gpt2", V.STRING, None),
        ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
        ("tokenizer.ggml.token_type", [1] * VOCAB, V.ARRAY, V.INT32),
        # Two merges: an array of one string reaches some transformers versions as the
        # string itself, whose characters then read as one-part merges.
        ("tokenizer.ggml.merges", ["a b", "c d"], V.ARRAY, V.STRING),
        ("tokenizer.ggml.bos_token_id", VOCAB - 2, V.UINT32, None),
        ("tokenizer.ggml.eos_token_id", VOCAB - 1, V.UINT32, None),
    ]


def _random_tensors(seed: int) -> dict[str, np.ndarray]:
    """llama.cpp-named weights [out, in] of std 0.02, with a few larger ones in each so
    that activations and logits spread as a trained model's do (not all near-ties)."""
    rng = np.random.default_rng(seed)
    kv = KV_HEADS * HEAD_DIM
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": (kv, HIDDEN),
            f"blk.{i}.attn_v.weight": (kv, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_gate.weight": (INTERMEDIATE, HIDDEN),
            f"blk.{i}.ffn_up.weight": (INTERMEDIATE, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, INTERMEDIATE),
        }
    tensors = {}
    for name, shape in shapes.items():
        w = rng.normal(0, 0.02, shape)
        outliers = rng.random(shape) < 0.01
        w[outliers] = rng.normal(0, 0.2, outliers.sum())
        tensors[name] = w.astype(np.float32)
    tensors["output.weight"] *= 10  # peaked next-token distributions
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = (1 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32)
    tensors["output_norm.weight"] = np.ones(HIDDEN, dtype=np.float32)
    return tensors


def write_random_llama_gguf(
    path: Path, types: Mapping[str, GGMLQuantizationType] = MIXED_TYPES, seed: int = 0
) -> Path:
    """The random llama file at `path`, each tensor stored at types[name] (F32 where types
    has none: the norms)."""
    return write_gguf(path, _random_tensors(seed), types, _metadata())


PROMPTS = [
    [396, 121, 426, 84, 203, 324, 262, 452, 47, 127, 500, 131],
    [423, 61, 341, 353, 44, 290, 418, 88, 33, 133, 232],
    [265, 185, 127, 32, 31, 202],
]
"""Token ids (the file's tokenizer is only there so that the engine loads it) whose
NUM_TOKENS greedy steps in float32 each lead the next best token by more than 1.5 (a few
such prompts among random ones: this random model's logits have near-ties elsewhere)."""
NUM_TOKENS = 8
