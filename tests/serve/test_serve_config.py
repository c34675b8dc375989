"""App keys, the `kvray` command, deployment options and tenants: no Ray needed."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster.app_config import ENGINE_KEYS, AppConfig, load_app_config
from cluster.cli import build_parser, parse_serve_args
from cluster.deployments import build_openai_app, llm_server_options
from cluster.engine_host import engine_args
from cluster.executor import RayActorGroupExecutor
from cluster.local_server import colocated_capacity
from cluster.tenants import TenantResolver
from cluster.topology import DIRECT_INGRESS_ENV, SERVE_FAST_PATH_ENV, node_env
from engine.api.errors import APIError
from engine.config import (
    RUNNER_ARGS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine.tenants import TenantConfig, TenantLimiter
from serve_app import build_app

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"tensor_parallel": 2}, "tensor_parallel"),
        ({"max_replicas": 0}, "max_replicas"),
        ({"prefill_cuda_graph_tokens": "-5"}, "prefill_cuda_graph_tokens"),
        ({"min_replicas": 2}, "max_replicas"),
        ({"min_replicas": 1, "max_replicas": 2, "initial_replicas": 3}, "initial_replicas"),
        ({"block_size": "big"}, "block_size"),
        ({"tool_call_parser": "qwen9"}, "tool_call_parser"),
        ({"enable_auto_tool_choice": True}, "tool_call_parser"),
        ({"reasoning_parser": "granite"}, "reasoning_parser"),
        ({"chat_template": "/no/such/template.jinja"}, "chat_template: no such file"),
        (
            {"chat_template": "{% for m in messages %}{{ m.content }}"},
            "chat_template: the template does not compile",
        ),
        (
            {"default_chat_template_kwargs": '{"tools": []}'},
            "default_chat_template_kwargs.tools cannot be set",
        ),
        ({"dtype": "float64"}, "dtype"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype: Input should be 'auto' or 'fp8'"),
        ({"quantization": "int3"}, "quantization: Input should be 'auto', 'none', 'fp8'"),
        ({"tenants": {"a": {"priorty": 1}}}, "priorty"),
        ({"api_keys": "{not json"}, "api_keys"),
        ({"served_model_name": []}, "served_model_name: .*at least one name"),
        ({"served_model_name": '["a", "a"]'}, "served_model_name: .*names one model twice"),
        ({"served_model_name": ["a", ""]}, "served_model_name: .*must not be empty"),
        ({"generation_config": "VLLM"}, "generation_config: .*'VLLM' has no"),
        ({"generation_config": ""}, "generation_config: .*'' has no"),
        ({"generation_config": "/no/such/dir"}, "generation_config: .*'/no/such/dir' has no"),
        ({"max_replicas": 2**32}, "max_replicas: .*less than or equal to 2147483647"),
        ({"initial_replicas": 2**31}, "initial_replicas: .*less than or equal to 2147483647"),
        ({"max_queued_requests": 2**31}, "max_queued_requests: .*less than or equal"),
        ({"ingress_max_replicas": 2**31}, "ingress_max_replicas: .*less than or equal"),
        ({"ingress_max_ongoing_requests": 10**12}, "ingress_max_ongoing_requests: .*less than"),
        ({"max_ongoing_requests": 10**12}, "max_ongoing_requests: .*less than or equal"),
        (
            {"max_ongoing_requests": 2**28 + 1},
            r"max_ongoing_requests \(268435457\) \+ max_queued_requests \(default: 4 x ",
        ),
        ({"max_num_seqs": 2**29}, r"max_num_seqs \(536870912\) \+ max_queued_requests \(def"),
        (
            {"max_ongoing_requests": 2**29, "max_queued_requests": 2**30},
            r"max_ongoing_requests \(536870912\) \+ max_queued_requests \(1073741824\)",
        ),
        ({"num_cpus": "inf"}, "num_cpus: Input should be a finite number"),
        ({"ingress_num_cpus": float("inf")}, "ingress_num_cpus: Input should be a finite"),
        ({"request_timeout_s": "inf"}, "request_timeout_s: Input should be a finite"),
        ({"target_ongoing_requests": "nan"}, "target_ongoing_requests: .*finite"),
        ({"look_back_period_s": "inf"}, "look_back_period_s: Input should be a finite"),
        ({"downscale_delay_s": "inf"}, "downscale_delay_s: Input should be a finite"),
        ({"cpu_kv_cache_gib": "inf"}, "cpu_kv_cache_gib: Input should be a finite"),
        ({"tenants": {"t": {"request_timeout_s": "inf"}}}, "tenants.t.request_timeout_s: .*finite"),
        ({"api_keys": {"": "t"}}, "api_keys: .*the key of tenant 't' is empty"),
        ({"api_keys": {"sk-1 ": "t"}}, "api_keys: .*tenant 't' starts or ends with whitespace"),
        ({"api_keys": {"sk-\u00e9": "t"}}, "api_keys: .*tenant 't' is not printable ASCII"),
        ({"api_keys": {"sk-\t1": "t"}}, "api_keys: .*tenant 't' is not printable ASCII"),
        (
            {"api_keys": {"k1": "team-a", "k2": "team-b"}, "tenants": {"team_a": {"priority": 1}}},
            "tenants: no API key maps to 'team_a' \\(api_keys map to 'team-a', 'team-b'\\)",
        ),
        ({"tenants": {"": {"priority": 1}}}, "tenants: the name '' is empty: without api_keys"),
        ({"tenants": {"t\u00eb": {}}}, "tenants: the name 't\u00eb' is not printable ASCII"),
        ({"tenants": {" t": {}}}, "tenants: the name ' t' starts or ends with whitespace"),
        ({"api_keys": '{"k": "a", "k": "b"}'}, "api_keys: .*'k' is given twice"),
        ({"tenants": '{"a": {"priority": 1, "priority": 2}}'}, "tenants: .*'priority' is given"),
        (
            {"default_chat_template_kwargs": '{"x": 1, "x": 2}'},
            "default_chat_template_kwargs: .*'x'",
        ),
        (
            {"models": '[{"max_model_len": 64, "max_model_len": 99}]'},
            "models: .*'max_model_len' is",
        ),
        (
            {"policy": "fcfs", "tenants": {"t": {"priority": 1}}},
            "policy fcfs ignores priorities, but tenants.t.priority is 1",
        ),
        (
            {"target_ongoing_requests": 9, "max_ongoing_requests": 8, "max_queued_requests": 0},
            r"target_ongoing_requests \(9\) is not below .* max_ongoing_requests \(8\) \+ max_q",
        ),
        (
            {"target_ongoing_requests": 16, "max_num_seqs": 16, "max_queued_requests": 0},
            r"target_ongoing_requests \(16\) .* max_num_seqs \(16\) .* never add a replica",
        ),
        (
            {"target_ongoing_requests": 40, "max_ongoing_requests": 8, "colocate_ingress": True},
            r"target_ongoing_requests \(40\) .*\(default: 4 x max_ongoing_requests = 32\)",
        ),
    ],
)
def test_a_bad_key_or_value_fails_at_build_naming_it(args, named):
    with pytest.raises(ValueError, match=named):
        build_app(args)


def test_every_engine_argument_is_an_app_key():
    engine_fields = set().union(
        *(cls.model_fields for cls in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig))
    )
    assert engine_fields | set(RUNNER_ARGS) == set(ENGINE_KEYS)
    config = load_app_config({"max_model_len": "256", "enable_prefix_caching": "false"})
    # Batch limits left out go unset: the engine sizes them for its GPU.
    assert config.engine_args().model_dump(exclude_unset=True) == {
        "max_model_len": 256,
        "enable_prefix_caching": False,
        "policy": "priority",
    }


def test_every_engine_validator_runs_at_start():
    """A check the engine configs make on a key is made by AppConfig too, so that a bad value
    fails at start naming the key, not later in a replica."""
    app_validators = {
        (d.func.__func__, d.info.fields, d.info.mode)
        for d in AppConfig.__pydantic_decorators__.field_validators.values()
    }
    for cls in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig):
        assert not cls.__pydantic_decorators__.model_validators, cls
        for d in cls.__pydantic_decorators__.field_validators.values():
            assert (d.func.__func__, d.info.fields, d.info.mode) in app_validators, d.cls_var_name
    # EngineConfig's own keys (device, enforce_eager, ...) are checked by their types alone.
    for d in EngineConfig.__pydantic_decorators__.field_validators.values():
        assert not set(d.info.fields) & set(RUNNER_ARGS), d.cls_var_name
    assert load_app_config({"generation_config": "vllm"}).generation_config == "vllm"


def test_serve_config_yaml_args_validate():
    spec = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = spec["applications"][0]
    assert app["import_path"] == "serve_app:build_app"
    config = load_app_config(app["args"])
    assert config.tenants["team-b"].priority == 1


def test_kvray_serve_help_lists_every_key_with_its_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    # After the usage line each flag has an entry (bools as "--x, --no-x") ending in its default.
    options = re.sub(r", --no-[\w-]+", "", help_text.split("options:", 1)[1])
    entries = {e.split(" ", 1)[0]: e for e in options.split(" --")}
    for name in AppConfig.model_fields:
        assert "(default: " in entries[name.replace("_", "-")], name
    assert "--max-num-seqs VALUE picked by the engine: 1024 on a 70 GiB+ GPU" in help_text
    assert "--request-timeout-s VALUE A request still running" in help_text


def test_kvray_serve_flags_build_the_same_config():
    config, args = parse_serve_args(
        [
            "serve", "/models/llama", "--tensor-parallel-size", "2", "--max-replicas", "4",
            "--no-enable-prefix-caching", "--api-keys", '{"sk-1": "team"}', "--port", "9000",
        ]
    )  # fmt: skip
    assert config == load_app_config(
        {
            "model": "/models/llama",
            "tensor_parallel_size": 2,
            "max_replicas": 4,
            "enable_prefix_caching": False,
            "api_keys": {"sk-1": "team"},
        }
    )
    assert args.port == 9000


def test_the_kv_cache_dtype_flag_reaches_the_engine_arguments():
    config, _ = parse_serve_args(["serve", "--kv-cache-dtype", "fp8"])
    assert engine_args(config).kv_cache_dtype == "fp8"
    assert engine_args(load_app_config({})).kv_cache_dtype == "auto"


def test_the_swap_flags_reach_the_engine_arguments_and_bad_values_name_the_key():
    config, _ = parse_serve_args(["serve", "--swap-space", "4", "--preemption-mode", "auto"])
    args = engine_args(config)
    assert (args.swap_space, args.preemption_mode) == (4.0, "auto")
    assert engine_args(load_app_config({})).swap_space == 0
    with pytest.raises(ValueError, match="swap_space"):
        load_app_config({"swap_space": -1})
    with pytest.raises(ValueError, match="preemption_mode: Input should be 'recompute', 'swap'"):
        load_app_config({"preemption_mode": "drop"})


def test_several_served_names_come_as_vllms_flag_or_as_json_text():
    config, _ = parse_serve_args(["serve", "--served-model-name", "main", "alias"])
    assert config.served_names == ["main", "alias"] and config.served_name == "main"
    single, _ = parse_serve_args(["serve", "--served-model-name", "main"])
    assert single.served_model_name == "main" and single.served_names == ["main"]
    from_text = load_app_config({"served_model_name": '["main", "alias"]'})
    assert from_text.served_model_name == ["main", "alias"]
    assert load_app_config({}).served_names == ["SmolLM2-135M-Instruct"]


def test_tool_call_keys_are_vllms_flags_and_name_the_servings_parsers():
    from engine.api.tool_parsers import TOOL_CALL_PARSERS

    config, _ = parse_serve_args(
        ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    )
    assert (config.enable_auto_tool_choice, config.tool_call_parser) == (True, "llama3_json")
    assert "enable_auto_tool_choice" not in config.engine_args().model_fields_set
    plain = load_app_config({})
    assert (plain.enable_auto_tool_choice, plain.tool_call_parser) == (False, None)
    for name in TOOL_CALL_PARSERS:
        assert load_app_config({"tool_call_parser": name}).tool_call_parser == name
    with pytest.raises(ValueError, match="tool_call_parser"):
        load_app_config({"tool_call_parser": "granite"})


def test_reasoning_and_template_keys_are_vllms_flags_and_reach_the_serving(tmp_path):
    from engine.api.reasoning_parsers import REASONING_PARSERS

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    config, _ = parse_serve_args(
        ["serve", "--reasoning-parser", "qwen3", "--chat-template", str(template),
         "--default-chat-template-kwargs", '{"enable_thinking": false}']
    )  # fmt: skip
    assert config.reasoning_parser == "qwen3"
    assert config.chat_template == template.read_text()  # the text travels, not the path
    assert config.default_chat_template_kwargs == {"enable_thinking": False}
    assert not {"reasoning_parser", "chat_template"} & config.engine_args().model_fields_set
    assert set(AppConfig.model_fields["reasoning_parser"].annotation.__args__[0].__args__) == set(
        REASONING_PARSERS
    )
    inline = load_app_config({"chat_template": "{{ messages[0].content }}"})
    assert inline.chat_template == "{{ messages[0].content }}"


def test_kvray_serve_rejects_a_bad_value_naming_it(capsys):
    with pytest.raises(SystemExit):
        parse_serve_args(["serve", "--max-num-seqs", "-1"])
    assert "max_num_seqs" in capsys.readouterr().err


def test_kvray_serve_takes_none_for_keys_that_may_be_unset():
    config, _ = parse_serve_args(["serve", "--request-timeout-s", "none", "--max-num-seqs", "8"])
    assert (config.request_timeout_s, config.max_num_seqs) == (None, 8)
    config, _ = parse_serve_args(["serve", "--max-num-seqs", "null", "--device", "None"])
    assert (config.max_num_seqs, config.device) == (None, None)
    assert config == load_app_config({"max_num_seqs": None, "device": None})


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--max-replicas", "none"], "max_replicas"),
        (["/models/a", "--model", "/models/b"], "as MODEL or as --model, not both"),
        (["/models/a", "--model", "/models/a"], "as MODEL or as --model, not both"),
        (["--tenant", "{}"], "unrecognized arguments: --tenant"),
        (["--max-rep", "4"], "unrecognized arguments: --max-rep"),
        (["--port", "99999"], "argument --port: '99999' is not a TCP port"),
        (["--port", "0"], "argument --port: '0' is not a TCP port"),
        (["--port", "-1"], "argument --port: '-1' is not a TCP port"),
        (["--port", "80x"], "argument --port: '80x' is not a TCP port"),
    ],
)
def test_kvray_serve_refuses_an_unclear_command_line(argv, error, capsys):
    with pytest.raises(SystemExit):
        parse_serve_args(["serve", *argv])
    assert error in capsys.readouterr().err
    _, args = parse_serve_args(["serve", "--port", "65535"])
    assert args.port == 65535


def test_a_group_of_ranks_gets_the_ray_actor_group_as_its_executor():
    def backend(**args):
        given = engine_args(load_app_config(args)).model_dump(exclude_unset=True)
        return given.get("distributed_executor_backend", "unset")

    assert backend() == "unset"  # one rank: the engine runs it in process
    assert backend(tensor_parallel_size=2) is RayActorGroupExecutor
    assert backend(pipeline_parallel_size=2, distributed_executor_backend="ray") is (
        RayActorGroupExecutor
    )
    assert backend(distributed_executor_backend="ray") is RayActorGroupExecutor
    assert backend(distributed_executor_backend="uni") == "uni"


def test_placement_bundles_follow_the_parallel_config():
    cpu = llm_server_options(
        load_app_config({"device": "cpu", "tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    )
    assert cpu["placement_group_bundles"] == [{"CPU": 0.25}] * 4
    assert cpu["placement_group_strategy"] == "PACK"
    assert (cpu["ray_actor_options"]["num_cpus"], cpu["ray_actor_options"]["num_gpus"]) == (0.25, 0)

    gpu = llm_server_options(load_app_config({"device": "cuda", "tensor_parallel_size": 2}))
    assert gpu["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert gpu["placement_group_strategy"] == "STRICT_PACK"
    assert gpu["ray_actor_options"]["num_gpus"] == 0.0  # the ranks own the GPUs

    one = llm_server_options(load_app_config({"device": "cuda"}))
    assert one["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}]
    assert one["ray_actor_options"]["num_gpus"] == 1.0
    # As many requests as the engine runs at once on a large GPU (not 256: a 500-request
    # burst then ran in two waves).
    assert one["max_ongoing_requests"] == 1024


def test_autoscaling_defaults_scale_before_the_engine_is_full():
    options = llm_server_options(
        load_app_config({"device": "cpu", "max_num_seqs": 64, "max_replicas": 3})
    )
    auto = options["autoscaling_config"]
    assert options["max_ongoing_requests"] == 64
    assert auto["target_ongoing_requests"] == 32
    assert (auto["min_replicas"], auto["max_replicas"]) == (1, 3)
    assert options["max_queued_requests"] == 4 * 64
    explicit = llm_server_options(
        load_app_config({"device": "cpu", "target_ongoing_requests": 5, "max_queued_requests": 0})
    )
    assert explicit["autoscaling_config"]["target_ongoing_requests"] == 5
    assert explicit["max_queued_requests"] == 0


def test_the_largest_request_bounds_fit_serves_32_bit_ints():
    edge = {"max_ongoing_requests": 2**28, "max_queued_requests": 3 * 2**28, "device": "cpu"}
    options = llm_server_options(load_app_config({**edge, "max_replicas": 2**31 - 1}))
    assert (options["max_ongoing_requests"], options["max_queued_requests"]) == (2**28, 3 * 2**28)
    assert options["autoscaling_config"]["max_replicas"] == 2**31 - 1
    colocated = load_app_config({**edge, "colocate_ingress": True})
    ingress = build_openai_app(colocated)._bound_deployment
    assert 2**30 < ingress._deployment_config.max_ongoing_requests <= 2**31 - 1
    default_queue = llm_server_options(load_app_config({"max_num_seqs": 2**30 // 5}))
    assert default_queue["max_queued_requests"] == 4 * (2**30 // 5)


def test_api_keys_and_tenant_names_a_request_can_give_are_accepted():
    keyed = load_app_config(
        {"api_keys": '{"sk a-1": "team a", "sk-2": "b"}', "tenants": {"team a": {"priority": 1}}}
    )
    resolver = TenantResolver(keyed.api_keys, keyed.tenants)
    tenant = resolver.resolve({"authorization": "Bearer sk a-1"})
    assert (tenant.name, tenant.config.priority) == ("team a", 1)
    with pytest.raises(APIError):
        resolver.resolve({"authorization": "Bearer "})
    named = load_app_config({"tenants": {"default": {"priority": 2}, "team-b": {}}})
    assert TenantResolver({}, named.tenants).resolve({}).config.priority == 2


def test_a_target_the_autoscaler_can_reach_is_accepted():
    # Requests queued for a replica count too: past max_ongoing_requests it scales on queues.
    queued = load_app_config({"target_ongoing_requests": 9, "max_ongoing_requests": 8})
    assert llm_server_options(queued)["autoscaling_config"]["target_ongoing_requests"] == 9
    colocated = {"max_ongoing_requests": 8, "colocate_ingress": True}
    assert load_app_config({**colocated, "target_ongoing_requests": 39.5}).colocate_ingress
    fcfs = load_app_config({"policy": "fcfs", "tenants": {"t": {"max_concurrent_requests": 2}}})
    assert fcfs.engine_args().policy == "fcfs"


def test_tenant_from_api_key_or_header():
    keyed = TenantResolver({"sk-a": "alice"}, {"alice": TenantConfig(priority=3)})
    alice = keyed.resolve({"authorization": "Bearer sk-a", "x-tenant-id": "mallory"})
    assert (alice.name, alice.config.priority, alice.cache_salt) == ("alice", 3, "alice")
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "sk-a"}):
        with pytest.raises(APIError) as info:
            keyed.resolve(headers)
        assert info.value.status_code == 401

    open_ = TenantResolver({}, {"bob": TenantConfig(cache_salt="shared")})
    assert open_.resolve({"x-tenant-id": "bob"}).cache_salt == "shared"
    assert open_.resolve({}).name == "default"


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_limiter_concurrency_and_lease_expiry():
    clock = _Clock()
    limiter = TenantLimiter(
        {"a": TenantConfig(max_concurrent_requests=2)}, request_timeout_s=30, clock=clock
    )
    first, second = limiter.acquire("a"), limiter.acquire("a")
    refused = limiter.acquire("a")
    assert first.lease_id and second.lease_id and refused.lease_id is None
    assert refused.retry_after_s > 0 and "'a'" in refused.reason
    assert limiter.acquire("other").lease_id is not None  # no limits for unlisted tenants
    limiter.release(first.lease_id)
    assert limiter.acquire("a").lease_id is not None
    clock.now += 89  # still within the time limit's minute of grace
    assert limiter.acquire("a").lease_id is None
    clock.now += 2  # an ingress that died without releasing loses its leases
    assert limiter.acquire("a").lease_id is not None


def test_a_lease_lives_as_long_as_its_tenants_own_time_limit():
    clock = _Clock()
    tenants = {"slow": TenantConfig(max_concurrent_requests=1, request_timeout_s=3600)}
    limiter = TenantLimiter(tenants, request_timeout_s=10, clock=clock)
    assert limiter.acquire("slow").lease_id is not None
    clock.now += 600  # the app's limit and its grace are long past; the tenant's is not
    assert limiter.acquire("slow").lease_id is None
    clock.now += 3600
    assert limiter.acquire("slow").lease_id is not None


def test_limiter_tokens_per_minute_window():
    clock = _Clock()
    limiter = TenantLimiter({"a": TenantConfig(tokens_per_minute=100)}, clock=clock)
    limiter.release(limiter.acquire("a").lease_id, tokens=60)
    clock.now += 20
    limiter.release(limiter.acquire("a").lease_id, tokens=50)
    refused = limiter.acquire("a")
    assert refused.lease_id is None
    # Under the limit again once the first 60 tokens leave the window, 40 s from now.
    assert refused.retry_after_s == pytest.approx(40)
    clock.now += 40
    assert limiter.acquire("a").lease_id is not None


def test_every_deployment_and_node_runs_serves_grpc_fast_path():
    config = load_app_config({"device": "cpu", "tenants": {"a": {"max_concurrent_requests": 1}}})
    app = build_openai_app(config)
    ingress = app._bound_deployment
    limiter = ingress.init_args[2]._bound_deployment
    server = ingress.init_args[0]._bound_deployment
    for deployment in (ingress, limiter, server):
        options = deployment.ray_actor_options
        assert options["runtime_env"]["env_vars"] == SERVE_FAST_PATH_ENV, deployment.name
    assert SERVE_FAST_PATH_ENV.items() <= node_env().items()
    # Direct ingress is the nodes' choice (off by default): replicas that turned it on by
    # themselves would disagree with a controller started without it.
    assert not DIRECT_INGRESS_ENV.keys() & SERVE_FAST_PATH_ENV.keys()


def test_direct_ingress_runs_haproxy_without_splicing(monkeypatch):
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    assert "RAY_SERVE_HAPROXY_BINARY_PATH" not in node_env()
    # Turning direct ingress on is enough: kvray's launchers add the rest.
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    env = node_env()
    assert DIRECT_INGRESS_ENV.items() <= env.items()
    wrapper = env["RAY_SERVE_HAPROXY_BINARY_PATH"]
    assert os.access(wrapper, os.X_OK)  # Serve starts it only if it is executable
    version = subprocess.run([wrapper, "-v"], env=env, capture_output=True, text=True)
    assert version.returncode == 0 and "HAProxy version" in version.stdout


def test_haproxy_busy_polling_is_a_global_setting_haproxy_accepts(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    env = {**node_env(), "TMPDIR": str(tmp_path)}
    config = tmp_path / "serve.cfg"
    config.write_text(
        "global\n    nbthread 1\ndefaults\n    mode http\n"
        "frontend f\n    bind 127.0.0.1:18999\n    http-request return status 200\n"
    )
    check = [env["RAY_SERVE_HAPROXY_BINARY_PATH"], "-c", "-f", str(config)]
    plain = subprocess.run(check, env=env, capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    assert not (tmp_path / "kvray-haproxy-busy-polling.cfg").exists()
    busy = subprocess.run(
        check, env={**env, "KVRAY_HAPROXY_BUSY_POLLING": "1"}, capture_output=True, text=True
    )
    assert busy.returncode == 0, busy.stderr  # a directive HAProxy did not know would fail
    extra = (tmp_path / "kvray-haproxy-busy-polling.cfg").read_text().split()
    assert extra == ["global", "busy-polling"]


def test_colocated_ingress_takes_the_engine_replicas_options():
    config = load_app_config({"device": "cpu", "colocate_ingress": True, "max_replicas": 3})
    ingress = build_openai_app(config)._bound_deployment
    assert ingress.name == "OpenAIIngress"
    assert ingress.init_args[0] is None  # no LLMServer handle: the replica builds the engine
    expected = llm_server_options(config.with_resolved_device())
    assert ingress._deployment_config.autoscaling_config.max_replicas == 3
    assert ingress._replica_config.placement_group_bundles == expected["placement_group_bundles"]
    # The replica bounds its requests itself (OpenAI's 429); Serve's bound sits above it.
    capacity = colocated_capacity(config)
    assert capacity == 5 * expected["max_ongoing_requests"]  # running + 4x as many waiting
    assert ingress._deployment_config.max_ongoing_requests > capacity
    assert ingress._deployment_config.max_queued_requests == -1


def test_the_quantization_flag_and_key_reach_the_engine_arguments():
    config, _ = parse_serve_args(["serve", "--quantization", "fp8"])
    assert engine_args(config).quantization == "fp8"
    assert engine_args(load_app_config({"quantization": "awq"})).quantization == "awq"
    assert engine_args(load_app_config({})).quantization == "auto"


def test_kvray_serve_grpc_port_starts_serve_with_the_grpc_api(monkeypatch, capsys):
    import ray
    from ray import serve

    import cluster.deployments
    import cluster.topology
    from cluster.cli import main
    from cluster.grpc_api.serve_setup import grpc_options

    started = {}
    monkeypatch.setattr(cluster.topology, "use_serve_fast_path", lambda: None)
    monkeypatch.setattr(ray, "init", lambda **_: None)
    monkeypatch.setattr(serve, "start", lambda **options: started.update(options))
    monkeypatch.setattr(serve, "run", lambda *_, **__: None)
    monkeypatch.setattr(cluster.deployments, "build_openai_app", lambda config: None)
    assert main(["serve", "--grpc-port", "9100"]) == 0
    assert started["grpc_options"] == grpc_options(9100)
    assert "gRPC (kvray.v1.InferenceService) on port 9100" in capsys.readouterr().out
    assert main(["serve"]) == 0
    assert started["grpc_options"] is None
    with pytest.raises(SystemExit):
        parse_serve_args(["serve", "--grpc-port", "70000"])


def test_routing_key_and_flag_set_llm_servers_request_router_where_replicas_may_be_several():
    from cluster.prefix_router import PrefixAffinityRouter

    def router(config):
        return llm_server_options(config).get("request_router_config")

    assert load_app_config({}).routing == "prefix_affinity"
    assert router(load_app_config({})) is None  # one replica: Serve's default
    several = router(load_app_config({"max_replicas": 3, "routing_load_factor": 2}))
    assert several.get_request_router_class().__name__ == PrefixAffinityRouter.__name__
    assert several.request_router_kwargs["load_factor"] == 2
    assert several.request_router_kwargs["block_size"] == 16
    config, _ = parse_serve_args(["serve", "--max-replicas", "2", "--routing", "power_of_two"])
    assert config.routing == "power_of_two" and router(config) is None
    colocated = {"max_replicas": 2, "colocate_ingress": True}
    assert not load_app_config(colocated).prefix_affinity
    models = load_app_config(
        {
            "models": [
                {"served_model_name": "a", "max_replicas": 2},
                {"served_model_name": "b", "max_replicas": 2, "routing": "power_of_two"},
            ]
        }
    ).model_configs()
    assert [m.prefix_affinity for m in models] == [True, False]
    with pytest.raises(ValueError, match="routing"):
        load_app_config({"routing": "round_robin"})
    with pytest.raises(ValueError, match="routing_load_factor"):
        load_app_config({"routing_load_factor": 0.5})
