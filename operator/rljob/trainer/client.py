"""Minimal JSON-over-HTTP client for the agent's loopback trainer API (stdlib only: trainers are sync
code in their own images, and should not need our dependencies)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

DEFAULT_AGENT_URL = "http://127.0.0.1:8472"


class AgentError(RuntimeError):
    """The agent refused (409 with a reason) or failed a trainer call."""

    def __init__(self, status: int, error: str, reason: str) -> None:
        super().__init__(f"agent answered {status} {error}: {reason}")
        self.status, self.error, self.reason = status, error, reason


class AgentUnavailable(RuntimeError):
    """The agent did not answer (not started yet, or gone)."""


class AgentClient:
    def __init__(self, url: str | None = None, timeout_s: float = 60.0) -> None:
        self.url = (url or os.environ.get("RLJOB_AGENT_URL") or DEFAULT_AGENT_URL).rstrip("/")
        self.timeout_s = timeout_s

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        query: dict[str, Any] | None = None,
    ) -> Any:
        """One request. A `wait` query parameter (server-side long-poll) is added to the socket timeout."""
        query = {k: v for k, v in (query or {}).items() if v is not None}
        wait = float(query.get("wait", 0))
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s + wait) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                parsed = json.loads(raw)
                raise AgentError(
                    e.code, parsed.get("error", "?"), parsed.get("reason", raw.decode()[:500])
                ) from None
            except (ValueError, AttributeError):
                raise AgentError(e.code, "HTTPError", raw.decode(errors="replace")[:500]) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise AgentUnavailable(f"{method} {url}: {e}") from e
