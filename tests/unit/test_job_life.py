"""A popped job's one owner: its phases, its one terminal action, the stop's deadline.

The table (``state.life``) with plain values; ``state.job.JobContext`` moving through it
from several threads; ``state.shared.WorkerState`` holding the jobs in hand for the
stop and the journal; and the pop loop's seams with the in-process fakes: the
pop sent beside a submit, a submit retried on its own, the declaration that
a submit's answer can change.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from bench.harness.fakes import FakeBackend, FakeClock, FakeHorde, FakeStopEvent
from koboldcpp_horde_chat.errors import JobFault
from koboldcpp_horde_chat.horde.pop import Lease, read_pop
from koboldcpp_horde_chat.service.loop import Worker
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.guard import WITHDRAW_CHAT_AT
from koboldcpp_horde_chat.state.job import JobContext
from koboldcpp_horde_chat.state.journal import Journal
from koboldcpp_horde_chat.state.life import ENDED, LIVE, MOVES, IllegalMove, Move, Phase, next_phase
from koboldcpp_horde_chat.state.shared import WorkerState
from tests import pops

MODEL = "koboldcpp/fake"


def settings(**options: Any) -> WorkerSettings:
    return WorkerSettings(
        api_key="unit-key-5f2e9c",
        worker_name="life-worker",
        model_id=MODEL,
        backend_max_context_length=4096,
        **{"max_length": 512, **options},
    )


def ctx(job_id: str = "j1", kind: str = "chat", **fields: Any) -> JobContext:
    return JobContext(id=job_id, kind=kind, lease=Lease(0.0, 150.0), started=0.0, **fields)


# --- the table ------------------------------------------------------------------------


def test_a_job_served_in_full_passes_each_phase_once_in_order() -> None:
    phase = Phase.POPPED
    seen: list[Phase] = [phase]
    for move in (Move.JOURNAL, Move.PREPARE, Move.GENERATE, Move.OUTCOME, Move.SETTLE, Move.SETTLED):
        phase = next_phase(phase, move)
        seen.append(phase)
    assert [p.value for p in seen] == [
        "popped", "journaled", "preparing", "generating", "outcome_ready", "settling", "settled"
    ]


@pytest.mark.parametrize("phase", sorted(LIVE))
def test_a_fault_can_be_decided_in_every_live_phase(phase: Phase) -> None:
    assert next_phase(phase, Move.SETTLE) is Phase.SETTLING


@pytest.mark.parametrize("move", list(Move))
def test_nothing_follows_the_end_of_a_jobs_life(move: Move) -> None:
    for phase in ENDED:
        with pytest.raises(IllegalMove):
            next_phase(phase, move)


def test_a_job_being_settled_cannot_be_settled_again_or_dropped_without_a_submit() -> None:
    for move in (Move.SETTLE, Move.NO_SUBMIT, Move.GENERATE):
        with pytest.raises(IllegalMove):
            next_phase(Phase.SETTLING, move)
    assert next_phase(Phase.SETTLING, Move.ABANDON) is Phase.ABANDONED  # exit, left to the journal


def test_every_move_leads_somewhere_from_somewhere() -> None:
    for move, (target, sources) in MOVES.items():
        assert sources, move
        assert isinstance(target, Phase)


# --- the owner ------------------------------------------------------------------------


def test_one_terminal_action_however_many_threads_ask_at_once() -> None:
    for _ in range(50):
        job = ctx()
        job.move(Move.JOURNAL)
        start = threading.Barrier(8)
        granted: list[bool] = []

        def take(
            job: JobContext = job, start: threading.Barrier = start, granted: list[bool] = granted
        ) -> None:
            start.wait()
            granted.append(job.settle())

        threads = [threading.Thread(target=take) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert granted.count(True) == 1
        assert job.phase is Phase.SETTLING


def test_a_given_up_job_ends_its_blocking_step_at_once_and_stops_its_generation() -> None:
    stopped: list[str] = []
    job = ctx(stop_generation=stopped.append)
    release = threading.Event()
    threading.Timer(0.2, job.give_up, args=("the stop's deadline",)).start()
    started = time.monotonic()
    with pytest.raises(JobFault, match="the stop's deadline"):
        job.until_given_up(lambda: release.wait(30))
    assert time.monotonic() - started < 5.0
    release.set()
    assert stopped == []  # no genkey yet: nothing to stop on koboldcpp
    job2 = ctx("j2", stop_generation=stopped.append, genkey="HORDEREQ_ab12",
               phase=Phase.GENERATING)
    job2.give_up("bye")
    job2.give_up("bye again")
    assert stopped == ["HORDEREQ_ab12"] and job2.abandon_why == "bye"
    # a job whose generation ended is not stopped: the client may be serving the next one
    job3 = ctx("j3", stop_generation=stopped.append, genkey="HORDEREQ_cd34",
               phase=Phase.SETTLING)
    job3.give_up("bye")
    assert stopped == ["HORDEREQ_ab12"]


def test_a_step_that_ends_first_returns_its_value_and_raises_its_own_error() -> None:
    job = ctx()
    assert job.until_given_up(lambda: 42) == 42

    def boom() -> int:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        job.until_given_up(boom)


def test_a_job_received_after_the_stops_deadline_is_given_up_at_once(tmp_path: Any) -> None:
    state = WorkerState(settings(), journal=Journal(tmp_path / "jobs.json"))
    state.request_stop(0.0)
    time.sleep(0.05)
    late = ctx("late")
    state.hold(late)
    assert late.abandoned.is_set()
    assert "0 s stop grace period" in late.abandon_why
    assert state.jobs_in_hand() == [late]


def test_the_stops_deadline_gives_up_every_job_in_hand_also_one_received_during_the_grace() -> None:
    state = WorkerState(settings())
    first = ctx("first")
    state.hold(first)
    state.request_stop(0.3)
    second = ctx("second")  # its pop was in flight at the signal
    state.hold(second)
    assert not first.abandoned.is_set() and not second.abandoned.is_set()
    time.sleep(0.6)
    assert first.abandoned.is_set() and second.abandoned.is_set()


def test_released_jobs_leave_the_journal_only_when_settled(tmp_path: Any) -> None:
    journal = Journal(tmp_path / "jobs.json")
    state = WorkerState(settings(), journal=journal)
    from koboldcpp_horde_chat.state.journal import JournalEntry

    for job_id in ("settled", "abandoned"):
        journal.add(JournalEntry(job_id, "chat", MODEL, "", 1e10))
    done, left = ctx("settled"), ctx("abandoned")
    for job in (done, left):
        state.hold(job)
        job.move(Move.JOURNAL)
        assert job.settle()
    done.end(Move.SETTLED)
    left.end(Move.ABANDON)
    state.release(done)
    state.release(left)
    assert [e.job_id for e in journal.load()] == ["abandoned"]
    assert state.jobs_in_hand() == []


# --- what a submit's answer could change ----------------------------------------------


def test_a_submit_that_could_withdraw_chat_or_a_feature_is_answered_before_the_next_pop() -> None:
    state = WorkerState(settings())
    chat = ctx(declared_features=("tools", "seed"))
    text = ctx("t", kind="text")
    assert not state.outcome_may_withdraw(chat, is_fault=False, now=10.0)
    for _ in range(WITHDRAW_CHAT_AT - 1):
        state.record_fault(10.0)
    # One more counted fault withdraws chat: a fault, or a chat reply the Horde may refuse.
    assert state.outcome_may_withdraw(chat, is_fault=False, now=10.0)
    assert state.outcome_may_withdraw(text, is_fault=True, now=10.0)
    assert not state.outcome_may_withdraw(text, is_fault=False, now=10.0)

    state = WorkerState(settings())
    state.record_feature_failure(["tools"] * 1, 10.0)
    assert not state.outcome_may_withdraw(chat, is_fault=False, now=10.0)
    state.record_feature_failure(["tools"], 11.0)  # the next refusal would withdraw tools
    assert state.outcome_may_withdraw(chat, is_fault=False, now=12.0)
    assert not state.outcome_may_withdraw(ctx("n", declared_features=("seed",)),
                                          is_fault=False, now=12.0)


# --- the loop's seams, with the fakes -------------------------------------------------


def tools_pop(job_id: str) -> dict[str, Any]:
    return pops.chat_pop(
        job_id,
        MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        tool_choice="required",
    )


def overlapping_worker(
    horde: FakeHorde, clock: FakeClock, journal: Journal | None = None, **options: Any
) -> Worker:
    return Worker(
        settings(**options),
        state=WorkerState(
            settings(**options), stop_event=FakeStopEvent(clock), journal=journal, clock=clock
        ),
        horde=horde,
        backend=FakeBackend(),
        pop_horde=horde,
    )


class SlowSubmitHorde(FakeHorde):
    """A Horde whose submit answers only once a pop sent beside it arrived (or 0.5 s)."""

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        answer = super().pop(body, timeout_s=timeout_s)
        self.popped.set()
        return answer

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.popped.clear()
        self.popped.wait(0.5)
        return super().submit(body, timeout_s=timeout_s)

    popped = threading.Event()


def test_the_pop_after_a_refusal_that_withdraws_tools_does_not_declare_tools() -> None:
    clock = FakeClock()
    horde = SlowSubmitHorde(
        clock, pops=[tools_pop("j1"), tools_pop("j2")],
        submit_script=("ChatSubmitNonconformant",),
    )
    worker = overlapping_worker(horde, clock)
    worker.state.record_feature_failure(["tools"], clock())
    worker.state.record_feature_failure(["tools"], clock())
    assert "tools" in worker.state.pop_body(worker.caps)["chat_features"]
    worker.run_once()  # j1: refused as nonconformant, faulted; tools withdrawn
    assert horde.jobs["j1"].state == "faulted"
    worker.run_once()
    assert "tools" not in horde.pop_bodies[1]["chat_features"]


def test_a_job_popped_beside_the_submit_is_journaled_on_the_pops_own_thread(
    tmp_path: Any,
) -> None:
    clock = FakeClock()
    horde = FakeHorde(clock)
    journal = Journal(tmp_path / "jobs.json")
    worker = overlapping_worker(horde, clock, journal)
    body = worker.state.pop_body(worker.caps)
    job = worker.driver.take_in_hand(body, read_pop(tools_pop("j9")), clock())
    assert job is not None and job.phase is Phase.JOURNALED
    (entry,) = journal.load()
    assert entry.job_id == "j9" and entry.genkey == job.genkey
    assert job.genkey.startswith("HORDEREQ_")  # made at the pop's answer, journaled with it
    assert worker.state.jobs_in_hand() == [job]

