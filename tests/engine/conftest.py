"""The engine end to end on CPU: models, loader, sampler, scheduler in a step, the offline
and async APIs, and actor groups through Ray."""

from pathlib import Path

import pytest

from tests.support.tiers import mark_folder, ray_modules

# Ray; engines of the bundled model, transformers' reference of it, its tokenizer loaded
# anew, engine processes.
SLOW = ray_modules("engine") | {
    "test_async_engine.py",
    "test_beam_search.py",  # transformers' beam search of the bundled model as the reference
    "test_forks.py",
    "test_llm_e2e.py",
    "test_piecewise_graphs.py",
    "test_prompt_logprobs.py",
    "test_fp8_models.py",  # checkpoints of the bundled model in each FP8 format
    "test_int4_models.py",  # checkpoints of the bundled model in each int4 format
    "test_structured_output.py",
    "test_tool_choice_engine.py",
    "test_generation_config.py::test_an_engine_process_reports_the_defaults",
    "test_kv_cache_fp8.py::test_the_bundled_model_with_an_fp8_cache_follows_the_float_cache",
    "test_loader.py::test_smollm2_shape_matches_the_bundled_config",
    "test_loader.py::test_bundled_gguf_weights_equal_transformers",
    "test_loader.py::test_bundled_gguf_logits_match_transformers",
    "test_gguf_quantized.py::test_the_bundled_q4_1_file_kept_quantized_gives_the_dequantized_logits",
    "test_gguf_quantized.py::test_llm_serves_the_bundled_gguf_kept_quantized",
    "test_models.py::test_tensor_parallel_two_ranks_match_transformers",  # two processes
    "test_model_lifecycle.py::test_the_bundled_model_switched_in_place_equals_a_fresh_engine",
    "test_tokenizer.py::test_encode_text_with_truncation_set_on_the_backend_still_encodes_everything",
}
# The tests of those modules that need no engine.
FAST = {
    "test_async_engine.py::test_output_deltas_rebuild_the_cumulative_outputs",
    "test_async_engine.py::test_prompt_logprobs_cross_once_and_stay_on_later_outputs",
    "test_async_engine.py::test_a_batch_of_metric_events_is_recorded_a_few_at_a_time",
    "test_forks.py::test_block_copy_matches_the_reference",
    "test_beam_search.py::test_a_beam_search_output_crosses_from_the_engine_process_with_its_logprob_sums",
    "test_piecewise_graphs.py::test_capture_sizes_bound_the_padding",
    "test_piecewise_graphs.py::test_prefill_cuda_graph_tokens_is_checked",
    "test_prompt_logprobs.py::test_prompt_logprobs_out_of_range_is_named",
    "test_structured_output.py::test_masked_rows_sample_only_allowed_tokens_and_the_others_are_untouched",
    "test_structured_output.py::test_allowed_token_ids_narrow_sampling_alone_and_beside_a_grammar_mask",
    "test_structured_output.py::test_one_kind_of_structured_output_at_a_time",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, Path(__file__).parent, slow=SLOW, fast=FAST)
