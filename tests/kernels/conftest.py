"""Kernels against their torch references; on a CPU the Triton kernels run in Triton's
interpreter, where a paged-attention case takes minutes."""

from pathlib import Path

import pytest

from tests.support.tiers import mark_folder

# Interpreted kernels of more than a few seconds a test; the references and the small
# kernels stay in the fast lane.
SLOW = {
    f"test_kernels.py::{name}"
    for name in (
        "test_decode_warm_up_leaves_the_kernel_ready_for_real_batches",
        "test_paged_attention_writes_only_owned_rows_of_a_given_output",
        "test_triton_gemv_matches_linear",
        "test_triton_gumbel_sample_follows_softmax_of_scaled_logits",
        "test_triton_paged_attention",
        "test_triton_paged_attention_batch_shapes",
        "test_triton_paged_decode_any_split_count",
        "test_triton_paged_decode_wide_tiles_for_small_groups",
        "test_triton_rotary_on_fused_qkv",
        "test_triton_store_kv",
    )
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, Path(__file__).parent, slow=SLOW)
