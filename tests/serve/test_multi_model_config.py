"""Several models in one app: the `models` key, what it refuses, the deployments it builds,
and the single-model app left as it was. No Ray needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cluster.app_config import (
    ENGINE_KEYS,
    PER_MODEL_KEYS,
    AppConfig,
    llm_server_name,
    load_app_config,
)
from cluster.cli import parse_serve_args
from cluster.deployments import build_openai_app, llm_server_options
from cluster.serve_options import PER_MODEL_SERVE_KEYS, ServeOptions
from engine.bundled import BUNDLED_MODEL_NAME, bundled_model_path
from engine.worker.loader import default_model_name
from serve_app import build_app

ROOT = Path(__file__).resolve().parents[2]

TWO = [
    {"max_model_len": 256, "max_replicas": 2, "num_cpus": 0.5},
    {"served_model_name": "short", "max_model_len": 128, "tensor_parallel_size": 2},
]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        # Duplicate served names, given or defaulted.
        ({"models": [{}, {}]}, r"models\[1\]: served name 'SmolLM2-135M-Instruct' is also models\[0\]"),
        ({"models": [{"served_model_name": "a"}, {"model": "/m/b"}, {"served_model_name": "a"}]}, r"models\[2\]: served name 'a'"),
        ({"models": [{"model": "/m/x/Llama"}, {"model": "/other/Llama.gguf"}]}, r"served name 'Llama'"),
        ({"models": [{"served_model_name": ["a", "b"]}, {"served_model_name": ["c", "b"]}]}, r"models\[1\]: served name 'b' is also models\[0\]"),
        # Top-level model keys beside models.
        ({"models": [{}], "model": "/m/x"}, r"models: model given at the top level"),
        ({"models": [{}], "max_model_len": 256}, r"max_model_len given at the top level"),
        ({"models": [{}], "max_replicas": 2}, r"max_replicas given at the top level"),
        # Colocation of several models.
        ({"models": [{}, {"served_model_name": "b"}], "colocate_ingress": True}, "colocate_ingress"),
        # A bad key inside an entry: its index and the key.
        ({"models": [{}, {"served_model_name": "b", "tensor_parallel": 2}]}, r"models\[1\]\.tensor_parallel: unknown key"),
        ({"models": [{"tenants": {}}]}, r"models\[0\]\.tenants: an app-wide key"),
        ({"models": [{"request_timeout_s": 5}]}, r"models\[0\]\.request_timeout_s: an app-wide key"),
        ({"models": [{"ingress_max_replicas": 5}]}, r"models\[0\]\.ingress_max_replicas: an app-wide"),
        # An entry's own values and cross-checks.
        ({"models": [{}, {"served_model_name": "b", "max_model_len": -1}]}, r"models\[1\]\.max_model_len"),
        ({"models": [{"min_replicas": 3}]}, r"models\[0\]: .*max_replicas \(1\) must be >= min_replicas \(3\)"),
        ({"models": [{"enable_auto_tool_choice": True}]}, r"models\[0\]: .*tool_call_parser"),
        ({"models": [{}, 3]}, r"models\.1"),
        ({"models": []}, r"models"),
        ({"models": "[{not json"}, r"models: .*not valid JSON"),
        # Served names Serve would deploy under one name.
        ({"models": [{"served_model_name": "a#b"}, {"served_model_name": "a_b"}]}, r"models\[1\]: served name 'a_b' and models\[0\]'s 'a#b' make one Serve deployment, LLMServer:a_b"),
        ({"models": [{"policy": "fcfs"}], "tenants": {"t": {"priority": 2}}}, r"models\[0\]: .*policy fcfs ignores priorities, but tenants.t.priority is 2"),
    ],
)  # fmt: skip
def test_a_bad_models_config_fails_at_build_naming_the_key(args, named):
    with pytest.raises(ValueError, match=named):
        build_app(args)


def test_keys_are_either_per_model_or_app_wide():
    assert PER_MODEL_SERVE_KEYS <= set(ServeOptions.model_fields)
    assert PER_MODEL_KEYS == ENGINE_KEYS | PER_MODEL_SERVE_KEYS
    app_wide = set(AppConfig.model_fields) - PER_MODEL_KEYS
    assert {"api_keys", "tenants", "request_timeout_s", "max_request_body_bytes"} <= app_wide
    assert {"colocate_ingress", "ingress_max_replicas", "models"} <= app_wide
    assert {"served_model_name", "model", "max_replicas", "tool_call_parser"} <= PER_MODEL_KEYS


def test_each_entry_becomes_a_single_model_config_with_the_app_wide_keys():
    config = load_app_config(
        {"models": TWO, "request_timeout_s": 30, "tenants": {"t": {"tokens_per_minute": 9}}}
    )
    first, second = config.model_configs()
    assert (first.served_name, second.served_name) == (BUNDLED_MODEL_NAME, "short")
    assert (first.max_model_len, second.max_model_len) == (256, 128)
    assert (first.max_replicas, second.max_replicas) == (2, 1)
    for model in (first, second):
        assert model.models is None and model.request_timeout_s == 30
        assert model.tenants["t"].tokens_per_minute == 9
    # The engine is told the name the ingress routes by.
    assert first.engine_args().model_dump(exclude_unset=True) == {
        "max_model_len": 256,
        "served_model_name": BUNDLED_MODEL_NAME,
        "policy": "priority",
    }
    resolved = config.with_resolved_device().model_configs()
    assert {m.device for m in resolved} == {"cpu"} and config.model_configs()[0].device is None


def test_without_models_the_config_is_todays_single_model_one():
    config = load_app_config({"max_model_len": 256, "max_replicas": 2})
    assert config.models is None and config.model_configs() == [config]
    assert config.engine_args().model_dump(exclude_unset=True) == {
        "max_model_len": 256,
        "policy": "priority",
    }
    assert config.served_name == BUNDLED_MODEL_NAME
    ingress = build_openai_app(config)._bound_deployment
    server = ingress.init_args[0]._bound_deployment
    assert server.name == "LLMServer"  # one deployment, under its old name
    assert server._deployment_config.autoscaling_config.max_replicas == 2


def test_one_llm_server_deployment_per_model_with_its_own_scaling_and_placement():
    config = load_app_config({"models": TWO, "ingress_max_replicas": 3})
    ingress = build_openai_app(config)._bound_deployment
    assert ingress.name == "OpenAIIngress"
    assert ingress._deployment_config.autoscaling_config.max_replicas == 3
    servers = ingress.init_args[0]
    assert list(servers) == [BUNDLED_MODEL_NAME, "short"]
    first, second = (servers[name]._bound_deployment for name in servers)
    assert (first.name, second.name) == (llm_server_name(BUNDLED_MODEL_NAME), "LLMServer:short")
    assert first._deployment_config.autoscaling_config.max_replicas == 2
    assert second._deployment_config.autoscaling_config.max_replicas == 1
    assert first._replica_config.placement_group_bundles == [{"CPU": 0.5}]
    assert second._replica_config.placement_group_bundles == [{"CPU": 0.25}] * 2
    assert first.init_args[0].max_model_len == 256 and second.init_args[0].max_model_len == 128
    ingress_config = ingress.init_args[1]
    assert [m.served_name for m in ingress_config.model_configs()] == list(servers)


def test_one_entry_of_models_may_be_colocated():
    config = load_app_config(
        {"models": [{"served_model_name": "solo", "max_replicas": 3}], "colocate_ingress": True}
    )
    ingress = build_openai_app(config)._bound_deployment
    assert ingress.init_args[0] is None
    model = ingress.init_args[1]
    assert model.served_name == "solo" and model.colocate_ingress
    expected = llm_server_options(model)
    assert ingress._deployment_config.autoscaling_config.max_replicas == 3
    assert ingress._replica_config.placement_group_bundles == expected["placement_group_bundles"]


def test_llm_server_names_are_valid_serve_names():
    assert llm_server_name("team/model#2") == "LLMServer:team/model_2"


def test_served_names_that_pass_get_a_deployment_each():
    names = ["a#b", "a/b", "a:b", "a b", "A_b"]
    config = load_app_config({"models": [{"served_model_name": name} for name in names]})
    servers = build_openai_app(config)._bound_deployment.init_args[0]
    deployments = [servers[name]._bound_deployment.name for name in names]
    assert deployments == [llm_server_name(name) for name in names]
    assert len(set(deployments)) == len(names)


def test_default_served_names_read_no_file_and_match_the_engines():
    assert default_model_name(None) == BUNDLED_MODEL_NAME
    assert default_model_name(str(bundled_model_path())) == BUNDLED_MODEL_NAME
    assert default_model_name("/models/Llama-3.1-8B/") == "Llama-3.1-8B"
    assert default_model_name("~/w/qwen.Q4.gguf") == "qwen.Q4"
    assert default_model_name("llama3-8b", "dummy") == "llama3-8b"


def test_every_example_serve_config_validates():
    examples = sorted(ROOT.glob("serve_config*.yaml"))
    assert {p.name for p in examples} >= {"serve_config.yaml", "serve_config_multi.yaml"}
    for path in examples:
        app = yaml.safe_load(path.read_text())["applications"][0]
        assert app["import_path"] == "serve_app:build_app"
        config = load_app_config(app["args"])
        build_openai_app(config)
    multi = load_app_config(
        yaml.safe_load((ROOT / "serve_config_multi.yaml").read_text())["applications"][0]["args"]
    )
    names = [m.served_name for m in multi.model_configs()]
    assert names == [BUNDLED_MODEL_NAME, "smollm2-short"]


def test_kvray_serve_takes_models_as_json():
    config, _ = parse_serve_args(
        ["serve", "--models", json.dumps(TWO), "--ingress-max-replicas", "1"]
    )
    assert [m.served_name for m in config.model_configs()] == [BUNDLED_MODEL_NAME, "short"]
    assert config == load_app_config({"models": TWO, "ingress_max_replicas": 1})


def test_kvray_serve_refuses_a_model_argument_beside_models(capsys):
    with pytest.raises(SystemExit):
        parse_serve_args(["serve", "/models/llama", "--models", json.dumps(TWO)])
    assert "model given at the top level" in capsys.readouterr().err
