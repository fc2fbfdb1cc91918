"""A stop while a Horde call is on the wire, driven against the real worker process.

At SIGTERM (``--stop-grace 1``) a call waits for the Horde: the loop's own pop,
the pop sent beside a submit, a submit whose answer is late, a streamed job's
progress posts, a submit retried after ``503`` with ``Retry-After``. Each time
the process exits within the grace + 2 s, whatever the call's own timeout
(30 s for a submit); a pop it could not wait for is said in one line and
counted as a possible aborted job; a job popped after the signal is faulted at
once (another worker takes it now), never generated; a reply the Horde would
take is sent before the exit when the deadline allows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness.worker_process import (
    WORKER_NAME,
    WorkerProcess,
    job_ids,
    slow,
    terminal_actions,
    until,
)
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply
from koboldcpp_horde_chat.state.journal_paths import journal_path

GRACE_S = 1.0
#: The stop's bound: the grace, then at most 2 s for the abort and the fault.
STOP_BOUND_S = GRACE_S + 2.0
#: An answer this late is never waited for: well past every bound and timeout but the submit's.
LATE_S = 30.0
POP_LEFT = "may be assigned to this stopped worker"

ASK = {"messages": [{"role": "user", "content": "Tell me about the sky."}]}


def stop_and_time(worker: WorkerProcess) -> float:
    return worker.sigterm_to_clean_exit(LATE_S + 15)


def journal(directory: Path) -> dict[str, Any]:
    """The worker's journal file as JSON ({} when there is none)."""
    path = journal_path(WORKER_NAME, directory)
    return dict(json.loads(path.read_text())) if path.exists() else {}


def chat_completions(kcpp: ScriptedKoboldcpp) -> int:
    return sum(r["path"] == "/v1/chat/completions" for r in kcpp.requests)


def short_replies(kcpp: ScriptedKoboldcpp) -> None:
    kcpp.token_delay_s = 0.005
    kcpp.script(lambda body: ScriptedReply(text="sky " * 20))


# --- pops ------------------------------------------------------------------------------


def test_the_loops_own_pop_unanswered_by_the_deadline_is_said_and_counted(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess],
    tmp_path: Path,
) -> None:
    """The Horde assigned a job to the pop in flight at SIGTERM, and its answer is
    30 s late: the worker exits by the bound, says a job may be assigned to it,
    and counts it in the fault history the maintenance guard reads."""
    rid = horde.send_chat(ASK, best_effort=True)
    horde.inject("pop", f"late:{LATE_S:g}")
    worker = workers("--stop-grace", str(GRACE_S))
    until(lambda: bool(job_ids(horde, rid)), 20, worker.log)
    time.sleep(0.3)
    took = stop_and_time(worker)
    assert took < STOP_BOUND_S, worker.log()
    assert worker.said(POP_LEFT) == 1, worker.log()
    assert len(journal(tmp_path / "state").get("faults", [])) == 1


def test_a_job_the_loops_own_pop_brings_after_the_signal_is_faulted_at_once(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    """The pop in flight at SIGTERM answers within the grace with a job: the worker
    cannot promise to generate it by the deadline, so it faults it at once (the
    request goes to another worker now) and sends koboldcpp nothing."""
    slow(kcpp, 0.5)
    rid = horde.send_chat(ASK, best_effort=True)
    horde.inject("pop", "late:0.6")
    worker = workers("--stop-grace", str(GRACE_S))
    until(lambda: bool(job_ids(horde, rid)), 20, worker.log)
    took = stop_and_time(worker)
    assert took < STOP_BOUND_S, worker.log()
    (job_id,) = job_ids(horde, rid)
    assert terminal_actions(horde) == {job_id: ["faulted"]}
    assert chat_completions(kcpp) == 0, worker.log()
    assert worker.said(POP_LEFT) == 0


def test_the_pop_beside_a_submit_unanswered_by_the_deadline_is_said_and_counted(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    kcpp.token_delay_s = 0.005
    kcpp.script(
        lambda body: ScriptedReply(text="sky " * (20 if "first" in json.dumps(body) else 400))
    )
    first = horde.send_chat({"messages": [{"role": "user", "content": "first"}]}, best_effort=True)
    horde.send_chat({"messages": [{"role": "user", "content": "second"}]}, best_effort=True)
    horde.inject("pop", "ok", f"late:{LATE_S:g}")
    worker = workers("--stop-grace", str(GRACE_S))
    until(lambda: "submitted" in terminal_actions(horde).get(
        (job_ids(horde, first) or ["?"])[0], []), 20, worker.log)
    time.sleep(0.2)
    took = stop_and_time(worker)
    assert took < STOP_BOUND_S, worker.log()
    assert worker.said(POP_LEFT) == 1, worker.log()


# --- submits ---------------------------------------------------------------------------


def test_a_submit_whose_answer_is_late_ends_by_the_deadline_and_stays_journaled(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess],
    tmp_path: Path,
) -> None:
    """The Horde took the reply sent just before SIGTERM and answers 30 s later (the
    submit's read timeout): the worker does not wait for it past the bound, and
    the job, its terminal action unanswered, stays in the journal."""
    short_replies(kcpp)
    rid = horde.send_chat(ASK, best_effort=True)
    horde.inject("submit", f"late:{LATE_S:g}")
    worker = workers("--stop-grace", str(GRACE_S))
    until(lambda: bool(job_ids(horde, rid)) and bool(terminal_actions(horde)), 20, worker.log)
    time.sleep(0.3)
    took = stop_and_time(worker)
    assert took < STOP_BOUND_S, worker.log()
    (job_id,) = job_ids(horde, rid)
    jobs = journal(tmp_path / "state").get("jobs", [])
    assert [e["job_id"] for e in jobs] == [job_id]


def test_a_submit_retried_after_a_503_is_sent_again_before_the_deadline(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    """503 with ``Retry-After: 6``, then SIGTERM with a 1 s grace: the retry's pause
    is cut to the stop's deadline, not lengthened, and the reply the Horde takes
    is sent before the exit (not left for the next start)."""
    short_replies(kcpp)
    rid = horde.send_chat(ASK, best_effort=True)
    horde.inject("submit", (503, {"message": "down", "rc": "Unavailable"}, {"Retry-After": "6"}))
    worker = workers("--stop-grace", str(GRACE_S))
    worker.wait_for("submit failed", 20)
    time.sleep(0.3)
    took = stop_and_time(worker)
    assert took < STOP_BOUND_S, worker.log()
    (job_id,) = job_ids(horde, rid)
    assert terminal_actions(horde) == {job_id: ["submitted"]}, worker.log()


# --- progress posts --------------------------------------------------------------------


def test_a_streamed_jobs_unanswered_progress_posts_end_at_the_deadline(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    """No progress post is answered: at the stop's deadline the post in flight is
    hung up, no post is sent or retried after it, and the job is faulted."""
    slow(kcpp, GRACE_S + 10)
    rid = horde.send_chat({**ASK, "stream": True}, best_effort=True)
    horde.inject("progress", *[f"hang:{LATE_S:g}"] * 5)
    worker = workers("--stop-grace", str(GRACE_S))

    def posts() -> int:
        return sum(r["path"].endswith("/progress") for r in horde.requests_log)

    until(lambda: posts() >= 1, 20, worker.log)
    time.sleep(0.3)
    took = stop_and_time(worker)
    assert took < STOP_BOUND_S, worker.log()
    assert posts() == 1, worker.log()
    (job_id,) = job_ids(horde, rid)
    assert terminal_actions(horde) == {job_id: ["faulted"]}, worker.log()
