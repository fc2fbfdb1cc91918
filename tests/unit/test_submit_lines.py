"""The lines an operator reads when a submit fails: what the next start will do
with the job (as the journal says, not a guess), and one line per outage, not
one per retry, with the job's id once.

The submit pipeline runs against a Horde stand-in that fails the way the real
client does (its errors carry the job id), on a fake clock.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from bench.harness.fakes import FakeClock
from koboldcpp_horde_chat.errors import HordeUnavailable, JobFault
from koboldcpp_horde_chat.horde.pop import Lease
from koboldcpp_horde_chat.run.submit import SubmitPipeline
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.job import JobContext
from koboldcpp_horde_chat.state.journal import Journal, JournalEntry
from koboldcpp_horde_chat.state.journal_rules import (
    REPLY_STATES,
    TERMINAL_STATES,
    next_start_plan,
)
from koboldcpp_horde_chat.state.life import Move
from koboldcpp_horde_chat.state.shared import WorkerState

MODEL = "koboldcpp/fake"
JOB = "31f5c0de-0000-4000-8000-00000000a11e"
REFUSED = "POST /api/v2/generate/text/submit: could not connect to 127.0.0.1:7011 (refused)"


def settings() -> WorkerSettings:
    return WorkerSettings(
        api_key="unit-key-5f2e9c", worker_name="lines-worker", model_id=MODEL,
        backend_max_context_length=4096, max_length=512,
    )


class OutageHorde:
    """A Horde whose submits fail ``failures`` times, as the real client raises
    them (the job id in the error), then are accepted."""

    def __init__(self, failures: int, *, sent: bool | None = False, status: int = 0) -> None:
        self.failures = failures
        self.sent = sent
        self.status = status
        self.bodies: list[dict[str, Any]] = []

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.bodies.append(body)
        if len(self.bodies) <= self.failures:
            raise HordeUnavailable(REFUSED, status=self.status, job_id=body["id"], sent=self.sent)
        return {"reward": 12.5}


class ClockPauses:
    """The pipeline's pauses (``StopSignal.pause``) move the fake clock."""

    def __init__(self, clock: FakeClock) -> None:
        self.pause = clock.advance


def pipeline(
    horde: OutageHorde, clock: FakeClock, journal: Journal | None
) -> tuple[SubmitPipeline, WorkerState]:
    state = WorkerState(settings(), journal=journal, clock=clock)
    return SubmitPipeline(settings(), horde, state, stop=ClockPauses(clock)), state  # type: ignore[arg-type]


def job_in_hand(state: WorkerState, clock: FakeClock, lease_s: float = 150.0) -> JobContext:
    ctx = JobContext(id=JOB, kind="chat", lease=Lease(clock(), clock() + lease_s),
                     started=clock(), model_id=MODEL)
    if state.journal is not None:
        state.journal.add(JournalEntry(JOB, "chat", MODEL, "", clock() + lease_s))
    state.hold(ctx)
    ctx.move(Move.JOURNAL)
    return ctx


def reply_body() -> dict[str, Any]:
    return {"id": JOB, "state": "ok", "model_id": MODEL,
            "chat_completion": {"role": "assistant", "content": "Blue."}}


def job_lines(caplog: pytest.LogCaptureFixture, level: int | None = None) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if f"job={JOB}" in r.getMessage() and (level is None or r.levelno == level)
    ]


# --- what the next start does, from the journal ------------------------------------------


def test_each_terminal_state_names_what_the_next_start_does() -> None:
    plans = {state: next_start_plan(state) for state in sorted(TERMINAL_STATES)}
    assert plans == {
        "none": "left to the next start, which faults it while its lease runs",
        "reply_kept": "left to the next start, which sends the reply again",
        "reply_sent": "left to the next start, which sends the reply again",
        "fault_sent": "a fault may have reached the Horde; none is sent again",
    }
    assert next_start_plan(None) == (
        "not in a journal: nothing is sent; its lease runs out on the Horde"
    )
    with pytest.raises(ValueError):
        next_start_plan("answered")


@pytest.mark.parametrize(("sent", "status"), [
    (False, 0),  # refused: the reply never reached the Horde
    (None, 0),  # no answer: it may have
    (True, 503),
])
def test_a_reply_given_up_at_the_stop_says_the_next_start_sends_it_again(
    sent: bool | None, status: int, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    journal = Journal(tmp_path / "jobs.json")
    sender, state = pipeline(OutageHorde(99, sent=sent, status=status), clock, journal)
    ctx = job_in_hand(state, clock)
    ctx.abandoned.set()  # the stop's deadline came
    with caplog.at_level(logging.DEBUG, logger="koboldcpp_horde_chat"):
        sender.reply(ctx, reply_body(), detail="stop, 2 tokens")
    (entry,) = journal.load()
    assert entry.terminal in REPLY_STATES and entry.reply == reply_body()
    (line,) = job_lines(caplog, logging.ERROR)
    assert line == (
        f"job={JOB} submit failed ({REFUSED}{f' (status={status})' if status else ''}) and the "
        "worker is stopping: left to the next start, which sends the reply again"
    )
    assert "faults it" not in " ".join(job_lines(caplog))


def test_a_fault_given_up_at_the_stop_says_the_next_start_faults_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    journal = Journal(tmp_path / "jobs.json")
    sender, state = pipeline(OutageHorde(99, sent=False), clock, journal)
    ctx = job_in_hand(state, clock)
    ctx.abandoned.set()
    with caplog.at_level(logging.DEBUG, logger="koboldcpp_horde_chat"):
        sender.fault(ctx, JobFault("koboldcpp failed"))
    assert journal.load()[0].terminal == "none"
    (line,) = job_lines(caplog, logging.ERROR)
    assert line.endswith(
        "and the worker is stopping: left to the next start, which faults it while its lease runs"
    )


@pytest.mark.parametrize(("sent", "plan"), [
    (None, "a fault may have reached the Horde; none is sent again"),
    (False, "left to the next start, which faults it while its lease runs"),
])
def test_a_fault_at_exit_that_failed_says_what_the_journal_leaves(
    sent: bool | None, plan: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    journal = Journal(tmp_path / "jobs.json")
    sender, state = pipeline(OutageHorde(99, sent=sent), clock, journal)
    ctx = job_in_hand(state, clock)
    with caplog.at_level(logging.DEBUG, logger="koboldcpp_horde_chat"):
        sender.fault_now(ctx)
    (line,) = job_lines(caplog, logging.WARNING)
    assert line == (
        f"job={JOB} fault failed ({REFUSED}) and the worker is exiting now: {plan}"
    )


def test_without_a_journal_the_stop_line_promises_no_next_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    sender, state = pipeline(OutageHorde(99), clock, None)
    ctx = job_in_hand(state, clock)
    ctx.abandoned.set()
    with caplog.at_level(logging.DEBUG, logger="koboldcpp_horde_chat"):
        sender.reply(ctx, reply_body(), detail="stop, 2 tokens")
    (line,) = job_lines(caplog, logging.ERROR)
    assert line.endswith(
        "the worker is stopping: not in a journal: nothing is sent; its lease runs out on the Horde"
    )


# --- an outage: one line when it starts, one when it ends -----------------------------------


def test_a_submit_through_an_outage_logs_one_warning_and_one_line_when_it_gets_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    horde = OutageHorde(4)
    sender, state = pipeline(horde, clock, None)
    ctx = job_in_hand(state, clock)
    with caplog.at_level(logging.DEBUG, logger="koboldcpp_horde_chat"):
        sender.reply(ctx, reply_body(), detail="stop, 2 tokens")
    assert len(horde.bodies) == 5
    warnings = job_lines(caplog, logging.WARNING)
    assert warnings == [
        f"job={JOB} submit failed ({REFUSED}); retrying while its lease runs (150 s left)"
    ]
    assert len(job_lines(caplog, logging.DEBUG)) == 3  # the retries, for a debug log
    (done,) = job_lines(caplog, logging.INFO)
    assert done.startswith(f"job={JOB} kind=chat submitted: stop, 2 tokens, ")
    assert ", at attempt 5, 12.50 kudos" in done
    assert all(line.count(JOB) == 1 for line in job_lines(caplog))


def test_a_submit_given_up_at_the_leases_end_logs_one_warning_then_one_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    horde = OutageHorde(99)
    sender, state = pipeline(horde, clock, None)
    ctx = job_in_hand(state, clock, lease_s=20.0)
    with caplog.at_level(logging.DEBUG, logger="koboldcpp_horde_chat"):
        sender.reply(ctx, reply_body(), detail="stop, 2 tokens")
    assert len(horde.bodies) > 3
    assert len(job_lines(caplog, logging.WARNING)) == 1
    (given_up,) = job_lines(caplog, logging.ERROR)
    assert given_up == (
        f"job={JOB} submit failed ({REFUSED}), the lease is over; dropped after "
        f"{len(horde.bodies)} attempts"
    )
    assert job_lines(caplog, logging.INFO) == []
    assert all(line.count(JOB) == 1 for line in job_lines(caplog))


def test_an_error_names_its_job_once_in_a_line_that_names_the_job() -> None:
    exc = HordeUnavailable("submit: HTTP 503", status=503, rc="", job_id=JOB)
    assert str(exc) == f"submit: HTTP 503 (status=503, job={JOB})"
    assert exc.reason == "submit: HTTP 503 (status=503)"
    assert HordeUnavailable(REFUSED, job_id=JOB, sent=False).reason == REFUSED
