"""The dev Horde is as strict as the real AI Horde where jobs get lost (over HTTP, no worker code).

Seed 000 "7. Fault a job": a worker's aborted job count rises with each job it
drops, and a worker that aborts more than 20 jobs in an hour is put into
maintenance. As on the real Horde, a job whose lease runs out without a submit is
an aborted job just as a faulted one is; a fault for a job that already ended is
answered ``200 {"reward": 0}``; and a worker name is at most 100 characters.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from koboldcpp_horde_chat.devkit.horde import DevHorde
from tests.integration.test_devhorde import (
    KEY,
    MODEL,
    POP,
    USER_ONLY,
    Worker,
    decl,
    reply,
)

TTL_S = 0.5


@pytest.fixture
def horde() -> Iterator[DevHorde]:
    with DevHorde(api_keys=(KEY,), ttl_s=TTL_S, sweep_s=0) as h:
        yield h


@pytest.fixture
def w(horde: DevHorde) -> Worker:
    return Worker(horde)


def fault(job_id: str) -> dict[str, Any]:
    return {"id": job_id, "state": "faulted", "model_id": MODEL}


def counts(horde: DevHorde, name: str = "w1") -> tuple[int, int, bool]:
    """(aborted_jobs this hour, uncompleted_jobs, maintenance_mode) of a worker."""
    details = horde.worker(name)
    assert details is not None
    return details["aborted_jobs"], details["uncompleted_jobs"], details["maintenance_mode"]


def pop_jobs(horde: DevHorde, w: Worker, n: int, name: str = "w1") -> list[str]:
    """Pop ``n`` jobs of ``n`` one-attempt requests (a lost job does not come back)."""
    for _ in range(n):
        horde.send_chat(USER_ONLY, best_effort=True, max_attempts=1)
    ids = [w.pop(decl(name))["id"] for _ in range(n)]
    assert all(ids) and len(set(ids)) == n
    return ids


def lose(horde: DevHorde, w: Worker, n: int) -> list[str]:
    """Pop ``n`` jobs, submit none, and let their ttl run out."""
    ids = pop_jobs(horde, w, n)
    time.sleep(TTL_S + 0.2)
    return ids


# --- aborted jobs ------------------------------------------------------------------------


def test_a_popped_job_never_submitted_counts_as_aborted_once_its_ttl_runs_out(
    horde: DevHorde, w: Worker
) -> None:
    rid = horde.send_chat(USER_ONLY, best_effort=True)
    job = w.pop(decl())
    assert job["ttl"] == TTL_S
    assert counts(horde) == (0, 0, False)  # a job in hand is not aborted
    time.sleep(TTL_S + 0.2)
    assert counts(horde) == (1, 1, False)  # seen at the next look, with no call in between
    assert [e["action"] for e in horde.ledger] == ["expired"]
    assert horde.status(rid)["restarted"] == 1


def test_a_faulted_job_counts_as_aborted(horde: DevHorde, w: Worker) -> None:
    (job_id,) = pop_jobs(horde, w, 1)
    assert w.submit(fault(job_id)).json() == {"reward": 0}
    assert counts(horde) == (1, 1, False)


def test_a_submitted_or_cancelled_job_is_not_aborted(horde: DevHorde, w: Worker) -> None:
    (job_id,) = pop_jobs(horde, w, 1)
    assert w.submit(reply(job_id)).status_code == 200
    rid = horde.send_chat({**USER_ONLY, "stream": True}, best_effort=True)
    streamed = w.pop(decl())["id"]
    assert w.progress(streamed, 1, content="Blue").status_code == 200
    horde.cancel(rid)  # settled on the posted content
    time.sleep(TTL_S + 0.2)
    assert counts(horde) == (0, 0, False)


# --- maintenance ------------------------------------------------------------------------


def test_21_lost_jobs_in_an_hour_put_the_worker_into_maintenance(horde: DevHorde, w: Worker) -> None:
    lose(horde, w, 20)
    assert counts(horde) == (20, 20, False)  # 20 is not more than 20
    assert w.post(POP, decl()).status_code == 200
    lose(horde, w, 1)
    # The 21st: maintenance, and the count starts again from 0 (the real Horde's rule).
    assert counts(horde) == (0, 21, True)
    horde.send_chat(USER_ONLY, best_effort=True)
    refused = w.post(POP, decl())
    assert refused.status_code == 403
    assert refused.json()["rc"] == "WorkerMaintenance"
    assert "maintenance" in refused.json()["message"]
    assert horde.pops[-1]["status"] == 403
    # Another worker of the same owner still gets the job the refused pop left waiting.
    assert w.pop(decl("w2"))["id"] is not None


def test_faults_and_lost_jobs_count_together(horde: DevHorde, w: Worker) -> None:
    for job_id in pop_jobs(horde, w, 10):
        assert w.submit(fault(job_id)).json() == {"reward": 0}
    lose(horde, w, 11)
    assert counts(horde) == (0, 21, True)
    assert w.post(POP, decl()).json()["rc"] == "WorkerMaintenance"


def test_the_owner_ends_maintenance_and_a_job_popped_before_it_is_still_served(
    horde: DevHorde, w: Worker
) -> None:
    (kept,) = pop_jobs(horde, w, 1)
    horde.set_maintenance("w1", True)
    refused = w.post(POP, decl())
    assert (refused.status_code, refused.json()["rc"]) == (403, "WorkerMaintenance")
    assert w.submit(reply(kept)).status_code == 200  # the submit is not refused
    horde.set_maintenance("w1", False)
    assert w.post(POP, decl()).status_code == 200
    assert counts(horde) == (0, 0, False)
    with pytest.raises(KeyError):
        horde.set_maintenance("never-popped", True)


def test_the_count_starts_again_when_an_abort_comes_after_the_window() -> None:
    window_s = 2.0
    with DevHorde(api_keys=(KEY,), aborted_jobs_window_s=window_s) as h:
        w = Worker(h)
        jobs = pop_jobs(h, w, 20)
        started = time.monotonic()  # the window opens with the first fault, after this
        first_answered = 0.0
        for job_id in jobs:
            w.submit(fault(job_id))
            first_answered = first_answered or time.monotonic()
        assert time.monotonic() - started < window_s, "the machine is too slow for this window"
        assert counts(h) == (20, 20, False)
        time.sleep(max(0.0, window_s + 0.1 - (time.monotonic() - first_answered)))
        (late,) = pop_jobs(h, w, 1)
        w.submit(fault(late))
        assert counts(h) == (1, 21, False)  # a new window, not the 21st of the old one


# --- submits for jobs that ended ----------------------------------------------------------


def _ended_job(horde: DevHorde, w: Worker, how: str) -> str:
    if how == "cancelled":
        rid = horde.send_chat({**USER_ONLY, "stream": True}, best_effort=True)
        job_id = str(w.pop(decl())["id"])
        assert w.progress(job_id, 1, content="Blue").status_code == 200
        horde.cancel(rid)
        return job_id
    (job_id,) = pop_jobs(horde, w, 1)
    if how == "expired":
        time.sleep(TTL_S + 0.2)
    elif how == "faulted":
        assert w.submit(fault(job_id)).status_code == 200
    return job_id


@pytest.mark.parametrize("how", ["expired", "faulted", "cancelled"])
def test_a_fault_for_a_job_that_ended_is_answered_reward_0_and_reopens_its_request(
    horde: DevHorde, w: Worker, how: str
) -> None:
    """As the real Horde's set_generation: wp.n += 1 for every faulted submit, before
    it looks at the job; the worker's counts are unchanged."""
    job_id = _ended_job(horde, w, how)
    before = counts(horde)
    late = w.submit(fault(job_id))
    assert (late.status_code, late.json()) == (200, {"reward": 0})
    assert horde.ledger[-1]["action"] == "late_fault"
    assert [(f["job_id"], f["ended"]) for f in horde.late_faults] == [
        (job_id, "expired" if how == "expired" else "faulted" if how == "faulted" else "cancelled")
    ]
    assert counts(horde) == before


def test_a_fault_for_an_accepted_job_is_duplicate_gen_and_generates_the_request_again(
    horde: DevHorde, w: Worker
) -> None:
    (job_id,) = pop_jobs(horde, w, 1)
    assert w.submit(reply(job_id)).status_code == 200
    rid = horde.job(job_id)["request_id"]  # type: ignore[index]
    assert horde.status(rid)["state"] == "done"
    late = w.submit(fault(job_id))
    assert (late.status_code, late.json()["rc"]) == (400, "DuplicateGen")
    assert [(f["job_id"], f["ended"]) for f in horde.late_faults] == [(job_id, "submitted")]
    assert horde.status(rid)["state"] == "waiting"  # another worker generates it again


@pytest.mark.parametrize("how", ["expired", "faulted", "cancelled"])
def test_a_reply_for_a_job_that_ended_is_still_aborted_gen(horde: DevHorde, w: Worker, how: str) -> None:
    job_id = _ended_job(horde, w, how)
    late = w.submit(reply(job_id))
    assert (late.status_code, late.json()["rc"]) == (400, "AbortedGen")
    assert horde.ledger[-1]["action"] == "aborted_gen"


# --- worker names -------------------------------------------------------------------------


def test_a_worker_name_over_100_characters_is_refused(horde: DevHorde, w: Worker) -> None:
    assert w.post(POP, decl("n" * 100)).status_code == 200
    refused = w.post(POP, decl("n" * 101))
    assert (refused.status_code, refused.json()["rc"]) == (400, "TooLongWorkerName")
    assert "100" in refused.json()["message"]
    assert horde.worker("n" * 101) is None and horde.worker("n" * 100) is not None


def test_the_worker_details_route_shows_maintenance(horde: DevHorde, w: Worker) -> None:
    lose(horde, w, 21)
    details = requests.get(f"{horde.url}/api/v2/workers/name/w1", timeout=5).json()
    assert (details["maintenance_mode"], details["uncompleted_jobs"]) == (True, 21)
