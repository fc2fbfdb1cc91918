"""What the HTTP clients take from the environment, against servers on 127.0.0.1.

The sessions the clients make do not re-read the environment on every call
(requests' ``trust_env``): the Horde client takes its proxy and CA bundle once,
when it is made, and koboldcpp (local) is reached without a proxy. Neither
ever sends ``.netrc`` credentials. Nothing here reaches a public host: the
``.invalid`` Horde is only ever named to a proxy on 127.0.0.1.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from koboldcpp_horde_chat.errors import BackendError, HordeUnavailable
from koboldcpp_horde_chat.horde.client import HordeClient
from koboldcpp_horde_chat.koboldcpp.client import KoboldClient
from tests.http_server import LocalServer, send_json

KEY = "env-test-key-0123456789"
AGENT = "koboldcpp-horde-chat:test"
POP_BODY = {"name": "w", "models": ["koboldcpp/m"]}
IDLE = {"id": None, "idle": 1}
PROXY_VARIABLES = (
    "http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY",
    "no_proxy", "NO_PROXY", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NETRC",
)  # fmt: skip


def recorder(tls: ssl.SSLContext | None = None) -> LocalServer:
    """An HTTP server on 127.0.0.1 that answers every request with a JSON object
    and keeps each request line's target and headers (a proxy sees the whole URL)."""
    return LocalServer(lambda handler, _body: send_json(handler, 200, IDLE), tls=tls)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No proxy, CA or netrc variables from the machine; HOME without a .netrc."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return monkeypatch


@pytest.fixture
def server() -> Iterator[LocalServer]:
    with recorder() as local:
        yield local


def dead_proxy() -> str:
    """An http:// proxy URL on a 127.0.0.1 port where nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def netrc_for_localhost(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "netrc"
    path.write_text("machine 127.0.0.1 login netrc-user password netrc-secret\n")
    path.chmod(0o600)
    env.setenv("NETRC", str(path))


# --- the Horde client ---------------------------------------------------------------------------


def test_the_horde_is_reached_through_the_proxy_set_when_the_client_is_made(
    env: pytest.MonkeyPatch, server: LocalServer
) -> None:
    env.setenv("http_proxy", server.url)
    client = HordeClient("http://horde.invalid", KEY, bridge_agent=AGENT)
    env.delenv("http_proxy")
    assert client.pop(POP_BODY, timeout_s=5) == {"id": None, "idle": 1}
    ((target, headers),) = server.seen
    assert target == "http://horde.invalid/api/v2/generate/text/pop"
    assert headers["apikey"] == KEY


def test_no_proxy_set_when_the_client_is_made_keeps_the_horde_direct(
    env: pytest.MonkeyPatch, server: LocalServer
) -> None:
    env.setenv("http_proxy", dead_proxy())
    env.setenv("no_proxy", "127.0.0.1")
    client = HordeClient(server.url, KEY, bridge_agent=AGENT)
    env.delenv("no_proxy")  # read once: a later change is not seen
    assert client.pop(POP_BODY, timeout_s=5)["id"] is None


def test_a_proxy_set_after_the_client_was_made_is_not_used(
    env: pytest.MonkeyPatch, server: LocalServer
) -> None:
    client = HordeClient(server.url, KEY, bridge_agent=AGENT)
    env.setenv("http_proxy", dead_proxy())
    assert client.pop(POP_BODY, timeout_s=5)["id"] is None
    assert [target for target, _ in server.seen] == ["/api/v2/generate/text/pop"]


def test_netrc_credentials_never_reach_the_horde(
    env: pytest.MonkeyPatch, server: LocalServer, tmp_path: Path
) -> None:
    netrc_for_localhost(env, tmp_path)
    client = HordeClient(server.url, KEY, bridge_agent=AGENT)
    client.pop(POP_BODY, timeout_s=5)
    client.submit({"id": "j1", "state": "faulted", "model_id": "m"}, timeout_s=5)
    assert len(server.seen) == 2
    assert all("authorization" not in headers for _, headers in server.seen)


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


@pytest.mark.parametrize("variable", ["REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"])
def test_a_private_ca_bundle_still_verifies_the_horde(
    env: pytest.MonkeyPatch, tmp_path: Path, variable: str
) -> None:
    cert, key = _self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    with recorder(tls) as horde:
        with pytest.raises(HordeUnavailable, match="TLS failure"):
            HordeClient(horde.url, KEY, bridge_agent=AGENT).pop(POP_BODY, timeout_s=5)
        env.setenv(variable, str(cert))
        assert HordeClient(horde.url, KEY, bridge_agent=AGENT).pop(POP_BODY, timeout_s=5) == {
            "id": None, "idle": 1,
        }


# --- koboldcpp --------------------------------------------------------------------------------


def test_koboldcpp_is_reached_without_the_proxy_variables(
    env: pytest.MonkeyPatch, server: LocalServer
) -> None:
    env.setenv("http_proxy", dead_proxy())
    env.setenv("all_proxy", dead_proxy())
    client = KoboldClient(server.url)
    assert client.perf(timeout_s=5) == {"id": None, "idle": 1}
    env.setenv("HTTP_PROXY", dead_proxy())
    client.perf(timeout_s=5)
    assert [target for target, _ in server.seen] == ["/api/extra/perf"] * 2


def test_netrc_credentials_never_reach_koboldcpp(
    env: pytest.MonkeyPatch, server: LocalServer, tmp_path: Path
) -> None:
    netrc_for_localhost(env, tmp_path)
    KoboldClient(server.url).perf(timeout_s=5)
    KoboldClient(server.url, "pw").abort("HORDEREQ_1", timeout_s=5)
    assert server.seen[0][1].get("authorization") is None
    assert server.seen[1][1]["authorization"] == "Bearer pw"  # its own password only


def test_a_session_passed_to_the_kobold_client_is_used_as_it_is(
    env: pytest.MonkeyPatch, server: LocalServer
) -> None:
    env.setenv("http_proxy", dead_proxy())
    with pytest.raises(BackendError, match="connection failed"):
        KoboldClient(server.url, session=requests.Session()).perf(timeout_s=5)
    assert server.seen == []
