"""The agent's only way to talk to vLLM: one method per route it uses (their bodies per version), every call
timed by operation, transport failures told apart from vLLM's answers. Rows: docs/vllm-conformance.md."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rljob.agent.engines.base import EngineError
from rljob.agent.engines.transport import EngineHTTP
from rljob.agent.engines.vllm.quirks import VLLMQuirks

PROBE_PROMPT = [0]  # one token id, the least a completion can take


def message(body: Any, text: str) -> str:
    """V-ROUTE-ERRORS: `{"error": {"message", ...}}`, or `{"error": str}` from the pause routes."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            return str(error.get("message", text))
        if error is not None:
            return str(error)
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
    return text[:500]


class VLLMClient(EngineHTTP[VLLMQuirks]):
    name = "vLLM"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        call_timeout_s: float,
        observe: Callable[[str, float], None],
    ) -> None:
        super().__init__(base_url, call_timeout_s=call_timeout_s, observe=observe)
        # V-ROUTE-AUTH: --api-key guards only /v1, /v2 and /inference paths; sent with every call anyway.
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # quirks: set once /version answered.

    def headers(self, path: str) -> Mapping[str, str]:
        return self._auth

    def message(self, body: Any, text: str) -> str:
        return message(body, text)

    # --- discovery -------------------------------------------------------------------------------------

    async def version(self, timeout: float | None = None) -> str:
        """V-ROUTE-VERSION: `{"version": "0.26.0"}`, served without the dev routes."""
        body = await self._ok("version", "GET", "/version", timeout=timeout)
        if not isinstance(body, dict) or "version" not in body:
            raise EngineError("version", 200, "no version in /version")
        return str(body["version"])

    async def server_info(self, timeout: float | None = None) -> dict[str, Any] | None:
        """V-ROUTE-SERVER-INFO: `{"vllm_config", "vllm_env", "system_env"}` with the config as JSON; None
        when the route is absent (404: VLLM_SERVER_DEV_MODE is off, V-LAUNCH-DEVMODE)."""
        status, body, text = await self._call(
            "server_info", "GET", "/server_info", params=[("config_format", "json")], timeout=timeout
        )
        if status == 404:
            return None
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("vllm_config"), dict):
            raise EngineError("server_info", status, message(body, text))
        return body

    async def health(self, timeout: float = 5.0) -> int:
        """V-HEALTH: 200 while paused, asleep or blocked in a utility call; 503 once the engine core died."""
        status, _, _ = await self._call("health", "GET", "/health", timeout=timeout)
        return status

    # --- drain -----------------------------------------------------------------------------------------

    async def pause(self, mode: str, timeout: float | None = None) -> None:
        """V-ROUTE-PAUSE: answers once the drain finished on every DP rank (V-DRAIN-TIMING); `clear_cache`
        keeps its default, true (a `keep` pause then preempts running requests: V-DRAIN-KEEP)."""
        assert mode in ("abort", "wait", "keep"), mode
        await self._ok(
            "pause", "POST", "/pause", params=[("mode", mode), ("clear_cache", "true")], timeout=timeout
        )

    async def resume(self, timeout: float | None = None) -> None:
        """V-ROUTE-RESUME: unpauses whatever paused the scheduler, a sleep included (V-KILL-RESUME-ASLEEP):
        sent only while nothing sleeps."""
        await self._ok("resume", "POST", "/resume", timeout=timeout)

    async def is_paused(self, timeout: float | None = None) -> bool:
        body = await self._ok("is_paused", "GET", "/is_paused", timeout=timeout)
        return bool(isinstance(body, dict) and body.get("is_paused"))

    async def abort_all(self, timeout: float | None = None) -> None:
        """V-ROUTE-ABORT: `{}` aborts every request the API server tracks; it does not pause."""
        await self._ok("abort_requests", "POST", "/abort_requests", body={}, timeout=timeout)

    # --- memory ----------------------------------------------------------------------------------------

    async def sleep(self, level: int, mode: str, timeout: float | None = None) -> None:
        """V-ROUTE-SLEEP: query parameters; answers once every worker slept (V-MEM-REPLY-ALL)."""
        assert level in (1, 2), level  # level >= 3 loses the buffers for good on 0.26 (V-KILL-L3)
        await self._ok(
            "sleep", "POST", "/sleep", params=[("level", str(level)), ("mode", mode)], timeout=timeout
        )

    async def release_kv_cache(self, timeout: float | None = None) -> None:
        """V-ROUTE-RELEASE-KV (0.34): the KV cache alone, after a completed pause."""
        await self._ok("release_kv_cache_memory", "POST", "/release_kv_cache_memory", timeout=timeout)

    async def wake_up(self, tags: list[str], timeout: float | None = None) -> bool | None:
        """V-ROUTE-WAKE: one wake of `tags` (each once: V-MEM-WAKE-DUP-TAG). 0.34 says whether nothing
        sleeps any more (True), 0.26 answers nothing (None)."""
        body = await self._ok(
            "wake_up", "POST", "/wake_up", params=[("tags", t) for t in tags], timeout=timeout
        )
        if isinstance(body, dict) and "status" in body:
            return bool(body["status"] == "awake")
        return None

    # --- flush -----------------------------------------------------------------------------------------

    async def reset_prefix_cache(self, timeout: float | None = None) -> bool:
        """V-ROUTE-FLUSH: `success` false while any KV block is in use (V-KILL-FLUSH-HELD)."""
        body = await self._ok("reset_prefix_cache", "POST", "/reset_prefix_cache", timeout=timeout)
        return bool(isinstance(body, dict) and body.get("success") is True)

    # --- refit -----------------------------------------------------------------------------------------

    async def reload_weights(self, path: str, timeout: float | None = None) -> None:
        """V-REFIT-DISK: `/collective_rpc reload_weights` with the checkpoint's path; no RPC `timeout` (one
        that expires leaves the workers loading: V-ROUTE-RPC)."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        await self._ok("reload_weights", "POST", "/collective_rpc", body=body, timeout=timeout)

    async def init_weight_transfer(self, init_info: dict[str, Any], timeout: float | None = None) -> None:
        """V-ROUTE-WT-INIT."""
        body = {"init_info": init_info}
        await self._ok(
            "init_weight_transfer_engine", "POST", "/init_weight_transfer_engine", body=body, timeout=timeout
        )

    async def start_weight_update(self, timeout: float | None = None) -> None:
        """V-ROUTE-WT-SESSION."""
        await self._ok("start_weight_update", "POST", "/start_weight_update", timeout=timeout)

    async def update_weights(self, update_info: dict[str, Any], timeout: float | None = None) -> str:
        """V-ROUTE-WT-UPDATE: answers once every worker loaded the chunk."""
        body = await self._ok(
            "update_weights", "POST", "/update_weights", body={"update_info": update_info}, timeout=timeout
        )
        return str(body.get("message", "")) if isinstance(body, dict) else ""

    async def finish_weight_update(self, version: str | None, timeout: float | None = None) -> None:
        """V-ROUTE-WT-SESSION: from 0.27 the finish also labels the weights."""
        body = {"weight_version": version} if self.q().finish_takes_weight_version else None
        await self._ok("finish_weight_update", "POST", "/finish_weight_update", body=body, timeout=timeout)

    async def weight_version(self, timeout: float | None = None) -> str:
        """V-ROUTE-WV (0.34): `/weight_info`, the DP ranks' consensus."""
        body = await self._ok("weight_info", "GET", "/weight_info", timeout=timeout)
        if not isinstance(body, dict) or "weight_version" not in body:
            raise EngineError("weight_info", 200, "no weight_version in /weight_info")
        return str(body["weight_version"])

    async def update_weight_version(self, version: str, timeout: float | None = None) -> None:
        """V-ROUTE-WV (0.34)."""
        body = await self._ok(
            "update_weight_version",
            "POST",
            "/update_weight_version",
            body={"new_version": version},
            timeout=timeout,
        )
        if not isinstance(body, dict) or body.get("success") is not True:
            raise EngineError("update_weight_version", 200, message(body, str(body)))

    async def weight_checksums(self, timeout: float | None = None) -> dict[str, str]:
        """V-ROUTE-CHECKER, V-CHECKER-HASH (0.34): sha256 of every parameter of every worker, keyed
        `dp{D}:pp{P}:pcp{C}:tp{T}:{name}`."""
        body = await self._ok(
            "weight_checker", "POST", "/weight_checker", body={"action": "checksum"}, timeout=timeout
        )
        checksums = body.get("checksums") if isinstance(body, dict) else None
        if not isinstance(checksums, dict):
            raise EngineError("weight_checker", 200, f"no checksums in the reply: {str(body)[:200]}")
        return {str(k): str(v) for k, v in checksums.items()}

    # --- serving ---------------------------------------------------------------------------------------

    async def generate_probe(self, model: str, timeout: float) -> None:
        """One greedy token (§8 "a generation probe"): `/v1/completions` of token id 0."""
        body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0}
        reply = await self._ok("generate_probe", "POST", "/v1/completions", body=body, timeout=timeout)
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if (
            not choices
            or not isinstance(choices[0], dict)
            or choices[0].get("finish_reason")
            not in (
                "length",
                "stop",
            )
        ):
            raise EngineError("generate_probe", 200, f"no token generated: {str(reply)[:200]}")

    async def metrics(self, timeout: float = 5.0) -> str:
        """V-METRIC-PROM: always mounted."""
        status, _, text = await self._call("metrics", "GET", "/metrics", timeout=timeout)
        if status != 200:
            raise EngineError("metrics", status, text[:500])
        return text
