"""Who sent a request (API key or X-Tenant-Id), what that tenant may do (`TenantConfig`,
the app's `tenants` key), and whether it may send another.

`TenantLimiter` is plain Python so it can be tested alone; the app runs one copy of it as
a single-replica Serve deployment, so every ingress replica counts against the same limits.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from engine.api.errors import APIError

DEFAULT_TENANT = "default"
TENANT_HEADER = "x-tenant-id"
WINDOW_S = 60.0
LEASE_GRACE_S = 60.0


class TenantConfig(BaseModel):
    """One tenant's limits, priority, cache salt and time limit."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    max_concurrent_requests: int | None = Field(default=None, gt=0)
    """Requests of this tenant in flight at once; more get 429."""
    tokens_per_minute: int | None = Field(default=None, gt=0)
    """Prompt + completion tokens over the last 60 s; past it requests get 429."""
    priority: int = 0
    """Scheduling priority (lower runs first); a request may ask for a later one, not an earlier one."""
    cache_salt: str | None = None
    """Prefix-cache salt; default: the tenant's name, so tenants never share cached blocks."""
    request_timeout_s: float | None = Field(default=None, gt=0)
    """Overrides the app's request_timeout_s for this tenant."""

    @property
    def has_limits(self) -> bool:
        return self.max_concurrent_requests is not None or self.tokens_per_minute is not None

    def time_limit_s(self, app_request_timeout_s: float | None) -> float | None:
        """This tenant's request time limit: its own request_timeout_s, else the app's."""
        return self.request_timeout_s or app_request_timeout_s


@dataclass(frozen=True)
class Tenant:
    name: str
    config: TenantConfig

    @property
    def cache_salt(self) -> str:
        return self.config.cache_salt if self.config.cache_salt is not None else self.name


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


@dataclass
class Admission:
    lease_id: str | None
    """Set when admitted: hand it back to `release()` when the request ends."""
    retry_after_s: float = 0.0
    reason: str = ""


@dataclass
class _TenantState:
    leases: dict[str, float] = field(default_factory=dict)
    """Lease id -> start time of the tenant's requests in flight."""
    usage: deque[tuple[float, int]] = field(default_factory=deque)
    """(time, tokens) of requests finished within the last minute."""
    tokens_in_window: int = 0


class TenantLimiter:
    """Per-tenant concurrent requests and tokens per minute (sliding 60 s window).

    Tokens are charged when a request ends (its real usage), so a tenant may overshoot its
    minute by the requests already in flight; the concurrency limit bounds that.
    """

    def __init__(
        self,
        tenants: Mapping[str, TenantConfig],
        request_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`request_timeout_s`: the app's; a tenant's own request_timeout_s overrides it.
        A lease outlives its tenant's time limit by a minute at most (an ingress that died
        before releasing it); without a time limit leases never expire."""
        self.tenants = dict(tenants)
        self.request_timeout_s = request_timeout_s
        self.clock = clock
        self._states: dict[str, _TenantState] = {}
        self._ids = itertools.count()

    def acquire(self, tenant: str) -> Admission:
        config = self.tenants.get(tenant) or TenantConfig()
        now = self.clock()
        state = self._state(tenant, now)
        limit = config.max_concurrent_requests
        if limit is not None and len(state.leases) >= limit:
            return Admission(
                None, 1.0, f"tenant {tenant!r} has {limit} requests in flight (its limit)"
            )
        tpm = config.tokens_per_minute
        if tpm is not None and state.tokens_in_window >= tpm:
            return Admission(
                None,
                self._seconds_until_under(state, tpm, now),
                f"tenant {tenant!r} used {state.tokens_in_window} tokens in the last minute "
                f"(its limit is {tpm})",
            )
        lease_id = f"{tenant}/{next(self._ids)}"
        state.leases[lease_id] = now
        return Admission(lease_id)

    def release(self, lease_id: str, tokens: int = 0) -> None:
        tenant = lease_id.rsplit("/", 1)[0]
        now = self.clock()
        state = self._state(tenant, now)
        state.leases.pop(lease_id, None)
        if tokens > 0:
            state.usage.append((now, tokens))
            state.tokens_in_window += tokens

    def _state(self, tenant: str, now: float) -> _TenantState:
        state = self._states.get(tenant)
        if state is None:
            state = self._states[tenant] = _TenantState()
        while state.usage and state.usage[0][0] <= now - WINDOW_S:
            state.tokens_in_window -= state.usage.popleft()[1]
        ttl = self._lease_ttl_s(tenant)
        if ttl is not None:
            expired = [i for i, t in state.leases.items() if t <= now - ttl]
            for lease_id in expired:
                del state.leases[lease_id]
        return state

    def _lease_ttl_s(self, tenant: str) -> float | None:
        timeout = (self.tenants.get(tenant) or TenantConfig()).time_limit_s(self.request_timeout_s)
        return None if timeout is None else timeout + LEASE_GRACE_S

    @staticmethod
    def _seconds_until_under(state: _TenantState, tpm: int, now: float) -> float:
        remaining = state.tokens_in_window
        for t, tokens in state.usage:
            remaining -= tokens
            if remaining < tpm:
                return max(0.0, t + WINDOW_S - now)
        return WINDOW_S
