"""The keys of a kvray Serve app itself (`ServeOptions`): replicas, queues, the ingress,
API keys and tenants, time limits, the chat front end's options. `AppConfig`
(cluster/app_config.py) adds the engine's keys to them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.tenants import TenantConfig

SERVE_INT_MAX = 2**31 - 1
"""Serve holds replica counts and request bounds as 32-bit ints: past this serve.run fails
with a message that names no key."""

QUEUED_PER_ONGOING_REQUEST = 4
"""max_queued_requests when not given: this many waiting per request a replica runs."""

REPLICA_REQUESTS_MAX = 2**30
"""The most requests one LLMServer replica may hold, running and queued; below
SERVE_INT_MAX so that a colocated replica's Serve bound, a little above it, fits too."""


class ServeOptions(BaseModel):
    """Keys of the Serve app itself (replicas, queues, safety, tenants)."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        protected_namespaces=(),
        allow_inf_nan=False,
    )

    min_replicas: int = Field(default=1, ge=0, le=SERVE_INT_MAX)
    """Fewest LLMServer replicas (each holds one copy of the model)."""
    max_replicas: int = Field(default=1, gt=0, le=SERVE_INT_MAX)
    initial_replicas: int | None = Field(default=None, ge=0, le=SERVE_INT_MAX)
    target_ongoing_requests: float | None = Field(default=None, gt=0)
    """Requests per replica the autoscaler aims at; default: half of max_ongoing_requests."""
    max_ongoing_requests: int | None = Field(default=None, gt=0, le=SERVE_INT_MAX)
    """Requests one replica takes at once; default: max_num_seqs if given, else 1024 with
    GPUs (the engine's default on a 70 GiB+ card) and 256 without."""
    max_queued_requests: int | None = Field(default=None, ge=0, le=SERVE_INT_MAX)
    """Requests waiting for a replica; more get 429. Default: 4 x max_ongoing_requests."""
    upscale_delay_s: float = Field(default=30.0, ge=0)
    downscale_delay_s: float = Field(default=600.0, ge=0)
    look_back_period_s: float = Field(default=30.0, gt=0)
    metrics_interval_s: float | None = Field(default=None, gt=0)
    """How often replicas report load to the autoscaler (Ray's default: 10 s)."""
    num_cpus: float | None = Field(default=None, gt=0)
    """CPUs per placement-group bundle (one bundle per rank); default 1 with GPUs, 0.25 without."""
    ingress_min_replicas: int = Field(default=1, gt=0, le=SERVE_INT_MAX)
    ingress_max_replicas: int = Field(default=2, gt=0, le=SERVE_INT_MAX)
    ingress_target_ongoing_requests: float = Field(default=256, gt=0)
    ingress_max_ongoing_requests: int = Field(default=8192, gt=0, le=SERVE_INT_MAX)
    ingress_num_cpus: float = Field(default=0.25, ge=0)
    colocate_ingress: bool = False
    """Serve HTTP from the engine replicas themselves (one deployment, `OpenAIIngress`
    holding the engine): two Ray calls less per request (a quicker first token),
    but the ingress scales with the engine replicas and the ingress_* keys are unused."""
    api_keys: dict[str, str] = Field(default_factory=dict)
    """API key -> tenant name. When set, requests need `Authorization: Bearer <key>` (401 without)."""
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    """Tenant name -> limits, priority, cache salt. Without api_keys the tenant is the
    X-Tenant-Id header (or "default")."""
    request_timeout_s: float | None = Field(default=600.0, gt=0)
    """A request still running after this long is aborted (its KV freed) with a 408."""
    no_replica_wait_s: float | None = Field(default=5.0, gt=0)
    """While no replica of a model is up (all died; Serve is starting new ones), a request
    waits this long for one, then gets 503 with Retry-After; none/null: it waits as long
    as it takes. Models with min_replicas 0 always wait (a request starts their replica)."""
    grpc_port: int | None = Field(default=None, ge=0, le=65535)
    """kvray's gRPC API (kvray.v1.InferenceService, cluster/grpc_api/inference.proto) on
    this port of Serve's proxies; none or 0: off. Serve takes it when it starts: `kvray
    serve` and an app built while no Serve instance runs start Serve with it, an app built
    on a running instance checks that it serves the API on this port."""
    max_request_body_bytes: int = Field(default=8 << 20, gt=0)
    """Larger request bodies get 413 before they are read."""
    max_completion_prompts: int = Field(default=1024, gt=0)
    """vLLM's VLLM_MAX_COMPLETION_PROMPTS: a completion request's most prompts (each is an
    engine request of its own, n sequences each); a longer list is a 400."""
    engine_process: bool | None = None
    """Run the engine in a process of its own beside the replica's; default: on one GPU."""
    enable_auto_tool_choice: bool = False
    """vLLM's: chats with tools and tool_choice "auto" (the default with tools) get their
    calls read out of the model's output, in tool_call_parser's format; without it such a
    chat is a 400 (a named tool_choice and "required" work either way)."""
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = None
    """vLLM's: the model's format of tool calls: hermes (Hermes, Qwen2.5, Qwen3:
    <tool_call>{...}</tool_call>), llama3_json (Llama 3.1/3.2's JSON calls), mistral
    ([TOOL_CALLS] and a JSON list)."""
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None
    """vLLM's: chats' outputs split into the model's thought, between <think> and </think>
    (message.reasoning and reasoning_content), and the content; a structured output or a
    forced tool choice then starts after the thought. deepseek_r1 (DeepSeek-R1, QwQ: the
    output starts thinking), qwen3 (Qwen3: a thought only where the output opens one)."""
    chat_template: str | None = None
    """vLLM's: a chat template in place of the tokenizer's, the path of a Jinja file or the
    template's text (a file is read, and the template compiled, at start)."""
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """vLLM's: variables for every chat template render (e.g. {"enable_thinking": false}); a
    request's chat_template_kwargs override them."""
    routing: Literal["power_of_two", "prefix_affinity"] = "prefix_affinity"
    """How a request picks one of a model's LLMServer replicas: prefix_affinity sends it to
    the replica most likely to hold its prompt's start in its prefix cache, within
    routing_load_factor (cluster/prefix_router.py); power_of_two: the less loaded of two at
    random (Serve's default). Applies where the model may have more than one replica
    (max_replicas > 1) and the ingress is not colocated; one replica is always power_of_two."""
    routing_load_factor: float = Field(default=1.5, ge=1)
    """prefix_affinity's bound: a replica takes a request for its cached prefix while its
    requests, this one included, stay within this many times the replicas' mean (rounded
    up); above it the request goes by power_of_two."""
    enable_prompt_tokens_details: bool = False
    """vLLM's: usage carries OpenAI's prompt_tokens_details.cached_tokens (the prompt
    tokens the prefix cache served)."""

    # Autoscaling on the engine's latency (cluster/autoscaling_policy.py).
    autoscaling_metric: Literal["ongoing_requests", "queue_wait", "ttft"] = "ongoing_requests"
    """What LLMServer's autoscaler holds at its target: ongoing_requests (Serve's own policy,
    target_ongoing_requests per replica), queue_wait (the engine's mean wait from arrival
    to first scheduled, target_queue_wait_s) or ttft (its mean time to first token,
    target_ttft_s), each replica's mean over look_back_period_s. A latency metric scales to
    ceil(replicas x observed / target) within [min_replicas, max_replicas], after
    upscale_delay_s / downscale_delay_s."""
    target_queue_wait_s: float | None = Field(default=None, gt=0)
    """The mean queue wait (seconds) autoscaling_metric queue_wait aims at."""
    target_ttft_s: float | None = Field(default=None, gt=0)
    """The mean time to first token (seconds) autoscaling_metric ttft aims at."""
    # -- the model lifecycle's admin API (cluster/admin_api.py) --
    admin_api_keys: list[str] = Field(default_factory=list)
    """Keys of the admin routes (/v1/admin/*: load_model, sleep, wake_up, is_sleeping,
    reset_prefix_cache) as `Authorization: Bearer <key>`; none: those routes are off (404).
    Separate from api_keys: a user's key gets 403 there."""
    switch_drain_timeout_s: float | None = Field(default=60.0, ge=0)
    """A replica that switches models or goes to sleep lets its running requests finish for
    this long, then aborts the rest with a 503 `model_switching`; none/null: waits for all."""
    wake_on_request: bool = False
    """A sleeping model wakes for the first generation request (which waits for it) instead
    of answering 503 `model_asleep`."""

    @property
    def prefix_affinity(self) -> bool:
        """Whether LLMServer's requests go by prefix affinity (`routing`)."""
        return (
            self.routing == "prefix_affinity"
            and self.max_replicas > 1
            and not self.colocate_ingress
        )

    @model_validator(mode="after")
    def _check_replicas(self) -> ServeOptions:
        for prefix in ("", "ingress_"):
            lo, hi = getattr(self, f"{prefix}min_replicas"), getattr(self, f"{prefix}max_replicas")
            if hi < lo:
                raise ValueError(
                    f"{prefix}max_replicas ({hi}) must be >= {prefix}min_replicas ({lo})"
                )
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(
                f"initial_replicas ({initial}) must be in [min_replicas, max_replicas] "
                f"= [{self.min_replicas}, {self.max_replicas}]"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        return self

    @model_validator(mode="after")
    def _check_autoscaling_metric(self) -> ServeOptions:
        from cluster.autoscaling_policy import TARGET_KEYS, autoscaling_keys_problem

        targets = {key: getattr(self, key) for key in TARGET_KEYS.values()}
        problem = autoscaling_keys_problem(
            self.autoscaling_metric, targets, self.target_ongoing_requests, self.colocate_ingress
        )
        if problem is not None:
            raise ValueError(problem)
        return self

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key, tenant in value.items():
            problem = _header_problem(key)
            if problem is not None:  # named by its tenant: the key is a secret
                raise ValueError(
                    f"the key of tenant {tenant!r} {problem}: an API key is {_HEADER_TEXT} "
                    "(as the Authorization header carries it)"
                )
        return value

    @field_validator("admin_api_keys")
    @classmethod
    def _check_admin_api_keys(cls, value: list[str]) -> list[str]:
        for index, key in enumerate(value):
            problem = _header_problem(key)
            if problem is not None:  # named by its place: the key is a secret
                raise ValueError(f"admin_api_keys[{index}] {problem}: a key is {_HEADER_TEXT}")
        return value

    @model_validator(mode="after")
    def _check_admin_keys_apart(self) -> ServeOptions:
        for index, key in enumerate(self.admin_api_keys):
            if key in self.api_keys:
                raise ValueError(
                    f"admin_api_keys[{index}] is also a key of api_keys: an admin key is a key "
                    "of its own"
                )
        return self

    @model_validator(mode="after")
    def _check_tenant_names(self) -> ServeOptions:
        keyed = set(self.api_keys.values())
        for name in self.tenants:
            if self.api_keys and name not in keyed:
                raise ValueError(
                    f"tenants: no API key maps to {name!r} (api_keys map to "
                    f"{', '.join(map(repr, sorted(keyed)))}), so its settings would never apply"
                )
            problem = None if self.api_keys else _header_problem(name)
            if problem is not None:
                raise ValueError(
                    f"tenants: the name {name!r} {problem}: without api_keys the tenant is "
                    f"the X-Tenant-Id header, so a tenant's name is {_HEADER_TEXT}"
                )
        return self

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, value: str | None) -> str | None:
        # The text travels in the config: replicas on other nodes may not have the file.
        if value is None:
            return None
        from engine.tokenizer import load_chat_template  # loads transformers: not for --help

        return load_chat_template(value, "chat_template")

    @field_validator("default_chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        from engine.tokenizer import ChatInputError, check_template_kwargs

        try:
            return check_template_kwargs(value, "default_chat_template_kwargs")
        except ChatInputError as e:
            raise ValueError(str(e)) from None

    @field_validator("api_keys", "tenants", "default_chat_template_kwargs", mode="before")
    @classmethod
    def _json_string(cls, value: Any) -> Any:
        # `serve run ... api_keys='{"k": "team"}'` and CLI flags hand dicts over as JSON text.
        return json_text(value)

    @field_validator("admin_api_keys", mode="before")
    @classmethod
    def _admin_keys_text(cls, value: Any) -> Any:
        # `serve run ... admin_api_keys='["k1"]'` (JSON) or one key as plain text.
        if isinstance(value, str):
            return json_text(value) if value.startswith("[") else [value]
        return value


def json_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict; a key given twice is an error (json.loads keeps the last)."""
    value: dict[str, Any] = {}
    for key, item in pairs:
        if key in value:
            raise ValueError(f"{key!r} is given twice in the JSON text")
        value[key] = item
    return value


_HEADER_TEXT = "printable ASCII, not empty, without whitespace at either end"


def _header_problem(text: str) -> str | None:
    """Why a request header's value can never equal `text` (the server strips its ends and
    decodes it as latin-1; clients send ASCII), None if one can."""
    if not text:
        return "is empty"
    if text != text.strip():
        return "starts or ends with whitespace"
    if not (text.isascii() and text.isprintable()):
        return "is not printable ASCII"
    return None


# The keys of one model's LLMServer deployment. Every other ServeOptions key is app-wide:
# with `models` it stays at the top level and applies to every model.
PER_MODEL_SERVE_KEYS = frozenset(
    {
        "min_replicas",
        "max_replicas",
        "initial_replicas",
        "target_ongoing_requests",
        "max_ongoing_requests",
        "max_queued_requests",
        "upscale_delay_s",
        "downscale_delay_s",
        "look_back_period_s",
        "metrics_interval_s",
        "num_cpus",
        "engine_process",
        "enable_auto_tool_choice",
        "tool_call_parser",
        "reasoning_parser",
        "chat_template",
        "default_chat_template_kwargs",
        "enable_prompt_tokens_details",
        "routing",
        "routing_load_factor",
        "autoscaling_metric",
        "target_queue_wait_s",
        "target_ttft_s",
    }
)
