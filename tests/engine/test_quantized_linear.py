"""The parallel linear layers load a quantization method's tensors shard by shard, exactly.

A toy int8 method (weight int8 [out, in] with one float scale per output channel, or per
tensor in the checkpoint, and a static activation scale) stands for the real ones: the
sharding rules it relies on are the layers', shared by every method.
"""

import pytest
import torch

from engine.distributed import override_parallel_state
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.quantization.base import LinearMethod, empty_param, shard_dims


class Int8PerChannel(LinearMethod):
    name = "int8-test"

    def __init__(self, group: int = 1):
        self.group = group

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        out = sum(output_sizes)
        layer.register_parameter(
            "weight", empty_param(out, input_size, dtype=torch.int8, output_dim=0, input_dim=1)
        )
        layer.register_parameter(
            "weight_scale", empty_param(out, dtype=torch.float32, output_dim=0)
        )
        layer.register_parameter(
            "group_sums",  # something packed along the input: one value per `group` inputs
            empty_param(
                out, input_size // self.group, output_dim=0, input_dim=1, input_pack=self.group
            ),
        )
        scalar = torch.nn.Parameter(torch.zeros(()), requires_grad=False)
        layer.register_parameter("input_scale", shard_dims(scalar, combine="max"))

    def apply(self, layer, x, bias=None):
        w = layer.weight.float() * layer.weight_scale[:, None]
        return torch.nn.functional.linear(x, w, bias)


def _qkv(rank=0, tp=1):
    with override_parallel_state(tp_rank=rank, tp_size=tp):
        return QKVParallelLinear(8, 2, 4, 2, method=Int8PerChannel(), prefix="qkv")


def _shards():
    torch.manual_seed(0)
    weights = {
        s: torch.randint(-127, 128, (n, 8), dtype=torch.int8)
        for s, n in (("q", 8), ("k", 4), ("v", 4))
    }
    scales = {"q": torch.tensor(0.5), "k": torch.tensor([0.25]), "v": torch.tensor(2.0)}
    return weights, scales


def test_per_tensor_scales_of_fused_shards_become_exact_per_channel_scales():
    weights, scales = _shards()
    layer = _qkv()
    for s in "qkv":
        layer.weight_loader(layer.weight, weights[s], s)
        layer.weight_loader(layer.weight_scale, scales[s], s)
        layer.weight_loader(layer.input_scale, torch.tensor(1.0 + "qkv".index(s)), s)
    x = torch.randn(3, 8)
    expected = torch.cat([x @ (weights[s].float() * scales[s].reshape(())).T for s in "qkv"], dim=1)
    torch.testing.assert_close(layer(x), expected)
    assert layer.input_scale.item() == 3.0  # one activation scale serves q, k and v: the largest


def test_two_tensor_parallel_ranks_hold_the_whole_layer_between_them():
    weights, scales = _shards()
    full = _qkv()
    ranks = [_qkv(r, 2) for r in range(2)]
    for layer in (full, *ranks):
        for s in "qkv":
            layer.weight_loader(layer.weight, weights[s], s)
            layer.weight_loader(layer.weight_scale, scales[s], s)
    x = torch.randn(2, 8)
    y, parts = full(x), [layer(x) for layer in ranks]
    # rank r holds [q_r | k_r | v_r]: put the heads back in [q | k | v] order
    q = torch.cat([p[:, :4] for p in parts], 1)
    k = torch.cat([p[:, 4:6] for p in parts], 1)
    v = torch.cat([p[:, 6:] for p in parts], 1)
    torch.testing.assert_close(torch.cat([q, k, v], 1), y)


def test_row_parallel_ranks_sum_to_the_whole_and_cut_packed_inputs_by_group():
    torch.manual_seed(1)
    w = torch.randint(-127, 128, (6, 16), dtype=torch.int8)
    scale = torch.rand(6) + 0.5
    sums = torch.randn(6, 4)  # 16 inputs in groups of 4
    layers = []
    for rank in range(2):
        with override_parallel_state(tp_rank=rank, tp_size=2):
            layer = RowParallelLinear(16, 6, method=Int8PerChannel(group=4), prefix="down")
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.weight_scale, scale)
        layer.weight_loader(layer.group_sums, sums)
        layers.append(layer)
    assert torch.equal(torch.cat([layer.group_sums for layer in layers], 1), sums)
    x = torch.randn(3, 16)
    y = layers[0].method.apply(layers[0], x[:, :8]) + layers[1].method.apply(layers[1], x[:, 8:])
    torch.testing.assert_close(y, x @ (w.float() * scale[:, None]).T)


def test_a_shard_that_splits_a_group_is_refused_naming_the_layer():
    with (
        override_parallel_state(tp_rank=0, tp_size=2),
        pytest.raises(
            ValueError, match=r"down.group_sums: this rank's 6 features do not split into .* 4"
        ),
    ):
        RowParallelLinear(12, 6, method=Int8PerChannel(group=4), prefix="down")


def test_a_merged_shard_of_the_wrong_shape_names_the_shard():
    layer = MergedColumnParallelLinear(8, [4, 4], method=Int8PerChannel(), prefix="gate_up")
    with pytest.raises(ValueError, match=r"\(5, 8\).*\(4, 8\).*shard 1"):
        layer.weight_loader(layer.weight, torch.zeros(5, 8, dtype=torch.int8), 1)


class BlockScales(Int8PerChannel):
    """Scales of 4-row blocks, one row of them per output channel once loaded."""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        super().create_weights(layer, input_size, output_sizes, params_dtype)
        del layer.weight_scale
        scale = empty_param(sum(output_sizes), dtype=torch.float32, output_dim=0, output_repeat=4)
        layer.register_parameter("weight_scale", scale)


def test_block_scales_load_per_channel_when_a_shard_starts_inside_a_block():
    with override_parallel_state(tp_rank=1, tp_size=2):
        # q: 6 heads x 2 = 12 rows (3 blocks of 4), k and v: 2 heads x 2 = 4 rows each
        layer = QKVParallelLinear(8, 2, 6, 2, method=BlockScales(), prefix="qkv")
    q_blocks, k_blocks = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0])
    layer.weight_loader(layer.weight_scale, q_blocks, "q")
    layer.weight_loader(layer.weight_scale, k_blocks, "k")
    # rank 1 holds q rows 6..11 (blocks 1, 1, 2, 2, 2, 2) then k rows 2..3 (block 0)
    assert layer.weight_scale[:8].tolist() == [2.0, 2.0, 3.0, 3.0, 3.0, 3.0, 5.0, 5.0]
    with pytest.raises(ValueError, match="has 2 rows of 4 features"):
        layer.weight_loader(layer.weight_scale, torch.ones(2), "q")


def test_a_tensor_the_fused_shards_share_must_be_the_same_in_each():
    class WithGroupIndex(Int8PerChannel):
        def create_weights(self, layer, input_size, output_sizes, params_dtype):
            super().create_weights(layer, input_size, output_sizes, params_dtype)
            layer.register_parameter(
                "g_idx", empty_param(input_size, dtype=torch.int32, input_dim=1, combine="same")
            )

    layer = MergedColumnParallelLinear(8, [4, 4], method=WithGroupIndex(), prefix="gate_up")
    g_idx = torch.tensor([1, 0, 1, 0, 2, 2, 3, 3], dtype=torch.int32)
    layer.weight_loader(layer.g_idx, g_idx, 0)
    layer.weight_loader(layer.g_idx, g_idx.clone(), 1)
    assert torch.equal(layer.g_idx, g_idx)
    with pytest.raises(ValueError, match="shard 1 differs from shard 0"):
        layer.weight_loader(layer.g_idx, g_idx.flip(0), 1)
