"""Per-tenant requests, tokens and rejections (`kvray_http_requests`, `kvray_tenant_tokens`,
`kvray_tenant_rejections`): recorded by the HTTP ingress, and by the engine's front ends
for requests that name a `tenant_id` (engine/tenant_requests.py)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

OTHER_TENANT = "other"


class TenantMetrics:
    """Per-tenant requests, tokens and rejections, labelled with the served model name the
    request went to ("" when it was refused before naming one: a client's unknown model
    names never become label values).

    `named_tenants`: the tenants that keep their name as a label value (None: all); any
    other counts as "other", so a client's X-Tenant-Id values cannot grow the series
    without bound."""

    def __init__(self, sink: Any, named_tenants: Collection[str] | None = None) -> None:
        self.sink = sink
        self.named_tenants = None if named_tenants is None else frozenset(named_tenants)

    def request_done(self, model: str, tenant: str, status_code: int) -> None:
        labels = {"model": model, "tenant": self._label(tenant), "code": str(status_code)}
        self.sink.inc("kvray_http_requests", 1, labels)

    def rejected(self, model: str, tenant: str, reason: str) -> None:
        labels = {"model": model, "tenant": self._label(tenant), "reason": reason}
        self.sink.inc("kvray_tenant_rejections", 1, labels)

    def tokens(self, model: str, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        for kind, count in (("prompt", prompt_tokens), ("generation", completion_tokens)):
            labels = {"model": model, "tenant": self._label(tenant), "kind": kind}
            self.sink.inc("kvray_tenant_tokens", count, labels)

    def _label(self, tenant: str) -> str:
        named = self.named_tenants
        return tenant if named is None or tenant in named else OTHER_TENANT
