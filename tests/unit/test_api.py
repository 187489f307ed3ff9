"""The API models: defaults, field-path errors, and the generated CRD staying in sync."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rljob.api import InvalidObject, parse_job, parse_spec
from rljob.api.crd import CRD_FILE, build_crd, render
from rljob.api.spec import (
    AGENT_CONTAINER,
    ENGINE_DEFAULTED,
    ENGINE_TRAITS,
    JOB_NAME_MAX_LENGTH,
    MAX_REPLICAS,
    TOKEN_VOLUME,
    DrainMode,
    EngineKind,
    Release,
    ReleaseTag,
    RLJobSpec,
    Rollout,
)
from rljob.api.status import RLJobStatus
from rljob.lifecycle.versions import is_newer

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS = {"spec": {"containers": [{"name": "sglang", "image": "lmsys/sglang"}, {"name": "trainer"}]}}


def test_defaults_live_in_the_models() -> None:
    spec = parse_spec({"template": CONTAINERS})
    assert spec.engine == EngineKind.SGLANG
    assert (spec.rollout.container, spec.rollout.port) == ("sglang", 30000)
    assert spec.replicas == 1
    assert spec.release.tags == [ReleaseTag.KV_CACHE, ReleaseTag.WEIGHTS, ReleaseTag.CUDA_GRAPH]
    assert spec.rollout.drain.mode.value == "abort"
    assert spec.refit.source.value == "disk"
    assert spec.weights.initial_version == "0"
    assert spec.backoff_limit == 3
    # Unknown container fields pass through untouched (the operator re-emits the user's template).
    assert spec.template.spec.containers[0].model_dump(by_alias=True)["image"] == "lmsys/sglang"


VLLM_CONTAINERS = {"spec": {"containers": [{"name": "vllm"}, {"name": "trainer"}]}}


def test_what_a_job_leaves_to_its_engine_is_the_engines() -> None:
    """rollout.container, rollout.port and release.tags default per engine; what the job sets stays."""
    spec = parse_spec({"engine": "vllm", "template": VLLM_CONTAINERS})
    assert (spec.rollout.container, spec.rollout.port) == ("vllm", 8000)
    assert spec.release.tags == [ReleaseTag.KV_CACHE, ReleaseTag.WEIGHTS]
    assert spec.release.verify.min_freed_fraction == 0.5  # the rest of release keeps its defaults
    assert spec.weights.initial_version == "default"  # what vLLM labels its launch weights
    set_by_job = parse_spec(
        {
            "engine": "vllm",
            "template": {"spec": {"containers": [{"name": "engine"}, {"name": "trainer"}]}},
            "rollout": {"container": "engine", "port": 9000, "drain": {"mode": "wait"}},
            "release": {"tags": ["kv_cache"]},
            "weights": {"initial_version": "0"},
        }
    )
    assert (set_by_job.rollout.container, set_by_job.rollout.port) == ("engine", 9000)
    assert set_by_job.rollout.drain.mode == DrainMode.WAIT
    assert set_by_job.release.tags == [ReleaseTag.KV_CACHE]
    assert set_by_job.weights.initial_version == "0"
    # Models built in Python: what they were given is kept, the rest is the engine's.
    built = RLJobSpec(
        engine=EngineKind.VLLM,
        template=VLLM_CONTAINERS,  # type: ignore[arg-type]
        rollout=Rollout(port=9001),
        release=Release(),
    )
    assert (built.rollout.container, built.rollout.port, built.release.tags) == (
        "vllm",
        9001,
        [ReleaseTag.KV_CACHE, ReleaseTag.WEIGHTS],
    )


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {"release": {"tags": ["kv_cache", "weights", "cuda_graph"]}},
            "release.tags: engine vllm cannot release",
        ),
        ({"release": {"tags": ["cuda_graph"]}}, "release.tags: engine vllm cannot release cuda_graph"),
        ({"release": {"tags": ["weights"]}}, "release.tags: engine vllm releases its weights only together"),
        (
            {"replicas": 2, "rollout": {"podsPerInstance": 2}},
            "rollout.podsPerInstance: engine vllm cannot span an instance over several pods",
        ),
        ({"engine": "tgi"}, "spec.engine: Input should be 'sglang' or 'vllm'"),
        ({"template": CONTAINERS}, "rollout.container 'vllm' is not a container"),
        ({"rollout": {"port": 8472}}, "rollout.port 8472 is the agent's trainer port"),
        ({"trainer": {"masterPort": 8000}}, "trainer.masterPort must differ"),
        (
            {"engine": "sglang", "template": CONTAINERS, "rollout": {"drain": {"mode": "wait"}}},
            "rollout.drain.mode: engine sglang has no drain that lets running requests finish",
        ),
    ],
    ids=[
        "every-tag",
        "cuda-graph",
        "weights-alone",
        "pods-per-instance",
        "unknown",
        "container",
        "port",
        "master",
        "wait-on-sglang",
    ],
)
def test_what_the_engine_cannot_do_is_refused_naming_the_field(body: dict, expected: str) -> None:
    with pytest.raises(InvalidObject) as err:
        parse_spec({"engine": "vllm", "template": VLLM_CONTAINERS, **body})
    assert expected in str(err.value)


def test_every_engine_rule_is_cel_for_its_engine_only() -> None:
    """Each engine's rules reach the API server, each guarded by its engine and naming its field."""
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = {(r["fieldPath"], r["message"]): r["rule"] for r in schema["x-kubernetes-validations"]}
    for kind, traits in ENGINE_TRAITS.items():
        for field, rule, message, _ in traits.all_rules(kind):
            assert rules[(field, message)] == f"self.engine != '{kind.value}' || ({rule})"
    assert schema["properties"]["engine"]["x-kubernetes-validations"] == [
        {"rule": "self == oldSelf", "message": "engine is immutable"}
    ]
    for part, name in ENGINE_DEFAULTED:  # no static default where the engine's applies
        assert "default" not in schema["properties"][part]["properties"][name]
        assert name not in schema["properties"][part].get("default", {})


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"release": {"tags": ["kv_cache", "in_place"]}}, "spec.release.tags[1]: Input should be"),
        (
            {"release": {"tags": ["kv_cache", "kv_cache"]}},
            "spec.release.tags: Value error, tags must be unique",
        ),
        ({"release": {"tags": []}}, "spec.release.tags: List should have at least 1 item"),
        (
            {"rollout": {"drain": {"mode": "in_place"}}},
            "spec.rollout.drain.mode: Input should be 'abort', 'retract' or",
        ),
        ({"replicas": 0}, "spec.replicas: Input should be greater than or equal to 1"),
        ({"release": {"verify": {"minFreedFraction": 1.5}}}, "spec.release.verify.minFreedFraction"),
        ({"trainer": {"container": "sglang"}}, "must name different containers"),
        ({"trainer": {"container": "missing"}}, "trainer.container 'missing' is not a container"),
        ({"weights": {"initialVersion": "a b"}}, "spec.weights.initialVersion: String should match pattern"),
        ({"replicaz": 2}, "spec.replicaz: Extra inputs are not permitted"),
        ({"rollout": {"port": 8472}}, "rollout.port 8472 is the agent's trainer port"),
        ({"rollout": {"port": 8473}}, "rollout.port 8473 is the agent's engine port"),
        ({"trainer": {"masterPort": 8473}}, "trainer.masterPort must differ"),
    ],
)
def test_invalid_specs_name_the_field(body: dict, expected: str) -> None:
    with pytest.raises(InvalidObject) as err:
        parse_spec({"template": CONTAINERS, **body})
    assert expected in str(err.value)


SGLANG, TRAINER = {"name": "sglang"}, {"name": "trainer"}


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (
            {"spec": {"containers": [SGLANG, TRAINER, {"name": AGENT_CONTAINER}]}},
            "spec.template.spec.containers: Value error, container name rljob-agent is reserved",
        ),
        (
            {"spec": {"containers": [SGLANG, TRAINER, SGLANG]}},
            "spec.template.spec.containers: Value error, container names must be unique: sglang",
        ),
        (
            {"spec": {"containers": [SGLANG, TRAINER], "volumes": [{"name": TOKEN_VOLUME, "emptyDir": {}}]}},
            "spec.template.spec.volumes: Value error, volume name rljob-agent-token is reserved",
        ),
        (
            {"spec": {"containers": [SGLANG, TRAINER], "volumes": [{"name": "w"}, {"name": "w"}]}},
            "spec.template.spec.volumes: Value error, volume names must be unique: w",
        ),
        (
            {"metadata": {"labels": {"app": "not ok!"}}, "spec": {"containers": [SGLANG, TRAINER]}},
            "spec.template.metadata.labels.app: String should match pattern",
        ),
        (
            {"metadata": {"labels": {"app": "x" * 64}}, "spec": {"containers": [SGLANG, TRAINER]}},
            "spec.template.metadata.labels.app: String should have at most 63 characters",
        ),
        (
            {"metadata": {"labels": {"a/b/c": "x"}}, "spec": {"containers": [SGLANG, TRAINER]}},
            "spec.template.metadata.labels.a/b/c.[key]: String should match pattern",
        ),
        (
            {"metadata": {"annotations": {"note": 1}}, "spec": {"containers": [SGLANG, TRAINER]}},
            "spec.template.metadata.annotations.note: Input should be a valid string",
        ),
    ],
)
def test_templates_the_pods_cannot_be_made_from_are_refused(template: dict, expected: str) -> None:
    """What the operator injects (agent container, token volume) and what the API server would refuse
    in a pod (duplicate names, bad label values, non-string annotations) is refused in the spec."""
    with pytest.raises(InvalidObject) as err:
        parse_spec({"template": template})
    assert expected in str(err.value)


def test_template_labels_annotations_and_other_metadata_pass() -> None:
    meta = {"labels": {"example.com/team": "rl", "tier": ""}, "annotations": {"note": "x"}, "name": "t"}
    spec = parse_spec({"template": {"metadata": meta, "spec": {"containers": [SGLANG, TRAINER]}}})
    assert spec.template.model_dump(by_alias=True, exclude_none=True)["metadata"] == meta


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "a" * (JOB_NAME_MAX_LENGTH + 1),
            f"metadata.name: Value error, must be at most {JOB_NAME_MAX_LENGTH}",
        ),
        ("a.b", "metadata.name: Value error, must be a DNS-1035 label"),
        ("1abc", "metadata.name: Value error, must be a DNS-1035 label"),
        ("abc-", "metadata.name: Value error, must be a DNS-1035 label"),
        ("Abc", "metadata.name: Value error, must be a DNS-1035 label"),
    ],
)
def test_job_names_the_children_cannot_carry_are_refused(name: str, expected: str) -> None:
    with pytest.raises(InvalidObject) as err:
        parse_job({"metadata": {"name": name}, "spec": {"template": CONTAINERS}})
    assert expected in str(err.value)


def test_job_name_limit_leaves_room_for_the_largest_pod_index() -> None:
    assert JOB_NAME_MAX_LENGTH + len(f"-{MAX_REPLICAS - 1}") == 63
    parse_job({"metadata": {"name": "a" * JOB_NAME_MAX_LENGTH}, "spec": {"template": CONTAINERS}})


def test_name_and_spec_errors_are_reported_together() -> None:
    body = {"metadata": {"name": "a.b"}, "spec": {"template": CONTAINERS, "replicas": 0}}
    with pytest.raises(InvalidObject) as err:
        parse_job(body)
    assert [e.split(":")[0] for e in err.value.errors] == ["metadata.name", "spec.replicas"]


def test_crd_refuses_what_the_models_refuse_at_admission() -> None:
    """The CEL the API server runs states the same rules as the models (tests/e2e/test_invalid_spec.py
    runs both against a real API server)."""
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    root = {r["rule"]: r for r in schema["x-kubernetes-validations"]}
    assert root[f"size(self.metadata.name) <= {JOB_NAME_MAX_LENGTH}"]["fieldPath"] == ".metadata.name"
    assert "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')" in root
    pod = schema["properties"]["spec"]["properties"]["template"]["properties"]["spec"]["properties"]
    for field, reserved in (("containers", AGENT_CONTAINER), ("volumes", TOKEN_VOLUME)):
        assert pod[field]["x-kubernetes-list-type"] == "map"  # the API server refuses duplicate names
        assert pod[field]["x-kubernetes-list-map-keys"] == ["name"]
        assert [r["rule"] for r in pod[field]["x-kubernetes-validations"]] == [
            f"self.all(x, x.name != '{reserved}')"
        ]
    spec_rules = [r["rule"] for r in schema["properties"]["spec"]["x-kubernetes-validations"]]
    port = "(has(self.rollout.port) ? self.rollout.port : (self.engine == 'vllm' ? 8000 : 30000))"
    assert f"{port} != 8472" in spec_rules


def test_crd_on_disk_matches_the_models() -> None:
    on_disk = (ROOT / CRD_FILE).read_text()
    assert on_disk == render(), "crds/ drifted from operator/rljob/api: run `make crds`"


def test_crd_is_small_structural_and_has_the_columns() -> None:
    text = render()
    assert len(text.encode()) < 256 * 1024  # client-side kubectl apply annotation limit
    crd = build_crd()
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]][:6] == [
        "Phase",
        "Iteration",
        "Weights",
        "Ready",
        "Engine",
        "Age",
    ]
    schema = version["schema"]["openAPIV3Schema"]
    flat = json.dumps(schema)
    for forbidden in ('"$ref"', '"anyOf"', '"title"', '"uniqueItems"'):
        assert forbidden not in flat

    def walk(node: dict, path: str) -> None:  # every list and string is bounded (CEL cost, etcd size)
        kind = node.get("type")
        if kind == "array":
            assert "maxItems" in node, path
            walk(node["items"], path + "[]")
        if kind == "string" and "enum" not in node and "format" not in node:
            assert "maxLength" in node or path.endswith(("apiVersion", "kind")), path
        for name, child in node.get("properties", {}).items():
            walk(child, f"{path}.{name}")
        if "additionalProperties" in node:  # a map's values, never beside properties (structural)
            assert "properties" not in node and isinstance(node["additionalProperties"], dict), path
            walk(node["additionalProperties"], path + ".*")

    walk(schema["properties"]["spec"], "spec")
    walk(schema["properties"]["status"], "status")
    rules = [r["rule"] for r in schema["properties"]["spec"]["x-kubernetes-validations"]]
    container = (
        "(has(self.rollout.container) ? self.rollout.container : (self.engine == 'vllm' ? 'vllm' : 'sglang'))"
    )
    assert f"{container} != self.trainer.container" in rules
    metadata = schema["properties"]["spec"]["properties"]["template"]["properties"]["metadata"]["properties"]
    assert metadata["labels"]["additionalProperties"]["pattern"]  # a label value's syntax, at admission
    assert metadata["annotations"]["additionalProperties"]["type"] == "string"
    assert (
        schema["properties"]["spec"]["properties"]["release"]["properties"]["tags"]["x-kubernetes-list-type"]
        == "set"
    )


def test_crd_defaults_match_model_defaults() -> None:
    """The same defaults, but for what the engine decides (the models fill those in per engine)."""
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    model = RLJobSpec.model_validate({"template": CONTAINERS}).wire()
    for part, name in ENGINE_DEFAULTED:
        del model[part][name]
    assert schema["properties"]["release"]["default"] == model["release"]
    assert schema["properties"]["rollout"]["default"] == model["rollout"]
    assert schema["properties"]["backoffLimit"]["default"] == model["backoffLimit"]
    assert schema["properties"]["engine"]["default"] == model["engine"] == "sglang"


def test_status_round_trips_and_finds_conditions_by_type() -> None:
    status = RLJobStatus.model_validate(
        {
            "phase": "Rollout",
            "conditions": [{"type": "Failed", "status": "False"}, {"type": "Ready", "status": "True"}],
        }
    )
    assert status.condition("Ready").status == "True"  # type: ignore[arg-type,union-attr]
    assert RLJobStatus.model_validate(status.wire()) == status


def test_example_manifests_are_valid() -> None:
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "RLJob":
                parse_spec(doc["spec"])


@pytest.mark.parametrize(
    ("candidate", "history", "newer"),
    [
        ("1", ["0"], True),
        ("10", ["0", "9"], True),
        ("2", ["0", "3"], False),
        ("3", ["3"], False),
        ("step-a", ["0"], True),
        ("step-a", ["step-a"], False),
    ],
)
def test_version_ordering(candidate: str, history: list[str], newer: bool) -> None:
    assert is_newer(candidate, history) is newer
