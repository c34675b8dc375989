"""Quick look: `python -m engine.generate --prompt "Hello" [--model PATH] [--max-tokens 64]`."""

from __future__ import annotations

import argparse

from engine.llm import LLM
from engine.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default: bundled")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args(argv)

    engine_args = {}
    if args.max_model_len:
        engine_args["max_model_len"] = args.max_model_len
    llm = LLM(model=args.model, **engine_args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    if args.chat:
        outputs = [llm.chat([{"role": "user", "content": p}], params)[0] for p in args.prompt]
    else:
        outputs = llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outputs):
        print(f"### {prompt}\n{out.outputs[0].text}\n[{out.outputs[0].finish_reason}]")


if __name__ == "__main__":
    main()
