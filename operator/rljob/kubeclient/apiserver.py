"""HTTP to the API server: JSON in, bytes out, nothing else. `ApiServer.call` in the event loop (aiohttp,
one keep-alive session per loop), `ApiServer.call_sync` from threads and before the loop runs (the leader
election, the start-up /version, the kubectl plugin; http.client, one kept-alive connection). Both pass
every call's verb and request body size to the `on_call` hook its builder gave (the operator counts
them), raise ApiError for an answer >= 400, try a connection that broke once more on a new one (a
kept-alive connection the server closed fails the first write), and take credentials again once after a
401 (a rotated token, an expired exec credential).

Not the generated client's calls (its configuration loaders give the credentials: credentials.py): its
validation and model building cost more of the operator's CPU than the call itself."""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

import aiohttp

from rljob.kubeclient.credentials import Credentials

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    """The API server answered >= 400. `body` is its answer (a Status, as text)."""

    def __init__(self, status: int, reason: str, body: str = "") -> None:
        super().__init__(f"HTTP {status} {reason}")
        self.status = status
        self.reason = reason
        self.body = body

    def status_object(self) -> dict[str, Any]:
        """The answer as a Status object; {'message': text} when it is not JSON."""
        try:
            status = json.loads(self.body or "{}")
        except ValueError:
            return {"message": self.body or self.reason}
        return status if isinstance(status, dict) else {"message": str(status)}


def _url_path(path: str, query: dict[str, str] | None) -> str:
    return f"{path}?{urllib.parse.urlencode(query)}" if query else path


def _encoded(body: Any) -> bytes | None:
    return None if body is None else json.dumps(body, separators=(",", ":")).encode()


def _uncounted(verb: str, sent: int) -> None:
    """The hook of a client whose builder counts nothing (the kubectl plugin, tests)."""


class _Attempts:
    """What one call may try again, the same in the event loop and in threads: a connection that broke,
    once (a kept-alive one the server closed fails the first write), and a 401, once, after asking the
    credentials again (a rotated token, an expired exec credential)."""

    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials
        self._broke = self._denied = False

    def once_more(self) -> bool:
        """After a broken connection: True the first time (try a new one), False after that (raise)."""
        again, self._broke = not self._broke, True
        return again

    def answer(self, status: int, reason: str | None, answer: bytes) -> bytes | None:
        """The answer to return; None to send the request again; ApiError for one >= 400."""
        if status == 401 and not self._denied:
            self._denied = True
            self._credentials.invalidate()
            return None
        if status >= 400:
            raise ApiError(status, reason or "", answer.decode(errors="replace"))
        return answer


class _TLSConnection(http.client.HTTPSConnection):
    """Checks the certificate against `server_name` (kubeconfig's tls-server-name) where that is not the
    host connected to (an address, a proxy's tunnel)."""

    def __init__(self, *args: Any, server_name: str | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # the TCP connection, and the proxy's tunnel
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._server_name)  # type: ignore[attr-defined]


OnCall = Callable[[str, int], None]
"""Called with the caller's verb and the request body's bytes once a call, before its first try (a retry
is the same call)."""


class ApiServer:
    TIMEOUT_SECONDS = 60.0  # the API server's own request timeout is 60 s

    def __init__(self, credentials: Credentials, on_call: OnCall = _uncounted) -> None:
        self.credentials = credentials
        self.on_call = on_call
        self.url = urllib.parse.urlsplit(credentials.server)
        self._ssl: ssl.SSLContext | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sync: http.client.HTTPConnection | None = None
        self._sync_lock = threading.Lock()

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.url.scheme != "https":
            return None
        if self._ssl is None:
            c = self.credentials
            c.bearer()  # an exec plugin may give the client certificate
            ctx = ssl.create_default_context(cafile=c.ca_path)
            if c.insecure:
                ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            if c.certificate_path:
                ctx.load_cert_chain(c.certificate_path, c.private_key_path)
            self._ssl = ctx
        return self._ssl

    def _headers(self, content_type: str) -> dict[str, str]:
        return {**self.credentials.headers(), "Content-Type": content_type, "Accept": JSON}

    # --- in the event loop -----------------------------------------------------------------------

    def _open(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self.ssl_context() or False)
            timeout = aiohttp.ClientTimeout(total=self.TIMEOUT_SECONDS, connect=10)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
            self._loop = loop
        return self._session

    async def call(
        self,
        verb: str,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        content_type: str = JSON,
    ) -> bytes:
        data = _encoded(body)
        self.on_call(verb, len(data or b""))
        url = self.credentials.server + _url_path(path, query)
        attempts = _Attempts(self.credentials)
        while True:
            try:
                async with self._open().request(
                    method,
                    url,
                    data=data,
                    headers=self._headers(content_type),
                    server_hostname=self.credentials.tls_server_name,
                    proxy=self.credentials.proxy_url,
                ) as resp:
                    answer = await resp.read()
            except aiohttp.ClientConnectionError:
                if attempts.once_more():
                    continue
                raise
            if (taken := attempts.answer(resp.status, resp.reason, answer)) is not None:
                return taken

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()

    # --- from threads ----------------------------------------------------------------------------

    def _connection(self) -> http.client.HTTPConnection:
        if self._sync is None:
            proxy = urllib.parse.urlsplit(self.credentials.proxy_url) if self.credentials.proxy_url else None
            host, port = (proxy or self.url).hostname or "", (proxy or self.url).port
            if self.url.scheme == "https":
                conn: http.client.HTTPConnection = _TLSConnection(
                    host,
                    port,
                    timeout=self.TIMEOUT_SECONDS,
                    context=self.ssl_context(),
                    server_name=self.credentials.tls_server_name or self.url.hostname,
                )
            else:
                conn = http.client.HTTPConnection(host, port, timeout=self.TIMEOUT_SECONDS)
            if proxy is not None:
                conn.set_tunnel(self.url.hostname or "", self.url.port)
            self._sync = conn
        return self._sync

    def call_sync(
        self,
        verb: str,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        content_type: str = JSON,
    ) -> bytes:
        data = _encoded(body)
        self.on_call(verb, len(data or b""))
        target = (self.url.path.rstrip("/") + _url_path(path, query)) or "/"
        attempts = _Attempts(self.credentials)
        with self._sync_lock:
            while True:
                conn = self._connection()
                try:
                    conn.request(method, target, body=data, headers=self._headers(content_type))
                    resp = conn.getresponse()
                    answer = resp.read()
                except (OSError, http.client.HTTPException):
                    conn.close()
                    self._sync = None
                    if attempts.once_more():
                        continue
                    raise
                if (taken := attempts.answer(resp.status, resp.reason, answer)) is not None:
                    return taken
