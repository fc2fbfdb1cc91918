"""Network failures are said in a few words at every I/O edge, never in the HTTP library's text.

Real sockets on 127.0.0.1: a closed port (refused), a server that accepts and
closes without answering (reset), one that accepts and never answers (timed
out), and one that cuts its answer short.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from collections.abc import Callable, Iterator

import pytest
import requests
import urllib3.exceptions

from koboldcpp_horde_chat import netfail
from koboldcpp_horde_chat.errors import BackendError, FetchError, HordeUnavailable
from koboldcpp_horde_chat.horde.client import HordeClient
from koboldcpp_horde_chat.koboldcpp.client import KoboldClient
from koboldcpp_horde_chat.run.downloads import fetch_messages

KEY = "0123456789abcdefKEY"
PASSWORD = "kcpp-secret-pw"
JOB = "job-1"
SUBMIT_BODY = {"id": JOB, "generation": "Blue.", "state": "ok"}
PROGRESS_BODY = {"id": JOB, "seq": 1, "delta": {"content": "Blue"}}

#: Pieces of the HTTP library's own text that must never reach a message.
LIBRARY_TEXT = (
    "HTTPConnection",
    "ConnectionPool",
    "Max retries",
    "NewConnectionError",
    "RemoteDisconnected",
    "Connection aborted",
    "ReadTimeoutError",
    "ProtocolError",
    "IncompleteRead",
    "urllib3",
    "Errno",
    "object at 0x",
    "Caused by",
)


def assert_no_library_text(text: str) -> None:
    for piece in LIBRARY_TEXT:
        assert piece not in text, f"{piece!r} in {text!r}"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


class RawServer:
    """A TCP server on 127.0.0.1 that treats each connection with ``handle``."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self._handle = handle
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self.port = int(self._listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._held.append(conn)
            self._handle(conn)

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (Linux)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(2)
        for conn in self._held:
            conn.close()


def read_request(conn: socket.socket) -> None:
    """Reads the request head and a body of Content-Length bytes."""
    conn.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return
        body += chunk


def hang_up(conn: socket.socket) -> None:
    read_request(conn)
    conn.close()


def never_answer(conn: socket.socket) -> None:
    read_request(conn)


def cut_short(conn: socket.socket) -> None:
    read_request(conn)
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n[{\"role\": "
    )
    conn.close()


@pytest.fixture
def server_factory() -> Iterator[Callable[[Callable[[socket.socket], None]], RawServer]]:
    servers: list[RawServer] = []

    def make(handle: Callable[[socket.socket], None]) -> RawServer:
        server = RawServer(handle)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


ServerFactory = Callable[[Callable[[socket.socket], None]], RawServer]


# --- the Horde --------------------------------------------------------------------------


def horde(url: str) -> HordeClient:
    return HordeClient(url, KEY, bridge_agent="test:1:local", connect_timeout_s=2)


def test_horde_refused_connection_is_said_in_a_few_words() -> None:
    port = closed_port()
    with pytest.raises(HordeUnavailable) as info:
        horde(f"http://127.0.0.1:{port}").submit(SUBMIT_BODY, timeout_s=2)
    assert info.value.message == (
        f"POST /api/v2/generate/text/submit: could not connect to 127.0.0.1:{port} (refused)"
    )
    assert info.value.sent is False and info.value.status == 0
    assert info.value.retry_after_s is None and info.value.rc == ""
    # No answer, so no status in the line ("(refused) (status=0)" said nothing more).
    assert str(info.value) == info.value.message + f" (job={JOB})"
    assert_no_library_text(str(info.value) + repr(info.value))


def test_horde_connection_closed_without_an_answer_is_said_in_a_few_words(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(hang_up)
    with pytest.raises(HordeUnavailable) as info:
        horde(server.url).pop({"name": "w"}, timeout_s=2)
    assert info.value.message == (
        f"POST /api/v2/generate/text/pop: connection to 127.0.0.1:{server.port} lost (reset)"
    )
    assert info.value.sent is None and info.value.status == 0
    assert_no_library_text(str(info.value) + repr(info.value))


def test_horde_read_timeout_is_said_in_a_few_words(server_factory: ServerFactory) -> None:
    server = server_factory(never_answer)
    with pytest.raises(HordeUnavailable) as info:
        horde(server.url).progress(PROGRESS_BODY, timeout_s=0.3)
    assert info.value.message == (
        f"POST /api/v2/generate/text/progress: no answer from 127.0.0.1:{server.port} in time"
    )
    assert info.value.sent is None and info.value.status == 0
    assert str(info.value) == info.value.message + f" (job={JOB})"
    assert_no_library_text(str(info.value) + repr(info.value))


def test_horde_answer_cut_short_is_said_in_a_few_words(server_factory: ServerFactory) -> None:
    server = server_factory(cut_short)
    with pytest.raises(HordeUnavailable) as info:
        horde(server.url).submit(SUBMIT_BODY, timeout_s=2)
    assert info.value.message == (
        "/api/v2/generate/text/submit: the Horde's answer could not be read: "
        "body read failed: connection failed (cut short)"
    )
    assert info.value.sent is True and info.value.status == 200
    assert_no_library_text(str(info.value))


def test_horde_network_failures_log_no_library_text(
    server_factory: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger="koboldcpp_horde_chat")
    client = horde(server_factory(hang_up).url)
    with pytest.raises(HordeUnavailable):
        client.pop({"name": "w"}, timeout_s=2)
    assert "POST /api/v2/generate/text/pop: no answer after " in caplog.text
    assert " s: connection failed (reset)\n" in caplog.text
    assert_no_library_text(caplog.text)
    assert KEY not in caplog.text


# --- koboldcpp --------------------------------------------------------------------------


def test_backend_refused_connection_is_said_in_a_few_words() -> None:
    client = KoboldClient(f"http://127.0.0.1:{closed_port()}", PASSWORD, connect_timeout_s=2)
    with pytest.raises(BackendError) as caught:
        client.chat_completion({"messages": []}, timeout_s=2)
    assert str(caught.value) == "POST /v1/chat/completions connection failed (refused)"
    assert caught.value.status == 0


def test_backend_connection_closed_without_an_answer_is_said_in_a_few_words(
    server_factory: ServerFactory,
) -> None:
    client = KoboldClient(server_factory(hang_up).url, PASSWORD, connect_timeout_s=2)
    with pytest.raises(BackendError) as caught:
        client.chat_completion({"messages": []}, timeout_s=2)
    assert str(caught.value) == "POST /v1/chat/completions connection failed (reset)"
    assert caught.value.status == 0


def test_backend_read_timeout_is_said_in_a_few_words(server_factory: ServerFactory) -> None:
    client = KoboldClient(server_factory(never_answer).url, PASSWORD, connect_timeout_s=2)
    with pytest.raises(BackendError) as caught:
        client.chat_completion({"messages": []}, timeout_s=0.3)
    assert str(caught.value) == "POST /v1/chat/completions timed out"
    assert caught.value.status == 0


def test_backend_stream_cut_by_a_reset_is_said_in_a_few_words(
    server_factory: ServerFactory,
) -> None:
    def reset_mid_stream(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(
            b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
            b"data: {\"choices\": []}\n\n"
        )
        # SO_LINGER 0: close() sends a reset instead of an orderly end of stream.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()

    client = KoboldClient(server_factory(reset_mid_stream).url, PASSWORD, connect_timeout_s=2)
    stream = client.open_chat_stream({"messages": []}, read_timeout_s=2)
    with pytest.raises(BackendError) as caught:
        for _ in range(10):
            if not stream.read_chunk():
                break
    stream.close()
    assert str(caught.value) == "reading the chat stream connection failed (reset)"


def test_backend_messages_never_hold_the_password_or_library_text(
    server_factory: ServerFactory,
) -> None:
    messages = []
    for url in (
        f"http://127.0.0.1:{closed_port()}",
        server_factory(hang_up).url,
        server_factory(never_answer).url,
    ):
        with pytest.raises(BackendError) as caught:
            KoboldClient(url, PASSWORD, connect_timeout_s=2).perf(timeout_s=0.3)
        messages.append(str(caught.value) + repr(caught.value))
    assert_no_library_text(" ".join(messages))
    assert PASSWORD not in " ".join(messages)


# --- messages_url and image URLs ------------------------------------------------------------


SIGNED = "/bucket/msgs.json?X-Amz-Signature=deadbeef"


def test_fetch_refused_connection_is_said_in_a_few_words() -> None:
    port = closed_port()
    with pytest.raises(FetchError) as caught:
        fetch_messages(f"http://127.0.0.1:{port}{SIGNED}", timeout_s=2)
    assert str(caught.value) == (
        f"messages_url http://127.0.0.1:{port}/bucket/msgs.json: connection failed (refused)"
    )


def test_fetch_connection_closed_without_an_answer_is_said_in_a_few_words(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(hang_up)
    with pytest.raises(FetchError) as caught:
        fetch_messages(server.url + SIGNED, timeout_s=2)
    assert str(caught.value) == (
        f"messages_url {server.url}/bucket/msgs.json: connection failed (reset)"
    )


def test_fetch_read_timeout_is_said_in_a_few_words(server_factory: ServerFactory) -> None:
    server = server_factory(never_answer)
    with pytest.raises(FetchError) as caught:
        fetch_messages(server.url + SIGNED, timeout_s=0.3)
    assert str(caught.value) == f"messages_url {server.url}/bucket/msgs.json: no answer in 0.3 s"


def test_fetch_body_cut_short_is_said_in_a_few_words(server_factory: ServerFactory) -> None:
    server = server_factory(cut_short)
    with pytest.raises(FetchError) as caught:
        fetch_messages(server.url + SIGNED, timeout_s=2)
    assert str(caught.value) == (
        f"messages_url {server.url}/bucket/msgs.json: "
        "body read failed: connection failed (cut short)"
    )


def test_fetch_failures_log_no_library_text_nor_the_signature(
    server_factory: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger="koboldcpp_horde_chat")
    texts = []
    for url in (
        f"http://127.0.0.1:{closed_port()}",
        server_factory(hang_up).url,
        server_factory(never_answer).url,
        server_factory(cut_short).url,
    ):
        with pytest.raises(FetchError) as caught:
            fetch_messages(url + SIGNED, timeout_s=0.3)
        texts.append(str(caught.value) + repr(caught.value))
    text = " ".join(texts) + caplog.text
    assert_no_library_text(text)
    assert "deadbeef" not in text


# --- the words, from the exception's type and what it wraps ------------------------------------


def wrapped(inner: BaseException) -> requests.exceptions.ConnectionError:
    """``inner`` as requests raises it: a ConnectionError around urllib3's MaxRetryError."""
    reason = urllib3.exceptions.NewConnectionError(None, "Failed to establish a new connection")  # type: ignore[arg-type]
    reason.__cause__ = inner
    return requests.exceptions.ConnectionError(
        urllib3.exceptions.MaxRetryError(None, "/x", reason)  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("exc", "words"),
    [
        (wrapped(ConnectionRefusedError(111, "refused")), "connection failed (refused)"),
        (wrapped(socket.gaierror(-2, "Name or service not known")),
         "connection failed (host name not found)"),
        (wrapped(OSError(101, "Network is unreachable")),
         "connection failed (network unreachable)"),
        (requests.exceptions.ConnectionError(urllib3.exceptions.ProtocolError(
            "Connection aborted.", http.client.RemoteDisconnected("closed"))),
         "connection failed (reset)"),
        (requests.exceptions.ReadTimeout("read timed out"), "timed out"),
        (requests.exceptions.ConnectTimeout("connect timed out"), "timed out"),
        (urllib3.exceptions.ReadTimeoutError(None, "/x", "read timed out"),  # type: ignore[arg-type]
         "timed out"),
        (requests.exceptions.SSLError(urllib3.exceptions.MaxRetryError(
            None, "/x", urllib3.exceptions.SSLError(ssl.SSLCertVerificationError(1, "bad")))),  # type: ignore[arg-type]
         "TLS certificate not trusted"),
        (requests.exceptions.SSLError("handshake"), "TLS failed"),
        (requests.exceptions.ProxyError(urllib3.exceptions.MaxRetryError(
            None, "/x", urllib3.exceptions.ProxyError("proxy", ConnectionRefusedError()))),  # type: ignore[arg-type]
         "connection failed (proxy refused)"),
        (requests.exceptions.ChunkedEncodingError(urllib3.exceptions.ProtocolError(
            "Connection broken", urllib3.exceptions.IncompleteRead(3, 10))),
         "connection failed (cut short)"),
        (requests.exceptions.ConnectionError("something else"), "connection failed"),
        (requests.exceptions.RequestException("odd"), "failed"),
    ],
)
def test_describe_names_the_cause_from_the_exception_types(exc: BaseException, words: str) -> None:
    assert netfail.describe(exc) == words


def test_describe_never_quotes_the_exception_text() -> None:
    secret = "Bearer hunter2 at http://x.example/?sig=deadbeef"
    for exc in (
        requests.exceptions.ConnectionError(secret),
        wrapped(ConnectionRefusedError(111, secret)),
        requests.exceptions.ReadTimeout(secret),
        ValueError(secret),
    ):
        words = netfail.describe(exc)
        assert "hunter2" not in words and "deadbeef" not in words and "x.example" not in words
