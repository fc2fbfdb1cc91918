"""The scripted koboldcpp against real koboldcpp 1.116.1 recordings, and KoboldClient against both.

Shapes (key order and value types), statuses and headers of every scripted
answer are compared with ``kcpp-samples/`` (recorded from a real koboldcpp
1.116.1); ids, timestamps and text may differ. The samples are read from
``tests/data/kcpp-samples`` or, failing that, ``$KCPP_SAMPLES``; tests that
need them skip when none exists.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped, unused-ignore]
import pytest
import requests

from koboldcpp_horde_chat.devkit.kcpp import (
    BUSY_BODY,
    PROTECTED_MODEL_NAME,
    UNAUTHORIZED_BODY,
    Fault,
    OaiStreamSplitter,
    ScriptedKoboldcpp,
    ScriptedReply,
    grammar_root_kind,
    split_reasoning,
)
from koboldcpp_horde_chat.errors import BackendError, BackendUnauthorized
from koboldcpp_horde_chat.koboldcpp.client import KoboldClient


def _samples_dir() -> Path | None:
    here = Path(__file__).resolve().parents[1] / "data" / "kcpp-samples"
    for candidate in (
        here,
        Path(os.environ.get("KCPP_SAMPLES", "")),
    ):
        if str(candidate) and (candidate / "chat_nonstream.body").is_file():
            return candidate
    return None


SAMPLES = _samples_dir()
needs_samples = pytest.mark.skipif(SAMPLES is None, reason="kcpp-samples not found")

COLOUR = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name one colour."},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}


# ------------------------------------------------------------------ helpers


def sample_text(name: str) -> str:
    assert SAMPLES is not None
    return (SAMPLES / name).read_bytes().decode("utf-8")


def sample_bytes(name: str) -> bytes:
    assert SAMPLES is not None
    return (SAMPLES / name).read_bytes()


def sample_json(name: str) -> Any:
    return json.loads(sample_text(name + ".body"))


def sample_headers(name: str) -> tuple[str, list[tuple[str, str]]]:
    lines = sample_text(name + ".headers").split("\r\n")
    status = lines[0]
    headers = [tuple(line.split(": ", 1)) for line in lines[1:] if line]
    return status, [(h[0], h[1]) for h in headers]


def assert_same_shape(actual: Any, expected: Any, path: str = "$") -> None:
    """Same key order, same JSON types, recursively (lists: first items)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: {actual!r} is not an object"
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same_shape(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list), f"{path}: {actual!r} is not a list"
        if actual and expected:
            assert_same_shape(actual[0], expected[0], f"{path}[0]")
    elif expected is None:
        assert actual is None, f"{path}: {actual!r} is not null"
    else:
        assert type(actual) is type(expected), (
            f"{path}: {actual!r} is not a {type(expected).__name__}"
        )


def raw_http(
    url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[str, list[tuple[str, str]], bytes]:
    """One request over a plain socket; returns (status line, headers in order, body)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: {len(data)}\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
    for name, value in (headers or {}).items():
        head += f"{name}: {value}\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + b"\r\n" + data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    header_blob, _, payload = received.partition(b"\r\n\r\n")
    lines = header_blob.decode("latin-1").split("\r\n")
    return lines[0], [(k, v) for k, v in (line.split(": ", 1) for line in lines[1:])], payload


def sse_events(payload: bytes) -> list[str]:
    """The ``data:`` values of an SSE body made only of ``data: ...\\n\\n`` events."""
    assert payload.endswith(b"\n\n")
    events = payload.decode("utf-8").split("\n\n")[:-1]
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [event[len("data: ") :] for event in events]


def chunks_of(payload: bytes) -> list[dict[str, Any]]:
    events = sse_events(payload)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def chat(k: ScriptedKoboldcpp, **body: Any) -> requests.Response:
    return requests.post(k.url + "/v1/chat/completions", json=body, timeout=20)


def message_of(response: requests.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return {
        **choice["message"],
        "_finish": choice["finish_reason"],
        "_usage": response.json()["usage"],
    }


@pytest.fixture
def k() -> Iterator[ScriptedKoboldcpp]:
    with ScriptedKoboldcpp(abort_reply_delay_s=0.0) as server:
        yield server


# --------------------------------------------------- shapes of the open GETs


GET_SAMPLES = [
    ("/api/extra/version", "get_extra_version"),
    ("/api/extra/true_max_context_length", "get_true_max_ctx"),
    ("/api/v1/info/version", "get_v1_info_version"),
    ("/api/v1/model", "get_v1_model"),
    ("/v1/models", "get_v1_models"),
    ("/api/extra/perf", "get_perf_initial"),
]


@needs_samples
@pytest.mark.parametrize(("path", "name"), GET_SAMPLES)
def test_open_gets_match_the_recorded_answers(k: ScriptedKoboldcpp, path: str, name: str) -> None:
    status_line, headers, payload = raw_http(k.url, "GET", path)
    expected_status, expected_headers = sample_headers(name)
    assert status_line == expected_status == "HTTP/1.0 200 OK"
    assert [h[0] for h in headers] == [h[0] for h in expected_headers]
    skip = {"Date", "content-length"}
    assert [h for h in headers if h[0] not in skip] == [
        h for h in expected_headers if h[0] not in skip
    ]
    assert dict(headers)["content-length"] == str(len(payload))
    assert_same_shape(json.loads(payload), sample_json(name))


@needs_samples
def test_fixed_values_of_the_open_gets(k: ScriptedKoboldcpp) -> None:
    assert requests.get(k.url + "/api/v1/info/version").json() == sample_json("get_v1_info_version")
    version = requests.get(k.url + "/api/extra/version").json()
    assert {**version, "version": "1.116.1"} == sample_json("get_extra_version")
    assert requests.get(k.url + "/api/extra/true_max_context_length").json() == {"value": 4096}
    assert requests.get(k.url + "/api/v1/config/max_context_length").json() == {"value": 4096}
    assert requests.get(k.url + "/api/v1/config/max_length").json() == {"value": 1024}
    assert requests.get(k.url + "/api/v1/model").json() == {"result": "koboldcpp/scripted-model"}


def test_version_reports_vision_jinja_and_protection_as_configured() -> None:
    with ScriptedKoboldcpp(vision=True, jinja=True, password="pw", version="1.117.1") as k:
        version = requests.get(k.url + "/api/extra/version").json()
    assert (version["vision"], version["jinja"], version["protected"], version["version"]) == (
        True,
        True,
        True,
        "1.117.1",
    )


# ----------------------------------------------------- tokencount and generate


@needs_samples
def test_tokencount_matches_the_recording_and_counts_bos(k: ScriptedKoboldcpp) -> None:
    prompt = "Hello world, this is a token count test."
    answer = requests.post(k.url + "/api/extra/tokencount", json={"prompt": prompt}).json()
    assert_same_shape(answer, sample_json("tokencount"))
    assert answer["prompt"] == prompt
    assert answer["ids"][0] == 2
    assert answer["value"] == len(answer["ids"]) == 1 + -(-len(prompt) // 4)
    empty = requests.post(k.url + "/api/extra/tokencount", json={"prompt": ""}).json()
    assert empty == sample_json("tokencount_empty") == {"value": 1, "ids": [2], "prompt": ""}
    assert k.tokencount_messages == []


def test_tokencount_of_messages_is_recorded(k: ScriptedKoboldcpp) -> None:
    body = {"prompt": "", "messages": COLOUR, "tools": [WEATHER_TOOL]}
    answer = requests.post(k.url + "/api/extra/tokencount", json=body).json()
    assert answer["value"] > 10
    assert "Name one colour." in answer["prompt"]
    assert k.tokencount_messages == [body]


@needs_samples
def test_kobold_generate_matches_the_recording(k: ScriptedKoboldcpp) -> None:
    body = {"prompt": "The capital of France is", "max_length": 48, "genkey": "KCPPgen1"}
    answer = requests.post(k.url + "/api/v1/generate", json=body).json()
    assert_same_shape(answer, sample_json("v1_generate"))
    result = answer["results"][0]
    assert result["finish_reason"] == "stop"
    assert result["completion_tokens"] == -(-len(result["text"]) // 4)


def test_kobold_generate_honours_budget_and_stop_sequence(k: ScriptedKoboldcpp) -> None:
    k.script(lambda body: ScriptedReply(text=" Paris. And then Lyon."))
    cut = requests.post(k.url + "/api/v1/generate", json={"prompt": "x", "max_length": 2}).json()
    assert cut["results"][0] | {"logprobs": None} == {
        "text": " Paris. ",
        "tool_calls": [],
        "finish_reason": "length",
        "logprobs": None,
        "prompt_tokens": 2,
        "completion_tokens": 2,
    }
    stopped = requests.post(
        k.url + "/api/v1/generate",
        json={"prompt": "x", "max_length": 50, "stop_sequence": [" And"]},
    ).json()["results"][0]
    assert (stopped["text"], stopped["finish_reason"]) == (" Paris.", "length")
    assert stopped["completion_tokens"] < 50


# ---------------------------------------------------------- chat, non-stream


@needs_samples
def test_chat_nonstream_matches_the_recording(k: ScriptedKoboldcpp) -> None:
    status_line, headers, payload = raw_http(
        k.url, "POST", "/v1/chat/completions", {"messages": COLOUR, "max_tokens": 64}
    )
    expected_status, expected_headers = sample_headers("chat_nonstream")
    assert status_line == expected_status
    skip = {"Date", "content-length"}
    assert [h for h in headers if h[0] not in skip] == [
        h for h in expected_headers if h[0] not in skip
    ]
    body = json.loads(payload)
    assert_same_shape(body, sample_json("chat_nonstream"))
    assert re.fullmatch(r"chatcmpl-A\d{6}", body["id"])
    assert body["model"] == "koboldcpp/scripted-model"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Blue.",
        "tool_calls": [],
    }
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["completion_tokens"] == 2
    assert usage["total_tokens"] == usage["prompt_tokens"] + 2
    assert usage["prompt_tokens"] > 10


@needs_samples
@pytest.mark.parametrize(
    ("name", "tool_choice"),
    [
        ("chat_tools_required", "required"),
        ("chat_tools_named", {"type": "function", "function": {"name": "get_weather"}}),
        ("chat_tools_auto", "auto"),
    ],
)
def test_chat_tool_calls_match_the_recording(
    k: ScriptedKoboldcpp, name: str, tool_choice: Any
) -> None:
    other = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}
    tools = [other, WEATHER_TOOL] if name == "chat_tools_named" else [WEATHER_TOOL, other]
    response = chat(
        k,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=128,
    )
    body = response.json()
    assert_same_shape(body, sample_json("chat_tools_required"))
    message = body["choices"][0]["message"]
    assert message["content"] == ""
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert re.fullmatch(r"call_[1-9]\d{4}", call["id"])
    assert call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])  # type: ignore[index]
    assert list(arguments) == ["city"]


def test_tool_results_and_tool_choices(k: ScriptedKoboldcpp) -> None:
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_12345",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_12345", "content": '{"temp_c": 18}'},
    ]
    answer = message_of(chat(k, messages=history, tools=[WEATHER_TOOL]))
    assert answer["tool_calls"] == [] and answer["_finish"] == "stop"
    assert '{"temp_c": 18}' in answer["content"]
    again = message_of(chat(k, messages=history, tools=[WEATHER_TOOL], tool_choice="required"))
    assert again["_finish"] == "tool_calls"
    plain = message_of(
        chat(
            k,
            messages=[{"role": "user", "content": "Name one colour."}],
            tools=[WEATHER_TOOL],
            tool_choice="none",
        )
    )
    assert (plain["content"], plain["tool_calls"], plain["_finish"]) == ("Blue.", [], "stop")


@needs_samples
def test_json_object_yields_an_array_like_real_koboldcpp(k: ScriptedKoboldcpp) -> None:
    body = chat(
        k,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=64,
    ).json()
    assert_same_shape(body, sample_json("chat_json_object"))
    content = body["choices"][0]["message"]["content"]
    assert content.startswith("[\n") and isinstance(json.loads(content), list)
    assert body["choices"][0]["finish_reason"] == "stop"


@needs_samples
def test_json_schema_yields_an_object_satisfying_it(k: ScriptedKoboldcpp) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array"},
        },
        "required": ["name", "age"],
    }
    body = chat(
        k,
        messages=[{"role": "user", "content": "A cat"}],
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}},
    ).json()
    assert_same_shape(body, sample_json("chat_json_schema"))
    value = json.loads(body["choices"][0]["message"]["content"])
    jsonschema.validate(value, schema)
    assert sorted(value) == ["age", "name"]


def test_an_object_rooted_grammar_yields_an_object(k: ScriptedKoboldcpp) -> None:
    from koboldcpp_horde_chat.translate.bodies import OBJECT_JSON_GRAMMAR

    content = message_of(
        chat(k, messages=[{"role": "user", "content": "A cat"}], grammar=OBJECT_JSON_GRAMMAR)
    )["content"]
    assert isinstance(json.loads(content), dict)
    # json_object beside the grammar replaces it with the array-rooted one (koboldcpp 1.116.1 koboldcpp.py L4279-4303)
    both = message_of(
        chat(
            k,
            messages=[{"role": "user", "content": "A cat"}],
            grammar=OBJECT_JSON_GRAMMAR,
            response_format={"type": "json_object"},
        )
    )["content"]
    assert isinstance(json.loads(both), list)


def test_grammar_root_kind() -> None:
    assert (
        grammar_root_kind('root ::= object\nobject ::= "{" ws "}"\nws ::= [ \\t\\n]*') == "object"
    )
    assert (
        grammar_root_kind('root ::= ws arr\narr ::= "[" ws "]"\nws ::= ([ \\t\\n] ws)?') == "array"
    )
    assert grammar_root_kind('root ::= "yes" | "no"') == "other"
    assert grammar_root_kind("nonsense") == "other"


def test_reasoning_is_split_unless_cut_before_the_end_tag(k: ScriptedKoboldcpp) -> None:
    msgs = [{"role": "user", "content": "Think first: what is 2 + 2?"}]
    whole = message_of(chat(k, messages=msgs, max_tokens=200))
    assert whole["reasoning_content"].strip().startswith("The user wrote:")
    assert "<think>" not in whole["content"] and whole["content"].strip().startswith("You said")
    assert whole["_finish"] == "stop"
    cut = message_of(chat(k, messages=msgs, max_tokens=5))
    assert "reasoning_content" not in cut
    assert cut["content"].startswith("<think>")
    assert (cut["_finish"], cut["_usage"]["completion_tokens"]) == ("length", 5)
    no_encap = message_of(chat(k, messages=msgs, max_tokens=200, encapsulate_thinking=False))
    assert "reasoning_content" not in no_encap
    assert no_encap["content"] == whole["reasoning_content"] + whole["content"]


def test_split_reasoning_follows_koboldcpp() -> None:
    assert split_reasoning("<think>a</think>b") == ("b", "a")
    assert split_reasoning("a</think>b") == ("b", "a")
    assert split_reasoning("<think>a") == ("<think>a", "")
    assert split_reasoning("x<seed:think>a</seed:think>b") == ("xb", "a")


def test_budget_stop_strings_and_eos(k: ScriptedKoboldcpp) -> None:
    long = message_of(
        chat(k, messages=[{"role": "user", "content": "Tell me a long story"}], max_tokens=3)
    )
    assert (long["content"], long["_finish"], long["_usage"]["completion_tokens"]) == (
        "Once upon a ",
        "length",
        3,
    )
    stopped = message_of(
        chat(
            k,
            messages=[{"role": "user", "content": "Tell me a story"}],
            max_tokens=300,
            stop=["fox"],
        )
    )
    assert stopped["content"] == "Once upon a time a small "
    assert stopped["_finish"] == "length"
    assert stopped["_usage"]["completion_tokens"] < 300
    # the EOS needs one more token of budget: "Blue." is 2 tokens
    assert message_of(chat(k, messages=COLOUR, max_tokens=2))["_finish"] == "length"
    assert message_of(chat(k, messages=COLOUR, max_tokens=3))["_finish"] == "stop"


def test_the_budget_is_clamped_like_koboldcpp() -> None:
    with ScriptedKoboldcpp(max_context_length=100) as k:
        k.script(lambda body: ScriptedReply(text="x" * 1000))
        usage = message_of(chat(k, messages=[{"role": "user", "content": "hi"}], max_tokens=500))[
            "_usage"
        ]
    # above 80% of the context: ctx - max(min(ctx - 4, 16), 20% of ctx) = 80
    assert usage["completion_tokens"] == 80


def test_a_prompt_over_the_context_is_cut_silently() -> None:
    with ScriptedKoboldcpp(max_context_length=256) as k:
        body = chat(k, messages=[{"role": "user", "content": "word " * 400}], max_tokens=16).json()
        assert body["usage"]["prompt_tokens"] == 256 - 16
        assert k.generations[-1]["overflow"] is True


def test_scripted_replies(k: ScriptedKoboldcpp) -> None:
    replies = iter(
        [
            ScriptedReply(text="fine", reasoning="hmm", prompt_tokens=77),
            ScriptedReply(text="oops", finish="error"),
            ScriptedReply(text="short", finish="length"),
            ScriptedReply(text="cut here", finish="stop_sequence"),
            ScriptedReply(tool_calls=[{"name": "get_weather", "arguments": {"city": "Oslo"}}]),
            ScriptedReply(
                tool_calls=[
                    {"id": "call_11111", "function": {"name": "get_weather", "arguments": "{}"}}
                ]
            ),
        ]
    )
    seen: list[dict[str, Any]] = []

    def script(body: dict[str, Any]) -> ScriptedReply:
        seen.append(body)
        return next(replies)

    k.script(script)
    user = [{"role": "user", "content": "hi"}]
    first = message_of(chat(k, messages=user, genkey="HORDEREQ_1"))
    assert (first["content"], first["reasoning_content"], first["_usage"]["prompt_tokens"]) == (
        "fine",
        "hmm",
        77,
    )
    assert seen[0]["genkey"] == "HORDEREQ_1"
    assert message_of(chat(k, messages=user))["_finish"] == "error"
    length = message_of(chat(k, messages=user, max_tokens=40))
    assert (length["content"], length["_finish"], length["_usage"]["completion_tokens"]) == (
        "short",
        "length",
        40,
    )
    stop = message_of(chat(k, messages=user, stop=["\nuser:"]))
    assert (stop["content"], stop["_finish"]) == ("cut here", "length")
    tool = message_of(chat(k, messages=user, tools=[WEATHER_TOOL]))
    assert tool["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    assert tool["_finish"] == "tool_calls"
    named = message_of(chat(k, messages=user, tools=[WEATHER_TOOL]))
    assert named["tool_calls"][0]["id"] == "call_11111"
    k.script(None)
    assert message_of(chat(k, messages=COLOUR))["content"] == "Blue."


# ------------------------------------------------------------- chat streams


@needs_samples
def test_a_chat_stream_is_framed_like_the_recording(k: ScriptedKoboldcpp) -> None:
    status_line, headers, payload = raw_http(
        k.url,
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Tell me a long story"}],
            "max_tokens": 48,
            "stream": True,
        },
    )
    expected_status, expected_headers = sample_headers("chat_stream")
    assert status_line == expected_status == "HTTP/1.0 200 OK"
    assert [h for h in headers if h[0] != "Date"] == [h for h in expected_headers if h[0] != "Date"]
    assert "content-length" not in {h[0].lower() for h in headers}
    recorded = chunks_of(sample_bytes("chat_stream.raw"))
    chunks = chunks_of(payload)
    assert len(chunks) == 49  # one per token, then the final chunk
    for chunk in chunks[:-1]:
        assert_same_shape(chunk, recorded[0])
        assert chunk["choices"][0]["finish_reason"] is None
    assert_same_shape(chunks[-1], recorded[-1])
    assert chunks[-1]["choices"][0] == recorded[-1]["choices"][0]
    assert len({c["id"] for c in chunks}) == 1 and re.fullmatch(r"chatcmpl-A\d{6}", chunks[0]["id"])
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert len(text) == 48 * 4 and text.startswith("Once upon a time a small fox lived")


@needs_samples
def test_a_stopped_stream_reports_length_and_usage_like_the_recording(k: ScriptedKoboldcpp) -> None:
    response = chat(
        k,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=300,
        stop=["fox"],
        stream=True,
        stream_options={"include_usage": True},
    )
    assert response.headers["content-type"] == "text/event-stream"
    recorded = chunks_of(sample_bytes("chat_stream_stop.raw"))
    chunks = chunks_of(response.content)
    assert_same_shape(chunks[-1], recorded[-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == "Once upon a time a small "
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len("Once upon a time a small fox") // 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@needs_samples
def test_a_streamed_tool_call_is_fake_streamed_like_the_recording(k: ScriptedKoboldcpp) -> None:
    response = chat(
        k,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        stream=True,
        stream_options={"include_usage": True},
    )
    recorded = chunks_of(sample_bytes("chat_tools_required_stream.raw"))
    chunks = chunks_of(response.content)
    assert len(chunks) == len(recorded) == 3
    for ours, theirs in zip(chunks, recorded, strict=True):
        assert_same_shape(ours, theirs)
        assert ours["id"] == "koboldcpp"
        assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": "",
    }
    assert json.loads(
        chunks[1]["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
    ) == {"city": "example"}


def test_a_streamed_reasoning_reply_splits_reasoning_from_content(k: ScriptedKoboldcpp) -> None:
    msgs = [{"role": "user", "content": "Think first: what is 2 + 2?"}]
    whole = message_of(chat(k, messages=msgs))
    chunks = chunks_of(chat(k, messages=msgs, stream=True).content)
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    assert all(c["choices"][0]["delta"]["role"] == "assistant" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_stream_cut_inside_the_reasoning_ends_in_reasoning(k: ScriptedKoboldcpp) -> None:
    chunks = chunks_of(
        chat(k, messages=[{"role": "user", "content": "think"}], max_tokens=4, stream=True).content
    )
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "finish_reason": "length",
        "delta": {"role": "assistant", "reasoning_content": ""},
    }


def test_the_stream_splitter_holds_back_partial_tags_and_stop_strings() -> None:
    splitter = OaiStreamSplitter(["\nuser:"])
    assert splitter.step("Hi <thi") == [({"role": "assistant", "content": "Hi "}, None)]
    assert splitter.step("nk>plan</think>ok") == [
        ({"role": "assistant", "reasoning_content": "plan", "content": "ok"}, None)
    ]
    assert splitter.step(" then\nus") == []
    assert splitter.finish("length") == [
        ({"role": "assistant", "content": " then\nus"}, None),
        ({"role": "assistant", "content": ""}, "length"),
    ]


def test_nothing_but_headers_is_sent_before_the_first_token() -> None:
    with ScriptedKoboldcpp(prompt_delay_s=0.4) as k:
        host, port = k.url.removeprefix("http://").split(":")
        data = json.dumps({"messages": COLOUR, "stream": True}).encode()
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            started = time.monotonic()
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                + str(len(data)).encode()
                + b"\r\n\r\n"
                + data
            )
            received = b""
            while b"\r\n\r\n" not in received:
                received += sock.recv(65536)
            headers_at = time.monotonic() - started
            rest = received.partition(b"\r\n\r\n")[2]
            if not rest:
                rest = sock.recv(65536)
            first_data_at = time.monotonic() - started
    assert headers_at < 0.3
    assert first_data_at >= 0.35
    assert rest.startswith(b"data: ")


# ---------------------------------------------------------------- password


def test_a_password_protects_generation_and_helpers_but_not_gets() -> None:
    with ScriptedKoboldcpp(password="pw", abort_reply_delay_s=0.0) as k:
        posts = {
            "/v1/chat/completions": {"messages": COLOUR},
            "/api/v1/generate": {"prompt": "x"},
            "/api/extra/tokencount": {"prompt": "x"},
            "/api/extra/abort": {"genkey": "x"},
            "/api/extra/generate/check": {"genkey": "x"},
        }
        for path, body in posts.items():
            refused = requests.post(k.url + path, json=body)
            assert (refused.status_code, refused.json()) == (401, UNAUTHORIZED_BODY), path
            wrong = requests.post(k.url + path, json=body, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            ok = requests.post(k.url + path, json=body, headers={"Authorization": "Bearer pw"})
            assert ok.status_code == 200, path
        assert requests.get(k.url + "/api/v1/model").json() == {"result": PROTECTED_MODEL_NAME}
        named = requests.get(k.url + "/api/v1/model", headers={"Authorization": "Bearer pw"})
        assert named.json() == {"result": "koboldcpp/scripted-model"}
        for path in ("/api/extra/version", "/api/extra/perf", "/api/v1/info/version", "/v1/models"):
            assert requests.get(k.url + path).status_code == 200


def test_the_client_reports_a_wrong_or_missing_password_clearly() -> None:
    with ScriptedKoboldcpp(password="pw") as k:
        for password in ("", "wrong"):
            with pytest.raises(BackendUnauthorized):
                KoboldClient(k.url, password).info()
        info = KoboldClient(k.url, "pw").info()
        assert info.model_name == "koboldcpp/scripted-model"
        assert any(
            r["path"] == "/api/extra/tokencount"
            and r["headers"].get("authorization") == "Bearer pw"
            for r in k.requests
        )


# -------------------------------------------------------- busy, queue, abort


def test_busy_answers_503_for_every_generation(k: ScriptedKoboldcpp) -> None:
    k.busy = True
    for path, body in (
        ("/v1/chat/completions", {"messages": COLOUR}),
        ("/api/v1/generate", {"prompt": "x"}),
    ):
        answer = requests.post(k.url + path, json=body)
        assert (answer.status_code, answer.json()) == (503, BUSY_BODY)
    assert k.generations == []


def test_a_body_over_maxrequestsize_is_answered_500_payload_too_big_without_generating() -> None:
    """koboldcpp 1.116.1 answers a Content-Length above ``--maxrequestsize`` MB with
    500 and this body, before reading it (koboldcpp.py L6422-6431); the default is 32 MB."""
    assert ScriptedKoboldcpp().max_request_bytes == 32 * 1024 * 1024
    with ScriptedKoboldcpp(max_request_bytes=1024 * 1024) as k:
        fits = {"messages": [{"role": "user", "content": "x" * (1024 * 1024 - 100)}], "max_tokens": 4}
        size = len(json.dumps(fits).encode())
        padded = dict(fits, genkey="g" * (1024 * 1024 - size - len(', "genkey": ""')))
        assert len(json.dumps(padded).encode()) == 1024 * 1024
        assert requests.post(k.url + "/v1/chat/completions", json=padded).status_code == 200
        over = dict(padded, genkey=padded["genkey"] + "g")
        answer = requests.post(k.url + "/v1/chat/completions", json=over)
        assert answer.status_code == 500
        assert answer.json() == {
            "detail": {"msg": "Payload is too big. Max payload size is 1MB.", "type": "bad_input"}
        }
        assert len(k.generations) == 1
        assert KoboldClient(k.url).tokencount("ok", timeout_s=5) > 0  # still serving


def test_a_body_over_maxrequestsize_fails_the_client_call_with_status_500() -> None:
    with ScriptedKoboldcpp(max_request_bytes=4096) as k:
        with pytest.raises(BackendError) as caught:
            KoboldClient(k.url).chat_completion(
                {"messages": [{"role": "user", "content": "y" * 5000}]}, timeout_s=5
            )
        assert caught.value.status == 500
        assert "Payload is too big. Max payload size is 4096 bytes." in str(caught.value)


def test_generations_are_serialised_and_perf_shows_the_queue() -> None:
    with ScriptedKoboldcpp(token_delay_s=0.03) as k:
        story = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 10}
        finished: list[float] = []

        def run() -> None:
            requests.post(k.url + "/v1/chat/completions", json=story, timeout=10)
            finished.append(time.monotonic())

        threads = [threading.Thread(target=run) for _ in range(2)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(0.12)
        perf = requests.get(k.url + "/api/extra/perf").json()
        for thread in threads:
            thread.join()
    assert (perf["idle"], perf["queue"]) == (0, 1)
    assert max(finished) - started >= 2 * 10 * 0.03
    assert len(k.generations) == 2


def test_abort_by_genkey_ends_a_stream_with_length_and_done() -> None:
    with ScriptedKoboldcpp(token_delay_s=0.01, abort_reply_delay_s=0.0) as k:
        body = {
            "messages": [{"role": "user", "content": "Tell me a long story"}],
            "stream": True,
            "genkey": "HORDEREQ_abc",
        }
        with requests.post(
            k.url + "/v1/chat/completions", json=body, stream=True, timeout=10
        ) as response:
            time.sleep(0.1)
            wrong = requests.post(k.url + "/api/extra/abort", json={"genkey": "other"}).json()
            right = requests.post(
                k.url + "/api/extra/abort", json={"genkey": "HORDEREQ_abc"}
            ).json()
            payload = response.content
    assert wrong == {"success": "false", "done": "false"}
    assert right == {"success": "true", "done": "true"}
    chunks = chunks_of(payload)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert 1 < len(chunks) < 500
    assert k.aborts == ["HORDEREQ_abc"]
    assert k.generations[-1]["aborted"] is True


@needs_samples
def test_abort_answers_match_the_recordings(k: ScriptedKoboldcpp) -> None:
    idle = requests.post(k.url + "/api/extra/abort", json={})
    assert idle.json() == sample_json("abort_idle")
    assert requests.post(k.url + "/api/extra/abort", json={"genkey": "nope"}).json() == sample_json(
        "abort_wrongkey"
    )
    assert k.aborts == [""]


def test_abort_of_a_whole_generation_returns_the_partial_text() -> None:
    with ScriptedKoboldcpp(token_delay_s=0.01, abort_reply_delay_s=0.0) as k:
        result: list[dict[str, Any]] = []
        body = {"prompt": "Tell me a long story", "max_length": 500, "genkey": "KCPPabort3"}
        thread = threading.Thread(
            target=lambda: result.append(
                requests.post(k.url + "/api/v1/generate", json=body).json()
            )
        )
        thread.start()
        time.sleep(0.15)
        assert (
            requests.post(k.url + "/api/extra/abort", json={"genkey": "KCPPabort3"}).json()["done"]
            == "true"
        )
        thread.join(5)
    out = result[0]["results"][0]
    assert out["finish_reason"] == "length"
    assert 0 < out["completion_tokens"] < 500
    assert len(out["text"]) <= out["completion_tokens"] * 4


def test_a_pending_abort_key_empties_the_queued_generation() -> None:
    with ScriptedKoboldcpp(abort_reply_delay_s=0.0) as k:
        k.local_generate(0.4)
        time.sleep(0.05)
        result: list[dict[str, Any]] = []
        body = {"messages": COLOUR, "genkey": "HORDEREQ_q"}
        thread = threading.Thread(target=lambda: result.append(chat(k, **body).json()))
        thread.start()
        time.sleep(0.1)
        pending = requests.post(k.url + "/api/extra/abort", json={"genkey": "HORDEREQ_q"}).json()
        thread.join(5)
    assert pending == {"success": "true", "done": "false"}
    choice = result[0]["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("", "length")


def test_a_client_that_leaves_a_stream_stops_the_generation() -> None:
    with ScriptedKoboldcpp(token_delay_s=0.02) as k:
        body = {"messages": [{"role": "user", "content": "Tell me a long story"}], "stream": True}
        response = requests.post(k.url + "/v1/chat/completions", json=body, stream=True, timeout=10)
        response.raw.read(100)
        response.close()
        deadline = time.monotonic() + 3
        while k.generating and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not k.generating
        record = k.generations[-1]
    assert record["client_gone"] is True
    assert record["completion_tokens"] < 100


# ------------------------------------------------------------ local users


def test_local_users_are_told_apart_by_the_horde_genkey_prefix(k: ScriptedKoboldcpp) -> None:
    assert k.last_non_horde_request_time is None
    chat(k, messages=COLOUR, genkey="HORDEREQ_1")
    assert k.last_non_horde_request_time is None
    before = time.time()
    chat(k, messages=COLOUR, genkey="KCPP1234")
    assert k.last_non_horde_request_time is not None and k.last_non_horde_request_time >= before


def test_local_generate_holds_the_model() -> None:
    with ScriptedKoboldcpp() as k:
        thread = k.local_generate(0.3)
        time.sleep(0.1)
        assert k.generating
        assert requests.get(k.url + "/api/extra/perf").json()["idle"] == 0
        assert k.last_non_horde_request_time is not None
        started = time.monotonic()
        chat(k, messages=COLOUR, genkey="HORDEREQ_2")
        waited = time.monotonic() - started
        thread.join(2)
        total_gens = requests.get(k.url + "/api/extra/perf").json()["total_gens"]
    assert waited >= 0.1
    assert total_gens == 2


# ------------------------------------------------------------------ faults


def test_injected_faults_reach_the_client_as_backend_errors(k: ScriptedKoboldcpp) -> None:
    client = KoboldClient(k.url)
    k.inject("chat", (500, {"detail": {"msg": "boom"}}), "reset", "truncate", "hang:2")
    with pytest.raises(BackendError, match="boom") as caught:
        client.chat_completion({"messages": COLOUR}, timeout_s=5)
    assert caught.value.status == 500
    with pytest.raises(BackendError) as reset:
        client.chat_completion({"messages": COLOUR}, timeout_s=5)
    assert reset.value.status == 0
    with pytest.raises(BackendError):
        client.chat_completion({"messages": COLOUR}, timeout_s=5)
    with pytest.raises(BackendError, match="timed out"):
        client.chat_completion({"messages": COLOUR}, timeout_s=0.3)
    assert (
        client.chat_completion({"messages": COLOUR}, timeout_s=5)["choices"][0]["message"][
            "content"
        ]
        == "Blue."
    )
    k.inject("tokencount", (200, "not json"))
    with pytest.raises(BackendError, match="not JSON"):
        client.tokencount("x", timeout_s=5)
    with pytest.raises(ValueError):
        k.inject("nope", "reset")
    with pytest.raises(ValueError):
        k.inject("chat", "explode")


def test_a_standing_fault_rule_fails_requests_by_what_they_are(k: ScriptedKoboldcpp) -> None:
    """``fail_when`` interleaves failures with successes: every chat completion
    fails, text generations fail only for the marked prompts, a queued fault
    still comes first, and a fault the rule gets wrong is a 500."""
    client = KoboldClient(k.url)
    seen: list[str] = []

    def rule(route: str, body: Any) -> Fault | None:
        seen.append(route)
        if route == "chat":
            return (500, {"detail": {"msg": "chat boom"}})
        if route == "generate" and isinstance(body, dict) and body.get("prompt") == "FAIL":
            return "reset"
        if route == "generate" and isinstance(body, dict) and body.get("prompt") == "odd":
            return "explode"
        return None

    k.fail_when(rule)
    with pytest.raises(BackendError, match="chat boom"):
        client.chat_completion({"messages": COLOUR}, timeout_s=5)
    assert client.generate({"prompt": "Once", "max_length": 4}, timeout_s=5)["results"]
    with pytest.raises(BackendError) as reset:
        client.generate({"prompt": "FAIL", "max_length": 4}, timeout_s=5)
    assert reset.value.status == 0
    with pytest.raises(BackendError, match="bad scripted fault") as bad:
        client.generate({"prompt": "odd", "max_length": 4}, timeout_s=5)
    assert bad.value.status == 500
    k.inject("generate", (503, {"detail": {"msg": "queued first"}}))
    with pytest.raises(BackendError, match="queued first"):
        client.generate({"prompt": "Once", "max_length": 4}, timeout_s=5)
    assert seen.count("generate") == 3  # the queued fault answered without the rule
    k.fail_when(None)
    assert client.chat_completion({"messages": COLOUR}, timeout_s=5)["choices"]


def test_a_cut_stream_ends_without_done(k: ScriptedKoboldcpp) -> None:
    k.inject("chat", "stream_cut")
    stream = KoboldClient(k.url).open_chat_stream(
        {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 20},
        read_timeout_s=5,
    )
    data = b""
    while chunk := stream.read_chunk():
        data += chunk
    stream.close()
    assert b"[DONE]" not in data
    assert data.count(b"\n\n") == 10
    assert not data.endswith(b"\n\n")


def test_requests_are_recorded(k: ScriptedKoboldcpp) -> None:
    requests.post(
        k.url + "/api/extra/tokencount", json={"prompt": "x"}, headers={"Client-Agent": "t:1"}
    )
    requests.get(k.url + "/api/extra/perf")
    assert k.requests[0]["method"] == "POST"
    assert k.requests[0]["path"] == "/api/extra/tokencount"
    assert k.requests[0]["body"] == {"prompt": "x"}
    assert k.requests[0]["headers"]["client-agent"] == "t:1"
    assert (k.requests[1]["method"], k.requests[1]["body"]) == ("GET", None)


# ------------------------------------------------- the client's byte stream


def test_stream_chunks_arrive_as_the_tokens_are_generated() -> None:
    with ScriptedKoboldcpp(token_delay_s=0.05) as k:
        stream = KoboldClient(k.url).open_chat_stream(
            {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8},
            read_timeout_s=5,
        )
        started = time.monotonic()
        arrivals: list[tuple[float, bytes]] = []
        while chunk := stream.read_chunk():
            arrivals.append((time.monotonic() - started, chunk))
        stream.close()
    assert len(arrivals) >= 5
    assert arrivals[0][0] < 0.2
    assert arrivals[-1][0] - arrivals[0][0] >= 0.25
    data = b"".join(chunk for _, chunk in arrivals)
    assert data.endswith(b"data: [DONE]\n\n")


def test_closing_a_stream_from_another_thread_wakes_the_reader() -> None:
    with ScriptedKoboldcpp(prompt_delay_s=5.0) as k:
        stream = KoboldClient(k.url).open_chat_stream({"messages": COLOUR}, read_timeout_s=10)
        result: list[bytes | BaseException] = []

        def read() -> None:
            try:
                result.append(stream.read_chunk())
            except BaseException as exc:
                result.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.2)
        closed_at = time.monotonic()
        stream.close()
        reader.join(2)
        assert not reader.is_alive()
        assert time.monotonic() - closed_at < 1.0
        assert result == [b""]
        deadline = time.monotonic() + 3
        while k.generating and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not k.generating


def test_a_stream_read_timeout_is_a_backend_error() -> None:
    with ScriptedKoboldcpp(prompt_delay_s=2.0) as k:
        stream = KoboldClient(k.url).open_chat_stream({"messages": COLOUR}, read_timeout_s=0.3)
        with pytest.raises(BackendError, match="timed out") as caught:
            stream.read_chunk()
        stream.close()
    assert caught.value.status == 0


class ReplayServer:
    """Serves recorded headers and a raw body byte for byte, in timed pieces, then closes."""

    def __init__(self, head: bytes, body: bytes, pieces: int, pause_s: float) -> None:
        self.head = head
        self.body = body
        self.pieces = pieces
        self.pause_s = pause_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.request = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            while b"\r\n\r\n" not in self.request:
                self.request += conn.recv(65536)
            head, _, rest = self.request.partition(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
            while len(rest) < length:
                rest += conn.recv(65536)
            self.request = head + b"\r\n\r\n" + rest
            conn.sendall(self.head)
            size = -(-len(self.body) // self.pieces)
            for i in range(0, len(self.body), size):
                time.sleep(self.pause_s)
                conn.sendall(self.body[i : i + size])
        self.listener.close()


@needs_samples
@pytest.mark.parametrize(
    "raw",
    [
        "chat_stream.raw",
        "chat_stream_stop.raw",
        "chat_stream_smollm.raw",
        "chat_tools_required_stream.raw",
        "abort_chat_stream.raw",
    ],
)
def test_recorded_streams_are_read_byte_for_byte_and_incrementally(raw: str) -> None:
    head = sample_bytes("chat_stream.headers")
    body = sample_bytes(raw)
    server = ReplayServer(head, body, pieces=4, pause_s=0.15)
    started = time.monotonic()
    stream = KoboldClient(server.url).open_chat_stream({"messages": COLOUR}, read_timeout_s=5)
    arrivals: list[tuple[float, bytes]] = []
    while chunk := stream.read_chunk():
        arrivals.append((time.monotonic() - started, chunk))
    stream.close()
    server.thread.join(2)
    assert b"".join(c for _, c in arrivals) == body
    assert len(arrivals) >= 4
    # the first piece is handed over long before the last one was sent
    assert arrivals[0][0] < 0.45 <= arrivals[-1][0]
    assert b'"stream": true' in server.request
