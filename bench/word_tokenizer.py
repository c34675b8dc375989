"""A word-level benchmark tokenizer: ids 0..V-1 are the words "t0".."t{V-1}".

    python -m bench.word_tokenizer DIR [--vocab-size 128256]

Text benchmarks on dummy-weight shapes need a tokenizer whose vocabulary matches the
shape's; this one round-trips exactly (decode then encode gives the same ids), so a
random-token prompt sent as text is the prompt the server computes. It is the same as
the one the vLLM yardstick was measured with (bos t128000, eos t128001 for Llama 3).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers


def write_word_tokenizer(folder: str | Path, vocab_size: int = 128256) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "t0",
        "model_max_length": 8192,
    }
    if vocab_size > 128001:
        config.update(bos_token="t128000", eos_token="t128001")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder")
    parser.add_argument("--vocab-size", type=int, default=128256)
    args = parser.parse_args(argv)
    print(write_word_tokenizer(args.folder, args.vocab_size))


if __name__ == "__main__":
    main()
