"""What the worker says and does against a Horde as the real AI Horde is today: no chat
routes (``prompt_jobs: false`` is ignored and text jobs still come), and suspicion of an
untrusted owner's worker faster than 150 tokens/s."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from bench.harness.worker_process import until
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp

SUSPECTED = "above the 150 tokens/s the Horde allows a worker of an untrusted owner"


@pytest.mark.parametrize("horde", [{"chat_routes": False}], indirect=True)
def test_a_chat_only_worker_says_a_horde_without_chat_routes_sends_it_text_jobs(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, the start line said such a Horde sends a chat-only worker nothing."""
    caplog.set_level(logging.INFO)
    rid = horde.send_text("Once", max_length=32)
    start_worker("--chat-only")
    until(lambda: horde.status(rid)["state"] == "done", 30, lambda: caplog.text[-3000:])
    assert horde.pops[0]["body"]["prompt_jobs"] is False
    assert (
        "(pops declare prompt_jobs: false; a Horde without the chat routes ignores it and "
        "sends text jobs, which this worker serves)" in caplog.text
    )
    assert "sends this worker nothing" not in caplog.text


@pytest.mark.parametrize("horde", [{"trusted": False}, {"trusted": True}], indirect=True)
def test_an_untrusted_owner_hears_once_that_the_worker_is_faster_than_the_horde_allows(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    ids = [horde.send_text(f"Once {i}", max_length=64) for i in range(3)]
    start_worker()
    until(lambda: horde.wait(ids, timeout_s=0.5), 30, lambda: caplog.text[-3000:])
    asked = [r for r in horde.requests_log if r["path"] == "/api/v2/find_user"]
    assert len(asked) == 1  # once, after the first fast job
    assert caplog.text.count(SUSPECTED) == (0 if horde.trusted else 1)
