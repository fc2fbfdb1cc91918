"""fetch.py: bounded downloads of messages_url bodies and image URLs.

Seed "Fetch offloaded messages" (seed 000) and seed 004: plain or gzip bodies
decoded by Content-Encoding, a 36 MiB decoded cap, at most 3 redirects, http(s)
only, no credentials, and a failed fetch is an error (the job is faulted).
"""

from __future__ import annotations

import gzip
import json
import logging
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
import requests
import responses

from koboldcpp_horde_chat.errors import FetchError
from koboldcpp_horde_chat.httpbody import read_body, redact_url
from koboldcpp_horde_chat.run import downloads as fetch
from koboldcpp_horde_chat.run.downloads import fetch_image, fetch_messages
from tests.http_server import LocalServer

MIB = 1024 * 1024
SECRET = "X-Amz-Signature=deadbeefSECRET"
URL = f"https://store.example/bucket/msgs.json?X-Amz-Expires=120&{SECRET}"
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": [{"type": "text", "text": "Name one colour."}]},
]
BODY = json.dumps(MESSAGES).encode()


# --- a tiny real HTTP server on 127.0.0.1 ----------------------------------------


def Server(script: Callable[[BaseHTTPRequestHandler], None]) -> LocalServer:  # noqa: N802
    """``tests.http_server.LocalServer`` answering each GET with ``script(handler)``."""
    return LocalServer(lambda handler, _body: script(handler))


def _headers(h: BaseHTTPRequestHandler, status: int, headers: dict[str, str]) -> None:
    h.send_response(status)
    for k, v in headers.items():
        h.send_header(k, v)
    h.end_headers()


def _gzip_bomb(decoded_bytes: int) -> bytes:
    comp = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(MIB)
    parts = [comp.compress(zeros) for _ in range(decoded_bytes // MIB)]
    parts.append(comp.flush())
    return b"".join(parts)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """100 MiB of zeros, gzipped (about 100 KiB)."""
    return _gzip_bomb(100 * MIB)


# --- decoding ------------------------------------------------------------------


@responses.activate
def test_plain_json_array_is_returned() -> None:
    responses.get(URL, body=BODY, content_type="application/json")
    assert fetch_messages(URL, timeout_s=5) == MESSAGES


@responses.activate
@pytest.mark.parametrize("coding", ["gzip", "x-gzip", "GZIP"])
def test_gzip_body_is_decoded_by_content_encoding(coding: str) -> None:
    responses.get(URL, body=gzip.compress(BODY), headers={"Content-Encoding": coding})
    assert fetch_messages(URL, timeout_s=5) == MESSAGES


@responses.activate
def test_several_concatenated_gzip_members_are_one_body() -> None:
    half = len(BODY) // 2
    # Two members plus zero padding between and after them, as gzip files may have.
    raw = gzip.compress(BODY[:half]) + b"\0\0" + gzip.compress(BODY[half:]) + b"\0"
    responses.get(URL, body=raw, headers={"Content-Encoding": "gzip"})
    assert fetch_messages(URL, timeout_s=5) == MESSAGES


@responses.activate
@pytest.mark.parametrize("wbits", [zlib.MAX_WBITS, -zlib.MAX_WBITS], ids=["zlib", "raw"])
def test_deflate_body_is_decoded_wrapped_or_raw(wbits: int) -> None:
    comp = zlib.compressobj(6, zlib.DEFLATED, wbits)
    raw = comp.compress(BODY) + comp.flush()
    responses.get(URL, body=raw, headers={"Content-Encoding": "deflate"})
    assert fetch_messages(URL, timeout_s=5) == MESSAGES


@responses.activate
def test_gzip_header_over_a_plain_body_is_an_error() -> None:
    responses.get(URL, body=BODY, headers={"Content-Encoding": "gzip"})
    with pytest.raises(FetchError, match="invalid gzip"):
        fetch_messages(URL, timeout_s=5)


@responses.activate
def test_truncated_gzip_is_an_error() -> None:
    responses.get(URL, body=gzip.compress(BODY)[:-12], headers={"Content-Encoding": "gzip"})
    with pytest.raises(FetchError, match="truncated gzip"):
        fetch_messages(URL, timeout_s=5)


@responses.activate
def test_garbage_after_a_gzip_member_is_an_error() -> None:
    responses.get(URL, body=gzip.compress(BODY) + b"junk", headers={"Content-Encoding": "gzip"})
    with pytest.raises(FetchError, match="invalid gzip"):
        fetch_messages(URL, timeout_s=5)


@responses.activate
@pytest.mark.parametrize("coding", ["br", "zstd", "gzip, br"])
def test_unsupported_content_encoding_is_an_error(coding: str) -> None:
    responses.get(URL, body=BODY, headers={"Content-Encoding": coding})
    with pytest.raises(FetchError, match="unsupported Content-Encoding"):
        fetch_messages(URL, timeout_s=5)


@responses.activate
def test_identity_content_encoding_is_plain() -> None:
    responses.get(URL, body=BODY, headers={"Content-Encoding": "identity"})
    assert fetch_messages(URL, timeout_s=5) == MESSAGES


# --- size caps ----------------------------------------------------------------------


@responses.activate
def test_body_of_exactly_the_cap_is_accepted_one_more_byte_is_not() -> None:
    cap = len(BODY)
    responses.get(URL, body=BODY)
    assert fetch_messages(URL, timeout_s=5, max_bytes=cap) == MESSAGES
    with pytest.raises(FetchError, match=f"exceeds {cap - 1} bytes"):
        fetch_messages(URL, timeout_s=5, max_bytes=cap - 1)


@responses.activate
def test_gzip_cap_counts_decoded_bytes_not_wire_bytes() -> None:
    big = json.dumps([{"role": "user", "content": "a" * (2 * MIB)}]).encode()
    responses.get(URL, body=gzip.compress(big), headers={"Content-Encoding": "gzip"})
    assert len(gzip.compress(big)) < MIB
    with pytest.raises(FetchError, match=f"decoded body exceeds {MIB} bytes"):
        fetch_messages(URL, timeout_s=5, max_bytes=MIB)


def test_default_cap_is_the_seeds_36_mib() -> None:
    assert fetch.MESSAGES_MAX_BYTES == 36 * MIB
    assert fetch_messages.__kwdefaults__ is not None
    assert fetch_messages.__kwdefaults__["max_bytes"] == 36 * MIB


def test_oversize_plain_body_stops_reading_early() -> None:
    """A body far over the cap, without Content-Length: the client stops and hangs up."""

    def script(h: BaseHTTPRequestHandler) -> None:
        _headers(h, 200, {"Connection": "close"})
        chunk = b"x" * (256 * 1024)
        for _ in range(800):  # 200 MiB if nobody stopped it
            h.wfile.write(chunk)
            srv.sent += len(chunk)

    with Server(script) as srv:
        started = time.monotonic()
        with pytest.raises(FetchError, match=f"exceeds {MIB} bytes"):
            fetch_messages(srv.url + "/big", timeout_s=10, max_bytes=MIB)
        assert time.monotonic() - started < 5
        time.sleep(0.2)
        # Socket buffers absorb a few MiB at most; 200 MiB would mean it kept reading.
        assert srv.sent < 40 * MIB


def test_declared_content_length_over_the_cap_fails_before_reading() -> None:
    def script(h: BaseHTTPRequestHandler) -> None:
        _headers(h, 200, {"Content-Length": str(500 * MIB)})
        h.wfile.write(b"[")
        time.sleep(5)

    with Server(script) as srv:
        started = time.monotonic()
        with pytest.raises(FetchError, match="exceeds"):
            fetch_messages(srv.url + "/big", timeout_s=10, max_bytes=MIB)
        assert time.monotonic() - started < 2


def test_gzip_bomb_fails_quickly_with_low_memory(bomb: bytes) -> None:
    def script(h: BaseHTTPRequestHandler) -> None:
        _headers(h, 200, {"Content-Encoding": "gzip", "Content-Length": str(len(bomb))})
        h.wfile.write(bomb)

    with Server(script) as srv:
        tracemalloc.start()
        started = time.monotonic()
        try:
            with pytest.raises(FetchError, match=f"decoded body exceeds {MIB} bytes"):
                fetch_messages(srv.url + "/bomb", timeout_s=10, max_bytes=MIB)
            elapsed = time.monotonic() - started
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert elapsed < 3
    assert peak < 8 * MIB, f"peak {peak} bytes while decoding a 100 MiB bomb"


@responses.activate
def test_gzip_bomb_through_a_mock_is_refused(bomb: bytes) -> None:
    responses.get(URL, body=bomb, headers={"Content-Encoding": "gzip"})
    with pytest.raises(FetchError, match=f"decoded body exceeds {MIB} bytes"):
        fetch_messages(URL, timeout_s=5, max_bytes=MIB)


@responses.activate
def test_endless_zero_padding_is_capped_on_the_wire() -> None:
    # Decodes to nothing, so only the raw cap stops it.
    raw = gzip.compress(b"[]") + bytes(3 * MIB)
    responses.get(URL, body=raw, headers={"Content-Encoding": "gzip"})
    with pytest.raises(FetchError, match="on the wire"):
        fetch_messages(URL, timeout_s=5, max_bytes=MIB)


# --- statuses, JSON ---------------------------------------------------------------


@responses.activate
@pytest.mark.parametrize("status", [404, 403, 500, 503])
def test_non_2xx_is_an_error_naming_the_status(status: int) -> None:
    responses.get(URL, status=status, body=b"<Error>NoSuchKey</Error>")
    with pytest.raises(FetchError, match=f"HTTP {status}"):
        fetch_messages(URL, timeout_s=5)


@responses.activate
@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b'{"messages": []}', "expected a JSON array, got dict"),
        (b'"hello"', "expected a JSON array, got str"),
        (b"null", "expected a JSON array, got NoneType"),
        (b'[{"role": "user"', "invalid JSON"),
        (b"", "invalid JSON"),
        (b'["\xff\xfe"]', "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply|invalid JSON"),
    ],
    ids=["object", "string", "null", "cut", "empty", "latin1", "deep"],
)
def test_body_that_is_not_a_json_array_is_an_error(body: bytes, match: str) -> None:
    responses.get(URL, body=body)
    with pytest.raises(FetchError, match=match):
        fetch_messages(URL, timeout_s=5)


@responses.activate
def test_empty_array_is_returned_as_is() -> None:
    responses.get(URL, body=b"[]")
    assert fetch_messages(URL, timeout_s=5) == []


# --- URLs and redirects ------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["file:///etc/passwd", "ftp://store.example/m.json", "data:application/json,[]",
     "store.example/m.json", "https:///nohost", "http://store.example:99999/x"],
)
def test_only_http_and_https_urls_are_fetched(url: str) -> None:
    with responses.RequestsMock() as rsps:  # any request would fail the test
        with pytest.raises(FetchError):
            fetch_messages(url, timeout_s=5)
        assert len(rsps.calls) == 0


@responses.activate
def test_url_with_credentials_is_refused() -> None:
    with pytest.raises(FetchError, match="credentials"):
        fetch_messages("https://user:pw@store.example/m.json", timeout_s=5)
    assert len(responses.calls) == 0


@responses.activate
def test_redirect_to_file_url_is_rejected() -> None:
    responses.get(URL, status=302, headers={"Location": "file:///etc/passwd"})
    with pytest.raises(FetchError, match="only http"):
        fetch_messages(URL, timeout_s=5)
    assert len(responses.calls) == 1


@responses.activate
def test_three_redirects_are_followed_relative_and_absolute() -> None:
    responses.get(URL, status=301, headers={"Location": "/hop1?sig=1"})
    responses.get("https://store.example/hop1", status=302,
                  headers={"Location": "https://other.example/hop2"})
    responses.get("https://other.example/hop2", status=307, headers={"Location": "hop3"})
    responses.get("https://other.example/hop3", body=BODY)
    assert fetch_messages(URL, timeout_s=5) == MESSAGES
    assert [c.request.url for c in responses.calls][-1] == "https://other.example/hop3"


@responses.activate
def test_a_fourth_redirect_is_not_followed() -> None:
    responses.get(URL, status=302, headers={"Location": "/a"})
    responses.get("https://store.example/a", status=302, headers={"Location": "/b"})
    responses.get("https://store.example/b", status=302, headers={"Location": "/c"})
    responses.get("https://store.example/c", status=302, headers={"Location": "/d"})
    responses.get("https://store.example/d", body=BODY)
    with pytest.raises(FetchError, match="more than 3 redirects"):
        fetch_messages(URL, timeout_s=5)
    assert len(responses.calls) == 4


@responses.activate
def test_redirect_without_location_is_an_error() -> None:
    responses.get(URL, status=302)
    with pytest.raises(FetchError, match="HTTP 302"):
        fetch_messages(URL, timeout_s=5)


# --- credentials ------------------------------------------------------------------


@responses.activate
def test_no_credentials_are_sent_even_from_a_given_session() -> None:
    session = requests.Session()
    session.headers["apikey"] = "0123456789abcdef"
    session.headers["Authorization"] = "Bearer kcpp-password"
    session.auth = ("user", "pw")
    session.cookies.set("session", "c00kie", domain="store.example")
    responses.get(URL, status=302, headers={"Location": "https://other.example/m.json"})
    responses.get("https://other.example/m.json", body=BODY)
    assert fetch_messages(URL, timeout_s=5, session=session) == MESSAGES
    for call in responses.calls:
        names = {k.lower() for k in call.request.headers}
        assert not names & {"apikey", "authorization", "cookie"}, call.request.headers
    # The caller's session itself is left as it was.
    assert session.headers["apikey"] == "0123456789abcdef"


def test_no_credentials_reach_a_real_server(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def script(h: BaseHTTPRequestHandler) -> None:
        if h.path.startswith("/first"):
            _headers(h, 302, {"Location": "/second", "Set-Cookie": "sid=abc; Path=/",
                              "Content-Length": "0"})
            return
        _headers(h, 200, {"Content-Length": str(len(BODY))})
        h.wfile.write(BODY)

    # A .netrc for the host must not be used either.
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login user password netrcpw\n")
    monkeypatch.setenv("NETRC", str(netrc))
    with Server(script) as srv:
        session = requests.Session()
        session.headers["apikey"] = "0123456789abcdef"
        assert fetch_messages(srv.url + "/first?sig=1", timeout_s=5, session=session) == MESSAGES
        assert [p for p, _ in srv.seen] == ["/first?sig=1", "/second"]
        for _, headers in srv.seen:
            assert "apikey" not in headers
            assert "authorization" not in headers
            assert "cookie" not in headers
            assert headers["accept-encoding"] == "gzip, deflate"


# --- time ---------------------------------------------------------------------------


@responses.activate
def test_read_timeout_is_an_error() -> None:
    responses.get(URL, body=requests.exceptions.ReadTimeout("read timed out"))
    with pytest.raises(FetchError, match="no answer in 5 s"):
        fetch_messages(URL, timeout_s=5)


@responses.activate
def test_connection_error_is_an_error() -> None:
    responses.get(URL, body=requests.exceptions.ConnectionError(f"refused for /msgs.json?{SECRET}"))
    with pytest.raises(FetchError, match="msgs.json: connection failed$") as info:
        fetch_messages(URL, timeout_s=5)
    assert SECRET not in str(info.value)


def test_no_headers_within_the_timeout_is_an_error() -> None:
    def script(h: BaseHTTPRequestHandler) -> None:
        time.sleep(3)

    with Server(script) as srv:
        started = time.monotonic()
        with pytest.raises(FetchError, match="no answer in 0.5 s"):
            fetch_messages(srv.url + "/slow", timeout_s=0.5)
        assert time.monotonic() - started < 1.5


def test_a_trickling_body_is_cut_at_the_total_deadline() -> None:
    """One byte every 0.1 s never trips a per-read timeout; the total deadline does."""

    def script(h: BaseHTTPRequestHandler) -> None:
        _headers(h, 200, {"Content-Length": "1000"})
        for _ in range(1000):
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(0.1)

    with Server(script) as srv:
        started = time.monotonic()
        with pytest.raises(FetchError, match="not received in time"):
            fetch_messages(srv.url + "/trickle", timeout_s=1.0)
        assert time.monotonic() - started < 2.0


def test_a_stalled_body_fails_at_the_deadline_not_a_read_timeout_later() -> None:
    """Data at 0.7 s, then silence: the next read may only wait for what is left."""

    def script(h: BaseHTTPRequestHandler) -> None:
        _headers(h, 200, {"Content-Length": "100"})
        h.wfile.flush()
        time.sleep(0.7)
        h.wfile.write(b"[")
        h.wfile.flush()
        time.sleep(3)

    with Server(script) as srv:
        started = time.monotonic()
        with pytest.raises(FetchError, match="not received in time"):
            fetch_messages(srv.url + "/stall", timeout_s=1.0)
        assert time.monotonic() - started < 1.4


def test_connection_refused_is_an_error() -> None:
    with Server(lambda h: None) as srv:
        url = srv.url
    with pytest.raises(FetchError, match="messages_url http://127.0.0.1"):
        fetch_messages(url + "/gone", timeout_s=2)


def test_chunked_gzip_from_a_real_server() -> None:
    raw = gzip.compress(BODY)

    def script(h: BaseHTTPRequestHandler) -> None:
        _headers(h, 200, {"Content-Encoding": "gzip", "Transfer-Encoding": "chunked"})
        for i in range(0, len(raw), 7):
            piece = raw[i : i + 7]
            h.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        h.wfile.write(b"0\r\n\r\n")

    with Server(script) as srv:
        assert fetch_messages(srv.url + "/chunked", timeout_s=5) == MESSAGES


# --- the query string stays secret -------------------------------------------------------


def _failures() -> Iterator[tuple[str, dict[str, Any]]]:
    yield "404", {"status": 404}
    yield "500", {"status": 500}
    yield "object", {"body": b"{}"}
    yield "badjson", {"body": b"[nope"}
    yield "gzip", {"body": BODY, "headers": {"Content-Encoding": "gzip"}}
    yield "big", {"body": b"[" + b" " * 2000 + b"]"}
    yield "timeout", {"body": requests.exceptions.ReadTimeout(f"GET /msgs.json?{SECRET}")}
    yield "conn", {"body": requests.exceptions.ConnectionError(f"GET /msgs.json?{SECRET}")}
    yield "redirect", {"status": 302, "headers": {"Location": f"ftp://x.example/a?{SECRET}"}}


@pytest.mark.parametrize(("name", "kwargs"), list(_failures()), ids=[n for n, _ in _failures()])
def test_query_string_is_never_in_errors_or_logs(
    name: str, kwargs: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="koboldcpp_horde_chat")
    with responses.RequestsMock() as rsps:
        rsps.get(URL, **kwargs)
        with pytest.raises(FetchError) as info:
            fetch_messages(URL, timeout_s=5, max_bytes=1000)
    text = str(info.value) + repr(info.value) + caplog.text
    assert "store.example/bucket/msgs.json" in str(info.value)
    assert SECRET not in text
    assert "deadbeef" not in text
    assert "X-Amz-Expires" not in text


def test_redact_url_keeps_scheme_host_port_path_only() -> None:
    assert redact_url("https://u:p@Store.example:8443/b/k.json?sig=1#frag") == (
        "https://store.example:8443/b/k.json"
    )
    assert redact_url("http://[::1]:80/x?y") == "http://[::1]:80/x"


# --- images ------------------------------------------------------------------------------


JPEG = b"\xff\xd8\xff\xe0" + b"\0" * 100 + b"\xff\xd9"


@responses.activate
def test_fetch_image_returns_the_bytes_whatever_the_content_type() -> None:
    url = "https://store.example/img/1?sig=abc"
    responses.get(url, body=JPEG, content_type="application/octet-stream")
    assert fetch_image(url, timeout_s=5, max_bytes=MIB) == JPEG
    assert responses.calls[0].request.headers["Accept"] == "image/*"


@responses.activate
def test_fetch_image_follows_the_same_rules() -> None:
    url = "https://store.example/img/1?sig=abc"
    responses.get(url, body=JPEG)
    with pytest.raises(FetchError, match="image URL https://store.example/img/1: decoded body exceeds 10"):
        fetch_image(url, timeout_s=5, max_bytes=10)
    responses.replace(responses.GET, url, status=302, headers={"Location": "file:///x.jpg"})
    with pytest.raises(FetchError, match="only http"):
        fetch_image(url, timeout_s=5, max_bytes=MIB)
    responses.replace(responses.GET, url, body=b"")
    with pytest.raises(FetchError, match="empty body"):
        fetch_image(url, timeout_s=5, max_bytes=MIB)
    responses.replace(responses.GET, url, body=gzip.compress(JPEG),
                      headers={"Content-Encoding": "gzip"})
    assert fetch_image(url, timeout_s=5, max_bytes=MIB) == JPEG


# --- read_body on its own -----------------------------------------------------------------


def test_read_body_past_deadline_is_an_error() -> None:
    with responses.RequestsMock() as rsps:
        rsps.get(URL, body=BODY)
        response = requests.get(URL, stream=True, timeout=5)
        with pytest.raises(FetchError, match="not received in time"):
            read_body(response, max_bytes=MIB, deadline=time.monotonic() - 1)


@pytest.mark.parametrize("stage", ["headers", "body"])
def test_a_hang_up_ends_a_hanging_image_download_at_once(stage: str) -> None:
    """An image URL that hangs (before its headers, or mid-body) with 30 s of budget
    left: the step's hang-up (a job given up at the stop's deadline) ends it at
    once, and a fetch after the hang-up is not sent."""

    def script(h: BaseHTTPRequestHandler) -> None:
        if stage == "body":
            _headers(h, 200, {"Content-Length": "1000"})
            h.wfile.write(b"\xff\xd8")
            h.wfile.flush()
        time.sleep(8)

    downloads = fetch.Downloads()
    with Server(script) as srv:
        timer = threading.Timer(0.3, downloads.hang_up)
        timer.start()
        started = time.monotonic()
        with pytest.raises(FetchError):
            fetch_image(srv.url + "/img", timeout_s=30, max_bytes=MIB, downloads=downloads)
        assert time.monotonic() - started < 2
        with pytest.raises(FetchError, match="not fetched"):
            fetch_image(srv.url + "/img", timeout_s=30, max_bytes=MIB, downloads=downloads)
