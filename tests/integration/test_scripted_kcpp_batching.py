"""The scripted koboldcpp's budget cuts and batching, as koboldcpp 1.116.1 has them.

``generate()`` caps ``max_length`` at ``--genlimit`` and then cuts it to leave
``max(min(ctx - 4, 16), int(ctx * 0.2))`` of the context to the prompt
(``koboldcpp.py`` L2167-2178). With ``--parallelrequests`` > 1 a batchable
generation runs beside the others; an abort by genkey does not stop it
(L6532-6541, ``gpttype_adapter.cpp`` L3802-3809 against L4443), a hang-up ends
a batched stream (L5752-5753) but not a non-streamed generation (no disconnect
check outside streams, L5798-5812).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests

from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply

STORY = [{"role": "user", "content": "Tell me a long story"}]


def chat(k: ScriptedKoboldcpp, **body: Any) -> dict[str, Any]:
    response = requests.post(k.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def in_background(fn: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


# --- the budget --------------------------------------------------------------------------


def test_genlimit_caps_every_generation_and_reports_a_normal_length_stop() -> None:
    with ScriptedKoboldcpp(genlimit=50) as k:
        body = chat(k, messages=STORY, max_tokens=300)
    assert body["usage"]["completion_tokens"] == 50
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("context", "max_tokens", "generated"),
    [
        (500, 420, 400),  # 500 - int(500 * 0.2)
        (525, 420, 420),
        (10, 5, 4),  # 10 - max(min(6, 16), 2): koboldcpp cuts at ">=", not above 80 %
        (4096, 3277, 3277),
    ],
)
def test_the_20_percent_cut_is_koboldcpps(context: int, max_tokens: int, generated: int) -> None:
    with ScriptedKoboldcpp(max_context_length=4096, chars_per_token=1) as k:
        k.script(lambda body: ScriptedReply(text="x" * 5000))
        body = chat(
            k,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=max_tokens,
            max_context_length=context,
        )
    assert body["usage"]["completion_tokens"] == generated


# --- batching ----------------------------------------------------------------------------


def slow(k: ScriptedKoboldcpp, tokens: int = 40, seconds: float = 2.0) -> None:
    k.token_delay_s = seconds / tokens
    k.script(lambda body: ScriptedReply(text="sky " * tokens))


def test_batched_generations_run_together_and_an_abort_by_genkey_stops_none() -> None:
    with ScriptedKoboldcpp(parallel_requests=2, abort_reply_delay_s=0.0) as k:
        slow(k)
        answers: list[dict[str, Any]] = []
        threads = [
            in_background(
                lambda key=key: answers.append(chat(k, messages=STORY, genkey=key))  # type: ignore[misc]
            )
            for key in ("HORDEREQ_a", "HORDEREQ_b")
        ]
        until(lambda: k.running == 2)
        assert not k.generating  # batched requests release koboldcpp's model lock
        assert requests.get(k.url + "/api/extra/perf").json()["idle"] == 0
        aborts = [
            requests.post(k.url + "/api/extra/abort", json={"genkey": key}).json()
            for key in ("HORDEREQ_a", "HORDEREQ_b")
        ]
        # koboldcpp's current genkey is the one that started last: that abort is
        # answered as done, and is not
        assert {"success": "true", "done": "true"} in aborts
        for thread in threads:
            thread.join(10)
    assert sorted(a["usage"]["completion_tokens"] for a in answers) == [40, 40]
    assert [g["aborted"] for g in k.generations] == [False, False]


def test_without_batching_an_abort_by_genkey_still_stops_the_generation() -> None:
    with ScriptedKoboldcpp(abort_reply_delay_s=0.0) as k:
        slow(k)
        answers: list[dict[str, Any]] = []
        thread = in_background(
            lambda: answers.append(chat(k, messages=STORY, genkey="HORDEREQ_a"))
        )
        until(lambda: k.running == 1)
        requests.post(k.url + "/api/extra/abort", json={"genkey": "HORDEREQ_a"})
        thread.join(10)
    assert answers[0]["usage"]["completion_tokens"] < 40
    assert k.generations[0]["aborted"] is True


def raw_post(k: ScriptedKoboldcpp, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", k.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def test_a_hang_up_ends_a_batched_stream_but_not_a_batched_whole_generation() -> None:
    with ScriptedKoboldcpp(parallel_requests=2) as k:
        # 6 s of generation: a loaded machine may start the second request late.
        slow(k, tokens=120, seconds=6.0)
        streamed = raw_post(
            k, b'{"messages": [{"role": "user", "content": "x"}], "stream": true, "genkey": "HORDEREQ_s"}'
        )
        whole = raw_post(k, b'{"messages": [{"role": "user", "content": "x"}], "genkey": "HORDEREQ_w"}')
        until(lambda: k.running == 2)
        hung_up = time.monotonic()
        streamed.close()
        whole.close()
        until(lambda: len(k.generations) == 1)
        assert time.monotonic() - hung_up < 1.0
        until(lambda: len(k.generations) == 2, 15.0)
    by_key = {g["genkey"]: g for g in k.generations}
    assert by_key["HORDEREQ_s"]["client_gone"] is True
    assert by_key["HORDEREQ_s"]["completion_tokens"] < 120
    assert by_key["HORDEREQ_w"]["aborted"] is False
    assert by_key["HORDEREQ_w"]["completion_tokens"] == 120  # koboldcpp generated it all


def test_a_request_koboldcpp_cannot_batch_waits_for_the_batched_ones() -> None:
    with ScriptedKoboldcpp(parallel_requests=2) as k:
        slow(k, seconds=1.0)
        batched = in_background(lambda: chat(k, messages=STORY))
        until(lambda: k.running == 1)
        started = time.monotonic()
        chat(k, messages=STORY, reasoning_effort="low")  # reasoning turns batching off
        waited = time.monotonic() - started
        batched.join(10)
    assert waited >= 1.5  # behind the batched one, then its own second
    assert [g["genkey"] for g in k.generations] == ["", ""]
