"""Write a CustomResourceDefinition's OpenAPI schema as this folder's JSON fixture.

    python tests/docker/schemas/extract.py CRD.yaml VERSION OUT.json [PRUNE ...]

Takes `spec.versions[name == VERSION].schema.openAPIV3Schema` of the CRD, drops `status` (a
manifest never sets it), and replaces each PRUNE path (dotted, under `properties`, e.g.
`spec.predictor.sklearn`) by an object that accepts anything, marked `x-pruned`: what the
manifests here do not use, to keep the fixture small. Everything else is kept as published.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

PRUNED = {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "x-pruned": True}


def extract(crd: dict, version: str, prune: list[str]) -> dict:
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = served["schema"]["openAPIV3Schema"]
    schema["properties"].pop("status", None)
    for path in prune:
        *parents, leaf = path.split(".")
        node = schema
        for name in parents:
            node = node["properties"][name]
        assert leaf in node["properties"], path
        node["properties"][leaf] = dict(PRUNED)
    return schema


def main() -> None:
    source, version, out, *prune = sys.argv[1:]
    crd = yaml.safe_load(Path(source).read_text())
    schema = extract(crd, version, prune)
    Path(out).write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
