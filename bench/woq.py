"""Weight-only quantized (WOQ) linear layers on one CUDA GPU, timed as the model runs them.

    python -m bench.woq [--bits 4] [--group 128] [--rows 1 16 ...] [--sweep] [--out f.json]

llama3-8b's four linear layers (whole, and halved for TP=2), each timed as CUDA-graph
replays over 32 distinct weights (no layer finds its weight in L2), for several row counts
M: kernels.triton_woq.woq_linear against the 16-bit layer (kernels.linear: the Triton GEMV
at M = 1, cuBLAS above). At M = 1 the quantized bytes read (codes, scales, mins) per
second are reported against the copy bandwidth, and the four layers' sum over 32 layers is
the linear layers' share of a batch-1 decode step. --sweep also times the GEMV and GEMM
configurations around the defaults (what the defaults should be chosen from).
"""

from __future__ import annotations

import argparse
import json

import torch

import kernels
from bench.kernels import RESULTS, copy_bandwidth, graph_ms, record, rel_err
from kernels import triton_woq
from kernels.triton_woq import GemmConfig, GemvConfig, gemm_config, gemv_config
from kernels.woq_ref import woq_dequantize, woq_quantize_rtn

DEVICE = "cuda"
LAYERS = 32
SHAPES = [  # (name, N, K)
    ("qkv_proj", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("gate_up_proj", 28672, 4096),
    ("down_proj", 4096, 14336),
    ("TP=2 qkv_proj", 3072, 4096),
    ("TP=2 o_proj", 4096, 2048),
    ("TP=2 gate_up_proj", 14336, 4096),
    ("TP=2 down_proj", 4096, 7168),
]
ROWS = [1, 4, 16, 64, 256, 1024, 2048]


def quantized_layers(n: int, k: int, bits: int, group: int) -> list[tuple]:
    """LAYERS distinct quantized weights of one shape (one quantized on the CPU, the rest
    its codes shifted, so the copies are as many bytes but not the same)."""
    qweight, scales, mins = woq_quantize_rtn(torch.randn(n, k) / k**0.5, bits, group)
    qweight, scales, mins = qweight.to(DEVICE), scales.to(DEVICE), mins.to(DEVICE)
    return [((qweight + i).contiguous(), scales, mins.clone(), bits, group) for i in range(LAYERS)]


def woq_bytes(n: int, k: int, bits: int, group: int) -> int:
    return n * k * bits // 8 + 2 * 2 * n * k // group


def time_layers(fn, x, layers) -> float:
    return graph_ms(lambda: [fn(x, *layer) for layer in layers]) / len(layers)


def bench_shapes(copy_gbps: float, bits: int, group: int, rows: list[int]) -> None:
    decode_ms = {"woq": 0.0, "bf16": 0.0}
    for name, n, k in SHAPES:
        layers = quantized_layers(n, k, bits, group)
        dense = [woq_dequantize(*[t.cpu() for t in layers[0][:3]], bits, group)]
        dense = [dense[0].to(DEVICE, torch.bfloat16) for _ in range(LAYERS)]
        for m in rows:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            err = rel_err(triton_woq.woq_linear(x, *layers[0]), x.float() @ dense[0].float().t())
            ms = time_layers(triton_woq.woq_linear, x, layers)
            ms16 = graph_ms(lambda x=x, ws=dense: [kernels.linear(x, w) for w in ws]) / LAYERS
            extra = {"bf16_us": ms16 * 1e3, "speedup": ms16 / ms, "rel_err": err}
            if m == 1:
                gbps = woq_bytes(n, k, bits, group) / ms / 1e6
                extra["pct_copy"] = 100 * gbps / copy_gbps
                if not name.startswith("TP"):
                    decode_ms["woq"] += LAYERS * ms
                    decode_ms["bf16"] += LAYERS * ms16
            record(f"woq int{bits} g{group} {name} {n}x{k} M={m}", ms, **extra)
        del layers, dense
    if 1 in rows:
        record(
            f"woq int{bits} g{group} llama3-8b linear layers, one decode step",
            decode_ms["woq"],
            bf16_ms=decode_ms["bf16"],
        )


def sweep(bits: int, group: int) -> None:
    """GEMV tiles at M = 1 and GEMM tiles at M = 16 around the defaults, whole layers."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, n, k in SHAPES[:4]:
        layers = quantized_layers(n, k, bits, group)
        x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        default = gemv_config(n, k, bits, sms)
        for block_n in (2, 4, 8):
            for block_c in (32, 64, 128):
                for split in (1, 2, 4):
                    cfg = GemvConfig(block_n, block_c, max(1, min(4, block_c // 32)), split)
                    ms = time_layers(lambda *a, c=cfg: triton_woq.woq_gemv(*a, config=c), x, layers)
                    mark = " (default)" if cfg == default else ""
                    record(f"sweep gemv {name} {cfg}{mark}", ms)
        x = torch.randn(16, k, device=DEVICE, dtype=torch.bfloat16)
        default = gemm_config(16, n, k, sms)
        for block_n, warps in ((64, 4), (128, 8)):
            for split in (1, 2, 4, 8):
                for stages in (2, 3, 4):
                    cfg = GemmConfig(64, block_n, 128, warps, stages, split)
                    ms = time_layers(lambda *a, c=cfg: triton_woq.woq_gemm(*a, config=c), x, layers)
                    mark = " (default)" if cfg == default else ""
                    record(f"sweep gemm M=16 {name} {cfg}{mark}", ms)
        del layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--rows", type=int, nargs="*", default=ROWS)
    parser.add_argument("--sweep", action="store_true", help="also time tile configurations")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    copy_gbps = copy_bandwidth()
    bench_shapes(copy_gbps, args.bits, args.group, args.rows)
    if args.sweep:
        sweep(args.bits, args.group)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": props.name, "results": RESULTS}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
