"""horde.py: the Horde client for pop, submit and progress.

Seed 000 steps 1, 6, 7 and "Streaming progress": the routes, the refusals by
status and rc (ChatSubmitInvalid, ChatJobAborted, ChatProgressOutOfSequence...),
503/429 as retryable, and the API key sent only to the Horde's host.
"""

from __future__ import annotations

import gzip
import json
import logging
import socket
import time
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
import requests
import responses
import urllib3.exceptions
from responses import matchers

from koboldcpp_horde_chat import __version__
from koboldcpp_horde_chat.errors import (
    ConfigError,
    HordeError,
    HordeRefusal,
    HordeUnavailable,
)
from koboldcpp_horde_chat.horde import client as client_module
from koboldcpp_horde_chat.horde.client import HordeClient, parse_retry_after
from tests.http_server import LocalServer

KEY = "SeCrEtKeY_0123456789abcdef"
BASE = "https://horde.example"
POP = f"{BASE}/api/v2/generate/text/pop"
SUBMIT = f"{BASE}/api/v2/generate/text/submit"
PROGRESS = f"{BASE}/api/v2/generate/text/progress"
AGENT = "koboldcpp-horde-chat:0.1.0:https://example.invalid/contact"
JOB = "7f1c9a2e-0000-4000-8000-000000000001"
MIB = 1024 * 1024

POP_BODY = {
    "name": "worker",
    "models": ["koboldcpp/model"],
    "max_length": 512,
    "max_context_length": 4096,
    "chat_jobs": True,
    "chat_features": ["seed", "presence_penalty"],
    "chat_limits": {"max_context_length": 4096, "max_length": 512},
    "model_id": "koboldcpp/model",
    "image_transports": [],
}
CHAT_POP = {
    "payload": {"messages": [{"role": "user", "content": "Name one colour."}], "max_length": 512,
                "max_context_length": 2048},
    "id": JOB, "ids": [JOB], "ttl": 150, "skipped": {}, "model": "koboldcpp/model", "chat": True,
}
SUBMIT_BODY = {
    "id": JOB,
    "message": {"role": "assistant", "content": "Blue."},
    "finish_reason": "stop",
    "model_id": "koboldcpp/model",
    "state": "ok",
}
FAULT_BODY = {"id": JOB, "state": "faulted", "model_id": "koboldcpp/model"}
PROGRESS_BODY = {"id": JOB, "seq": 1, "delta": {"content": "Blue"}}


def client(**kwargs: Any) -> HordeClient:
    return HordeClient(BASE, KEY, bridge_agent=AGENT, **kwargs)


# --- routes, headers, bodies ----------------------------------------------------------


@responses.activate
def test_pop_posts_the_body_with_the_headers_and_returns_the_job() -> None:
    responses.post(POP, json=CHAT_POP, match=[matchers.json_params_matcher(POP_BODY)])
    assert client().pop(POP_BODY, timeout_s=40) == CHAT_POP
    headers = responses.calls[0].request.headers
    assert headers["apikey"] == KEY
    assert headers["Client-Agent"] == f"koboldcpp-horde-chat:{__version__}"
    assert headers["User-Agent"] == AGENT
    assert headers["Content-Type"] == "application/json"


@responses.activate
def test_submit_returns_the_reward() -> None:
    responses.post(SUBMIT, json={"reward": 12.5}, match=[matchers.json_params_matcher(SUBMIT_BODY)])
    assert client().submit(SUBMIT_BODY, timeout_s=30) == {"reward": 12.5}
    assert responses.calls[0].request.headers["apikey"] == KEY


@responses.activate
def test_fault_submit_returns_zero_reward() -> None:
    responses.post(SUBMIT, json={"reward": 0}, match=[matchers.json_params_matcher(FAULT_BODY)])
    assert client().submit(FAULT_BODY, timeout_s=30) == {"reward": 0}


@responses.activate
def test_progress_returns_accepted_seq_and_cancelled() -> None:
    responses.post(PROGRESS, json={"accepted_seq": 1, "cancelled": False},
                   match=[matchers.json_params_matcher(PROGRESS_BODY)])
    assert client().progress(PROGRESS_BODY, timeout_s=10) == {"accepted_seq": 1, "cancelled": False}
    assert responses.calls[0].request.headers["apikey"] == KEY


@responses.activate
def test_an_empty_pop_is_returned_as_is() -> None:
    empty: dict[str, Any] = {"id": None, "ids": [], "payload": {}, "skipped": {"max_context_length": 1}}
    responses.post(POP, json=empty)
    assert client().pop(POP_BODY, timeout_s=40) == empty


@responses.activate
def test_base_url_path_prefix_and_trailing_slash() -> None:
    responses.post("https://horde.example/prefix/api/v2/generate/text/pop", json={"id": None})
    c = HordeClient("https://horde.example/prefix/", KEY, bridge_agent=AGENT)
    assert c.pop(POP_BODY, timeout_s=5) == {"id": None}


@responses.activate
def test_non_ascii_body_is_sent_as_utf8_json() -> None:
    body = dict(SUBMIT_BODY, message={"role": "assistant", "content": "Blau \u00fc \u2603"})
    responses.post(SUBMIT, json={"reward": 1}, match=[matchers.json_params_matcher(body)])
    assert client().submit(body, timeout_s=5) == {"reward": 1}


@responses.activate
def test_gzip_encoded_answer_is_decoded() -> None:
    responses.post(POP, body=gzip.compress(json.dumps(CHAT_POP).encode()),
                   headers={"Content-Encoding": "gzip"}, content_type="application/json")
    assert client().pop(POP_BODY, timeout_s=5) == CHAT_POP


# --- 2xx that are not a JSON object --------------------------------------------------------


@responses.activate
@pytest.mark.parametrize("body", [b"<html>ok</html>", b"", b"[1, 2]", b'"ok"', b"\xff\xfe{}"],
                         ids=["html", "empty", "array", "string", "not-utf8"])
def test_2xx_without_a_json_object_is_unavailable_invalid_json(body: bytes) -> None:
    responses.post(SUBMIT, body=body)
    with pytest.raises(HordeUnavailable, match="invalid JSON") as info:
        client().submit(SUBMIT_BODY, timeout_s=5)
    err = info.value
    assert err.status == 200
    assert err.job_id == JOB


# --- refusals and unavailability ---------------------------------------------------------


@responses.activate
@pytest.mark.parametrize(
    ("status", "rc"),
    [
        (400, "ChatSubmitInvalid"),
        (400, "ChatSubmitNonconformant"),
        (400, "ChatModelMismatch"),
        (400, "AbortedGen"),
        (400, "DuplicateGen"),
        (401, "InvalidAPIKey"),
        (403, "WrongCredentials"),
    ],
)
def test_4xx_on_submit_is_a_refusal_with_status_rc_message_body_and_job(status: int, rc: str) -> None:
    body = {"message": f"The submit was refused ({rc}).", "rc": rc}
    responses.post(SUBMIT, status=status, json=body)
    with pytest.raises(HordeRefusal) as info:
        client().submit(SUBMIT_BODY, timeout_s=5)
    err = info.value
    assert (err.status, err.rc, err.message, err.job_id) == (status, rc, body["message"], JOB)
    assert err.body == body


@responses.activate
def test_invalid_declaration_on_pop_is_a_refusal() -> None:
    body = {"message": "chat_limits is required with chat_jobs", "rc": "ChatDeclarationInvalid"}
    responses.post(POP, status=400, json=body)
    with pytest.raises(HordeRefusal) as info:
        client().pop(POP_BODY, timeout_s=5)
    assert info.value.rc == "ChatDeclarationInvalid"
    assert info.value.job_id is None


@responses.activate
@pytest.mark.parametrize(
    ("status", "body"),
    [
        (404, {"message": "The job has ended.", "rc": "ChatJobAborted"}),
        (404, {"message": "Not streaming.", "rc": "ChatProgressNotStreaming"}),
        (409, {"message": "Out of sequence.", "rc": "ChatProgressOutOfSequence", "expected_seq": 3}),
        (413, {"message": "Cap reached.", "rc": "ChatProgressCapReached"}),
    ],
)
def test_progress_refusals_carry_rc_and_body(status: int, body: dict[str, Any]) -> None:
    responses.post(PROGRESS, status=status, json=body)
    with pytest.raises(HordeRefusal) as info:
        client().progress(PROGRESS_BODY, timeout_s=5)
    assert info.value.status == status
    assert info.value.rc == body["rc"]
    assert info.value.body == body
    assert info.value.job_id == JOB


@responses.activate
def test_503_progress_unavailable_is_retryable_with_rc() -> None:
    responses.post(PROGRESS, status=503,
                   json={"message": "Progress is unavailable.", "rc": "ChatProgressUnavailable"})
    with pytest.raises(HordeUnavailable) as info:
        client().progress(PROGRESS_BODY, timeout_s=5)
    err = info.value
    assert err.status == 503 and err.rc == "ChatProgressUnavailable"
    assert err.retry_after_s is None
    assert err.sent is True


@responses.activate
def test_429_with_retry_after_seconds() -> None:
    responses.post(POP, status=429, headers={"Retry-After": "7"},
                   json={"message": "Too many requests", "rc": "TooManyRequests"})
    with pytest.raises(HordeUnavailable) as info:
        client().pop(POP_BODY, timeout_s=5)
    assert info.value.status == 429
    assert info.value.retry_after_s == 7.0
    assert info.value.rc == "TooManyRequests"


@responses.activate
def test_503_with_retry_after_http_date() -> None:
    when = datetime.now(timezone.utc) + timedelta(seconds=120)
    responses.post(SUBMIT, status=503, headers={"Retry-After": format_datetime(when, usegmt=True)})
    with pytest.raises(HordeUnavailable) as info:
        client().submit(SUBMIT_BODY, timeout_s=5)
    assert info.value.retry_after_s is not None
    assert 100 <= info.value.retry_after_s <= 121


@pytest.mark.parametrize(
    ("value", "expected"),
    [("7", 7.0), ("0", 0.0), ("2.5", 2.5), ("-3", 0.0), ("99999", 3600.0), ("soon", None),
     ("", None), (None, None), ("nan", None),
     ("Wed, 21 Oct 2015 07:28:30 GMT", 30.0), ("Wed, 21 Oct 2015 07:27:00 GMT", 0.0)],
)
def test_parse_retry_after(value: str | None, expected: float | None) -> None:
    now = datetime(2015, 10, 21, 7, 28, 0, tzinfo=timezone.utc)
    assert parse_retry_after(value, now=now) == expected


@responses.activate
@pytest.mark.parametrize("status", [500, 502, 504])
def test_5xx_html_is_unavailable_without_rc(status: int) -> None:
    responses.post(POP, status=status, body=b"<html><body>Bad gateway</body></html>",
                   content_type="text/html")
    with pytest.raises(HordeUnavailable) as info:
        client().pop(POP_BODY, timeout_s=5)
    assert info.value.status == status
    assert info.value.rc == ""
    assert f"HTTP {status}" in info.value.message
    assert "<html>" not in info.value.message


@responses.activate
def test_long_messages_are_shortened() -> None:
    responses.post(SUBMIT, status=400, json={"message": "x" * 5000, "rc": "ChatSubmitInvalid"})
    with pytest.raises(HordeRefusal) as info:
        client().submit(SUBMIT_BODY, timeout_s=5)
    assert len(info.value.message) <= 300


@responses.activate
def test_mapping_ignores_message_text() -> None:
    # A 400 whose message talks of being unavailable is still a refusal; a 503
    # whose message talks of refusal is still retryable.
    responses.post(SUBMIT, status=400, json={"message": "Service unavailable, retry", "rc": "X"})
    responses.post(POP, status=503, json={"message": "Refused: invalid", "rc": "Y"})
    with pytest.raises(HordeRefusal):
        client().submit(SUBMIT_BODY, timeout_s=5)
    with pytest.raises(HordeUnavailable):
        client().pop(POP_BODY, timeout_s=5)


# --- size caps --------------------------------------------------------------------------------


@responses.activate
def test_oversize_answer_is_unavailable() -> None:
    responses.post(SUBMIT, json={"reward": 1, "pad": "x" * (2 * MIB)})
    with pytest.raises(HordeUnavailable, match="exceeds") as info:
        client().submit(SUBMIT_BODY, timeout_s=5)
    assert info.value.status == 200


@responses.activate
def test_pop_has_its_own_larger_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    big = dict(CHAT_POP, pad="x" * (2 * MIB))
    responses.post(POP, json=big)
    responses.post(SUBMIT, json={"reward": 1, "pad": "x" * (2 * MIB)})
    c = client()
    assert c.pop(POP_BODY, timeout_s=5) == big  # 64 MiB cap by default
    with pytest.raises(HordeUnavailable):
        c.submit(SUBMIT_BODY, timeout_s=5)  # 1 MiB cap
    monkeypatch.setattr(client_module, "POP_MAX_BYTES", MIB)
    with pytest.raises(HordeUnavailable, match=f"exceeds {MIB} bytes"):
        client().pop(POP_BODY, timeout_s=5)


# --- network failures -------------------------------------------------------------------------


@responses.activate
def test_read_timeout_is_unavailable_maybe_sent() -> None:
    responses.post(SUBMIT, body=requests.exceptions.ReadTimeout("read timed out"))
    with pytest.raises(HordeUnavailable, match="no answer") as info:
        client().submit(SUBMIT_BODY, timeout_s=5)
    assert info.value.status == 0
    assert info.value.sent is None
    assert info.value.job_id == JOB


@responses.activate
def test_connect_timeout_is_unavailable_not_sent() -> None:
    responses.post(POP, body=requests.exceptions.ConnectTimeout("connect timed out"))
    with pytest.raises(HordeUnavailable) as info:
        client().pop(POP_BODY, timeout_s=5)
    assert info.value.sent is False


@responses.activate
def test_reset_after_sending_is_unavailable_maybe_sent() -> None:
    err = urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset"))
    responses.post(SUBMIT, body=requests.exceptions.ConnectionError(err))
    with pytest.raises(HordeUnavailable, match="connection to horde.example lost") as info:
        client().submit(SUBMIT_BODY, timeout_s=5)
    assert info.value.sent is None


@responses.activate
def test_tls_failure_names_tls_and_the_ca_bundle_variables() -> None:
    responses.post(POP, body=requests.exceptions.SSLError("certificate verify failed"))
    with pytest.raises(HordeUnavailable) as info:
        client().pop(POP_BODY, timeout_s=5)
    message = str(info.value)
    assert "TLS failure" in message
    assert "REQUESTS_CA_BUNDLE" in message and "CURL_CA_BUNDLE" in message


@responses.activate
def test_redirect_is_not_followed_and_is_a_refusal() -> None:
    responses.post(POP, status=301, headers={"Location": "https://evil.example/api/v2/generate/text/pop?x=1"})
    responses.post("https://evil.example/api/v2/generate/text/pop", json={"id": None})
    with pytest.raises(HordeRefusal) as info:
        client().pop(POP_BODY, timeout_s=5)
    assert len(responses.calls) == 1
    assert info.value.status == 301
    assert "https://evil.example/api/v2/generate/text/pop" in info.value.message
    assert "not followed" in info.value.message


# --- the key stays secret ------------------------------------------------------------------------


def _key_scenarios() -> list[tuple[str, str, dict[str, Any]]]:
    echo = {"message": f"bad key {KEY}", "rc": f"rc{KEY}", "echo": KEY}
    return [
        ("400-echo", SUBMIT, {"status": 400, "json": echo}),
        ("503-echo", SUBMIT, {"status": 503, "json": echo}),
        ("429-echo", POP, {"status": 429, "json": echo}),
        ("html-echo", POP, {"status": 502, "body": f"<p>{KEY}</p>".encode()}),
        ("redirect", POP, {"status": 302, "headers": {"Location": f"https://x.example/{KEY}?k={KEY}"}}),
        ("bad-json", SUBMIT, {"status": 200, "body": f"not json {KEY}".encode()}),
        ("big", SUBMIT, {"status": 200, "body": KEY.encode() * 100_000}),
        ("timeout", PROGRESS, {"body": requests.exceptions.ReadTimeout(f"timed out {KEY}")}),
        ("conn", PROGRESS, {"body": requests.exceptions.ConnectionError(f"refused {KEY}")}),
        ("tls", POP, {"body": requests.exceptions.SSLError(f"tls {KEY}")}),
        ("other", POP, {"body": requests.exceptions.RequestException(f"odd {KEY}")}),
    ]


@pytest.mark.parametrize(("name", "url", "kwargs"), _key_scenarios(),
                         ids=[s[0] for s in _key_scenarios()])
def test_the_key_is_in_no_error_message_repr_or_log(
    name: str, url: str, kwargs: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    c = client()
    call = {POP: c.pop, SUBMIT: c.submit, PROGRESS: c.progress}[url]
    bodies: dict[str, dict[str, Any]] = {POP: POP_BODY, SUBMIT: SUBMIT_BODY, PROGRESS: PROGRESS_BODY}
    body = bodies[url]
    with responses.RequestsMock() as rsps:
        rsps.post(url, **kwargs)
        with pytest.raises(HordeError) as info:
            call(body, timeout_s=5)
    err = info.value
    for text in (str(err), repr(err), err.message, err.rc, json.dumps(err.body), caplog.text,
                 repr(c)):
        assert KEY not in text
    assert err.message  # something useful remains


def test_client_repr_shows_the_host_only() -> None:
    c = HordeClient("https://horde.example:8443/base", KEY, bridge_agent=AGENT)
    assert repr(c) == "HordeClient(host='horde.example:8443')"


@responses.activate
def test_one_debug_line_per_call_without_bodies(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="koboldcpp_horde_chat.horde")
    responses.post(SUBMIT, json={"reward": 3})
    client().submit(SUBMIT_BODY, timeout_s=5)
    records = [r for r in caplog.records if r.name == "koboldcpp_horde_chat.horde"]
    assert len(records) == 1
    line = records[0].getMessage()
    assert "/api/v2/generate/text/submit" in line and "200" in line and " s" in line
    assert "Blue." not in line and "reward" not in line and KEY not in line


# --- configuration --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["ftp://horde.example", "horde.example", "https://", "https://u:p@horde.example",
     "https://horde.example/?x=1", "https://horde.example:notaport"],
)
def test_unusable_base_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError):
        HordeClient(url, KEY, bridge_agent=AGENT)


@pytest.mark.parametrize("key", ["", f"{KEY}\n", f" {KEY}", "key with space", "k\u00e9y"])
def test_unusable_key_is_a_config_error_without_the_key(key: str) -> None:
    with pytest.raises(ConfigError) as info:
        HordeClient(BASE, key, bridge_agent=AGENT)
    if key.strip():
        assert key.strip() not in str(info.value)


# --- real sockets on 127.0.0.1 ----------------------------------------------------------------


def _send_json(h: BaseHTTPRequestHandler, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(obj).encode()
    h.send_response(status)
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def test_redirect_to_another_host_never_receives_the_key() -> None:
    with LocalServer(lambda h, b: _send_json(h, 200, {"id": None})) as other:
        def redirect(h: BaseHTTPRequestHandler, body: bytes) -> None:
            h.send_response(307)
            h.send_header("Location", other.url + h.path)
            h.send_header("Content-Length", "0")
            h.end_headers()

        with LocalServer(redirect) as horde:
            c = HordeClient(horde.url, KEY, bridge_agent=AGENT)
            with pytest.raises(HordeRefusal) as info:
                c.pop(POP_BODY, timeout_s=5)
            assert info.value.status == 307
            assert horde.seen[0][1]["apikey"] == KEY
        assert other.seen == []


def test_connection_refused_is_unavailable_not_sent() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    c = HordeClient(f"http://127.0.0.1:{port}", KEY, bridge_agent=AGENT, connect_timeout_s=2)
    with pytest.raises(HordeUnavailable, match="could not connect") as info:
        c.submit(SUBMIT_BODY, timeout_s=2)
    assert info.value.sent is False
    assert info.value.status == 0
    assert info.value.job_id == JOB


def test_no_answer_in_time_is_unavailable_maybe_sent() -> None:
    with LocalServer(lambda h, b: time.sleep(2)) as horde:
        c = HordeClient(horde.url, KEY, bridge_agent=AGENT)
        started = time.monotonic()
        with pytest.raises(HordeUnavailable, match="no answer") as info:
            c.submit(SUBMIT_BODY, timeout_s=0.5)
        assert time.monotonic() - started < 1.5
    assert info.value.sent is None


def test_connection_closed_without_answer_is_unavailable_maybe_sent() -> None:
    def hang_up(h: BaseHTTPRequestHandler, body: bytes) -> None:
        h.close_connection = True
        h.connection.shutdown(socket.SHUT_RDWR)

    with LocalServer(hang_up) as horde:
        c = HordeClient(horde.url, KEY, bridge_agent=AGENT)
        with pytest.raises(HordeUnavailable) as info:
            c.submit(SUBMIT_BODY, timeout_s=2)
    assert info.value.sent is None
    assert info.value.status == 0


def test_calls_reuse_one_keep_alive_connection() -> None:
    with LocalServer(lambda h, b: _send_json(h, 200, {"accepted_seq": 1, "cancelled": False})) as horde:
        c = HordeClient(horde.url, KEY, bridge_agent=AGENT)
        for _ in range(3):
            c.progress(PROGRESS_BODY, timeout_s=5)
        c.close()
    assert len(horde.seen) == 3
    assert horde.connections == 1


def test_a_trickling_answer_is_cut() -> None:
    def trickle(h: BaseHTTPRequestHandler, body: bytes) -> None:
        h.send_response(200)
        h.send_header("Content-Length", "10000")
        h.end_headers()
        for _ in range(10000):
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(0.05)

    with LocalServer(trickle) as horde:
        c = HordeClient(horde.url, KEY, bridge_agent=AGENT, connect_timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(HordeUnavailable, match="not received in time") as info:
            c.submit(SUBMIT_BODY, timeout_s=0.5)
        assert time.monotonic() - started < 2
    assert info.value.sent is True


def test_a_plain_http_horde_url_is_warned_about_once_however_many_clients_use_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker makes a client per loop and one for its start-up recovery: one warning."""
    caplog.set_level(logging.WARNING, logger="koboldcpp_horde_chat.horde")
    for _ in range(3):
        HordeClient("http://horde.plain-http.test/", "k", bridge_agent="a:1:b").close()
    HordeClient("https://horde.plain-http.test", "k", bridge_agent="a:1:b").close()
    HordeClient("http://127.0.0.1:7001", "k", bridge_agent="a:1:b").close()
    assert [r.getMessage() for r in caplog.records] == [
        "the Horde URL http://horde.plain-http.test is plain http: the API key travels unencrypted"
    ]
