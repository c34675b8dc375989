"""kv_cache_dtype="fp8" on the GPU: the Triton kernels under CUDA graphs (whole-forward and
piecewise) against the torch reference path, the fp8 cache against the bf16 one, and a start
that compiles every kernel variant serving needs."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import kernels
from engine import LLM, SamplingParams
from engine.layers.attention import attention_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 32
# Tolerances of this model's logprobs, from its CPU runs (torch references): the fp8 cache
# against the float one moves prompt logprobs by 0.08 on average (0.37 at most), and fp8
# caches of a float32 and a bf16 model part by 0.05 (0.23 at most), their greedy tokens
# agreeing up to ties of 0.3 for 8 steps a prompt on average.
SCALES = {
    "model.layers.0.self_attn.k_scale": torch.tensor(0.3),
    "model.layers.0.self_attn.v_scale": torch.tensor(0.02),
    "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.05]),
    "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([0.5]),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random bf16 Llama with KV scales for its first two layers."""
    from safetensors.torch import load_file, save_file
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
    path = tmp_path_factory.mktemp("tiny-llama-kv-fp8")
    model.to(torch.bfloat16).save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    save_file(weights | SCALES, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


@contextlib.contextmanager
def _kernel_switch(torch_kernels: bool):
    old = os.environ.get("KVRAY_TORCH_KERNELS")
    os.environ["KVRAY_TORCH_KERNELS"] = "1" if torch_kernels else "0"
    kernels.read_kernel_switch()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVRAY_TORCH_KERNELS", None)
        else:
            os.environ["KVRAY_TORCH_KERNELS"] = old
        kernels.read_kernel_switch()


def _engine_args(**args) -> dict:
    return (
        dict(
            dtype="bfloat16",
            max_model_len=512,
            max_num_seqs=32,
            max_num_batched_tokens=128,
            prefill_cuda_graph_tokens=128,
            gpu_memory_utilization=0.3,
        )
        | args
    )


def _generate(model_dir: str, torch_kernels: bool, enforce_eager: bool, **args):
    """(greedy completions with their prompts' logprobs, the engine's KV blocks)."""
    with _kernel_switch(torch_kernels):
        llm = LLM(model=model_dir, **_engine_args(enforce_eager=enforce_eager, **args))
        runner = llm.engine.executor.worker.runner
        if args.get("kv_cache_dtype") == "fp8":
            assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
            layers = attention_layers(runner.model)
            scales = [s.item() for a in layers[:3] for s in (a.k_scale, a.v_scale)]
            assert scales == pytest.approx([0.3, 0.02, 0.05, 0.5, 1.0, 1.0])
        assert (runner.cuda_graphs is None) == enforce_eager
        params = SamplingParams(
            temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=5, prompt_logprobs=0
        )
        outputs = llm.generate(_prompts(), params)
        blocks = llm.engine.num_gpu_blocks
        llm.engine.shutdown()
    return outputs, blocks


def _prompts():
    gen = torch.Generator().manual_seed(1)
    # Lengths off the block size; prompts over 128 tokens are chunked beside decodes.
    return [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in range(5, 305, 15)]


def _prompt_gaps(outputs, reference) -> torch.Tensor:
    """How far each prompt token's logprob moved (every step reads the prompt's keys and
    values back from the cache; no greedy choice in between)."""
    return torch.tensor(
        [
            abs(x.logprob - y.logprob)
            for a, b in zip(outputs, reference, strict=True)
            for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)
        ]
    )


def _matched_steps(outputs, reference, tolerance: float) -> int:
    """Steps where both chose the same token with logprobs within `tolerance`. Where they
    first part, the choice must be a tie at that tolerance in the reference."""
    matched = 0
    for f, r in zip(outputs, reference, strict=True):
        f, r = f.outputs[0], r.outputs[0]
        for step, (a, b) in enumerate(zip(f.token_ids, r.token_ids, strict=True)):
            if a != b:
                top = r.logprobs[step].top
                assert a in top, f"step {step}: token {a} not in the reference's top-5"
                assert abs(top[a] - top[b]) <= tolerance, f"step {step}: not a tie"
                break
            assert abs(f.logprobs[step].logprob - r.logprobs[step].logprob) <= tolerance
            matched += 1
    return matched


def test_fp8_cache_triton_path_in_cuda_graphs_matches_the_reference_path(model_dir):
    fast, _ = _generate(model_dir, torch_kernels=False, enforce_eager=False, kv_cache_dtype="fp8")
    ref, _ = _generate(model_dir, torch_kernels=True, enforce_eager=True, kv_cache_dtype="fp8")
    # The two paths' bf16 roundings apart, as between float32 and bf16 models, at most.
    gaps = _prompt_gaps(fast, ref)
    assert gaps.mean() <= 0.08 and gaps.max() <= 0.6
    assert _matched_steps(fast, ref, tolerance=0.5) >= len(ref) * 4


def test_fp8_cache_holds_twice_the_blocks_and_follows_the_bf16_cache(model_dir):
    fp8, fp8_blocks = _generate(model_dir, False, enforce_eager=False, kv_cache_dtype="fp8")
    bf16, bf16_blocks = _generate(model_dir, False, enforce_eager=False)
    # The same memory budget (the profile run is the same): about twice the blocks.
    assert 1.9 * bf16_blocks <= fp8_blocks <= 2.1 * bf16_blocks
    gaps = _prompt_gaps(fp8, bf16)
    assert gaps.mean() <= 0.15 and gaps.max() <= 1.0
    assert _matched_steps(fp8, bf16, tolerance=1.0) >= len(bf16) * 2


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_fp8_serving_after_the_start_compiles_no_kernel(model_dir, enforce_eager):
    """As tests/gpu/test_gpu_model.py's test of the 16-bit cache: the start compiles the
    fp8 variants of the store and attention kernels too."""
    from kernels.variants import new_kernel_variants

    llm = LLM(
        model=model_dir,
        **_engine_args(
            max_num_batched_tokens=512,
            prefill_cuda_graph_tokens=256,
            enforce_eager=enforce_eager,
            kv_cache_dtype="fp8",
        ),
    )
    engine = llm.engine
    gen = torch.Generator().manual_seed(3)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    with new_kernel_variants() as compiled:
        for i in range(32):
            params = SamplingParams(
                temperature=0.0 if i % 3 else 1.0,
                seed=i if i % 2 else None,
                max_tokens=draw(1, 48),
                ignore_eos=True,
            )
            prompt = torch.randint(0, 2048, (draw(1, 400),), generator=gen).tolist()
            engine.add_request(f"r{i}", prompt, params)
            for _ in range(i % 4):
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    engine.shutdown()
    assert compiled == [], "compiled while serving:\n" + "\n".join(compiled)
