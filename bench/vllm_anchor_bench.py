"""vLLM 0.25.1 offline anchor on the device: dummy bf16 weights of a public model's shape, random
token prompts, EOS ignored, vLLM defaults (torch.compile, CUDA graphs, prefix caching). One JSON
line per workload. The same workloads as bench.suite, drawn the same way.

Usage on the device, from the project root with vLLM unpacked (docs/benchmarks.md):
    PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 SHAPE=llama3-8b TP=1 \\
        python3 bench/vllm_anchor_bench.py
SHAPE: a config in bench/data/vllm_shapes (llama3-8b, qwen3-0.6b, llama3-70b, qwen2.5-7b);
PP=2 sets pipeline_parallel_size; QUANT=fp8: vLLM's online FP8 (per-tensor W8A8); QUANT=awq: an
AWQ int4 g128 checkpoint config (dummy int4 weights, float16); KV=fp8: kv_cache_dtype fp8;
ONLY=latency,sampled runs those workloads alone; SEED: the workload seed (default 0, as
bench.suite's --seed).
"""

import json
import os
import random
import time

SHAPE = os.environ.get("SHAPE", "llama3-8b")
TP = int(os.environ.get("TP", "1"))
SHAPES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "vllm_shapes")
# (name, num_prompts, input_len, output_len); "mixed" and "sampled": lengths uniform in
# [100, 1024].
WORKLOADS = {
    "llama3-8b": [
        ("latency", 1, 256, 128),
        ("batch64", 64, 512, 256),
        ("throughput", 1000, 1024, 128),
        ("decode_heavy", 1000, 128, 1024),
        ("sampled", 512, None, None),
    ],
    "qwen3-0.6b": [("latency", 1, 256, 128), ("mixed", 256, None, None)],
    "llama3-70b": [("latency", 1, 256, 128), ("throughput", 1000, 1024, 128)],
    "qwen2.5-7b": [("latency", 1, 256, 128), ("sampled", 512, None, None)],
}


def sampled_requests(n, seed):
    """The "sampled" workload, drawn exactly as bench.suite.sampled_requests draws it."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    params = [
        dict(
            temperature=0.8,
            top_p=0.95,
            top_k=50,
            max_tokens=rng.randint(100, 1024),
        )
        for _ in range(n)
    ]
    return prompts, params


def shape_config(shape, quant):
    with open(os.path.join(SHAPES_DIR, f"{shape}.json")) as f:
        cfg = json.load(f)
    if quant == "awq":
        cfg["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 128,
            "zero_point": True,
            "version": "gemm",
        }
    return cfg


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    quant, kv = os.environ.get("QUANT", ""), os.environ.get("KV", "auto")
    workload_seed = int(os.environ.get("SEED", "0"))
    d = f"/tmp/model-{SHAPE}" + ("-awq" if quant == "awq" else "")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(shape_config(SHAPE, quant), f)
    t = time.time()
    extra = {"quantization": "fp8"} if quant == "fp8" else {}
    llm = LLM(
        model=d,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float16" if quant == "awq" else "bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.9,
        seed=0,
        tensor_parallel_size=TP,
        pipeline_parallel_size=int(os.environ.get("PP", "1")),
        kv_cache_dtype=kv,
        **extra,
    )
    base = {
        "engine": "vllm-0.25.1",
        "model_shape": SHAPE,
        "tp": TP,
        "quant": quant or "none",
        "kv_cache_dtype": kv,
    }
    only = set(filter(None, os.environ.get("ONLY", "").split(",")))
    startup = {**base, "bench": "startup", "startup_s": round(time.time() - t, 1)}
    print(json.dumps(startup), flush=True)
    rng = random.Random(0)

    def ids(n):
        return [rng.randint(100, 100000) for _ in range(n)]

    def timed(ps, sps):
        t = time.perf_counter()
        res = llm.generate(ps, sps, use_tqdm=False)
        return time.perf_counter() - t, res

    for name, n, inp, out in WORKLOADS[SHAPE]:
        if only and name not in only:
            continue
        if name == "latency":
            p = [TokensPrompt(prompt_token_ids=ids(inp))]
            greedy_one = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
            greedy_all = SamplingParams(
                temperature=0, max_tokens=out, min_tokens=out, ignore_eos=True, detokenize=False
            )
            one = min(timed(p, greedy_one)[0] for _ in range(3))
            full = min(timed(p, greedy_all)[0] for _ in range(3))
            result = {
                **base,
                "bench": "latency",
                "batch_size": 1,
                "input_len": inp,
                "output_len": out,
                "ms_per_token": round((full - one) / (out - 1) * 1000, 3),
                "ttft_s": round(one, 4),
            }
            print(json.dumps(result), flush=True)
            continue
        if name == "mixed":
            r = random.Random(0)
            ps = [
                TokensPrompt(
                    prompt_token_ids=[r.randint(0, 10000) for _ in range(r.randint(100, 1024))]
                )
                for _ in range(n)
            ]
            sps = [
                SamplingParams(
                    temperature=0.6,
                    ignore_eos=True,
                    max_tokens=r.randint(100, 1024),
                    detokenize=False,
                )
                for _ in range(n)
            ]
        elif name == "sampled":
            prompts, params = sampled_requests(n, workload_seed)
            ps = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            sps = [SamplingParams(ignore_eos=True, detokenize=False, **p) for p in params]
        else:
            ps = [TokensPrompt(prompt_token_ids=ids(inp)) for _ in range(n)]
            sps = SamplingParams(
                temperature=0, max_tokens=out, min_tokens=out, ignore_eos=True, detokenize=False
            )
        dt, res = timed(ps, sps)
        n_in = sum(len(p["prompt_token_ids"]) for p in ps)
        n_out = sum(len(x.outputs[0].token_ids) for x in res)
        result = {
            **base,
            "bench": name,
            "num_prompts": n,
            "input_len": inp,
            "output_len": out,
            "wall_s": round(dt, 3),
            "output_tok_s": round(n_out / dt, 1),
            "total_tok_s": round((n_in + n_out) / dt, 1),
        }
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
