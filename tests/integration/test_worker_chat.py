"""The real standalone worker against the dev Horde and the scripted koboldcpp.

Each test sends requests as a client would, runs the worker until they end,
and asserts the exact pop and submit bodies and the ledger's single terminal
action per job (seed: "The pop loop", steps 1-8, worked example).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import pytest
import requests

from koboldcpp_horde_chat import BRIDGE_AGENT
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply

from .conftest import API_KEY

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def serve(horde: DevHorde, start_worker: Any, ids: list[str], *extra: str, timeout_s: float = 30) -> None:
    worker = start_worker(*extra)
    try:
        assert horde.wait(ids, timeout_s=timeout_s), [horde.status(i) for i in ids]
    finally:
        worker.stop()


def submits(horde: DevHorde) -> list[dict[str, Any]]:
    return [e["body"] for e in horde.ledger]


def chat_requests(kcpp: ScriptedKoboldcpp) -> list[dict[str, Any]]:
    return [r for r in kcpp.requests if r["path"] == "/v1/chat/completions"]


def one_terminal_action_per_job(horde: DevHorde) -> None:
    final = [e for e in horde.ledger if e["action"] != "refused"]
    job_ids = [e["job_id"] for e in final]
    assert len(job_ids) == len(set(job_ids)), horde.ledger


def test_every_pop_carries_the_chat_declaration(horde: DevHorde, start_worker: Any) -> None:
    rid = horde.send_chat({"messages": [{"role": "user", "content": "Name one colour."}]}, best_effort=True)
    serve(horde, start_worker, [rid])
    assert horde.pops, "the worker never popped"
    for pop in horde.pops:
        body = pop["body"] if "body" in pop else pop
        assert body == {
            "name": "test-worker",
            "models": ["koboldcpp/scripted-model"],
            "max_length": 512,
            "max_context_length": 4096,
            "priority_usernames": [],
            "softprompts": [],
            "bridge_agent": BRIDGE_AGENT,
            "chat_jobs": True,
            "chat_features": [
                "seed",
                "presence_penalty",
                "tools",
                "json_object",
                "json_schema",
                "reasoning_effort",
                "prompt_overflow_refused",
            ],
            "chat_limits": {"max_context_length": 4096, "max_length": 512, "tools_max_temperature": 1.0},
            "model_id": "koboldcpp/scripted-model",
            "image_transports": ["messages_url"],
        }


def test_a_plain_chat_job_is_generated_and_submitted_as_a_structured_reply(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    rid = horde.send_chat(
        {
            "messages": [
                {"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": [{"type": "text", "text": "Name one colour."}]},
            ],
            "temperature": 0.5,
            "stop": ["\nuser:"],
            "max_tokens": 64,
            "seed": 7,
        }
    )
    serve(horde, start_worker, [rid])
    (sent,) = chat_requests(kcpp)
    body = sent["body"]
    genkey = body.pop("genkey")
    assert genkey.startswith("HORDEREQ_")
    assert body == {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": [{"type": "text", "text": "Name one colour."}]},
        ],
        "max_tokens": 64,
        "max_context_length": 4096,
        "temperature": 0.5,
        "top_p": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "rep_pen": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "stop": ["\nuser:"],
        "seed": 7,
        "reasoning_effort": "medium",
        "stream": False,
    }
    assert "apikey" not in sent["headers"]
    gen = kcpp.generations[-1]
    (entry,) = horde.ledger
    job_id = entry["job_id"]
    assert entry["action"] == "submitted"
    assert entry["body"] == {
        "id": job_id,
        "message": {"role": "assistant", "content": "Blue."},
        "finish_reason": "stop",
        "native_finish_reason": "stop",
        "prompt_tokens": gen["prompt_tokens"],
        "completion_tokens": gen["completion_tokens"],
        "model_id": "koboldcpp/scripted-model",
        "state": "ok",
    }
    status = horde.status(rid)
    assert status["done"] and status["message"]["content"] == "Blue."


def test_a_tool_call_reply_is_submitted_with_the_backend_minted_call_and_null_content(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    rid = horde.send_chat(
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER],
            "tool_choice": "auto",
            "max_tokens": 128,
        }
    )
    serve(horde, start_worker, [rid])
    (sent,) = chat_requests(kcpp)
    assert sent["body"]["tools"] == [WEATHER]
    assert sent["body"]["tool_choice"] == "auto"
    (entry,) = horde.ledger
    message = entry["body"]["message"]
    assert entry["body"]["finish_reason"] == "tool_calls"
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"} or isinstance(
        json.loads(call["function"]["arguments"]), dict
    )


def test_a_tool_history_follow_up_is_answered(horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any) -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_11111", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_11111", "content": "18C, clear"},
    ]
    rid = horde.send_chat({"messages": history, "tools": [WEATHER], "max_tokens": 64})
    serve(horde, start_worker, [rid])
    (sent,) = chat_requests(kcpp)
    assert sent["body"]["messages"] == history
    (entry,) = horde.ledger
    assert entry["action"] == "submitted"
    assert entry["body"]["finish_reason"] == "stop"
    assert "18C" in entry["body"]["message"]["content"]


def test_json_object_is_sent_as_an_object_rooted_grammar_and_the_reply_is_an_object(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    rid = horde.send_chat(
        {
            "messages": [{"role": "user", "content": "A cat as JSON"}],
            "response_format": {"type": "json_object"},
            "max_tokens": 64,
        },
        best_effort=True,  # a strict json_object request needs structured_output_enforced
    )
    serve(horde, start_worker, [rid])
    (sent,) = chat_requests(kcpp)
    assert "response_format" not in sent["body"]
    assert sent["body"]["grammar"].lstrip().startswith("root")
    (entry,) = horde.ledger
    assert entry["action"] == "submitted"
    assert isinstance(json.loads(entry["body"]["message"]["content"]), dict)


def test_reasoning_is_submitted_apart_from_the_answer(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.script(lambda body: ScriptedReply(text="Four.", reasoning="2 and 2 make 4."))
    rid = horde.send_chat({"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 64})
    serve(horde, start_worker, [rid])
    (entry,) = horde.ledger
    message = entry["body"]["message"]
    assert message["reasoning_content"] == "2 and 2 make 4."
    assert message["content"].strip() == "Four."
    assert entry["body"]["finish_reason"] == "stop"


def test_reasoning_cut_off_by_max_length_is_submitted_as_reasoning_with_empty_content(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.script(lambda body: ScriptedReply(text="never reached", reasoning="x " * 400))
    rid = horde.send_chat({"messages": [{"role": "user", "content": "ponder"}], "max_tokens": 16})
    serve(horde, start_worker, [rid])
    (entry,) = horde.ledger
    message = entry["body"]["message"]
    assert message["content"] == ""
    assert message["reasoning_content"].startswith("x x")
    assert entry["body"]["finish_reason"] == "length"


def test_a_stop_sequence_hit_is_submitted_as_stop_not_length(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.script(lambda body: ScriptedReply(text="Blue", finish="stop_sequence"))
    rid = horde.send_chat(
        {"messages": [{"role": "user", "content": "colour?"}], "stop": ["\nuser:"], "max_tokens": 300}
    )
    serve(horde, start_worker, [rid])
    (entry,) = horde.ledger
    assert kcpp.generations[-1]["finish_reason"] == "length"  # koboldcpp's quirk
    assert entry["body"]["finish_reason"] == "stop"
    assert entry["body"]["native_finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_generation_aborted_on_koboldcpp_is_faulted_not_submitted_cut_short(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any, stream: bool
) -> None:
    """koboldcpp's stop button (an abort without a genkey) ends the Horde's job too,
    and koboldcpp reports it as "length", as it does a stop sequence: the worker
    must not submit the cut reply as a complete one."""
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text="The sky is blue today. " * 20))
    rid = horde.send_chat(
        {"messages": [{"role": "user", "content": "Sky?"}], "max_tokens": 300, "stream": stream},
        best_effort=True,
        max_attempts=1,
    )
    worker = start_worker()
    try:
        deadline = time.monotonic() + 20
        while not kcpp.generating:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        assert requests.post(f"{kcpp.url}/api/extra/abort", json={}, timeout=5).json() == {
            "success": "true", "done": "true"
        }
        assert horde.wait([rid], timeout_s=20)
    finally:
        worker.stop()
    (entry,) = [e for e in horde.ledger if e["action"] != "refused"]
    assert entry["action"] == "faulted"
    assert entry["body"] == {
        "id": entry["job_id"], "state": "faulted", "model_id": "koboldcpp/scripted-model"
    }
    assert kcpp.generations[-1]["aborted"] is True


def test_a_conversation_that_does_not_fit_is_faulted_with_prompt_overflow_and_not_generated(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    rid = horde.send_chat(
        {"messages": [{"role": "user", "content": "word " * 4000}], "max_tokens": 512}, max_attempts=1
    )
    serve(horde, start_worker, [rid])
    (entry,) = horde.ledger
    assert entry["body"] == {
        "id": entry["job_id"],
        "state": "faulted",
        "model_id": "koboldcpp/scripted-model",
        "fault_reason": "prompt_overflow",
    }
    assert chat_requests(kcpp) == []
    # the fit check counts a prompt string and never sends messages to tokencount
    assert kcpp.tokencount_messages == []
    counts = [r for r in kcpp.requests if r["path"] == "/api/extra/tokencount"]
    assert counts and all(set(r["body"]) == {"prompt"} for r in counts)


def test_a_text_job_is_forwarded_to_generate_and_submitted_with_generation(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    rid = horde.send_text("The capital of France is", max_length=24, max_context_length=1024)
    serve(horde, start_worker, [rid])
    (sent,) = [r for r in kcpp.requests if r["path"] == "/api/v1/generate"]
    assert sent["body"]["prompt"] == "The capital of France is"
    assert sent["body"]["max_length"] == 24
    assert sent["body"]["genkey"].startswith("HORDEREQ_")
    (entry,) = horde.ledger
    assert entry["kind"] == "text"
    assert set(entry["body"]) == {"id", "generation", "state"}
    assert entry["body"]["state"] == "ok"
    assert isinstance(entry["body"]["generation"], str) and entry["body"]["generation"]


@pytest.mark.parametrize(
    "horde",
    [{"offload_bytes": 64, "offload_gzip": False}, {"offload_bytes": 64, "offload_gzip": True}],
    indirect=True,
    ids=["plain", "gzip"],
)
def test_offloaded_messages_are_fetched_without_the_api_key(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    messages = [
        {"role": "system", "content": "You are a terse assistant. " * 10},
        {"role": "user", "content": "Name one colour."},
    ]
    rid = horde.send_chat({"messages": messages, "max_tokens": 32})
    serve(horde, start_worker, [rid])
    popped = [p["response"] for p in horde.pops if p.get("response") and p["response"].get("id")]
    assert popped and "messages_url" in popped[0]["payload"]
    assert "messages" not in popped[0]["payload"]
    storage = [r for r in horde.requests_log if r["port"] == "storage"]
    assert len(storage) == 1
    assert "apikey" not in storage[0]["headers"]
    (sent,) = chat_requests(kcpp)
    assert sent["body"]["messages"] == messages
    (entry,) = horde.ledger
    assert entry["action"] == "submitted"


def test_a_refused_reply_becomes_a_reply_refused_fault_and_is_not_resubmitted(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    # A call to a function the request did not offer: 400 ChatSubmitInvalid.
    kcpp.script(
        lambda body: ScriptedReply(tool_calls=[{"name": "launch_rocket", "arguments": {}}])
        if body.get("tools")
        else None
    )
    rid = horde.send_chat(
        {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "max_tokens": 64},
        max_attempts=1,
    )
    serve(horde, start_worker, [rid])
    actions = [(e["action"], e.get("rc"), e.get("fault_reason")) for e in horde.ledger]
    assert actions == [("refused", "ChatSubmitInvalid", None), ("faulted", None, "reply_refused")]
    assert len(chat_requests(kcpp)) == 1  # a chat job is not generated a second time


def test_a_backend_failure_faults_the_job_without_a_reason(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.inject("chat", (500, {"detail": {"msg": "boom"}}))
    rid = horde.send_chat({"messages": [{"role": "user", "content": "hi"}]}, max_attempts=1)
    serve(horde, start_worker, [rid])
    (entry,) = horde.ledger
    assert entry["body"] == {"id": entry["job_id"], "state": "faulted", "model_id": "koboldcpp/scripted-model"}


def test_an_error_finish_reason_faults_the_job_without_a_reason(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.script(lambda body: ScriptedReply(text="", finish="error"))
    rid = horde.send_chat({"messages": [{"role": "user", "content": "hi"}]}, max_attempts=1)
    serve(horde, start_worker, [rid])
    (entry,) = horde.ledger
    assert entry["action"] == "faulted" and "fault_reason" not in entry["body"]


def test_a_malformed_chat_payload_is_faulted_not_crashed_on(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    rid = horde.send_chat({"messages": [{"role": "user", "content": "hi"}]}, max_attempts=2)
    horde.inject(
        "pop",
        (
            200,
            {
                "id": "bad-job-1",
                "ids": ["bad-job-1"],
                "chat": True,
                "payload": {"messages": [{"role": "wizard", "content": 3}], "max_length": 16, "max_context_length": 1024},
                "model": "koboldcpp/scripted-model",
                "ttl": 150,
            },
        ),
    )
    serve(horde, start_worker, [rid])
    bad = [r for r in horde.requests_log if r["path"].endswith("/submit") and b"bad-job-1" in r["body"]]
    assert len(bad) == 1
    assert json.loads(bad[0]["body"]) == {"id": "bad-job-1", "state": "faulted", "model_id": "koboldcpp/scripted-model"}
    assert horde.status(rid)["done"]  # the worker went on serving


def test_the_api_key_reaches_only_the_horde(horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any) -> None:
    ids = [
        horde.send_chat({"messages": [{"role": "user", "content": "hi"}]}),
        horde.send_text("Once upon a time", max_length=16),
    ]
    serve(horde, start_worker, ids)
    for r in kcpp.requests:
        assert API_KEY not in json.dumps(r["headers"]) and API_KEY not in json.dumps(r["body"])
    for r in horde.requests_log:
        if r["port"] == "storage":
            assert API_KEY.encode() not in json.dumps(r["headers"]).encode()


def test_a_protected_koboldcpp_without_its_password_is_a_startup_error(
    horde: DevHorde, start_worker: Any
) -> None:
    with ScriptedKoboldcpp(password="secret") as locked:
        worker = start_worker(kcpp_url=locked.url)
        worker.thread.join(10)
        assert worker.result.get("code") == 2
    assert horde.pops == []


def test_a_protected_koboldcpp_with_its_password_serves_jobs(horde: DevHorde, start_worker: Any) -> None:
    with ScriptedKoboldcpp(password="secret") as locked:
        rid = horde.send_chat({"messages": [{"role": "user", "content": "hi"}]})
        worker = start_worker("--kcpp-password", "secret", kcpp_url=locked.url)
        try:
            assert horde.wait([rid], timeout_s=20)
        finally:
            worker.stop()
        assert all(
            r["headers"].get("authorization") == "Bearer secret"
            for r in locked.requests
            if r["method"] == "POST"
        )
        assert horde.ledger[0]["action"] == "submitted"


def test_a_refused_declaration_stops_the_worker_with_exit_code_2(horde: DevHorde, start_worker: Any) -> None:
    horde.inject("pop", (400, {"rc": "ChatDeclarationInvalid", "message": "chat_limits is required"}))
    worker = start_worker()
    worker.thread.join(15)
    assert worker.result.get("code") == 2
    assert len(horde.pops) <= 1


def test_chat_only_pops_with_prompt_jobs_false(horde: DevHorde, start_worker: Any) -> None:
    rid = horde.send_chat({"messages": [{"role": "user", "content": "hi"}]})
    serve(horde, start_worker, [rid], "--chat-only")
    assert all((p["body"] if "body" in p else p).get("prompt_jobs") is False for p in horde.pops)


def test_text_jobs_follow_each_other_without_the_local_user_pause(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    """The worker's own /api/v1/generate calls are not a local user to yield to."""
    worker = start_worker()
    time.sleep(1.5)  # koboldcpp's last request is then clearly before the worker's first
    ids = [horde.send_text(f"Story {i}:", max_length=16) for i in range(3)]
    ids.append(horde.send_chat({"messages": [{"role": "user", "content": "hi"}]}))
    try:
        assert horde.wait(ids, timeout_s=12), [horde.status(i)["state"] for i in ids]
    finally:
        worker.stop()
    assert [e["action"] for e in horde.ledger] == ["submitted"] * 4


def test_a_job_over_the_declared_max_length_is_faulted_without_a_reason(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    rid = horde.send_chat({"messages": [{"role": "user", "content": "hi"}]}, max_attempts=2)
    horde.inject(
        "pop",
        (
            200,
            {
                "id": "big-job",
                "ids": ["big-job"],
                "chat": True,
                "payload": {"messages": [{"role": "user", "content": "hi"}], "max_length": 10**12, "max_context_length": 4096},
                "model": "koboldcpp/scripted-model",
                "ttl": 150,
            },
        ),
    )
    serve(horde, start_worker, [rid])
    bad = [json.loads(r["body"]) for r in horde.requests_log if r["path"].endswith("/submit") and b"big-job" in r["body"]]
    assert bad == [{"id": "big-job", "state": "faulted", "model_id": "koboldcpp/scripted-model"}]
    assert chat_requests(kcpp) and all(r["body"]["max_tokens"] < 10**12 for r in chat_requests(kcpp))


def test_a_job_given_up_as_its_stream_ends_is_faulted_for_the_stop_not_for_an_abort(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The stop's grace runs out: the worker gives the job up and aborts its generation.
    When the aborted stream ends before the run looks at the job again, the fault
    still names the stop, not a stop button on koboldcpp."""
    from koboldcpp_horde_chat.run import chat as chat_run

    real = chat_run.generate_streamed
    why = "the job did not end within the 6 s stop grace period"

    def given_up_as_it_ends(ports: Any, job: Any, ctx: Any, body: bytes) -> Any:
        def grace_over() -> None:
            time.sleep(0.5)
            requests.post(f"{kcpp.url}/api/extra/abort", json={"genkey": ctx.genkey}, timeout=5)

        threading.Thread(target=grace_over, daemon=True).start()
        result = real(ports, job, ctx, body)
        ctx.give_up(why)  # landed just after the stream's last look at the job
        return result

    monkeypatch.setattr(chat_run, "generate_streamed", given_up_as_it_ends)
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text="The sky is blue today. " * 20))
    faults = fault_lines_of_one_streamed_job(horde, start_worker, caplog, max_tokens=300)
    assert any(why in line for line in faults), faults
    assert not any("a stop on koboldcpp" in line for line in faults), faults


def fault_lines_of_one_streamed_job(
    horde: DevHorde, start_worker: Any, caplog: pytest.LogCaptureFixture, **fields: Any
) -> list[str]:
    """Serve one streamed chat request (``fields`` added to it); check its one job
    was faulted and return the worker's lines that say so."""
    caplog.set_level(logging.INFO)
    rid = horde.send_chat(
        {"messages": [{"role": "user", "content": "Sky?"}], "stream": True, **fields},
        best_effort=True,
        max_attempts=1,
    )
    serve(horde, start_worker, [rid])
    (entry,) = [e for e in horde.ledger if e["action"] != "refused"]
    assert entry["action"] == "faulted"
    return [r.getMessage() for r in caplog.records if "faulted" in r.getMessage()]


def test_a_streamed_job_whose_stream_is_cut_by_the_stop_is_faulted_for_the_stop(
    horde: DevHorde, start_worker: Any, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The stop's grace runs out mid-stream: the worker gives the job up and hangs up
    its stream, which then ends without a finish reason. The fault names the stop,
    not a koboldcpp that cut its stream short."""
    from koboldcpp_horde_chat.errors import BackendError
    from koboldcpp_horde_chat.run import chat as chat_run

    why = "the job did not end within the 6 s stop grace period"

    def cut_by_the_stop(ports: Any, job: Any, ctx: Any, body: bytes) -> Any:
        ctx.give_up(why)
        raise BackendError("the stream ended without a finish reason (and without [DONE]: cut off)")

    monkeypatch.setattr(chat_run, "generate_streamed", cut_by_the_stop)
    faults = fault_lines_of_one_streamed_job(horde, start_worker, caplog)
    assert any(why in line for line in faults), faults
    assert not any("generation failed" in line for line in faults), faults
