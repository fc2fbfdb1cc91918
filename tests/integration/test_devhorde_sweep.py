"""The dev Horde where the real AI Horde decides an outcome: a faulted request comes
straight back (to the worker that faulted it too) until the sweep faults it, a job
expires at the first sweep after its ttl, and a Horde without the chat routes ignores
the chat declaration, ``prompt_jobs: false`` included. The differences kept on
purpose (``max_attempts``, ``sweep_s=0``) are named by a test each.
"""

from __future__ import annotations

import time

import requests

from koboldcpp_horde_chat.devkit.horde import DevHorde
from tests.integration.test_devhorde import KEY, MODEL, USER_ONLY, Worker, decl, reply


def _fault(w: Worker, job_id: str) -> None:
    r = w.submit({"id": job_id, "state": "faulted", "model_id": MODEL})
    assert (r.status_code, r.json()) == (200, {"reward": 0})


def test_a_faulted_request_comes_straight_back_to_the_same_worker_until_the_sweep() -> None:
    """The real Horde's faulted submit runs wp.n += 1: the request is back at the head
    of the queue at once, ahead of a request sent after it, for the worker that
    faulted it; only its sweep (every 60 s) faults a request with more than 2 faulted
    jobs. Before, the dev Horde faulted it at once at its 3rd faulted job."""
    with DevHorde(api_keys=(KEY,), sweep_s=3600.0) as h:
        w = Worker(h)
        bad = h.send_chat(USER_ONLY, best_effort=True)
        good = h.send_chat(USER_ONLY, best_effort=True)
        handed: list[str] = []
        for _ in range(5):
            job = w.pop(decl())
            assert h.job(job["id"])["request_id"] == bad  # type: ignore[index]
            handed.append(job["id"])
            _fault(w, job["id"])
        assert len(set(handed)) == 5  # a new job id at each pop
        assert h.status(bad)["state"] == "waiting"  # 5 faulted jobs, no sweep yet
        assert h.worker("w1")["aborted_jobs"] == 5  # type: ignore[index]
        h.sweep()
        assert h.status(bad)["state"] == "faulted"
        job = w.pop(decl())
        assert h.job(job["id"])["request_id"] == good  # type: ignore[index]


def test_the_sweep_faults_a_request_only_past_two_faulted_jobs() -> None:
    with DevHorde(api_keys=(KEY,), sweep_s=3600.0) as h:
        w = Worker(h)
        rid = h.send_chat(USER_ONLY, best_effort=True)
        for _ in range(2):
            _fault(w, w.pop(decl())["id"])
        h.sweep()
        assert h.status(rid)["state"] == "waiting"
        _fault(w, w.pop(decl())["id"])
        h.sweep()
        assert h.status(rid)["state"] == "faulted"


def test_the_sweep_runs_by_itself_every_sweep_s() -> None:
    with DevHorde(api_keys=(KEY,), sweep_s=0.5) as h:
        w = Worker(h)
        rid = h.send_chat(USER_ONLY, best_effort=True)
        for _ in range(3):
            _fault(w, w.pop(decl())["id"])
        time.sleep(0.6)
        assert h.status(rid)["state"] == "faulted"


def test_a_job_without_a_submit_expires_at_the_first_sweep_after_its_ttl() -> None:
    """The real Horde aborts a stale job only in its sweep: 0-60 s after the ttl a
    late submit is still taken; at the sweep the job is aborted (the worker's aborted
    count + 1) and its request goes back to the queue."""
    with DevHorde(api_keys=(KEY,), ttl_s=0.2, sweep_s=1.5) as h:
        w = Worker(h)
        h.send_chat(USER_ONLY, best_effort=True)
        rid = h.send_chat(USER_ONLY, best_effort=True)
        first = w.pop(decl())["id"]
        lost = w.pop(decl())["id"]
        time.sleep(0.4)  # both ttls passed; the sweep has not come
        late = w.submit(reply(first))
        assert late.status_code == 200, late.text
        assert h.job(lost)["action"] is None  # type: ignore[index]
        time.sleep(1.3)
        assert h.job(lost)["action"] == "expired"  # type: ignore[index]
        assert h.worker("w1")["aborted_jobs"] == 1  # type: ignore[index]
        assert h.status(rid)["state"] == "waiting"
        assert w.pop(decl())["id"] in h.status(rid)["job_ids"]


def test_difference_on_purpose_max_attempts_faults_a_request_at_once() -> None:
    """Not on the real Horde: a request sent with max_attempts faults at its n-th
    faulted job, without a sweep (a test hook)."""
    with DevHorde(api_keys=(KEY,), sweep_s=3600.0) as h:
        w = Worker(h)
        rid = h.send_chat(USER_ONLY, best_effort=True, max_attempts=1)
        _fault(w, w.pop(decl())["id"])
        assert h.status(rid)["state"] == "faulted"


def test_difference_on_purpose_sweep_s_zero_expires_a_job_at_its_ttl() -> None:
    """Not on the real Horde: sweep_s=0 sweeps at every call, so a job expires at its ttl."""
    with DevHorde(api_keys=(KEY,), ttl_s=0.2, sweep_s=0) as h:
        w = Worker(h)
        h.send_chat(USER_ONLY, best_effort=True)
        job_id = w.pop(decl())["id"]
        time.sleep(0.3)
        assert h.job(job_id)["action"] == "expired"  # type: ignore[index]


def test_a_request_that_leaves_validated_backends_out_goes_to_any_backend() -> None:
    """The real Horde's parser defaults validated_backends to false."""
    with DevHorde(api_keys=(KEY,)) as h:
        w = Worker(h)
        rid = h.send_text("Hello")
        job = w.pop(decl(bridge_agent="some-bridge:1:nowhere"))
        assert job["id"] in h.status(rid)["job_ids"]


def test_a_horde_without_chat_routes_ignores_the_chat_declaration_and_prompt_jobs() -> None:
    """As the real Horde: the chat keys are unknown and ignored without a word, so a
    chat-only pop (prompt_jobs: false) gets text jobs; the chat routes are not there."""
    with DevHorde(api_keys=(KEY,), chat_routes=False) as h:
        w = Worker(h)
        rid = h.send_text("Hello")
        job = w.pop(decl(prompt_jobs=False))
        assert job["id"] in h.status(rid)["job_ids"] and "chat" not in job
        assert h.worker("w1")["accepts_prompt_jobs"] is True  # type: ignore[index]
        r = requests.post(
            h.url + "/api/v2/generate/chat/async", json={**USER_ONLY, "horde": {}}, timeout=5
        )
        assert r.status_code == 404
        assert w.pop(decl(prompt_jobs=False, chat_features=["bogus"], model_id=None))["id"] is None
