"""Who sent a request over HTTP (API key or X-Tenant-Id).

What a tenant may do (`TenantConfig`, the app's `tenants` key), its cache salt and the
`TenantLimiter` are engine/tenants.py's, shared with the engine's own front ends; the app
runs one copy of the limiter as a single-replica Serve deployment, so every ingress replica
counts against the same limits.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.api.errors import APIError
from engine.tenants import DEFAULT_TENANT, Tenant, TenantConfig

TENANT_HEADER = "x-tenant-id"


class TenantResolver:
    def __init__(self, api_keys: Mapping[str, str], tenants: Mapping[str, TenantConfig]) -> None:
        self.api_keys = dict(api_keys)
        self.tenants = dict(tenants)

    def resolve(self, headers: Mapping[str, str]) -> Tenant:
        """The request's tenant; 401 when API keys are on and the key is missing or wrong.

        With keys on, X-Tenant-Id is ignored: a key cannot claim another tenant's limits.
        """
        if self.api_keys:
            scheme, _, key = headers.get("authorization", "").partition(" ")
            name = self.api_keys.get(key.strip()) if scheme.lower() == "bearer" else None
            if name is None:
                raise APIError(
                    "missing or invalid API key: send `Authorization: Bearer <key>`",
                    401,
                    code="invalid_api_key",
                )
        else:
            name = headers.get(TENANT_HEADER) or DEFAULT_TENANT
        return Tenant(name, self.tenants.get(name) or TenantConfig())
