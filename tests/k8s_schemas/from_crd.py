"""Turn a CustomResourceDefinition's openAPIV3Schema into the JSON schema in this folder:

    python tests/k8s_schemas/from_crd.py CRD.yaml VERSION > tests/k8s_schemas/KIND.json   (needs PyYAML)

The CRD's schema is kept as it is, less its descriptions and Kubernetes' own extensions, with two
changes that make it check what the API server checks: unknown fields are errors (kubectl's strict
field validation, its default), and ``apiVersion`` and ``kind`` must name the resource.

The CRDs these came from:
  pytorchjob.json  kubeflow/training-operator 374e88af2d28d49e1c40008238f6e039b5677177,
                   manifests/base/crds/kubeflow.org_pytorchjobs.yaml, version v1 (the last release
                   line of the v1 operator; v2 replaced it with TrainJob)
  jobset.json      kubernetes-sigs/jobset 08dfbdfd682714a9ab929633eca8dc95315187e7,
                   config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml, version v1alpha2
"""

from __future__ import annotations

import json
import sys

import yaml


def strict(schema: dict) -> dict:
    out = {}
    for key, value in schema.items():
        if key == "description" or key.startswith("x-kubernetes-"):
            continue
        if key == "properties":
            value = {name: strict(child) for name, child in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = strict(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            value = [strict(child) for child in value]
        out[key] = value
    if "properties" in out and "additionalProperties" not in out and not schema.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def main(path: str, version: str) -> None:
    with open(path) as stream:
        crd = yaml.safe_load(stream)
    (served,) = [entry for entry in crd["spec"]["versions"] if entry["name"] == version]
    schema = strict(served["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": f"{crd['spec']['group']}/{version}"}
    schema["properties"]["kind"] = {"const": crd["spec"]["names"]["kind"]}
    schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "metadata", "spec"})
    json.dump({"$schema": "http://json-schema.org/draft-07/schema#", **schema}, sys.stdout, separators=(",", ":"),
              sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
