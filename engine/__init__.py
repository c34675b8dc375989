"""kvray's inference engine: paged KV cache, continuous batching, Llama-family models."""

from engine.llm_engine import LLM, LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutput

__all__ = [
    "LLM",
    "LLMEngine",
    "CompletionOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutput",
]
