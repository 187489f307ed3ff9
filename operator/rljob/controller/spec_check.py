"""One RLJob's spec as its conductor runs it: parsed once per generation, checked against the API server
(the token Secret and the Service created once, a server-side dry run of a pod once per generation while
the job runs), and made into its pods' manifests. A refusal, the models' or the API server's, is the
spec's error: decide() fails the job before any pod exists."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rljob.api import InvalidObject, parse_job
from rljob.api.spec import RLJobSpec
from rljob.api.status import RLJobStatus
from rljob.controller.children import (
    AgentOptions,
    gang_pod,
    headless_service,
    new_token,
    refusal_spec_error,
    token_secret,
)
from rljob.controller.kube import ChildRefused, Kube

MAX_SPEC_ERROR = 1000  # the status message is bounded (api/status.py)


@dataclass
class ParsedSpec:
    """One generation of the RLJob as the operator reads it: the spec, or why it cannot be run."""

    generation: int | None
    spec: RLJobSpec | None
    error: str | None = None  # Observation.spec_error: the models refuse it, or the API server a child
    pods_checked: bool = False  # a pod of this spec passed a server-side dry run

    def refused(self, refused: ChildRefused) -> None:
        self.error = refusal_spec_error(refused.refusal)[:MAX_SPEC_ERROR]


class SpecCheck:
    def __init__(self, kube: Kube, body: Mapping[str, Any], agent: AgentOptions) -> None:
        meta = body["metadata"]
        self.kube = kube
        self.body = body  # kopf's live view: spec edits show up here
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.agent = agent
        self.last: ParsedSpec | None = None  # the generation parsed last
        self._children_ready = False  # the token Secret and the Service exist

    def pod(self, spec: RLJobSpec, index: int, gang: int) -> dict[str, Any]:
        """The manifest of pod `index` of gang `gang`, in the job's namespace."""
        manifest = gang_pod(self.name, self.uid, spec, index, gang, self.agent, spec.iterations)
        manifest["metadata"]["namespace"] = self.namespace
        return manifest

    def parse(self) -> ParsedSpec:
        """The validated spec, parsed again only when metadata.generation moves (every spec edit does)."""
        generation = self.body.get("metadata", {}).get("generation")
        if self.last is None or self.last.generation != generation:
            try:
                self.last = ParsedSpec(generation, parse_job(self.body))
            except InvalidObject as err:
                self.last = ParsedSpec(generation, None, str(err)[:MAX_SPEC_ERROR])
        return self.last

    async def check(self, status: RLJobStatus, authorize: Callable[[str], None]) -> ParsedSpec:
        """The spec, with what the API server says about its children: the token Secret and Service
        (created once; `authorize` is given the token), and the pods (a server-side dry run of the last
        pod, once per generation, while the job runs)."""
        parsed = self.parse()
        if parsed.spec is None or parsed.error is not None:
            return parsed
        try:
            if not self._children_ready:
                authorize(await self._token_and_service(parsed.spec))
                self._children_ready = True
            if not parsed.pods_checked and not status.phase.terminal:
                await self.kube.create(
                    self.namespace,
                    self.pod(parsed.spec, parsed.spec.replicas - 1, status.restarts),
                    dry_run=True,
                )
                parsed.pods_checked = True
        except ChildRefused as refused:
            parsed.refused(refused)
        return parsed

    async def _token_and_service(self, spec: RLJobSpec) -> str:
        token = await self.kube.read_token(self.namespace, self.name)
        if token is None:
            await self.kube.create(self.namespace, token_secret(self.name, self.uid, new_token()))
            token = await self.kube.read_token(self.namespace, self.name)
            assert token is not None
        await self.kube.create(self.namespace, headless_service(self.name, self.uid, spec))
        return token
