"""Generate the RLJob CustomResourceDefinition from the pydantic models (`make crds`).

The models are the single source of truth; this module only translates JSON Schema into the
structural OpenAPI v3 subset the API server accepts (no $ref, no anyOf-null, no additionalProperties
beside properties, map values typed through additionalProperties, Kubernetes list/CEL extensions kept)."""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema, to_jsonable_python

from rljob.api.spec import ENGINE_DEFAULTED, NAME_RULES, RLJobSpec
from rljob.api.status import RLJobStatus

GROUP = "rljob.io"
VERSION = "v1alpha1"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]
CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILE = f"crds/{GROUP}_{PLURAL}.yaml"

# Printer columns: what `kubectl get rljob` shows (priority 1 = only with -o wide).
PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Iteration", "type": "integer", "jsonPath": ".status.iteration"},
    {"name": "Weights", "type": "string", "jsonPath": ".status.weightVersion"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
    {"name": "Engine", "type": "string", "jsonPath": ".spec.engine"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Rollout%", "type": "integer", "jsonPath": ".status.profile.rolloutPercent", "priority": 1},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "priority": 1},
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1},
]

# propertyNames / patternProperties: pydantic's constraints on dict keys; the API server has no such schema.
_DROP = {
    "title",
    "$defs",
    "additionalProperties",
    "const",
    "discriminator",
    "examples",
    "propertyNames",
    "patternProperties",
}


class _WithFactoryDefaults(GenerateJsonSchema):
    """Also emit defaults produced by default_factory, so the API server defaults nested objects too."""

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        if "default_factory" in schema and "default" not in schema:
            inner = self.generate_inner(schema["schema"])
            factory: Any = schema["default_factory"]
            try:
                value = factory()
            except TypeError:  # factories taking validated data: no static default
                return inner
            dumped = (
                value.model_dump(mode="json", by_alias=True, exclude_none=True)
                if hasattr(value, "model_dump")
                else to_jsonable_python(value)
            )
            return {**inner, "default": dumped}
        return super().default_schema(schema)


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        # A field's own validations/description win over the referenced model's, and both CEL lists merge.
        rules = target.get("x-kubernetes-validations", []) + extra.pop("x-kubernetes-validations", [])
        merged = {**target, **extra}
        if rules:
            merged["x-kubernetes-validations"] = rules
        return _resolve(merged, defs)
    return {k: _resolve(v, defs) for k, v in node.items()}


def _structural(node: Any) -> Any:
    if isinstance(node, list):
        return [_structural(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    any_of = node.get("anyOf")
    if any_of is not None:
        non_null = [s for s in any_of if s.get("type") != "null"]
        if len(non_null) == 1:  # Optional[X]: unset means absent in Kubernetes
            node = {**{k: v for k, v in node.items() if k != "anyOf"}, **non_null[0]}
            if node.get("default", 0) is None:
                node.pop("default")
    preserve = node.get("additionalProperties") is True
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {k: _structural(v) for k, v in value.items()}
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[bound] = value
            out[key] = True
        elif key == "description":
            out[key] = " ".join(str(value).split())
        else:
            out[key] = _structural(value)
    values = _map_values(node)
    if values is not None:  # the API server cannot check a map's keys by schema, but checks every value
        out["additionalProperties"] = _structural(values)
    if preserve:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _map_values(node: dict[str, Any]) -> dict[str, Any] | None:
    """The value schema of a dict[K, V] (pydantic writes patternProperties when K has a pattern)."""
    if "properties" in node:
        return None
    patterns = node.get("patternProperties")
    values = next(iter(patterns.values())) if isinstance(patterns, dict) and len(patterns) == 1 else None
    values = values or node.get("additionalProperties")
    return values if isinstance(values, dict) and values else None


def openapi_schema(model: type[Any]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, schema_generator=_WithFactoryDefaults)
    return dict(_structural(_resolve(raw, raw.get("$defs", {}))))


def build_crd() -> dict[str, Any]:
    spec = openapi_schema(RLJobSpec)
    spec.pop("default", None)
    _engine_defaulted(spec)
    status = openapi_schema(RLJobStatus)
    status.pop("default", None)
    _strip_defaults(status)  # the controller writes status; API-server defaulting would only hide bugs
    schema = {
        "type": "object",
        "description": "RL post-training job: rollout on an inference engine and training sharing a gang of "
        "GPU pods.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # Only name (and generateName) may be declared here; the bound keeps NAME_RULES' CEL cheap
            # (253: a DNS subdomain, what the API server allows anyway).
            "metadata": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 253}}},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": NAME_RULES,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["all", "rljob"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def _engine_defaulted(spec: dict[str, Any]) -> None:
    """No static default where the engine's applies (the models fill it in; CEL reads it per engine)."""
    for part, name in ENGINE_DEFAULTED:
        schema = spec["properties"][part]
        schema["properties"][name].pop("default", None)
        schema.get("default", {}).pop(name, None)


def _strip_defaults(node: Any) -> None:
    if isinstance(node, dict):
        node.pop("default", None)
        for value in node.values():
            _strip_defaults(value)
    elif isinstance(node, list):
        for value in node:
            _strip_defaults(value)


def render() -> str:
    header = "# Generated from operator/rljob/api by `make crds`. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=110)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
