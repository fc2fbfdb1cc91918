"""Streamed chat jobs: the real worker, the dev Horde and a scripted koboldcpp.

Seed 000 "Streaming progress" and the pop-loop flowchart: a job with
``stream_progress: true`` and no tools is generated with ``"stream": true`` and
its text is posted to ``/api/v2/generate/text/progress`` about once a second
(seq 1, 2, 3...), then submitted whole. Each test sends a client request, runs
the worker until the job has ended and asserts what a client or the Horde would
see: the posts, the submit, the local abort, and the job's single terminal
action in the dev Horde's ledger.

The scripted koboldcpp generates at ``token_delay_s`` per token (4 characters),
so a reply of ~60 tokens at 0.05 s streams for about three seconds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply

PROGRESS = "/api/v2/generate/text/progress"
SUBMIT = "/api/v2/generate/text/submit"
MODEL = "koboldcpp/scripted-model"
#: ~57 tokens: about 2.9 s of streaming at 0.05 s a token.
TEXT = "The quick brown fox jumps over the lazy dog near the river bank. " * 3 + "The end."
#: ~35 tokens: about 1.75 s, enough for two posts and a last one.
SHORT_TEXT = "The quick brown fox jumps over the lazy dog near the river bank. " * 2 + "The end."
#: ~130 tokens: long enough to still be streaming when a test intervenes.
LONG_TEXT = "Once upon a time a small fox lived at the edge of a quiet forest. " * 8
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


# --- helpers -------------------------------------------------------------------------


def stream_request(horde: DevHorde, *, max_attempts: int = 3, **extra: Any) -> str:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Tell me something."}],
        "max_tokens": 300,
        "stream": True,
    }
    body.update(extra)
    return horde.send_chat(body, max_attempts=max_attempts)


def serve(horde: DevHorde, start_worker: Any, rid: str, *extra: str, timeout_s: float = 30) -> None:
    """Run the worker until the request is final (done, faulted or cancelled)."""
    worker = start_worker(*extra)
    try:
        assert horde.wait([rid], timeout_s=timeout_s), horde.status(rid)
    finally:
        worker.stop()


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def progress_posts(horde: DevHorde) -> list[dict[str, Any]]:
    """Every progress body the worker sent, in order (retries included)."""
    return [json.loads(r["body"]) for r in horde.requests_log if r["path"] == PROGRESS]


def submit_requests(horde: DevHorde) -> list[dict[str, Any]]:
    return [json.loads(r["body"]) for r in horde.requests_log if r["path"] == SUBMIT]


def chat_requests(kcpp: ScriptedKoboldcpp) -> list[dict[str, Any]]:
    return [r for r in kcpp.requests if r["path"] == "/v1/chat/completions"]


def terminal(horde: DevHorde) -> list[tuple[str, str]]:
    """(job id, action) of every ledger entry that is not a refusal."""
    return [(e["job_id"], e["action"]) for e in horde.ledger if e["action"] != "refused"]


def only_job_id(horde: DevHorde, rid: str) -> str:
    (job_id,) = horde.status(rid)["job_ids"]
    return str(job_id)


def assert_seqs_in_order(stream: list[dict[str, Any]]) -> None:
    assert [s["seq"] for s in stream] == list(range(1, len(stream) + 1)), stream


def content_of(stream: list[dict[str, Any]]) -> str:
    return "".join(s["content"] for s in stream)


def reasoning_of(stream: list[dict[str, Any]]) -> str:
    return "".join(s.get("reasoning_content", "") for s in stream)


# --- the streamed reply --------------------------------------------------------------


def test_a_streamed_reply_arrives_as_ordered_posts_whose_concatenation_is_the_submitted_content(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text=TEXT))
    rid = stream_request(horde)
    serve(horde, start_worker, rid)

    (sent,) = chat_requests(kcpp)
    assert sent["body"]["stream"] is True
    assert sent["body"]["stream_options"] == {"include_usage": True}
    job_id = only_job_id(horde, rid)
    assert terminal(horde) == [(job_id, "submitted")]
    (entry,) = horde.ledger
    gen = kcpp.generations[-1]
    assert entry["body"] == {
        "id": job_id,
        "message": {"role": "assistant", "content": TEXT},
        "finish_reason": "stop",
        "native_finish_reason": "stop",
        "prompt_tokens": gen["prompt_tokens"],
        "completion_tokens": gen["completion_tokens"],
        "model_id": MODEL,
        "state": "ok",
    }
    status = horde.status(rid)
    stream = status["stream"]
    assert len(stream) >= 3  # ~3 s of text: about one post a second, then the last
    assert_seqs_in_order(stream)
    assert content_of(stream) == TEXT == status["message"]["content"]
    assert all("reasoning_content" not in s for s in stream)
    # each post was sent once (no retries), all of them before the submit
    posts = progress_posts(horde)
    assert [p["seq"] for p in posts] == [s["seq"] for s in stream]
    assert all(p["id"] == job_id for p in posts)
    paths = [r["path"] for r in horde.requests_log if r["path"] in (PROGRESS, SUBMIT)]
    assert paths == [PROGRESS] * len(posts) + [SUBMIT]
    # about once a second while text flows (the last post goes when generation ends)
    times = [r["at"] for r in horde.requests_log if r["path"] == PROGRESS]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)][:-1]
    assert gaps and all(0.9 <= g <= 2.0 for g in gaps), gaps


def test_a_slow_horde_gets_one_post_a_round_trip_not_one_post_a_token(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    """At a 1 s round trip a post takes as long as the interval: what koboldcpp sent
    meanwhile must go into the next post whole, not one chunk a post (which made a
    100-token reply take over a minute and a long one run out of its lease)."""
    kcpp.token_delay_s = 0.02
    kcpp.script(lambda body: ScriptedReply(text=LONG_TEXT))  # ~130 tokens, ~2.6 s
    rid = stream_request(horde)
    horde.latency_s = 1.0
    started = time.monotonic()
    serve(horde, start_worker, rid, timeout_s=60)
    took = time.monotonic() - started
    job_id = only_job_id(horde, rid)
    assert terminal(horde) == [(job_id, "submitted")]
    stream = horde.status(rid)["stream"]
    assert content_of(stream) == LONG_TEXT
    assert len(progress_posts(horde)) <= 6, len(progress_posts(horde))
    assert took < 15.0, took


def test_a_job_with_tools_is_generated_whole_and_posts_no_progress(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.token_delay_s = 0.02
    rid = stream_request(
        horde,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="auto",
    )
    serve(horde, start_worker, rid)

    popped = [p["response"] for p in horde.pops if p["response"] and p["response"].get("id")]
    assert popped[0]["payload"]["stream_progress"] is True and popped[0]["payload"]["tools"]
    (sent,) = chat_requests(kcpp)
    assert sent["body"]["stream"] is False
    assert "stream_options" not in sent["body"]
    assert progress_posts(horde) == []
    job_id = only_job_id(horde, rid)
    assert terminal(horde) == [(job_id, "submitted")]
    body = horde.ledger[0]["body"]
    assert body["finish_reason"] == "tool_calls"
    assert body["message"]["content"] is None
    assert body["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_reasoning_is_posted_as_reasoning_content_before_the_answer_starts(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    thought = "Two and two make four, which I can check by counting on my fingers. " * 2
    answer = "The answer is four, as anyone who counts carefully will find."
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text=answer, reasoning=thought))
    rid = stream_request(horde, messages=[{"role": "user", "content": "What is 2+2?"}])
    serve(horde, start_worker, rid)

    job_id = only_job_id(horde, rid)
    assert terminal(horde) == [(job_id, "submitted")]
    message = horde.ledger[0]["body"]["message"]
    stream = horde.status(rid)["stream"]
    assert_seqs_in_order(stream)
    # the reasoning without its surrounding whitespace, posted and submitted alike
    assert reasoning_of(stream) == message["reasoning_content"] == thought.strip()
    assert content_of(stream) == message["content"] == answer
    assert "<think>" not in content_of(stream) + reasoning_of(stream)
    # reasoning first, with an empty content, until the answer starts
    assert stream[0]["content"] == "" and stream[0]["reasoning_content"]
    first_answer = next(i for i, s in enumerate(stream) if s["content"])
    assert all(not s.get("reasoning_content") for s in stream[first_answer + 1 :])
    assert sum(1 for s in stream if s.get("reasoning_content")) >= 2


def test_a_stop_sequence_the_backend_streams_is_never_posted(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    # A backend that streams the stop sequence as generated: the worker strips it.
    text = "Colours: blue and green.\nuse red too, said the painter, and grey for the sky."
    kcpp.hold_stop_sequences = False
    kcpp.log_chunks = True
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text=text, finish="stop_sequence"))
    rid = stream_request(horde, stop=["\nuser:"])
    serve(horde, start_worker, rid)

    streamed = "".join(d.get("content", "") for _, d in kcpp.chunk_log)
    assert streamed.endswith("\nuser:")  # the backend did send it
    job_id = only_job_id(horde, rid)
    assert terminal(horde) == [(job_id, "submitted")]
    body = horde.ledger[0]["body"]
    assert body["message"]["content"] == text
    assert body["finish_reason"] == "stop" and body["native_finish_reason"] == "length"
    stream = horde.status(rid)["stream"]
    assert_seqs_in_order(stream)
    assert content_of(stream) == text  # the near miss "\nuse" is posted, the stop is not
    assert all("user:" not in s["content"] for s in stream)


# --- the Horde's answers -------------------------------------------------------------


def test_a_cancel_after_the_second_post_aborts_the_generation_and_nothing_is_submitted(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text=LONG_TEXT))
    rid = stream_request(horde)
    worker = start_worker()
    try:
        assert wait_until(lambda: len(horde.status(rid)["stream"]) >= 2, 15)
        pops = len(horde.pops)
        horde.cancel(rid)
        # the worker ends the job and goes back to popping
        assert wait_until(lambda: len(horde.pops) > pops, 10)
    finally:
        worker.stop()

    (sent,) = chat_requests(kcpp)
    genkey = sent["body"]["genkey"]
    assert genkey in kcpp.aborts
    gen = kcpp.generations[-1]
    assert gen["genkey"] == genkey and gen["aborted"]
    assert gen["completion_tokens"] < len(LONG_TEXT) // 4
    job_id = only_job_id(horde, rid)
    assert terminal(horde) == [(job_id, "cancelled")]
    assert submit_requests(horde) == []
    # the post answered with cancelled: true was the last one
    posts = progress_posts(horde)
    stream = horde.status(rid)["stream"]
    assert len(posts) == len(stream) + 1
    assert_seqs_in_order(stream)
    assert LONG_TEXT.startswith(content_of(stream))


def test_chat_job_aborted_stops_the_generation_and_nothing_is_submitted(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text=LONG_TEXT))
    horde.inject(
        "progress", "ok", "ok", (404, {"rc": "ChatJobAborted", "message": "This job has ended."})
    )
    rid = stream_request(horde)
    worker = start_worker()
    try:
        assert wait_until(lambda: len(progress_posts(horde)) >= 3, 15)
        assert wait_until(lambda: len(kcpp.generations) == 1, 10)
        pops = len(horde.pops)
        assert wait_until(lambda: len(horde.pops) > pops, 10)
    finally:
        worker.stop()

    genkey = chat_requests(kcpp)[0]["body"]["genkey"]
    assert genkey in kcpp.aborts
    assert kcpp.generations[-1]["aborted"]
    assert [p["seq"] for p in progress_posts(horde)] == [1, 2, 3]
    assert submit_requests(horde) == []
    # The scripted 404 was not processed, so the dev Horde still holds the job:
    # the worker's no-submit is the job's only terminal action.
    assert terminal(horde) == []
    job = horde.job(only_job_id(horde, rid))
    assert job is not None and job["action"] is None


UNAVAILABLE = (503, {"rc": "ChatProgressUnavailable", "message": "Progress is unavailable."})


@pytest.mark.parametrize(
    ("answers", "sent_seqs"),
    [
        ((UNAVAILABLE, UNAVAILABLE, UNAVAILABLE), [1, 2, 2, 2]),
        (((404, {"rc": "ChatProgressNotStreaming", "message": "Not streaming."}),), [1, 2]),
        (((413, {"rc": "ChatProgressCapReached", "message": "Cap reached."}),), [1, 2]),
        (
            ((409, {"rc": "ChatProgressOutOfSequence", "message": "?", "expected_seq": 2}),),
            [1, 2],
        ),
    ],
    ids=["503-three-times", "404-not-streaming", "413-cap", "409-expecting-the-same-seq"],
)
def test_an_answer_that_stops_posting_keeps_generating_and_the_job_is_still_submitted(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Any,
    answers: tuple[Any, ...],
    sent_seqs: list[int],
) -> None:
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text=SHORT_TEXT))
    horde.inject("progress", "ok", *answers)
    rid = stream_request(horde)
    serve(horde, start_worker, rid)

    posts = progress_posts(horde)
    assert [p["seq"] for p in posts] == sent_seqs
    assert all(p == posts[1] for p in posts[1:])  # the retries resend the same body
    assert not kcpp.generations[-1]["aborted"]
    job_id = only_job_id(horde, rid)
    assert terminal(horde) == [(job_id, "submitted")]
    assert horde.ledger[0]["body"]["message"]["content"] == SHORT_TEXT
    status = horde.status(rid)
    assert status["done"] and status["message"]["content"] == SHORT_TEXT
    assert [s["seq"] for s in status["stream"]] == [1]


@pytest.mark.parametrize("lost", ["drop", "truncate", "reset"])
def test_a_lost_post_answer_is_retried_with_the_same_seq_and_content_and_nothing_is_duplicated(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any, lost: str
) -> None:
    # drop and truncate: the post was processed, then its answer lost; reset: not processed.
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text=SHORT_TEXT))
    horde.inject("progress", "ok", lost)
    rid = stream_request(horde)
    serve(horde, start_worker, rid)

    posts = progress_posts(horde)
    assert [p["seq"] for p in posts[:3]] == [1, 2, 2]
    assert posts[2] == posts[1]
    assert [p["seq"] for p in posts[3:]] == list(range(3, len(posts)))
    job_id = only_job_id(horde, rid)
    assert terminal(horde) == [(job_id, "submitted")]
    stream = horde.status(rid)["stream"]
    assert_seqs_in_order(stream)
    assert content_of(stream) == SHORT_TEXT == horde.ledger[0]["body"]["message"]["content"]


def test_out_of_sequence_answers_are_resolved_from_expected_seq_without_rewriting_text(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    # The first post is answered "expected 2" (the worker takes seq 1 as held), but
    # the Horde never stored it: seq 2 then gets 409 expected 1, and the worker
    # sends the text of both under seq 1.
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text=SHORT_TEXT))
    horde.inject(
        "progress",
        (409, {"rc": "ChatProgressOutOfSequence", "message": "?", "expected_seq": 2}),
    )
    rid = stream_request(horde)
    serve(horde, start_worker, rid)

    posts = progress_posts(horde)
    assert [p["seq"] for p in posts[:3]] == [1, 2, 1]
    merged = posts[0]["delta"]["content"] + posts[1]["delta"]["content"]
    assert posts[2]["delta"]["content"] == merged
    job_id = only_job_id(horde, rid)
    assert terminal(horde) == [(job_id, "submitted")]
    stream = horde.status(rid)["stream"]
    assert_seqs_in_order(stream)
    assert stream[0]["content"] == merged
    assert content_of(stream) == SHORT_TEXT


# --- backend failures ----------------------------------------------------------------


def fault_only(horde: DevHorde, rid: str) -> None:
    job_id = only_job_id(horde, rid)
    assert terminal(horde) == [(job_id, "faulted")]
    assert horde.ledger[-1]["body"] == {"id": job_id, "state": "faulted", "model_id": MODEL}
    assert horde.status(rid)["faulted"]


def test_a_stream_koboldcpp_cuts_mid_token_faults_the_job_without_a_reason(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.token_delay_s = 0.02
    kcpp.script(lambda body: ScriptedReply(text=TEXT))
    kcpp.inject("chat", "stream_cut")
    rid = stream_request(horde, max_attempts=1)
    serve(horde, start_worker, rid)

    assert kcpp.generations[-1].get("cut") is True
    fault_only(horde, rid)


def test_an_in_band_error_aborts_the_generation_at_once_and_faults_the_job(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.token_delay_s = 0.02
    kcpp.script(lambda body: ScriptedReply(text=LONG_TEXT))  # the error comes half-way
    kcpp.inject("chat", "stream_error")
    rid = stream_request(horde, max_attempts=1)
    serve(horde, start_worker, rid)

    genkey = chat_requests(kcpp)[0]["body"]["genkey"]
    gen = kcpp.generations[-1]
    assert gen.get("error_sent") and gen["aborted"]
    assert gen["completion_tokens"] < len(LONG_TEXT) // 4 * 3 // 4
    assert genkey in kcpp.aborts
    fault_only(horde, rid)


def test_a_stream_that_ends_without_a_finish_reason_faults_the_job_without_a_reason(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.token_delay_s = 0.02
    kcpp.script(lambda body: ScriptedReply(text=TEXT))
    kcpp.inject("chat", "no_finish")
    rid = stream_request(horde, max_attempts=1)
    serve(horde, start_worker, rid)

    assert kcpp.generations[-1]["aborted"] is False
    fault_only(horde, rid)


# --- deadlines -----------------------------------------------------------------------


@pytest.mark.parametrize("horde", [{"ttl_s": 7, "sweep_s": 0}], indirect=True)
def test_a_backend_silent_until_the_lease_nears_its_end_is_aborted_and_faulted_in_time(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    kcpp.prompt_delay_s = 30.0  # prompt processing far longer than the 7 s lease
    rid = stream_request(horde, max_attempts=1)
    started = time.monotonic()
    serve(horde, start_worker, rid)

    assert time.monotonic() - started < 7.0
    genkey = chat_requests(kcpp)[0]["body"]["genkey"]
    assert genkey in kcpp.aborts
    assert kcpp.generations[-1]["aborted"]
    assert progress_posts(horde) == []
    fault_only(horde, rid)  # faulted while the lease lasted: not "expired", not AbortedGen


@pytest.mark.parametrize("horde", [{"ttl_s": 7, "sweep_s": 0}], indirect=True)
def test_posts_extend_the_lease_so_a_pause_longer_than_the_lease_left_at_open_is_waited_out(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    # The fit check takes 1.5 s, so at open the lease keeps 7 - 1.5 - 5 = 0.5 s
    # before the submit margin; the stream then pauses 1.5 s half-way, after
    # posts extended the lease to 7 s after each of them.
    text = "Blue is the colour of the sky on a clear summer day. " * 2
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text=text))
    kcpp.inject("tokencount", "hang:1.5")
    kcpp.inject("chat", "stall:1.5")
    rid = stream_request(horde)
    serve(horde, start_worker, rid)

    assert not kcpp.generations[-1]["aborted"]
    job_id = only_job_id(horde, rid)
    assert terminal(horde) == [(job_id, "submitted")]
    stream = horde.status(rid)["stream"]
    assert_seqs_in_order(stream)
    assert content_of(stream) == text == horde.ledger[0]["body"]["message"]["content"]


@pytest.mark.parametrize("horde", [{"ttl_s": 7, "sweep_s": 0}], indirect=True)
def test_a_stream_whose_posts_stopped_is_faulted_before_its_unextended_lease_ends(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    # 503s stop posting at once, so nothing extends the 7 s lease; the reply would
    # take 6.5 s, past the 2 s the lease leaves before the submit margin.
    kcpp.token_delay_s = 0.05
    kcpp.script(lambda body: ScriptedReply(text=LONG_TEXT))
    horde.inject("progress", UNAVAILABLE, UNAVAILABLE, UNAVAILABLE)
    rid = stream_request(horde, max_attempts=1)
    serve(horde, start_worker, rid)

    genkey = chat_requests(kcpp)[0]["body"]["genkey"]
    assert genkey in kcpp.aborts
    assert kcpp.generations[-1]["aborted"]
    assert [p["seq"] for p in progress_posts(horde)] == [1, 1, 1]
    fault_only(horde, rid)


def test_the_lease_the_last_progress_post_extended_is_journaled(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short reply's last post goes after the stream ended: the lease it extends
    is the job's from then on, and the journal is told (a restart must not take
    a lease that runs for one that ended)."""
    from koboldcpp_horde_chat.state.job import JobContext

    journaled: list[tuple[JobContext, float]] = []
    real = JobContext.record_lease

    def spy(self: JobContext) -> None:
        journaled.append((self, self.lease.deadline))
        real(self)

    monkeypatch.setattr(JobContext, "record_lease", spy)
    kcpp.token_delay_s = 0.01
    kcpp.script(lambda body: ScriptedReply(text="Blue."))
    rid = stream_request(horde)
    serve(horde, start_worker, rid)

    job_id = only_job_id(horde, rid)
    assert terminal(horde) == [(job_id, "submitted")]
    assert len(progress_posts(horde)) == 2  # the first text at once, the rest after the end
    assert journaled, "the extended lease was never journaled"
    ctx, deadline = journaled[-1]
    assert deadline == ctx.lease.deadline > ctx.lease.popped_at + horde.ttl_s
