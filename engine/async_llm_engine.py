"""AsyncLLMEngine: kvray's `AsyncEngine` with the serving guides' forms.

```python
engine = AsyncLLMEngine.from_pretrained(model, max_num_seqs=64)   # the engine keys
outputs = await engine.generate(["a prompt", "another"], max_tokens=100)  # final outputs
stream = await engine.generate(["a prompt"], stream=True, max_tokens=100)
async for output in stream:
    print(output.outputs[0].text, end="", flush=True)             # the new text only
```

`generate(prompts, sampling_params=None, *, stream=False, tenant_id=None, **fields)` (no
request_id) takes one prompt or a list, and `SamplingParams` fields as keywords (over
`sampling_params`, else over the model's defaults). Awaited, it gives the final
`RequestOutput`s in the order of the prompts or, with `stream=True`, an async iterator of
outputs as tokens arrive. A streamed output is a delta: its completions hold the text,
token ids and logprobs that arrived since the prompt's previous output (each printed once),
with `finish_reason` on the last; outputs with nothing new are left out. Several prompts
stream interleaved as their tokens come; each output's `request_id` ends in `-<i>`, the
prompt's index in the list. Leaving the loop early aborts every prompt's request.

`generate(prompt, sampling_params, request_id, ...)` is `AsyncEngine.generate` (the
serving layer's form): an async iterator of cumulative outputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.tenant_requests import EngineTenants
from engine.tenants import Tenant, TenantConfig

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {"output_kind"}
"""The keywords `generate` takes as sampling parameters (max_tokens, temperature, ...)."""


class AsyncLLMEngine(AsyncEngine):
    """`AsyncEngine` under the guides' name, with `from_pretrained` and their `generate`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tenants = EngineTenants()
        self._generate_calls = itertools.count()

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        tenants: Mapping[str, TenantConfig | Mapping] | None = None,
        engine_process: bool | None = None,
        **engine_keys: Any,
    ) -> AsyncLLMEngine:
        """The engine of `model` (an HF folder, a `.gguf` file; None: the bundled model)
        with the engine keys (and their aliases: max_batch_size, ...). `tenants`: name ->
        `TenantConfig` (or its keys), for `generate(..., tenant_id=...)`; with tenants the
        policy defaults to "priority". `engine_process` as in `from_engine_args`."""
        table = EngineTenants(tenants)
        args = EngineArgs(model=model, **table.engine_keys(engine_keys))
        engine = cls.from_engine_args(args, engine_process=engine_process)
        engine.tenants = table
        return engine

    def enable_metrics(self, sink: Any) -> None:
        """AsyncEngine's metrics, and the tokens and refusals of requests that name a tenant."""
        super().enable_metrics(sink)
        self.tenants.record_into(sink)

    def generate(  # type: ignore[override]  # a plain method: it also returns an awaitable
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        *,
        stream: bool = False,
        tenant_id: str | None = None,
        **sampling_fields: Any,
    ) -> Any:
        """With `request_id`: AsyncEngine's async iterator of one request's cumulative
        outputs. Without: an awaitable of the final outputs, or of a stream of deltas
        (`stream=True`); the module's docstring says what they hold."""
        unknown = sorted(set(sampling_fields) - SAMPLING_FIELDS)
        if unknown:
            raise TypeError(
                f"generate() got unexpected keyword argument(s) {', '.join(unknown)}: "
                "not SamplingParams fields"
            )
        if request_id is None:
            params = self._params(sampling_params, sampling_fields, stream)
            return self._generate_prompts(prompt, params, priority, cache_salt, stream, tenant_id)
        if stream or sampling_fields or sampling_params is None:
            raise TypeError(
                "generate(prompt, sampling_params, request_id) takes a SamplingParams and no "
                "stream or sampling keywords: leave request_id out for those"
            )
        if tenant_id is None:
            return super().generate(prompt, sampling_params, request_id, priority, cache_salt)
        return self._tenant_request(
            prompt, sampling_params, request_id, priority, cache_salt, tenant_id
        )

    def _params(
        self, sampling_params: SamplingParams | None, fields: dict[str, Any], stream: bool
    ) -> SamplingParams:
        if sampling_params is None:
            sampling_params = SamplingParams(**self.generation_defaults.as_sampling_args())
        kind = RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY
        return dataclasses.replace(sampling_params, **fields, output_kind=kind)

    def _admit(
        self, tenant_id: str | None, priority: int, cache_salt: str | None
    ) -> tuple[Tenant | None, str | None, int, str | None]:
        if tenant_id is None:
            return None, None, priority, cache_salt
        tenant, lease = self.tenants.admit(tenant_id, self.model_name)
        return tenant, lease, *tenant.request_keys(priority, cache_salt)

    async def _tenant_request(
        self, prompt: Any, params: SamplingParams, request_id: str, priority: int,
        cache_salt: str | None, tenant_id: str,
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        tenant, lease, priority, cache_salt = self._admit(tenant_id, priority, cache_salt)
        last = None
        try:
            async for output in super().generate(prompt, params, request_id, priority, cache_salt):
                last = output
                yield output
        finally:
            self.tenants.charge(lease, self.model_name, tenant, [last])

    async def _generate_prompts(
        self, prompts: Any, params: SamplingParams, priority: int, cache_salt: str | None,
        stream: bool, tenant_id: str | None,
    ) -> list[RequestOutput] | AsyncIterator[RequestOutput]:  # fmt: skip
        call = next(self._generate_calls)
        requests = [
            (prompt, params, f"generate-{call}-{i}", priority, cache_salt)
            for i, prompt in enumerate(_prompt_list(prompts))
        ]
        if stream:
            return self._stream_deltas(requests, tenant_id)
        tenant, lease, priority, cache_salt = self._admit(tenant_id, priority, cache_salt)
        requests = [(*r[:3], priority, cache_salt) for r in requests]
        last: list[RequestOutput | None] = [None] * len(requests)

        async def run(i: int) -> None:
            async for output in AsyncEngine.generate(self, *requests[i]):
                last[i] = output

        try:
            await _run_all([run(i) for i in range(len(requests))])
        finally:
            if tenant is not None:
                self.tenants.charge(lease, self.model_name, tenant, last)
        return last  # type: ignore[return-value]  # each request ends with its final output

    async def _stream_deltas(
        self, requests: list[tuple], tenant_id: str | None
    ) -> AsyncIterator[RequestOutput]:
        # Admitted at the first iteration: a stream never read holds no tenant's slot.
        *_, priority, cache_salt = requests[0]
        tenant, lease, priority, cache_salt = self._admit(tenant_id, priority, cache_salt)
        requests = [(*r[:3], priority, cache_salt) for r in requests]
        queue: asyncio.Queue = asyncio.Queue()
        last: list[RequestOutput | None] = [None] * len(requests)

        async def pump(i: int) -> None:
            try:
                async for output in AsyncEngine.generate(self, *requests[i]):
                    queue.put_nowait((i, output))
            except Exception as e:
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(requests))]
        try:
            open_requests = len(requests)
            while open_requests:
                i, item = await queue.get()
                if item is None:
                    open_requests -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    delta = delta_output(last[i], item)
                    last[i] = item
                    if delta is not None:
                        yield delta
        finally:
            for task in tasks:
                task.cancel()  # a request still running is aborted
            await asyncio.gather(*tasks, return_exceptions=True)
            if tenant is not None:
                self.tenants.charge(lease, self.model_name, tenant, last)


def _prompt_list(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts must be a prompt or a non-empty list of them, got {prompts!r}")
    return list(prompts)


async def _run_all(coroutines: list) -> None:
    """Run the coroutines together; the first to raise cancels the others (which aborts
    their requests) and its error is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task in done and task.exception() is not None:
                raise task.exception()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def delta_output(previous: RequestOutput | None, output: RequestOutput) -> RequestOutput | None:
    """`output` (cumulative) with only what came since `previous` in its completions; None
    when nothing did and it is not the last."""
    before = {} if previous is None else {c.index: c for c in previous.outputs}
    completions = []
    for completion in output.outputs:
        prior = before.get(completion.index)
        num_ids = 0 if prior is None else len(prior.token_ids)
        num_chars = 0 if prior is None else len(prior.text)
        logprobs = completion.logprobs
        completions.append(
            dataclasses.replace(
                completion,
                text=completion.text[num_chars:],
                token_ids=completion.token_ids[num_ids:],
                logprobs=None if logprobs is None else logprobs[num_ids:],
            )
        )
    if not output.finished and not any(c.token_ids or c.text for c in completions):
        return None
    return dataclasses.replace(output, outputs=completions)
