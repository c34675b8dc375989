"""Micro-benchmark of the Triton kernels on one CUDA GPU.

    python -m bench.kernels [--out results.json] [--sweep] [--only decode ...]

Measures the device-to-device copy bandwidth (bytes read + written) as the ceiling,
then paged decode attention at batch 64 / context 4096 / 32 q heads / 8 kv heads /
head dim 128 / bf16, reported as KV bytes read per second against that ceiling, and
every kernel against its torch reference or the closest torch equivalent. `--sweep`
also times decode and prefill tile configurations (what the defaults were chosen from).
Times are medians of triton.testing.do_bench; decode (and its torch SDPA equivalent) is
timed as CUDA graph replays, the way the model runner runs it.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kernels import triton_attention as ta
from kernels.activation_ref import silu_and_mul_ref
from kernels.attention_ref import paged_attention_ref, store_kv_ref
from kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary_ref import apply_rotary_ref
from kernels.triton_activation import silu_and_mul_triton
from kernels.triton_attention import tuning
from kernels.triton_norm import fused_add_rms_norm_triton, rms_norm_triton
from kernels.triton_rotary import apply_rotary_triton

DEVICE = "cuda"
RESULTS: dict[str, dict] = {}
COPY_NUMEL = 1 << 29  # 2 GiB of float32
# (name, (num_seqs, seq_len, num_heads, num_kv_heads, head_dim, dtype)); the first is the
# acceptance case and gets the torch comparisons and the sweep.
DECODE_CASES = [
    ("decode B64 ctx4096 32q/8kv D128 bf16", (64, 4096, 32, 8, 128, torch.bfloat16)),
    ("decode B64 ctx4096 9q/3kv D64 bf16 (SmolLM2)", (64, 4096, 9, 3, 64, torch.bfloat16)),
    ("decode B1 ctx32768 32q/8kv D128 bf16", (1, 32768, 32, 8, 128, torch.bfloat16)),
    ("decode B256 ctx1024 32q/8kv D128 bf16", (256, 1024, 32, 8, 128, torch.bfloat16)),
    # qwen3-0.6b's mixed workload in its middle: batch ~165, context ~900.
    ("decode B165 ctx900 16q/8kv D128 bf16 (qwen3)", (165, 900, 16, 8, 128, torch.bfloat16)),
    ("decode B96 ctx1200 16q/8kv D128 bf16 (qwen3)", (96, 1200, 16, 8, 128, torch.bfloat16)),
]
# (name, (num_seqs, q_len, cached prefix len, num_heads, num_kv_heads, head_dim, dtype))
PREFILL_CASES = [
    ("prefill 4x2048 new tokens 32q/8kv D128 bf16", (4, 2048, 0, 32, 8, 128, torch.bfloat16)),
    (
        "prefill chunk 4x512 over 3584 cached, 32q/8kv D128",
        (4, 512, 3584, 32, 8, 128, torch.bfloat16),
    ),
]
# (tokens, hidden, intermediate) of the elementwise kernels.
ELEMENTWISE_SHAPE = (8192, 4096, 14336)


def bench_ms(fn, rep: int = 100) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def record(name: str, ms: float, **fields) -> None:
    RESULTS[name] = {"ms": ms, **fields}
    extra = "  ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
    )
    print(f"{name:<52} {ms * 1e3:>10.1f} us  {extra}", flush=True)


def graph_ms(fn, rep: int = 100) -> float:
    """Time fn replayed from a CUDA graph, as the model runner runs decode.

    Short kernels timed by direct calls also count the host's launch work (wrapper,
    allocations, two launches) whenever it outlasts the queued work before them.
    """
    fn()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:
        print(f"  (not capturable, timed by direct calls: {e})")
        return bench_ms(fn, rep)
    return bench_ms(graph.replay, rep)


def copy_bandwidth() -> float:
    src = torch.randn(COPY_NUMEL, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    gbps = 2 * src.numel() * src.element_size() / ms / 1e6
    record(f"copy {src.numel() * 4 >> 20} MiB d2d (read + write)", ms, GBps=gbps)
    return gbps


def decode_batch(num_seqs, seq_len, num_heads, num_kv_heads, head_dim, dtype, block_size=16):
    blocks_per_seq = math.ceil(seq_len / block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    kv_cache = torch.randn(
        2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE, dtype=dtype
    )
    # Scattered blocks, as a long-running server's pool would hand them out.
    tables = (torch.randperm(num_blocks - 1, device=DEVICE) + 1).to(torch.int32)
    return dict(
        query=torch.randn(num_seqs, num_heads, head_dim, device=DEVICE, dtype=dtype),
        kv_cache=kv_cache,
        query_start_loc=torch.arange(num_seqs + 1, device=DEVICE, dtype=torch.int32),
        seq_lens=torch.full((num_seqs,), seq_len, device=DEVICE, dtype=torch.int32),
        block_tables=tables.view(num_seqs, blocks_per_seq),
        scale=head_dim**-0.5,
        max_query_len=1,
        max_seq_len=seq_len,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def set_decode_config(block_n: int, warps: int, stages: int) -> None:
    tuning.DECODE_BLOCK_N = block_n
    tuning.DECODE_NUM_WARPS = warps
    tuning.DECODE_NUM_STAGES = stages


def bench_decode(copy_gbps: float, sweep: bool) -> None:
    cases = DECODE_CASES
    for i, (name, shape) in enumerate(cases):
        batch = decode_batch(*shape)
        num_seqs, seq_len, _, num_kv_heads, head_dim, dtype = shape
        kv_bytes = 2 * num_seqs * seq_len * num_kv_heads * head_dim * dtype.itemsize
        err = rel_err(ta.paged_attention_triton(**batch), paged_attention_ref(**batch))
        ms = graph_ms(lambda batch=batch: ta.paged_attention_triton(**batch))
        gbps = kv_bytes / ms / 1e6
        splits = ta.decode_num_splits(num_seqs, num_kv_heads, seq_len, tuning.num_sms(0))
        record(name, ms, KV_GBps=gbps, pct_copy=100 * gbps / copy_gbps, splits=splits, rel_err=err)
        ms = bench_ms(lambda batch=batch: ta.paged_attention_triton(**batch))
        gbps = kv_bytes / ms / 1e6
        record("  same, direct calls (host launch included)", ms, pct_copy=100 * gbps / copy_gbps)
        if i == 0:
            bench_decode_equivalents(batch, shape, copy_gbps, kv_bytes)
        if sweep:
            sweep_decode(name, batch, kv_bytes, copy_gbps, paged_attention_ref(**batch))
        del batch
        torch.cuda.empty_cache()


def bench_decode_equivalents(batch, shape, copy_gbps, kv_bytes) -> None:
    num_seqs, seq_len, num_heads, num_kv_heads, head_dim, dtype = shape
    # The torch equivalent on contiguous (unpaged) K/V: SDPA with GQA.
    k = torch.randn(num_seqs, num_kv_heads, seq_len, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    q = batch["query"].view(num_seqs, num_heads, 1, head_dim)
    ms = graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    gbps = kv_bytes / ms / 1e6
    record(
        "  torch SDPA contiguous K/V (enable_gqa)",
        ms,
        KV_GBps=gbps,
        pct_copy=100 * gbps / copy_gbps,
    )
    ms = bench_ms(lambda: paged_attention_ref(**batch), rep=200)
    record("  torch reference paged_attention_ref", ms, KV_GBps=kv_bytes / ms / 1e6)


def sweep_decode(case, batch, kv_bytes, copy_gbps, ref) -> None:
    default = (tuning.DECODE_BLOCK_N, tuning.DECODE_NUM_WARPS, tuning.DECODE_NUM_STAGES)
    best = None
    max_splits = min(64, math.ceil(batch["max_seq_len"] / 64))
    for block_n, warps, stages in ((64, 4, 3), (128, 4, 3)):
        set_decode_config(block_n, warps, stages)
        for splits in (s for s in (1, 2, 3, 4, 6, 8, 16, 32, 64) if s <= max_splits):
            try:
                err = rel_err(ta.paged_attention_triton(**batch, num_splits=splits), ref)
                ms = graph_ms(
                    lambda s=splits: ta.paged_attention_triton(**batch, num_splits=s), rep=40
                )
            except Exception as e:  # out of shared memory for a large tile, say
                print(
                    f"  sweep BLOCK_N={block_n} warps={warps} stages={stages}: {type(e).__name__}"
                )
                break
            gbps = kv_bytes / ms / 1e6
            name = f"  sweep decode BLOCK_N={block_n} w={warps} st={stages} splits={splits}"
            record(name, ms, KV_GBps=gbps, pct_copy=100 * gbps / copy_gbps, rel_err=err)
            if best is None or ms < best[0]:
                best = (ms, block_n, warps, stages, splits)
    set_decode_config(*default)
    print(f"  best decode config (ms, BLOCK_N, warps, stages, splits): {best}")
    RESULTS[f"{case}: sweep best"] = {"ms": best[0], "config": best[1:]}


def prefill_batch(num_seqs, q_len, ctx_len, num_heads, num_kv_heads, head_dim, dtype):
    batch = decode_batch(num_seqs, q_len + ctx_len, num_heads, num_kv_heads, head_dim, dtype)
    batch["query"] = torch.randn(num_seqs * q_len, num_heads, head_dim, device=DEVICE, dtype=dtype)
    batch["query_start_loc"] = torch.arange(
        0, num_seqs * q_len + 1, q_len, device=DEVICE, dtype=torch.int32
    )
    batch["max_query_len"] = q_len
    return batch


def bench_prefill(sweep: bool) -> None:
    cases = PREFILL_CASES
    for i, (name, shape) in enumerate(cases):
        num_seqs, q_len, ctx_len, num_heads, num_kv_heads, head_dim, dtype = shape
        batch = prefill_batch(*shape)
        # Causal: query j sees ctx_len + j + 1 keys; two matmuls of 2 flops per MAC.
        pairs = num_seqs * (q_len * ctx_len + q_len * (q_len + 1) / 2)
        flops = 4 * pairs * num_heads * head_dim
        err = rel_err(ta.paged_attention_triton(**batch), paged_attention_ref(**batch))
        ms = bench_ms(lambda batch=batch: ta.paged_attention_triton(**batch))
        record(name, ms, TFLOPs=flops / ms / 1e9, rel_err=err)
        if ctx_len == 0:
            bench_prefill_sdpa(batch, shape, flops)
        if sweep and i == 0:
            ref = paged_attention_ref(**batch)
            default = tuning.PREFILL_CONFIG
            best = None
            configs = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]
            for cfg in configs:
                tuning.PREFILL_CONFIG = cfg
                try:
                    err = rel_err(ta.paged_attention_triton(**batch), ref)
                    ms = bench_ms(lambda batch=batch: ta.paged_attention_triton(**batch), rep=40)
                except Exception as e:
                    print(f"  sweep prefill {cfg}: {type(e).__name__}")
                    continue
                record(
                    f"  sweep prefill BLOCK_M,N,warps,stages={cfg}",
                    ms,
                    TFLOPs=flops / ms / 1e9,
                    rel_err=err,
                )
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            tuning.PREFILL_CONFIG = default
            print(f"  best prefill config: {best}")
            RESULTS["prefill sweep best"] = {"ms": best[0], "config": best[1]}
        del batch
        torch.cuda.empty_cache()


def bench_prefill_sdpa(batch, shape, flops) -> None:
    num_seqs, q_len, _, num_heads, num_kv_heads, head_dim, dtype = shape
    q = batch["query"].view(num_seqs, q_len, num_heads, head_dim).transpose(1, 2)
    k = torch.randn(num_seqs, num_kv_heads, q_len, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    ms = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    record("  torch SDPA causal contiguous (enable_gqa)", ms, TFLOPs=flops / ms / 1e9)


def bench_elementwise(copy_gbps: float) -> None:
    dtype = torch.bfloat16
    tokens, hidden, inter = ELEMENTWISE_SHAPE

    def pair(name, triton_fn, torch_fn, nbytes, torch_name="torch reference"):
        ms = bench_ms(triton_fn)
        gbps = nbytes / ms / 1e6
        record(name, ms, GBps=gbps, pct_copy=100 * gbps / copy_gbps)
        ms_t = bench_ms(torch_fn)
        record(f"  {torch_name}", ms_t, GBps=nbytes / ms_t / 1e6, speedup=ms_t / ms)

    x = torch.randn(tokens, hidden, device=DEVICE, dtype=dtype)
    r = torch.randn_like(x)
    w = torch.randn(hidden, device=DEVICE, dtype=dtype)
    nbytes = 2 * x.numel() * 2
    pair(
        f"rms_norm {tokens}x{hidden} bf16",
        lambda: rms_norm_triton(x, w, 1e-5),
        lambda: rms_norm_ref(x, w, 1e-5),
        nbytes,
    )
    ms_t = bench_ms(lambda: F.rms_norm(x, (hidden,), w, 1e-5))
    record("  torch F.rms_norm", ms_t, GBps=nbytes / ms_t / 1e6)
    pair(
        f"fused_add_rms_norm {tokens}x{hidden} bf16",
        lambda: fused_add_rms_norm_triton(x, r, w, 1e-5),
        lambda: fused_add_rms_norm_ref(x, r, w, 1e-5),
        2 * nbytes,
    )

    xm = torch.randn(tokens, 2 * inter, device=DEVICE, dtype=dtype)
    pair(
        f"silu_and_mul {tokens}x2*{inter} bf16",
        lambda: silu_and_mul_triton(xm),
        lambda: silu_and_mul_ref(xm),
        3 * tokens * inter * 2,
    )

    num_heads, num_kv_heads, head_dim = 32, 8, 128
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE, dtype=dtype)
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    half = head_dim // 2
    inv_freq = 1e4 ** (-torch.arange(0, half, device=DEVICE, dtype=torch.float32) / half)
    angles = torch.arange(8192, device=DEVICE, dtype=torch.float32)[:, None] * inv_freq
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    nbytes = 2 * (num_heads + num_kv_heads) * head_dim * tokens * 2
    pair(
        f"apply_rotary {tokens} tok 32q/8kv D128 bf16 (fused qkv)",
        lambda: apply_rotary_triton(positions, q, k, cos_sin),
        lambda: apply_rotary_ref(positions, q, k, cos_sin),
        nbytes,
    )

    block_size = 16
    kv_cache = torch.empty(
        2,
        math.ceil(tokens / block_size) + 1,
        block_size,
        num_kv_heads,
        head_dim,
        device=DEVICE,
        dtype=dtype,
    )
    slots = torch.randperm(tokens, device=DEVICE) + block_size
    nbytes = 2 * 2 * tokens * num_kv_heads * head_dim * 2
    pair(
        f"store_kv {tokens} tok 8kv D128 bf16",
        lambda: ta.store_kv_triton(k, v, kv_cache, slots),
        lambda: store_kv_ref(k, v, kv_cache, slots),
        nbytes,
    )


# (name, N, K) of llama3-8b's batch-1 linear layers, whole and halved for TP=2.
GEMV_SHAPES = [
    ("qkv_proj", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("gate_up_proj", 28672, 4096),
    ("down_proj", 4096, 14336),
    ("TP=2 qkv_proj", 3072, 4096),
    ("TP=2 o_proj", 4096, 2048),
    ("TP=2 gate_up_proj", 14336, 4096),
    ("TP=2 down_proj", 4096, 7168),
]
GEMV_LAYERS = 32


def bench_gemv(copy_gbps: float) -> None:
    """One-row linear layers as the model runs them: a graph over 32 distinct copies of the
    weight (no layer finds its weight in L2), the Triton GEMV against cuBLAS."""
    from kernels.triton_gemv import gemv_triton

    for name, n, k in GEMV_SHAPES:
        weights = [
            torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5
            for _ in range(GEMV_LAYERS)
        ]
        x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        err = rel_err(gemv_triton(x, weights[0]), F.linear(x.float(), weights[0].float()))
        nbytes = GEMV_LAYERS * n * k * 2
        for label, fn in (("Triton GEMV", gemv_triton), ("cuBLAS (F.linear)", F.linear)):
            ms = graph_ms(lambda fn=fn, x=x, ws=weights: [fn(x, w) for w in ws]) / GEMV_LAYERS
            gbps = nbytes / GEMV_LAYERS / ms / 1e6
            extra = {"rel_err": err} if fn is gemv_triton else {}
            record(f"gemv {name} {n}x{k}: {label}", ms, pct_copy=100 * gbps / copy_gbps, **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--sweep", action="store_true", help="also time tile configurations")
    parser.add_argument(
        "--only", nargs="*", help="sections: decode prefill elementwise gemv (default all)"
    )
    args = parser.parse_args()
    sections = set(args.only or ["decode", "prefill", "elementwise", "gemv"])
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    copy_gbps = copy_bandwidth()
    if "decode" in sections:
        bench_decode(copy_gbps, args.sweep)
    if "prefill" in sections:
        bench_prefill(args.sweep)
    if "elementwise" in sections:
        bench_elementwise(copy_gbps)
    if "gemv" in sections:
        bench_gemv(copy_gbps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": props.name, "results": RESULTS}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
