"""Key safety: the API key goes to the Horde's host only, and never into logs or errors.

A mixed run of the real standalone worker (chat, streamed chat, text, an
offloaded ``messages_url``, an image by signed URL, a backend failure, a
refused reply) while every server records every request it receives. The key
must appear only in the ``apikey`` header of requests to the Horde port, and in
no log line, exception text or repr (seed: "Fetch offloaded messages", seed 004).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import pytest

from koboldcpp_horde_chat import BRIDGE_AGENT
from koboldcpp_horde_chat.devkit.horde import ROUTES, DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply
from koboldcpp_horde_chat.errors import HordeError
from koboldcpp_horde_chat.horde.client import HordeClient
from koboldcpp_horde_chat.service.loop import Worker
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.shared import WorkerState
from tests.unit.test_images import jpeg

from .conftest import API_KEY

WORKER_ROUTES = set(ROUTES.values())


def record_texts(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every worker log record as a formatter would print it, traceback included, plus its
    args' reprs. The devkit's own records are left out: they echo what a test scripted."""
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    texts = []
    for record in caplog.records:
        if record.name.startswith("koboldcpp_horde_chat.devkit"):
            continue
        texts.append(formatter.format(record))
        texts.append(repr(record.args))
    return texts


def mentions(value: Any, secret: str) -> bool:
    if isinstance(value, bytes):
        return secret.encode() in value
    return secret in json.dumps(value, default=repr)


@pytest.mark.parametrize("horde", [{"offload_bytes": 1200}], indirect=True)
def test_over_a_mixed_run_the_key_reaches_only_the_horde_and_no_log(
    horde: DevHorde, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    kcpp = ScriptedKoboldcpp(vision=True).start()
    try:
        import base64

        image = "data:image/jpeg;base64," + base64.b64encode(jpeg(8, 8)).decode()
        rids = [
            horde.send_chat({"messages": [{"role": "user", "content": "Name one colour."}]}, best_effort=True),
            horde.send_chat(
                {"messages": [{"role": "user", "content": "Tell me about the sky."}], "stream": True},
                best_effort=True,
            ),
            horde.send_text("Once upon a time", max_length=40),
            horde.send_chat(  # offloaded: messages_url on the storage port
                {"messages": [{"role": "user", "content": "Name one colour. " + "Be brief. " * 150}]},
                best_effort=True,
            ),
            horde.send_chat(  # an image by signed URL on the storage port
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "text", "text": "What colour is this?"},
                                {"type": "image_url", "image_url": {"url": image}},
                            ],
                        }
                    ]
                },
                best_effort=True,
            ),
            horde.send_chat(  # a refused reply (a call to a function the request lacks)
                {
                    "messages": [{"role": "user", "content": "Weather in Paris?"}],
                    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
                },
                best_effort=True,
                max_attempts=1,
            ),
        ]
        calls = iter([True])

        def script(body: dict[str, Any]) -> ScriptedReply | None:
            if body.get("tools") and next(calls, False):
                return ScriptedReply(tool_calls=[{"name": "not_offered", "arguments": {}}])
            return None

        kcpp.script(script)
        kcpp.inject("generate", (500, {"detail": {"msg": "scripted failure"}}))  # a text fault first
        worker = start_worker("--chat-withhold", "prompt_overflow_refused", kcpp_url=kcpp.url)
        try:
            assert horde.wait(rids, timeout_s=40), [horde.status(r) for r in rids]
        finally:
            worker.stop()
        # The run covered what it claims to.
        storage = [r for r in horde.requests_log if r["port"] == "storage"]
        assert any(r["path"].startswith("/o/msg-") for r in storage), "no messages_url fetch"
        assert any(r["path"].startswith("/o/img-") for r in storage), "no image URL fetch"
        assert any(e["action"] == "refused" for e in horde.ledger)
        assert any(e["action"] == "faulted" for e in horde.ledger)
        assert horde.status(rids[1])["stream"], "no progress posts"

        # Every request to the Horde port's worker routes carries the key...
        worker_calls = [r for r in horde.requests_log if r["port"] == "horde" and r["path"] in WORKER_ROUTES]
        assert worker_calls and all(r["headers"].get("apikey") == API_KEY for r in worker_calls)
        # ...and the key is nowhere else: not on storage, not in any body or query, not to koboldcpp.
        for r in horde.requests_log:
            elsewhere = {k: v for k, v in r["headers"].items() if k != "apikey"}
            assert not mentions(elsewhere, API_KEY) and not mentions(r["body"], API_KEY), r["path"]
            assert API_KEY not in r["query"]
            if r["port"] == "storage":
                assert "apikey" not in r["headers"] and "authorization" not in r["headers"]
        assert kcpp.requests
        for r in kcpp.requests:
            assert not mentions(r["headers"], API_KEY) and not mentions(r["body"], API_KEY), r["path"]
            assert "apikey" not in r["headers"]
        # No log line, traceback or logged repr carries it.
        assert not [t for t in record_texts(caplog) if API_KEY in t]
    finally:
        kcpp.stop()


def test_a_horde_error_echoing_the_key_is_logged_redacted_and_the_worker_stops(
    horde: DevHorde, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    horde.inject(
        "pop",
        (503, {"message": f"overloaded for key {API_KEY}", "rc": API_KEY}),
        (401, {"message": f"No user matching sent API Key {API_KEY}.", "rc": "InvalidAPIKey"}),
    )
    worker = start_worker()
    worker.thread.join(15)
    assert worker.result.get("code") == 3
    texts = record_texts(caplog)
    assert not [t for t in texts if API_KEY in t]
    assert sum("check your API key" in t for t in caplog.messages) == 1
    assert any("overloaded for key ***" in t for t in caplog.messages)


def test_a_wrong_key_is_never_logged_either(
    horde: DevHorde, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "wrong-key-7d1f0a93"
    worker = start_worker(key=wrong)
    worker.thread.join(15)
    assert worker.result.get("code") == 3
    assert not [t for t in record_texts(caplog) if wrong in t]


def test_exceptions_and_reprs_of_the_worker_objects_hide_the_key(horde: DevHorde) -> None:
    client = HordeClient("http://127.0.0.1:9", API_KEY, bridge_agent=BRIDGE_AGENT, connect_timeout_s=0.5)
    with pytest.raises(HordeError) as caught:
        client.pop({"name": "x"}, timeout_s=0.5)
    texts = [str(caught.value), repr(caught.value), repr(caught.value.args), repr(client)]
    settings = WorkerSettings(
        api_key=API_KEY, worker_name="w", model_id="m", backend_max_context_length=1, kcpp_password="pw-secret"
    )
    texts += [repr(settings), str(settings)]
    worker = Worker(settings, horde=client, backend=None, state=WorkerState(settings, stop_event=threading.Event()))  # type: ignore[arg-type]
    texts += [repr(worker), repr(vars(worker.state.stats))]
    assert not [t for t in texts if API_KEY in t or "pw-secret" in t]
