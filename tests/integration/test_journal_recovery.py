"""A job in hand when the worker died is faulted at the next start (the dev Horde, a real client).

Seed "7. Fault a job": the faulted submit returns ``{"reward": 0}`` and the
request goes back to the queue for the next pop. The worker's side here is the
journal and :func:`recover` with a real ``HordeClient`` and ``KoboldClient``; the
Horde's side is the dev Horde, which implements the rules on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.harness.worker_process import POP, POP_MODEL, WORKER_NAME, WorkerProcess
from koboldcpp_horde_chat import BRIDGE_AGENT
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp
from koboldcpp_horde_chat.horde.client import HordeClient
from koboldcpp_horde_chat.koboldcpp.client import KoboldClient
from koboldcpp_horde_chat.service.recovery import RecoveryResult, recover
from koboldcpp_horde_chat.state.journal import Journal, JournalEntry
from koboldcpp_horde_chat.state.journal_paths import journal_path
from tests.integration.conftest import API_KEY

MODEL = POP_MODEL
GENKEY = "HORDEREQ_0123456789ab"
REQUEST = {"messages": [{"role": "user", "content": "Name one colour."}], "max_tokens": 64}


def client(horde: DevHorde) -> HordeClient:
    return HordeClient(horde.url, API_KEY, bridge_agent=BRIDGE_AGENT)


def pop_chat_job(horde: DevHorde) -> tuple[str, dict[str, Any]]:
    """A client's chat request, popped by the worker: (request id, pop answer)."""
    rid = horde.send_chat(REQUEST)
    with client(horde) as h:
        answer = h.pop(POP, timeout_s=5)
    assert answer["id"] and answer["chat"] is True
    return rid, answer


def journal_before_the_crash(tmp_path: Path, answer: dict[str, Any], genkey: str) -> Path:
    """What the worker records before generating; the process then dies."""
    path = journal_path(POP["name"], tmp_path / "state")
    Journal(path).add(
        JournalEntry(answer["id"], "chat", POP["model_id"], genkey, time.time() + answer["ttl"])
    )
    return path


def restart(path: Path, horde: DevHorde, kcpp_url: str) -> RecoveryResult:
    """The next start: a new journal object on the same file, recovered with real clients."""
    backend = KoboldClient(kcpp_url)
    try:
        with client(horde) as h:
            return recover(
                Journal(path), horde=h, backend=backend, model_id_default="unused"
            )
    finally:
        backend.close()


def test_a_chat_job_in_hand_at_a_crash_is_faulted_and_its_request_requeued(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, tmp_path: Path
) -> None:
    rid, answer = pop_chat_job(horde)
    job_id = answer["id"]
    path = journal_before_the_crash(tmp_path, answer, GENKEY)
    orphan = kcpp.local_generate(60.0, genkey=GENKEY)  # the dead worker's generation runs on
    deadline = time.monotonic() + 5
    while not kcpp.generating and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kcpp.generating
    assert horde.job(job_id)["action"] is None  # the Horde still holds the job

    result = restart(path, horde, kcpp.url)

    assert result == RecoveryResult(faulted=1)
    job = horde.job(job_id)
    assert job is not None and job["action"] == "faulted"
    faults = [e for e in horde.ledger if e["job_id"] == job_id]
    assert [(e["action"], e["status"]) for e in faults] == [("faulted", 200)]
    assert faults[0]["body"] == {"id": job_id, "state": "faulted", "model_id": MODEL}
    status = horde.status(rid)
    assert (status["state"], status["restarted"]) == ("waiting", 1)

    # The abort reached koboldcpp with the genkey and stopped the orphaned generation.
    orphan.join(5)
    assert not orphan.is_alive()
    assert kcpp.aborts == [GENKEY]
    aborts = [r for r in kcpp.requests if r["path"] == "/api/extra/abort"]
    assert [r["body"] for r in aborts] == [{"genkey": GENKEY}]
    assert "apikey" not in aborts[0]["headers"]
    assert all(API_KEY not in str(r) for r in kcpp.requests)

    # The journal is clear, and the request is served by the next pop.
    assert Journal(path).load() == []
    with client(horde) as h:
        again = h.pop(POP, timeout_s=5)
    assert again["id"] and again["id"] != job_id
    assert horde.job(again["id"])["request_id"] == rid


def test_a_reply_accepted_just_before_the_crash_is_sent_again_not_faulted(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, tmp_path: Path
) -> None:
    """The worker keeps the reply in the journal before it sends it; the Horde stored
    it and the process died before its answer: the next start sends the same reply,
    answered DuplicateGen at no cost, never a fault (which would re-open the request)."""
    rid, answer = pop_chat_job(horde)
    job_id = answer["id"]
    path = journal_before_the_crash(tmp_path, answer, GENKEY)
    reply = {"id": job_id, "message": {"role": "assistant", "content": "Blue."},
             "finish_reason": "stop", "model_id": MODEL, "state": "ok"}
    assert Journal(path).keep_reply(job_id, reply)
    with client(horde) as h:  # the reply was accepted; the process died before its answer
        h.submit(reply, timeout_s=5)

    result = restart(path, horde, kcpp.url)

    assert result == RecoveryResult(settled=1)
    ledger = [e for e in horde.ledger if e["job_id"] == job_id]
    assert [e["action"] for e in ledger] == ["submitted", "duplicate"]
    assert ledger[1]["body"] == reply  # the same reply, not a fault
    assert horde.status(rid)["state"] == "done"  # the reply stands
    assert kcpp.aborts == []  # its generation had ended
    assert Journal(path).load() == []


def test_a_reply_kept_at_a_crash_is_submitted_by_the_next_start(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, tmp_path: Path
) -> None:
    rid, answer = pop_chat_job(horde)
    job_id = answer["id"]
    path = journal_before_the_crash(tmp_path, answer, GENKEY)
    reply = {"id": job_id, "message": {"role": "assistant", "content": "Blue."},
             "finish_reason": "stop", "model_id": MODEL, "state": "ok"}
    journal = Journal(path)  # kept, not sent yet
    entry = journal.entry(job_id)
    assert entry is not None
    journal.add(replace(entry, terminal="reply_kept", reply=reply))

    result = restart(path, horde, kcpp.url)

    assert result.replied == 1 and result.kudos > 0
    assert [e["action"] for e in horde.ledger if e["job_id"] == job_id] == ["submitted"]
    assert horde.status(rid)["state"] == "done"
    assert Journal(path).load() == []


@pytest.mark.late_fault_expected
def test_a_job_whose_lease_ended_on_the_horde_is_counted_once(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, tmp_path: Path
) -> None:
    rid, answer = pop_chat_job(horde)
    job_id = answer["id"]
    path = journal_before_the_crash(tmp_path, answer, GENKEY)
    assert horde.expire_leases() == [job_id]  # the Horde's clock ran ahead of the worker's

    result = restart(path, horde, kcpp.url)

    # The worker's clock said the lease ran: as the real Horde, the fault of a job
    # that already ended is answered {"reward": 0}, and re-opens its request.
    assert result == RecoveryResult(faulted=1)
    assert [e["action"] for e in horde.ledger if e["job_id"] == job_id] == ["expired", "late_fault"]
    assert horde.status(rid)["restarted"] == 1
    assert [f["job_id"] for f in horde.late_faults] == [job_id]
    assert horde.worker(POP["name"])["uncompleted_jobs"] == 1  # type: ignore[index]


def test_an_entry_past_its_lease_sends_nothing(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, tmp_path: Path
) -> None:
    _, answer = pop_chat_job(horde)
    path = journal_path(POP["name"], tmp_path)
    Journal(path).add(
        JournalEntry(answer["id"], "chat", MODEL, GENKEY, time.time() - 1.0)
    )
    submits_before = [r for r in horde.requests_log if r["path"].endswith("/submit")]

    result = restart(path, horde, kcpp.url)

    assert result == RecoveryResult(expired=1)
    assert [r for r in horde.requests_log if r["path"].endswith("/submit")] == submits_before
    assert [r for r in kcpp.requests if r["path"] == "/api/extra/abort"] == []
    assert Journal(path).load() == []


def test_a_worker_started_against_another_horde_leaves_the_first_hordes_jobs_alone(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, tmp_path: Path,
    workers: Callable[..., WorkerProcess],
) -> None:
    """The journal holds a job popped from another Horde (its lease running): the
    worker started against the dev Horde sends it nothing there (it would be
    answered 404 and the job expire on its own Horde), says so in one line, and
    keeps it in the journal for a start against that Horde."""
    first = "http://127.0.0.1:9/"
    directory = tmp_path / "state"
    path = journal_path(WORKER_NAME, directory)
    Journal(path, horde=first).add(
        JournalEntry("other-job", "chat", MODEL, GENKEY, time.time() + 120.0)
    )
    worker = workers()
    worker.wait_for("left alone", 30)
    assert worker.said(
        "job journal: 1 job popped from http://127.0.0.1:9 left alone (this start serves "
        f"{horde.url.rstrip('/')}); kept in the journal for a start against that Horde"
    ) == 1, worker.log()
    worker.wait_for("started as", 30)
    assert not [r for r in horde.requests_log if r["path"].endswith("/submit")]
    worker.sigterm_to_clean_exit(20)
    (kept,) = Journal(path).load()
    assert (kept.job_id, kept.horde) == ("other-job", "http://127.0.0.1:9")
