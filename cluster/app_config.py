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

from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from cluster.serve_options import (
    PER_MODEL_SERVE_KEYS,
    QUEUED_PER_ONGOING_REQUEST,
    REPLICA_REQUESTS_MAX,
    ServeOptions,
    json_text,
)
from engine.arg_aliases import resolve_aliases
from engine.config import (
    PART_CONFIGS,
    SERVER_PREFILL_TOKENS_WITH_DECODES,
    EngineArgs,
    EngineConfig,
    max_default_num_seqs,
    part_field_validators,
    world_size,
)
from engine.tenants import TenantConfig, check_tenant_priorities


def _engine_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for cls in PART_CONFIGS:  # ModelConfig first: its max_model_len default wins
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


ENGINE_KEYS = frozenset(_engine_fields())

PER_MODEL_KEYS = ENGINE_KEYS | PER_MODEL_SERVE_KEYS

_AppConfigBase = create_model(
    "_AppConfigBase",
    __base__=ServeOptions,
    # The engine's checks run at start, naming the key (a generation_config folder without
    # the file, ...), not later in a replica.
    __validators__=part_field_validators(),
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

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        # The guides' names (max_batch_size, request_timeout, ...): engine/arg_aliases.py.
        return resolve_aliases(data, cls.model_fields) if isinstance(data, dict) else data

    @field_validator("models", mode="before")
    @classmethod
    def _models_json_string(cls, value: Any) -> Any:
        return json_text(value)

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _served_names_json(cls, value: Any) -> Any:
        # Several names arrive from `serve run ... served_model_name='["a", "b"]'` as text.
        return json_text(value) if isinstance(value, str) and value.startswith("[") else value

    @model_validator(mode="after")
    def _check_replica_requests(self) -> AppConfig:
        if self.models is not None:
            return self  # each entry is checked on its own
        # Before the device is known, the larger default (a GPU's).
        device = self.device or "cuda"
        ongoing = self.resolved_max_ongoing_requests(device)
        ongoing_key = "max_ongoing_requests"
        if self.max_ongoing_requests is None and self.max_num_seqs is not None:
            ongoing_key = "max_num_seqs"
        queued = self.resolved_max_queued_requests(device)
        if self.max_queued_requests is None:
            per = QUEUED_PER_ONGOING_REQUEST
            held = f"max_queued_requests (default: {per} x {ongoing_key} = {queued})"
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
        check_tenant_priorities(self.policy, self.tenants)
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
        from engine.worker.loader import served_names  # loads torch: not for --help

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

    def engine_args(self) -> EngineArgs:
        """The engine keys that were given, as the engine's arguments (its fields_set); the
        engine resolves the rest."""
        given = (self.model_fields_set & ENGINE_KEYS) | {"policy"}
        return EngineArgs(**{k: getattr(self, k) for k in given})

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
        # The replica's GPU is not known here: the engine's default on the largest GPU. On a
        # smaller one the engine runs fewer and the rest wait in its queue, as in vLLM's server.
        return max_default_num_seqs(device or self.device)

    def resolved_max_queued_requests(self, device: str | None = None) -> int:
        """Serve's max_queued_requests on `device` (default: the config's)."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return QUEUED_PER_ONGOING_REQUEST * self.resolved_max_ongoing_requests(device)

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
    try:
        entry = resolve_aliases(entry, AppConfig.model_fields)
    except ValueError as e:
        raise ValueError(f"models[{index}]: {e}") from None
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
