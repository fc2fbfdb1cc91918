"""The seams of the pop sent during a long text generation, driven against the
real worker process.

Three text jobs are queued: the first one's generation is measured (about
2 s), the second one's is long, so the next pop goes out during it and brings
the third job, which waits in hand while the second one is generated; the
second one's reply is then submitted beside the third job. At each instant of
that overlap a SIGTERM, a SIGKILL, a failing submit or a koboldcpp restart
still ends every job once, by the stop's deadline, and nothing is sent for a
job whose lease ended (the ``horde`` fixture's late-fault check).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.harness.worker_process import (
    WORKER_NAME,
    WorkerProcess,
    job_ids,
    terminal_actions,
    until,
)
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply
from koboldcpp_horde_chat.state.journal_paths import journal_path

GRACE_S = 1.0
#: The stop's bound: the grace, then at most 2 s for the abort and the fault.
STOP_BOUND_S = GRACE_S + 2.0
#: An answer this late is never waited for.
LATE_S = 30.0
POP_LEFT = "may be assigned to this stopped worker"
TOKENS = 64
#: Seconds per token of each job's generation, by its prompt: the first measured
#: (about 2 s), the second long enough for the early pop's job to wait in hand.
FAST = 0.03
SLOW = 0.1


class Jobs:
    """Three text jobs queued on the dev Horde, served by a scripted koboldcpp whose
    speed per token depends on the job; notes which generations started."""

    def __init__(
        self, horde: DevHorde, kcpp: ScriptedKoboldcpp, delays: tuple[float, float, float]
    ) -> None:
        self.horde = horde
        self.started: list[str] = []
        #: when each generation started (monotonic seconds), by job
        self.started_at: dict[str, float] = {}
        self._lock = threading.Lock()
        names = ("first", "second", "third")
        speed = dict(zip(names, delays, strict=True))

        def script(body: dict[str, Any]) -> ScriptedReply:
            text = json.dumps(body)
            name = next((n for n in names if n in text), "first")
            with self._lock:
                self.started.append(name)
                self.started_at[name] = time.monotonic()
            kcpp.token_delay_s = speed[name]
            return ScriptedReply(text="word " * 400, finish="length")

        kcpp.token_delay_s = delays[0]
        kcpp.script(script)
        self.rids = {n: horde.send_text(f"Once upon a time, {n}", max_length=TOKENS)
                     for n in names}

    def generating(self, name: str) -> bool:
        with self._lock:
            return bool(self.started) and self.started[-1] == name

    def job(self, name: str) -> str | None:
        ids = job_ids(self.horde, self.rids[name])
        return ids[0] if ids else None

    def pops(self) -> int:
        return sum(r["path"].endswith("/pop") for r in self.horde.requests_log)

    def early_pop_sent(self, worker: WorkerProcess) -> int:
        """Wait for the second generation, then for the pop sent during it; the
        pops sent before it."""
        until(lambda: self.generating("second"), 30, worker.log)
        before = self.pops()
        until(lambda: self.pops() > before, 10, worker.log)
        assert self.generating("second"), "the pop went after the generation"
        return before


def one_each(horde: DevHorde) -> dict[str, str]:
    actions = terminal_actions(horde)
    assert all(len(a) == 1 for a in actions.values()), actions
    return {job_id: a[0] for job_id, a in actions.items()}


def journaled(tmp_path: Path) -> list[dict[str, Any]]:
    path = journal_path(WORKER_NAME, tmp_path / "state")
    return list(json.loads(path.read_text())["jobs"]) if path.exists() else []


def submits_of(horde: DevHorde, job_id: str) -> list[dict[str, Any]]:
    return [json.loads(c["body"]) for c in horde.requests_log
            if c["path"].endswith("/submit") and json.loads(c["body"]).get("id") == job_id]


def stop_and_time(worker: WorkerProcess) -> float:
    return worker.sigterm_to_clean_exit(LATE_S + 15)


# --- (a) the stop while the early pop is in flight -------------------------------------


def test_a_stop_while_the_early_pop_is_in_flight_ends_each_job_once(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    """The pop sent during the second generation is answered 30 s late: the worker
    exits by the bound, the second job ends once, and the third job (assigned to
    that pop) is said left to the Horde, never served."""
    jobs = Jobs(horde, kcpp, (FAST, FAST, FAST))
    worker = workers("--stop-grace", str(GRACE_S))
    until(lambda: jobs.generating("second"), 30, worker.log)
    horde.inject("pop", f"late:{LATE_S:g}")
    jobs.early_pop_sent(worker)
    until(lambda: jobs.job("third") is not None, 5, worker.log)
    took = stop_and_time(worker)
    assert took < STOP_BOUND_S, worker.log()
    second, third = jobs.job("second"), jobs.job("third")
    actions = one_each(horde)
    assert second in actions, worker.log()
    assert third not in actions or actions[third] == "faulted", worker.log()
    if third not in actions:
        assert worker.said(POP_LEFT) == 1, worker.log()
    assert "third" not in jobs.started, worker.log()


def test_a_job_the_early_pop_brings_after_the_signal_is_faulted_at_once(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    """The pop sent during the second generation answers with the third job 1 s
    after it went, after SIGTERM: the third job is faulted, never generated."""
    jobs = Jobs(horde, kcpp, (FAST, FAST, FAST))
    worker = workers("--stop-grace", str(GRACE_S))
    until(lambda: jobs.generating("second"), 30, worker.log)
    horde.inject("pop", "late:1")
    jobs.early_pop_sent(worker)
    took = stop_and_time(worker)
    assert took < STOP_BOUND_S, worker.log()
    actions = one_each(horde)
    assert actions[str(jobs.job("third"))] == "faulted", worker.log()
    assert str(jobs.job("second")) in actions, worker.log()
    assert worker.said(POP_LEFT) == 0, worker.log()
    assert "third" not in jobs.started, worker.log()


# --- (b) the stop with the early job in hand, the generation still running --------------


def test_a_stop_with_the_early_job_in_hand_faults_it_at_once(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    """The third job waits in hand while the second one is generated (6 s): at
    SIGTERM both end once by the bound, the waiting one faulted, not left to expire."""
    jobs = Jobs(horde, kcpp, (FAST, SLOW, FAST))
    worker = workers("--stop-grace", str(GRACE_S))
    jobs.early_pop_sent(worker)
    until(lambda: jobs.job("third") is not None, 5, worker.log)
    time.sleep(0.3)  # the pop's answer is in, the job in hand
    assert jobs.generating("second")
    took = stop_and_time(worker)
    assert took < STOP_BOUND_S, worker.log()
    actions = one_each(horde)
    assert actions[str(jobs.job("third"))] == "faulted", worker.log()
    assert str(jobs.job("second")) in actions, worker.log()
    assert "third" not in jobs.started, worker.log()


# --- (c) the stop while the reply beside is being submitted --------------------------------


def test_a_stop_while_the_reply_beside_is_on_the_wire_ends_each_job_once(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess],
    tmp_path: Path,
) -> None:
    """The second job's reply, submitted beside the third job, is answered 30 s
    late; SIGTERM while the third one is generated: the worker exits by the bound,
    the third job is faulted, and the second one's reply, stored by the Horde,
    stays journaled; the next start sends it again and nothing more."""
    jobs = Jobs(horde, kcpp, (FAST, FAST, SLOW))
    first = workers("--stop-grace", str(GRACE_S))
    until(lambda: jobs.generating("second"), 30, first.log)
    horde.inject("submit", f"late:{LATE_S:g}")
    until(lambda: jobs.generating("third"), 15, first.log)
    second_id, third_id = str(jobs.job("second")), str(jobs.job("third"))
    until(lambda: len(submits_of(horde, second_id)) == 1, 5, first.log)
    time.sleep(0.3)
    took = stop_and_time(first)
    assert took < STOP_BOUND_S, first.log()
    assert one_each(horde) == {
        str(jobs.job("first")): "submitted", second_id: "submitted", third_id: "faulted"
    }, first.log()
    kept = [e["job_id"] for e in journaled(tmp_path)]
    assert second_id in kept, first.log()

    again = workers("--stop-grace", str(GRACE_S))
    until(lambda: journaled(tmp_path) == [], 20, again.log)
    assert len(submits_of(horde, second_id)) == 2  # the reply, sent again
    assert one_each(horde)[second_id] == "submitted"
    stop_and_time(again)


# --- (d) the reply beside failing ---------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        (503, {"message": "down", "rc": "Unavailable"}, {"Retry-After": "1"}),
        (500, {"message": "boom"}),
        "reset",
        "drop",
    ],
    ids=["503-then-ok", "500", "no-answer", "answer-lost"],
)
def test_a_failing_reply_beside_ends_its_job_once(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess],
    answer: Any,
) -> None:
    """The second job's reply, submitted beside the third job, fails once (503, 500,
    no answer, or taken with its answer lost): it is sent again and the job ends
    once, submitted (no second terminal action); the third job did not wait for it."""
    jobs = Jobs(horde, kcpp, (FAST, FAST, FAST))
    worker = workers()
    until(lambda: jobs.generating("second"), 30, worker.log)
    horde.inject("submit", answer)
    assert horde.wait(list(jobs.rids.values()), timeout_s=40), worker.log()
    time.sleep(1.5)  # a retry, if any, would be sent by now
    assert one_each(horde) == {
        str(jobs.job(n)): "submitted" for n in ("first", "second", "third")
    }, worker.log()
    assert jobs.started == ["first", "second", "third"]
    # the failing submit was the reply beside: the third generation did not wait for it
    second_id = str(jobs.job("second"))
    sent = [c["at"] for c in horde.requests_log if c["path"].endswith("/submit")
            and json.loads(c["body"]).get("id") == second_id]
    assert jobs.started_at["third"] < sent[-1] + 0.5, worker.log()


# --- (e) a SIGKILL with two jobs in hand ---------------------------------------------------


def test_a_kill_with_two_jobs_in_hand_then_a_restart_ends_both_once(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess],
    tmp_path: Path,
) -> None:
    """SIGKILL while the second job is generated and the third one, popped during
    it, waits: both are journaled, and the next start faults each once."""
    jobs = Jobs(horde, kcpp, (FAST, SLOW, FAST))
    first = workers()
    jobs.early_pop_sent(first)
    until(lambda: jobs.job("third") is not None, 5, first.log)
    second_id, third_id = str(jobs.job("second")), str(jobs.job("third"))
    until(lambda: {e["job_id"] for e in journaled(tmp_path)} >= {second_id, third_id}, 5,
          first.log)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert set(terminal_actions(horde)) == {str(jobs.job("first"))}
    assert "third" not in jobs.started, first.log()

    again = workers()
    until(lambda: {second_id, third_id} <= set(terminal_actions(horde)), 20, again.log)
    time.sleep(0.5)
    actions = one_each(horde)
    assert actions[second_id] == actions[third_id] == "faulted", again.log()
    # (the Horde gives the faulted requests out again: the next start may serve them)
    until(lambda: not {second_id, third_id} & {e["job_id"] for e in journaled(tmp_path)}, 5,
          again.log)


# --- (f) koboldcpp restarted while the early job waits ---------------------------------------


def test_a_koboldcpp_restart_while_the_early_job_waits_ends_it_once(
    horde: DevHorde, tmp_path: Path
) -> None:
    """koboldcpp dies during the second generation (the third job in hand) and comes
    back 3 s later: every job ends once, none is lost (left to expire)."""
    first = ScriptedKoboldcpp(max_context_length=4096).start()
    second = ScriptedKoboldcpp(max_context_length=4096, port=first.port)
    jobs = Jobs(horde, first, (FAST, SLOW, FAST))
    worker = WorkerProcess(horde, first, tmp_path / "state")
    try:
        jobs.early_pop_sent(worker)
        until(lambda: jobs.job("third") is not None, 5, worker.log)
        time.sleep(0.3)
        first.kill()
        time.sleep(3.0)
        second.token_delay_s = FAST
        second.script(lambda body: ScriptedReply(text="word " * 400, finish="length"))
        second.start()
        ids = [str(jobs.job(n)) for n in ("first", "second", "third")]
        until(lambda: set(ids) <= set(terminal_actions(horde)), 30, worker.log)
        time.sleep(0.5)
        actions = one_each(horde)
        assert actions[ids[1]] == "faulted", worker.log()
        assert actions[ids[2]] in ("faulted", "submitted"), worker.log()
    finally:
        worker.stop()
        first.stop()
        second.stop()
