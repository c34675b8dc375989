"""kvray's inference engine: paged KV cache, continuous batching, Llama-family models.

The public names load on first use (PEP 562), so that importing a submodule such as
`engine.api.protocol` (the HTTP ingress does) does not import torch.
"""

from importlib import import_module
from typing import TYPE_CHECKING

_PUBLIC = {
    "AsyncLLMEngine": "engine.async_llm_engine",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "CompletionOutput": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "RequestOutputKind": "engine.sampling_params",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutput": "engine.sampling_params",
    "TenantConfig": "engine.tenants",
    "TenantLimitError": "engine.tenant_requests",
}

__all__ = [
    "AsyncLLMEngine",
    "LLM",
    "LLMEngine",
    "CompletionOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutput",
    "TenantConfig",
    "TenantLimitError",
]

if TYPE_CHECKING:
    from engine.async_llm_engine import AsyncLLMEngine
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutput
    from engine.tenant_requests import TenantLimitError
    from engine.tenants import TenantConfig


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
