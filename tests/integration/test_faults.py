"""Fault injection: the real worker against the dev Horde and the scripted koboldcpp.

Each fault on each route (pop, submit, progress, tokencount, chat completion,
abort, messages_url): connection refused, reset, timeout, 5xx, 429 with
``Retry-After``, truncated JSON, a stream that stops mid-token, and koboldcpp
restarted mid-job. Every test asserts each job's single terminal action in the
dev Horde's ledger (seed: "The pop loop", "7. Fault a job", "Streaming
progress") and that nothing was submitted twice.

The worker is built directly (``service.loop.Worker`` with the real ``HordeClient``
and ``KoboldClient``) so that its timeouts can be short; a 6.5 s lease
(``DevHorde(ttl_s=6.5)``) leaves 1.5 s for a generation once the worker keeps
its 5 s margin for the submit, so the timeout tests are quick.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from koboldcpp_horde_chat import BRIDGE_AGENT
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import BUSY_BODY, ScriptedKoboldcpp, ScriptedReply
from koboldcpp_horde_chat.horde.client import HordeClient
from koboldcpp_horde_chat.koboldcpp.client import KoboldClient
from koboldcpp_horde_chat.service.loop import Worker
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.shared import WorkerState

from .conftest import API_KEY

MODEL = "koboldcpp/scripted-model"
FINAL = ("submitted", "faulted", "cancelled", "expired")
SHORT_LEASE = {"ttl_s": 6.5, "sweep_s": 0}


# --- harness ---------------------------------------------------------------------------


class Running:
    """A Worker's ``run()`` on a thread."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="fault-worker")
        self.thread.start()

    def _run(self) -> None:
        self.code = self.worker.run()

    def stop(self, timeout_s: float = 15.0) -> int | None:
        self.worker.stop_event.set()
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the worker did not stop"
        return self.code


@pytest.fixture
def run_worker(horde: DevHorde, kcpp: ScriptedKoboldcpp) -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def start(*, kcpp_url: str | None = None, horde_url: str | None = None, **overrides: Any) -> Running:
        options: dict[str, Any] = {
            "api_key": API_KEY,
            "worker_name": "fault-worker",
            "model_id": MODEL,
            "backend_max_context_length": 4096,
            "max_length": 512,
            "horde_url": horde_url or horde.url,
            "kcpp_url": kcpp_url or kcpp.url,
            "local_idle_s": 0.0,
            "pop_timeout_s": 2.0,
            "submit_timeout_s": 2.0,
            "progress_timeout_s": 1.0,
            "connect_timeout_s": 1.0,
            # probe a koboldcpp that stopped answering every 0.5 s instead of 3 s
            "backend_probe_s": 0.5,
        }
        options.update(overrides)
        settings = WorkerSettings(**options)
        worker = Worker(
            settings,
            horde=HordeClient(
                settings.horde_url, settings.api_key, bridge_agent=BRIDGE_AGENT, connect_timeout_s=1.0
            ),
            backend=KoboldClient(settings.kcpp_url, connect_timeout_s=1.0),
            state=WorkerState(settings, stop_event=threading.Event()),
        )
        running = Running(worker)
        started.append(running)
        return running

    yield start
    for running in started:
        running.worker.stop_event.set()
        running.thread.join(15)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def actions(horde: DevHorde) -> dict[str, list[str]]:
    """Every job's ledger actions, in order; asserts exactly one terminal action each."""
    by_job: dict[str, list[str]] = defaultdict(list)
    for entry in horde.ledger:
        by_job[entry["job_id"]].append(entry["action"])
    for job_id, acts in by_job.items():
        final = [a for a in acts if a in FINAL]
        assert len(final) == 1, (job_id, acts)
        assert "aborted_gen" not in acts, (job_id, acts)  # nothing sent after the lease
    return dict(by_job)


def terminal(horde: DevHorde, rid: str) -> list[str]:
    """The terminal action of each job of request ``rid``, in pop order."""
    acts = actions(horde)
    return [next(a for a in acts[j] if a in FINAL) for j in horde.status(rid)["job_ids"]]


def entries(horde: DevHorde, job_id: str) -> list[dict[str, Any]]:
    return [e for e in horde.ledger if e["job_id"] == job_id]


def ask(horde: DevHorde, text: str = "Name one colour.", **body: Any) -> str:
    return horde.send_chat({"messages": [{"role": "user", "content": text}], **body}, best_effort=True)


def serve(horde: DevHorde, run_worker: Callable[..., Running], rids: list[str], timeout_s: float = 20, **kw: Any) -> Running:
    running = run_worker(**kw)
    try:
        assert horde.wait(rids, timeout_s=timeout_s), [horde.status(r) for r in rids]
    finally:
        running.stop()
    return running


def horde_calls(horde: DevHorde, route: str) -> list[dict[str, Any]]:
    return [r for r in horde.requests_log if r["port"] == "horde" and r["path"].endswith("/" + route)]


def key_blamed(caplog: pytest.LogCaptureFixture) -> bool:
    return any("API key" in r.getMessage() for r in caplog.records)


# --- pop -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault",
    [
        "reset",
        (502, {"message": "Bad Gateway"}),
        (503, {"message": "Service Unavailable", "rc": "ServiceUnavailable"}),
        (429, {"message": "Too Many Requests", "rc": "TooManyRequests"}, {"Retry-After": "1"}),
        (200, ["not", "an", "object"]),
    ],
    ids=["reset", "502", "503", "429", "not-an-object"],
)
def test_a_pop_fault_that_assigned_nothing_is_retried_and_the_job_served(
    horde: DevHorde, run_worker: Callable[..., Running], fault: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    rid = ask(horde)
    horde.inject("pop", fault)
    serve(horde, run_worker, [rid])
    assert terminal(horde, rid) == ["submitted"]
    assert not key_blamed(caplog)
    pops = horde_calls(horde, "pop")
    gap = pops[1]["at"] - pops[0]["at"]
    assert gap >= (1.0 if fault[0] == 429 else 0.5)  # backed off (Retry-After: 1 honoured)


@pytest.mark.parametrize("fault", ["truncate", "drop"])
def test_a_pop_answer_lost_after_assignment_leaves_one_expired_job_then_the_request_is_served(
    horde: DevHorde, run_worker: Callable[..., Running], fault: str
) -> None:
    rid = ask(horde)
    horde.inject("pop", fault)
    running = run_worker()
    try:
        until(lambda: len(horde_calls(horde, "pop")) >= 2)  # the worker moved on
        assert horde.expire_leases() == horde.status(rid)["job_ids"]
        assert horde.wait([rid], timeout_s=10)
    finally:
        running.stop()
    assert terminal(horde, rid) == ["expired", "submitted"]


def test_a_pop_that_times_out_is_retried_and_no_job_is_answered_twice(
    horde: DevHorde, run_worker: Callable[..., Running]
) -> None:
    rid = ask(horde)
    # The first pop hangs past the worker's 1 s timeout and is then processed.
    horde.inject("pop", "hang:1.4", (503, {"message": "busy"}))
    running = run_worker(pop_timeout_s=1.0)
    try:
        until(lambda: bool(horde.status(rid)["job_ids"]), 10)
        until(lambda: len(horde_calls(horde, "pop")) >= 3, 10)
        horde.expire_leases()
        assert horde.wait([rid], timeout_s=10)
    finally:
        running.stop()
    assert terminal(horde, rid) in (["submitted"], ["expired", "submitted"])


def test_a_horde_refusing_connections_is_waited_for_without_blaming_the_key(
    kcpp: ScriptedKoboldcpp, run_worker: Callable[..., Running], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    horde = DevHorde(api_keys=(API_KEY,), port=free_port())
    horde.start()
    try:
        url = horde.url
        rid = ask(horde)
        horde.refuse_connections()
        running = run_worker(horde_url=url)
        time.sleep(1.5)
        horde.accept_connections()
        try:
            assert horde.wait([rid], timeout_s=15)
        finally:
            running.stop()
        assert terminal(horde, rid) == ["submitted"]
        assert any("could not connect" in r.getMessage() for r in caplog.records)
        assert not key_blamed(caplog)
    finally:
        horde.stop()


# --- submit ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault",
    [
        "reset",
        "drop",
        "truncate",
        "hang:3",
        (503, {"message": "Service Unavailable"}),
        (429, {"message": "Too Many Requests"}, {"Retry-After": "1.5"}),
    ],
    ids=["reset", "drop", "truncate", "timeout", "503", "429"],
)
def test_a_submit_fault_is_retried_with_the_same_body_and_the_reply_counted_once(
    horde: DevHorde, run_worker: Callable[..., Running], fault: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    rid = ask(horde)
    horde.inject("submit", fault)
    serve(horde, run_worker, [rid], submit_timeout_s=1.0)
    (job_id,) = horde.status(rid)["job_ids"]
    assert terminal(horde, rid) == ["submitted"]
    acts = [e["action"] for e in entries(horde, job_id)]
    # A processed submit whose answer was lost is retried: the Horde says DuplicateGen.
    assert acts in (["submitted"], ["submitted", "duplicate"], ["duplicate", "submitted"])
    sent = horde_calls(horde, "submit")
    assert len({r["body"] for r in sent}) == 1  # the very same body each time
    if isinstance(fault, tuple) and fault[0] == 429:
        assert sent[1]["at"] - sent[0]["at"] >= 1.5
    assert not key_blamed(caplog)


def test_a_horde_down_at_submit_time_gets_the_reply_once_it_is_back(
    kcpp: ScriptedKoboldcpp, run_worker: Callable[..., Running]
) -> None:
    kcpp.token_delay_s = 0.05  # "Name one colour." -> "Blue.": a few tokens
    kcpp.script(lambda body: ScriptedReply(text="Blue is the colour of the sky. " * 3))
    horde = DevHorde(api_keys=(API_KEY,), port=free_port())
    horde.start()
    try:
        rid = ask(horde)
        running = run_worker(horde_url=horde.url)
        try:
            until(lambda: kcpp.generating, 10)
            horde.refuse_connections()
            time.sleep(1.5)
            horde.accept_connections()
            assert horde.wait([rid], timeout_s=15)
        finally:
            running.stop()
        assert terminal(horde, rid) == ["submitted"]
    finally:
        horde.stop()


# --- progress (streamed jobs) ----------------------------------------------------------


def streamed(horde: DevHorde, kcpp: ScriptedKoboldcpp) -> str:
    kcpp.token_delay_s = 0.01
    kcpp.script(lambda body: ScriptedReply(text="The sky is blue today. " * 12))
    return horde.send_chat(
        {"messages": [{"role": "user", "content": "Tell me about the sky."}], "stream": True},
        best_effort=True,
    )


@pytest.mark.parametrize(
    "fault",
    [
        "reset",
        "drop",
        "truncate",
        "hang:2",
        (503, {"message": "Unavailable", "rc": "ChatProgressUnavailable"}),
        (429, {"message": "Too Many Requests"}, {"Retry-After": "1"}),
    ],
    ids=["reset", "drop", "truncate", "timeout", "503", "429"],
)
def test_a_progress_fault_neither_duplicates_text_nor_loses_the_submit(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, run_worker: Callable[..., Running], fault: Any
) -> None:
    rid = streamed(horde, kcpp)
    horde.inject("progress", fault)
    serve(horde, run_worker, [rid])
    assert terminal(horde, rid) == ["submitted"]
    status = horde.status(rid)
    posted = "".join(e["content"] for e in status["stream"])
    assert status["message"]["content"].startswith(posted)
    assert [e["seq"] for e in status["stream"]] == list(range(1, len(status["stream"]) + 1))


def test_a_stream_that_stops_mid_token_is_faulted_not_submitted_as_a_reply(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, run_worker: Callable[..., Running]
) -> None:
    rid = streamed(horde, kcpp)
    kcpp.inject("chat", "stream_cut")
    serve(horde, run_worker, [rid])
    first, second = horde.status(rid)["job_ids"]
    assert terminal(horde, rid) == ["faulted", "submitted"]
    assert entries(horde, first)[0]["body"] == {"id": first, "state": "faulted", "model_id": MODEL}


def test_a_cancelled_stream_whose_abort_fails_is_still_not_submitted(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, run_worker: Callable[..., Running]
) -> None:
    kcpp.token_delay_s = 0.02
    kcpp.script(lambda body: ScriptedReply(text="The sky is blue today. " * 40))
    rid = horde.send_chat(
        {"messages": [{"role": "user", "content": "Tell me about the sky."}], "stream": True},
        best_effort=True,
    )
    kcpp.inject("abort", "reset")
    running = run_worker()
    try:
        until(lambda: bool(horde.status(rid)["stream"]), 10)
        horde.cancel(rid)
        until(lambda: any(r["path"] == "/api/extra/abort" for r in kcpp.requests), 10)
        time.sleep(0.3)
    finally:
        running.stop()
    assert terminal(horde, rid) == ["cancelled"]
    assert not horde_calls(horde, "submit")


# --- tokencount ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault",
    ["reset", "truncate", (500, {"detail": {"msg": "oops"}}), (200, {"value": "many"}), (503, BUSY_BODY)],
    ids=["reset", "truncate", "500", "no-count", "busy"],
)
def test_a_tokencount_fault_faults_the_job_without_a_reason(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, run_worker: Callable[..., Running], fault: Any
) -> None:
    rid = ask(horde)
    kcpp.inject("tokencount", fault)
    serve(horde, run_worker, [rid])
    first = horde.status(rid)["job_ids"][0]
    assert terminal(horde, rid) == ["faulted", "submitted"]
    assert entries(horde, first)[0]["body"] == {"id": first, "state": "faulted", "model_id": MODEL}
    assert len([r for r in kcpp.requests if r["path"] == "/v1/chat/completions"]) == 1


@pytest.mark.parametrize("horde", [SHORT_LEASE], indirect=True)
def test_a_tokencount_timeout_still_faults_the_job_within_its_lease(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, run_worker: Callable[..., Running]
) -> None:
    rid = ask(horde)
    kcpp.inject("tokencount", "hang:8")
    serve(horde, run_worker, [rid])
    assert terminal(horde, rid) == ["faulted", "submitted"]


# --- chat completion -------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault",
    [
        "reset",
        "truncate",
        (500, {"detail": {"msg": "Error parsing input.", "type": "bad_input"}}),
        (200, {"choices": []}),
        (200, "<html>not json</html>"),
    ],
    ids=["reset", "truncate", "500", "no-choices", "not-json"],
)
def test_a_chat_completion_fault_faults_the_job_once_without_generating_again(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, run_worker: Callable[..., Running], fault: Any
) -> None:
    rid = ask(horde)
    kcpp.inject("chat", fault)
    serve(horde, run_worker, [rid])
    first = horde.status(rid)["job_ids"][0]
    assert terminal(horde, rid) == ["faulted", "submitted"]
    assert entries(horde, first)[0]["body"] == {"id": first, "state": "faulted", "model_id": MODEL}
    # One generation per job: the faulted job was not generated a second time.
    assert len([r for r in kcpp.requests if r["path"] == "/v1/chat/completions"]) == 2


def test_a_busy_koboldcpp_is_waited_for_within_the_lease(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, run_worker: Callable[..., Running]
) -> None:
    rid = ask(horde)
    kcpp.inject("chat", (503, BUSY_BODY))
    serve(horde, run_worker, [rid])
    assert terminal(horde, rid) == ["submitted"]


@pytest.mark.parametrize("horde", [SHORT_LEASE], indirect=True)
@pytest.mark.parametrize(
    "abort_fault", [None, "reset", "hang:8"], ids=["abort-ok", "abort-reset", "abort-timeout"]
)
def test_a_chat_completion_timeout_aborts_the_generation_and_faults_within_the_lease(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, run_worker: Callable[..., Running], abort_fault: str | None
) -> None:
    rid = ask(horde)
    kcpp.inject("chat", "hang:8")
    if abort_fault:
        kcpp.inject("abort", abort_fault)
    serve(horde, run_worker, [rid])
    assert terminal(horde, rid) == ["faulted", "submitted"]
    first_genkey = next(r for r in kcpp.requests if r["path"] == "/v1/chat/completions")["body"]["genkey"]
    aborts = [r["body"] for r in kcpp.requests if r["path"] == "/api/extra/abort"]
    assert {"genkey": first_genkey} in aborts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_koboldcpp_restarted_mid_job_faults_that_job_and_serves_the_next_on_the_new_one(
    horde: DevHorde, run_worker: Callable[..., Running], stream: bool
) -> None:
    port = free_port()
    old = ScriptedKoboldcpp(port=port, token_delay_s=0.02).start()
    old.script(lambda body: ScriptedReply(text="The sky is blue today. " * 40))
    new = ScriptedKoboldcpp(port=port)
    try:
        rid = horde.send_chat(
            {"messages": [{"role": "user", "content": "Name one colour."}], "stream": stream},
            best_effort=True,
        )
        running = run_worker(kcpp_url=f"http://127.0.0.1:{port}")
        try:
            until(lambda: old.generating, 10)
            time.sleep(0.2)
            old.kill()
            new.start()
            assert horde.wait([rid], timeout_s=20)
        finally:
            running.stop()
        first = horde.status(rid)["job_ids"][0]
        assert terminal(horde, rid) == ["faulted", "submitted"]
        assert entries(horde, first)[0]["body"] == {"id": first, "state": "faulted", "model_id": MODEL}
        assert horde.status(rid)["message"]["content"] == "Blue."  # the new koboldcpp's reply
    finally:
        old.stop()
        new.stop()


def test_koboldcpp_down_costs_at_most_one_fault_and_no_pops_until_it_is_back(
    horde: DevHorde, run_worker: Callable[..., Running], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    port = free_port()
    first_kcpp = ScriptedKoboldcpp(port=port).start()
    second_kcpp = ScriptedKoboldcpp(port=port)
    try:
        running = run_worker(kcpp_url=f"http://127.0.0.1:{port}")
        try:
            until(lambda: len(horde_calls(horde, "pop")) >= 1, 10)
            first_kcpp.kill()
            rids = [ask(horde) for _ in range(3)]
            until(lambda: any(e["action"] == "faulted" for e in horde.ledger), 10)
            pops_while_down = len(horde_calls(horde, "pop"))
            time.sleep(1.2)  # the worker probes koboldcpp (every 0.5 s here), and does not pop
            assert len(horde_calls(horde, "pop")) == pops_while_down
            second_kcpp.start()
            assert horde.wait(rids, timeout_s=15)
        finally:
            running.stop()
        assert [e["action"] for e in horde.ledger].count("faulted") == 1
        assert all(terminal(horde, rid)[-1] == "submitted" for rid in rids)
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert text.count("does not answer: not popping until it does") == 1
        assert "answers again" in text
    finally:
        first_kcpp.stop()
        second_kcpp.stop()


# --- messages_url ----------------------------------------------------------------------

OFFLOAD = {"offload_bytes": 64}
OFFLOAD_SHORT = {"offload_bytes": 64, "ttl_s": 6.5, "sweep_s": 0}


def long_ask(horde: DevHorde) -> str:
    return ask(horde, "Name one colour. " + "Please answer briefly. " * 8)


@pytest.mark.parametrize("horde", [OFFLOAD], indirect=True)
@pytest.mark.parametrize(
    "fault",
    ["reset", "truncate", "drop", (500, {"message": "InternalError"}), (403, {"message": "AccessDenied"})],
    ids=["reset", "truncate", "drop", "500", "403"],
)
def test_a_messages_url_fault_faults_the_job_without_a_reason(
    horde: DevHorde, run_worker: Callable[..., Running], fault: Any
) -> None:
    rid = long_ask(horde)
    horde.inject("storage", fault)
    serve(horde, run_worker, [rid])
    first = horde.status(rid)["job_ids"][0]
    assert terminal(horde, rid) == ["faulted", "submitted"]
    assert entries(horde, first)[0]["body"] == {"id": first, "state": "faulted", "model_id": MODEL}


@pytest.mark.parametrize("horde", [OFFLOAD_SHORT], indirect=True)
def test_a_messages_url_timeout_faults_the_job_within_its_lease(
    horde: DevHorde, run_worker: Callable[..., Running]
) -> None:
    rid = long_ask(horde)
    horde.inject("storage", "hang:8")
    serve(horde, run_worker, [rid])
    assert terminal(horde, rid) == ["faulted", "submitted"]


@pytest.mark.parametrize("horde", [OFFLOAD], indirect=True)
def test_a_messages_url_refusing_connections_faults_the_job(
    horde: DevHorde, run_worker: Callable[..., Running]
) -> None:
    rid = long_ask(horde)
    horde.refuse_connections("storage")
    running = run_worker()
    try:
        deadline = time.monotonic() + 20
        while len(horde.status(rid)["job_ids"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a fourth pop would come now
    finally:
        running.stop()
    # Each attempt is one fault without a reason; the Horde hands the request straight
    # back, and its third job is left to expire (state/refaults.py) rather than faulted.
    first, second, third = horde.status(rid)["job_ids"]
    acts = actions(horde)
    assert [next(a for a in acts[j] if a in FINAL) for j in (first, second)] == ["faulted"] * 2
    assert third not in acts
    assert all(e["fault_reason"] is None for e in horde.ledger)
    assert horde.job(third)["action"] is None  # type: ignore[index]
    horde.expire_leases()  # its ttl passed: the sweep faults the request (3 faulted jobs)
    assert horde.status(rid)["state"] == "faulted"


# --- text jobs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault", ["reset", "truncate", (500, {"detail": {"msg": "oops"}})], ids=["reset", "truncate", "500"]
)
def test_a_text_generation_fault_faults_the_text_job(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, run_worker: Callable[..., Running], fault: Any
) -> None:
    rid = horde.send_text("Once upon a time", max_length=40)
    kcpp.inject("generate", fault)
    serve(horde, run_worker, [rid])
    first = horde.status(rid)["job_ids"][0]
    assert terminal(horde, rid) == ["faulted", "submitted"]
    assert entries(horde, first)[0]["body"] == {"id": first, "generation": "", "state": "faulted"}


# --- the CLI's withholding reaches the pop ---------------------------------------------


def test_chat_withhold_from_the_command_line_reaches_every_pop(
    horde: DevHorde, start_worker: Any
) -> None:
    rid = horde.send_chat(
        {"messages": [{"role": "user", "content": "Name one colour."}], "seed": 3}, best_effort=True
    )
    worker = start_worker("--chat-withhold", "json_schema, tools,prompt_overflow_refused")
    try:
        until(lambda: len(horde.pops) >= 1, 15)
        assert horde.wait([rid], timeout_s=15)
    finally:
        worker.stop()
    for pop in horde.pops:
        assert pop["body"]["chat_features"] == ["seed", "presence_penalty", "json_object", "reasoning_effort"]
    assert terminal(horde, rid) == ["submitted"]


# --- bounded reads ---------------------------------------------------------------------


def trickling_server(head: bytes, body: bytes, every_s: float) -> tuple[str, threading.Event]:
    """A one-shot HTTP server that sends ``head`` then ``body`` one byte every ``every_s``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            conn.recv(65536)
            conn.sendall(head)
            for byte in body:
                if done.wait(every_s):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", done


@pytest.mark.parametrize("call", ["tokencount", "chat_completion"])
def test_a_koboldcpp_answer_that_trickles_in_is_cut_off_at_the_calls_deadline(call: str) -> None:
    from koboldcpp_horde_chat.errors import BackendError

    body = b'{"value": 5, "results": [], "choices": [], "pad": "' + b"x" * 40 + b'"}'
    url, done = trickling_server(
        b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n", body, every_s=0.1
    )
    client = KoboldClient(url, connect_timeout_s=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(BackendError, match="in time"):
            if call == "tokencount":
                client.tokencount("hello", timeout_s=1.0)
            elif call == "chat_completion":
                client.chat_completion({"messages": []}, timeout_s=1.0)
            else:
                client.generate({"prompt": "x"}, timeout_s=1.0)
        # Bytes kept arriving within the read timeout; the whole call still ended on time.
        assert time.monotonic() - started < 2.5
    finally:
        done.set()
