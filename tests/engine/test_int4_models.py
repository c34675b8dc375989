"""AWQ and GPTQ checkpoints of the bundled model load exactly: kvray's logits and greedy
tokens match a float model of the weights the checkpoint's own dequantization gives.

The repack into the weight-only layout rounds each zero point times its scale to float16
(at most 2**-11 of it, the same shift for a whole group of weights), and the kernels widen
the weight to the activations' dtype (float32 here): the logits agree to LOGIT_ATOL (of
logits spread over about +-20) and the greedy tokens are the same. Groups of 64 and 32 (the bundled model's 576 inputs
are no multiple of 128: the kernel tests cover groups of 128).
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
from tests.support.quantizers import int4_checkpoint

LOGIT_ATOL = 0.1
FORMATS = {
    "awq-g64": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "version": "gemm",
    },
    "gptq-g32": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq",
    },
    "gptq-g64-act-order": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 64,
        "desc_act": True,
        "sym": True,
        "checkpoint_format": "gptq",
    },
    "gptq-8bit-g64": {
        "quant_method": "gptq",
        "bits": 8,
        "group_size": 64,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq",
    },
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    _, weights = bundled_float_weights()
    made = {}
    for name, config in FORMATS.items():
        tensors, floats = int4_checkpoint(weights, config)
        made[name] = (
            write_checkpoint(root / name, tensors, config),
            load_checkpoint(write_checkpoint(root / f"{name}-f", floats)),
        )
    return made


@pytest.mark.parametrize("name", FORMATS)
def test_an_int4_checkpoint_gives_the_float_models_logits_and_tokens(checkpoints, name):
    folder, reference = checkpoints[name]
    model = load_checkpoint(folder)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.qweight.dtype == torch.uint8 and layer.method.name == name.split("-")[0]
    assert model.lm_head.weight.dtype == torch.float32
    torch.testing.assert_close(
        logits_of(model, PROMPT), logits_of(reference, PROMPT), atol=LOGIT_ATOL, rtol=0
    )
    assert greedy_tokens(model, PROMPT, 4) == greedy_tokens(reference, PROMPT, 4)


@pytest.mark.parametrize("name", ["awq-g64", "gptq-g32"])
def test_tensor_parallel_ranks_hold_the_int4_layers_between_them(checkpoints, name):
    """Three ranks (the bundled model's 9 heads and 3 KV heads do not split in two)."""
    assert_ranks_hold_layers(checkpoints[name][0])


def test_an_act_order_checkpoint_is_refused_where_ranks_would_split_its_inputs(checkpoints):
    folder, _ = checkpoints["gptq-g64-act-order"]
    with pytest.raises(
        ValueError, match=r"o_proj: an activation-order GPTQ checkpoint \(desc_act\)"
    ):
        load_checkpoint(folder, tp_rank=0, tp_size=3)


def test_a_group_size_the_kernels_do_not_take_is_refused_naming_it(tmp_path):
    _, weights = bundled_float_weights()
    config = dict(FORMATS["gptq-g32"], group_size=-1)
    folder = write_checkpoint(tmp_path / "g-1", dict(list(weights.items())[:3]), config)
    with pytest.raises(ValueError, match=r"group_size=-1 is not supported.*16, 32, 64, 128"):
        load_checkpoint(folder)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_dummy_weights_run_as_random_int4_weights(tmp_path, method):
    """The benchmarks' path: load_format="dummy" with an int4 method quantizes the random
    16-bit weights at load."""
    from engine import LLM, SamplingParams
    from tests.support.tiny_models import TINY_ARGS, write_tiny_llama

    folder = write_tiny_llama(tmp_path)
    llm = LLM(model=folder, load_format="dummy", quantization=method, device="cpu", **TINY_ARGS)
    assert llm.engine.config.model.quantization == method
    layer = llm.engine.executor.worker.runner.model.model.layers[0].mlp.down_proj
    assert layer.qweight.dtype == torch.uint8  # int4, two a byte
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
