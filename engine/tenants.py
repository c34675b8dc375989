"""Tenants: what one may do (`TenantConfig`), its prefix-cache salt, and whether it may send
another request (`TenantLimiter`).

One owner for each setting: the HTTP ingress (the app's `tenants` key, a tenant named by its
API key or X-Tenant-Id) and the engine's own front ends (`LLM(tenants=...)`,
`AsyncLLMEngine.from_pretrained(tenants=...)`, a tenant named by `tenant_id`) read the same
`TenantConfig`, derive a tenant's cache salt the same way (`Tenant.cache_salt`,
`prefix_cache_salt`) and count its limits with the same `TenantLimiter`. Plain Python, no
torch: the ingress imports it.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_TENANT = "default"
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

    def request_keys(self, priority: int, cache_salt: str | None) -> tuple[int, str]:
        """(priority, cache salt) of one of this tenant's requests that asks for `priority`
        and its own `cache_salt`: never more urgent than the tenant, never in another
        tenant's cache."""
        return max(self.config.priority, priority), prefix_cache_salt(self.cache_salt, cache_salt)


def prefix_cache_salt(tenant_salt: str | None, request_salt: str | None) -> str | None:
    """The salt of a request's prefix-cache blocks: its tenant's, and within it the
    request's own `cache_salt`. Both go into the result, so no salt a client picks can
    name another tenant's blocks."""
    if request_salt is None:
        return tenant_salt
    return json.dumps([tenant_salt, request_salt])


def tenant_configs(tenants: Mapping[str, TenantConfig | Mapping] | None) -> dict[str, TenantConfig]:
    """Tenant name -> its checked `TenantConfig` (each given as one or as its keys);
    ValueError naming `tenants.<name>` and the field."""
    configs = {}
    for name, config in (tenants or {}).items():
        if isinstance(config, TenantConfig):
            configs[name] = config
            continue
        try:
            configs[name] = TenantConfig.model_validate(config)
        except ValidationError as e:
            problems = "; ".join(
                f"tenants.{name}.{'.'.join(map(str, error['loc']))}: {error['msg']}"
                for error in e.errors()
            )
            raise ValueError(problems) from None
    return configs


def check_tenant_priorities(policy: str, tenants: Mapping[str, TenantConfig]) -> None:
    """ValueError when `policy` would ignore a tenant's priority."""
    if policy != "priority":
        for name, tenant in tenants.items():
            if tenant.priority != 0:
                raise ValueError(
                    f"policy {policy} ignores priorities, but tenants.{name}.priority is "
                    f"{tenant.priority}: use policy priority (the default) or drop it"
                )


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
