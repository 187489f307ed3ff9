"""Minimal JSON-over-HTTP client for the agent's loopback trainer API (stdlib only: trainers are sync
code in their own images, and should not need our dependencies). One kept-alive connection per thread:
a refit sends one request per bucket, and a new connection per request costs more than the request."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.parse
from typing import Any

DEFAULT_AGENT_URL = "http://127.0.0.1:8472"
# Reopen a connection idle this long: the agent's server (aiohttp) closes idle ones after 75 s, and a
# request written into a connection the server is closing fails with no way to tell if it was handled.
IDLE_REOPEN_S = 20.0
# The agent is a native sidecar: the kubelet restarts it (backoff 10 s, 20 s, ... after the first) and it
# continues from its record. Meanwhile a call waits for it this long when it is safe to send again: it was
# refused at connect (never sent), or it is safe to repeat.
RESTART_GRACE_S = float(os.environ.get("RLJOB_AGENT_RESTART_GRACE_SECONDS", "60"))
# Safe to repeat: every GET, asking for the GPU (a second request keeps the first), and publishing the
# same version again (the agent answers a repeat of its last publish with the same report).
RETRIED_POSTS = frozenset({"/v1/trainer/request", "/v1/trainer/publish"})


class AgentError(RuntimeError):
    """The agent refused (409 with a reason) or failed a trainer call."""

    def __init__(self, status: int, error: str, reason: str) -> None:
        super().__init__(f"agent answered {status} {error}: {reason}")
        self.status, self.error, self.reason = status, error, reason


class AgentUnavailable(RuntimeError):
    """The agent did not answer (not started yet, or gone)."""


class _NotSent(Exception):
    """The request could not be written on a reused connection: safe to send again on a new one."""


class AgentClient:
    def __init__(self, url: str | None = None, timeout_s: float = 60.0) -> None:
        self.url = (url or os.environ.get("RLJOB_AGENT_URL") or DEFAULT_AGENT_URL).rstrip("/")
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"agent URL must be http://host:port, not {self.url!r}")
        self._host, self._port = parsed.hostname, parsed.port or 80
        self._prefix = parsed.path.rstrip("/")
        self.timeout_s = timeout_s
        self._local = threading.local()

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        query: dict[str, Any] | None = None,
    ) -> Any:
        """One request. A `wait` query parameter (server-side long-poll) is added to the socket timeout.
        A request safe to repeat is retried while the agent restarts (RESTART_GRACE_S)."""
        repeatable = method == "GET" or path in RETRIED_POSTS
        deadline = time.monotonic() + RESTART_GRACE_S
        while True:
            try:
                return self._call_once(method, path, body, query)
            except AgentUnavailable as e:
                unsent = isinstance(e.__cause__, ConnectionRefusedError)
                if not (repeatable or unsent) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def _call_once(
        self, method: str, path: str, body: dict[str, Any] | None, query: dict[str, Any] | None
    ) -> Any:
        query = {k: v for k, v in (query or {}).items() if v is not None}
        wait = float(query.get("wait", 0))
        target = self._prefix + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        try:
            try:
                status, raw = self._send(method, target, data, self.timeout_s + wait, reuse=True)
            except _NotSent:
                status, raw = self._send(method, target, data, self.timeout_s + wait, reuse=False)
        except (OSError, http.client.HTTPException) as e:
            raise AgentUnavailable(f"{method} {self.url}{target}: {e}") from e
        if status >= 400:
            try:
                parsed = json.loads(raw)
                raise AgentError(
                    status, parsed.get("error", "?"), parsed.get("reason", raw.decode()[:500])
                ) from None
            except (ValueError, AttributeError):
                raise AgentError(status, "HTTPError", raw.decode(errors="replace")[:500]) from None
        return json.loads(raw or b"null")

    def _send(
        self, method: str, target: str, data: bytes | None, timeout: float, *, reuse: bool
    ) -> tuple[int, bytes]:
        local = self._local
        conn: http.client.HTTPConnection | None = getattr(local, "conn", None)
        fresh = conn is None or not reuse or time.monotonic() - getattr(local, "used_at", 0.0) > IDLE_REOPEN_S
        if fresh:
            if conn is not None:
                conn.close()
            conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
            local.conn = conn
        assert conn is not None
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        headers = {"Content-Type": "application/json"}
        try:
            conn.request(method, target, body=data, headers=headers)
        except (BrokenPipeError, ConnectionResetError) as e:
            conn.close()
            local.conn = None
            if fresh:
                raise
            raise _NotSent() from e
        except BaseException:  # e.g. refused at connect: the connection must not be reused half-sent
            conn.close()
            local.conn = None
            raise
        try:
            resp = conn.getresponse()
            raw = resp.read()
        except http.client.RemoteDisconnected as e:
            # Nothing came back on a reused connection: the server had closed it before reading (an
            # answer would have come first). On a new connection it is a real failure.
            conn.close()
            local.conn = None
            if fresh:
                raise
            raise _NotSent() from e
        except BaseException:
            conn.close()
            local.conn = None
            raise
        local.used_at = time.monotonic()
        if resp.will_close:
            conn.close()
            local.conn = None
        return resp.status, raw
