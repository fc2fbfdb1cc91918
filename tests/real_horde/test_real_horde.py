"""The worker against the real AI Horde server: text jobs (the real Horde has no chat
routes) from a second user, served by ``python -m koboldcpp_horde_chat`` with a scripted
koboldcpp, judged by what the Horde recorded in its database (``workers``,
``processing_gens``, ``waiting_prompts``, ``kudos_ledger``).

Where the real Horde acts on timers the tests wait for them: a job with no submit is
aborted by a sweep every 60 s once its 150 s ttl has passed, and a request faulted
more than twice is given up by the same sweep.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from koboldcpp_horde_chat.devkit.kcpp import Fault, ScriptedReply

from .conftest import KNOWN_MODEL, KNOWN_PARAMETERS, OnRealHorde, needs_real_horde, poll, text_kudos

pytestmark = needs_real_horde()

REPLY = "The lighthouse keeper found a bottle on the shore and read the note inside it."
PROMPT = "Once upon a time"
#: The worker's line when its guard stops the popping short of the Horde's maintenance.
GUARD_LINE = "not popping, to stay out of maintenance"
#: The worker's line when koboldcpp failed its generations in a row.
STREAK_LINE = "failed 3 generations in a row: not popping"


def _reply(on_real: OnRealHorde, text: str = REPLY) -> None:
    on_real.kcpp.script(lambda body: ScriptedReply(text=text))


def _slow(on_real: OnRealHorde, seconds: float, first_only: bool = False) -> None:
    """Each generation (or only the first) takes about ``seconds``: 40 tokens."""
    on_real.kcpp.token_delay_s = seconds / 40
    calls: list[int] = []

    def script(body: dict[str, Any]) -> ScriptedReply:
        calls.append(1)
        if first_only and len(calls) > 1:
            on_real.kcpp.token_delay_s = 0.0
        return ScriptedReply(text="sky " * 40)

    on_real.kcpp.script(script)


def _fail_marked(marker: str) -> Any:
    """koboldcpp's rule: a text generation whose prompt holds ``marker`` fails (500)."""

    def rule(route: str, body: Any) -> Fault | None:
        if route == "generate" and isinstance(body, dict) and marker in str(body.get("prompt")):
            return 500, {"detail": {"msg": "scripted failure"}}
        return None

    return rule


def test_a_reply_is_rewarded_and_the_request_done(on_real: OnRealHorde) -> None:
    """One request, one job: the reply is the request's generation, the worker
    fulfilled it without an aborted job, and the owner is credited what the Horde
    pays a trusted owner's unknown model."""
    _reply(on_real)
    rid = on_real.send_text(PROMPT, max_length=64)
    on_real.start_worker()
    on_real.wait_done([rid], 60)
    (job,) = on_real.jobs(rid)
    assert job["generation"].strip() == REPLY
    assert not job["faulted"] and job["worker"] == on_real.name
    worker = on_real.worker()
    assert worker is not None
    assert (worker["fulfilments"], worker["aborted_jobs"], worker["uncompleted_jobs"]) == (1, 0, 0)
    credited = on_real.credits(job["id"])
    assert credited == [pytest.approx(text_kudos(job["generation"], PROMPT, 64, parameters_b=None),
                                      abs=0.01)]


def test_a_fault_reopens_the_request_and_the_worker_serves_it_again(
    on_real: OnRealHorde,
) -> None:
    """koboldcpp fails the first generation: the worker faults the job, the Horde
    counts it aborted and re-opens the request, which comes back to this worker
    and is served."""
    _reply(on_real)
    on_real.kcpp.inject("generate", (500, {"detail": {"msg": "scripted failure"}}))
    rid = on_real.send_text(PROMPT)
    worker_proc = on_real.start_worker()
    on_real.wait_done([rid], 60)
    first, second = on_real.jobs(rid)
    assert first["faulted"] and first["generation"] is None
    assert not second["faulted"] and second["generation"].strip() == REPLY
    worker = on_real.worker()
    assert worker is not None and (worker["aborted_jobs"], worker["fulfilments"]) == (1, 1)
    assert worker_proc.said(f"job={first['id']} kind=text faulted") == 1


def test_sigterm_mid_job_faults_it_so_the_request_is_reopened_at_once(
    on_real: OnRealHorde,
) -> None:
    """SIGTERM while koboldcpp generates a 30 s job: the worker exits within its
    stop grace having faulted the job, so the Horde re-opens the request now
    rather than at the job's expiry minutes later; a worker started after serves it."""
    _slow(on_real, 30.0)
    rid = on_real.send_text(PROMPT)
    worker_proc = on_real.start_worker("--stop-grace", "1")
    poll(lambda: on_real.kcpp.generating, 60, on_real.why)
    took = worker_proc.sigterm_to_clean_exit(10.0)
    assert took < 5.0, worker_proc.log()
    (job,) = on_real.jobs(rid)
    assert job["faulted"] and job["generation"] is None
    assert on_real.request(rid)["n"] == 1
    worker = on_real.worker()
    assert worker is not None and worker["aborted_jobs"] == 1
    on_real.kcpp.token_delay_s = 0.0
    _reply(on_real)
    on_real.start_worker()
    on_real.wait_done([rid], 60)
    assert len(on_real.jobs(rid)) == 2


def test_sigkill_mid_job_then_a_restart_faults_it_from_the_journal(
    on_real: OnRealHorde,
) -> None:
    """SIGKILL while koboldcpp generates: the job is left open on the Horde. The
    restarted worker finds it in its journal and faults it at once (the request is
    re-opened well before the Horde's 150 s expiry would) and then serves it."""
    _slow(on_real, 30.0)
    rid = on_real.send_text(PROMPT)
    first_proc = on_real.start_worker()
    poll(lambda: on_real.kcpp.generating, 60, on_real.why)
    first_proc.stop()  # SIGKILL
    (job,) = on_real.jobs(rid)
    assert not job["faulted"] and job["generation"] is None  # open on the Horde
    killed_at = time.monotonic()
    on_real.kcpp.token_delay_s = 0.0
    _reply(on_real)
    on_real.start_worker()
    on_real.wait_done([rid], 60)
    assert time.monotonic() - killed_at < 60.0
    first, second = on_real.jobs(rid)
    assert first["id"] == job["id"] and first["faulted"] and first["generation"] is None
    assert second["generation"].strip() == REPLY
    worker = on_real.worker()
    assert worker is not None and (worker["aborted_jobs"], worker["fulfilments"]) == (1, 1)


@pytest.mark.slow
def test_a_job_running_past_its_lease_is_faulted_within_it_and_nothing_is_sent_late(
    on_real: OnRealHorde,
) -> None:
    """koboldcpp's first generation would take 400 s, past the job's 150 s lease
    (the pop's ttl): the worker stops it and faults the job before the lease ends,
    before the Horde's sweep could abort it (150 to 210 s after the pop), and
    serves the request once its re-measured speed lets it declare the request's
    length again. Exactly two jobs: a fault sent late would have re-opened the
    request a second time, a reply sent late would have given the first job a
    generation."""
    _slow(on_real, 400.0, first_only=True)
    rid = on_real.send_text(PROMPT)
    worker_proc = on_real.start_worker()
    poll(lambda: len(on_real.jobs(rid)) == 1, 60, on_real.why)
    first_id = on_real.jobs(rid)[0]["id"]
    ages: list[float] = []

    def faulted() -> bool:
        (row,) = on_real.horde.sql(
            "select faulted, extract(epoch from (now() at time zone 'utc') - created) "
            f"from processing_gens where id = '{first_id}'"
        )
        ages.append(float(row[1]))
        return row[0] == "t"

    poll(faulted, 240, on_real.why)
    assert ages[-1] < 150.0, on_real.why()  # the worker's fault, within the ttl
    on_real.wait_done([rid], 150)
    time.sleep(10)  # anything late would land now
    first, second = on_real.jobs(rid)
    assert first["id"] == first_id and first["faulted"] and first["generation"] is None
    assert second["generation"] is not None
    assert on_real.request(rid)["n"] == 0
    worker = on_real.worker()
    assert worker is not None and (worker["aborted_jobs"], worker["fulfilments"]) == (1, 1)
    assert worker_proc.said(f"job={first_id} kind=text faulted") == 1
    assert worker_proc.said(f"job={first_id} kind=text submitted") == 0
    assert on_real.kcpp.aborts, "koboldcpp's generation was not stopped"


@pytest.mark.slow
def test_maintenance_set_by_the_owner_pauses_the_worker_until_lifted(
    on_real: OnRealHorde,
) -> None:
    """The owner puts the worker into maintenance: its pops are refused
    (WorkerMaintenance, the owner's message in the worker's line), a client's
    request waits; once the owner lifts it the worker pops again within its
    minute's wait and serves the request."""
    _reply(on_real)
    worker_proc = on_real.start_worker()
    poll(lambda: on_real.worker() is not None, 60, on_real.why)
    worker = on_real.worker()
    assert worker is not None
    on_real.set_maintenance(worker["id"], True, "back after the upgrade")
    worker_proc.wait_for("back after the upgrade", 30)
    rid = on_real.send_text(PROMPT)
    time.sleep(5)
    assert on_real.jobs(rid) == []
    worker = on_real.worker()
    assert worker is not None and worker["maintenance"]
    on_real.set_maintenance(worker["id"], False)
    on_real.wait_done([rid], 90)
    worker = on_real.worker()
    assert worker is not None and not worker["maintenance"] and worker["aborted_jobs"] == 0


@pytest.mark.slow
def test_koboldcpp_failing_in_a_row_stops_the_popping_far_from_maintenance(
    on_real: OnRealHorde,
) -> None:
    """koboldcpp fails every generation of 20 marked requests, queued before 8 good
    ones (a user may have 30 waiting). The real Horde hands a faulted request
    straight back to the same worker, so the failures come in a row: the worker
    stops popping and probes koboldcpp a few aborted jobs into the Horde's hour
    (maintenance above 20), and its guard never has to stop it. Once koboldcpp
    generates again, the next probe succeeds and what waits is served."""
    _reply(on_real)
    failing, broken = _fail_marked("FAIL"), [True]
    on_real.kcpp.fail_when(lambda route, body: failing(route, body) if broken[0] else None)
    for i in range(20):
        on_real.send_text(f"FAIL {i}")
    good = [on_real.send_text(f"Once {i}") for i in range(8)]
    worker_proc = on_real.start_worker()
    poll(lambda: worker_proc.said(STREAK_LINE) > 0, 120, on_real.why)
    jobs = len(on_real.worker_jobs())
    time.sleep(5)
    assert len(on_real.worker_jobs()) == jobs  # stopped
    worker = on_real.worker()
    assert worker is not None
    assert not worker["maintenance"]
    assert worker["aborted_jobs"] <= 3, on_real.why()
    broken[0] = False  # koboldcpp generates again: the probe (60 s after the stop) succeeds
    on_real.wait_done(good, 240)
    assert worker_proc.said(GUARD_LINE) == 0, on_real.why()
    worker = on_real.worker()
    assert worker is not None and not worker["maintenance"]


def test_a_request_that_always_fails_costs_at_most_three_faults(on_real: OnRealHorde) -> None:
    """One request koboldcpp always fails, queued before 10 good ones. The real Horde
    hands a faulted request straight back to the same worker: the worker faults it
    at most 3 times, serves the 10 others and is not paused."""
    _reply(on_real)
    on_real.kcpp.fail_when(_fail_marked("FAIL"))
    bad = on_real.send_text("FAIL always")
    good = [on_real.send_text(f"Once {i}") for i in range(10)]
    worker_proc = on_real.start_worker()
    poll(lambda: worker_proc.said(GUARD_LINE) > 0 or on_real.done(good) == len(good), 120,
         on_real.why)
    assert worker_proc.said(GUARD_LINE) == 0, on_real.why()
    faulted = [j for j in on_real.jobs(bad) if j["faulted"]]
    assert len(faulted) <= 3, on_real.why()
    worker = on_real.worker()
    assert worker is not None and not worker["maintenance"]
    late = on_real.send_text("Once more")  # still popping
    on_real.wait_done([late], 30)


@pytest.mark.parametrize("on_real", [{"model_name": KNOWN_MODEL}], indirect=True)
def test_a_validated_bridge_agent_earns_the_full_reward_of_a_known_model(
    on_real: OnRealHorde,
) -> None:
    """The worker's bridge agent is one the Horde validates: a known 7 B model's
    reply earns the full reward, not the 30 % of an unvalidated backend."""
    _reply(on_real)
    rid = on_real.send_text(PROMPT, max_length=64)
    on_real.start_worker()
    on_real.wait_done([rid], 60)
    (job,) = on_real.jobs(rid)
    worker = on_real.worker()
    assert worker is not None and worker["bridge_agent"].startswith("KoboldCppEmbedWorker:2:")
    full = text_kudos(job["generation"], PROMPT, 64, parameters_b=KNOWN_PARAMETERS / 1e9)
    cut = text_kudos(job["generation"], PROMPT, 64, parameters_b=KNOWN_PARAMETERS / 1e9,
                     validated=False)
    assert full > cut
    assert on_real.credits(job["id"]) == [pytest.approx(full, abs=0.005)]


@pytest.mark.parametrize("on_real", [{"parallel_requests": 2}], indirect=True)
def test_two_slots_on_a_new_worker_name_serve_every_request_once(on_real: OnRealHorde) -> None:
    """--parallelrequests 2 under a name the Horde has never seen: both slots' first
    pops create the same worker at once (the Horde answers one of them 500), yet
    every request is served once, by one worker of 2 threads, without an aborted job."""
    on_real.kcpp.token_delay_s = 2.0 / 40
    _reply(on_real, "sky " * 40)
    rids = [on_real.send_text(f"Once {i}") for i in range(6)]
    worker_proc = on_real.start_worker("--parallelrequests", "2")
    on_real.wait_done(rids, 90)
    worker = on_real.worker()
    assert worker is not None
    assert (worker["threads"], worker["aborted_jobs"], worker["fulfilments"]) == (2, 0, 6)
    assert all(len(on_real.jobs(r)) == 1 for r in rids)
    assert worker_proc.proc.poll() is None
