"""What the client receives: U+0000, koboldcpp's cut budget, declared limits, reasoning.

The real standalone worker against the dev Horde and the scripted koboldcpp:

* the AI Horde refuses any submit whose JSON holds U+0000 (400
  ``NulByteInPayload``), so nothing the model produced reaches a post or a
  submit with it (seed "6. Submit the reply", "Streaming progress");
* koboldcpp cuts a ``max_length`` above 80 % of the context to ``ctx - max(min(ctx
  - 4, 16), 20 % of ctx)`` and reports ``length`` when it used that budget up: the
  reply is then submitted as ``length``, not ``stop`` (seed step 6, finish_reason;
  reasoning cut inside an unclosed block);
* the declared ``max_length`` leaves room for a prompt in the declared context, so
  the Horde does not send jobs that can only be faulted (seed "Chat limits");
* the reasoning a streamed job posts is the reasoning it submits, and the same as
  when the client did not stream.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply

PROGRESS = "/api/v2/generate/text/progress"
SUBMIT = "/api/v2/generate/text/submit"
MODEL = "koboldcpp/scripted-model"
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


def serve(horde: DevHorde, start_worker: Any, ids: list[str], *extra: str) -> None:
    worker = start_worker(*extra)
    try:
        assert horde.wait(ids, timeout_s=40), [horde.status(i) for i in ids]
    finally:
        worker.stop()


def wire_bodies(horde: DevHorde, path: str) -> list[str]:
    """The raw JSON text of every body the worker sent to ``path``."""
    return [bytes(r["body"]).decode("utf-8") for r in horde.requests_log if r["path"] == path]


def holds_nul(raw: str) -> bool:
    """True when JSON text holds U+0000, as a character or as a real ``\\u0000`` escape."""
    return "\x00" in raw or "\\u0000" in raw.replace("\\\\", "")


def submitted(horde: DevHorde) -> dict[str, Any]:
    """The one accepted submit (and nothing else settled the job)."""
    (entry,) = horde.ledger
    assert entry["action"] == "submitted", horde.ledger
    body: dict[str, Any] = entry["body"]
    return body


def content_of(stream: list[dict[str, Any]]) -> str:
    return "".join(s["content"] for s in stream)


def reasoning_of(stream: list[dict[str, Any]]) -> str:
    return "".join(s.get("reasoning_content", "") for s in stream)


# --- U+0000 -----------------------------------------------------------------------------


def test_a_nul_the_model_emits_is_removed_and_the_reply_is_accepted_once(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.script(lambda body: ScriptedReply(text="Blue\u0000.", reasoning="A colour\u0000."))
    rid = horde.send_chat({"messages": [{"role": "user", "content": "Name one colour."}],
                           "max_tokens": 64})
    serve(horde, start_worker, [rid])
    body = submitted(horde)
    assert body["message"] == {"role": "assistant", "content": "Blue.",
                               "reasoning_content": "A colour."}
    (raw,) = wire_bodies(horde, SUBMIT)
    assert not holds_nul(raw)


def test_a_nul_escaped_in_tool_call_arguments_is_removed(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    # koboldcpp encodes a model's U+0000 in the arguments' JSON text as \u0000, which a
    # client would decode back to U+0000
    kcpp.script(lambda body: ScriptedReply(tool_calls=[
        {"name": "get_weather", "arguments": '{"city": "Par\\u0000is"}'}
    ]))
    rid = horde.send_chat({"messages": [{"role": "user", "content": "Weather in Paris?"}],
                           "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 64})
    serve(horde, start_worker, [rid])
    (call,) = submitted(horde)["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    (raw,) = wire_bodies(horde, SUBMIT)
    assert not holds_nul(raw)


def test_a_nul_in_a_streamed_reply_is_never_posted_and_posts_match_the_submit(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    text = "Blue\u0000 is the colour of the sky on a clear day.\u0000 " * 3
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text=text, reasoning="Sky\u0000 colour."))
    rid = horde.send_chat({"messages": [{"role": "user", "content": "Name one colour."}],
                           "max_tokens": 300, "stream": True})
    serve(horde, start_worker, [rid])
    message = submitted(horde)["message"]
    assert message["content"] == text.replace("\u0000", "")
    assert message["reasoning_content"] == "Sky colour."
    stream = horde.status(rid)["stream"]
    assert len(stream) >= 2
    assert content_of(stream) == message["content"]
    assert reasoning_of(stream) == message["reasoning_content"]
    raws = wire_bodies(horde, PROGRESS) + wire_bodies(horde, SUBMIT)
    assert not any(holds_nul(raw) for raw in raws)


def test_a_nul_in_a_text_generation_is_removed(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.script(lambda body: ScriptedReply(text=" Paris\u0000."))
    rid = horde.send_text("The capital of France is", max_length=24)
    serve(horde, start_worker, [rid])
    (entry,) = horde.ledger
    assert entry["action"] == "submitted"
    assert entry["body"]["generation"] == " Paris."
    (raw,) = wire_bodies(horde, SUBMIT)
    assert not holds_nul(raw)


# --- koboldcpp's cut budget ---------------------------------------------------------------

#: A job asking 900 tokens in a 1000-token context: sent with that context koboldcpp
#: would generate at most 800 (its 20 % rule); the worker sends 1124, which keeps 900.
CUT_REQUEST = {
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 900,
    "max_context_length": 1000,
}


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_koboldcpp_would_cut_keeps_its_whole_budget_and_is_submitted_as_length(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any, stream: bool
) -> None:
    kcpp.token_delay_s = 0.003 if stream else 0.0
    rid = horde.send_chat({**CUT_REQUEST, "stream": stream})
    serve(horde, start_worker, [rid], "--hordegenlen", "900")
    (sent,) = [r for r in kcpp.requests if r["path"] == "/v1/chat/completions"]
    assert (sent["body"]["max_tokens"], sent["body"]["max_context_length"]) == (900, 1124)
    gen = kcpp.generations[-1]
    assert (gen["finish_reason"], gen["completion_tokens"]) == ("length", 900)
    body = submitted(horde)
    assert body["finish_reason"] == "length"
    assert body["native_finish_reason"] == "length"
    assert body["completion_tokens"] == 900
    if stream:
        assert content_of(horde.status(rid)["stream"]) == body["message"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_cut_at_the_budget_is_reasoning_with_empty_content_and_length(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any, stream: bool
) -> None:
    kcpp.token_delay_s = 0.003 if stream else 0.0
    kcpp.script(lambda body: ScriptedReply(text="never reached", reasoning="x " * 2000))
    rid = horde.send_chat({**CUT_REQUEST, "stream": stream})
    serve(horde, start_worker, [rid], "--hordegenlen", "900")
    assert kcpp.generations[-1]["completion_tokens"] == 900
    body = submitted(horde)
    assert body["finish_reason"] == "length"
    assert body["message"]["content"] == ""
    reasoning = body["message"]["reasoning_content"]
    assert reasoning.startswith("x x") and reasoning == reasoning.strip()
    if stream:
        stream_posts = horde.status(rid)["stream"]
        assert reasoning_of(stream_posts) == reasoning
        assert content_of(stream_posts) == ""


# --- declared limits ----------------------------------------------------------------------


def test_a_genlen_beyond_the_context_is_declared_with_room_for_a_prompt(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    # 4000 tokens in a 4096-token context leaves no room for any prompt: before, the
    # worker popped it and could only fault it (prompt_overflow)
    too_long = horde.send_chat(
        {"messages": [{"role": "user", "content": "Name one colour."}], "max_tokens": 4000},
        max_attempts=1,
    )
    fits = horde.send_chat(
        {"messages": [{"role": "user", "content": "Name one colour."}], "max_tokens": 3277}
    )
    serve(horde, start_worker, [fits], "--hordegenlen", "100000")
    assert horde.pops
    for pop in horde.pops:
        body = pop["body"] if "body" in pop else pop
        assert body["max_length"] == 3277
        assert body["chat_limits"]["max_length"] == 3277
    assert submitted(horde)["message"]["content"] == "Blue."
    waiting = horde.status(too_long)
    assert (waiting["state"], waiting["job_ids"]) == ("waiting", [])
    warnings = [r.getMessage() for r in caplog.records if "--hordegenlen" in r.getMessage()]
    assert warnings == [
        "worker 1: max_length 100000 (--hordegenlen) is lowered to 3277: koboldcpp cuts a max_length "
        "above 3277 on this worker's 4096-token context, which keeps room for the prompt"
    ]


# --- reasoning: posted, stored, streamed or not ------------------------------------------


def test_the_posted_and_the_stored_reasoning_agree_streamed_or_not(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    # koboldcpp passes the reasoning on as generated, surrounding whitespace included
    thought = "\n  Let me ponder. Blue is the colour of a clear sky, and of the sea.\n\n"
    answer = "Blue, the colour of a clear sky."
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text=answer, reasoning=thought))
    request = {"messages": [{"role": "user", "content": "Name one colour."}], "max_tokens": 300}
    streamed = horde.send_chat({**request, "stream": True})
    whole = horde.send_chat(request)
    serve(horde, start_worker, [streamed, whole])
    assert [e["action"] for e in horde.ledger] == ["submitted", "submitted"]
    stream_status, whole_status = horde.status(streamed), horde.status(whole)
    posts = stream_status["stream"]
    assert sum(1 for p in posts if p.get("reasoning_content")) >= 2
    expected = "Let me ponder. Blue is the colour of a clear sky, and of the sea."
    assert reasoning_of(posts) == expected
    assert stream_status["message"]["reasoning_content"] == expected
    assert whole_status["message"]["reasoning_content"] == expected
    # the content is kept as generated, and the same either way too
    assert content_of(posts) == stream_status["message"]["content"]
    assert stream_status["message"]["content"] == whole_status["message"]["content"]
