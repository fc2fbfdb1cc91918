"""The seams of a job's life, driven against the real worker process.

Each test sends a real signal, a SIGKILL, a failing submit or a koboldcpp
restart at one instant of a job's life (a pop in flight beside a submit, the
messages fetch, the token count, a submit being retried, a job waiting behind
a submit) and checks what an operator cares about: every popped job ends in
one terminal action (or is faulted by the next start), no job outlives the
stop's deadline, and nothing is served under limits koboldcpp no longer has.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

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

ASK = {"messages": [{"role": "user", "content": "Tell me about the sky."}]}


def stop_and_time(worker: WorkerProcess) -> float:
    return worker.sigterm_to_clean_exit(STOP_BOUND_S + 10)


def one_each(horde: DevHorde) -> dict[str, str]:
    actions = terminal_actions(horde)
    assert all(len(a) == 1 for a in actions.values()), actions
    return {job_id: a[0] for job_id, a in actions.items()}


# --- one deadline per job: the stop holds in every phase ----------------------------------


def test_a_job_whose_pop_was_beside_the_submit_at_the_signal_ends_by_the_stops_deadline(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    """The pop sent beside the first job's submit is in flight at SIGTERM; the job it
    brings after the grace is faulted at once, not served in full."""
    kcpp.token_delay_s = 0.01
    kcpp.script(
        lambda body: ScriptedReply(text="sky " * (40 if "first" in json.dumps(body) else 400))
    )
    first = horde.send_chat({"messages": [{"role": "user", "content": "first"}]}, best_effort=True)
    second = horde.send_chat({"messages": [{"role": "user", "content": "second"}]},
                             best_effort=True)
    horde.inject("pop", "ok", "hang:1.2")  # the second pop answers 1.2 s after it is sent
    worker = workers("--stop-grace", str(GRACE_S))
    until(lambda: "submitted" in terminal_actions(horde).get(
        (job_ids(horde, first) or ["?"])[0], []), 20, worker.log)
    took = stop_and_time(worker)
    assert took < STOP_BOUND_S, worker.log()
    (late,) = job_ids(horde, second)
    assert one_each(horde)[late] == "faulted"
    assert worker.said(f"job={late} kind=chat faulted") == 1


@pytest.mark.parametrize("horde", [{"offload_bytes": 0}], indirect=True)
def test_a_stop_during_the_messages_fetch_ends_within_the_grace(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    rid = horde.send_chat(ASK, best_effort=True)
    horde.inject("storage", "hang:30")
    worker = workers("--stop-grace", str(GRACE_S))
    until(lambda: bool(job_ids(horde, rid)), 20, worker.log)
    time.sleep(0.3)  # the fetch is under way
    took = stop_and_time(worker)
    assert took < STOP_BOUND_S, worker.log()
    (job_id,) = job_ids(horde, rid)
    assert one_each(horde) == {job_id: "faulted"}
    assert not [r for r in kcpp.requests if r["path"] == "/v1/chat/completions"]


def test_a_stop_during_the_token_count_ends_within_the_grace(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    rid = horde.send_chat(ASK, best_effort=True)
    kcpp.inject("tokencount", "hang:30")
    worker = workers("--stop-grace", str(GRACE_S))
    until(lambda: bool(job_ids(horde, rid)), 20, worker.log)
    time.sleep(0.3)
    took = stop_and_time(worker)
    assert took < STOP_BOUND_S, worker.log()
    (job_id,) = job_ids(horde, rid)
    assert one_each(horde) == {job_id: "faulted"}


# --- journaled from the pop's answer -------------------------------------------------------


@pytest.mark.parametrize("horde", [{"offload_bytes": 0}], indirect=True)
@pytest.mark.parametrize("step", ["messages fetch", "token count"])
def test_a_job_killed_before_its_generation_is_faulted_by_the_next_start(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess], tmp_path: Path,
    step: str,
) -> None:
    rid = horde.send_chat(ASK, best_effort=True)
    if step == "messages fetch":
        horde.inject("storage", "hang:30")
    else:
        kcpp.inject("tokencount", "hang:30")
    first = workers()
    until(lambda: bool(job_ids(horde, rid)), 20, first.log)
    time.sleep(0.3)
    (job_id,) = job_ids(horde, rid)
    journaled = json.loads(journal_path(WORKER_NAME, tmp_path / "state").read_text())["jobs"]
    assert [e["job_id"] for e in journaled] == [job_id]
    assert journaled[0]["genkey"].startswith("HORDEREQ_")  # made at the pop's answer
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert terminal_actions(horde) == {}

    second = workers()
    until(lambda: job_id in terminal_actions(horde), 20, second.log)
    assert terminal_actions(horde)[job_id] == ["faulted"]
    assert second.said(f"job={job_id} kind=chat faulted after a restart") <= 1


# --- the pop beside the submit never costs a job --------------------------------------------


def test_a_failing_submit_does_not_hold_the_job_popped_beside_it(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    """The first job's submit gets 503 and is retried on its own; the second job,
    popped beside it, is served and submitted meanwhile; no pop while it retries."""
    kcpp.token_delay_s = 0.005
    kcpp.script(lambda body: ScriptedReply(text="sky " * 20))
    first = horde.send_chat({"messages": [{"role": "user", "content": "first"}]}, best_effort=True)
    second = horde.send_chat({"messages": [{"role": "user", "content": "second"}]},
                             best_effort=True)
    horde.inject("submit", (503, {"message": "down", "rc": "Unavailable"}, {"Retry-After": "3"}))
    worker = workers()
    assert horde.wait([first, second], timeout_s=30), worker.log()
    ids = {job_ids(horde, first)[0], job_ids(horde, second)[0]}
    assert one_each(horde) == {job_id: "submitted" for job_id in ids}
    (retried,) = [j for j in ids if worker.said(f"job={j} submit failed") == 1]
    (other,) = ids - {retried}
    calls = horde.requests_log
    submits = [c["at"] for c in calls if c["path"].endswith("/submit")
               and json.loads(c["body"]).get("id") == retried]
    failed_at, accepted_at = submits[0], submits[-1]
    pop_times = [c["at"] for c in calls if c["path"].endswith("/pop")]
    (other_popped_at,) = [
        at for at, pop in zip(pop_times, horde.pops, strict=True)
        if (pop.get("response") or {}).get("id") == other
    ]
    order = [e["job_id"] for e in horde.ledger if e["action"] == "submitted"]
    if other_popped_at < accepted_at:
        # The other job was in hand while the submit was retried (popped beside
        # it): it was served meanwhile, not behind the retries.
        assert order == [other, retried], worker.log()
    # Nothing else is popped while the submit is being retried (a job popped then
    # could not be delivered either); the pop beside the failing submit may
    # still be on its way just after it.
    assert [t for t in pop_times if failed_at + 1.0 < t < accepted_at] == [], worker.log()


# --- koboldcpp as it is now ------------------------------------------------------------------


def test_a_job_that_waited_while_koboldcpp_restarted_smaller_is_not_served_under_the_old_context(
    horde: DevHorde, tmp_path: Path
) -> None:
    """koboldcpp restarts from 4096 to 2048 tokens while a job popped beside a slow
    submit waits: the job is not sent to koboldcpp under the old declaration."""
    from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp as Kcpp

    first = Kcpp(max_context_length=4096, model_name="koboldcpp/Small-Model").start()
    second = Kcpp(max_context_length=2048, model_name="koboldcpp/Small-Model", port=first.port)
    slow(first, 0.3)
    worker = WorkerProcess(horde, first, tmp_path / "state")
    try:
        a = horde.send_chat({"messages": [{"role": "user", "content": "first"}]},
                            best_effort=True)
        big = "word " * 2500  # with 256 to generate: fits 4096, not 2048
        b = horde.send_chat(
            {"messages": [{"role": "user", "content": big}], "max_tokens": 256}, best_effort=True
        )
        horde.inject("submit", "hang:3")  # the first job's submit answers 3 s late
        until(lambda: bool(job_ids(horde, b)), 20, worker.log)  # popped beside that submit
        first.kill()
        second.start()
        assert horde.wait([a], timeout_s=20), worker.log()
        (job_b,) = job_ids(horde, b)
        until(lambda: job_b in terminal_actions(horde), 20, worker.log)
        assert terminal_actions(horde)[job_b] == ["faulted"], worker.log()
        assert not [r for r in second.requests if r["path"] == "/v1/chat/completions"]
    finally:
        worker.stop()
        first.stop()
        second.stop()
