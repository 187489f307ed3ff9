"""Shared model configuration: camelCase on the wire (Kubernetes style), snake_case in Python."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel


class WireModel(BaseModel):
    """Base for every model that crosses a boundary (CR, agent API).

    Unknown fields are refused so a typo in a manifest is an error, not a silently ignored key.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_enum_values=False,
        validate_default=True,
    )

    def wire(self) -> dict[str, Any]:
        """The JSON-ready form: camelCase, no nulls (Kubernetes omits unset fields)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def field_path(loc: tuple[int | str, ...], root: str = "") -> str:
    """Render a pydantic error location as a Kubernetes field path: `spec.release.tags[1]`."""
    out = root
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<root>"


def describe_errors(err: ValidationError, root: str = "") -> list[str]:
    """One line per error, each naming the field path, as the API server does."""
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        lines.append(f"{field_path(loc, root)}: {e['msg']}")
    return lines


class InvalidObject(ValueError):
    """A manifest or request body that our models refuse; the message names every bad field."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors
