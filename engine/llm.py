"""LLM: offline batch generation over an LLMEngine (generate, chat)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from engine.beam_search import BeamSearchOutput, BeamSearchParams, to_beam_search_output
from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.observability.gc_pauses import frozen_heap
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.tenant_requests import EngineTenants
from engine.tenants import TenantConfig
from engine.tokenizer import apply_chat_template

PromptType = str | list[int]


class LLM:
    """Offline batch generation.

    `LLM()` serves the bundled SmolLM2; `LLM(model="path/to/folder-or.gguf", **engine_args)`
    takes vLLM-named engine arguments (max_model_len, max_num_seqs, dtype, ...), built into
    one `EngineArgs`. `tenants`: name -> `TenantConfig` (or its keys), for
    `generate(..., tenant_id=...)`; with tenants the policy defaults to "priority".
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tenants: Mapping[str, TenantConfig | Mapping] | None = None,
        **engine_args: Any,
    ):
        self.tenants = EngineTenants(tenants)
        args = EngineArgs(model=model, **self.tenants.engine_keys(engine_args))
        self.engine = LLMEngine.from_engine_args(args)
        self._ids = itertools.count()

    # -- the model lifecycle (engine/lifecycle.py) ---------------------------------------

    def load_model(
        self,
        model: str | None,
        weights_only: bool = False,
        load_format: str = "auto",
        **engine_args: Any,
    ) -> None:
        """Serve another model from now on, without a new LLM. weights_only=True: a
        checkpoint of the same architecture and shapes replaces the weights in place (KV
        cache and CUDA graphs kept); otherwise any model, the engine rebuilt for it with
        this LLM's engine keys (and `engine_args`). A failed load leaves the old model
        serving. Details: `LLMEngine.load_model`."""
        self.engine.load_model(model, weights_only, load_format, **engine_args)

    def sleep(self, level: int = 1) -> None:
        """Free the device's memory until wake_up(): level 1 keeps the weights in host
        memory, level 2 drops them; both free the KV cache. generate() is refused meanwhile."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix; False while a request holds blocks."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling_params: SamplingParams() with
        the model's generation_config.json defaults (unless generation_config="vllm")."""
        return self.engine.get_default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tenant_id: str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`.

        `tenant_id`: the prompts run at that tenant's priority, in its own prefix cache, within
        its limits (engine/tenant_requests.py); with the engine's metrics on
        (`llm.engine.enable_metrics(sink)`) its tokens are recorded with its name."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts"
                )
        # Only finished outputs are returned here: no per-step outputs to build.
        final_only = {}
        for params in params_list:
            if id(params) not in final_only:
                final_only[id(params)] = dataclasses.replace(
                    params, output_kind=RequestOutputKind.FINAL_ONLY
                )
        params_list = [final_only[id(p)] for p in params_list]
        if tenant_id is None:
            return self._run(prompts, params_list, 0, None)
        metrics = self.engine.metrics
        self.tenants.record_into(None if metrics is None else metrics.sink)
        tenant, lease = self.tenants.admit(tenant_id, self.engine.model_name)
        outputs: list[RequestOutput] = []
        try:
            outputs = self._run(prompts, params_list, *tenant.request_keys(0, None))
        finally:
            self.tenants.charge(lease, self.engine.model_name, tenant, outputs)
        return outputs

    def _run(
        self,
        prompts: list[PromptType],
        params_list: list[SamplingParams],
        priority: int,
        cache_salt: str | None,
    ) -> list[RequestOutput]:
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, params, priority, cache_salt)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        with frozen_heap():
            while len(finished) < len(ids):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                failed = self.engine.take_failed()
                if failed:
                    self.engine.abort_request(ids)
                    raise failed[0][1]
        return [finished[rid] for rid in ids]

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType | dict[str, Any]],
        params: BeamSearchParams,
    ) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: per prompt, the `beam_width` best sequences, best
        first (engine/beam_search.py). A prompt is text, token ids, or vLLM's
        {"prompt": text} / {"prompt_token_ids": ids}."""
        if isinstance(prompts, dict):
            prompts = [prompts]
        if isinstance(prompts, list | tuple):
            prompts = [_prompt_of(p) for p in prompts]
        outputs = self.generate(prompts, params.to_sampling_params())
        tokenizer = self.engine.tokenizer
        return [to_beam_search_output(o, tokenizer, params.length_penalty) for o in outputs]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them
        (`continue_final_message`: the model continues the last message; `tools`: OpenAI's
        tool definitions, rendered by templates that take them; `chat_template_kwargs`:
        extra template variables, e.g. Qwen3's `enable_thinking`). The output is text:
        calls and reasoning in it are not parsed here."""
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.engine.tokenizer
        prompts = [
            apply_chat_template(
                tokenizer,
                conv,
                add_generation_prompt,
                continue_final_message,
                tools,
                chat_template_kwargs,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)


def _prompt_of(prompt: PromptType | dict[str, Any]) -> PromptType:
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError("a prompt dict takes 'prompt' (text) or 'prompt_token_ids'")
