"""A request's tenant at the engine: `tenant_id` on `LLM.generate` and
`AsyncLLMEngine.generate`, with the tenants the HTTP ingress reads (engine/tenants.py).

A tenant's request runs at its priority and in its own prefix cache (its cache salt, derived
as the ingress derives it); its max_concurrent_requests and tokens_per_minute are counted by
a `TenantLimiter` of the engine's own (refused: `TenantLimitError`, the server's 429); its
tokens and refusals are recorded as the ingress records them (`kvray_tenant_tokens`,
`kvray_tenant_rejections`, labelled with the tenant). request_timeout_s is the server's: the
engine keeps no time limit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from engine.observability.tenant_metrics import TenantMetrics
from engine.outputs import RequestOutput
from engine.tenants import (
    Tenant,
    TenantConfig,
    TenantLimiter,
    check_tenant_priorities,
    tenant_configs,
)

RATE_LIMITED = "rate_limit_exceeded"
"""The reason label of a refusal, the server's error code for its 429."""


class TenantLimitError(RuntimeError):
    """A tenant's request past its max_concurrent_requests or tokens_per_minute."""

    def __init__(self, tenant: str, reason: str, retry_after_s: float) -> None:
        super().__init__(f"{reason}; retry in {retry_after_s:.0f} s")
        self.tenant = tenant
        self.retry_after_s = retry_after_s


class EngineTenants:
    """The tenants of one engine front end (`tenants=`: name -> `TenantConfig` or its keys).

    A `tenant_id` not among them runs as one with no limits, priority 0 and its own cache
    salt, as an unknown X-Tenant-Id does at the ingress.
    """

    def __init__(self, tenants: Mapping[str, TenantConfig | Mapping] | None = None) -> None:
        self.configs = tenant_configs(tenants)
        self.limiter = TenantLimiter(self.configs)
        self.metrics: TenantMetrics | None = None

    def engine_keys(self, keys: Mapping[str, Any]) -> dict[str, Any]:
        """`keys` with policy "priority" where tenants are given and no policy is (the
        server's default: their priorities take effect); ValueError for a policy that would
        ignore a tenant's priority."""
        keys = dict(keys)
        if self.configs:
            keys.setdefault("policy", "priority")
        check_tenant_priorities(keys.get("policy", "fcfs"), self.configs)
        return keys

    def record_into(self, sink: Any) -> None:
        """Record tenant tokens and refusals into `sink` (a MetricsSink; None: stop). The
        tenant ids come from the program, not from clients: each keeps its name as a label."""
        self.metrics = None if sink is None else TenantMetrics(sink)

    def admit(self, tenant_id: str, model: str) -> tuple[Tenant, str | None]:
        """The tenant and its lease (None when it has no limits); TenantLimitError when it
        may not send another request now."""
        if not isinstance(tenant_id, str) or not tenant_id:
            raise ValueError(f"tenant_id must be a non-empty string, got {tenant_id!r}")
        tenant = Tenant(tenant_id, self.configs.get(tenant_id) or TenantConfig())
        if not tenant.config.has_limits:
            return tenant, None
        admission = self.limiter.acquire(tenant_id)
        if admission.lease_id is None:
            if self.metrics is not None:
                self.metrics.rejected(model, tenant_id, RATE_LIMITED)
            raise TenantLimitError(tenant_id, admission.reason, admission.retry_after_s)
        return tenant, admission.lease_id

    def charge(
        self, lease: str | None, model: str, tenant: Tenant, outputs: Iterable[RequestOutput | None]
    ) -> None:
        """The tenant's requests have ended with `outputs` (their last ones; None for one
        that never gave any): give its slot back and charge the tokens."""
        prompt_tokens = completion_tokens = 0
        for output in outputs:
            if output is not None:
                prompt_tokens += len(output.prompt_token_ids)
                completion_tokens += sum(len(o.token_ids) for o in output.outputs)
        if lease is not None:
            self.limiter.release(lease, prompt_tokens + completion_tokens)
        if self.metrics is not None:
            self.metrics.tokens(model, tenant.name, prompt_tokens, completion_tokens)
