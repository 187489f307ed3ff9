"""The SGLang-compatible endpoint a framework (slime, verl, AReaL) is pointed at instead of SGLang, on
loopback: its lifecycle calls become the RLJob handoff, generation and read routes pass through.

- release (any tags): the trainer's lease request; answered, as SGLang answers a release, once the gang
  drained, released, verified and the operator granted the lease.
- a weight push: the first of a lease publishes (the push's `weight_version`, else the served version
  plus one) and waits for the refit window; each push goes through the window's guards to SGLang.
- a disk update: publishes `model_path`; answered once this pod's agent refitted that version.
- a resume with `kv_cache` (or every tag): the end of the refit; answered once this pod serves the new
  version. With no weights pushed since the release, the lease goes back without weights and it is
  answered once the gang serves the committed version again. A resume of `weights` or `cuda_graph` alone
  is the agent's own (its refit resumes them).
- pause, continue and, off rollout, flush are answered here: the agent's drain, refit and resume make
  these calls themselves (the framework's would race them).
Every reply has the shape SGLang gives that route (rows C-ROUTE-* of docs/sglang-conformance.md), for the
pod's SGLang version as the SGLang client read it; a refusal carries "rljob:" and the reason in SGLang's
error shape for the route, and is kept as the trainer's last refusal until its next accepted handoff call
(the operator shows it when the trainer ends). What passes through goes through the SGLang client
(`SGLangClient.forward`).

A call in flight when the agent's process ends loses its connection (the kernel closes it with the
process): the framework sees it drop. The same call sent again to the restarted agent is answered as
the first would have been, from the recorded state (agent/record.py), once the recovery has settled: a
release waits on the recorded lease request (or answers at once if the lease was granted), a push or load
replays the version the lease published, a resume waits until the pod serves (or answers at once if it
does). A call whose first sending the agent cannot account for (a refit window open at the restart) is
refused with the recovery's reason: the pod is given up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rljob.agent.engines.framework_endpoint import (
    FrameworkSession,
    Refusal,
    framework_app,
    next_version,
)
from rljob.agent.engines.sglang.client import SGLangClient
from rljob.agent.engines.sglang.quirks import SGLangQuirks
from rljob.agent.errors import Refused
from rljob.api.agent import PublishRequest, Stage, TensorPush
from rljob.api.spec import RefitSource


@dataclass(frozen=True)
class Replies:
    """SGLang's success answers on the routes the endpoint answers itself."""

    paused: dict[str, str] = field(  # C-ROUTE-PAUSE
        default_factory=lambda: {"message": "Generation paused successfully.", "status": "ok"}
    )
    continued: dict[str, str] = field(  # C-ROUTE-CONTINUE
        default_factory=lambda: {"message": "Generation continued successfully.", "status": "ok"}
    )
    flushed: str = (  # C-ROUTE-FLUSH: text/plain
        "Cache flushed.\nPlease check backend logs for more details. "
        "(When there are running or waiting requests, the operation will not be performed.)\n"
    )
    disk_updated: dict[str, Any] = field(  # C-ROUTE-DISK
        default_factory=lambda: {
            "success": True,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": 0,
        }
    )


# The replies by the oldest SGLang version each row holds for, oldest first: every version checked
# (docs/sglang-conformance.md, 0.5.6 to 0.5.23) answers these routes alike, so one row.
REPLIES: tuple[tuple[tuple[int, int, int], Replies], ...] = (((0, 5, 6), Replies()),)


def replies_for(quirks: SGLangQuirks | None) -> Replies:
    """The replies of the pod's SGLang version (`quirks`: None until /server_info answered: the newest)."""
    if quirks is None:
        return REPLIES[-1][1]
    return next((r for since, r in reversed(REPLIES) if quirks.key >= since), REPLIES[0][1])


# Routes a framework must not reach SGLang with: each would bypass the gang's lock-step or the guards.
NOT_THROUGH_ENDPOINT = {
    "/update_weights_from_distributed": "distributed refits go through the agent's refit window "
    "(rljob.trainer.Handoff); the endpoint takes tensor and disk refits",
    "/init_weights_update_group": "weight-update groups are formed through the agent's refit window",
    "/destroy_weights_update_group": "weight-update groups are formed through the agent's refit window",
    "/update_weight_version": "the weight version is the one the refit publishes",
    "/begin_weight_update": "the agent's refit opens the weight-update session",
    "/end_weight_update": "the agent's refit closes the weight-update session",
}


class MemoryTags(BaseModel):
    """C-ROUTE-RELEASE / C-ROUTE-RESUME: `{tags: [str] | null}`; null or [] means every tag."""

    model_config = ConfigDict(extra="ignore")
    tags: list[str] | None = None

    def every(self) -> bool:
        return not self.tags


class TensorUpdate(BaseModel):
    """C-ROUTE-TENSOR: the fields the endpoint reads; others are SGLang's and not forwarded."""

    model_config = ConfigDict(extra="ignore")
    serialized_named_tensors: list[str] = Field(min_length=1, max_length=64)
    load_format: str | None = Field(default=None, max_length=64)
    weight_version: str | None = Field(default=None, max_length=128)


class DiskUpdate(BaseModel):
    """C-ROUTE-DISK: the fields the endpoint reads."""

    model_config = ConfigDict(extra="ignore")
    model_path: str = Field(min_length=1, max_length=1024)
    weight_version: str | None = Field(default=None, max_length=128)


def _update_error(message: str, status: int = 400) -> Refusal:
    return Refusal(status, {"success": False, "message": f"rljob: {message}"})  # C-ROUTE-DISK/TENSOR


def _memory_error(message: str) -> Refusal:
    return Refusal(400, {"error": {"message": f"rljob: {message}"}})  # C-ROUTE-RELEASE / C-ROUTE-RESUME


def _body(raw: bytes, model: type[BaseModel]) -> Any:
    """C-ROUTE-VALIDATION: a body SGLang's model refuses is a 400 in its validation shape."""
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        message = f"{where}: {first['msg']}"
        raise Refusal(
            400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
        ) from e


class SGLangEndpoint(FrameworkSession[SGLangClient]):
    """One pod's framework session: the version it published in the current lease, if any."""

    not_through = NOT_THROUGH_ENDPOINT

    def _replies(self) -> Replies:
        return replies_for(self.client.quirks)

    def refusal(self, status: int, message: str) -> Refusal:
        return _update_error(message, status)

    # --- the handoff ---------------------------------------------------------------------------------

    async def release(self, request: web.Request) -> web.Response:
        _body(await request.read(), MemoryTags)
        await self._settled(_memory_error)
        if not self.store.state.trainer.lease_held:
            try:
                self.lease.request()
            except Refused as e:
                raise _memory_error(e.reason) from e
            why = await self._until_lease_held()
            if why is not None:
                raise _memory_error(why)
        self.published = None
        self.lease.accepted()
        return web.json_response(None)

    async def resume(self, request: web.Request) -> web.Response:
        tags = _body(await request.read(), MemoryTags)
        await self._settled(_memory_error)
        if not tags.every() and "kv_cache" not in (tags.tags or []):
            self.lease.accepted()
            return web.json_response(None)  # weights, cuda_graph: the agent's refit resumes them
        version = self.published
        if version is None:
            if self._serving_freely():
                if self._lease_ended_serving():  # the same resume again: its answer was lost
                    return web.json_response(None)
                raise _memory_error("nothing is released: SGLang dies on a resume of a tag it holds")
            return await self._resume_unchanged()
        self._close_window(version)
        why = await self._until_serving(version)
        if why is not None:
            raise _memory_error(why)
        self.published = None
        self.lease.accepted()
        return web.json_response(None)

    def _lease_ended_serving(self) -> bool:
        """The pod serves again after the trainer gave back the current lease (published or not)."""
        t, granted = self.store.state.trainer, self.store.lease_epoch
        return granted is not None and granted in (t.published_epoch, t.returned_epoch)

    async def _resume_unchanged(self) -> web.Response:
        """A resume with no weights pushed since the release (AReaL's start-up offload and onload): the
        lease goes back without weights and the gang serves the committed version again."""
        if self.store.state.trainer.lease_held:
            try:
                self.lease.return_unchanged()
            except Refused as e:
                raise _memory_error(e.reason) from e
        elif self.store.state.stage not in (Stage.TRAINED, Stage.REFITTED):  # else: a call sent again
            raise _memory_error("no new weights since the release: push or load weights before resuming")
        why = await self._until(
            lambda: self.store.state.stage == Stage.SERVING,
            self._command_failed("refit", "resume"),
        )
        if why is not None:
            raise _memory_error(why)
        self.lease.accepted()
        return web.json_response(None)

    def refused(self, request: web.Request, refusal: Refusal) -> None:
        """What the endpoint refused, for the operator (TrainerReport.last_refusal)."""
        body = refusal.body if isinstance(refusal.body, dict) else {}
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else body.get("message")
        self.lease.refused(f"{request.method} {request.path}: {message or refusal.body}")

    def _publish(self, version: str | None, path: str | None, source: RefitSource) -> str:
        """The first weights of a lease publish; later ones must name the same version."""
        if self.refit_source is not None and self.refit_source != source:
            raise _update_error(
                f"this RLJob refits from {self.refit_source.value} (spec.refit.source), not {source.value}"
            )
        if self.published is not None:
            if version not in (None, self.published):
                raise _update_error(f"weight_version {version} differs from {self.published}, published")
            return self.published
        st = self.store.state
        if not st.trainer.lease_held:
            raise _update_error("the trainer holds no GPU lease: call /release_memory_occupation first")
        chosen = version or next_version(st.engine.served_version)
        try:
            self.lease.publish(PublishRequest(version=chosen, path=path))
        except (Refused, ValidationError) as e:
            raise _update_error(e.reason if isinstance(e, Refused) else str(e)) from e
        self.published = chosen
        return chosen

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body: TensorUpdate = _body(await request.read(), TensorUpdate)
        await self._settled(_update_error)
        version = self._publish(body.weight_version, None, RefitSource.TENSOR)
        why = await self._until_window_open(version, "push")
        if why is not None:
            raise _update_error(why)
        push = TensorPush(
            serialized_named_tensors=body.serialized_named_tensors, load_format=body.load_format
        )
        try:
            result = await self.windows.push_tensor(push)
        except Refused as e:
            raise _update_error(f"{e.error}: {e.reason}") from e
        self.lease.accepted()
        return web.json_response({"success": True, "message": result.message})

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body: DiskUpdate = _body(await request.read(), DiskUpdate)
        await self._settled(_update_error)
        version = self._publish(body.weight_version, body.model_path, RefitSource.DISK)
        why = await self._until_refitted(version)
        if why is not None:
            raise _update_error(why)
        self.lease.accepted()
        return web.json_response(self._replies().disk_updated)

    async def pause(self, request: web.Request) -> web.Response:
        return web.json_response(self._replies().paused)

    async def resume_generation(self, request: web.Request) -> web.Response:
        return web.json_response(self._replies().continued)

    async def flush_cache(self, request: web.Request) -> web.StreamResponse:
        if self._serving_freely():
            return await self.pass_through(request)
        flushed = self._replies().flushed  # the agent's refit flushes itself
        return web.Response(text=flushed, content_type="text/plain")


def build_app(endpoint: SGLangEndpoint) -> web.Application:
    app = framework_app(endpoint)
    r = app.router
    for path, handler in (
        ("/release_memory_occupation", endpoint.release),
        ("/resume_memory_occupation", endpoint.resume),
        ("/flush_cache", endpoint.flush_cache),
    ):
        r.add_route("GET", path, handler)
        r.add_route("POST", path, handler)
    r.add_post("/update_weights_from_tensor", endpoint.update_from_tensor)
    r.add_post("/update_weights_from_disk", endpoint.update_from_disk)
    r.add_post("/pause_generation", endpoint.pause)
    r.add_post("/continue_generation", endpoint.resume_generation)
    r.add_route("*", "/{tail:.*}", endpoint.pass_through)
    return app
