"""The pop loop's manners and words, with in-process fakes of the Horde and koboldcpp.

The overlap of a submit with the next pop, the quick re-check of a koboldcpp
finishing the worker's own request, the Horde's messages to the owner, refusals
named by their rc, empty pops' skipped counts and the periodic totals line.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import pytest

from bench.harness.fakes import FakeBackend, FakeClock, FakeHorde, FakeManners, FakeStopEvent
from koboldcpp_horde_chat.errors import HordeRefusal
from koboldcpp_horde_chat.service.gate import MAINTENANCE_POLL_S, OWN_TAIL_POLL_S
from koboldcpp_horde_chat.service.loop import Worker
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.shared import WorkerState
from koboldcpp_horde_chat.state.status import SUMMARY_EVERY_S
from tests.unit.test_loop_decisions import KEY, MODEL, chat_pop, text_pop


class Manners(FakeManners):
    """Local-use signals as a script: ``busy`` answers in turn (then False)."""

    def __init__(self, busy: list[bool] | None = None) -> None:
        self.busy = list(busy or [])
        self.busy_checks = 0

    def model_busy(self) -> bool:
        self.busy_checks += 1
        return self.busy.pop(0) if self.busy else False


def build(
    pops: list[Any],
    *,
    overlap: bool = False,
    manners: Manners | None = None,
    horde: FakeHorde | None = None,
    clock: FakeClock | None = None,
) -> tuple[Worker, FakeHorde, FakeClock, FakeStopEvent]:
    clock = clock or FakeClock()
    horde = horde or FakeHorde(clock, pops=pops)
    stop = FakeStopEvent(clock)
    settings = WorkerSettings(
        api_key=KEY, worker_name="loop-worker", model_id=MODEL, backend_max_context_length=4096
    )
    worker = Worker(
        settings,
        horde=horde,
        backend=FakeBackend(),
        manners=manners or Manners(),
        state=WorkerState(settings, stop_event=stop, clock=clock),
        pop_horde=horde if overlap else None,
    )
    return worker, horde, clock, stop


def messages_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("koboldcpp_horde_chat")]


# --- the submit overlaps the next pop ---------------------------------------------------------


def popped(horde: FakeHorde, n: int) -> None:
    """Wait (up to 2 s) until the pop sent beside a submit went out: a stop that
    comes before it means no pop (the loop is stopping), not a job to serve."""
    deadline = time.monotonic() + 2.0
    while horde.pop_calls < n:
        assert time.monotonic() < deadline, f"{horde.pop_calls} pops"
        time.sleep(0.005)


class OrderedHorde(FakeHorde):
    """Records the order of calls. The k-th submit waits (up to ``overlap_wait_s``,
    2 s) for the (k+1)-th pop: it comes at once when the loop sent the next pop
    beside the submit, never when the loop pops only after the submit."""

    def __init__(self, clock: FakeClock, pops: list[Any], *, overlap_wait_s: float = 2.0) -> None:
        super().__init__(clock, pops=pops)
        self.overlap_wait_s = overlap_wait_s
        self.calls: list[str] = []
        self._changed = threading.Condition()
        self._pops = 0
        self._submits = 0

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        with self._changed:
            self._pops += 1
            self.calls.append("pop")
            self._changed.notify_all()
        return super().pop(body, timeout_s=timeout_s)

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        with self._changed:
            self._submits += 1
            wanted = self._submits + 1
            overlapped = self._changed.wait_for(
                lambda: self._pops >= wanted, timeout=self.overlap_wait_s
            )
            self.calls.append(
                f"submit {body['id']}" + (" (after the next pop went out)" if overlapped else "")
            )
        return super().submit(body, timeout_s=timeout_s)


def test_the_next_pop_goes_out_while_the_job_is_submitted_and_every_job_ends_once() -> None:
    clock = FakeClock()
    horde = OrderedHorde(clock, [chat_pop("j1"), text_pop("t2"), chat_pop("j3")])
    worker, _, _, stop = build([], overlap=True, horde=horde, clock=clock)
    for _ in range(3):
        assert worker.run_once() is True
    stop.set()
    worker.drain()
    assert horde.verdicts() == {"j1": "submitted", "t2": "submitted", "j3": "submitted"}
    assert horde.calls[:4] == [
        "pop",
        "pop",
        "submit j1 (after the next pop went out)",
        "pop",
    ]
    assert "submit t2 (after the next pop went out)" in horde.calls


def test_without_a_second_horde_client_each_submit_ends_before_the_next_pop() -> None:
    clock = FakeClock()
    # a pop sent beside the submit would come within milliseconds: wait 0.5 s for it
    horde = OrderedHorde(clock, [chat_pop("j1"), chat_pop("j2")], overlap_wait_s=0.5)
    worker, _, _, _ = build([], horde=horde, clock=clock)
    worker.run_once()
    worker.run_once()
    assert horde.calls[0:2] == ["pop", "submit j1"]


def test_a_job_popped_while_the_loop_stops_is_still_served() -> None:
    worker, horde, _, stop = build([chat_pop("j1"), chat_pop("j2")], overlap=True)
    worker.run_once()  # serves j1; j2 is popped meanwhile
    popped(horde, 2)
    stop.set()
    worker.drain()
    assert horde.verdicts() == {"j1": "submitted", "j2": "submitted"}
    assert horde.pop_calls == 2



class HeldCheck(Manners):
    """From the first pop on, each busy check waits (up to 2 s) for ``until`` and
    records in ``checks`` whether it came."""

    def __init__(self, until: threading.Event) -> None:
        super().__init__()
        self.until = until
        self.armed = False
        self.checks: list[bool] = []

    def model_busy(self) -> bool:
        if self.armed:
            self.checks.append(self.until.wait(2.0))
        return False


class ArmingHorde(FakeHorde):
    """Arms ``manners`` at its first pop; sets ``submitted`` at each submit."""

    def __init__(
        self,
        clock: FakeClock,
        pops: list[Any],
        manners: HeldCheck,
        submitted: threading.Event | None = None,
    ) -> None:
        super().__init__(clock, pops=pops)
        self.manners = manners
        self.submitted = submitted or threading.Event()

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.manners.armed = True
        return super().pop(body, timeout_s=timeout_s)

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.submitted.set()
        return super().submit(body, timeout_s=timeout_s)


def test_the_submit_does_not_wait_for_the_check_of_koboldcpp_before_the_next_pop() -> None:
    """Whether to pop again is asked of koboldcpp (its perf, a round trip) beside the submit."""
    submitted = threading.Event()
    manners = HeldCheck(until=submitted)
    clock = FakeClock()
    horde = ArmingHorde(clock, [chat_pop("j1"), chat_pop("j2")], manners, submitted)
    worker, _, _, stop = build([], overlap=True, horde=horde, clock=clock, manners=manners)
    assert worker.run_once() is True
    popped(horde, 2)
    stop.set()
    worker.drain()
    assert manners.checks and manners.checks[0] is True  # answered after the submit went out
    assert horde.verdicts() == {"j1": "submitted", "j2": "submitted"}


def test_a_stop_that_comes_while_the_next_pop_is_prepared_sends_no_pop() -> None:
    release = threading.Event()  # koboldcpp's perf answers after the stop
    manners = HeldCheck(until=release)
    clock = FakeClock()
    horde = ArmingHorde(clock, [chat_pop("j1"), chat_pop("j2")], manners)
    worker, _, _, stop = build([], overlap=True, horde=horde, clock=clock, manners=manners)
    assert worker.run_once() is True
    stop.set()
    release.set()
    worker.drain()
    assert horde.pop_calls == 1
    assert horde.verdicts() == {"j1": "submitted"}

# --- koboldcpp finishing the worker's own request ---------------------------------------------


def test_after_its_own_job_the_worker_rechecks_a_busy_koboldcpp_every_10_ms() -> None:
    manners = Manners()
    worker, horde, clock, stop = build([chat_pop("j1")], manners=manners)
    worker.run_once()
    manners.busy = [True, True, True]  # koboldcpp still holds its lock for a moment
    waited_before = stop.waited
    for _ in range(3):
        assert worker.run_once() is False
    assert stop.waited - waited_before == pytest.approx(3 * OWN_TAIL_POLL_S)


class QueueManners(Manners):
    """Manners that also say whether requests wait for koboldcpp's model lock."""

    def __init__(self, busy: list[bool] | None = None, queued: bool = False) -> None:
        super().__init__(busy)
        self.queued = queued

    def requests_queued(self) -> bool:
        return self.queued


def test_the_tail_of_its_own_request_does_not_hold_the_next_pop_when_nobody_waits() -> None:
    """koboldcpp keeps its model lock 50 ms after answering; nobody queued: pop at once."""
    manners = QueueManners()
    worker, horde, clock, stop = build([chat_pop("j1"), chat_pop("j2")], manners=manners)
    worker.run_once()
    manners.busy = [True, True, True]
    waited_before = stop.waited
    assert worker.run_once() is True  # popped and served j2 without waiting
    assert stop.waited == waited_before
    assert horde.verdicts() == {"j1": "submitted", "j2": "submitted"}


def test_a_request_queued_behind_its_own_is_let_through_first() -> None:
    manners = QueueManners(queued=True)
    worker, horde, clock, stop = build([chat_pop("j1"), chat_pop("j2")], manners=manners)
    worker.run_once()
    manners.busy = [True, True]
    assert worker.run_once() is False
    assert worker.run_once() is False
    assert horde.pop_calls == 1


def test_someone_elses_long_generation_is_checked_every_0_2_s_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    manners = Manners([True] * 30)
    worker, horde, clock, stop = build([], manners=manners)
    for _ in range(30):
        assert worker.run_once() is False
    assert stop.waited == pytest.approx(30 * 0.2)
    lines = [m for m in messages_logged(caplog) if "busy" in m]
    assert lines == [
        "worker 1: koboldcpp is busy with another client's request: not popping until it is free"
    ]
    worker.run_once()  # free again: pops
    assert "worker 1: koboldcpp is free: popping again" in messages_logged(caplog)


# --- the Horde's words ------------------------------------------------------------------------


def test_each_moderator_message_is_logged_once_however_many_pops_carry_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    note = {"id": "m-1", "message": "Your worker name is odd.", "origin": "AI Horde Moderators"}
    empty: dict[str, Any] = {"id": None, "ids": [], "skipped": {}, "messages": [note]}
    job = chat_pop("j1")
    job["messages"] = [note]
    worker, horde, _, _ = build([empty, job, empty, dict(empty, messages=[note, {"id": "m-2", "message": "Thanks."}])])
    for _ in range(4):
        worker.run_once()
    said = [m for m in messages_logged(caplog) if "message from the Horde" in m]
    assert said == [
        "worker 1: message from the Horde (origin AI Horde Moderators): Your worker name is odd.",
        "worker 1: message from the Horde: Thanks.",
    ]
    assert horde.verdicts() == {"j1": "submitted"}


def test_too_many_workers_is_named_by_its_rc_and_retried_a_minute_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    refusal = HordeRefusal(
        "To avoid abuse, untrusted users can only have up to 3 distinct workers.",
        status=403,
        rc="TooManyWorkers",
    )
    worker, horde, clock, stop = build([refusal, refusal, chat_pop("j1")])
    for _ in range(3):
        worker.run_once()
    lines = messages_logged(caplog)
    refused = [m for m in lines if "TooManyWorkers" in m]
    assert len(refused) == 1
    assert "keep --hordeworkername the same across runs" in refused[0]
    assert not any("maintenance" in m for m in lines)
    assert stop.waited >= 2 * MAINTENANCE_POLL_S
    assert horde.verdicts() == {"j1": "submitted"}
    assert worker.state.exit_code == 0
    assert "worker 1: the Horde takes pops again: popping" in lines


def test_a_pop_refusal_retried_with_backoff_is_said_once_then_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refusal without an owner's action (an unknown rc) is retried with the
    backoff: one WARNING when it starts, the retries at DEBUG, one line when pops
    are answered again."""
    caplog.set_level(logging.DEBUG)
    refusal = HordeRefusal("I am a teapot.", status=418, rc="Teapot")
    worker, horde, _, _ = build([refusal] * 5 + [chat_pop("j1")])
    for _ in range(6):
        worker.run_once()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "418 Teapot" in warnings[0], warnings
    assert warnings[0].endswith("trying again, up to a minute apart")
    assert "worker 1: the Horde takes pops again: popping" in messages_logged(caplog)
    assert horde.verdicts() == {"j1": "submitted"}


def test_a_horde_outage_at_the_pop_is_said_once_then_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    worker, horde, _, _ = build(["lost", "unavailable", "lost", "rate_limited", chat_pop("j1")])
    for _ in range(5):
        worker.run_once()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "does not answer" in warnings[0], warnings
    assert "worker 1: the Horde answers again: popping" in messages_logged(caplog)
    assert horde.verdicts() == {"j1": "submitted"}


def test_empty_pops_say_what_was_skipped_once_while_it_stays_the_same(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    empty: dict[str, Any] = {"id": None, "ids": [], "skipped": {"untrusted": 2}, "messages": []}
    worker, _, _, _ = build([empty] * 40)
    for _ in range(40):
        worker.run_once()  # 1 s, then 2 s, then 3 s between empty pops: 85 s in all
    said = [m for m in messages_logged(caplog) if "skipped" in m]
    assert said == ["worker 1: no job for this worker: 2 requests skipped: untrusted=2"]


def test_a_totals_line_comes_every_ten_minutes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    worker, horde, clock, _ = build([chat_pop("j1")])
    worker.run_once()
    clock.advance(SUMMARY_EVERY_S + 1)
    worker.run_once()
    worker.run_once()
    lines = [m for m in messages_logged(caplog) if "uptime" in m]
    assert len(lines) == 1
    assert lines[0].startswith("worker 1: 1 jobs, 12 kudos (") and "0 faults" in lines[0]


def test_a_horde_that_does_not_answer_is_said_once_not_at_every_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    worker, horde, _, _ = build(["unavailable", "lost", "unavailable", "rate_limited", chat_pop("j1")])
    for _ in range(5):
        worker.run_once()
    lines = messages_logged(caplog)
    down = [m for m in lines if "does not answer" in m]
    assert down == [
        "worker 1: the Horde at https://aihorde.net does not answer: trying again, up to a "
        "minute apart (pop: HTTP 502 (status=502))"
    ]
    assert "worker 1: the Horde answers again: popping" in lines
    assert horde.verdicts() == {"j1": "submitted"}


# --- a koboldcpp that stopped answering --------------------------------------------------------


class DownBackend(FakeBackend):
    """koboldcpp that does not answer its readiness GET."""

    def ready(self, *, timeout_s: float = 10.0) -> bool:
        return False


@pytest.mark.parametrize(("probe_s", "wait_s"), [(None, 3.0), (0.5, 0.5)])
def test_a_koboldcpp_that_failed_a_job_and_does_not_answer_is_probed_every_3_s(
    probe_s: float | None, wait_s: float
) -> None:
    """No pop while it is down: the loop waits 3 s (``backend_probe_s``) between probes."""
    clock = FakeClock()
    settings = WorkerSettings(
        api_key=KEY, worker_name="loop-worker", model_id=MODEL, backend_max_context_length=4096
    )
    if probe_s is not None:
        settings = dataclasses.replace(settings, backend_probe_s=probe_s)
    worker = Worker(
        settings,
        horde=FakeHorde(clock, pops=[chat_pop("j1")]),
        backend=DownBackend(),
        state=WorkerState(settings, stop_event=FakeStopEvent(clock), clock=clock),
    )
    worker.gate.backend_suspect = True
    assert worker.gate.pause() == ("backend_down", wait_s)


class ChangedManners(FakeManners):
    """koboldcpp came back serving another context: a fresh read says so, and from
    then on the manners say stop (as the standalone host's do)."""

    changed: str | None = None

    def recheck(self) -> str | None:
        self.changed = "koboldcpp restarted with koboldcpp/fake (context 1024)"
        return self.changed

    def should_stop(self) -> bool:
        return self.changed is not None


def test_a_koboldcpp_that_answers_again_with_another_context_is_not_popped_for() -> None:
    """Back after failing, koboldcpp is read again before the next pop: serving
    something else, it is not popped for under the old declaration."""
    clock = FakeClock()
    horde = FakeHorde(clock, pops=[chat_pop("j1")])
    settings = WorkerSettings(
        api_key=KEY, worker_name="loop-worker", model_id=MODEL, backend_max_context_length=4096
    )
    worker = Worker(
        settings,
        horde=horde,
        backend=FakeBackend(),
        manners=ChangedManners(),
        state=WorkerState(settings, stop_event=FakeStopEvent(clock), clock=clock),
    )
    worker.gate.backend_suspect = True
    worker.run_once()
    assert horde.pop_calls == 0


def test_every_job_says_the_totals_and_rates_from_the_first_job_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As koboldcpp's own worker prints after every submit: total kudos, time,
    jobs, kudos per hour, jobs per hour and kudos per job (the fake Horde pays
    12.5 kudos a job); the stop line gives the uptime."""
    caplog.set_level(logging.INFO)
    worker, horde, clock, stop = build([chat_pop(f"j{i}") for i in range(1, 6)])
    for _ in range(5):
        clock.advance(60.0)
        worker.run_once()
    lines = [m.split(" | ", 1)[1] for m in messages_logged(caplog) if " submitted: " in m]
    assert lines == [
        f"[Total:{total} kudos, Time:000h:0{n}m:00s, Jobs:{n}, EarnRate:750.00 kudos/hr, "
        f"JobRate:60.00 jobs/hr, JobCost:12.50 kudos/job] Faults:0"
        for n, total in ((1, 12), (2, 25), (3, 38), (4, 50), (5, 62))
    ]


class _StopAfterOnePop(Manners):
    horde: FakeHorde

    def should_stop(self) -> bool:
        return self.horde.pop_calls >= 1


def test_the_stop_line_gives_the_uptime_and_the_totals(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    manners = _StopAfterOnePop()
    worker, horde, clock, _ = build([chat_pop("j1")], manners=manners)
    manners.horde = horde
    clock.advance(90.0)
    assert worker.run() == 0
    assert messages_logged(caplog)[-1] == (
        "worker 1: stopped ([Total:12 kudos, Time:000h:01m:30s, Jobs:1, EarnRate:500.00 "
        "kudos/hr, JobRate:40.00 jobs/hr, JobCost:12.50 kudos/job] Faults:0)"
    )


def test_chat_and_text_jobs_both_report_their_length_in_koboldcpps_tokens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    worker, _, _, _ = build([chat_pop("c1"), text_pop("t1")])
    worker.run_once()
    worker.run_once()
    records = [r for r in caplog.records if r.name.startswith("koboldcpp_horde_chat")]
    submitted = [r.getMessage() for r in records if " submitted: " in r.getMessage()]
    assert submitted[0].startswith("job=c1 kind=chat submitted: finish=stop tokens=3 calls=0, ")
    assert submitted[1].startswith("job=t1 kind=text submitted: tokens=5, ")
    assert not [m for m in submitted if "chars" in m]
    # The payload's keys are for debugging: at DEBUG, not on the job's INFO line.
    received = [r for r in records if "kind=chat received:" in r.getMessage()]
    assert [r.levelno for r in received] == [logging.INFO]
    assert "keys" not in received[0].getMessage()
    keys = [r for r in records if r.getMessage().startswith("job=c1 payload keys: ")]
    assert [r.levelno for r in keys] == [logging.DEBUG]


def test_the_first_chat_job_is_said_once_as_the_start_line_promised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    worker, _, _, _ = build([text_pop("t1"), chat_pop("c1"), chat_pop("c2")])
    for _ in range(3):
        worker.run_once()
    said = [m for m in messages_logged(caplog) if "the Horde sends chat jobs" in m]
    assert said == ["worker 1: the Horde sends chat jobs: serving chat jobs and text jobs"]
    lines = messages_logged(caplog)
    assert lines.index(said[0]) < next(i for i, m in enumerate(lines) if m.startswith("job=c1"))


def test_a_pop_during_a_generation_held_back_by_a_due_remeasure_leaves_it_for_the_gate() -> None:
    """The pop sent during a generation never goes while a re-measure of koboldcpp
    is due; holding back must not use the re-measure up, or the gate would never
    send it and the lowered limits would stay a whole cool-off longer."""
    from koboldcpp_horde_chat.state.lease_fit import RECHECK_AFTER_S

    worker, _, clock, _ = build([])
    fit = worker.state.lease_fit
    fit.ran_out("text", max_length=100, seconds=150.0, now=clock.monotonic())
    clock.advance(RECHECK_AFTER_S)
    assert worker.next_pop.prepare((threading.Event(), 0.0)) is None
    assert fit.recheck_due(clock.monotonic()) == ["text"]
