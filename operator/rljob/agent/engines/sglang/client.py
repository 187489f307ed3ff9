"""The agent's only way to talk to SGLang: one method per endpoint it uses, the version quirks applied,
every call timed by operation, and transport failures told apart from SGLang's answers."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from rljob.agent.engines.base import EngineError
from rljob.agent.engines.sglang.metrics import parse_metrics
from rljob.agent.engines.sglang.quirks import SGLangQuirks
from rljob.agent.engines.transport import EngineHTTP

log = logging.getLogger("rljob.agent")

# Lifecycle routes SGLang guards as ADMIN_OPTIONAL (docs/sglang-conformance.md, C-ROUTE-AUTH).
ADMIN_OPTIONAL_ROUTES = frozenset(
    {
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weight_version",
        "/weights_checker",
    }
)

# Calls that never occupy the scheduler's control inbox (tokenizer-only or the probe itself): they do not
# count as control calls in flight, which is what suspends the scheduler probe (C-DEATH-HARD).
PASSIVE_OPERATIONS = frozenset(
    {"ping", "model_info", "weight_version", "scheduler_probe", "load", "metrics", "gpu_utilization"}
)


def _summed_loads(loads: list[dict[str, Any]]) -> dict[str, float | None]:
    """The DP ranks' load entries as one: cache_hit_rate averaged, the rest summed (None: no rank has it)."""

    def mean(key: str) -> float | None:
        vals = [float(x[key]) for x in loads if x.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    tput = [float(x["gen_throughput"]) for x in loads if "gen_throughput" in x]
    known = [c for c in map(_running_waiting, loads) if c is not None]
    return {
        "cache_hit_rate": mean("cache_hit_rate"),
        "gen_throughput": sum(tput) if tput else None,
        "running": float(sum(r for r, _ in known)) if known else None,
        "waiting": float(sum(w for _, w in known)) if known else None,
    }


def _running_waiting(entry: dict[str, Any]) -> tuple[int, int] | None:
    """(running, waiting) of one DP rank's load entry: `/v1/loads` has both, 0.5.6's `/get_load` has
    `num_reqs` = running + waiting (C-METRIC-LOAD-ROUTE)."""
    try:
        waiting = int(entry["num_waiting_reqs"])
        if "num_running_reqs" in entry:
            return int(entry["num_running_reqs"]), waiting
        return int(entry["num_reqs"]) - waiting, waiting
    except (KeyError, TypeError, ValueError):
        return None


def _message(body: Any, text: str) -> str:
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict):
            return str(body["error"].get("message", text))
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return text[:500]


class SGLangClient(EngineHTTP[SGLangQuirks]):
    name = "SGLang"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        admin_api_key: str | None,
        call_timeout_s: float,
        observe: Callable[[str, float], None],
    ) -> None:
        super().__init__(base_url, call_timeout_s=call_timeout_s, observe=observe)
        # Auth levels (docs/sglang-conformance.md, C-ROUTE-AUTH): lifecycle routes are ADMIN_OPTIONAL (the
        # admin key if the server has one, else its api key); every other route needs the api key if one is
        # set.
        self._normal_auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        admin = admin_api_key or api_key
        self._admin_auth = {"Authorization": f"Bearer {admin}"} if admin else {}
        # quirks: set once /server_info answered.
        # Control calls in flight, and how many ever started: a scheduler probe that timed out counts as
        # a sign of death only if no control call ran during it (a long release or a blocking group init
        # keeps the scheduler busy, C-REFIT-GROUP-BLOCK).
        self.control_in_flight = 0
        self.control_started = 0
        self._get_load_outstanding = False  # 0.5.6's /get_load hangs once the scheduler is dead
        self._load_route: str | None = None  # /get_load after /v1/loads answered 500 (C-METRIC-LOAD-ASGI)

    def headers(self, path: str) -> Mapping[str, str]:
        return self._admin_auth if path in ADMIN_OPTIONAL_ROUTES else self._normal_auth

    def message(self, body: Any, text: str) -> str:
        return _message(body, text)

    @contextlib.contextmanager
    def calling(self, operation: str) -> Iterator[None]:
        control = operation not in PASSIVE_OPERATIONS
        if control:
            self.control_in_flight += 1
            self.control_started += 1
        try:
            yield
        finally:
            if control:
                self.control_in_flight -= 1

    async def _refit(self, operation: str, path: str, body: dict[str, Any], timeout: float | None) -> str:
        """Refit endpoints answer {success, message}; success:false is a failure even with HTTP 200."""
        reply = await self._ok(operation, "POST", path, body=body, timeout=timeout)
        if not isinstance(reply, dict) or reply.get("success") is not True:
            raise EngineError(operation, 200, _message(reply, str(reply)))
        return str(reply.get("message", ""))

    # --- discovery -------------------------------------------------------------------------------

    async def server_info(self, timeout: float | None = None) -> dict[str, Any]:
        info = await self._ok("server_info", "GET", "/server_info", timeout=timeout)
        if not isinstance(info, dict):
            raise EngineError("server_info", 200, "not a JSON object")
        return info

    async def model_info(self, timeout: float | None = None) -> dict[str, Any]:
        info = await self._ok("model_info", "GET", "/model_info", timeout=timeout)
        if not isinstance(info, dict):
            raise EngineError("model_info", 200, "not a JSON object")
        return info

    async def served_version(self, timeout: float | None = None) -> str:
        """C-ROUTE-WV-READ: `/model_info` has `weight_version` on every version."""
        body = await self._ok("weight_version", "GET", "/model_info", timeout=timeout)
        if not isinstance(body, dict) or "weight_version" not in body:
            raise EngineError("weight_version", 200, "no weight_version in /model_info")
        return str(body["weight_version"])

    async def served(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """C-ROUTE-WV-READ: (weight_version, model_path) from one `/model_info`."""
        body = await self._ok("weight_version", "GET", "/model_info", timeout=timeout)
        if not isinstance(body, dict):
            raise EngineError("weight_version", 200, "not a JSON object")
        version, path = body.get("weight_version"), body.get("model_path")
        return (str(version) if version is not None else None, str(path) if path is not None else None)

    async def update_weight_version(self, version: str, timeout: float | None = None) -> None:
        """C-ROUTE-WV-SET: sets the served version without touching weights or taking a lock.
        abort_all_requests defaults to true there: always send false."""
        body = {"new_version": version, "abort_all_requests": False}
        reply = await self._ok(
            "update_weight_version", "POST", "/update_weight_version", body=body, timeout=timeout
        )
        if not isinstance(reply, dict) or reply.get("success") is not True:
            raise EngineError("update_weight_version", 200, _message(reply, str(reply)))

    async def ping(self, timeout: float = 5.0) -> int:
        """Liveness only: any HTTP answer means the process is alive (/ping stays 200 while paused)."""
        status, _, _ = await self._call("ping", "GET", "/ping", timeout=timeout)
        return status

    # --- drain -----------------------------------------------------------------------------------

    async def pause(self, mode: str, timeout: float | None = None) -> None:
        assert mode in ("abort", "retract"), "in_place keeps KV held: a later release would kill SGLang"
        await self._ok("pause_generation", "POST", "/pause_generation", body={"mode": mode}, timeout=timeout)

    async def abort_all(self, timeout: float | None = None) -> None:
        """C-DRAIN-ABORT-FIRST: every request in flight ends with finish_reason abort; answers at once."""
        await self._ok("abort_request", "POST", "/abort_request", body={"abort_all": True}, timeout=timeout)

    async def continue_generation(self, timeout: float | None = None) -> None:
        await self._ok("continue_generation", "POST", "/continue_generation", body={}, timeout=timeout)

    async def flush_cache(self, server_wait_s: float, timeout: float | None = None) -> bool:
        """True once SGLang flushed (it was idle). `server_wait_s` is sent as ?timeout= where supported;
        the caller passes 0 when the deferred form cannot succeed (after a retract, C-IDLE-FLUSH-DEFERRED).
        A 400 is "not idle" on every version, 0.5.6 included, whose 400 carries the success text
        (C-ROUTE-FLUSH)."""
        params = (
            {"timeout": f"{server_wait_s:.3f}"}
            if self.q().flush_takes_timeout and server_wait_s > 0
            else None
        )
        status, body, text = await self._call(
            "flush_cache", "POST", "/flush_cache", params=params, timeout=timeout
        )
        if status == 200:
            return True
        if status == 400:
            return False  # not idle yet / another flush in progress / timed out waiting
        raise EngineError("flush_cache", status, _message(body, text))

    # --- memory ----------------------------------------------------------------------------------

    async def release(self, tags: list[str], timeout: float | None = None) -> None:
        await self._ok(
            "release_memory_occupation",
            "POST",
            "/release_memory_occupation",
            body={"tags": tags},
            timeout=timeout,
        )

    async def resume(self, tags: list[str], timeout: float | None = None) -> None:
        await self._ok(
            "resume_memory_occupation",
            "POST",
            "/resume_memory_occupation",
            body={"tags": tags},
            timeout=timeout,
        )

    # --- refit -----------------------------------------------------------------------------------

    async def update_weights_from_disk(self, path: str, version: str, timeout: float | None = None) -> str:
        body = {"model_path": path, "weight_version": version, "flush_cache": True}
        return await self._refit("update_weights_from_disk", "/update_weights_from_disk", body, timeout)

    async def begin_weight_update(self, timeout: float | None = None) -> str:
        return await self._refit("begin_weight_update", "/begin_weight_update", {}, timeout)

    async def end_weight_update(self, timeout: float | None = None) -> str:
        return await self._refit("end_weight_update", "/end_weight_update", {}, timeout)

    async def update_weights_from_tensor(
        self, tensors: list[str], load_format: str | None, version: str | None, timeout: float | None = None
    ) -> str:
        body: dict[str, Any] = {"serialized_named_tensors": tensors, "flush_cache": False}
        if load_format is not None:
            body["load_format"] = load_format
        if version is not None:
            body["weight_version"] = version
        return await self._refit("update_weights_from_tensor", "/update_weights_from_tensor", body, timeout)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        version: str | None,
        timeout: float | None = None,
    ) -> str:
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": False,
        }
        if version is not None:
            body["weight_version"] = version
        return await self._refit(
            "update_weights_from_distributed", "/update_weights_from_distributed", body, timeout
        )

    async def init_weights_update_group(self, body: dict[str, Any], timeout: float | None = None) -> str:
        return await self._refit("init_weights_update_group", "/init_weights_update_group", body, timeout)

    async def weights_checksum(self, timeout: float | None = None) -> dict[str, Any]:
        """C-ROUTE-CHECKER, C-CHECKER-CHECKSUM (from 0.5.15.post1, `quirks.checker_checksum`): `POST
        /weights_checker {"action": "checksum"}`, one scheduler call in which every GPU hashes every
        parameter it holds; the reply `{success, message, ranks: [{checksums: {name: hex16},
        per_gpu_checksum, parallelism_info}], per_engine_checksum}`. Never while weights are released: the
        hash reads the parameters' memory (C-CHECKER-RELEASED)."""
        reply = await self._ok(
            "weights_checker", "POST", "/weights_checker", body={"action": "checksum"}, timeout=timeout
        )
        if not isinstance(reply, dict) or reply.get("success") is not True:
            raise EngineError("weights_checker", 200, _message(reply, str(reply)[:500]))
        return reply

    # --- health and load -------------------------------------------------------------------------

    async def generate_probe(self, timeout: float) -> None:
        """C-RESUME-PROBE: one greedy token from token id 0, what `/health_generate` submits, without its
        1 s sleep (C-HEALTH-GENERATE); `log_metrics: false` keeps it out of the rollout's token counters.
        Sent while paused it waits in the tokenizer until continue_generation (C-PAUSE-GENERATE-WAITS)."""
        body = {
            "input_ids": [0],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "log_metrics": False,
        }
        reply = await self._ok("generate_probe", "POST", "/generate", body=body, timeout=timeout)
        if not isinstance(reply, dict) or not reply.get("output_ids"):
            raise EngineError("generate_probe", 200, f"no token generated: {str(reply)[:200]}")

    @property
    def load_route(self) -> str:
        """C-METRIC-LOAD-ROUTE's route, or `/get_load` once `/v1/loads` answered 500 on a version that still
        has the shim (C-METRIC-LOAD-ASGI)."""
        return self._load_route or self.q().load_route

    async def _loads(self, operation: str, timeout: float | None, *, core: bool) -> tuple[str, Any]:
        route = self.load_route
        params = {"include": "core"} if core and route == "/v1/loads" else None
        status, body, text = await self._call(operation, "GET", route, params=params, timeout=timeout)
        if status == 500 and route == "/v1/loads" and self.q().has_get_load_shim:
            log.warning(
                "/v1/loads answered 500 (%s): reading /get_load from now on (C-METRIC-LOAD-ASGI)",
                _message(body, text)[:200],
            )
            self._load_route = "/get_load"
            return await self._loads(operation, timeout, core=core)
        if status != 200:
            raise EngineError(operation, status, _message(body, text))
        return route, body

    async def rank_loads(self, timeout: float | None = None) -> list[tuple[int, int, int]]:
        """(dp_rank, running, waiting) per DP rank (C-METRIC-LOAD-ROUTE): `/v1/loads?include=core` entries,
        or 0.5.6's `/get_load` list, whose `num_reqs` is running + waiting."""
        route, body = await self._loads("rank_loads", timeout, core=True)
        items = body.get("loads") if isinstance(body, dict) else body
        if not isinstance(items, list) or not items:
            raise EngineError("rank_loads", 200, f"{route} returned no per-rank loads")
        ranks: list[tuple[int, int, int]] = []
        try:
            for i, x in enumerate(items):
                rank = int(x.get("dp_rank", i))
                waiting = int(x["num_waiting_reqs"])
                if "num_running_reqs" in x:
                    running = int(x["num_running_reqs"])
                else:
                    running = int(x["num_reqs"]) - waiting
                ranks.append((rank, running, waiting))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise EngineError("rank_loads", 200, f"{route}: unexpected entry: {e}") from e
        return ranks

    async def scheduler_probe(self, timeout: float) -> bool:
        """C-DEATH-HARD: one bounded `/get_load`, answered by the scheduler even while paused
        (C-DP-LOADS-PAUSED). True: the scheduler answered; TimeoutError: it did not. False: not sent,
        because a /get_load is still outstanding (once the scheduler is dead they all hang)."""
        if self._get_load_outstanding:
            return False
        self._get_load_outstanding = True
        try:
            await self._call("scheduler_probe", "GET", "/get_load", timeout=timeout)
        finally:
            self._get_load_outstanding = False
        return True

    async def load(self, timeout: float = 5.0) -> dict[str, float | None]:
        """cache_hit_rate (mean), gen_throughput, running and waiting requests (sums) over the DP ranks; None
        where the version has none (0.5.6's /get_load has counts only). Without --enable-metrics the two
        rates are SGLang's 0.0 defaults, not measurements (C-METRIC-OFF): the caller asks `metrics`."""
        keys = ("cache_hit_rate", "gen_throughput", "running", "waiting")
        none: dict[str, float | None] = dict.fromkeys(keys)
        scheduler_bound = self.q().load_route == "/get_load"  # 0.5.6: share the probe's one-outstanding rule
        if scheduler_bound:
            if self._get_load_outstanding:
                return none
            self._get_load_outstanding = True
        try:
            _, body = await self._loads("load", timeout, core=False)
        finally:
            if scheduler_bound:
                self._get_load_outstanding = False
        loads = body.get("loads", []) if isinstance(body, dict) else body
        if not isinstance(loads, list) or not loads:
            return none
        return _summed_loads([x for x in loads if isinstance(x, dict)])

    async def metrics(self, timeout: float = 5.0) -> dict[str, float] | None:
        """`/metrics` summed per series (parse_metrics), or None when the server has none (a 404): SGLang
        mounts it only with --enable-metrics (C-METRIC-PROM, C-METRIC-OFF)."""
        status, _, text = await self._call("metrics", "GET", "/metrics", timeout=timeout)
        if status == 404:
            return None
        if status != 200:
            raise EngineError("metrics", status, text[:500])
        return parse_metrics(text)
