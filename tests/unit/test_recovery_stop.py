"""A stop during the start-up recovery: its pauses and attempts end by the stop's
deadline, and what the Horde has not answered stays in the journal for the next start.

On the real Horde a fault re-opens the request (``wp.n += 1``) whether or not
the job still runs, and a kept reply sent again costs nothing (``DuplicateGen``):
so each pending job gets one last attempt by the deadline, none after it, and a
fault whose answer a stop cut is never sent again. Seed sections: "7. Fault a
job", "Check the completed reply".
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from koboldcpp_horde_chat.errors import HordeUnavailable
from koboldcpp_horde_chat.inflight import STOP_SUBMIT_EXTRA_S, CallDeadlines, stop_call_ends
from koboldcpp_horde_chat.service.recovery import (
    STOP_LAST_ATTEMPT_LEAD_S,
    Recovery,
    RecoveryResult,
    recover,
)
from koboldcpp_horde_chat.state.journal import Journal
from tests.unit.test_clock import StepClock
from tests.unit.test_journal import (
    NOW,
    Pauses,
    RecordingBackend,
    ScriptedHorde,
    Wall,
    _fixed_clock_mark,  # noqa: F401  (autouse: the journal's clocks read NOW)
    chat_entry,
    journal_with,
)

REPLY = {"id": "job-r", "message": {"role": "assistant", "content": "Blue."}, "state": "ok"}
UNAVAILABLE = HordeUnavailable("submit: HTTP 503", status=503, retry_after_s=20.0, sent=True)


class StopAfter:
    """The worker is told to stop (deadline ``grace_s`` later) during submit number ``n``."""

    def __init__(self, wall: Wall, n: int, grace_s: float) -> None:
        self.wall, self.n, self.grace_s = wall, n, grace_s
        self.deadline: float | None = None

    def note_submit(self, count: int) -> None:
        if count == self.n and self.deadline is None:
            self.deadline = self.wall.now + self.grace_s


class StoppingHorde(ScriptedHorde):
    def __init__(self, stop: StopAfter, *script: Any) -> None:
        super().__init__(*script)
        self.stop = stop
        self.sent_at: list[float] = []

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.sent_at.append(self.stop.wall.now)
        self.stop.note_submit(len(self.sent_at))
        return super().submit(body, timeout_s=timeout_s)


class StopPauses(Pauses):
    """Pauses on the wall clock, and the stop that ``stop`` makes."""

    def __init__(self, stop: StopAfter) -> None:
        super().__init__(stop.wall)
        self.stop = stop

    def last_attempt_at(self) -> float | None:
        return self.stop.deadline  # set when the stop comes


def run(path: Path, horde: StoppingHorde) -> tuple[RecoveryResult, Pauses]:
    pauses = StopPauses(horde.stop)
    result = recover(
        Journal(path), horde=horde, backend=RecordingBackend(), clock=horde.stop.wall,
        model_id_default="koboldcpp/default", stop=pauses,  # type: ignore[arg-type]
    )
    return result, pauses


def kept_reply_entry(**over: Any) -> Any:
    return chat_entry("job-r", terminal="reply_sent", reply=REPLY, **over)


def test_a_stop_cuts_a_kept_replys_retry_pause_to_its_last_attempt_before_the_deadline(
    tmp_path: Path,
) -> None:
    """503 with Retry-After 20 s, then a stop with 3 s of grace: the reply goes
    again before the deadline (not 20 s later, not never) and is accepted."""
    path = journal_with(tmp_path, kept_reply_entry())
    stop = StopAfter(Wall(), 1, 3.0)
    horde = StoppingHorde(stop, UNAVAILABLE, {"reward": 12})
    result, pauses = run(path, horde)
    assert result == RecoveryResult(replied=1, kudos=12.0)
    assert horde.bodies == [REPLY, REPLY]
    assert horde.sent_at == [NOW, NOW + 3.0 - STOP_LAST_ATTEMPT_LEAD_S]
    assert Journal(path).load() == []


def test_what_the_horde_has_not_answered_by_the_deadline_stays_in_the_journal(
    tmp_path: Path,
) -> None:
    """The Horde answers 503 to everything: each job gets one last attempt by the
    deadline, none after it, and the journal keeps each as it was (the reply to
    send again, the job still without a terminal action: the next start faults
    it while its lease surely runs)."""
    path = journal_with(tmp_path, kept_reply_entry(), chat_entry("job-f"))
    stop = StopAfter(Wall(), 1, 4.0)
    horde = StoppingHorde(stop, *[UNAVAILABLE] * 10)
    result, _ = run(path, horde)
    assert result == RecoveryResult(kept=2)
    deadline = NOW + 4.0
    assert all(at <= deadline for at in horde.sent_at)
    # the first round (the stop came during the reply's submit), then one last attempt each
    assert [b["id"] for b in horde.bodies] == ["job-r", "job-f", "job-r", "job-f"]
    left = {e.job_id: e for e in Journal(path).load()}
    assert left["job-r"].terminal == "reply_sent" and left["job-r"].reply == REPLY
    assert left["job-f"].terminal == "none"


def test_a_fault_whose_answer_a_stop_cut_stays_journaled_as_sent_and_goes_no_more(
    tmp_path: Path,
) -> None:
    """The fault was on the wire at the deadline and hung up: the Horde may have
    taken it, so the journal says so and the next start sends nothing more."""
    path = journal_with(tmp_path, chat_entry("job-f"))
    stop = StopAfter(Wall(), 1, 2.0)
    cut = HordeUnavailable("submit: no answer by the worker's stop deadline", status=0, sent=None)
    horde = StoppingHorde(stop, cut, {"reward": 0})
    result, _ = run(path, horde)
    assert result == RecoveryResult(kept=1)
    assert len(horde.bodies) == 1
    (entry,) = Journal(path).load()
    assert entry.terminal == "fault_sent"


def test_no_attempt_starts_after_the_deadline(tmp_path: Path) -> None:
    path = journal_with(tmp_path, kept_reply_entry(), chat_entry("job-f"))
    wall = Wall()
    stop = StopAfter(wall, 0, 0.0)
    stop.deadline = NOW - 0.1  # the stop's deadline has passed at start
    horde = StoppingHorde(stop)
    result, _ = run(path, horde)
    assert result == RecoveryResult(kept=2)
    assert horde.bodies == []
    assert len(Journal(path).load()) == 2


class BlockingHorde:
    """A Horde whose every submit waits to be hung up or for ``release`` (a slow Horde)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.calls += 1
        self.release.wait(timeout_s)
        raise HordeUnavailable("submit: no answer in time", status=0, sent=None)


def test_finish_makes_the_stop_and_waits_at_most_to_the_submits_deadline(tmp_path: Path) -> None:
    """A host that exits during the recovery: ``finish`` sets the stop's deadline
    and returns once the recovery ended, within the grace and the submit's ``STOP_SUBMIT_EXTRA_S``."""
    journal = Journal(journal_with(tmp_path, kept_reply_entry(lease_end=time.time() + 150)))
    journal.lock()
    horde = BlockingHorde()
    deadlines = CallDeadlines()
    stop_event = threading.Event()
    recovery = Recovery(
        journal, horde_factory=lambda: horde, backend_factory=None,
        model_id_default="koboldcpp/default", stop_event=stop_event, deadlines=deadlines,
    )
    time.sleep(0.2)
    started = time.monotonic()
    # the in-flight call is cut at the submit deadline, as the Horde client does
    timer = threading.Timer(0.5 + STOP_SUBMIT_EXTRA_S, horde.release.set)
    timer.start()
    try:
        assert recovery.finish(0.5)
    finally:
        timer.cancel()
        journal.unlock()
    assert time.monotonic() - started < 0.5 + 2.0
    assert stop_event.is_set() and deadlines.ends_at("stop") is not None
    assert recovery.result is not None and recovery.result.kept == 1
    assert [e.job_id for e in Journal(journal.path).load()] == ["job-r"]


def test_stop_call_ends_gives_every_kind_its_deadline() -> None:
    ends = stop_call_ends(100.0)
    assert ends == {"stop": 100.0, "progress": 100.0, "pop": 100.5, "kcpp": 100.5, "submit": 101.0}


def wait_until(check: Any, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= end:
            return False
        time.sleep(0.01)
    return True


def test_the_recoverys_pauses_and_waits_run_on_the_clock_it_is_given(tmp_path: Path) -> None:
    """A 503 with Retry-After 20 s: the thread's retry comes when the given clock
    has moved 20 s, not before (whatever the real time), and ``wait`` times out
    on that clock too."""
    journal = Journal(journal_with(tmp_path, kept_reply_entry()))
    journal.lock()
    clock = StepClock()
    clock.wall = NOW
    horde = ScriptedHorde(UNAVAILABLE, {"reward": 12})
    recovery = Recovery(
        journal, horde_factory=lambda: horde, backend_factory=None,
        model_id_default="koboldcpp/default", stop_event=threading.Event(), clock=clock,
    )
    try:
        assert wait_until(lambda: len(horde.bodies) == 1)
        outcome: list[bool] = []
        waiter = threading.Thread(target=lambda: outcome.append(recovery.wait(timeout_s=5.0)))
        waiter.start()
        time.sleep(0.5)  # more than the pause's slices: the clock has not moved
        assert len(horde.bodies) == 1 and recovery.result is None
        clock.advance(5.0)  # the wait's 5 s have passed on the recovery's clock
        waiter.join(2.0)
        assert outcome == [False] and len(horde.bodies) == 1
        clock.advance(15.0)  # the Retry-After's 20 s
        assert recovery.wait(timeout_s=5.0)
    finally:
        journal.unlock()
    assert horde.bodies == [REPLY, REPLY]
    assert recovery.result == RecoveryResult(replied=1, kudos=12.0)


def test_finish_sets_the_stops_deadline_on_the_recoverys_clock(tmp_path: Path) -> None:
    """A stop during a pause ends it at once (the clock need not move): the
    reply's last attempt comes by the deadline ``finish`` set on the given clock."""
    journal = Journal(journal_with(tmp_path, kept_reply_entry()))
    journal.lock()
    clock = StepClock()
    clock.wall = NOW
    deadlines = CallDeadlines(clock)
    horde = ScriptedHorde(UNAVAILABLE, {"reward": 12})
    recovery = Recovery(
        journal, horde_factory=lambda: horde, backend_factory=None,
        model_id_default="koboldcpp/default", stop_event=threading.Event(),
        deadlines=deadlines, clock=clock,
    )
    try:
        assert wait_until(lambda: len(horde.bodies) == 1)
        finishing = threading.Thread(target=recovery.finish, args=(3.0,))
        finishing.start()
        assert wait_until(lambda: deadlines.ends_at("stop") is not None)
        assert deadlines.ends_at("stop") == clock.now + 3.0
        time.sleep(0.3)
        assert len(horde.bodies) == 1  # the last attempt waits for its time on the clock
        clock.advance(3.0 - STOP_LAST_ATTEMPT_LEAD_S)
        finishing.join(5.0)
        assert not finishing.is_alive()
    finally:
        journal.unlock()
    assert horde.bodies == [REPLY, REPLY]
    assert recovery.result == RecoveryResult(replied=1, kudos=12.0)


def test_a_kept_reply_accepted_with_a_reward_too_large_for_a_float_counts_no_kudos(
    tmp_path: Path,
) -> None:
    """JSON carries integers of any size; a reward beyond a float's range is not a
    number of kudos, and the recovery goes on (as the submit pipeline does)."""
    path = journal_with(tmp_path, kept_reply_entry())
    horde = StoppingHorde(StopAfter(Wall(), 99, 3.0), {"reward": 10**400})
    result, _ = run(path, horde)
    assert result == RecoveryResult(replied=1, kudos=0.0)
    assert Journal(path).load() == []
