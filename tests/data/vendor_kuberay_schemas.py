"""Writes kuberay_crd_schemas.json.gz from KubeRay's CRDs (ray-operator/config/crd/bases/).

The file holds the `openAPIV3Schema` of RayCluster and RayService v1, the schema a
Kubernetes API server applies to those objects, with every `description` dropped (they
are nine tenths of the CRDs' 2 MB and change nothing a validator checks).

    python tests/data/vendor_kuberay_schemas.py PATH/TO/crd/bases
"""

import gzip
import json
import sys
from pathlib import Path

import yaml

KINDS = ("RayCluster", "RayService")
VERSION = "v1"
OUT = Path(__file__).with_name("kuberay_crd_schemas.json.gz")


def without_descriptions(node):
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def schema(crd_dir: Path, kind: str) -> dict:
    crd = yaml.safe_load((crd_dir / f"ray.io_{kind.lower()}s.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == VERSION]
    return without_descriptions(version["schema"]["openAPIV3Schema"])


def main(crd_dir: str) -> None:
    schemas = {kind: {VERSION: schema(Path(crd_dir), kind)} for kind in KINDS}
    text = json.dumps(schemas, sort_keys=True, separators=(",", ":"))
    # mtime=0: the same CRDs give the same bytes.
    OUT.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))


if __name__ == "__main__":
    main(sys.argv[1])
