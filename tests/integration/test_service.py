"""The standalone worker as a service: a bounded stop, jobs that survive a crash, state lines.

``python -m koboldcpp_horde_chat`` runs in a subprocess against the dev Horde
and the scripted koboldcpp of this test process, as a supervisor (docker,
systemd) would run it: real signals, a real SIGKILL and a restart, and the
lines an operator reads.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.harness.worker_process import WORKER_NAME, WorkerProcess, slow, terminal_actions, until
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp
from koboldcpp_horde_chat.state.journal_paths import journal_path

# --- a stop a supervisor can wait for ----------------------------------------------------


def test_sigterm_during_a_generation_longer_than_the_grace_aborts_and_faults_it_then_exits_0(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    slow(kcpp, 20.0)
    rid = horde.send_chat({"messages": [{"role": "user", "content": "Sky?"}]}, best_effort=True)
    worker = workers("--stop-grace", "2")
    until(lambda: kcpp.generating, 20)
    worker.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    code = worker.wait(15)
    took = time.monotonic() - signalled
    assert code == 0, worker.log()
    assert 1.8 <= took < 6.0, took  # the grace period, then the abort and one fault
    (job_id,) = horde.status(rid)["job_ids"]
    assert terminal_actions(horde) == {job_id: ["faulted"]}
    assert len(kcpp.aborts) >= 1 and kcpp.aborts[0].startswith("HORDEREQ_")
    assert not kcpp.generating
    assert worker.said("did not end within the 2 s stop grace period") == 1
    # The request went back to the queue for another worker.
    assert horde.status(rid)["state"] == "waiting"


def test_sigterm_during_a_generation_within_the_grace_submits_it(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    slow(kcpp, 1.5)
    rid = horde.send_chat({"messages": [{"role": "user", "content": "Sky?"}]}, best_effort=True)
    worker = workers("--stop-grace", "8")
    until(lambda: kcpp.generating, 20)
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait(15) == 0, worker.log()
    (job_id,) = horde.status(rid)["job_ids"]
    assert terminal_actions(horde) == {job_id: ["submitted"]}
    assert kcpp.aborts == []


def test_a_submit_the_horde_does_not_answer_at_a_stop_is_left_to_the_next_start(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    """The stop stays bounded when the Horde hangs on the last submit: the worker
    gives up a second after the grace period and keeps the job in its journal."""
    slow(kcpp, 1.0)
    rid = horde.send_chat({"messages": [{"role": "user", "content": "Sky?"}]}, best_effort=True)
    horde.inject("submit", "hang:30")
    worker = workers("--stop-grace", "2")
    until(lambda: kcpp.generating, 20)
    worker.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert worker.wait(15) == 0, worker.log()
    assert time.monotonic() - signalled < 5.0
    (job_id,) = horde.status(rid)["job_ids"]
    journaled = json.loads(journal_path(WORKER_NAME, tmp_path / "state").read_text())["jobs"]
    assert [e["job_id"] for e in journaled] == [job_id]
    assert journaled[0]["terminal"] == "reply_sent"  # the reply is kept, not to be faulted
    assert worker.said("left to the next start, which sends the reply again") == 1


# --- jobs that survive a crash -----------------------------------------------------------


def test_a_job_in_hand_at_a_sigkill_is_faulted_by_the_restarted_worker_before_it_pops(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    slow(kcpp, 30.0)
    rid = horde.send_chat({"messages": [{"role": "user", "content": "Sky?"}]}, best_effort=True)
    first = workers()
    until(lambda: kcpp.generating, 20)
    path = journal_path(WORKER_NAME, tmp_path / "state")
    journaled = json.loads(path.read_text())["jobs"]
    (job_id,) = horde.status(rid)["job_ids"]
    assert [(e["job_id"], e["kind"]) for e in journaled] == [(job_id, "chat")]
    assert journaled[0]["genkey"].startswith("HORDEREQ_")
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert terminal_actions(horde) == {}  # the Horde still holds the job
    assert kcpp.generating  # and koboldcpp still generates it

    restarted_at = time.monotonic()
    slow(kcpp, 0.2)
    second = workers()
    until(lambda: job_id in terminal_actions(horde), 20, second.log)
    assert terminal_actions(horde)[job_id] == ["faulted"]
    # its generation is aborted once the Horde answered the fault
    until(lambda: kcpp.aborts, 10, second.log)
    assert kcpp.aborts[:1] == [journaled[0]["genkey"]]
    # The fault was the restarted worker's first job call to the Horde (after the
    # key check at start): before any pop.
    calls = [
        r for r in horde.requests_log
        if r["port"] == "horde" and r["at"] > restarted_at and r["path"] != "/api/v2/find_user"
    ]
    assert calls[0]["path"].endswith("/generate/text/submit")
    assert json.loads(calls[0]["body"]) == {
        "id": job_id, "state": "faulted", "model_id": "koboldcpp/scripted-model"
    }
    second.wait_for(f"job={job_id} kind=chat faulted after a restart")  # its log line follows
    assert second.said(f"job={job_id} kind=chat faulted after a restart") == 1
    # The request was requeued and the restarted worker served it.
    assert horde.wait([rid], timeout_s=20)
    until(lambda: json.loads(path.read_text())["jobs"] == [], 5, path.read_text())


def test_a_second_worker_process_with_the_same_name_refuses_to_start_and_leaves_the_job_alone(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    """Its start would otherwise fault the first one's job in hand and abort its
    generation, which the first would then submit cut short."""
    slow(kcpp, 4.0)
    rid = horde.send_chat({"messages": [{"role": "user", "content": "Sky?"}]}, best_effort=True)
    workers()  # the first worker, which takes the job
    until(lambda: kcpp.generating, 20)
    second = workers()
    assert second.wait(15) == 2
    assert second.said(f"another worker named '{WORKER_NAME}' runs on this machine (process ") == 1
    assert horde.wait([rid], timeout_s=20)
    (job_id,) = horde.status(rid)["job_ids"]
    assert terminal_actions(horde) == {job_id: ["submitted"]}
    assert kcpp.aborts == []
    assert horde.status(rid)["message"]["content"] == "sky " * 40  # all of it


# --- what the worker is doing -----------------------------------------------------------


def test_a_local_user_and_another_client_are_said_once_each_and_so_is_popping_again(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    worker = workers()
    until(lambda: len(horde.pops) >= 1, 20)
    time.sleep(1.5)  # requests within 1 s of the worker's first look are koboldcpp's own start
    kcpp.local_generate(3.0)  # a local user's generation (no HORDEREQ_ genkey)
    worker.wait_for("koboldcpp had a local request (or just started): not popping until 20 s after it")
    pops = len(horde.pops)
    worker.wait_for("no local request for 20 s: popping again", timeout_s=30)
    assert len(horde.pops) > pops
    assert worker.said("koboldcpp had a local request") == 1
    assert worker.said("popping again") == 1


def test_a_local_user_queued_behind_the_workers_job_is_yielded_to_after_it(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    """koboldcpp notes a request's time when it takes the model lock: a local user who
    asked while the worker's job generated gets it right after that job, and must
    be yielded to like one who asked while koboldcpp was idle."""
    slow(kcpp, 3.0)
    worker = workers()
    until(lambda: len(horde.pops) >= 1, 20)
    time.sleep(1.5)  # requests within 1 s of the worker's first look are koboldcpp's own start
    rid = horde.send_chat({"messages": [{"role": "user", "content": "Sky?"}]}, best_effort=True)
    until(lambda: kcpp.generating, 20)
    time.sleep(1.0)
    kcpp.local_generate(2.0)  # waits for the worker's generation, then runs
    assert horde.wait([rid], timeout_s=20)
    worker.wait_for(
        "koboldcpp had a local request (or just started): not popping until 20 s after it",
        timeout_s=10,
    )
    second = horde.send_chat({"messages": [{"role": "user", "content": "Sea?"}]}, best_effort=True)
    # A worker that did not yield would pop it within about a second (its empty-pop
    # wait); yielding, it pops nothing for 20 s.
    time.sleep(3)
    assert horde.status(second)["job_ids"] == [], worker.log()  # still yielding


def test_koboldcpp_down_and_back_and_the_hordes_messages_are_said_once(
    horde: DevHorde, workers: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp as Kcpp

    first = Kcpp(max_context_length=4096).start()
    second = Kcpp(max_context_length=4096, port=first.port)
    try:
        horde.add_worker_message("Please rename your model.", worker=WORKER_NAME)
        url = first.url
        worker = WorkerProcess(horde, first, tmp_path / "state")
        try:
            worker.wait_for("message from the Horde (origin moderator")
            until(lambda: len(horde.pops) >= 3, 20)
            first.kill()
            horde.send_chat({"messages": [{"role": "user", "content": "Hi"}]}, best_effort=True)
            worker.wait_for(f"koboldcpp at {url} does not answer: not popping until it does")
            second.start()
            worker.wait_for(f"koboldcpp at {url} answers again: popping", timeout_s=20)
            assert worker.said("Please rename your model.") == 1
            assert worker.said("does not answer") == 1
            lines = [line for line in worker.lines if "koboldcpp_horde_chat" in line]
            assert lines and max(len(line) for line in lines) < 400
            assert not any("Traceback" in line or "urllib3" in line for line in worker.lines)
        finally:
            worker.stop()
    finally:
        first.stop()
        second.stop()


def test_a_job_queued_while_koboldcpp_is_down_waits_for_it_and_its_new_declaration(
    horde: DevHorde, tmp_path: Path
) -> None:
    """A koboldcpp that does not answer is not popped for (docs/operating.md: the worker stops
    popping; it does not fault jobs it cannot serve), also when no job failed first;
    when it comes back serving another context, the waiting job is popped under the
    new declaration."""
    from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp as Kcpp

    first = Kcpp(max_context_length=4096, model_name="koboldcpp/Small-Model").start()
    port = first.port
    second = Kcpp(max_context_length=1024, model_name="koboldcpp/Small-Model", port=port)
    worker = WorkerProcess(horde, first, tmp_path / "state")
    try:
        until(lambda: len(horde.pops) >= 2, 20)
        first.kill()
        worker.wait_for("does not answer: not popping until it does", timeout_s=20)
        rid = horde.send_chat({"messages": [{"role": "user", "content": "Hi"}]}, best_effort=True)
        time.sleep(3)
        assert horde.status(rid)["job_ids"] == [], worker.log()  # nobody popped it
        second.start()
        assert horde.wait([rid], timeout_s=30), worker.log()
        (job_id,) = horde.status(rid)["job_ids"]
        assert terminal_actions(horde) == {job_id: ["submitted"]}
        (pop,) = [p for p in horde.pops if (p.get("response") or {}).get("id") == job_id]
        assert pop["body"]["chat_limits"]["max_context_length"] == 1024
        assert worker.proc.poll() is None
    finally:
        worker.stop()
        first.stop()
        second.stop()

def test_koboldcpp_back_with_another_model_is_declared_anew_before_a_job_is_served(
    horde: DevHorde, tmp_path: Path
) -> None:
    """The worker read koboldcpp's model and context at start: one restarted with
    another model or a smaller context must not be served under the old declaration."""
    from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp as Kcpp

    first = Kcpp(max_context_length=4096, model_name="koboldcpp/Small-Model").start()
    port = first.port
    second = Kcpp(max_context_length=1024, model_name="koboldcpp/Other-Model", port=port)
    worker = WorkerProcess(horde, first, tmp_path / "state")
    try:
        until(lambda: len(horde.pops) >= 2, 20)
        assert horde.pops[-1]["body"]["model_id"] == "koboldcpp/Small-Model"
        first.kill()
        time.sleep(1.5)
        second.start()
        worker.wait_for(
            "koboldcpp restarted with koboldcpp/Other-Model (context 1024) (it served "
            "koboldcpp/Small-Model (context 4096)): reading it again", timeout_s=20
        )
        pops = len(horde.pops)
        until(lambda: len(horde.pops) > pops + 1, 20, worker.log)
        body = horde.pops[-1]["body"]
        assert body["model_id"] == "koboldcpp/Other-Model"
        assert body["chat_limits"]["max_context_length"] == 1024
        assert worker.proc.poll() is None  # the same process goes on
        rid = horde.send_chat({"messages": [{"role": "user", "content": "Hi"}]}, best_effort=True)
        assert horde.wait([rid], timeout_s=20)
        assert horde.status(rid)["model"] == "koboldcpp/Other-Model"
    finally:
        worker.stop()
        first.stop()
        second.stop()


def test_faults_before_koboldcpp_came_back_changed_still_count_toward_withdrawing_chat(
    horde: DevHorde,
    start_worker: Callable[..., object],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The Horde counts a worker's aborted jobs by its name whatever koboldcpp it
    serves from: the worker re-declared after koboldcpp came back with another
    context still counts the faults from before (and its totals go on), or a
    koboldcpp crashing and coming back changed could take it into maintenance.
    Here chat is withdrawn at 2 faults (15 in the product)."""
    import logging

    from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp as Kcpp
    from koboldcpp_horde_chat.state import guard as guard_module

    monkeypatch.setattr(guard_module, "WITHDRAW_CHAT_AT", 2)
    monkeypatch.setattr(guard_module, "RESTORE_CHAT_BELOW", 1)
    caplog.set_level(logging.INFO)
    first = Kcpp(max_context_length=4096).start()
    second = Kcpp(max_context_length=2048, port=first.port)
    third = Kcpp(max_context_length=2048, port=first.port)
    try:
        for kcpp in (first, second, third):
            slow(kcpp, 20.0)
        start_worker(kcpp_url=first.url)

        def killed_mid_job(kcpp: Kcpp) -> None:
            rid = horde.send_chat(
                {"messages": [{"role": "user", "content": "Sky?"}]}, best_effort=True, max_attempts=1
            )
            until(lambda: kcpp.generating, 20)
            kcpp.kill()
            until(lambda: horde.status(rid)["state"] == "faulted", 20)

        killed_mid_job(first)
        second.start()
        until(lambda: "reading it again" in caplog.text, 30)
        killed_mid_job(second)
        third.start()
        until(lambda: "withdrawing the chat declaration" in caplog.text, 30, lambda: caplog.text[-3000:])
    finally:
        first.stop()
        second.stop()
        third.stop()


def test_faults_of_an_earlier_run_still_count_toward_withdrawing_chat(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    """A koboldcpp that crashes on some chat jobs, with the worker inside it, restarts
    the worker each time: the Horde still counts the aborted jobs of the hour, so the
    next run must too (kept beside the journal), or chat is never withdrawn before
    maintenance. Here chat is withdrawn at 2 faults (15 in the product)."""
    import logging

    from koboldcpp_horde_chat.state import guard as guard_module

    monkeypatch.setattr(guard_module, "WITHDRAW_CHAT_AT", 2)
    monkeypatch.setattr(guard_module, "RESTORE_CHAT_BELOW", 1)
    caplog.set_level(logging.INFO)
    journal = str(tmp_path / "state")

    def one_faulted_run() -> None:
        kcpp.inject("chat", (500, {"detail": {"msg": "boom"}}))
        running = start_worker("--journal-dir", journal)
        rid = horde.send_chat(
            {"messages": [{"role": "user", "content": "Sky?"}]}, best_effort=True, max_attempts=1
        )
        until(lambda: horde.status(rid)["state"] == "faulted", 20)
        pops = len(horde.pops)
        until(lambda: len(horde.pops) > pops, 20)  # the pop after the fault: declared anew
        running.stop()  # type: ignore[attr-defined]

    one_faulted_run()
    assert "withdrawing the chat declaration" not in caplog.text
    assert "chat_jobs" in horde.pops[-1]["body"]
    one_faulted_run()
    assert "withdrawing the chat declaration" in caplog.text, caplog.text[-3000:]
    assert "chat_jobs" not in horde.pops[-1]["body"]
