"""FP8 checkpoints of the bundled model load exactly: kvray's logits and greedy tokens match
a float model of the same dequantized weights.

A prompt of at most 16 tokens runs W8A16 (16-bit activations) everywhere, so there the only
difference from the float model is rounding: a tight tolerance. Longer batches quantize their
activations per token to e4m3 (W8A8, 3 mantissa bits in every layer): there the next-token
distributions stay close (KL divergence) and the most likely token is the same wherever the
float model is not near a tie.
"""

import pytest
import torch

from tests.support.bundled_checkpoints import (
    PROMPT,
    assert_ranks_hold_layers,
    bundled_float_weights,
    greedy_tokens,
    load_checkpoint,
    logits_of,
    write_checkpoint,
)
from tests.support.fp8_quantizers import fp8_checkpoint

SCHEMES = ["fp8-tensor", "fp8-block", "ct-channel", "ct-tensor"]
W8A16_ATOL = 2e-3  # float32 sums in another order
W8A8_MEAN_KL, W8A8_MAX_KL = 0.05, 0.3
LONG_PROMPT = PROMPT * 2  # 24 tokens: past the W8A16 batch limit


def assert_same_distributions(logits: torch.Tensor, expected: torch.Tensor) -> None:
    """Every position's most likely token is the same where the float model is not near a
    tie (its first two tokens a logit or more apart), and the distributions are close."""
    top2 = expected.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1.0
    assert torch.equal(logits.argmax(-1)[clear], expected.argmax(-1)[clear])
    p, q = expected.log_softmax(-1), logits.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert kl.mean() < W8A8_MEAN_KL and kl.max() < W8A8_MAX_KL, kl


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """scheme -> (fp8 checkpoint folder, float model of its dequantized weights)."""
    root = tmp_path_factory.mktemp("fp8")
    _, weights = bundled_float_weights()
    made = {}
    for scheme in SCHEMES:
        tensors, config, floats = fp8_checkpoint(weights, scheme)
        folder = write_checkpoint(root / scheme, tensors, config)
        made[scheme] = (folder, load_checkpoint(write_checkpoint(root / f"{scheme}-f", floats)))
    made["f32"] = (write_checkpoint(root / "f32", weights), None)
    return made


@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_fp8_checkpoint_gives_the_float_models_logits_and_tokens(checkpoints, scheme):
    folder, reference = checkpoints[scheme]
    model = load_checkpoint(folder)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight.dtype == torch.float32  # the head and embeddings stay float
    torch.testing.assert_close(
        logits_of(model, PROMPT), logits_of(reference, PROMPT), atol=W8A16_ATOL, rtol=0
    )
    assert_same_distributions(logits_of(model, LONG_PROMPT), logits_of(reference, LONG_PROMPT))
    assert greedy_tokens(model, PROMPT, 4) == greedy_tokens(reference, PROMPT, 4)


def test_a_float_checkpoint_quantized_at_load_keeps_the_float_models_tokens(checkpoints):
    folder, _ = checkpoints["f32"]
    model, reference = load_checkpoint(folder, "fp8"), load_checkpoint(folder)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert_same_distributions(logits_of(model, LONG_PROMPT), logits_of(reference, LONG_PROMPT))
    assert greedy_tokens(model, PROMPT, 4) == greedy_tokens(reference, PROMPT, 4)


@pytest.mark.parametrize("scheme", ["fp8-tensor", "ct-channel"])
def test_tensor_parallel_ranks_hold_the_fp8_layers_between_them(checkpoints, scheme):
    """Three ranks (the bundled model's 9 heads and 3 KV heads do not split in two)."""
    assert_ranks_hold_layers(checkpoints[scheme][0])


def test_a_missing_scale_is_named_as_the_checkpoint_names_it(tmp_path):
    _, weights = bundled_float_weights()
    tensors, config, _ = fp8_checkpoint(weights, "fp8-tensor")
    del tensors["model.layers.2.self_attn.v_proj.weight_scale"]
    folder = write_checkpoint(tmp_path / "broken", tensors, config)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.v_proj\.weight_scale"):
        load_checkpoint(folder)
