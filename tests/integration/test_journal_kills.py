"""A SIGKILL at each instant of a job's terminal action, then a restart: the worker
process against the dev Horde and the scripted koboldcpp.

On the real Horde every faulted submit re-opens the request (``wp.n += 1``), also
for a job that already ended: the common ``horde`` fixture fails a test whose dev
Horde saw such a fault. Seed sections: "7. Fault a job", "Check the completed
reply" (DuplicateGen), "Streaming progress" (the lease).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.harness.worker_process import WORKER_NAME, WorkerProcess, slow, terminal_actions, until
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply
from koboldcpp_horde_chat.state.journal_paths import journal_path

ASK = {"messages": [{"role": "user", "content": "Name one colour."}]}


def journaled(tmp_path: Path) -> list[dict]:  # type: ignore[type-arg]
    path = journal_path(WORKER_NAME, tmp_path / "state")
    return list(json.loads(path.read_text())["jobs"]) if path.exists() else []


def submits_of(horde: DevHorde, job_id: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(c["body"]) for c in horde.requests_log
            if c["path"].endswith("/submit") and json.loads(c["body"]).get("id") == job_id]


def kill(worker: WorkerProcess) -> None:
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait(10)


def test_a_kill_while_the_stored_replys_answer_is_on_its_way_sends_the_reply_again(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess],
    tmp_path: Path,
) -> None:
    kcpp.script(lambda body: ScriptedReply(text="Blue."))
    rid = horde.send_chat(ASK, best_effort=True)
    horde.inject("submit", "late:30")  # stored at once, answered 30 s later
    first = workers()
    until(lambda: "submitted" in str(terminal_actions(horde)), 20, first.log)
    (job_id,) = horde.status(rid)["job_ids"]
    (kept,) = journaled(tmp_path)
    assert kept["terminal"] == "reply_sent" and kept["reply"] == submits_of(horde, job_id)[0]
    kill(first)

    second = workers()
    second.wait_for("jobs in hand at the last stop", 20)
    assert [s.get("state") for s in submits_of(horde, job_id)] == ["ok", "ok"]  # no fault
    assert submits_of(horde, job_id)[0] == submits_of(horde, job_id)[1]
    assert terminal_actions(horde) == {job_id: ["submitted"]}
    assert horde.status(rid)["state"] == "done"
    assert journaled(tmp_path) == []


def test_a_kill_just_after_an_accepted_submit_leaves_nothing_for_the_next_start(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess],
    tmp_path: Path,
) -> None:
    """The pop sent beside the submit is still in flight: the removal is already on disk."""
    kcpp.script(lambda body: ScriptedReply(text="Blue."))
    rid = horde.send_chat(ASK, best_effort=True)
    horde.inject("pop", "ok", "hang:20")  # the pop beside the submit answers late
    first = workers()
    until(lambda: "submitted" in str(terminal_actions(horde)), 20, first.log)
    (job_id,) = horde.status(rid)["job_ids"]
    until(lambda: first.said(f"job={job_id} kind=chat submitted") == 1, 5, first.log)
    assert journaled(tmp_path) == []
    kill(first)

    second = workers()
    second.wait_for("worker 1: started", 20)
    time.sleep(0.5)
    assert len(submits_of(horde, job_id)) == 1
    assert terminal_actions(horde) == {job_id: ["submitted"]}


def test_a_fault_whose_answer_was_lost_is_sent_once(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess],
) -> None:
    kcpp.inject("chat", (500, {"error": "boom"}))
    rid = horde.send_chat(ASK, best_effort=True)
    horde.inject("submit", "drop")  # the fault is taken; its answer is lost
    worker = workers()
    until(lambda: bool(horde.status(rid)["job_ids"]), 20, worker.log)
    (job_id,) = horde.status(rid)["job_ids"][:1]
    until(lambda: worker.said(f"job={job_id} the fault's answer was lost") == 1, 20, worker.log)
    time.sleep(1.0)
    faults = [s for s in submits_of(horde, job_id) if s.get("state") == "faulted"]
    assert len(faults) == 1
    assert terminal_actions(horde)[job_id] == ["faulted"]


def test_the_next_start_faults_a_job_in_hand_before_koboldcpp_answers(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess],
    tmp_path: Path,
) -> None:
    """The job's lease runs while koboldcpp loads: the recovery does not wait for it.
    The journal holds the pop's ttl, not the lease cap."""
    rid = horde.send_chat(ASK, best_effort=True)
    kcpp.inject("tokencount", "hang:30")
    started = time.time()  # the pop answers after this
    first = workers()
    until(lambda: bool(horde.status(rid)["job_ids"]), 20, first.log)
    (job_id,) = horde.status(rid)["job_ids"]
    until(lambda: bool(journaled(tmp_path)), 5, first.log)
    (entry,) = journaled(tmp_path)
    read = time.time()  # the lease end was written before this
    # The pop's ttl from the pop's answer, not the 200 s cap: bounded by this test's
    # own clock, however long the worker took to start, pop and write its journal.
    assert started + horde.ttl_s - 0.5 <= entry["lease_end"] <= read + horde.ttl_s + 0.5
    kill(first)
    url = kcpp.url
    kcpp.kill()  # koboldcpp is down (loading, say)

    second = WorkerProcess(horde, kcpp, tmp_path / "state", kcpp_url=url)
    try:
        until(lambda: job_id in terminal_actions(horde), 20, second.log)
        assert terminal_actions(horde)[job_id] == ["faulted"]
        # koboldcpp never answered this worker: it never started serving. Its first
        # "waiting" line may come after the fault (the recovery runs beside the wait)
        # and reaches this test through a pipe, so it is waited for, not expected yet.
        second.wait_for("waiting for koboldcpp", 20)
        assert second.said("worker 1: started") == 0
        # the entry goes once the worker has read the Horde's answer to the fault
        until(lambda: journaled(tmp_path) == [], 5, second.log)
    finally:
        second.stop()


# --- a SIGKILL at every phase of a job's life, then a restart -------------------------


@dataclass(frozen=True)
class KillPhase:
    """A phase of a job's life at which the worker is killed, and what the next start
    must send for it (the dev Horde's terminal actions for that job, in order)."""

    prepare: Callable[[DevHorde, ScriptedKoboldcpp], dict[str, Any]]  # -> the chat request
    reached: Callable[[DevHorde, ScriptedKoboldcpp, WorkerProcess, str], bool]
    journal_state: str | None  # the entry's terminal state at the kill (None: not listed)
    then: list[str]  # the job's terminal actions on the Horde after the next start
    sent_after_restart: int  # the submits the next start sends for the job


def _slow_generation(horde: DevHorde, kcpp: ScriptedKoboldcpp) -> dict[str, Any]:
    slow(kcpp, 20.0)
    return ASK


def _streamed(horde: DevHorde, kcpp: ScriptedKoboldcpp) -> dict[str, Any]:
    slow(kcpp, 20.0)
    return ASK | {"stream": True}


def _fetch_hangs(horde: DevHorde, kcpp: ScriptedKoboldcpp) -> dict[str, Any]:
    horde.offload_bytes = 0  # every request's messages are fetched from storage
    horde.inject("storage", "hang:30")
    return ASK


def _count_hangs(horde: DevHorde, kcpp: ScriptedKoboldcpp) -> dict[str, Any]:
    kcpp.inject("tokencount", "hang:30")
    return ASK


def _submit_503(horde: DevHorde, kcpp: ScriptedKoboldcpp) -> dict[str, Any]:
    kcpp.script(lambda body: ScriptedReply(text="Blue."))
    horde.inject("submit", (503, {"message": "busy"}, {"Retry-After": "30"}))
    return ASK


def _fault_answer_lost(horde: DevHorde, kcpp: ScriptedKoboldcpp) -> dict[str, Any]:
    kcpp.inject("chat", (500, {"error": "boom"}))
    horde.inject("submit", "drop")  # the fault is taken; its answer is lost
    return ASK


def _popped(horde: DevHorde, kcpp: ScriptedKoboldcpp, worker: WorkerProcess, job_id: str) -> bool:
    return True  # the job is journaled (checked before the kill) and its step hangs


def _generating(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, worker: WorkerProcess, job_id: str
) -> bool:
    return kcpp.generating


def _streaming(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, worker: WorkerProcess, job_id: str
) -> bool:
    return kcpp.generating and any(
        r["path"].endswith("/progress") for r in horde.requests_log
    )


def _said(text: str) -> Callable[[DevHorde, ScriptedKoboldcpp, WorkerProcess, str], bool]:
    return lambda horde, kcpp, worker, job_id: worker.said(f"job={job_id} {text}") > 0


KILL_PHASES = {
    # no terminal action yet: the next start faults it while its lease surely runs
    "fetching messages": KillPhase(_fetch_hangs, _popped, "none", ["faulted"], 1),
    "counting tokens": KillPhase(_count_hangs, _popped, "none", ["faulted"], 1),
    "generating": KillPhase(_slow_generation, _generating, "none", ["faulted"], 1),
    "generating streamed": KillPhase(_streamed, _streaming, "none", ["faulted"], 1),
    # the reply is kept: the next start sends it, not a fault
    "submit retried after 503": KillPhase(
        _submit_503, _said("submit failed"), "reply_sent", ["submitted"], 1
    ),
    # the fault may have been taken: nothing more
    "fault sent, its answer lost": KillPhase(
        _fault_answer_lost, _said("the fault's answer was lost"), None, ["faulted"], 0
    ),
}


@pytest.mark.parametrize("phase", list(KILL_PHASES), ids=list(KILL_PHASES))
def test_a_kill_at_each_phase_then_the_next_start_sends_exactly_what_the_rule_says(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess],
    tmp_path: Path, phase: str,
) -> None:
    """The other phases have tests of their own above: a stored reply's answer on its
    way, just after an accepted submit, and the token count with koboldcpp down at the
    restart. The window between the Horde's answer and the journal's write leaves the
    journal as "the answer on its way" does (the reply kept as sent), so it ends the same."""
    case = KILL_PHASES[phase]
    rid = horde.send_chat(case.prepare(horde, kcpp), best_effort=True)
    first = workers()
    until(lambda: bool(horde.status(rid)["job_ids"]), 20, first.log)
    (job_id,) = horde.status(rid)["job_ids"][:1]
    until(lambda: case.reached(horde, kcpp, first, job_id), 20, first.log)

    def journal_state() -> str | None:
        entries = {e["job_id"]: e for e in journaled(tmp_path)}
        return entries[job_id].get("terminal", "none") if job_id in entries else None

    # the journal is written beside the step that hangs: waited for, not slept on
    until(lambda: journal_state() == case.journal_state, 10, first.log)
    time.sleep(0.3)
    assert journal_state() == case.journal_state, first.log()
    before = len(submits_of(horde, job_id))
    kill(first)

    second = workers()
    second.wait_for("worker 1: started", 20)
    until(lambda: job_id not in {e["job_id"] for e in journaled(tmp_path)}, 10, second.log)
    time.sleep(0.5)
    assert len(submits_of(horde, job_id)) - before == case.sent_after_restart, second.log()
    assert terminal_actions(horde)[job_id] == case.then, second.log()
    faults = [s for s in submits_of(horde, job_id) if s.get("state") == "faulted"]
    assert len(faults) <= 1
