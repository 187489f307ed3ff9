"""The vLLM-compatible endpoint a framework (SkyRL; any client of vLLM's RL routes) is pointed at instead
of vLLM, on loopback: its lifecycle calls become the RLJob handoff, generation and read routes pass through.

- `/sleep` (any level): the trainer's lease request; answered, as vLLM answers a sleep, once the gang
  drained, released, verified and the operator granted the lease.
- a weight update's start (`/start_weight_update`, or SkyRL's `/collective_rpc skyrl_start_weight_update`):
  publishes the served version plus one and waits for the refit window; each update (`/update_weights`,
  or SkyRL's `update_weights_ipc`, rewritten into vLLM's own form: docs/vllm-conformance.md §11) goes
  through the window's guards to vLLM; the finish closes the window and answers once the refit loaded and
  verified the weights.
- `/wake_up` of `kv_cache` (or of everything): the end of the handoff; answered once this pod serves the new
  version. A wake of `weights` alone is the agent's own (its refit wakes them) and is answered at once.
- `/pause`, `/resume`, `/reset_prefix_cache` off rollout, `/init_weight_transfer_engine` with the IPC
  backend are answered here: the agent's drain, refit and resume make these calls (the framework's would
  race them).
Replies have vLLM's shape for the route at the pod's version; a refusal carries "rljob:" and the reason in
vLLM's error shape (V-ROUTE-ERRORS) and is kept as the trainer's last refusal until its next accepted call.
What passes through goes through the vLLM client (`VLLMClient.forward`)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from rljob.agent.engines import framework_endpoint
from rljob.agent.engines.framework_endpoint import FrameworkSession, framework_app, next_version
from rljob.agent.engines.vllm import handles
from rljob.agent.engines.vllm.client import VLLMClient
from rljob.agent.errors import Refused
from rljob.api.agent import PublishRequest, Stage, TensorPush
from rljob.api.spec import RefitSource

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "uint8": 1, "int8": 1}
# SkyRL's worker-extension methods (NewInferenceWorkerWrap at a9564572, §11) the endpoint takes as the window.
SKYRL_START, SKYRL_UPDATE, SKYRL_FINISH = (
    "skyrl_start_weight_update",
    "update_weights_ipc",
    "skyrl_finish_weight_update",
)
NOT_THROUGH_ENDPOINT = {
    "/update_weight_version": "the weight version is the one the refit publishes",
    "/release_kv_cache_memory": "the agent's release frees memory once the gang drained",
    "/shutdown_weight_transfer_engine": "the agent owns vLLM's weight transfer",
    "/start_draft_weight_update": "the agent refits the served model only",
}


class Refusal(framework_endpoint.Refusal):
    """A call the endpoint refuses, in vLLM's error shape (V-ROUTE-ERRORS)."""

    def __init__(self, status: int, message: str) -> None:
        kind = {
            400: "BadRequestError",
            409: "BadRequestError",
            502: "InternalServerError",
            503: "ServiceUnavailableError",
        }
        error_type = kind.get(status, "BadRequestError")
        body = {"error": {"message": f"rljob: {message}", "type": error_type, "param": None, "code": status}}
        super().__init__(status, body, message)


def skyrl_update(info: Any) -> dict[str, Any]:
    """SkyRL's `update_weights_ipc` update_info (names, dtype_names, shapes, sizes in elements, one buffer
    in the model's dtype, handles `{uuid: reduce_tensor(buffer)}`: cuda_ipc_strategy.py:198-250@a9564572)
    as vLLM's packed IPC update (tensor_sizes in bytes, the same buffer viewed as uint8, handles
    `{uuid: rebuild args}`: V-REFIT-IPC)."""
    if not isinstance(info, dict):
        raise Refusal(400, "update_weights_ipc: kwargs.update_info is not an object")
    obj, broken = handles.decode(info.get("ipc_handles_pickled"))
    native = handles.native(obj) if broken is None else None
    if native is None:
        raise Refusal(400, f"update_weights_ipc: ipc_handles_pickled is {broken or 'not {gpu_uuid: handle}'}")
    args = {uuid: handles.byte_view(a) for uuid, a in native.items()}  # SkyRL packs in the model's dtype
    if any(a is None for a in args.values()):
        raise Refusal(400, "update_weights_ipc: a packed buffer that is not one contiguous 1-D tensor")
    dtypes, sizes = info.get("dtype_names"), info.get("sizes")
    if not isinstance(dtypes, list) or not isinstance(sizes, list) or len(dtypes) != len(sizes):
        raise Refusal(400, "update_weights_ipc: dtype_names and sizes must be lists of one length")
    try:
        tensor_sizes = [int(n) * ITEMSIZE[str(d)] for n, d in zip(sizes, dtypes, strict=True)]
    except (KeyError, TypeError, ValueError) as e:
        raise Refusal(400, f"update_weights_ipc: a dtype or size vLLM cannot view: {e}") from e
    return {
        "names": info.get("names"),
        "dtype_names": dtypes,
        "shapes": info.get("shapes"),
        "tensor_sizes": tensor_sizes,
        "ipc_handles_pickled": handles.encode(args),
    }


class VLLMEndpoint(FrameworkSession[VLLMClient]):
    """One pod's framework session: the version it published in the current lease, if any."""

    not_through = NOT_THROUGH_ENDPOINT

    def refusal(self, status: int, message: str) -> Refusal:
        return Refusal(status, message)

    def _json_replies(self) -> bool:
        """V-ROUTE-SLEEP, V-ROUTE-WAKE: 0.34 answers JSON, 0.26 an empty 200."""
        quirks = self.client.quirks
        return quirks is None or quirks.wake_says_awake

    def _workers(self) -> int:
        """`/collective_rpc` answers one result per worker of DP rank 0 (V-ROUTE-RPC)."""
        facts = self.store.facts
        return max(1, facts.tp_size * getattr(facts, "pp_size", 1)) if facts is not None else 1

    def _rpc_reply(self) -> web.Response:
        return web.json_response({"results": [None] * self._workers()})

    # --- the handoff ---------------------------------------------------------------------------------

    async def sleep(self, request: web.Request) -> web.Response:
        level = request.query.get("level", "1")
        await self._settled(_unsettled)
        if not self.store.state.trainer.lease_held:
            try:
                self.lease.request()
            except Refused as e:
                raise Refusal(409, e.reason) from e
            why = await self._until_lease_held()
            if why is not None:
                raise Refusal(409, why)
        self.published = None
        self.lease.accepted()
        if not self._json_replies():
            return web.Response(status=200)
        return web.json_response({"status": "sleeping", "level": int(level) if level.isdigit() else level})

    async def wake_up(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", [])
        await self._settled(_unsettled)
        if tags and "kv_cache" not in tags:
            self.lease.accepted()  # weights: the agent's refit wakes them
            return self._wake_reply(tags, awake=False)
        version = self.published
        if version is None:
            st = self.store.state
            if st.stage == Stage.SERVING and not st.trainer.lease_held:
                return self._wake_reply(tags, awake=True)  # nothing asleep, or the same wake again
            raise Refusal(
                409, "no weights were pushed since the sleep: update weights before waking kv_cache"
            )
        why = await self._until_serving(version)
        if why is not None:
            raise Refusal(409, why)
        self.published = None
        self.lease.accepted()
        return self._wake_reply(tags, awake=True)

    def _wake_reply(self, tags: list[str], *, awake: bool) -> web.Response:
        if not self._json_replies():
            return web.Response(status=200)
        return web.json_response({"status": "awake" if awake else "sleeping", "tags": tags or None})

    def _publish(self) -> str:
        if self.refit_source is not None and self.refit_source != RefitSource.TENSOR:
            raise Refusal(
                409, f"this RLJob refits from {self.refit_source.value} (spec.refit.source), not tensor"
            )
        if self.published is not None:
            return self.published
        st = self.store.state
        if not st.trainer.lease_held:
            raise Refusal(409, "the trainer holds no GPU lease: call /sleep first")
        chosen = next_version(st.engine.served_version)
        try:
            self.lease.publish(PublishRequest(version=chosen, path=None))
        except Refused as e:
            raise Refusal(409, e.reason) from e
        self.published = chosen
        return chosen

    async def start_update(self) -> None:
        await self._settled(_unsettled)
        version = self._publish()
        why = await self._until_window_open(version, "call")
        if why is not None:
            raise Refusal(409, why)
        self.lease.accepted()

    async def update(self, update_info: dict[str, Any]) -> str:
        await self._settled(_unsettled)
        if self.published is None:
            raise Refusal(409, "no weight update was started in this lease: start one first")
        try:
            result = await self.windows.push_tensor(TensorPush(update_info=update_info))
        except Refused as e:
            raise Refusal(e.status if e.status in (400, 409) else 400, f"{e.error}: {e.reason}") from e
        self.lease.accepted()
        return result.message

    async def finish_update(self) -> None:
        await self._settled(_unsettled)
        version = self.published
        if version is None:
            raise Refusal(409, "no weight update was started in this lease")
        self._close_window(version)
        why = await self._until_refitted(version)
        if why is not None:
            raise Refusal(409, why)
        self.lease.accepted()

    # --- the routes ----------------------------------------------------------------------------------

    async def start_weight_update(self, request: web.Request) -> web.Response:
        await self.start_update()
        return web.json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        info = body.get("update_info")
        if not isinstance(info, dict):
            raise Refusal(400, "Missing 'update_info' in request body")
        await self.update(info)
        return web.json_response({"message": "Weights updated"})

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        await self.finish_update()
        return web.json_response({"message": "Weight update finished"})

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        info = body.get("init_info")
        if not isinstance(info, dict):
            raise Refusal(400, "Missing 'init_info' in request body")
        if set(info) - {"packed"}:
            raise Refusal(
                400,
                "an NCCL weight transfer is not taken: the RLJob endpoint takes CUDA IPC updates and disk",
            )
        return web.json_response({"message": "Weight transfer initialized"})  # the agent inits it itself

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        method = body.get("method")
        raw_kwargs = body.get("kwargs")
        kwargs: dict[str, Any] = raw_kwargs if isinstance(raw_kwargs, dict) else {}
        if method == SKYRL_START:
            await self.start_update()
        elif method == SKYRL_UPDATE:
            await self.update(skyrl_update(kwargs.get("update_info")))
        elif method == SKYRL_FINISH:
            await self.finish_update()
        else:
            raise Refusal(
                400,
                f"/collective_rpc {method!r} is not taken through the RLJob endpoint: it reaches every "
                "worker "
                "outside the gang's lock-step (the weight-update methods are)",
            )
        return self._rpc_reply()

    async def pause(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "paused"})  # V-ROUTE-PAUSE: the agent's drain pauses

    async def resume(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "resumed"})  # V-ROUTE-RESUME: the agent's resume serves

    async def reset_prefix_cache(self, request: web.Request) -> web.StreamResponse:
        if self._serving_freely():
            return await self.pass_through(request)
        return web.json_response({"success": True})  # V-ROUTE-FLUSH: the agent's refit resets it

    async def refuse_passing(self, request: web.Request) -> None:
        if request.path == "/weight_checker" and b'"reset"' in await request.read():
            raise Refusal(
                400, "/weight_checker reset zeroes the served weights: not through the RLJob endpoint"
            )


def _unsettled(why: str) -> Refusal:
    return Refusal(503, why)


async def _json_object(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = json.loads(raw) if raw else {}
    except ValueError as e:
        raise Refusal(400, f"the body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise Refusal(400, "Request body must be a JSON object")
    return body


def build_app(endpoint: VLLMEndpoint) -> web.Application:
    app = framework_app(endpoint)
    r = app.router
    r.add_post("/sleep", endpoint.sleep)
    r.add_post("/wake_up", endpoint.wake_up)
    r.add_post("/pause", endpoint.pause)
    r.add_post("/resume", endpoint.resume)
    r.add_post("/reset_prefix_cache", endpoint.reset_prefix_cache)
    r.add_post("/init_weight_transfer_engine", endpoint.init_weight_transfer_engine)
    r.add_post("/start_weight_update", endpoint.start_weight_update)
    r.add_post("/update_weights", endpoint.update_weights)
    r.add_post("/finish_weight_update", endpoint.finish_weight_update)
    r.add_post("/collective_rpc", endpoint.collective_rpc)
    r.add_route("*", "/{tail:.*}", endpoint.pass_through)
    return app
