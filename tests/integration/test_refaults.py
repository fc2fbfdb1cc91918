"""A request that always fails on this worker, end to end: the standalone worker
against the dev Horde playing the real one (a faulted request comes straight back,
to this worker too, until a sweep every 60 s faults it) and a scripted koboldcpp.
The request costs the worker 3 aborted jobs (2 faults, then its third job left to
expire, which makes the Horde's sweep fault it), and the good requests behind it
are all served, with no hour-long pause.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from bench.harness.worker_process import until
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import Fault, ScriptedKoboldcpp

NAME = "test-worker"


def _bad_request(horde: DevHorde, kcpp: ScriptedKoboldcpp, kind: str) -> str:
    if kind == "text":  # a prompt koboldcpp fails every time

        def fail(route: str, body: Any) -> Fault | None:
            if route == "generate" and isinstance(body, dict) and "CRASH" in str(body.get("prompt")):
                return 500, {"detail": {"msg": "boom"}}
            return None

        kcpp.fail_when(fail)
        return horde.send_text("CRASH", max_length=32)
    # a conversation that never fits the job's context: faulted prompt_overflow
    return horde.send_chat(
        {
            "messages": [{"role": "user", "content": "words " * 400}],
            "max_tokens": 32,
            "max_context_length": 256,
        },
        best_effort=True,
    )


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_request_that_always_fails_costs_three_aborted_jobs_and_the_others_are_served(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    """Before, the worker faulted it each time the Horde handed it back (19 times in
    3 s against the real Horde), then stopped popping for an hour to stay out of
    maintenance, serving none of the requests behind it. Now koboldcpp's three
    failures in a row on it (a text job left to expire counts) have the worker probe
    koboldcpp once with a generation of its size, which succeeds: the good requests
    are served after that probe (its first wait: 3 s here, 60 s in service)."""
    monkeypatch.setattr("koboldcpp_horde_chat.state.probes.FIRST_WAIT_S", 3.0)
    caplog.set_level(logging.INFO)
    bad = _bad_request(horde, kcpp, kind)
    good = [horde.send_text(f"Once {i}", max_length=32) for i in range(10)]
    t0 = time.monotonic()
    start_worker()
    until(
        lambda: all(horde.status(r)["state"] == "done" for r in good),
        60,
        lambda: caplog.text[-3000:],
    )
    took = time.monotonic() - t0
    ledger = [e for e in horde.ledger if e["request_id"] == bad]
    faults = [e for e in ledger if e["action"] == "faulted"]
    assert len(faults) == 2, ledger
    jobs = horde.status(bad)["job_ids"]
    assert len(jobs) == 3  # the third left to expire: no submit for it
    third = horde.job(jobs[-1])
    assert third is not None and third["action"] is None
    assert "not popping, to stay out of maintenance" not in caplog.text
    assert "left to expire (one aborted job)" in caplog.text
    # The Horde's sweep after the third job's ttl: its 3rd faulted job faults it.
    horde.expire_leases()
    assert horde.status(bad)["state"] == "faulted"
    assert horde.worker(NAME)["uncompleted_jobs"] == 3  # type: ignore[index]
    assert took < 60
    logging.getLogger(__name__).info("refaults %s: 10 good served in %.1f s", kind, took)


def test_requests_of_one_payload_do_not_hide_a_koboldcpp_that_fails_everything(
    horde: DevHorde,
    kcpp: ScriptedKoboldcpp,
    start_worker: Callable[..., object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Many requests with one payload while koboldcpp fails every generation: the job
    left to expire counts as a failed generation too, so the worker stops popping and
    probes koboldcpp after 3, as with distinct requests, instead of leaving job after
    job to expire until its hour is full."""
    caplog.set_level(logging.INFO)
    for _ in range(60):
        kcpp.inject("generate", (500, {"detail": {"msg": "boom"}}))
    for _ in range(25):
        horde.send_text("Once", max_length=32, max_attempts=1)
    start_worker()
    until(lambda: "failed 3 generations in a row: not popping" in caplog.text, 60,
          lambda: caplog.text[-3000:])
    pops = len(horde.pops)
    time.sleep(2.0)
    assert len(horde.pops) == pops
    assert len([e for e in horde.ledger if e["action"] == "faulted"]) == 2
    assert caplog.text.count("left to expire (one aborted job)") == 1
