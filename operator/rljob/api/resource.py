"""The whole RLJob object and parsing with Kubernetes-style field paths in every error."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from rljob.api.base import InvalidObject, describe_errors
from rljob.api.spec import JobMetadata, RLJobSpec
from rljob.api.status import RLJobStatus


def parse_spec(spec: Any) -> RLJobSpec:
    """Validate a spec as the operator receives it; errors read `spec.release.tags[1]: ...`."""
    try:
        return RLJobSpec.model_validate(spec)
    except ValidationError as err:
        raise InvalidObject(describe_errors(err, root="spec")) from None


def parse_job(body: Any) -> RLJobSpec:
    """Validate what the operator acts on: metadata.name (every child is named after it) and the spec.
    The errors of both are reported together, each naming its field."""
    errors: list[str] = []
    try:
        JobMetadata.model_validate(body.get("metadata") or {})
    except ValidationError as err:
        errors += describe_errors(err, root="metadata")
    try:
        spec = parse_spec(body.get("spec"))
    except InvalidObject as err:
        errors += err.errors
    if errors:
        raise InvalidObject(errors)
    return spec


def parse_status(status: Any) -> RLJobStatus:
    """Status written by an older operator may lack fields; unknown ones are dropped, not fatal."""
    try:
        return RLJobStatus.model_validate(status or {})
    except ValidationError as err:
        raise InvalidObject(describe_errors(err, root="status")) from None
