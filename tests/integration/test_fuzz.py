"""Property tests: malformed pops, backend bodies and streams, and Horde answers.

The real ``Worker`` runs on in-process fakes of the Horde and koboldcpp
(``bench/harness/fakes.py``: no sockets, a fake clock), so each target runs 1000
examples in seconds. Whatever hypothesis generates, the worker

* never raises out of ``run_once``;
* never has two submits of one job accepted, and never submits a job the
  Horde cancelled or ended, nor resends a refused reply;
* ends every popped job that has an id in exactly one terminal action:
  submitted, faulted, ended by the Horde (404, ``AbortedGen``...), cancelled,
  or left to expire only after trying to submit until its lease ran out.

Seed: "The pop loop", "2. Recognise a chat job", "Submit refusals",
"7. Fault a job", "Streaming progress".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.harness.fakes import (
    BACKEND_ERRORS,
    POP_ERRORS,
    PROGRESS_OUTCOMES,
    SUBMIT_OUTCOMES,
    FakeBackend,
    FakeClock,
    FakeHorde,
    FakeStopEvent,
    backend_error,
    chat_body,
    sse_chunks,
)
from koboldcpp_horde_chat.errors import BackendBusy, BackendError, ReplyError
from koboldcpp_horde_chat.service.loop import Worker
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.shared import WorkerState
from tests import pops

MODEL = "koboldcpp/fake"
EXAMPLES = settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
ACCEPTABLE = {"submitted", "faulted", "ended", "cancelled", "expired"}


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    """Thousands of faults log thousands of warnings: skip formatting them."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


# --- strategies ------------------------------------------------------------------------

json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


def base_pop(kind: str, job_id: str) -> dict[str, Any]:
    if kind == "text":
        return pops.text_pop(job_id, MODEL, prompt="Once upon a time")
    extra: dict[str, Any] = {}
    if kind == "stream":
        extra["stream_progress"] = True
    if kind == "tools":
        extra["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        extra["tool_choice"] = "required"
    if kind == "schema":
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}
    return pops.chat_pop(
        job_id,
        MODEL,
        full=True,
        messages=[
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": [{"type": "text", "text": "Name one colour."}]},
        ],
        temperature=0.5,
        **extra,
    )


KINDS = ("chat", "stream", "tools", "schema", "text")
TOP_KEYS = ("id", "ttl", "chat", "payload", "model", "ids", "skipped")
PAYLOAD_KEYS = (
    "messages", "messages_url", "max_length", "max_context_length", "stream_progress", "tools",
    "tool_choice", "response_format", "stop_sequence", "seed", "temperature", "prompt", "n",
)
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


@st.composite
def mutated_pop(draw: st.DrawFn, index: int) -> dict[str, Any]:
    pop = base_pop(draw(st.sampled_from(KINDS)), f"job-{index}")
    for _ in range(draw(st.integers(0, 4))):
        where = draw(st.sampled_from(("top", "payload", "message")))
        delete = draw(st.booleans())
        if where == "top":
            target: Any = pop
            key = draw(st.sampled_from(TOP_KEYS))
        elif where == "payload":
            target = pop.get("payload")
            key = draw(st.sampled_from(PAYLOAD_KEYS) | st.text(max_size=6))
        else:
            payload = pop.get("payload")
            messages = payload.get("messages") if isinstance(payload, dict) else None
            if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
                continue
            target = messages[-1]
            key = draw(st.sampled_from(MESSAGE_KEYS))
        if not isinstance(target, dict):
            continue
        if key == "messages_url" and not delete:
            # Never a public host: a closed local port (connection refused) or a non-http URL.
            target[key] = draw(st.sampled_from(["http://127.0.0.1:9/m", "ftp://x/y", "", 5]))
        elif delete:
            target.pop(key, None)
        else:
            target[key] = draw(json_value)
    if pop.get("id") == f"job-{index}" or not isinstance(pop.get("id"), str):
        return pop
    pop["id"] = f"job-{index}-{pop['id']!r}"[:40]  # keep ids unique across one run
    return pop


@st.composite
def pop_sequences(draw: st.DrawFn) -> list[Any]:
    n = draw(st.integers(1, 4))
    return [draw(mutated_pop(i)) for i in range(n)]


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


stream_event = st.one_of(
    json_value.map(sse),
    st.binary(max_size=40),
    st.sampled_from(
        [
            b"data: [DONE]\n\n",
            b": keep-alive\n\n",
            b"data: {\"choices\": [{\"delta\": {\"content\": \"Bl",
            sse({"choices": [{"index": 0, "delta": {"content": "Blue"}}]}),
            sse({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]}),
            sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
            sse({"error": {"message": "boom"}}),
            sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}),
            "\ufffd<think>".encode(),
        ]
    ),
    st.sampled_from(["error", "reset", "server_error"]).map(backend_error),
    st.just(RuntimeError("socket went away")),
)
backend_result = st.one_of(
    json_value,
    st.sampled_from(BACKEND_ERRORS).map(backend_error),
    st.builds(
        chat_body,
        st.text(max_size=20),
        st.sampled_from(["stop", "length", "tool_calls", "content_filter", "error", "eos_token", ""]),
    ),
    st.just(ReplyError("bad")),
)


# --- harness ---------------------------------------------------------------------------


def build(horde: FakeHorde, backend: FakeBackend, clock: FakeClock) -> Worker:
    options = WorkerSettings(
        api_key="fuzz-key", worker_name="fuzz", model_id=MODEL, backend_max_context_length=4096,
        max_length=512,
    )
    return Worker(
        options,
        horde=horde,
        backend=backend,
        state=WorkerState(options, stop_event=FakeStopEvent(clock), clock=clock),
        pop_horde=horde,  # each submit overlaps the next pop, as in production
    )


def drive(worker: Worker, horde: FakeHorde, passes: int) -> None:
    for _ in range(passes):
        if worker.stop_event.is_set():
            break
        worker.run_once()  # must not raise
    worker.drain()  # a pop that overlapped the last submit gets its job served too


def left_to_expire(horde: FakeHorde, pops: list[Any]) -> set[str]:
    """Jobs the worker may leave to expire on purpose: a job of a request (its pop's
    payload, model and kind) whose 2 jobs before it were faulted since one was
    submitted (the Horde hands a faulted request back; ``state/refaults.py``)."""
    verdicts = horde.verdicts()
    faulted: dict[str, int] = {}
    allowed: set[str] = set()
    for pop in pops:
        job_id = pop.get("id") if isinstance(pop, dict) else None
        if not (isinstance(job_id, str) and job_id in verdicts):
            continue
        key = json.dumps(
            [pop.get("payload"), pop.get("model"), pop.get("chat") is True],
            sort_keys=True, default=repr,
        )
        if faulted.get(key, 0) >= 2:
            allowed.add(job_id)
        if verdicts[job_id] == "faulted":
            faulted[key] = faulted.get(key, 0) + 1
        elif verdicts[job_id] == "submitted":
            faulted[key] = 0
    return allowed


def check(horde: FakeHorde, pops: list[Any] | None = None) -> None:
    verdicts = horde.verdicts()
    expiring = left_to_expire(horde, pops or [])
    bad = {
        j: v for j, v in verdicts.items()
        if v not in ACCEPTABLE and not (j in expiring and v == "lost")
    }
    assert not bad, {j: vars(horde.jobs[j]) for j in bad}
    late = {j: job.late_submits for j, job in horde.jobs.items() if job.late_submits}
    assert not late, late


# --- targets ---------------------------------------------------------------------------


@EXAMPLES
@given(pops=pop_sequences())
def test_malformed_pops_never_escape_and_every_job_gets_one_answer(pops: list[Any]) -> None:
    clock = FakeClock()
    horde = FakeHorde(clock, pops=pops)
    worker = build(horde, FakeBackend(), clock)
    drive(worker, horde, len(pops))
    check(horde, pops)


@EXAMPLES
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
    tokencounts=st.lists(st.one_of(st.integers(-5, 10**7), json_value, st.sampled_from(BACKEND_ERRORS).map(backend_error)), max_size=3),
    chats=st.lists(backend_result, max_size=3),
    generates=st.lists(backend_result, max_size=3),
    streams=st.lists(
        st.one_of(
            st.lists(stream_event, max_size=8),
            st.sampled_from(["error", "reset", "unauthorized", "server_error"]).map(backend_error),
            st.just(sse_chunks()),
        ),
        max_size=3,
    ),
    aborts=st.lists(st.one_of(st.booleans(), st.sampled_from(BACKEND_ERRORS).map(backend_error)), max_size=2),
)
def test_malformed_backend_bodies_and_streams_fault_the_job_once(
    kinds: list[str],
    tokencounts: list[Any],
    chats: list[Any],
    generates: list[Any],
    streams: list[Any],
    aborts: list[Any],
) -> None:
    clock = FakeClock()
    pops = [base_pop(kind, f"job-{i}") for i, kind in enumerate(kinds)]
    horde = FakeHorde(clock, pops=pops)
    backend = FakeBackend()
    backend.tokencounts.extend(tokencounts)
    backend.chats.extend(chats)
    backend.generates.extend(generates)
    backend.streams.extend(streams)
    backend.aborts.extend(aborts)
    worker = build(horde, backend, clock)
    drive(worker, horde, len(pops))
    check(horde, pops)
    assert set(horde.verdicts()) == {p["id"] for p in pops}


@EXAMPLES
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
    pop_errors=st.lists(st.sampled_from(POP_ERRORS), max_size=3),
    submits=st.lists(st.sampled_from(SUBMIT_OUTCOMES), max_size=12),
    progress=st.lists(st.sampled_from(PROGRESS_OUTCOMES), max_size=8),
    stream_text=st.text(min_size=1, max_size=60),
)
def test_any_horde_answers_leave_no_job_lost_or_submitted_twice(
    kinds: list[str],
    pop_errors: list[str],
    submits: list[str],
    progress: list[str],
    stream_text: str,
) -> None:
    clock = FakeClock()
    pops: list[Any] = [*pop_errors, *(base_pop(kind, f"job-{i}") for i, kind in enumerate(kinds))]
    horde = FakeHorde(clock, pops=pops, submit_script=submits, progress_script=progress)
    backend = FakeBackend()
    backend.streams.extend(sse_chunks(stream_text.replace("\n", " ") + " end") for _ in kinds)
    worker = build(horde, backend, clock)
    drive(worker, horde, len(pops))
    check(horde, pops)
    if not worker.stop_event.is_set():
        assert set(horde.verdicts()) == {f"job-{i}" for i in range(len(kinds))}
    assert all(job.accepted <= 1 for job in horde.jobs.values())


def test_the_busy_backend_path_waits_out_the_lease_then_faults() -> None:
    """A backend busy for good: the job is faulted before its lease ends, not left."""
    clock = FakeClock()
    horde = FakeHorde(clock, pops=[base_pop("chat", "job-0")])
    backend = FakeBackend()
    backend.chats.extend(BackendBusy("503 busy", status=503) for _ in range(500))
    worker = build(horde, backend, clock)
    drive(worker, horde, 1)
    assert horde.verdicts() == {"job-0": "faulted"}
    job = horde.jobs["job-0"]
    assert job.last_attempt_at <= job.popped_at + job.ttl_s


def test_a_backend_error_raised_as_a_non_backend_exception_is_still_one_fault() -> None:
    clock = FakeClock()
    horde = FakeHorde(clock, pops=[base_pop("chat", "job-0"), base_pop("text", "job-1")])
    backend = FakeBackend()
    backend.chats.append(ValueError("a bug in a lower layer"))
    backend.generates.append(BackendError("x", status=0))
    worker = build(horde, backend, clock)
    drive(worker, horde, 2)
    assert horde.verdicts() == {"job-0": "faulted", "job-1": "faulted"}
