"""The one set of keys that builds a kvray Serve app.

`serve run serve_app:build_app key=value ...`, the `args:` of a Serve config file and
`kvray serve --key value ...` all validate through `AppConfig`: an unknown key or a bad
value fails at start with a message naming it. Engine keys are the engine's own
(engine/config.py), so the two can never drift apart.

With `models` one app serves several models: each entry holds one model's keys
(PER_MODEL_KEYS: its engine keys and its LLMServer deployment's replica keys), the top level
the app's own (tenants, API keys, time limits, the ingress); `AppConfig.model_configs()`
gives one single-model AppConfig per entry.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from engine.config import (
    SERVER_PREFILL_TOKENS_WITH_DECODES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    world_size,
)
from engine.tokenizer import ChatInputError, check_template_kwargs, load_chat_template
from engine.worker.loader import served_names

SERVE_INT_MAX = 2**31 - 1
"""Serve holds replica counts and request bounds as 32-bit ints: past this serve.run fails
with a message that names no key."""

REPLICA_REQUESTS_MAX = 2**30
"""The most requests one LLMServer replica may hold, running and queued; below
SERVE_INT_MAX so that a colocated replica's Serve bound, a little above it, fits too."""


class TenantConfig(BaseModel):
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
    holding the engine): two Ray calls less per request (about 4 ms of time to first token),
    but the ingress scales with the engine replicas and the ingress_* keys are unused."""
    api_keys: dict[str, str] = Field(default_factory=dict)
    """API key -> tenant name. When set, requests need `Authorization: Bearer <key>` (401 without)."""
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    """Tenant name -> limits, priority, cache salt. Without api_keys the tenant is the
    X-Tenant-Id header (or "default")."""
    request_timeout_s: float | None = Field(default=600.0, gt=0)
    """A request still running after this long is aborted (its KV freed) with a 408."""
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
    enable_prompt_tokens_details: bool = False
    """vLLM's: usage carries OpenAI's prompt_tokens_details.cached_tokens (the prompt
    tokens the prefix cache served)."""

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
        return None if value is None else load_chat_template(value, "chat_template")

    @field_validator("default_chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            return check_template_kwargs(value, "default_chat_template_kwargs")
        except ChatInputError as e:
            raise ValueError(str(e)) from None

    @field_validator("api_keys", "tenants", "default_chat_template_kwargs", mode="before")
    @classmethod
    def _json_string(cls, value: Any) -> Any:
        # `serve run ... api_keys='{"k": "team"}'` and CLI flags hand dicts over as JSON text.
        return _json_text(value)


def _json_text(value: Any) -> Any:
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


# ModelConfig comes first: its max_model_len default (None = the model's own) wins.
ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig)


def _engine_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for cls in ENGINE_CONFIGS:
        for name, info in cls.model_fields.items():
            fields.setdefault(name, (info.annotation, info))
    # None: the engine picks from the GPU (vLLM's defaults: 1024 on a 70 GiB+ card).
    fields["max_num_seqs"] = (
        int | None,
        Field(
            default=None, gt=0, description="picked by the engine: 1024 on a 70 GiB+ GPU, else 256"
        ),
    )
    fields["max_num_batched_tokens"] = (
        int | None,
        Field(default=None, gt=0, description="picked by the engine: 8192 when serving"),
    )
    fields["max_prefill_tokens_with_decodes"] = (
        int | None,
        Field(
            default=None,
            ge=0,
            description="prompt tokens a step takes while requests decode (longer prompts "
            f"are chunked); picked by the engine: {SERVER_PREFILL_TOKENS_WITH_DECODES} when "
            "serving; 0: up to max_num_batched_tokens",
        ),
    )
    # The engine takes an executor class; the app names its own: "ray", the Ray actor group.
    fields["distributed_executor_backend"] = (
        Literal["uni", "ray"] | None,
        Field(default=None, description='None: "uni" for one rank, "ray" for more'),
    )
    fields["policy"] = (Literal["fcfs", "priority"], Field(default="priority"))
    fields["device"] = (Literal["cpu", "cuda"] | None, Field(default=None))
    fields["enforce_eager"] = (bool, Field(default=False))
    info = EngineConfig.model_fields["prefill_cuda_graph_tokens"]
    fields["prefill_cuda_graph_tokens"] = (info.annotation, info)
    return fields


def _engine_validators() -> dict[str, Any]:
    """The engine configs' field validators, so that a value the engine would refuse (a
    generation_config folder without the file, ...) is refused at start, naming its key."""
    return {
        f"_{cls.__name__}{name}": field_validator(*d.info.fields, mode=d.info.mode)(d.func)
        for cls in ENGINE_CONFIGS
        for name, d in cls.__pydantic_decorators__.field_validators.items()
    }


ENGINE_KEYS = frozenset(_engine_fields())

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
    }
)
PER_MODEL_KEYS = ENGINE_KEYS | PER_MODEL_SERVE_KEYS

_AppConfigBase = create_model(
    "_AppConfigBase",
    __base__=ServeOptions,
    __validators__=_engine_validators(),
    **_engine_fields(),
)


class AppConfig(_AppConfigBase):
    """Every key of a kvray Serve app: the engine's (vLLM names) and `ServeOptions`.

    The server's scheduling policy defaults to "priority" so tenant priorities take effect;
    with equal priorities it admits in arrival order, like "fcfs".
    """

    models: list[dict[str, Any]] | None = Field(
        default=None,
        min_length=1,
        description="several models in one app: a list of entries (JSON on the command line), "
        "each with one model's engine and replica keys (model, served_model_name, "
        "tensor_parallel_size, max_replicas, ...); the app's own keys (tenants, api_keys, "
        "request_timeout_s, ingress_*) stay at the top level",
    )
    _model_configs: list[AppConfig] = PrivateAttr(default_factory=list)

    @field_validator("models", mode="before")
    @classmethod
    def _models_json_string(cls, value: Any) -> Any:
        return _json_text(value)

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _served_names_json(cls, value: Any) -> Any:
        # Several names arrive from `serve run ... served_model_name='["a", "b"]'` as text.
        return _json_text(value) if isinstance(value, str) and value.startswith("[") else value

    @model_validator(mode="after")
    def _check_replica_requests(self) -> AppConfig:
        if self.models is not None:
            return self  # each entry is checked on its own
        # Before the device is known, the larger default (a GPU's).
        ongoing = self.resolved_max_ongoing_requests(self.device or "cuda")
        ongoing_key = "max_ongoing_requests"
        if self.max_ongoing_requests is None and self.max_num_seqs is not None:
            ongoing_key = "max_num_seqs"
        queued = self.max_queued_requests
        if queued is None:
            queued = 4 * ongoing
            held = f"max_queued_requests (default: 4 x {ongoing_key} = {queued})"
        else:
            held = f"max_queued_requests ({queued})"
        held = f"{ongoing_key} ({ongoing}) + {held}"
        if ongoing + queued > REPLICA_REQUESTS_MAX:
            raise ValueError(
                f"{held}: a replica would hold {ongoing + queued} requests, past the "
                f"{REPLICA_REQUESTS_MAX} it may (Serve bounds requests by 32-bit ints); "
                "give smaller values"
            )
        # The autoscaler counts a replica's requests and those queued for it at its callers.
        # With none queued there (no queue, or colocated: the replica queues its own) a
        # target of what one replica holds is never passed.
        target = self.target_ongoing_requests
        bounded = self.colocate_ingress or queued == 0
        if target is not None and bounded and target >= ongoing + queued:
            raise ValueError(
                f"target_ongoing_requests ({target:g}) is not below the requests a replica "
                f"holds, {held}: the autoscaler would never add a replica"
            )
        return self

    @model_validator(mode="after")
    def _check_priorities(self) -> AppConfig:
        if self.policy == "fcfs":
            for name, tenant in self.tenants.items():
                if tenant.priority != 0:
                    raise ValueError(
                        f"policy fcfs ignores priorities, but tenants.{name}.priority is "
                        f"{tenant.priority}: use policy priority (the default) or drop it"
                    )
        return self

    @model_validator(mode="after")
    def _check_models(self) -> AppConfig:
        if self.models is None:
            return self
        misplaced = sorted(self.model_fields_set & PER_MODEL_KEYS)
        if misplaced:
            raise ValueError(
                f"models: {', '.join(misplaced)} given at the top level next to `models`: "
                "a model's keys go in its entry of models"
            )
        if self.colocate_ingress and len(self.models) > 1:
            raise ValueError(
                f"colocate_ingress=true serves one model (its engine runs in the ingress "
                f"replica), but models lists {len(self.models)}: drop colocate_ingress"
            )
        app_wide = {k: getattr(self, k) for k in self.model_fields_set - {"models"}}
        configs = [_model_config(i, entry, app_wide) for i, entry in enumerate(self.models)]
        first_entry: dict[str, int] = {}
        for i, config in enumerate(configs):
            for name in config.served_names:
                if name in first_entry:
                    raise ValueError(
                        f"models[{i}]: served name {name!r} is also "
                        f"models[{first_entry[name]}]'s: give one of them another "
                        "served_model_name"
                    )
                first_entry[name] = i
        deployments: dict[str, int] = {}
        for i, config in enumerate(configs):
            deployment = llm_server_name(config.served_name)
            if deployment in deployments:
                other = deployments[deployment]
                raise ValueError(
                    f"models[{i}]: served name {config.served_name!r} and models[{other}]'s "
                    f"{configs[other].served_name!r} make one Serve deployment, {deployment} "
                    "('#' becomes '_'): give one of them another served_model_name"
                )
            deployments[deployment] = i
        self._model_configs = configs
        return self

    @property
    def served_names(self) -> list[str]:
        """Every name a request's `model` may give this model; the first is the one
        responses carry (and metrics label)."""
        return served_names(self.served_model_name, self.model, self.load_format)

    @property
    def served_name(self) -> str:
        """The model's name in the API: the first of served_names."""
        return self.served_names[0]

    @property
    def world_size(self) -> int:
        """Ranks of one replica's engine (engine.config.world_size)."""
        return world_size(self.tensor_parallel_size, self.pipeline_parallel_size)

    def model_configs(self) -> list[AppConfig]:
        """One single-model config per model served: the entries of `models` (each with the
        app-wide keys and its served_model_name filled in), else this config."""
        return list(self._model_configs) if self.models is not None else [self]

    def engine_args(self) -> dict[str, Any]:
        """The engine keys that were given; the engine resolves the rest."""
        given = (self.model_fields_set & ENGINE_KEYS) | {"policy"}
        return {k: getattr(self, k) for k in given}

    def with_resolved_device(self) -> AppConfig:
        """Pin `device` (cuda when the Ray cluster, or this machine, has GPUs), so that the
        placement group and the engine inside it agree."""
        if self.models is not None:
            resolved = self.model_copy()
            resolved._model_configs = [c.with_resolved_device() for c in self._model_configs]
            return resolved
        if self.device is not None:
            return self
        return self.model_copy(update={"device": "cuda" if _cluster_has_gpus() else "cpu"})

    def resolved_max_ongoing_requests(self, device: str | None = None) -> int:
        """Serve's max_ongoing_requests on `device` (default: the config's)."""
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        # The engine's own default on a large GPU; on a smaller one (256 sequences) the rest
        # wait in the engine's queue, as they would in vLLM's server.
        return 1024 if (device or self.device) == "cuda" else 256

    def tenant(self, name: str) -> TenantConfig:
        return self.tenants.get(name) or TenantConfig()

    @property
    def has_tenant_limits(self) -> bool:
        return any(t.has_limits for t in self.tenants.values())


def load_app_config(args: dict[str, Any] | None) -> AppConfig:
    """Validate app keys; ValueError naming each bad key (pydantic's own message)."""
    try:
        return AppConfig.model_validate(dict(args or {}))
    except ValidationError as e:
        raise ValueError(f"invalid kvray app config: {_problems(e)}") from None


def _problems(e: ValidationError, within: str | None = None) -> str:
    """Each error as `key: message`; keys under `within` (the whole config: `args`)."""
    problems = []
    for err in e.errors(include_url=False):
        key = ".".join(str(p) for p in err["loc"])
        if within is not None:
            key = f"{within}.{key}" if key else within
        problems.append(f"{key or 'args'}: {err['msg']}")
    return "; ".join(problems)


def _model_config(index: int, entry: dict[str, Any], app_wide: dict[str, Any]) -> AppConfig:
    """Entry `index` of `models` as a single-model AppConfig; ValueError naming the entry
    and the key."""
    for key in entry:
        if key not in PER_MODEL_KEYS:
            where = (
                "an app-wide key: set it at the top level"
                if key in AppConfig.model_fields
                else "unknown key"
            )
            raise ValueError(f"models[{index}].{key}: {where}")
    try:
        config = AppConfig.model_validate({**app_wide, **entry})
        if config.served_model_name is None:
            # Named here, so that the ingress and the engine agree on it.
            config = config.model_copy(update={"served_model_name": config.served_name})
    except ValidationError as e:
        raise ValueError(_problems(e, within=f"models[{index}]")) from None
    return config


def llm_server_name(served_name: str) -> str:
    """The LLMServer deployment of one of several models (Serve refuses '#' in names)."""
    return "LLMServer:" + served_name.replace("#", "_")


def _cluster_has_gpus() -> bool:
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()
