"""The RLJob API and the agent wire protocol: the single source of truth for the CRD and OpenAPI."""

from rljob.api.base import InvalidObject
from rljob.api.resource import parse_job, parse_spec, parse_status
from rljob.api.spec import RLJobSpec
from rljob.api.status import Phase, RLJobStatus

__all__ = ["InvalidObject", "Phase", "RLJobSpec", "RLJobStatus", "parse_job", "parse_spec", "parse_status"]
