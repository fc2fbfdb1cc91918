"""The pop loop's decisions, with in-process fakes of the Horde and koboldcpp.

Error classes by status and rc (seed "7. Fault a job", "Submit refusals"),
maintenance avoidance, guarantee withdrawal, and "every popped job ends in one
terminal action" even when something unexpected breaks.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from bench.harness.fakes import (
    FakeBackend,
    FakeClock,
    FakeHorde,
    FakeStopEvent,
    FakeStream,
    backend_error,
)
from koboldcpp_horde_chat.errors import BackendError, HordeRefusal, HordeUnavailable
from koboldcpp_horde_chat.koboldcpp.api import BackendInfo
from koboldcpp_horde_chat.koboldcpp.manners import StandaloneManners
from koboldcpp_horde_chat.service.gate import MAINTENANCE_POLL_S
from koboldcpp_horde_chat.service.loop import Worker
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.guard import FailureStreak
from koboldcpp_horde_chat.state.shared import WorkerState
from tests import pops

KEY = "unit-key-5f2e9c"
MODEL = "koboldcpp/fake"


def make(
    pops: list[Any],
    *,
    submit_script: tuple[str, ...] = (),
    backend: FakeBackend | None = None,
    **settings: Any,
) -> tuple[Worker, FakeHorde, FakeBackend, FakeClock]:
    clock = FakeClock()
    horde = FakeHorde(clock, pops=pops, submit_script=submit_script)
    backend = backend or FakeBackend()
    options: dict[str, Any] = {"max_length": 512}
    options.update(settings)
    worker_settings = WorkerSettings(
        api_key=KEY,
        worker_name="unit-worker",
        model_id=MODEL,
        backend_max_context_length=4096,
        **options,
    )
    worker = Worker(
        worker_settings,
        horde=horde,
        backend=backend,
        state=WorkerState(worker_settings, stop_event=FakeStopEvent(clock), clock=clock),
    )
    return worker, horde, backend, clock


def chat_pop(job_id: str, **payload: Any) -> dict[str, Any]:
    """A chat job of a request of its own: its messages name the job (a payload
    faulted twice that comes back is another matter: tests/unit/test_refaults.py)."""
    payload.setdefault("messages", [{"role": "user", "content": f"Name one colour. ({job_id})"}])
    return pops.chat_pop(job_id, MODEL, **payload)


def text_pop(job_id: str) -> dict[str, Any]:
    """A text job of a request of its own (its prompt names the job)."""
    return pops.text_pop(job_id, MODEL, prompt=f"Once ({job_id})")


def run(worker: Worker, passes: int) -> None:
    for _ in range(passes):
        if worker.stop_event.is_set():
            break
        worker.run_once()


def log_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


# --- error classes on pop --------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "rc"),
    [(401, "InvalidAPIKey"), (401, ""), (403, "WrongCredentials"), (403, "InvalidAPIKey")],
)
def test_a_refused_key_says_check_your_api_key_once_and_stops_with_code_3(
    status: int, rc: str, caplog: pytest.LogCaptureFixture
) -> None:
    refusal = HordeRefusal("No user matching sent API Key.", status=status, rc=rc)
    worker, horde, _, _ = make([refusal, refusal, chat_pop("j1")])
    caplog.set_level(logging.DEBUG)
    assert worker.run() == 3
    assert horde.pop_calls == 1  # stopped popping at once
    assert log_text(caplog).count("check your API key") == 1
    assert not horde.jobs


def test_maintenance_is_logged_with_the_hordes_message_and_polled_slowly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    maintenance = HordeRefusal(
        "Worker is in maintenance: too many aborted jobs", status=403, rc="WorkerMaintenance"
    )
    worker, horde, _, clock = make([maintenance, maintenance, chat_pop("j1")])
    caplog.set_level(logging.INFO)
    start = clock()
    run(worker, 2)
    assert clock() - start >= 2 * MAINTENANCE_POLL_S
    assert not worker.stop_event.is_set() and worker.state.exit_code == 0
    text = log_text(caplog)
    assert "Worker is in maintenance: too many aborted jobs" in text
    assert "API key" not in text
    run(worker, 1)
    assert horde.verdicts() == {"j1": "submitted"}


@pytest.mark.parametrize(
    "error",
    [
        HordeUnavailable("pop: HTTP 502", status=502),
        HordeUnavailable("pop: HTTP 503", status=503, rc="ServiceUnavailable"),
        HordeUnavailable("pop: HTTP 429", status=429, retry_after_s=None),
        HordeUnavailable("pop: could not connect", status=0, sent=False),
        HordeUnavailable("pop: TLS failure; REQUESTS_CA_BUNDLE", status=0, sent=None),
    ],
)
def test_server_and_network_errors_back_off_with_jitter_and_never_blame_the_key(
    error: HordeUnavailable, caplog: pytest.LogCaptureFixture
) -> None:
    worker, horde, _, clock = make([error] * 8 + [chat_pop("j1")])
    caplog.set_level(logging.DEBUG)
    waits = []
    for _ in range(8):
        before = clock()
        worker.run_once()
        waits.append(clock() - before)
    assert waits == sorted(waits) or len(set(waits)) > 1  # grows, and is not one fixed value
    assert len({round(w, 6) for w in waits}) == len(waits)  # jitter: no two waits equal
    assert 0.5 <= waits[0] <= 1.0 and waits[-1] > 20.0
    assert max(waits) <= 60.0
    text = log_text(caplog)
    assert "API key" not in text and worker.state.exit_code == 0
    run(worker, 1)
    assert horde.verdicts() == {"j1": "submitted"}
    # A success resets the schedule.
    assert worker._error_backoff.attempts == 0


def test_a_429_waits_at_least_its_retry_after() -> None:
    limited = HordeUnavailable("pop: HTTP 429", status=429, retry_after_s=37.0)
    worker, _, _, clock = make([limited])
    before = clock()
    worker.run_once()
    assert clock() - before >= 37.0


# --- error classes on submit -----------------------------------------------------------


@pytest.mark.parametrize(("outcome", "counted"), [("not_found", 0), ("AbortedGen", 1)])
def test_a_job_the_horde_ended_is_dropped_without_counting_as_a_fault(
    outcome: str, counted: int
) -> None:
    """Dropped, not faulted; an ``AbortedGen`` (the Horde ended the job first: its
    lease ran out) is an aborted job on the Horde, so the guard counts it."""
    worker, horde, _, clock = make([chat_pop("j1")], submit_script=(outcome,))
    run(worker, 1)
    assert horde.verdicts() == {"j1": "ended"}
    assert horde.jobs["j1"].attempts == 1  # dropped: no retry, no fault submit
    assert worker.state.stats.faults == 0
    assert worker.state.maintenance_guard.recent(clock()) == counted


def test_a_key_refused_at_submit_stops_the_worker(caplog: pytest.LogCaptureFixture) -> None:
    worker, horde, backend, _ = make([chat_pop("j1"), chat_pop("j2")])

    def refuse(body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        raise HordeRefusal("No user matching sent API Key.", status=401, rc="InvalidAPIKey")

    horde.submit = refuse  # type: ignore[method-assign]
    caplog.set_level(logging.INFO)
    run(worker, 3)
    assert worker.state.exit_code == 3 and worker.stop_event.is_set()
    assert horde.pop_calls == 1
    assert log_text(caplog).count("check your API key") == 1


@pytest.mark.parametrize(
    ("outcome", "reason"),
    [
        ("ChatSubmitInvalid", "reply_refused"),
        ("ChatModelMismatch", "reply_refused"),
        ("ChatSubmitNonconformant", "reply_refused"),
        ("bad_request", None),
    ],
)
def test_a_refused_reply_is_faulted_once_and_never_resent(
    outcome: str, reason: str | None
) -> None:
    worker, horde, _, _ = make([chat_pop("j1")], submit_script=(outcome,))
    run(worker, 1)
    job = horde.jobs["j1"]
    assert horde.verdicts() == {"j1": "faulted"}
    assert [b.get("state") for b in job.bodies] == ["ok", "faulted"]
    assert job.bodies[1].get("fault_reason") == reason
    assert job.late_submits == 0


def test_a_refused_text_reply_is_faulted_rather_than_left_to_expire() -> None:
    worker, horde, _, _ = make([text_pop("t1")], submit_script=("bad_request",))
    run(worker, 1)
    assert horde.verdicts() == {"t1": "faulted"}
    assert horde.jobs["t1"].bodies[-1] == {"id": "t1", "generation": "", "state": "faulted"}


@pytest.mark.parametrize("outcome", ["lost_before", "unavailable", "rate_limited"])
def test_a_submit_not_answered_is_retried_with_the_same_body(outcome: str) -> None:
    worker, horde, _, _ = make([chat_pop("j1")], submit_script=(outcome, outcome))
    run(worker, 1)
    job = horde.jobs["j1"]
    assert horde.verdicts() == {"j1": "submitted"}
    assert len(job.bodies) == 3 and job.bodies[0] == job.bodies[1] == job.bodies[2]


def test_a_lost_submit_answer_is_retried_and_the_duplicate_is_not_a_second_submit() -> None:
    worker, horde, _, _ = make([chat_pop("j1")], submit_script=("lost_after",))
    run(worker, 1)
    job = horde.jobs["j1"]
    assert horde.verdicts() == {"j1": "submitted"}
    assert job.accepted == 1 and job.attempts == 2


def test_a_submit_that_never_gets_through_gives_up_when_the_lease_is_over() -> None:
    worker, horde, _, clock = make([chat_pop("j1")], submit_script=("unavailable",) * 500)
    run(worker, 1)
    job = horde.jobs["j1"]
    assert horde.verdicts() == {"j1": "expired"}
    assert job.attempts < 60  # paced, not hammered
    assert clock() - job.popped_at < job.ttl_s + 30


def test_an_absurd_reward_is_not_a_crash() -> None:
    worker, horde, _, _ = make([chat_pop("j1")], submit_script=("garbage_reward",))
    assert worker.run_once() is True
    assert horde.verdicts() == {"j1": "submitted"}
    assert worker.state.stats.kudos == 0.0


# --- every popped job gets an answer ---------------------------------------------------


def test_an_unexpected_error_while_serving_faults_the_job_instead_of_leaving_it() -> None:
    backend = FakeBackend()
    backend.tokencounts.append(RuntimeError("a bug"))
    worker, horde, _, _ = make([chat_pop("j1")], backend=backend)
    assert worker.run_once() is True
    assert horde.verdicts() == {"j1": "faulted"}


def test_an_unexpected_error_in_the_submit_itself_still_faults_the_job() -> None:
    worker, horde, _, _ = make([chat_pop("j1")])
    real_submit = horde.submit
    calls: list[dict[str, Any]] = []

    def submit(body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        calls.append(body)
        if len(calls) == 1:
            raise RuntimeError("a bug after the claim")
        return real_submit(body, timeout_s=timeout_s)

    horde.submit = submit  # type: ignore[method-assign]
    assert worker.run_once() is True
    assert [body.get("state") for body in calls] == ["ok", "faulted"]
    assert horde.verdicts() == {"j1": "faulted"}


def test_a_ttl_too_large_for_a_float_is_answered() -> None:
    pop = chat_pop("j1")
    pop["ttl"] = 10**400
    worker, horde, _, _ = make([pop])
    worker.run_once()
    assert horde.verdicts()["j1"] in ("submitted", "faulted")


def test_a_huge_ttl_does_not_stretch_backend_timeouts_past_the_lease_cap() -> None:
    pop = chat_pop("j1")
    pop["ttl"] = 1e9
    worker, horde, backend, _ = make([pop])
    worker.run_once()
    assert horde.verdicts() == {"j1": "submitted"}
    assert backend.last_timeout_s["chat"] <= worker.settings.lease_cap_s
    assert backend.last_timeout_s["tokencount"] <= 60.0


def test_a_malformed_text_job_is_faulted_as_a_text_job() -> None:
    pop = text_pop("t1")
    pop["payload"] = "not an object"
    pop["chat"] = "yes"  # not true: a text job by the seed's rule
    worker, horde, _, _ = make([pop])
    worker.run_once()
    assert horde.jobs["t1"].bodies == [{"id": "t1", "generation": "", "state": "faulted"}]


# --- maintenance avoidance -------------------------------------------------------------


def failing_backend(n: int) -> FakeBackend:
    backend = FakeBackend()
    backend.chats.extend({"choices": []} for _ in range(n))  # a reply that cannot be read
    return backend


def test_chat_is_withdrawn_before_the_hordes_twenty_faults_and_restored_after_a_quiet_hour(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pops = [chat_pop(f"j{i}") for i in range(15)]
    worker, horde, _, clock = make(pops, backend=failing_backend(15))
    # The Horde's count alone: three chat failures in a row would withdraw chat
    # first (guard.FailureStreak; test_guard_recovery.py).
    worker.state.failure_streak = FailureStreak(limit=100)
    caplog.set_level(logging.INFO)
    run(worker, 15)
    assert [horde.verdict(j) for j in horde.jobs.values()] == ["faulted"] * 15
    assert all(b.get("chat_jobs") is True for b in horde.pop_bodies)
    worker.run_once()  # the 16th pop: no declaration, text jobs only
    last = horde.pop_bodies[-1]
    assert "chat_jobs" not in last and "chat_features" not in last
    assert last["max_length"] == 512 and last["models"] == [MODEL]
    withdrawals = [r for r in caplog.records if "withdrawing the chat declaration" in r.getMessage()]
    assert len(withdrawals) == 1 and withdrawals[0].getMessage().startswith(
        "aborted 15 in the Horde's hour (maintenance above 20), chat jobs among them: "
        "withdrawing the chat declaration (text jobs continue) until fewer than 10 remain"
    )
    clock.advance(3660.0)  # the Horde's hour and the guard's minute beyond it
    worker.run_once()
    assert horde.pop_bodies[-1].get("chat_jobs") is True
    assert "aborted 0 in the Horde's hour (maintenance above 20): declaring chat again" in (
        log_text(caplog)
    )


def test_nineteen_aborted_text_jobs_stop_the_popping_until_the_hordes_hour_allows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker, horde, _, clock = make([text_pop("t1"), chat_pop("c1")])
    caplog.set_level(logging.INFO)
    first = clock()
    for i in range(19):
        worker.state.record_fault(first + i, kind="text")
    clock.advance(19.0)
    run(worker, 3)
    assert horde.pop_calls == 0
    stops = [r.getMessage() for r in caplog.records if "not popping, to stay out" in r.getMessage()]
    assert len(stops) == 1, stops  # said once, not once a pass
    assert stops[0].startswith(
        "worker 1: aborted 19 in the Horde's hour (maintenance above 20): not popping"
    )
    # The first leaves the Horde's hour and a minute 3641 s from now.
    assert stops[0].endswith("(in 61 min) unless more are counted")
    # Text faults alone never withdraw chat: chat fails nowhere.
    assert "withdrawing the chat declaration" not in log_text(caplog)
    clock.advance(first + 3660.0 - clock())  # the first leaves the Horde's hour and a minute
    run(worker, 1)
    assert horde.pop_calls == 1
    assert horde.pop_bodies[-1].get("chat_jobs") is True
    assert "the Horde's hour allows another aborted job: popping again" in log_text(caplog)


def test_a_chat_only_worker_pauses_pops_while_chat_is_withdrawn() -> None:
    pops = [chat_pop(f"j{i}") for i in range(15)]
    worker, horde, _, clock = make(pops, backend=failing_backend(15), prompt_jobs=False)
    worker.state.failure_streak = FailureStreak(limit=100)  # the Horde's count alone
    run(worker, 15)
    calls = horde.pop_calls
    before = clock()
    worker.run_once()
    assert horde.pop_calls == calls  # no pop without the declaration
    assert clock() - before >= MAINTENANCE_POLL_S


def test_faults_after_nonconformant_refusals_do_not_count_toward_maintenance() -> None:
    pops = [chat_pop(f"j{i}") for i in range(20)]
    worker, horde, _, clock = make(pops, submit_script=("ChatSubmitNonconformant", "ok") * 20)
    run(worker, 20)
    assert all(horde.verdict(j) == "faulted" for j in horde.jobs.values())
    assert worker.state.maintenance_guard.recent(clock()) == 0
    assert all(b.get("chat_jobs") is True for b in horde.pop_bodies)


# --- guarantee and feature withdrawal --------------------------------------------------


def schema_pop(job_id: str) -> dict[str, Any]:
    return chat_pop(
        job_id,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object"}},
        },
    )


def test_three_nonconformant_refusals_withdraw_the_feature_the_requests_used(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pops = [schema_pop("s1"), schema_pop("s2"), chat_pop("plain", tools=[]), schema_pop("s3")]
    script = ("ChatSubmitNonconformant", "ok") * 2 + ("ok",) + ("ChatSubmitNonconformant", "ok")
    worker, horde, _, _ = make(pops, submit_script=script)
    caplog.set_level(logging.INFO)
    run(worker, 5)
    features = [b["chat_features"] for b in horde.pop_bodies]
    assert all("json_schema" in f for f in features[:4])
    assert "json_schema" not in features[4]
    assert "json_object" in features[4] and "tools" in features[4]
    lines = [r.getMessage() for r in caplog.records if "withdrawing 'json_schema'" in r.getMessage()]
    assert len(lines) == 1
    assert "from the chat declaration until " in lines[0]
    assert lines[0].endswith("(for 60 min): 3 of its replies within an hour were refused by "
                             "the Horde or unusable; chat without it goes on")
    # Each refused reply was faulted with reply_refused, never resubmitted.
    for job_id in ("s1", "s2", "s3"):
        bodies = horde.jobs[job_id].bodies
        assert [b["state"] for b in bodies] == ["ok", "faulted"]
        assert bodies[1]["fault_reason"] == "reply_refused"


def test_a_withdrawn_feature_comes_back_after_its_cool_off_and_operator_withholds_stay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pops = [chat_pop(f"t{i}", tools=[], tool_choice="required") for i in range(3)]
    script = ("ChatSubmitNonconformant", "ok") * 3
    worker, horde, _, clock = make(
        pops, submit_script=script, chat_withhold=frozenset({"seed"})
    )
    caplog.set_level(logging.INFO)
    run(worker, 3)
    clock.advance(3000.0)
    run(worker, 1)
    during = horde.pop_bodies[-1]["chat_features"]
    assert "tools" not in during and "seed" not in during
    assert "json_schema" in during
    clock.advance(700.0)  # the hour's cool-off ended
    run(worker, 1)
    after = horde.pop_bodies[-1]["chat_features"]
    assert "tools" in after and "seed" not in after
    assert "declaring 'tools' again: its cool-off after refused replies ended" in caplog.text



def test_tool_calls_without_a_name_withdraw_tools_alone_not_chat(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model whose tool calls the worker cannot use (no function name) fails
    the tools feature, not koboldcpp nor chat: at the third, tools is withdrawn
    for its cool-off; chat stays declared and no failure streak withdraws it."""
    nameless = {
        "choices": [{
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"arguments": "{}"}}
            ]},
        }],
        "usage": {"prompt_tokens": 5, "completion_tokens": 5},
    }
    backend = FakeBackend()
    backend.chats.extend(dict(nameless) for _ in range(3))
    pops = [chat_pop(f"t{i}", tools=[{"type": "function", "function": {"name": "w"}}])
            for i in range(3)]
    worker, horde, _, _ = make(pops, backend=backend)
    caplog.set_level(logging.INFO)
    run(worker, 4)
    assert [horde.verdict(horde.jobs[f"t{i}"]) for i in range(3)] == ["faulted"] * 3
    last = horde.pop_bodies[-1]
    assert last["chat_jobs"] is True and "tools" not in last["chat_features"]
    assert not worker.state.failure_streak.kind_failing("chat")
    assert worker.state.maintenance_guard.chat_recent(worker.state.clock.monotonic()) == 0
    assert "withdrawing 'tools' from the chat declaration until" in caplog.text

def test_refusals_of_other_kinds_withdraw_nothing() -> None:
    pops = [schema_pop(f"s{i}") for i in range(4)]
    worker, horde, _, _ = make(pops, submit_script=("ChatSubmitInvalid", "ok") * 4)
    run(worker, 5)
    assert "json_schema" in horde.pop_bodies[-1]["chat_features"]


# --- bounded -----------------------------------------------------------------------------


def test_a_payload_with_a_huge_number_of_keys_makes_short_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pop = chat_pop("j1")
    pop["payload"].update({f"extra_key_{i}": 0 for i in range(100_000)})
    worker, horde, _, _ = make([pop])
    caplog.set_level(logging.INFO, logger="koboldcpp_horde_chat")
    worker.run_once()
    assert horde.verdicts() == {"j1": "submitted"}
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("koboldcpp_horde_chat.")]
    assert lines and max(len(line) for line in lines) < 2000


def test_an_abort_after_a_timeout_is_quick_enough_to_leave_room_for_the_fault() -> None:
    from koboldcpp_horde_chat.errors import BackendError

    backend = FakeBackend()
    backend.chats.append(BackendError("timed out", status=0))
    worker, horde, backend, _ = make([chat_pop("j1")], backend=backend)
    worker.run_once()
    assert horde.verdicts() == {"j1": "faulted"}
    assert backend.last_timeout_s["abort"] <= 2.0


# --- koboldcpp's --maxrequestsize ---------------------------------------------------------


class SizeRecordingBackend(FakeBackend):
    """Records the size of every chat body, as sent (the worker sends it encoded)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def chat_completion(
        self,
        body: dict[str, Any] | bytes | bytearray,
        *,
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> Any:
        self.sizes.append(len(body))
        return super().chat_completion(body, timeout_s=timeout_s)

    def open_chat_stream(
        self,
        body: dict[str, Any] | bytes | bytearray,
        *,
        read_timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> FakeStream:
        self.sizes.append(len(body))
        return super().open_chat_stream(body, read_timeout_s=read_timeout_s)


LONG_TEXT = "Describe this at length. " * 400  # 10,000 characters, about 2,500 tokens


@pytest.mark.parametrize("streamed", [False, True])
def test_a_chat_request_over_koboldcpps_maxrequestsize_is_faulted_without_sending_it(
    streamed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """koboldcpp answers a body over --maxrequestsize with 500 "Payload is too big"
    (koboldcpp 1.116.1 koboldcpp.py L6422-6431): the worker faults the job at once, without a fault_reason."""
    extra = {"stream_progress": True} if streamed else {}
    pop = chat_pop(
        "j1", messages=[{"role": "user", "content": LONG_TEXT}], max_context_length=4096, **extra
    )
    caplog.set_level(logging.INFO, logger="koboldcpp_horde_chat")
    worker, horde, backend, _ = make([pop], kcpp_max_request_bytes=8 * 1024)
    worker.run_once()
    assert horde.verdicts() == {"j1": "faulted"}
    assert horde.jobs["j1"].bodies == [{"id": "j1", "state": "faulted", "model_id": MODEL}]
    assert "chat" not in backend.calls and "stream" not in backend.calls
    assert "abort" not in backend.calls
    line = next(r.getMessage() for r in caplog.records if "faulted" in r.getMessage())
    assert "--maxrequestsize of 8192 bytes" in line and "job=j1" in line


def test_a_chat_request_of_exactly_koboldcpps_limit_is_sent() -> None:
    """koboldcpp refuses only a Content-Length above the limit."""
    pop = chat_pop("j1", messages=[{"role": "user", "content": LONG_TEXT}], max_context_length=4096)
    probe = SizeRecordingBackend()
    worker, _, _, _ = make([pop], backend=probe)
    worker.run_once()
    size = probe.sizes[0]
    assert size > 10_000

    exact = SizeRecordingBackend()
    worker, horde, _, _ = make([pop], backend=exact, kcpp_max_request_bytes=size)
    worker.run_once()
    assert horde.verdicts() == {"j1": "submitted"} and exact.sizes == [size]

    over = SizeRecordingBackend()
    worker, horde, _, _ = make([pop], backend=over, kcpp_max_request_bytes=size - 1)
    worker.run_once()
    assert horde.verdicts() == {"j1": "faulted"} and over.sizes == []


def test_the_default_limit_is_koboldcpps_default_of_32_mb() -> None:
    settings = WorkerSettings(api_key=KEY, worker_name="w", model_id=MODEL, backend_max_context_length=4096)
    assert settings.kcpp_max_request_bytes == 32 * 1024 * 1024


# --- StandaloneManners: koboldcpp's /api/extra/perf ---------------------------------------


class PerfBackend:
    """koboldcpp's /api/extra/perf as a script: each read takes the next answer (the
    last one repeats); ``reads`` counts the GETs."""

    def __init__(self, *answers: dict[str, Any] | Exception) -> None:
        self.answers = list(answers)
        self.reads = 0

    def perf(self, *, timeout_s: float = 10.0) -> dict[str, Any]:
        self.reads += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)

    def info(self, *, timeout_s: float = 10.0) -> BackendInfo:
        raise AssertionError("info() is read only for a worker started with an identity")


IDLE = {"idle": 1, "queue": 0, "idletime": 100.0}
BUSY = {"idle": 0, "queue": 0, "idletime": 0.0}


def standalone(backend: PerfBackend) -> tuple[StandaloneManners, FakeClock]:
    clock = FakeClock()
    return StandaloneManners(backend, clock=clock), clock


def test_an_idle_koboldcpp_is_asked_for_perf_at_most_once_a_second() -> None:
    backend = PerfBackend(IDLE)
    manners, clock = standalone(backend)
    for _ in range(5):  # five pops in a second, as jobs follow each other
        assert manners.last_local_request_time() is None
        assert manners.model_busy() is False
        clock.advance(0.19)
    assert backend.reads == 1
    clock.advance(0.1)  # a second after the read
    manners.last_local_request_time()
    assert backend.reads == 2


def test_after_a_busy_answer_perf_is_read_on_every_call() -> None:
    backend = PerfBackend(BUSY)
    manners, clock = standalone(backend)
    for _ in range(3):
        manners.last_local_request_time()
        assert manners.model_busy() is True
        clock.advance(0.2)
    assert backend.reads == 3


def test_a_failed_perf_read_is_not_kept() -> None:
    from koboldcpp_horde_chat.errors import BackendError

    backend = PerfBackend(BackendError("connection refused"), IDLE)
    manners, _clock = standalone(backend)
    assert manners.last_local_request_time() is None
    assert manners.last_local_request_time() is None
    assert backend.reads == 2


def test_perf_figures_that_are_no_finite_number_are_read_as_missing() -> None:
    """JSON carries integers of any size and Python's json writes Infinity: such an
    ``uptime`` or ``idletime`` is no figure to act on, and no crash."""
    backend = PerfBackend({"idle": 1, "queue": 0, "idletime": 10**400, "uptime": float("inf")})
    manners, _clock = standalone(backend)
    assert manners.last_local_request_time() is None
    assert manners.model_busy() is False


def test_a_local_user_is_noticed_at_most_a_second_late() -> None:
    """koboldcpp reports idletime 100 s at first; then a local user sends a request."""
    backend = PerfBackend(IDLE)
    manners, clock = standalone(backend)
    assert manners.last_local_request_time() is None  # the baseline: nobody since start
    clock.advance(0.5)
    user_at = clock()
    backend.answers = [{"idle": 0, "queue": 0, "idletime": 0.5}]  # read 0.5 s later
    assert manners.last_local_request_time() is None  # the idle answer is reused
    assert manners.model_busy() is False
    clock.advance(0.5)  # one second after the last read
    assert manners.last_local_request_time() == user_at
    assert manners.model_busy() is True
    assert backend.reads == 2


def test_the_workers_own_request_after_a_cached_answer_is_not_a_local_user() -> None:
    backend = PerfBackend(IDLE)
    manners, clock = standalone(backend)
    manners.last_local_request_time()
    clock.advance(0.3)
    manners.note_own_request()  # the worker's generation, koboldcpp idle again after it
    backend.answers = [{"idle": 1, "queue": 0, "idletime": 0.2}]
    clock.advance(0.8)
    assert manners.last_local_request_time() is None
    assert backend.reads == 2


def test_a_restarted_koboldcpps_start_is_not_taken_for_a_local_user() -> None:
    """koboldcpp counts its own start as the last request; after a restart that
    must not pause the worker for 20 s as if a local user had come."""
    down = BackendError("GET /api/extra/perf connection failed (refused)")
    backend = PerfBackend(
        {"idle": 1, "queue": 0, "idletime": 50.0, "uptime": 50.0},
        down,
        {"idle": 1, "queue": 0, "idletime": 2.0, "uptime": 2.0},
    )
    manners, clock = standalone(backend)
    assert manners.last_local_request_time() is None
    clock.advance(1.5)
    assert manners.last_local_request_time() is None  # koboldcpp went away
    clock.advance(1.5)
    assert manners.last_local_request_time() is None  # and came back: not a local user


def test_a_restart_seen_only_as_a_lower_uptime_is_not_a_local_user_either() -> None:
    backend = PerfBackend(
        {"idle": 1, "queue": 0, "idletime": 50.0, "uptime": 50.0},
        {"idle": 1, "queue": 0, "idletime": 1.0, "uptime": 1.0},
    )
    manners, clock = standalone(backend)
    assert manners.last_local_request_time() is None
    clock.advance(5.0)
    assert manners.last_local_request_time() is None


def test_a_local_request_after_the_worker_started_is_still_a_local_user() -> None:
    backend = PerfBackend(
        {"idle": 1, "queue": 0, "idletime": 50.0, "uptime": 50.0},
        {"idle": 1, "queue": 0, "idletime": 0.5, "uptime": 55.0},
    )
    manners, clock = standalone(backend)
    assert manners.last_local_request_time() is None
    clock.advance(5.0)
    assert manners.last_local_request_time() == clock() - 0.5


def test_a_request_of_the_worker_that_waited_for_koboldcpps_lock_is_not_a_local_user() -> None:
    """With two loops, one request waits for the other's to end; koboldcpp notes its
    time only when it takes the lock, later than it was sent."""
    backend = PerfBackend(
        {"idle": 1, "queue": 0, "idletime": 50.0, "uptime": 50.0},
        {"idle": 0, "queue": 0, "idletime": 0.0, "uptime": 55.0},  # noted while in flight
        {"idle": 1, "queue": 0, "idletime": 2.5, "uptime": 60.0},  # after it ended
        {"idle": 1, "queue": 0, "idletime": 0.5, "uptime": 63.0},  # someone else, later
    )
    manners, clock = standalone(backend)
    assert manners.last_local_request_time() is None
    manners.note_own_request()  # sent, waits for the lock
    clock.advance(5.0)
    assert manners.last_local_request_time() is None
    clock.advance(2.0)
    manners.note_own_request_done()
    clock.advance(3.0)
    assert manners.last_local_request_time() is None  # koboldcpp's stamp is the worker's own
    clock.advance(3.0)
    assert manners.last_local_request_time() == clock() - 0.5


def test_a_local_request_queued_behind_the_workers_own_is_a_local_user_when_seen() -> None:
    """koboldcpp stamps a queued request when it takes the lock, just after the
    worker's own: its stamp looks like the worker's, its queue and lock do not."""
    start = {"idle": 1, "queue": 0, "idletime": 50.0, "uptime": 50.0}
    backend = PerfBackend(start)
    manners, clock = standalone(backend)
    assert manners.last_local_request_time() is None
    manners.note_own_request()
    backend.answers = [{"idle": 0, "queue": 1, "idletime": 3.0, "uptime": 53.0}]
    clock.advance(3.0)
    assert manners.last_local_request_time() is None  # the worker's own is in flight
    manners.note_own_request_done()
    assert manners.last_local_request_time() == clock()  # someone waits: not the worker
    seen = clock()
    backend.answers = [{"idle": 1, "queue": 0, "idletime": 4.9, "uptime": 58.0}]
    clock.advance(5.0)  # they took the lock 0.1 s after the worker's end, now done
    assert manners.last_local_request_time() == seen


def test_koboldcpp_busy_with_a_request_that_took_the_lock_after_the_workers_is_a_local_user() -> None:
    backend = PerfBackend({"idle": 1, "queue": 0, "idletime": 50.0, "uptime": 50.0})
    manners, clock = standalone(backend)
    manners.last_local_request_time()
    started = clock()
    manners.note_own_request()  # takes the lock at once: koboldcpp stamps it now
    clock.advance(2.0)
    manners.note_own_request_done()
    # still busy 3 s on with the worker's own request (an abort that lands late):
    # the lock holder's stamp is from before the worker's request ended
    backend.answers = [{"idle": 0, "queue": 0, "idletime": 5.0, "uptime": 55.0}]
    clock.advance(3.0)
    assert clock() - 5.0 == started
    assert manners.last_local_request_time() is None
    # someone else took the lock 0.05 s after the worker's request ended
    backend.answers = [{"idle": 0, "queue": 0, "idletime": 2.95, "uptime": 55.0}]
    assert manners.last_local_request_time() == clock()


def test_a_local_request_handed_the_lock_before_the_worker_noted_its_end_is_a_local_user() -> None:
    """koboldcpp hands its lock to a queued request as it answers the worker; a
    worker slow to read that answer (a loaded machine) notes its own end after
    koboldcpp stamped the next request. Busy past koboldcpp's short hold after
    answering, koboldcpp serves someone else: a local user to yield to."""
    backend = PerfBackend({"idle": 1, "queue": 0, "idletime": 50.0, "uptime": 50.0})
    manners, clock = standalone(backend)
    manners.last_local_request_time()
    manners.note_own_request()
    clock.advance(3.0)  # the worker's generation ends; the queued local user takes the lock
    clock.advance(0.3)  # the worker reads koboldcpp's answer 0.3 s later
    manners.note_own_request_done()
    clock.advance(0.1)
    backend.answers = [{"idle": 0, "queue": 0, "idletime": 0.4, "uptime": 53.4}]
    assert manners.last_local_request_time() is None  # within koboldcpp's hold after answering
    clock.advance(0.6)
    backend.answers = [{"idle": 0, "queue": 0, "idletime": 1.0, "uptime": 54.0}]
    assert manners.last_local_request_time() == clock()


def test_a_perf_read_without_answer_marks_koboldcpp_unreachable_until_one_answers() -> None:
    from koboldcpp_horde_chat.errors import BackendError

    backend = PerfBackend(BackendError("connection refused"), IDLE)
    manners, _clock = standalone(backend)
    manners.last_local_request_time()
    assert manners.unreachable is True
    manners.last_local_request_time()
    assert manners.unreachable is False


class InfoPerfBackend(PerfBackend):
    """PerfBackend that also answers ``info()`` from a script."""

    def __init__(self, infos: list[BackendInfo], *answers: dict[str, Any] | Exception) -> None:
        super().__init__(*answers)
        self.infos = infos

    def info(self, *, timeout_s: float = 10.0) -> BackendInfo:
        return self.infos.pop(0)


def test_a_koboldcpp_restarted_with_another_model_stops_the_loops() -> None:
    from koboldcpp_horde_chat.koboldcpp.api import BackendInfo
    from koboldcpp_horde_chat.koboldcpp.manners import BackendIdentity, StandaloneManners

    def info(name: str, ctx: int) -> BackendInfo:
        return BackendInfo(model_name=name, max_context_length=ctx, vision=False,
                           version="1.116.1")

    down = BackendError("GET /api/extra/perf connection failed (refused)")
    backend = InfoPerfBackend(
        [info("koboldcpp/Small", 2048), info("koboldcpp/Big-70B", 1024)],
        {"idle": 1, "queue": 0, "idletime": 50.0, "uptime": 50.0},
        down,
        {"idle": 1, "queue": 0, "idletime": 1.0, "uptime": 1.0},  # back, same model
        down,
        {"idle": 1, "queue": 0, "idletime": 1.0, "uptime": 1.0},  # back, another model
    )
    clock = FakeClock()
    manners = StandaloneManners(
        backend, clock=clock,
        identity=BackendIdentity("koboldcpp/Small", 2048, False, version="1.116.1"),
    )
    for _ in range(3):
        manners.last_local_request_time()
        clock.advance(1.5)
    assert manners.changed is None and manners.should_stop() is False
    for _ in range(2):
        manners.last_local_request_time()
        clock.advance(1.5)
    assert manners.should_stop() is True
    assert manners.changed == (
        "koboldcpp restarted with koboldcpp/Big-70B (context 1024) "
        "(it served koboldcpp/Small (context 2048))"
    )


def test_a_stop_sequence_sent_as_one_string_is_held_back_from_progress_posts_too() -> None:
    """``stop_sequence`` as a bare string (the worker accepts it) ends the content
    posted as progress as it ends the submitted reply."""
    from bench.harness.fakes import sse_chunks

    backend = FakeBackend()
    backend.streams.append(sse_chunks("Blue sky.\nuser: and more words after it"))
    worker, horde, _, _ = make(
        [chat_pop("s1", stream_progress=True, stop_sequence="\nuser:")], backend=backend
    )
    worker.run_once()
    posted = "".join(b["delta"].get("content", "") for b in horde.progress_bodies)
    assert "user:" not in posted
    (submitted,) = horde.jobs["s1"].bodies
    assert submitted["message"]["content"] == "Blue sky."


def test_a_failed_generation_is_named_alike_for_chat_and_text_jobs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One fault line for one cause, whichever kind of job koboldcpp failed."""
    backend = FakeBackend()
    backend.chats.append(backend_error("server_error"))
    backend.generates.append(backend_error("server_error"))
    worker, horde, _, _ = make([chat_pop("c1"), text_pop("t1")], backend=backend)
    caplog.set_level(logging.INFO)
    run(worker, 2)
    assert horde.verdicts() == {"c1": "faulted", "t1": "faulted"}
    faults = [r.getMessage() for r in caplog.records if " faulted: " in r.getMessage()]
    assert len(faults) == 2, faults
    assert all("faulted: generation failed: HTTP 500" in line for line in faults), faults
