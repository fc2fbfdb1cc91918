"""What the worker says about the Horde at start and while it runs.

A wrong API key fails at the start, before any pop, in both hosts: the standalone
worker exits 3 with one line; inside koboldcpp the worker does not start and says
why, and koboldcpp's thread returns (koboldcpp serves on). The dev Horde answers
``GET /api/v2/find_user`` as the real Horde does (404 ``UserNotFound``, its
message repeating the key). A Horde that stops answering is said once, and
its return.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp
from koboldcpp_horde_chat.horde import watch as watch_module
from koboldcpp_horde_chat.hosts import inside_kcpp as kcpp_hook
from koboldcpp_horde_chat.hosts import key_check
from tests.integration.test_kcpp_hook_e2e import WORKER_NAME, stand_in_koboldcpp

WRONG = "wrong-key-5c9e01d7aa"


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(key_check, "_KEY_CHECKS", {}, raising=False)
    yield


def pops(horde: DevHorde) -> list[dict[str, Any]]:
    return [r for r in horde.requests_log if r["path"].endswith("/generate/text/pop")]


def test_a_wrong_key_fails_the_standalone_worker_at_start_before_any_pop(
    horde: DevHorde, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    worker = start_worker(key=WRONG)
    worker.thread.join(15)
    assert worker.result.get("code") == 3
    assert pops(horde) == []
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [
        f"the Horde at {horde.url} refused the API key (404 UserNotFound): check your API "
        "key (--hordekey): the Horde knows no user with it"
    ]
    assert WRONG not in caplog.text


def test_the_right_key_is_named_by_its_user_and_the_worker_pops(
    horde: DevHorde, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    worker = start_worker()
    rid = horde.send_text("Once", max_length=8)
    assert horde.wait([rid], timeout_s=20.0)
    assert worker.stop() == 0
    assert f"the Horde at {horde.url} knows the API key: user dev-user#1" in caplog.messages
    finds = [r for r in horde.requests_log if r["path"] == "/api/v2/find_user"]
    assert len(finds) == 1  # once for the whole run


def test_a_wrong_key_does_not_start_the_worker_inside_koboldcpp(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(kcpp_hook, "_SHARED", {})
    monkeypatch.setenv("AI_HORDE_URL", horde.url)
    module = stand_in_koboldcpp(kcpp)
    module.args.hordekey = WRONG
    thread = threading.Thread(
        target=kcpp_hook.run_horde_worker,
        args=(module, module.args, WRONG, WORKER_NAME, 1, 1),
        daemon=True,
    )
    thread.start()
    thread.join(15)
    try:
        assert not thread.is_alive(), "the worker started with a wrong key"
    finally:
        module.exitcounter = 999
        thread.join(10)
    assert pops(horde) == []
    assert (
        f"worker 1: not started: the Horde at {horde.url} refused the API key (404 "
        "UserNotFound): check your API key (--hordekey): the Horde knows no user with it"
    ) in caplog.messages
    assert WRONG not in caplog.text


def test_a_horde_that_stops_answering_a_pop_is_said_once_and_its_return_too(
    horde: DevHorde, start_worker: Any, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The standalone worker's clients share one watch (``horde.watch``): a pop the
    Horde leaves unanswered is said while it waits, its answer when it comes."""
    monkeypatch.setattr(watch_module, "QUIET_AFTER_S", 0.5)
    caplog.set_level(logging.INFO)
    horde.inject("pop", "hang:2.0")
    worker = start_worker()
    rid = horde.send_text("Once", max_length=8)
    assert horde.wait([rid], timeout_s=20.0)
    assert worker.stop() == 0
    said = [m for m in caplog.messages if m.startswith("Horde ")]
    assert len(said) == 2, said
    assert re.fullmatch(r"Horde not answering for \d+ s \(pop\): waiting", said[0])
    assert re.fullmatch(r"Horde answering again after [12] s", said[1])
