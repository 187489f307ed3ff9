"""Where the API server is and who the operator is to it (kubeclient/credentials.py), read by the
`kubernetes` library's loaders: a pod's ServiceAccount; a kubeconfig's current context over several files,
the first to name an entry winning, paths relative to their file, inline data as private files; an exec
credential plugin run again when its credential expires or a 401 asks; and kopf's login from the same."""

from __future__ import annotations

import base64
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.kubeclient.credentials import ASK_SECONDS, ConfigError, Credentials


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path


def kubeconfig(
    current: str | None,
    contexts: list[tuple[str, str, str, str | None]],
    clusters: dict[str, Any],
    users: dict[str, Any],
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        **({"current-context": current} if current else {}),
        "contexts": [
            {"name": n, "context": {"cluster": c, "user": u, **({"namespace": ns} if ns else {})}}
            for n, c, u, ns in contexts
        ],
        "clusters": [{"name": n, "cluster": c} for n, c in clusters.items()],
        "users": [{"name": n, "user": u} for n, u in users.items()],
    }


def test_the_first_file_to_name_an_entry_wins_and_paths_are_relative_to_their_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = write(
        tmp_path / "a" / "config",
        kubeconfig(
            "dev",
            [("dev", "c1", "u1", "team")],
            {
                "c1": {
                    "server": "https://one:6443/",
                    "certificate-authority": "ca.crt",
                    "tls-server-name": "api",
                }
            },
            {"u1": {"client-certificate": "u.crt", "client-key": "u.key"}},
        ),
    )
    second = write(
        tmp_path / "b" / "config",
        kubeconfig(
            "other",
            [("dev", "c2", "u2", None), ("other", "c2", "u2", None)],
            {"c1": {"server": "https://shadowed"}, "c2": {"server": "http://two:8080"}},
            {"u2": {"token": "t2"}},
        ),
    )
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([str(first), str(tmp_path / "missing"), str(second)]))
    for name in ("ca.crt", "u.crt", "u.key"):
        (tmp_path / "a" / name).write_text(name)
    # The library takes the current-context of the last file that sets one (client-go: the first):
    # docs/install.md says so; a context named explicitly is the same for both.
    assert Credentials.load().server == "http://two:8080"
    c = Credentials.load(context="dev")
    assert (c.server, c.namespace, c.tls_server_name) == ("https://one:6443", "team", "api")
    assert c.ca_path == str(tmp_path / "a" / "ca.crt")
    assert (c.certificate_path, c.private_key_path) == (
        str(tmp_path / "a" / "u.crt"),
        str(tmp_path / "a" / "u.key"),
    )
    other = Credentials.load(context="other")
    assert (other.server, other.bearer(), other.namespace) == ("http://two:8080", "t2", None)


def test_inline_data_becomes_private_files(tmp_path: Path) -> None:
    data = {"ca": b"-----BEGIN CERTIFICATE-----\nCA\n", "crt": b"CRT", "key": b"KEY"}
    b64 = {k: base64.b64encode(v).decode() for k, v in data.items()}
    path = write(
        tmp_path / "config",
        kubeconfig(
            "k",
            [("k", "c", "u", None)],
            {
                "c": {
                    "server": "https://k",
                    "certificate-authority-data": b64["ca"],
                    "insecure-skip-tls-verify": True,
                }
            },
            {"u": {"client-certificate-data": b64["crt"], "client-key-data": b64["key"]}},
        ),
    )
    c = Credentials.from_kubeconfig(str(path))
    assert c.insecure and c.ca_path and c.certificate_path and c.private_key_path
    assert Path(c.ca_path).read_bytes() == data["ca"] and Path(c.private_key_path).read_bytes() == data["key"]
    assert stat.S_IMODE(Path(c.private_key_path).stat().st_mode) == 0o600


def test_a_kubeconfig_that_names_nothing_usable_is_a_config_error(tmp_path: Path) -> None:
    path = write(
        tmp_path / "config", kubeconfig(None, [("k", "c", "u", None)], {"c": {"server": "https://k"}}, {})
    )
    with pytest.raises(ConfigError, match="current-context"):
        Credentials.from_kubeconfig(str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        Credentials.from_kubeconfig(str(tmp_path / "nope"))
    missing_cluster = write(tmp_path / "c2", kubeconfig("k", [("k", "gone", "u", None)], {}, {}))
    with pytest.raises(ConfigError, match="gone"):
        Credentials.from_kubeconfig(str(missing_cluster))


def test_in_a_pod_the_service_account_is_used(tmp_path: Path) -> None:
    root = tmp_path / "sa"
    root.mkdir()
    (root / "token").write_text("sa-token")  # the kubelet writes it with no newline
    (root / "ca.crt").write_text("CA")
    (root / "namespace").write_text("rljob-system")
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    c = Credentials.in_cluster(env, root)
    assert c is not None
    assert (c.server, c.ca_path, c.namespace) == (
        "https://[fd00::1]:443",
        str(root / "ca.crt"),
        "rljob-system",
    )
    assert c.headers() == {"Authorization": "bearer sa-token"} and c.bearer() == "sa-token"
    assert Credentials.in_cluster({}, root) is None
    assert Credentials.in_cluster(env, tmp_path / "elsewhere") is None


def test_basic_auth_when_there_is_no_token(tmp_path: Path) -> None:
    path = write(
        tmp_path / "config",
        kubeconfig(
            "k",
            [("k", "c", "u", None)],
            {"c": {"server": "https://k"}},
            {"u": {"username": "admin", "password": "pw"}},
        ),
    )
    c = Credentials.from_kubeconfig(str(path))
    assert c.headers() == {"Authorization": "Basic " + base64.b64encode(b"admin:pw").decode()}
    assert c.bearer() is None


def exec_plugin(tmp_path: Path, expires: str | None, fail: bool = False) -> Path:
    """A credential plugin that counts its runs and hands out token-<run>."""
    script = tmp_path / "bin" / "credential-plugin"
    script.parent.mkdir(exist_ok=True)
    status: dict[str, Any] = {}
    if expires:
        status["expirationTimestamp"] = expires
    script.write_text(
        f"""#!{sys.executable}
import json, os, pathlib, sys
count = pathlib.Path({str(tmp_path / "runs")!r})
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
assert info["kind"] == "ExecCredential" and os.environ["PLUGIN_REGION"] == "eu", info
if {fail!r}:
    print("no credentials for you", file=sys.stderr)
    sys.exit(3)
print(json.dumps({{"apiVersion": info["apiVersion"], "kind": "ExecCredential",
                  "status": {{"token": f"token-{{n}}", **{status!r}}}}}))
"""
    )
    script.chmod(0o755)
    return write(
        tmp_path / "config",
        kubeconfig(
            "k",
            [("k", "c", "u", None)],
            {"c": {"server": "https://k"}},
            {
                "u": {
                    "exec": {
                        "apiVersion": "client.authentication.k8s.io/v1",
                        "command": "./bin/credential-plugin",  # relative to the kubeconfig's folder
                        "args": [],
                        "env": [{"name": "PLUGIN_REGION", "value": "eu"}],
                    }
                }
            },
        ),
    )


def test_an_exec_plugin_runs_once_until_asked_again(tmp_path: Path) -> None:
    c = Credentials.from_kubeconfig(str(exec_plugin(tmp_path, expires=None)))
    assert [c.bearer(), c.bearer()] == ["token-1", "token-1"]
    c.invalidate()  # a 401
    assert c.bearer() == "token-2" and (tmp_path / "runs").read_text() == "2"


def test_an_exec_credential_is_renewed_once_it_expired(tmp_path: Path) -> None:
    now = [0.0]
    c = Credentials.from_kubeconfig(str(exec_plugin(tmp_path, expires="2020-01-01T00:00:00Z")))
    c.clock = lambda: now[0]
    assert [c.bearer(), c.bearer()] == ["token-2", "token-2"]  # asked once per ASK_SECONDS
    now[0] += ASK_SECONDS
    assert c.bearer() == "token-3"  # already expired: every ask runs the plugin again
    later = Credentials.from_kubeconfig(str(exec_plugin(tmp_path, expires="2999-01-01T00:00:00Z")))
    later.clock = lambda: now[0]
    first = later.bearer()
    now[0] += ASK_SECONDS
    assert [first, later.bearer()] == ["token-4", "token-4"]


def test_a_failing_exec_plugin_is_a_config_error_with_its_words(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no credentials for you"):
        Credentials.from_kubeconfig(str(exec_plugin(tmp_path, expires=None, fail=True)))


def test_kopf_logs_in_with_the_operators_credentials(tmp_path: Path) -> None:
    import kopf

    from rljob.controller.handlers import login
    from rljob.controller.kube import Kube
    from rljob.kubeclient.apiserver import ApiServer

    token = tmp_path / "token"
    token.write_text("first")
    (tmp_path / "ca.crt").write_text("CA")
    path = write(
        tmp_path / "config",
        kubeconfig(
            "k",
            [("k", "c", "u", "ops")],
            {"c": {"server": "https://k:6443", "certificate-authority": "ca.crt"}},
            {"u": {"tokenFile": "token"}},
        ),
    )
    c = Credentials.from_kubeconfig(str(path))
    memo = kopf.Memo(kube=Kube(ApiServer(c)))
    info = login(memo=memo)
    assert (info.server, info.ca_path, info.scheme, info.token, info.default_namespace) == (
        "https://k:6443",
        str(tmp_path / "ca.crt"),
        "Bearer",
        "first",
        "ops",
    )
    token.write_text("rotated")
    assert login(memo=memo).token == "rotated"  # kopf asks again after a 401: the file is read again
