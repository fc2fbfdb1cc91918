"""A stop during the start-up recovery, driven against the real worker process.

The journal holds two jobs an earlier process left: a reply kept (sent, its
answer unknown) and a job without a terminal action. The Horde answers their
submits ``503`` with ``Retry-After: 30``, or stores them and answers 30 s
late. SIGTERM comes while the recovery waits (``--stop-grace 1``), with
koboldcpp answering (the pop loops wait for the recovery) or not (the worker
still waits for it): the process exits within the grace + 2 s, the journal
still lists what the Horde has not answered, a fault is sent at most once, and
the next start ends both jobs as the journal says. Seed sections: "7. Fault a
job", "Check the completed reply".
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from bench.harness.worker_process import WORKER_NAME, WorkerProcess, terminal_actions, until
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp
from koboldcpp_horde_chat.state.journal import Journal, JournalEntry
from koboldcpp_horde_chat.state.journal_paths import journal_path
from tests.integration.test_journal_recovery import POP, client

GRACE_S = 1.0
STOP_BOUND_S = GRACE_S + 2.0
MODEL = str(POP["model_id"])
UNAVAILABLE = (503, {"message": "The Horde is busy."}, {"Retry-After": "30"})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def left_in_hand(horde: DevHorde, directory: Path) -> tuple[str, str, Path]:
    """Two chat jobs popped by this worker, journaled as a process that died left
    them: (the job with a kept reply, the job without a terminal action, the file)."""
    with client(horde) as h:
        ids = []
        for text in ("first", "second"):
            horde.send_chat({"messages": [{"role": "user", "content": text}]})
            answer = h.pop(POP | {"name": WORKER_NAME}, timeout_s=5)
            ids.append(str(answer["id"]))
    path = journal_path(WORKER_NAME, directory)
    journal = Journal(path)
    for job_id in ids:
        journal.add(JournalEntry(job_id, "chat", MODEL, "", time.time() + horde.ttl_s))
    reply = {"id": ids[0], "message": {"role": "assistant", "content": "Blue."},
             "finish_reason": "stop", "model_id": MODEL, "state": "ok"}
    assert journal.keep_reply(ids[0], reply)
    return ids[0], ids[1], path


def entries(path: Path) -> dict[str, dict[str, Any]]:
    jobs = json.loads(path.read_text())["jobs"] if path.exists() else []
    return {e["job_id"]: e for e in jobs}


def submits(horde: DevHorde) -> list[dict[str, Any]]:
    return [json.loads(c["body"]) for c in horde.requests_log if c["path"].endswith("/submit")]


@pytest.mark.parametrize(
    ("horde_answers", "koboldcpp"),
    [("503", "up"), ("503", "down"), ("503", "loading"), ("late", "up")],
    ids=["503-loops-waiting", "503-koboldcpp-down", "503-koboldcpp-not-answering",
         "answers-late-loops-waiting"],
)
def test_a_sigterm_during_the_recovery_exits_in_time_and_keeps_the_unanswered_jobs(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, tmp_path: Path, horde_answers: str, koboldcpp: str,
) -> None:
    """``loading``: koboldcpp takes the connection and answers 30 s later (the
    worker's read of it has a 10 s timeout)."""
    directory = tmp_path / "state"
    replied, unanswered, path = left_in_hand(horde, directory)
    if horde_answers == "503":
        horde.inject("submit", *[UNAVAILABLE] * 4)  # the second start finds the Horde well
    else:
        horde.inject("submit", "late:30", "late:30")  # stored at once, answered 30 s later
    url = f"http://127.0.0.1:{free_port()}" if koboldcpp == "down" else None
    if koboldcpp == "loading":
        kcpp.inject("model", "hang:30")
    worker = WorkerProcess(horde, kcpp, directory, "--stop-grace", str(GRACE_S), kcpp_url=url)
    try:
        until(lambda: {s["id"] for s in submits(horde)} == {replied, unanswered}, 20, worker.log)
        time.sleep(0.3)
        took = worker.sigterm_to_exit(STOP_BOUND_S + 20)
        assert took is not None and took < STOP_BOUND_S, worker.log()
        assert worker.proc.returncode == 0, worker.log()
    finally:
        worker.stop()

    left = entries(path)
    assert set(left) == {replied, unanswered}, worker.log()
    assert left[replied]["terminal"] == "reply_sent"
    faults = [s for s in submits(horde) if s["id"] == unanswered]
    assert all(s["state"] == "faulted" for s in faults)
    if horde_answers == "503":
        # one attempt before the signal, one last attempt by the deadline; nothing taken
        assert len(submits(horde)) == 4, worker.log()
        assert left[unanswered].get("terminal", "none") == "none"
        assert terminal_actions(horde) == {}
    else:
        # the fault was taken, its answer cut at the stop: never sent again
        assert len(faults) == 1
        assert left[unanswered]["terminal"] == "fault_sent"
        assert terminal_actions(horde) == {replied: ["submitted"], unanswered: ["faulted"]}

    again = WorkerProcess(horde, kcpp, directory)
    try:
        again.wait_for("jobs in hand at the last stop", 20)
        until(lambda: entries(path) == {}, 5, again.log)
    finally:
        again.stop()
    actions = terminal_actions(horde)  # the faulted request's next job is served meanwhile
    assert {replied: actions[replied], unanswered: actions[unanswered]} == {
        replied: ["submitted"], unanswered: ["faulted"]
    }
    # 503: two refused, then the one fault taken; late: the one fault, taken before
    assert len([s for s in submits(horde) if s["id"] == unanswered]) == (
        3 if horde_answers == "503" else 1
    )
