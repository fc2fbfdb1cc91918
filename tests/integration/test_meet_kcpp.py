"""The worker meets the koboldcpp it finds: it reads koboldcpp's version, its
chat route and the model's chat template, says in one line what it found and
what it declares, and declares only what that koboldcpp serves. End to end:
the standalone worker against the dev Horde and a scripted koboldcpp playing
each koboldcpp.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest

from bench.harness.worker_process import until
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply

CHAT = {"messages": [{"role": "user", "content": "Name one colour."}], "max_tokens": 16}
#: koboldcpp 1.45: the last release before /v1/chat/completions, and before /props.
OLD = {"version": "1.45", "chat_route": False, "chat_template": None}


def _found_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("koboldcpp 1.")]


@pytest.mark.parametrize("kcpp", [OLD], indirect=True)
def test_a_koboldcpp_too_old_for_chat_gets_no_chat_job_and_serves_text(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A koboldcpp without the chat route: no pop declares chat, from the first,
    so the chat request waits for another worker and no chat job is faulted;
    the text request is served. One line says what was found and declared."""
    caplog.set_level(logging.INFO)
    chat_id = horde.send_chat(CHAT, best_effort=True)
    text_id = horde.send_text("Once upon a time", max_length=16, max_context_length=1024)
    start_worker()
    until(lambda: horde.status(text_id)["state"] == "done", 30, lambda: caplog.text[-3000:])
    time.sleep(1.0)  # a few more pops
    assert horde.pops, "the worker never popped"
    assert all("chat_jobs" not in pop["body"] for pop in horde.pops)
    assert horde.status(chat_id)["state"] == "waiting"
    assert not [e for e in horde.ledger if e["kind"] == "chat"]
    assert not [r for r in kcpp.requests if r["path"] == "/v1/chat/completions"]
    assert _found_lines(caplog) == [
        f"koboldcpp 1.45 at {kcpp.url}: model scripted-model, context 4096, chat template "
        "unknown, vision no, no chat route (koboldcpp 1.46 added it); declaring text"
    ]


def test_the_start_line_says_what_koboldcpp_serves_and_what_is_declared(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    start_worker()
    until(lambda: len(horde.pops) >= 1, 30, lambda: caplog.text[-3000:])
    assert _found_lines(caplog) == [
        f"koboldcpp 1.116.1 at {kcpp.url}: model scripted-model, context 4096, chat "
        "template yes, vision no; declaring chat (seed, presence_penalty, tools, "
        "json_object, json_schema, reasoning_effort, prompt_overflow_refused), text"
    ]
    assert "no chat template" not in caplog.text


@pytest.mark.parametrize("kcpp", [{"chat_template": ""}], indirect=True)
def test_a_model_without_a_chat_template_is_said_and_still_serves_chat(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """koboldcpp reports the empty template: a WARNING says replies go through
    koboldcpp's fallback template; chat stays declared and is served."""
    caplog.set_level(logging.INFO)
    chat_id = horde.send_chat(CHAT, best_effort=True)
    start_worker()
    until(lambda: horde.status(chat_id)["state"] == "done", 30, lambda: caplog.text[-3000:])
    warnings = [
        r.getMessage() for r in caplog.records
        if r.levelno == logging.WARNING and "no chat template" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert warnings[0].startswith(
        "koboldcpp reports no chat template for model scripted-model: chat replies go "
        "through koboldcpp's fallback template (Alpaca's"
    )
    assert "chat template none" in _found_lines(caplog)[0]
    assert horde.pops[0]["body"]["chat_jobs"] is True


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tool_calls_the_horde_keeps_refusing_withdraw_tools_alone_and_plain_chat_goes_on(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A small model calls a function the request did not offer: the Horde
    refuses each reply (ChatSubmitInvalid) and the worker faults it with
    reply_refused. At the third, tools alone is withdrawn (one line, until
    when): no tool request is popped any more, plain chat jobs are served."""
    caplog.set_level(logging.INFO)
    kcpp.script(
        lambda body: ScriptedReply(tool_calls=[{"name": "GetWeather", "arguments": {}}])
        if body.get("tools") else None
    )
    tool_body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "max_tokens": 32,
    }
    tool_ids = [horde.send_chat(tool_body, best_effort=True, max_attempts=1) for _ in range(4)]
    start_worker()
    until(lambda: sum(horde.status(r)["state"] == "faulted" for r in tool_ids) >= 3, 60,
          lambda: caplog.text[-3000:])
    plain_ids = [horde.send_chat(CHAT, best_effort=True) for _ in range(3)]
    until(lambda: all(horde.status(r)["state"] == "done" for r in plain_ids), 60,
          lambda: caplog.text[-3000:])
    assert [horde.status(r)["state"] for r in tool_ids].count("waiting") == 1
    refused = [e for e in horde.ledger if e["action"] == "refused"]
    assert [e["rc"] for e in refused] == ["ChatSubmitInvalid"] * 3
    last = horde.pops[-1]["body"]
    assert last["chat_jobs"] is True
    assert "tools" not in last["chat_features"] and "json_schema" in last["chat_features"]
    lines = [r.getMessage() for r in caplog.records if "withdrawing" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("withdrawing 'tools' from the chat declaration until ")
    assert "(for 60 min)" in lines[0]


@pytest.mark.parametrize("kcpp", [{"version": "1.60.1", "chat_route": False}], indirect=True)
def test_a_koboldcpp_whose_chat_route_answers_404_costs_one_chat_job_not_three(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """koboldcpp reports a version with the chat route (1.46 and later) but
    answers it 404 (a build or a proxy without it): the first chat job is
    faulted, and no later pop declares chat; text jobs go on."""
    caplog.set_level(logging.INFO)
    chat_ids = [horde.send_chat(CHAT, best_effort=True, max_attempts=1) for _ in range(3)]
    start_worker()
    until(lambda: any(horde.status(r)["state"] == "faulted" for r in chat_ids), 30,
          lambda: caplog.text[-3000:])
    text_id = horde.send_text("Once upon a time", max_length=16, max_context_length=1024)
    until(lambda: horde.status(text_id)["state"] == "done", 30, lambda: caplog.text[-3000:])
    states = sorted(horde.status(r)["state"] for r in chat_ids)
    assert states == ["faulted", "waiting", "waiting"]
    assert "chat_jobs" not in horde.pops[-1]["body"]
    lines = [r.getMessage() for r in caplog.records if "it has no chat route" in r.getMessage()]
    assert lines == [
        f"koboldcpp at {kcpp.url} answered 404 for /v1/chat/completions: it has no chat "
        "route; popping without the chat declaration until koboldcpp restarts (text jobs "
        "continue)"
    ]


def test_koboldcpp_back_as_an_older_version_is_met_again_and_declared_anew(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """koboldcpp restarted as a release without the chat route, same model and
    context: the worker notices, says what it found again, and stops declaring chat."""
    caplog.set_level(logging.INFO)
    start_worker()
    until(lambda: len(horde.pops) >= 2, 30, lambda: caplog.text[-3000:])
    assert horde.pops[-1]["body"]["chat_jobs"] is True
    port = kcpp.port
    kcpp.kill()
    time.sleep(1.5)
    older = ScriptedKoboldcpp(port=port, **OLD).start()  # type: ignore[arg-type]
    try:
        until(lambda: len(_found_lines(caplog)) >= 2, 30, lambda: caplog.text[-3000:])
        assert "koboldcpp restarted as 1.45 (it was 1.116.1): reading it again" in caplog.text
        assert _found_lines(caplog)[1].startswith(f"koboldcpp 1.45 at {older.url}: ")
        pops = len(horde.pops)
        until(lambda: len(horde.pops) > pops + 1, 30, lambda: caplog.text[-3000:])
        assert "chat_jobs" not in horde.pops[-1]["body"]
    finally:
        older.stop()
