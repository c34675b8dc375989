"""The GPU fast path (Triton kernels, CUDA graphs) against the torch reference path."""

from __future__ import annotations

import os

import pytest
import torch

import kernels
from engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 64
# One bf16 step of a logit in [32, 64); the float32 log-softmax of two logits one such step
# apart can differ by a few float32 ulps more, hence the slack.
BF16_LOGPROB_TOL = 0.25 + 1e-5
"""bf16 rounding through the layers moves a logprob by up to about this much; two
candidates closer than this are a tie that either path may break its own way."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        initializer_range=0.05,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Peaked next-token distributions, as in a trained model: random weights alone give
        # near-uniform logits where bf16 rounding breaks ties at almost every step.
        model.lm_head.weight.mul_(5.0)
    model = model.to(torch.bfloat16)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return str(path)


def _run(
    model_dir: str,
    prompts,
    torch_kernels: bool,
    enforce_eager: bool,
    dtype: str,
    prompt_logprobs: int | None = None,
    **engine_args,
):
    """Greedy completions with logprobs (the whole RequestOutputs with prompt_logprobs)."""
    old = os.environ.get("KVRAY_TORCH_KERNELS")
    os.environ["KVRAY_TORCH_KERNELS"] = "1" if torch_kernels else "0"
    kernels.read_kernel_switch()
    try:
        llm = LLM(
            model=model_dir,
            dtype=dtype,
            max_model_len=512,
            max_num_seqs=32,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=0.3,
            **engine_args,
        )
        runner = llm.engine.executor.worker.runner
        piecewise = runner.piecewise_graphs
        if piecewise is not None:
            assert set(piecewise.pieces) == set(piecewise.sizes), "a bucket was not captured"
            runs, run = [], piecewise.run

            def spy(input_ids, positions, meta):
                runs.append(meta.max_query_len)
                return run(input_ids, positions, meta)

            piecewise.run = spy
        params = SamplingParams(
            temperature=0.0,
            max_tokens=STEPS,
            ignore_eos=True,
            logprobs=5,
            prompt_logprobs=prompt_logprobs,
        )
        outputs = llm.generate(prompts, params)
        llm.engine.shutdown()
        if piecewise is not None:
            del piecewise.run  # the spy held the graphs in a reference cycle
            assert any(q > 1 for q in runs), "no step with a prefill replayed the graphs"
        if prompt_logprobs is not None:
            return outputs
        return [o.outputs[0] for o in outputs]
    finally:
        if old is None:
            os.environ.pop("KVRAY_TORCH_KERNELS", None)
        else:
            os.environ["KVRAY_TORCH_KERNELS"] = old
        kernels.read_kernel_switch()


def _prompts():
    gen = torch.Generator().manual_seed(1)
    # Lengths that are not multiples of the block size; batch of 20 decodes in graphs.
    return [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in range(5, 105, 5)]


def _matched_steps(fast, ref, tolerance: float) -> int:
    """Steps where both paths chose the same token with logprobs within `tolerance`. Where
    they first part, the choice must be a tie at that tolerance in the reference."""
    matched = 0
    for f, r in zip(fast, ref, strict=True):
        for step, (a, b) in enumerate(zip(f.token_ids, r.token_ids, strict=True)):
            if a != b:
                top = r.logprobs[step].top
                assert a in top, f"step {step}: token {a} not in the reference's top-5"
                assert abs(top[a] - top[b]) <= tolerance, f"step {step}: not a tie"
                break
            assert abs(f.logprobs[step].logprob - r.logprobs[step].logprob) <= tolerance
            matched += 1
    return matched


def test_float32_fast_path_gives_the_reference_tokens(model_dir):
    """In float32 (tf32 dots in the Triton attention) the paths differ by rounding only."""
    prompts = _prompts()
    fast = _run(model_dir, prompts, torch_kernels=False, enforce_eager=False, dtype="float32")
    ref = _run(model_dir, prompts, torch_kernels=True, enforce_eager=True, dtype="float32")
    assert _matched_steps(fast, ref, tolerance=1e-2) >= 0.9 * len(prompts) * STEPS


def test_bf16_fast_path_matches_reference_up_to_ties(model_dir):
    prompts = _prompts()
    fast = _run(model_dir, prompts, torch_kernels=False, enforce_eager=False, dtype="bfloat16")
    ref = _run(model_dir, prompts, torch_kernels=True, enforce_eager=True, dtype="bfloat16")
    assert _matched_steps(fast, ref, BF16_LOGPROB_TOL) >= len(prompts) * 4


def test_piecewise_graphs_give_the_reference_tokens(model_dir):
    """Steps with prefills (chunked at 128 tokens beside running decodes) replay graphs
    split at attention; float32, as the first test of this file."""
    prompts = _prompts()
    chunked = dict(max_num_batched_tokens=128)
    fast = _run(
        model_dir,
        prompts,
        torch_kernels=False,
        enforce_eager=False,
        dtype="float32",
        prefill_cuda_graph_tokens=128,
        **chunked,
    )
    ref = _run(
        model_dir, prompts, torch_kernels=True, enforce_eager=True, dtype="float32", **chunked
    )
    assert _matched_steps(fast, ref, tolerance=1e-2) >= 0.9 * len(prompts) * STEPS


def test_prompt_logprobs_of_the_fast_path_match_the_reference(model_dir):
    """Prompt rows' logits come from the piecewise graphs' hidden states, over chunks."""
    prompts = _prompts()
    args = dict(dtype="float32", prompt_logprobs=2, max_num_batched_tokens=128)
    fast = _run(
        model_dir, prompts, torch_kernels=False, enforce_eager=False,
        prefill_cuda_graph_tokens=128, **args,
    )  # fmt: skip
    ref = _run(model_dir, prompts, torch_kernels=True, enforce_eager=True, **args)
    for f, r, prompt in zip(fast, ref, prompts, strict=True):
        assert len(f.prompt_logprobs) == len(prompt) and f.prompt_logprobs[0] is None
        for a, b in zip(f.prompt_logprobs[1:], r.prompt_logprobs[1:], strict=True):
            assert a.token_id == b.token_id
            assert abs(a.logprob - b.logprob) <= 1e-2


def test_piecewise_graphs_bf16_match_eager_steps(model_dir):
    prompts = _prompts()
    args = dict(dtype="bfloat16", torch_kernels=False, max_num_batched_tokens=256)
    fast = _run(model_dir, prompts, enforce_eager=False, prefill_cuda_graph_tokens=256, **args)
    eager = _run(model_dir, prompts, enforce_eager=True, **args)
    assert _matched_steps(fast, eager, BF16_LOGPROB_TOL) >= len(prompts) * 4


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_serving_after_the_start_compiles_no_kernel(model_dir, enforce_eager, caplog):
    """The engine's start (profile run, graph capture, warm-up) compiles every Triton kernel
    variant that serving needs: one compiled on first use stalls the whole step, for
    hundreds of milliseconds on a machine whose Triton cache is cold. Serving here: prompts
    of 1 to 400 tokens arriving beside running decodes, one or two at a time, chunked at a
    512-token budget, greedy and sampled (seeded or not), steps over the graphs' token cap
    run eagerly."""
    from kernels.variants import new_kernel_variants

    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        prefill_cuda_graph_tokens=256,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=0.3,
    )
    engine = llm.engine
    gen = torch.Generator().manual_seed(3)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    with new_kernel_variants() as compiled:
        for i in range(48):
            params = SamplingParams(
                temperature=0.0 if i % 3 else 1.0,
                seed=i if i % 2 else None,  # seeded rows sample apart from the others
                max_tokens=draw(1, 64),
                ignore_eos=True,
            )
            prompt = torch.randint(0, 2048, (draw(1, 400),), generator=gen).tolist()
            engine.add_request(f"r{i}", prompt, params)
            for _ in range(i % 4):  # 0: the next one arrives in the same step
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    assert compiled == [], "compiled while serving:\n" + "\n".join(compiled)
    # Outside the probe the engine's own watch is back: a kernel built now is logged.
    import triton
    import triton.language as tl

    @triton.jit
    def _fill_one(out_ptr):  # a new kernel on each run of this test: never built before
        tl.store(out_ptr, 1.0)

    out = torch.zeros(1, device="cuda")
    with caplog.at_level("WARNING", logger="kernels.variants"):
        _fill_one[(1,)](out)
    assert "_fill_one" in caplog.text and out.item() == 1.0
    engine.shutdown()
