"""The dev Horde, driven over HTTP with ``requests`` as a worker would (no worker code).

Each test checks one rule of seed 000 ("Serve chat jobs from a text worker") or
seed 004 (image and messages transports) with the seed's exact values.
"""

from __future__ import annotations

import base64
import copy
import email.utils
import gzip
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from koboldcpp_horde_chat.devkit.horde import FAULT_REASON_SENTENCES, DevHorde
from tests.unit.test_images import jpeg

KEY = "devkey-0123"
OTHER_KEY = "devkey-4567"
MODEL = "koboldcpp/test-model"
#: koboldcpp's own embedded worker agent: a validated backend.
KCPP_AGENT = "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp"
POP = "/api/v2/generate/text/pop"
SUBMIT = "/api/v2/generate/text/submit"
PROGRESS = "/api/v2/generate/text/progress"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
SEED_REQUEST = {
    "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Name one colour."}]},
    ],
    "temperature": 0.5,
    "stop": ["\nuser:"],
    "max_tokens": 512,
}
USER_ONLY = {"messages": [{"role": "user", "content": "Name one colour."}], "max_tokens": 64}
ALL_FEATURES = [
    "seed",
    "presence_penalty",
    "tools",
    "json_object",
    "json_schema",
    "vision",
    "reasoning_effort",
    "tools_with_response_format",
    "prompt_overflow_refused",
    "tool_choice_enforced",
    "structured_output_enforced",
]


def decl(name: str = "w1", *, features: list[str] | None = None, **over: Any) -> dict[str, Any]:
    """A pop body with the seed's step 1 declaration (limits as in the seed's job example)."""
    body: dict[str, Any] = {
        "name": name,
        "models": [MODEL],
        "max_length": 512,
        "max_context_length": 4096,
        "chat_jobs": True,
        "chat_features": ["seed", "presence_penalty"] if features is None else features,
        "chat_limits": {"max_context_length": 2048, "max_length": 512},
        "model_id": MODEL,
        "image_transports": [],
        "bridge_agent": KCPP_AGENT,
    }
    body.update(over)
    return body


class Worker:
    """A worker's HTTP calls, nothing more."""

    def __init__(self, horde: DevHorde, key: str = KEY) -> None:
        self.url = horde.url
        self.s = requests.Session()
        self.s.headers["apikey"] = key

    def post(self, path: str, body: dict[str, Any]) -> requests.Response:
        return self.s.post(self.url + path, json=body, timeout=5)

    def pop(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.post(POP, body)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def submit(self, body: dict[str, Any]) -> requests.Response:
        return self.post(SUBMIT, body)

    def progress(self, job_id: str, seq: int, **delta: str) -> requests.Response:
        return self.post(PROGRESS, {"id": job_id, "seq": seq, "delta": delta})


def reply(job_id: str, content: str | None = "Blue.", **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": job_id,
        "message": {"role": "assistant", "content": content},
        "finish_reason": "stop",
        "model_id": MODEL,
        "state": "ok",
        "prompt_tokens": 21,
        "completion_tokens": 3,
        "native_finish_reason": "eos_token",
    }
    body.update(over)
    return body


def call(name: str = "get_weather", call_id: str = "call_1", args: Any = '{"city": "Paris"}') -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


@pytest.fixture
def horde() -> Iterator[DevHorde]:
    with DevHorde(api_keys=(KEY, OTHER_KEY)) as h:
        yield h


@pytest.fixture
def w(horde: DevHorde) -> Worker:
    return Worker(horde)


# --- keys and declaration ---------------------------------------------------------------


@pytest.mark.parametrize("path", [POP, SUBMIT, PROGRESS])
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_a_missing_or_unknown_key_is_refused_with_401(horde: DevHorde, path: str, key: str | None) -> None:
    headers = {} if key is None else {"apikey": key}
    r = requests.post(horde.url + path, json=decl(), headers=headers, timeout=5)
    assert r.status_code == 401
    assert r.json()["rc"] == "InvalidAPIKey"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda b: b.pop("chat_limits"), "chat_limits"),
        (lambda b: b.pop("model_id"), "model_id"),
        (lambda b: b["chat_limits"].update(tools_max_temperature=-0.5), "tools_max_temperature"),
        (lambda b: b.update(model_id="koboldcpp/other"), "model_id"),
        (lambda b: (b.pop("chat_jobs"), b.update(prompt_jobs=False)), "prompt_jobs"),
    ],
)
def test_an_invalid_declaration_is_refused_naming_the_field(w: Worker, change: Any, field: str) -> None:
    body = decl()
    change(body)
    r = w.post(POP, body)
    assert r.status_code == 400
    assert r.json()["rc"] == "ChatDeclarationInvalid"
    assert field in r.json()["message"]


def test_a_pop_without_chat_jobs_withdraws_the_declaration(horde: DevHorde, w: Worker) -> None:
    w.pop(decl(features=["seed", "made_up_feature"], image_transports=["messages_url", "carrier_pigeon"]))
    details = requests.get(horde.url + "/api/v2/workers/name/w1", timeout=5).json()
    assert details["accepts_chat_jobs"] is True and details["accepts_prompt_jobs"] is True
    assert details["chat"] == {
        "model_id": MODEL,
        "features": ["seed"],
        "limits": {"max_context_length": 2048, "max_length": 512},
        "image_transports": ["messages_url"],
    }
    horde.send_chat(USER_ONLY, best_effort=True)
    withdrawn = decl()
    del withdrawn["chat_jobs"]
    assert w.pop(withdrawn)["id"] is None
    details = requests.get(horde.url + "/api/v2/workers/name/w1", timeout=5).json()
    assert details["accepts_chat_jobs"] is False and "chat" not in details
    assert w.pop(decl())["chat"] is True


# --- job shapes --------------------------------------------------------------------------


def test_the_seed_request_pops_as_the_seed_job_and_completes_with_the_seed_reply(
    horde: DevHorde, w: Worker
) -> None:
    rid = horde.send_chat(SEED_REQUEST, best_effort=True)
    job = w.pop(decl())
    job_id = job["id"]
    assert job == {
        "payload": {
            "messages": [
                {"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": [{"type": "text", "text": "Name one colour."}]},
            ],
            "temperature": 0.5,
            "top_p": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "rep_pen": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "stop_sequence": ["\nuser:"],
            "max_length": 512,
            "max_context_length": 2048,
            "n": 1,
        },
        "id": job_id,
        "ids": [job_id],
        "messages": [],
        "ttl": 150,
        "extra_source_images": None,
        "skipped": {},
        "softprompt": None,
        "model": MODEL,
        "chat": True,
    }
    r = w.submit(reply(job_id))
    assert r.status_code == 200
    assert isinstance(r.json()["reward"], float) and r.json()["reward"] > 0
    status = horde.status(rid)
    assert status["done"] is True and status["state"] == "done"
    assert status["message"] == {"role": "assistant", "content": "Blue."}
    assert (status["finish_reason"], status["prompt_tokens"], status["completion_tokens"]) == ("stop", 21, 3)
    again = w.submit(reply(job_id))
    assert again.status_code == 400 and again.json()["rc"] == "DuplicateGen"
    assert [e["action"] for e in horde.ledger] == ["submitted", "duplicate"]


def test_missing_token_counts_show_as_null(horde: DevHorde, w: Worker) -> None:
    rid = horde.send_chat(USER_ONLY, best_effort=True)
    body = reply(w.pop(decl())["id"])
    del body["prompt_tokens"], body["completion_tokens"]
    assert w.submit(body).status_code == 200
    assert horde.status(rid)["prompt_tokens"] is None and horde.status(rid)["completion_tokens"] is None


def test_a_text_job_pops_without_a_chat_key_and_completes_with_generation(horde: DevHorde, w: Worker) -> None:
    rid = horde.send_text("The capital of France is", max_length=24, params={"temperature": 0.7})
    job = w.pop(decl())
    assert "chat" not in job
    assert job["payload"] == {
        "prompt": "The capital of France is",
        "max_length": 24,
        "max_context_length": 1024,
        "temperature": 0.7,
    }
    assert (job["model"], job["ttl"], job["ids"]) == (MODEL, 150, [job["id"]])
    r = w.submit({"id": job["id"], "generation": " Paris.", "state": "ok"})
    assert r.status_code == 200 and r.json()["reward"] > 0
    assert horde.status(rid)["generation"] == " Paris."


def test_a_chat_only_worker_gets_no_text_job(horde: DevHorde, w: Worker) -> None:
    horde.send_text("Hello")
    body = decl(prompt_jobs=False)
    del body["max_length"], body["max_context_length"]
    assert w.pop(body)["id"] is None
    assert w.pop(decl())["payload"]["prompt"] == "Hello"


def test_a_developer_message_arrives_as_system_and_reasoning_effort_only_when_declared(
    horde: DevHorde, w: Worker
) -> None:
    body = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    horde.send_chat(body, best_effort=True)
    horde.send_chat(body, best_effort=True)
    plain = w.pop(decl())["payload"]
    assert plain["messages"][0] == {"role": "system", "content": "Be brief."}
    assert "reasoning_effort" not in plain and "seed" not in plain and "stop_sequence" not in plain
    assert plain["max_length"] == 512  # the worker's chat max_length when max_tokens is left out
    reasoning = w.pop(decl("w2", features=["reasoning_effort"]))["payload"]
    assert reasoning["reasoning_effort"] == "medium"


# --- eligibility -------------------------------------------------------------------------


def test_a_tools_request_waits_for_a_worker_declaring_tools(horde: DevHorde, w: Worker) -> None:
    horde.send_chat({**USER_ONLY, "tools": [WEATHER], "tool_choice": "auto"}, best_effort=True)
    assert w.pop(decl())["id"] is None
    payload = w.pop(decl("w2", features=["tools"]))["payload"]
    assert payload["tools"] == [WEATHER] and payload["tool_choice"] == "auto"


def test_a_tool_history_alone_needs_tools_and_tool_choice_none_sends_no_tool_key(
    horde: DevHorde, w: Worker
) -> None:
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call()]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    horde.send_chat({"messages": history, "tools": [WEATHER], "tool_choice": "none"}, best_effort=True)
    assert w.pop(decl())["id"] is None
    payload = w.pop(decl("w2", features=["tools"]))["payload"]
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(payload)


def test_a_named_function_arrives_alone_as_required(horde: DevHorde, w: Worker) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    horde.send_chat({**USER_ONLY, "tools": [WEATHER, TIME], "tool_choice": choice}, best_effort=True)
    payload = w.pop(decl(features=["tools"]))["payload"]
    assert payload["tools"] == [TIME] and payload["tool_choice"] == "required"


def test_strict_requests_need_their_guarantees(horde: DevHorde, w: Worker) -> None:
    horde.send_chat(USER_ONLY)
    assert w.pop(decl())["id"] is None
    assert w.pop(decl("w2", features=["prompt_overflow_refused"]))["chat"] is True
    horde.send_chat({**USER_ONLY, "response_format": {"type": "json_object"}})
    assert w.pop(decl("w3", features=["json_object", "prompt_overflow_refused"]))["id"] is None
    job = w.pop(decl("w4", features=["json_object", "prompt_overflow_refused", "structured_output_enforced"]))
    assert job["payload"]["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(
    ("request_over", "features", "limits_over", "eligible"),
    [
        ({"max_tokens": 513}, [], {}, False),
        ({"max_context_length": 4096}, [], {}, False),
        ({"seed": 7}, [], {}, False),
        ({"seed": 7}, ["seed"], {}, True),
        ({"presence_penalty": 0.5}, [], {}, False),
        ({"presence_penalty": 0.0}, [], {}, True),
        ({"tools": [WEATHER], "temperature": 1.5}, ["tools"], {"tools_max_temperature": 1.0}, False),
        ({"tools": [WEATHER], "temperature": 1.0}, ["tools"], {"tools_max_temperature": 1.0}, True),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, ["tools", "json_object"], {}, False),
        (
            {"tools": [WEATHER], "response_format": {"type": "json_object"}},
            ["tools", "json_object", "tools_with_response_format"],
            {},
            True,
        ),
    ],
)
def test_a_request_goes_only_to_a_worker_within_its_limits_and_features(
    horde: DevHorde, w: Worker, request_over: dict[str, Any], features: list[str], limits_over: dict[str, Any], eligible: bool
) -> None:
    horde.send_chat({**USER_ONLY, **request_over}, best_effort=True)
    body = decl(features=features)
    body["chat_limits"].update(limits_over)
    assert (w.pop(body)["id"] is not None) is eligible


# --- images and offload ------------------------------------------------------------------


JPEG = jpeg(4, 4)
IMAGE_REQUEST = {
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(JPEG).decode()}},
            ],
        }
    ]
}


def test_images_go_by_the_declared_transport(horde: DevHorde, w: Worker) -> None:
    for _ in range(2):
        horde.send_chat(IMAGE_REQUEST, best_effort=True)
    assert w.pop(decl(features=["vision"]))["id"] is None  # vision without a transport
    assert w.pop(decl("w2", image_transports=["base64"]))["id"] is None  # a transport without vision
    b64 = w.pop(decl("w3", features=["vision"], image_transports=["base64"]))["payload"]
    url = b64["messages"][0]["content"][1]["image_url"]["url"]
    assert url.startswith("data:image/jpeg;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == JPEG
    signed = w.pop(decl("w4", features=["vision"], image_transports=["base64", "url"]))["payload"]
    url = signed["messages"][0]["content"][1]["image_url"]["url"]
    assert url.startswith(horde.storage_url + "/")
    expires = float(url.split("exp=")[1].split("&")[0])
    assert expires - time.time() > 590
    r = requests.get(url, timeout=5)
    assert r.status_code == 200 and r.content == JPEG
    assert "apikey" not in horde.requests_log[-1]["headers"]


@pytest.mark.parametrize("gzipped", [False, True])
def test_large_messages_are_offloaded_to_a_messages_url_worker_only(gzipped: bool) -> None:
    long_messages = [{"role": "user", "content": "word " * 400}]
    with DevHorde(api_keys=(KEY,), offload_bytes=1000, offload_gzip=gzipped) as h:
        w = Worker(h)
        h.send_chat({"messages": long_messages}, best_effort=True)
        h.send_chat({"messages": long_messages}, best_effort=True)
        h.send_chat(USER_ONLY, best_effort=True)
        payload = w.pop(decl(image_transports=["messages_url"]))["payload"]
        assert "messages" not in payload
        r = requests.get(payload["messages_url"], timeout=5, stream=True)
        raw = r.raw.read()
        assert r.status_code == 200
        assert (r.headers.get("Content-Encoding") == "gzip") is gzipped
        assert json.loads(gzip.decompress(raw) if gzipped else raw) == long_messages
        assert w.pop(decl("w2"))["payload"]["messages"] == long_messages  # inline without messages_url
        assert "messages" in w.pop(decl("w3", image_transports=["messages_url"]))["payload"]  # small


def test_a_messages_url_expires() -> None:
    with DevHorde(api_keys=(KEY,), offload_bytes=10, messages_url_s=0.2) as h:
        h.send_chat(USER_ONLY, best_effort=True)
        url = Worker(h).pop(decl(image_transports=["messages_url"]))["payload"]["messages_url"]
        time.sleep(0.3)
        assert requests.get(url, timeout=5).status_code == 403
        assert requests.get(url.replace("sig=", "sig=0"), timeout=5).status_code == 403


# --- submit refusals ---------------------------------------------------------------------


def _tools_job(horde: DevHorde, w: Worker, **over: Any) -> tuple[str, str]:
    rid = horde.send_chat({**USER_ONLY, "tools": [WEATHER], **over}, best_effort=True)
    return rid, w.pop(decl(features=["tools"]))["id"]


@pytest.mark.parametrize(
    ("change", "rc"),
    [
        (lambda b: b.pop("message"), "ChatSubmitInvalid"),
        (lambda b: b.update(finish_reason="eos_token"), "ChatSubmitInvalid"),
        (lambda b: b.update(generation="Blue."), "ChatSubmitInvalid"),
        (lambda b: b.update(finish_reason="tool_calls"), "ChatSubmitInvalid"),
        (lambda b: b["message"].update(content=None), "ChatSubmitInvalid"),
        (lambda b: b.update(native_finish_reason="x" * 33), "ChatSubmitInvalid"),
        (lambda b: b["message"].update(reasoning_content="r" * (1024 * 1024 + 1)), "ChatSubmitInvalid"),
        (lambda b: b["message"].update(tool_calls=[call("get_time")]), "ChatSubmitInvalid"),
        (lambda b: b["message"].update(tool_calls=[call(), call()]), "ChatSubmitInvalid"),
        (lambda b: b["message"].update(tool_calls=[call(args={"city": "Paris"})]), "ChatSubmitInvalid"),
        (lambda b: b.update(model_id="koboldcpp/other"), "ChatModelMismatch"),
        (lambda b: b.update(prompt_tokens=-1), "ChatSubmitInvalid"),
        (lambda b: b.update(completion_tokens=10_000_001), "ChatSubmitInvalid"),
        (lambda b: b.update(completion_tokens="3"), "ChatSubmitInvalid"),
    ],
)
def test_a_reply_that_cannot_be_stored_is_refused(horde: DevHorde, w: Worker, change: Any, rc: str) -> None:
    _, job_id = _tools_job(horde, w)
    body = reply(job_id)
    change(body)
    r = w.submit(body)
    assert r.status_code == 400
    assert r.json()["rc"] == rc
    assert horde.ledger[-1]["action"] == "refused" and horde.ledger[-1]["rc"] == rc


def test_the_edges_of_the_refusal_rules_are_accepted(horde: DevHorde, w: Worker) -> None:
    _, job_id = _tools_job(horde, w)
    body = reply(job_id, None, finish_reason="tool_calls", native_finish_reason="x" * 32)
    body["message"].update(tool_calls=[call(), call(call_id="call_2")], reasoning_content="r" * 1024 * 1024)
    body.update(prompt_tokens=0, completion_tokens=10_000_000)
    assert w.submit(body).status_code == 200


def test_a_refused_reply_keeps_the_job_open_for_its_fault(horde: DevHorde, w: Worker) -> None:
    rid, job_id = _tools_job(horde, w, max_tokens=64)
    refused = w.submit(reply(job_id, None))
    assert refused.json()["rc"] == "ChatSubmitInvalid"
    fault = w.submit({"id": job_id, "state": "faulted", "model_id": MODEL, "fault_reason": "reply_refused"})
    assert fault.status_code == 200 and fault.json() == {"reward": 0}
    status = horde.status(rid)
    assert status["refusals"][0]["rc"] == "ChatSubmitInvalid"
    assert status["return_code"] == "ChatWorkerFault"
    assert status["return_message"] == refused.json()["message"]
    assert horde.worker("w1")["aborted_jobs"] == 1  # type: ignore[index]


def test_a_message_on_a_text_job_is_refused(horde: DevHorde, w: Worker) -> None:
    horde.send_text("Hello")
    job_id = w.pop(decl())["id"]
    r = w.submit({"id": job_id, "message": {"role": "assistant", "content": "Hi"}, "state": "ok"})
    assert r.status_code == 400 and r.json()["rc"] == "ChatSubmitInvalid"




@pytest.mark.parametrize(
    ("request_over", "message", "conformant"),
    [
        ({"tools": [WEATHER], "tool_choice": "none"}, {"content": "", "tool_calls": [call()]}, False),
        ({"tools": [WEATHER], "tool_choice": "required"}, {"content": "Sunny."}, False),
        ({"tools": [WEATHER], "tool_choice": "required"}, {"content": None, "tool_calls": [call()]}, True),
        (
            {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            {"content": None, "tool_calls": [call()]},
            False,
        ),
        ({"response_format": {"type": "json_object"}}, {"content": "[1, 2]"}, False),
        ({"response_format": {"type": "json_object"}}, {"content": '{"a": 1}'}, True),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}},
            {"content": "not json"},
            False,
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "p",
                        "strict": True,
                        "schema": {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]},
                    },
                }
            },
            {"content": '{"age": "old"}'},
            False,
        ),
        (
            {"tools": [WEATHER], "response_format": {"type": "json_object"}},
            {"content": None, "tool_calls": [call()]},
            True,
        ),
    ],
)
def test_a_strict_request_refuses_a_nonconformant_reply_and_best_effort_accepts_it(
    horde: DevHorde, w: Worker, request_over: dict[str, Any], message: dict[str, Any], conformant: bool
) -> None:
    strict_rid = horde.send_chat({**USER_ONLY, **request_over})
    loose_rid = horde.send_chat({**USER_ONLY, **request_over}, best_effort=True)
    for rid in (strict_rid, loose_rid):
        job_id = w.pop(decl(features=ALL_FEATURES))["id"]
        body = reply(job_id, finish_reason="tool_calls" if message.get("tool_calls") else "stop")
        body["message"].update(message)
        r = w.submit(body)
        if rid == strict_rid and not conformant:
            assert r.status_code == 400 and r.json()["rc"] == "ChatSubmitNonconformant"
        else:
            assert r.status_code == 200, r.text


def test_a_fault_after_a_nonconformant_reply_is_counted_apart(horde: DevHorde, w: Worker) -> None:
    rid = horde.send_chat({**USER_ONLY, "response_format": {"type": "json_object"}})
    job_id = w.pop(decl(features=ALL_FEATURES))["id"]
    refused = w.submit(reply(job_id, "not an object"))
    assert refused.json()["rc"] == "ChatSubmitNonconformant"
    w.submit({"id": job_id, "state": "faulted", "model_id": MODEL, "fault_reason": "reply_refused"})
    details = horde.worker("w1")
    assert details is not None and (details["nonconformant_replies"], details["aborted_jobs"]) == (1, 0)
    assert horde.status(rid)["return_message"] == refused.json()["message"]


def test_a_strict_single_call_request_shows_only_the_first_call(horde: DevHorde, w: Worker) -> None:
    rid = horde.send_chat({**USER_ONLY, "tools": [WEATHER], "parallel_tool_calls": False})
    job = w.pop(decl(features=ALL_FEATURES))
    assert job["payload"]["parallel_tool_calls"] is False
    body = reply(job["id"], None, finish_reason="tool_calls")
    body["message"]["tool_calls"] = [call(), call(call_id="call_2")]
    assert w.submit(body).status_code == 200
    assert [c["id"] for c in horde.status(rid)["message"]["tool_calls"]] == ["call_1"]


# --- faults ------------------------------------------------------------------------------


def test_a_fault_returns_the_request_to_the_queue_until_its_attempts_run_out(horde: DevHorde, w: Worker) -> None:
    rid = horde.send_chat(USER_ONLY, best_effort=True, max_attempts=2)
    first = w.pop(decl())["id"]
    r = w.submit({"id": first, "state": "faulted", "model_id": MODEL, "fault_reason": "prompt_overflow"})
    assert r.status_code == 200 and r.json() == {"reward": 0}
    status = horde.status(rid)
    assert (status["state"], status["restarted"], status["fault_reasons"]) == ("waiting", 1, ["prompt_overflow"])
    assert status["return_code"] == "ChatWorkerFault"
    assert status["return_message"] == FAULT_REASON_SENTENCES["prompt_overflow"]
    second = w.pop(decl("w2"))["id"]
    assert second != first and horde.status(rid)["worker"] == "w2"
    w.submit({"id": second, "state": "faulted", "model_id": MODEL, "fault_reason": "gremlins"})
    status = horde.status(rid)
    assert (status["state"], status["faulted"], status["fault_reasons"]) == ("faulted", True, ["prompt_overflow"])
    assert horde.ledger[-1]["fault_reason"] is None
    assert w.pop(decl())["id"] is None
    # A repeated fault (its first answer lost) is answered as the first, counted once
    # toward the worker, and re-opens the request (the real Horde's wp.n += 1).
    again = w.submit({"id": first, "state": "faulted", "model_id": MODEL})
    assert (again.status_code, again.json()) == (200, {"reward": 0})
    assert horde.ledger[-1]["action"] == "late_fault"
    assert [f["job_id"] for f in horde.late_faults] == [first]
    assert horde.worker("w1")["uncompleted_jobs"] == 1  # type: ignore[index]


# --- progress ----------------------------------------------------------------------------


def _stream_job(horde: DevHorde, w: Worker, max_tokens: int = 64) -> tuple[str, str]:
    rid = horde.send_chat({**USER_ONLY, "max_tokens": max_tokens, "stream": True}, best_effort=True)
    job = w.pop(decl())
    assert job["payload"]["stream_progress"] is True
    return rid, job["id"]


def test_progress_is_sequenced_retried_and_refused_when_rewritten(horde: DevHorde, w: Worker) -> None:
    horde.send_chat(USER_ONLY, best_effort=True)
    plain = w.pop(decl())
    assert "stream_progress" not in plain["payload"]
    assert w.progress(plain["id"], 1, content="Blue").json()["rc"] == "ChatProgressNotStreaming"
    rid, job_id = _stream_job(horde, w)
    r = w.progress(job_id, 1, content="Bl")
    assert (r.status_code, r.json()) == (200, {"accepted_seq": 1, "cancelled": False})
    skipped = w.progress(job_id, 3, content="ue")
    assert skipped.status_code == 409
    assert (skipped.json()["rc"], skipped.json()["expected_seq"]) == ("ChatProgressOutOfSequence", 2)
    retry = w.progress(job_id, 1, content="Bl")
    assert (retry.status_code, retry.json()) == (200, {"accepted_seq": 1, "cancelled": False})
    rewritten = w.progress(job_id, 1, content="Gr")
    assert rewritten.status_code == 409 and rewritten.json()["expected_seq"] == 2
    assert w.progress(job_id, 2, content="ue", reasoning_content="").json()["accepted_seq"] == 2
    assert horde.status(rid)["stream"] == [
        {"seq": 1, "content": "Bl"},
        {"seq": 2, "content": "ue", "reasoning_content": ""},
    ]
    assert w.submit(reply(job_id)).status_code == 200
    ended = w.progress(job_id, 3, content="!")
    assert (ended.status_code, ended.json()["rc"]) == (404, "ChatJobAborted")


def test_progress_stops_at_16_bytes_per_max_length_token(horde: DevHorde, w: Worker) -> None:
    _, job_id = _stream_job(horde, w, max_tokens=4)
    assert w.progress(job_id, 1, content="a" * 60).status_code == 200
    capped = w.progress(job_id, 2, content="b", reasoning_content="cccc")
    assert (capped.status_code, capped.json()["rc"]) == (413, "ChatProgressCapReached")
    assert w.progress(job_id, 2, content="bcde").status_code == 200


def test_progress_stops_after_1000_posts(horde: DevHorde, w: Worker) -> None:
    _, job_id = _stream_job(horde, w, max_tokens=512)
    for seq in range(1, 1001):
        assert w.progress(job_id, seq, content="x").status_code == 200
    assert w.progress(job_id, 1001, content="x").json()["rc"] == "ChatProgressCapReached"


def test_a_cancel_settles_a_streamed_job_on_its_posted_content(horde: DevHorde, w: Worker) -> None:
    rid, job_id = _stream_job(horde, w)
    assert w.progress(job_id, 1, content="Blue").status_code == 200
    horde.cancel(rid)
    assert horde.ledger[-1]["action"] == "cancelled"
    r = w.progress(job_id, 2, content=" sky")
    assert (r.status_code, r.json()) == (200, {"accepted_seq": 2, "cancelled": True})
    late = w.submit(reply(job_id))
    assert (late.status_code, late.json()["rc"]) == (400, "AbortedGen")
    status = horde.status(rid)
    assert status["state"] == "cancelled" and status["stream"] == [{"seq": 1, "content": "Blue"}]
    assert horde.wait([rid], timeout_s=0.1)


def test_a_cancelled_job_that_does_not_stream_is_submitted_as_usual(horde: DevHorde, w: Worker) -> None:
    rid = horde.send_chat(USER_ONLY, best_effort=True)
    job_id = w.pop(decl())["id"]
    horde.cancel(rid)
    assert w.submit(reply(job_id)).json()["reward"] > 0
    assert horde.ledger[-1]["action"] == "submitted"


def test_the_lease_expires_and_progress_extends_it() -> None:
    with DevHorde(api_keys=(KEY,), ttl_s=0.5, sweep_s=0) as h:
        w = Worker(h)
        rid = h.send_chat(USER_ONLY, best_effort=True)
        first = w.pop(decl())
        assert first["ttl"] == 0.5
        time.sleep(0.7)
        late = w.submit(reply(first["id"]))
        assert (late.status_code, late.json()["rc"]) == (400, "AbortedGen")
        assert [e["action"] for e in h.ledger] == ["expired", "aborted_gen"]
        assert h.status(rid)["restarted"] == 1
        h.send_chat({**USER_ONLY, "stream": True}, best_effort=True)
        w.pop(decl())  # the restarted request, left to expire
        streamed = w.pop(decl("w2"))["id"]
        time.sleep(0.35)
        assert w.progress(streamed, 1, content="Blue").status_code == 200
        time.sleep(0.35)  # past the base lease, within the extended one
        assert w.submit(reply(streamed)).status_code == 200


def test_progress_extends_the_lease_no_further_than_the_cap_from_the_pop() -> None:
    assert DevHorde(trusted=True).lease_cap_s == 600.0 and DevHorde().lease_cap_s == 200.0
    with DevHorde(api_keys=(KEY,), ttl_s=0.5, lease_cap_s=0.6, sweep_s=0) as h:
        w = Worker(h)
        _, job_id = _stream_job(h, w)
        time.sleep(0.3)
        assert w.progress(job_id, 1, content="Blue").status_code == 200  # 0.8 s, capped at 0.6 s
        time.sleep(0.4)
        late = w.submit(reply(job_id))
        assert (late.status_code, late.json()["rc"]) == (400, "AbortedGen")


# --- client routes and fault injection --------------------------------------------------


def test_the_client_routes_queue_and_show_requests(horde: DevHorde, w: Worker) -> None:
    created = requests.post(
        horde.url + "/api/v2/generate/chat/async",
        json={**copy.deepcopy(USER_ONLY), "horde": {"best_effort": True}},
        timeout=5,
    )
    assert created.status_code == 202
    rid = created.json()["id"]
    job_id = w.pop(decl())["id"]
    w.submit(reply(job_id))
    status = requests.get(horde.url + f"/api/v2/generate/chat/status/{rid}", timeout=5).json()
    assert status["done"] is True and status["message"]["content"] == "Blue."
    assert requests.get(horde.url + "/api/v2/dev/ledger", timeout=5).json()[0]["job_id"] == job_id
    bad = requests.post(horde.url + "/api/v2/generate/chat/async", json={"messages": []}, timeout=5)
    assert bad.status_code == 400


def test_scripted_faults_answer_the_next_calls_then_service_resumes(horde: DevHorde, w: Worker) -> None:
    horde.send_chat(USER_ONLY, best_effort=True)
    horde.inject("pop", (503, {"message": "busy", "rc": "ServiceUnavailable"}), "reset", "truncate")
    assert w.post(POP, decl()).status_code == 503
    with pytest.raises(requests.ConnectionError):
        w.post(POP, decl())
    truncated = w.post(POP, decl())
    with pytest.raises(ValueError):
        truncated.json()
    lost_job = horde.pops[-1]["response"]["id"]
    assert lost_job is not None and horde.job(lost_job) is not None
    assert w.pop(decl())["id"] is None
    with pytest.raises(ValueError):
        horde.inject("pop", "explode")


def test_a_late_answer_is_processed_at_once_and_answered_after_the_delay(
    horde: DevHorde, w: Worker
) -> None:
    """``late:<s>``: the pop's job is assigned when the pop arrives (as a Horde whose
    answer is on its way), its answer comes ``s`` seconds later."""
    rid = horde.send_chat(USER_ONLY, best_effort=True)
    horde.inject("pop", "late:0.6")
    start = time.monotonic()
    seen: list[list[str]] = []
    watcher = threading.Timer(0.3, lambda: seen.append(list(horde.status(rid)["job_ids"])))
    watcher.start()
    job = w.pop(decl())
    assert time.monotonic() - start >= 0.6
    watcher.join()
    assert seen == [[job["id"]]]  # assigned before the answer left


# --- validated backends (the Horde's bridge agent rule) ---------------------------------

UNVALIDATED_AGENTS = [
    None,  # no bridge_agent: the Horde reads "unknown:0:unknown"
    "koboldcpp-horde-chat:0.1.0:koboldcpp-horde-chat 0.1.0",
    "KoboldCppEmbedWorker:2",  # no third field: the agent does not parse
    "KoboldCppEmbedWorker:v2:https://github.com/LostRuins/koboldcpp",  # not a version
    "koboldcppembedworker:2:https://github.com/LostRuins/koboldcpp",  # names are exact
]
VALIDATED_AGENTS = [
    KCPP_AGENT,
    "KoboldCppEmbedWorker:2:koboldcpp-horde-chat 0.1.0",
    "AI Horde Worker:24:https://github.com/Haidra-Org/AI-Horde-Worker",
    "AI Horde Worker~aphrodite~oai:1.2.3:https://example.org",
    "AI Horde Worker~aphrodite~kai:4:x",
    "TabbyAPI:0.1.0-beta+build.7:x:with:colons",
]


def _agent_decl(name: str, agent: str | None, **over: Any) -> dict[str, Any]:
    body = decl(name, **over)
    if agent is None:
        del body["bridge_agent"]
    else:
        body["bridge_agent"] = agent
    return body


@pytest.mark.parametrize("agent", UNVALIDATED_AGENTS)
def test_requests_skip_a_worker_whose_backend_is_not_validated_unless_the_client_allows_it(
    horde: DevHorde, w: Worker, agent: str | None
) -> None:
    horde.send_chat(USER_ONLY, best_effort=True, validated_backends=True)
    horde.send_text("Hello", validated_backends=True)
    empty = w.pop(_agent_decl("w1", agent))
    assert (empty["id"], empty["skipped"]) == (None, {"bridge_version": 2})
    # Left out, validated_backends is false, as the real Horde stores it.
    chat_rid = horde.send_chat(USER_ONLY, best_effort=True)
    text_rid = horde.send_text("Hello")
    assert w.pop(_agent_decl("w1", agent))["id"] == horde.status(chat_rid)["job_ids"][0]
    assert w.pop(_agent_decl("w1", agent))["id"] == horde.status(text_rid)["job_ids"][0]


@pytest.mark.parametrize("agent", VALIDATED_AGENTS)
def test_a_worker_whose_bridge_agent_names_a_validated_backend_gets_every_request(
    horde: DevHorde, w: Worker, agent: str
) -> None:
    chat_rid = horde.send_chat(USER_ONLY, best_effort=True)
    text_rid = horde.send_text("Hello")
    assert w.pop(_agent_decl("w1", agent))["id"] == horde.status(chat_rid)["job_ids"][0]
    assert w.pop(_agent_decl("w1", agent))["id"] == horde.status(text_rid)["job_ids"][0]
    details = requests.get(horde.url + "/api/v2/workers/name/w1", timeout=5).json()
    assert details["bridge_agent"] == agent


def test_the_client_routes_take_validated_backends(horde: DevHorde, w: Worker) -> None:
    chat = {**copy.deepcopy(USER_ONLY), "horde": {"best_effort": True, "validated_backends": True}}
    assert requests.post(horde.url + "/api/v2/generate/chat/async", json=chat, timeout=5).status_code == 202
    text = {"prompt": "Hello", "validated_backends": True}
    assert requests.post(horde.url + "/api/v2/generate/text/async", json=text, timeout=5).status_code == 202
    # Left out, validated_backends is false, as the real Horde stores it.
    chat_default = {**copy.deepcopy(USER_ONLY), "horde": {"best_effort": True}}
    assert requests.post(horde.url + "/api/v2/generate/chat/async", json=chat_default, timeout=5).status_code == 202
    assert requests.post(horde.url + "/api/v2/generate/text/async", json={"prompt": "Hi"}, timeout=5).status_code == 202
    unvalidated = _agent_decl("w1", None)
    assert w.pop(unvalidated)["chat"] is True
    assert w.pop(unvalidated)["payload"]["prompt"] == "Hi"
    left = w.pop(unvalidated)
    assert (left["id"], left["skipped"]) == (None, {"bridge_version": 2})


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_an_unvalidated_backend_earns_three_tenths_of_the_reward(horde: DevHorde, w: Worker, kind: str) -> None:
    rewards = []
    for name, agent in (("w1", KCPP_AGENT), ("w2", None)):
        if kind == "chat":
            horde.send_chat(USER_ONLY, best_effort=True, validated_backends=False)
            job_id = w.pop(_agent_decl(name, agent))["id"]
            r = w.submit(reply(job_id, "Blue. " * 40))
        else:
            horde.send_text("Hello", validated_backends=False)
            job_id = w.pop(_agent_decl(name, agent))["id"]
            r = w.submit({"id": job_id, "generation": "Blue. " * 40, "state": "ok"})
        assert r.status_code == 200, r.text
        rewards.append(r.json()["reward"])
    assert rewards[0] == 6.0 and rewards[1] == 1.8


def test_a_streamed_job_cancelled_on_an_unvalidated_backend_earns_three_tenths(horde: DevHorde, w: Worker) -> None:
    rid = horde.send_chat({**USER_ONLY, "stream": True}, best_effort=True, validated_backends=False)
    job_id = w.pop(_agent_decl("w1", None))["id"]
    assert w.progress(job_id, 1, content="Blue. " * 40).status_code == 200
    horde.cancel(rid)
    assert horde.status(rid)["reward"] == 1.8


def test_a_bridge_agent_over_1000_characters_or_not_a_string_is_refused(w: Worker) -> None:
    assert w.post(POP, decl(bridge_agent="KoboldCppEmbedWorker:2:" + "x" * 977)).status_code == 200
    for agent in ("KoboldCppEmbedWorker:2:" + "x" * 978, 2):
        r = w.post(POP, decl(bridge_agent=agent))
        assert r.status_code == 400 and "rc" not in r.json()
        assert set(r.json()["errors"]) == {"bridge_agent"}


# --- NUL characters -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b["message"].update(content="Bl\x00ue."),
        lambda b: b["message"].update(reasoning_content="\x00"),
        lambda b: b.update(native_finish_reason="eos\x00"),
    ],
)
def test_a_chat_submit_holding_a_nul_character_is_refused(horde: DevHorde, w: Worker, change: Any) -> None:
    rid = horde.send_chat(USER_ONLY, best_effort=True)
    job_id = w.pop(decl())["id"]
    body = reply(job_id)
    change(body)
    r = w.submit(body)
    assert r.status_code == 400 and r.json()["rc"] == "NulByteInPayload"
    assert horde.status(rid)["state"] == "processing"  # nothing stored: the job can still end
    assert w.submit(reply(job_id)).status_code == 200


def test_a_text_submit_or_a_fault_holding_a_nul_character_is_refused(horde: DevHorde, w: Worker) -> None:
    horde.send_text("Hello")
    text_job = w.pop(decl())["id"]
    r = w.submit({"id": text_job, "generation": "Hi\x00", "state": "ok"})
    assert r.status_code == 400 and r.json()["rc"] == "NulByteInPayload"
    horde.send_chat(USER_ONLY, best_effort=True)
    chat_job = w.pop(decl())["id"]
    r = w.submit({"id": chat_job, "state": "faulted", "model_id": MODEL, "fault_reason": "\x00"})
    assert r.status_code == 400 and r.json()["rc"] == "NulByteInPayload"
    assert [e["rc"] for e in horde.ledger] == ["NulByteInPayload", "NulByteInPayload"]


# --- input validation and the chat fault's model_id -----------------------------------------


@pytest.mark.parametrize("state", ["bogus", "", "FAULTED", None, 1])
def test_a_submit_state_outside_the_horde_enum_is_refused(horde: DevHorde, w: Worker, state: Any) -> None:
    horde.send_chat(USER_ONLY, best_effort=True)
    job_id = w.pop(decl())["id"]
    r = w.submit(reply(job_id, state=state))
    assert r.status_code == 400
    assert r.json()["message"] == "Input payload validation failed" and "rc" not in r.json()
    assert set(r.json()["errors"]) == {"state"}
    assert w.submit(reply(job_id)).status_code == 200


@pytest.mark.parametrize("state", ["ok", "censored", "csam"])
def test_the_horde_submit_states_are_accepted(horde: DevHorde, w: Worker, state: str) -> None:
    horde.send_chat(USER_ONLY, best_effort=True)
    job_id = w.pop(decl())["id"]
    assert w.submit(reply(job_id, state=state)).status_code == 200


def test_a_chat_fault_without_model_id_is_a_text_submit_and_needs_generation(horde: DevHorde, w: Worker) -> None:
    rid = horde.send_chat(USER_ONLY, best_effort=True)
    job_id = w.pop(decl())["id"]
    r = w.submit({"id": job_id, "state": "faulted"})
    assert r.status_code == 400 and "rc" not in r.json()
    assert set(r.json()["errors"]) == {"generation"}
    assert horde.status(rid)["state"] == "processing"
    ok = w.submit({"id": job_id, "state": "faulted", "generation": ""})
    assert (ok.status_code, ok.json()) == (200, {"reward": 0})
    assert horde.status(rid)["restarted"] == 1


def test_a_text_fault_needs_generation(horde: DevHorde, w: Worker) -> None:
    horde.send_text("Hello")
    job_id = w.pop(decl())["id"]
    r = w.submit({"id": job_id, "state": "faulted"})
    assert r.status_code == 400 and set(r.json()["errors"]) == {"generation"}
    assert w.submit({"id": job_id, "state": "faulted", "generation": ""}).json() == {"reward": 0}


@pytest.mark.parametrize("delta", [{}, {"content": None}, {"content": None, "reasoning_content": None}])
def test_a_progress_post_without_content_or_reasoning_is_refused(horde: DevHorde, w: Worker, delta: dict[str, Any]) -> None:
    rid, job_id = _stream_job(horde, w)
    r = w.post(PROGRESS, {"id": job_id, "seq": 1, "delta": delta})
    assert (r.status_code, r.json()["rc"]) == (400, "ChatProgressInvalid")
    assert w.progress(job_id, 1, reasoning_content="hmm").json()["accepted_seq"] == 1
    assert horde.status(rid)["stream"] == [{"seq": 1, "content": "", "reasoning_content": "hmm"}]


def test_a_progress_post_may_carry_a_nul_character(horde: DevHorde, w: Worker) -> None:
    # The Horde's NUL refusal is its database's: progress text is not stored there.
    _, job_id = _stream_job(horde, w)
    assert w.progress(job_id, 1, content="a\x00b").status_code == 200


@pytest.mark.parametrize(
    ("penalty", "features", "eligible"),
    [(0.5, [], False), (-1.0, ["presence_penalty"], False), (0.5, ["frequency_penalty"], True), (0.0, [], True)],
)
def test_a_frequency_penalty_request_needs_a_worker_declaring_frequency_penalty(
    horde: DevHorde, w: Worker, penalty: float, features: list[str], eligible: bool
) -> None:
    horde.send_chat({**USER_ONLY, "frequency_penalty": penalty}, best_effort=True)
    job = w.pop(decl(features=features))
    assert (job["id"] is not None) is eligible
    if eligible:
        assert job["payload"]["frequency_penalty"] == penalty


# --- another owner's key -------------------------------------------------------------------


def test_calls_for_another_owners_job_are_refused_with_wrong_credentials(horde: DevHorde, w: Worker) -> None:
    intruder = Worker(horde, key=OTHER_KEY)
    rid, job_id = _stream_job(horde, w)
    calls = [
        intruder.progress(job_id, 1, content="Blue"),
        intruder.submit(reply(job_id)),
        intruder.submit({"id": job_id, "state": "faulted", "model_id": MODEL}),
        intruder.post(POP, decl()),  # the worker name is the other owner's
    ]
    for r in calls:
        assert (r.status_code, r.json()["rc"]) == (403, "WrongCredentials")
    assert horde.ledger == [] and horde.status(rid)["stream"] == []
    assert w.progress(job_id, 1, content="Blue").status_code == 200
    assert w.submit(reply(job_id)).status_code == 200
    assert intruder.pop(decl("w2"))["id"] is None  # its own worker is fine


# --- pop answers: messages and skipped -----------------------------------------------------


def test_moderator_messages_reach_the_worker_they_are_for_until_they_expire(horde: DevHorde, w: Worker) -> None:
    for_w1 = horde.add_worker_message("Please update your worker.", worker="w1")
    for_all = horde.add_worker_message("Maintenance tonight.", worker=None, origin=None)
    horde.add_worker_message("Gone.", worker="w1", expiry_s=-1)
    horde.add_worker_message("Not yours.", worker="w2")
    empty = w.pop(decl())
    assert [m["id"] for m in empty["messages"]] == [for_w1, for_all]
    first, second = empty["messages"]
    assert {k: v for k, v in first.items() if k != "expiry"} == {
        "id": for_w1,
        "message": "Please update your worker.",
        "origin": "moderator",
    }
    assert "origin" not in second
    expiry = email.utils.parsedate_to_datetime(first["expiry"]).timestamp()
    assert 12 * 3600 - 60 < expiry - time.time() <= 12 * 3600
    horde.send_chat(USER_ONLY, best_effort=True)
    horde.send_text("Hello")
    assert [m["id"] for m in w.pop(decl())["messages"]] == [for_w1, for_all]
    assert [m["id"] for m in w.pop(decl())["messages"]] == [for_w1, for_all]
    assert [m["message"] for m in w.pop(decl("w3"))["messages"]] == ["Maintenance tonight."]


def test_an_empty_pop_counts_the_requests_it_passed_over_by_reason(horde: DevHorde, w: Worker) -> None:
    horde.send_text("Long", max_length=600)
    horde.send_text("Wide", max_context_length=8192)
    horde.send_text("Other model", models=["koboldcpp/other"])
    horde.send_chat({**USER_ONLY, "max_tokens": 513}, best_effort=True)
    horde.send_chat({**USER_ONLY, "max_context_length": 4096}, best_effort=True)
    horde.send_chat({**USER_ONLY, "model": "koboldcpp/other"}, best_effort=True)
    horde.send_chat({**USER_ONLY, "seed": 1}, best_effort=True, validated_backends=True)
    unvalidated = w.pop(_agent_decl("w1", None))
    assert unvalidated["id"] is None
    assert unvalidated["skipped"] == {"max_length": 2, "max_context_length": 2, "models": 2, "bridge_version": 1}
    validated = w.pop(decl(features=[]))  # an undeclared feature has no reason name
    assert validated["id"] is None
    assert validated["skipped"] == {"max_length": 2, "max_context_length": 2, "models": 2}
    horde.send_chat(USER_ONLY, best_effort=True)
    job = w.pop(decl())
    assert job["id"] is not None and job["skipped"] == {}  # a job answer reports no skips


# --- latency -------------------------------------------------------------------------------


def test_latency_delays_every_worker_route_answer_and_can_change_at_runtime() -> None:
    with DevHorde(api_keys=(KEY,), latency_s=0.3) as h:
        w = Worker(h)
        h.send_chat(USER_ONLY, best_effort=True)
        t0 = time.monotonic()
        job_id = w.pop(decl())["id"]
        t1 = time.monotonic()
        assert w.submit(reply(job_id, state="bogus")).status_code == 400
        t2 = time.monotonic()
        assert w.progress(job_id, 1, content="x").status_code == 404
        t3 = time.monotonic()
        assert min(t1 - t0, t2 - t1, t3 - t2) >= 0.3
        t4 = time.monotonic()
        requests.get(h.url + "/api/v2/dev/ledger", timeout=5)
        assert time.monotonic() - t4 < 0.25  # the client routes are not delayed
        h.latency_s = 0.0
        t5 = time.monotonic()
        assert w.submit(reply(job_id)).status_code == 200
        assert time.monotonic() - t5 < 0.25
