"""Perplexity of the bundled model, float32 against each quantized format, on CPU.

python -m bench.perplexity [--formats f32 fp8 ...] [--window 1024] [--record]

The text is bench/data/perplexity.txt (4,641 tokens of the bundled tokenizer: the Python 3.11
language reference's statements chapter as `pydoc_data.topics` ships it, PSF license). Each
format's checkpoint is written from the bundled model's float weights by the reference
quantizers of the tests (tests/support), loaded by kvray, and scored over non-overlapping
windows of `--window` tokens: perplexity = exp(mean negative log-likelihood of every token
after a window's first). "f32" is the bundled GGUF's weights dequantized to float32, the
float model every format is compared with. Groups of 64 for AWQ/GPTQ, and no GGUF K-quants:
the bundled model's 576 inputs are no multiple of 128 or 256.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import emit

TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def _hf_folder(root: Path, name: str, tensors, config=None) -> Path:
    from tests.support.bundled_checkpoints import write_checkpoint

    return write_checkpoint(root / name, tensors, config)


def _float(root: Path) -> tuple[Path, str]:
    from tests.support.bundled_checkpoints import bundled_float_weights

    return _hf_folder(root, "f32", bundled_float_weights()[1]), "none"


def _fp8_online(root: Path) -> tuple[Path, str]:
    return _float(root)[0], "fp8"


def _fp8_scheme(scheme: str) -> Callable[[Path], tuple[Path, str]]:
    def build(root: Path) -> tuple[Path, str]:
        from tests.support.bundled_checkpoints import bundled_float_weights
        from tests.support.fp8_quantizers import fp8_checkpoint

        tensors, config, _ = fp8_checkpoint(bundled_float_weights()[1], scheme)
        return _hf_folder(root, scheme, tensors, config), "auto"

    return build


def _int4(config: dict) -> Callable[[Path], tuple[Path, str]]:
    def build(root: Path) -> tuple[Path, str]:
        from tests.support.bundled_checkpoints import bundled_float_weights
        from tests.support.quantizers import int4_checkpoint

        tensors, _ = int4_checkpoint(bundled_float_weights()[1], config)
        name = f"{config['quant_method']}-{config['bits']}-{config['group_size']}"
        return _hf_folder(root, name, tensors, config), "auto"

    return build


def _gguf(type_name: str) -> Callable[[Path], tuple[Path, str]]:
    """The bundled file's linear layers rewritten in one GGUF type (its embeddings and head
    as they are); "Q4_1" is the bundled file itself."""

    def build(root: Path) -> tuple[Path, str]:
        from gguf import GGMLQuantizationType

        from engine.bundled import bundled_model_path
        from tests.support.gguf_checkpoints import read_gguf_floats, write_gguf

        if type_name == "Q4_1":
            return bundled_model_path(), "gguf"
        metadata, tensors = read_gguf_floats(bundled_model_path())
        qtype = GGMLQuantizationType[type_name]
        types = {n: qtype for n in tensors if n.startswith("blk.") and n.endswith(_GGUF_LINEAR)}
        types |= {n: GGMLQuantizationType.F32 for n in tensors if n not in types}
        return write_gguf(root / f"{type_name}.gguf", tensors, types, metadata), "gguf"

    return build


_GGUF_LINEAR = tuple(
    f"{part}.weight"
    for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
)

FORMATS: dict[str, Callable[[Path], tuple[Path, str]]] = {
    "f32": _float,
    "fp8": _fp8_online,
    "fp8-tensor": _fp8_scheme("fp8-tensor"),
    "fp8-block": _fp8_scheme("fp8-block"),
    "ct-channel": _fp8_scheme("ct-channel"),
    "awq-g64": _int4(
        {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    ),
    "gptq-g64": _int4(
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 64,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        }
    ),
    "gguf-q4_1": _gguf("Q4_1"),
    "gguf-q4_0": _gguf("Q4_0"),
    "gguf-q8_0": _gguf("Q8_0"),
}
"""Format -> a function writing its checkpoint under a folder: (model path, quantization)."""


def perplexity(model, ids: list[int], window: int) -> float:
    from tests.support.bundled_checkpoints import logits_of

    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        logprobs = torch.log_softmax(logits_of(model, chunk)[:-1].double(), dim=-1)
        target = torch.tensor(chunk[1:])
        nll -= logprobs.gather(1, target[:, None]).sum().item()
        count += len(chunk) - 1
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--formats", nargs="*", default=list(FORMATS))
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args(argv)
    from engine.input_processor import load_tokenizer_for
    from engine.worker.loader import resolve_model_source
    from tests.support.bundled_checkpoints import load_checkpoint

    tokenizer = load_tokenizer_for(resolve_model_source(None), None)
    ids = tokenizer.encode(TEXT.read_text())
    command = "python -m bench.perplexity " + " ".join(argv or sys.argv[1:])
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.formats:
            start = time.perf_counter()
            path, quantization = FORMATS[name](Path(tmp))
            if str(path).endswith(".gguf"):
                from tests.support.gguf_checkpoints import load_gguf

                model = load_gguf(path, quantization)
            else:
                model = load_checkpoint(path, quantization)
            ppl = perplexity(model, ids, args.window)
            reference = ppl if name == "f32" else reference
            result = {
                "bench": "perplexity",
                "format": name,
                "tokens": len(ids),
                "window": args.window,
                "perplexity": round(ppl, 4),
                "wall_s": round(time.perf_counter() - start, 1),
                "command": command,
            }
            if reference is not None and name != "f32":
                result["vs_f32_pct"] = round((ppl / reference - 1) * 100, 2)
            emit(result, args.record)


if __name__ == "__main__":
    main()
