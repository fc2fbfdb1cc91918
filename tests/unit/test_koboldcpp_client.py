"""KoboldClient against mocked koboldcpp answers (``responses``): every method and error."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import responses
from hypothesis import given, settings
from hypothesis import strategies as st
from responses import matchers

from koboldcpp_horde_chat.errors import BackendBusy, BackendError, BackendUnauthorized
from koboldcpp_horde_chat.jsonbody import RAW_STRING_MIN_CHARS, encode_json
from koboldcpp_horde_chat.koboldcpp.api import BackendInfo
from koboldcpp_horde_chat.koboldcpp.client import PROTECTED_MODEL_NAME, KoboldClient
from koboldcpp_horde_chat.koboldcpp.connection import BackendStream
from tests.http_server import LocalServer, send_json

BASE = "http://127.0.0.1:5001"
PASSWORD = "s3cret-pass"
UNAUTHORIZED = {
    "detail": {
        "error": "Unauthorized",
        "msg": "Authentication key is missing or invalid.",
        "type": "unauthorized",
    }
}
BUSY = {"detail": {"msg": "Server is busy; please try again later.", "type": "service_unavailable"}}
VERSION = {
    "result": "KoboldCpp",
    "version": "1.116.1",
    "protected": False,
    "llm": True,
    "txt2img": False,
    "vision": False,
    "audio": False,
    "jinja": False,
}
CHAT_BODY = {
    "id": "chatcmpl-A343157",
    "object": "chat.completion",
    "created": 1795991068,
    "model": "koboldcpp/m",
    "usage": {"prompt_tokens": 28, "completion_tokens": 2, "total_tokens": 30},
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Blue.", "tool_calls": []},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ],
}


class RecordingSession(requests.Session):
    """A Session that remembers the keyword arguments of each request."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> requests.Response:  # type: ignore[override]
        self.calls.append({"method": method, "url": url, **kwargs})
        return super().request(method, url, *args, **kwargs)


@pytest.fixture
def mocked() -> Any:
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        yield rsps


def sent_json(call: Any) -> Any:
    return json.loads(call.request.body)


def add_info(
    rsps: Any, *, model: str = "koboldcpp/Qwen3-8B", ctx: int = 8192, **version: Any
) -> None:
    rsps.add(responses.GET, f"{BASE}/api/v1/model", json={"result": model})
    rsps.add(responses.GET, f"{BASE}/api/extra/true_max_context_length", json={"value": ctx})
    rsps.add(responses.GET, f"{BASE}/api/extra/version", json={**VERSION, **version})


# ---------------------------------------------------------------- ready


def test_ready_is_true_for_the_kai_version_answer(mocked: Any) -> None:
    mocked.add(responses.GET, f"{BASE}/api/v1/info/version", json={"result": "1.2.5"})
    assert KoboldClient(BASE).ready() is True


@pytest.mark.parametrize(
    "kwargs",
    [
        {"json": {"result": ""}},
        {"json": {}},
        {"json": ["1.2.5"]},
        {"body": "<html>starting</html>"},
        {"status": 500, "json": {"result": "1.2.5"}},
        {"body": requests.ConnectionError("refused")},
    ],
)
def test_ready_is_false_unless_a_truthy_result_arrives(mocked: Any, kwargs: dict[str, Any]) -> None:
    mocked.add(responses.GET, f"{BASE}/api/v1/info/version", **kwargs)
    assert KoboldClient(BASE).ready() is False


# ----------------------------------------------------------------- info


def test_info_reads_name_context_and_capabilities(mocked: Any) -> None:
    add_info(mocked, vision=True, jinja=True)
    info = KoboldClient(BASE).info()
    assert info == BackendInfo(
        model_name="koboldcpp/Qwen3-8B",
        max_context_length=8192,
        vision=True,
        version="1.116.1",
    )
    # an open instance is not probed with a tokencount
    assert not any(c.request.url.endswith("/tokencount") for c in mocked.calls)


def test_info_tolerates_an_old_version_answer_without_the_newer_keys(mocked: Any) -> None:
    mocked.add(responses.GET, f"{BASE}/api/v1/model", json={"result": "koboldcpp/old"})
    mocked.add(responses.GET, f"{BASE}/api/extra/true_max_context_length", json={"value": 2048})
    mocked.add(responses.GET, f"{BASE}/api/extra/version", json={"result": "KoboldCpp"})
    info = KoboldClient(BASE).info()
    assert (info.vision, info.version) == (False, "")


def test_info_on_a_protected_instance_without_password_is_unauthorized(mocked: Any) -> None:
    add_info(mocked, model=PROTECTED_MODEL_NAME, protected=True)
    with pytest.raises(BackendUnauthorized) as caught:
        KoboldClient(BASE).info()
    assert "missing" in str(caught.value)


def test_info_with_a_wrong_password_is_unauthorized_by_the_masked_name(mocked: Any) -> None:
    add_info(mocked, model=PROTECTED_MODEL_NAME, protected=True)
    with pytest.raises(BackendUnauthorized) as caught:
        KoboldClient(BASE, PASSWORD).info()
    assert "wrong" in str(caught.value)
    assert PASSWORD not in str(caught.value)


def test_info_with_a_wrong_password_is_unauthorized_by_a_401_tokencount(mocked: Any) -> None:
    add_info(mocked, protected=True)
    mocked.add(responses.POST, f"{BASE}/api/extra/tokencount", status=401, json=UNAUTHORIZED)
    with pytest.raises(BackendUnauthorized) as caught:
        KoboldClient(BASE, PASSWORD).info()
    assert caught.value.status == 401
    assert PASSWORD not in str(caught.value)


def test_info_with_the_right_password_checks_it_with_an_empty_tokencount(mocked: Any) -> None:
    add_info(mocked, protected=True)
    mocked.add(
        responses.POST,
        f"{BASE}/api/extra/tokencount",
        json={"value": 1, "ids": [2], "prompt": ""},
        match=[matchers.header_matcher({"Authorization": f"Bearer {PASSWORD}"})],
    )
    KoboldClient(BASE, PASSWORD).info()
    count_calls = [c for c in mocked.calls if c.request.url.endswith("/api/extra/tokencount")]
    assert [sent_json(c) for c in count_calls] == [{"prompt": ""}]


@pytest.mark.parametrize("ctx", [{"value": 0}, {"value": "4096"}, {"value": True}, {}])
def test_info_rejects_a_context_size_that_is_not_a_positive_int(mocked: Any, ctx: Any) -> None:
    mocked.add(responses.GET, f"{BASE}/api/v1/model", json={"result": "koboldcpp/m"})
    mocked.add(responses.GET, f"{BASE}/api/extra/true_max_context_length", json=ctx)
    mocked.add(responses.GET, f"{BASE}/api/extra/version", json=VERSION)
    with pytest.raises(BackendError):
        KoboldClient(BASE).info()


def test_info_when_koboldcpp_is_down_is_a_backend_error_with_status_0(mocked: Any) -> None:
    mocked.add(responses.GET, f"{BASE}/api/v1/model", body=requests.ConnectionError("refused"))
    with pytest.raises(BackendError) as caught:
        KoboldClient(BASE).info()
    assert caught.value.status == 0
    assert not isinstance(caught.value, BackendUnauthorized)


# ----------------------------------------------------------------- perf


def test_perf_returns_the_statistics_object(mocked: Any) -> None:
    perf = {"total_gens": 3, "queue": 1, "idle": 0, "idletime": 2.5}
    mocked.add(responses.GET, f"{BASE}/api/extra/perf", json=perf)
    assert KoboldClient(BASE).perf() == perf


# ------------------------------------------------------------ tokencount


def test_tokencount_sends_only_the_prompt_and_returns_the_value(mocked: Any) -> None:
    mocked.add(
        responses.POST,
        f"{BASE}/api/extra/tokencount",
        json={"value": 11, "ids": list(range(11)), "prompt": "Hello world"},
    )
    assert KoboldClient(BASE).tokencount("Hello world", timeout_s=5) == 11
    assert sent_json(mocked.calls[0]) == {"prompt": "Hello world"}


@pytest.mark.parametrize("body", [{"value": -1}, {"value": "11"}, {"ids": []}, {"value": None}])
def test_tokencount_without_a_usable_count_is_an_error(mocked: Any, body: Any) -> None:
    mocked.add(responses.POST, f"{BASE}/api/extra/tokencount", json=body)
    with pytest.raises(BackendError):
        KoboldClient(BASE).tokencount("x", timeout_s=5)


def test_tokencount_400_is_a_backend_error_with_its_status(mocked: Any) -> None:
    mocked.add(responses.POST, f"{BASE}/api/extra/tokencount", status=400, json={"value": -1})
    with pytest.raises(BackendError) as caught:
        KoboldClient(BASE).tokencount("x", timeout_s=5)
    assert caught.value.status == 400


# ------------------------------------------------------------- headers


def test_the_bearer_is_sent_only_with_a_password_and_never_an_apikey(mocked: Any) -> None:
    for _ in range(2):
        mocked.add(responses.POST, f"{BASE}/api/extra/tokencount", json={"value": 1})
    KoboldClient(BASE).tokencount("", timeout_s=5)
    KoboldClient(BASE, PASSWORD).tokencount("", timeout_s=5)
    open_headers = mocked.calls[0].request.headers
    protected_headers = mocked.calls[1].request.headers
    assert "Authorization" not in open_headers
    assert protected_headers["Authorization"] == f"Bearer {PASSWORD}"
    for headers in (open_headers, protected_headers):
        assert "apikey" not in {name.lower() for name in headers}
        assert headers["Content-Type"] == "application/json"


def test_every_call_passes_a_connect_and_read_timeout_pair(mocked: Any) -> None:
    session = RecordingSession()
    client = KoboldClient(BASE, connect_timeout_s=3.0, session=session)
    mocked.add(responses.GET, f"{BASE}/api/v1/info/version", json={"result": "1.2.5"})
    mocked.add(responses.GET, f"{BASE}/api/extra/perf", json={})
    mocked.add(responses.POST, f"{BASE}/api/extra/tokencount", json={"value": 1})
    mocked.add(responses.POST, f"{BASE}/v1/chat/completions", json=CHAT_BODY)
    mocked.add(responses.POST, f"{BASE}/api/extra/abort", json={"success": "true", "done": "true"})
    mocked.add(responses.POST, f"{BASE}/api/v1/generate", json={"results": [{"text": "x"}]})
    mocked.add(
        responses.POST,
        f"{BASE}/v1/chat/completions",
        body=b"data: [DONE]\n\n",
        content_type="text/event-stream",
    )
    client.ready(timeout_s=4.0)
    client.perf(timeout_s=5.0)
    client.tokencount("", timeout_s=6.0)
    client.chat_completion({"messages": []}, timeout_s=7.0)
    client.abort("HORDEREQ_1", timeout_s=8.0)
    client.generate({"prompt": "x"}, timeout_s=9.0)
    client.open_chat_stream({"messages": []}, read_timeout_s=10.0).close()
    assert [c["timeout"] for c in session.calls] == [
        (3.0, 4.0),
        (3.0, 5.0),
        (3.0, 6.0),
        (3.0, 7.0),
        (3.0, 8.0),
        (3.0, 9.0),
        (3.0, 10.0),
    ]


# ------------------------------------------------------- chat_completion


def test_chat_completion_posts_the_body_unchanged_and_returns_the_object(mocked: Any) -> None:
    mocked.add(responses.POST, f"{BASE}/v1/chat/completions", json=CHAT_BODY)
    body = {"messages": [{"role": "user", "content": "Name one colour."}], "genkey": "HORDEREQ_1"}
    assert KoboldClient(BASE).chat_completion(body, timeout_s=30) == CHAT_BODY
    assert sent_json(mocked.calls[0]) == body


@pytest.mark.parametrize(
    ("kwargs", "error", "status"),
    [
        ({"status": 401, "json": UNAUTHORIZED}, BackendUnauthorized, 401),
        ({"status": 503, "json": BUSY}, BackendBusy, 503),
        ({"status": 500, "json": {"detail": {"msg": "Error parsing input."}}}, BackendError, 500),
        ({"status": 404, "body": "not found"}, BackendError, 404),
        ({"status": 200, "body": "{not json"}, BackendError, 200),
        ({"status": 200, "json": [1, 2]}, BackendError, 200),
        ({"status": 200, "json": "text"}, BackendError, 200),
        ({"body": requests.ConnectionError("refused")}, BackendError, 0),
        ({"body": requests.ReadTimeout("read timed out")}, BackendError, 0),
        ({"body": requests.exceptions.ChunkedEncodingError("cut")}, BackendError, 0),
    ],
)
def test_chat_completion_maps_every_failure_to_a_backend_error(
    mocked: Any, kwargs: dict[str, Any], error: type[BackendError], status: int
) -> None:
    mocked.add(responses.POST, f"{BASE}/v1/chat/completions", **kwargs)
    with pytest.raises(error) as caught:
        KoboldClient(BASE, PASSWORD).chat_completion({"messages": []}, timeout_s=5)
    assert type(caught.value) is error
    assert caught.value.status == status
    assert PASSWORD not in str(caught.value)


def test_busy_is_retryable_and_unauthorized_is_not(mocked: Any) -> None:
    mocked.add(responses.POST, f"{BASE}/v1/chat/completions", status=503, json=BUSY)
    mocked.add(responses.POST, f"{BASE}/v1/chat/completions", status=401, json=UNAUTHORIZED)
    client = KoboldClient(BASE)
    with pytest.raises(BackendBusy) as busy:
        client.chat_completion({}, timeout_s=5)
    with pytest.raises(BackendUnauthorized):
        client.chat_completion({}, timeout_s=5)
    assert "Server is busy" in str(busy.value)


def test_a_timeout_says_it_timed_out(mocked: Any) -> None:
    mocked.add(responses.POST, f"{BASE}/v1/chat/completions", body=requests.ReadTimeout("slow"))
    with pytest.raises(BackendError, match="timed out"):
        KoboldClient(BASE).chat_completion({}, timeout_s=1)


def test_the_password_never_appears_even_when_an_exception_text_holds_it(mocked: Any) -> None:
    mocked.add(
        responses.POST,
        f"{BASE}/v1/chat/completions",
        body=requests.ConnectionError(f"proxy said Bearer {PASSWORD} is bad"),
    )
    with pytest.raises(BackendError) as caught:
        KoboldClient(BASE, PASSWORD).chat_completion({}, timeout_s=1)
    assert PASSWORD not in str(caught.value) + repr(caught.value)
    # The exception's own text is never quoted, so neither is what it holds.
    assert str(caught.value) == "POST /v1/chat/completions connection failed"


def test_an_answer_over_the_size_cap_is_an_error(mocked: Any) -> None:
    big = {"pad": "x" * 5000}
    mocked.add(responses.POST, f"{BASE}/v1/chat/completions", json=big)
    client = KoboldClient(BASE, max_body_bytes=4096)
    with pytest.raises(BackendError, match="larger than 4096 bytes"):
        client.chat_completion({}, timeout_s=5)
    mocked.add(responses.POST, f"{BASE}/v1/chat/completions", json=big)
    assert KoboldClient(BASE, max_body_bytes=8192).chat_completion({}, timeout_s=5) == big


def test_a_body_that_is_not_json_serialisable_is_a_backend_error() -> None:
    with pytest.raises(BackendError, match="not JSON"):
        KoboldClient(BASE).chat_completion({"x": object()}, timeout_s=1)


# ------------------------------------------------------ open_chat_stream


SSE = (
    b'data: {"id": "chatcmpl-A1", "object": "chat.completion.chunk", "choices": '
    b'[{"index": 0, "finish_reason": null, "delta": {"role": "assistant", "content": "Blue."}}]}\n\n'
    b"data: [DONE]\n\n"
)


def test_open_chat_stream_asks_for_a_stream_and_reads_all_bytes(mocked: Any) -> None:
    mocked.add(
        responses.POST, f"{BASE}/v1/chat/completions", body=SSE, content_type="text/event-stream"
    )
    stream = KoboldClient(BASE).open_chat_stream(
        {"messages": [], "stream_options": {"include_usage": True}}, read_timeout_s=5
    )
    assert isinstance(stream, BackendStream)
    data = b""
    while chunk := stream.read_chunk():
        assert len(chunk) <= 65536
        data += chunk
    assert data == SSE
    assert stream.read_chunk() == b""
    sent = sent_json(mocked.calls[0])
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert mocked.calls[0].request.headers["Accept"] == "text/event-stream"
    stream.close()
    stream.close()
    assert stream.closed


def test_open_chat_stream_with_a_whole_json_answer_is_an_error(mocked: Any) -> None:
    mocked.add(responses.POST, f"{BASE}/v1/chat/completions", json=CHAT_BODY)
    with pytest.raises(BackendError, match="instead of an event stream") as caught:
        KoboldClient(BASE).open_chat_stream({"messages": []}, read_timeout_s=5)
    assert caught.value.status == 200


@pytest.mark.parametrize(
    ("kwargs", "error", "status"),
    [
        ({"status": 401, "json": UNAUTHORIZED}, BackendUnauthorized, 401),
        ({"status": 503, "json": BUSY}, BackendBusy, 503),
        ({"status": 500, "body": "boom"}, BackendError, 500),
        ({"body": requests.ConnectionError("refused")}, BackendError, 0),
        ({"status": 200, "body": "plain text", "content_type": "text/plain"}, BackendError, 200),
    ],
)
def test_open_chat_stream_maps_failures(
    mocked: Any, kwargs: dict[str, Any], error: type[BackendError], status: int
) -> None:
    mocked.add(responses.POST, f"{BASE}/v1/chat/completions", **kwargs)
    with pytest.raises(error) as caught:
        KoboldClient(BASE, PASSWORD).open_chat_stream({}, read_timeout_s=5)
    assert type(caught.value) is error
    assert caught.value.status == status


def test_a_closed_stream_reads_nothing_more(mocked: Any) -> None:
    mocked.add(
        responses.POST, f"{BASE}/v1/chat/completions", body=SSE, content_type="text/event-stream"
    )
    stream = KoboldClient(BASE).open_chat_stream({}, read_timeout_s=5)
    stream.close()
    assert stream.closed
    assert stream.read_chunk() == b""


def test_a_read_error_mid_stream_is_a_backend_error() -> None:
    class Broken:
        def read1(self, amt: int) -> bytes:
            raise requests.exceptions.ConnectionError("reset by peer")

    response = requests.Response()
    response.status_code = 200
    response.raw = Broken()
    with pytest.raises(BackendError, match="reading the chat stream") as caught:
        BackendStream(response).read_chunk()
    assert caught.value.status == 0


# ------------------------------------------------------------------ abort


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"success": "true", "done": "true"}, True),
        ({"success": "true", "done": "false"}, True),
        ({"success": "false", "done": "false"}, False),
        ({"success": True}, True),
        ({"success": "True"}, False),
        ({}, False),
    ],
)
def test_abort_reads_the_string_success(mocked: Any, body: Any, expected: bool) -> None:
    mocked.add(responses.POST, f"{BASE}/api/extra/abort", json=body)
    assert KoboldClient(BASE).abort("HORDEREQ_123") is expected
    assert sent_json(mocked.calls[0]) == {"genkey": "HORDEREQ_123"}


def test_abort_on_a_protected_instance_without_password_is_unauthorized(mocked: Any) -> None:
    mocked.add(responses.POST, f"{BASE}/api/extra/abort", status=401, json=UNAUTHORIZED)
    with pytest.raises(BackendUnauthorized):
        KoboldClient(BASE).abort("HORDEREQ_1")


# --------------------------------------------------------------- generate


def test_generate_posts_the_payload_to_the_kobold_route(mocked: Any) -> None:
    answer: dict[str, Any] = {
        "results": [
            {
                "text": " Paris.",
                "tool_calls": [],
                "finish_reason": "stop",
                "logprobs": None,
                "prompt_tokens": 6,
                "completion_tokens": 2,
            }
        ]
    }
    mocked.add(responses.POST, f"{BASE}/api/v1/generate", json=answer)
    payload = {"prompt": "The capital of France is", "max_length": 48, "genkey": "HORDEREQ_9"}
    assert KoboldClient(BASE).generate(payload, timeout_s=30) == answer
    assert sent_json(mocked.calls[0]) == payload


def test_generate_busy_is_backend_busy(mocked: Any) -> None:
    mocked.add(responses.POST, f"{BASE}/api/v1/generate", status=503, json=BUSY)
    with pytest.raises(BackendBusy):
        KoboldClient(BASE).generate({"prompt": "x"}, timeout_s=5)


def test_the_base_url_trailing_slash_is_ignored(mocked: Any) -> None:
    mocked.add(responses.GET, f"{BASE}/api/extra/perf", json={"idle": 1})
    assert KoboldClient(BASE + "/").perf() == {"idle": 1}


def test_the_client_repr_hides_the_password() -> None:
    assert PASSWORD not in repr(KoboldClient(BASE, PASSWORD))


# ----------------------------------------------------------- encode_json

# Long strings around the 64 KiB threshold: a base64 data URL, and strings that
# need escaping (quote, backslash, control characters, DEL, non-ASCII).
LONG_UNITS = ["A", "iVBORw0KGgo+/=", "x\n", 'q"', "\\", "\u00e9", "\x7f", "\x00", "~ ", "\u2603b"]
LONG_STRINGS = st.builds(
    lambda head, unit, n, tail: head + unit * n + tail,
    st.sampled_from(["", "data:image/png;base64,", "\t", "\u00fc"]),
    st.sampled_from(LONG_UNITS),
    st.sampled_from([RAW_STRING_MIN_CHARS - 1, RAW_STRING_MIN_CHARS, RAW_STRING_MIN_CHARS + 7]),
    st.text(max_size=3),
)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | LONG_STRINGS,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)


@settings(max_examples=150, deadline=None)
@given(JSON_VALUES)
def test_encode_json_round_trips_any_json_value(value: Any) -> None:
    encoded = encode_json(value)
    assert json.loads(encoded) == value
    assert bytes(encoded) == json.dumps(value).encode("ascii")


def test_a_long_clean_string_is_spliced_in_and_the_rest_encoded_by_json() -> None:
    url = "data:image/jpeg;base64," + "/9j/4AAQ" * 20_000
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "caf\u00e9 \"quoted\"\n"},
        {"type": "image_url", "image_url": {"url": url}},
    ]}], "tools": ({"a": 1}, [url]), "n": 1.5}  # fmt: skip
    encoded = encode_json(body)
    assert isinstance(encoded, bytearray)
    assert bytes(encoded) == json.dumps(body).encode("ascii")
    assert body["messages"][0]["content"][1]["image_url"]["url"] is url  # not modified


@pytest.mark.parametrize("at", [0, 300 * 1024, 600 * 1024 + 5])
def test_a_control_character_deep_in_a_long_string_is_escaped(at: int) -> None:
    text = "A" * at + "\n" + "B" * (700 * 1024 - at)
    body = {"before": "x" * RAW_STRING_MIN_CHARS, "text": text, "after": ["y" * RAW_STRING_MIN_CHARS, 1]}
    assert bytes(encode_json(body)) == json.dumps(body).encode("ascii")


def test_encode_json_refuses_what_json_refuses() -> None:
    with pytest.raises(TypeError):
        encode_json({"a": object(), "b": "x" * RAW_STRING_MIN_CHARS})
    looped: list[Any] = []
    looped.append(looped)
    with pytest.raises(RecursionError):
        encode_json(looped)
    with pytest.raises(BackendError, match="not JSON"):
        KoboldClient(BASE).chat_completion({"messages": looped}, timeout_s=5)


@pytest.fixture
def raw_server() -> Iterator[LocalServer]:
    """A local HTTP server keeping each request's headers and raw body; answers
    every request with a chat completion."""
    with LocalServer(lambda handler, _body: send_json(handler, 200, CHAT_BODY)) as server:
        yield server


def test_a_large_chat_body_reaches_koboldcpp_whole_with_its_content_length(
    raw_server: LocalServer,
) -> None:
    images = ["data:image/png;base64," + "iVBORw0KGgo" * (9_000 + i) for i in range(3)]
    body = {
        "messages": [
            {"role": "system", "content": "Be terse. \u2603 \"ok\"\n"},
            {"role": "user", "content": [
                {"type": "text", "text": "What differs?"},
                *({"type": "image_url", "image_url": {"url": u}} for u in images),
            ]},
        ],
        "max_tokens": 64,
        "genkey": "HORDEREQ_1",
    }  # fmt: skip
    client = KoboldClient(raw_server.url)
    assert client.chat_completion(body, timeout_s=10) == CHAT_BODY
    assert client.chat_completion(encode_json(body), timeout_s=10) == CHAT_BODY
    assert len(raw_server.bodies) == 2
    for (_, headers), raw in zip(raw_server.seen, raw_server.bodies, strict=True):
        assert json.loads(raw) == body
        assert headers["content-length"] == str(len(raw))
        assert "transfer-encoding" not in headers
    assert raw_server.bodies[0] == raw_server.bodies[1]


def test_an_encoded_stream_body_is_sent_unchanged(mocked: Any) -> None:
    mocked.add(
        responses.POST, f"{BASE}/v1/chat/completions", body=b"data: [DONE]\n\n",
        content_type="text/event-stream",
    )
    encoded = encode_json({"messages": [], "stream": True, "genkey": "HORDEREQ_2"})
    KoboldClient(BASE).open_chat_stream(encoded, read_timeout_s=5).close()
    assert mocked.calls[0].request.body == encoded


# ------------------------------------------------------- the environment
# (proxies, .netrc and CA bundles against local servers: tests/integration/test_http_env.py)


def test_a_session_passed_in_is_used_as_it_is() -> None:
    session = requests.Session()
    KoboldClient(BASE, session=session)
    assert session.trust_env is True and session.proxies == {}


def test_a_refused_connection_is_said_in_a_few_words_without_the_http_library_text() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(BackendError) as caught:
        KoboldClient(f"http://127.0.0.1:{port}").info(timeout_s=2)
    assert str(caught.value) == "GET /api/v1/model connection failed (refused)"
