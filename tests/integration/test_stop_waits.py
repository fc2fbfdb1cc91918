"""The stop while the worker waits on something that is not a job's call: the pop
gate's probe of a koboldcpp failing its generations, and a chat job's image
download on its thread pool. Each hangs for far longer than the stop's grace;
at SIGTERM (``--stop-grace 1``) the process exits within the grace + 2 s all
the same, as it does for every other call."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable

import pytest

from bench.harness.worker_process import WorkerProcess, job_ids, until
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp

from ..unit.test_images import jpeg

GRACE_S = 1.0
STOP_BOUND_S = GRACE_S + 2.0
HANG_S = 40.0


def generate_requests(kcpp: ScriptedKoboldcpp) -> int:
    return sum(r["path"] == "/api/v1/generate" for r in kcpp.requests)


def test_the_stop_ends_a_hanging_probe_of_a_failing_koboldcpp_within_the_grace(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    """Three text jobs fail, so the gate probes koboldcpp (60 s later, as in service:
    the worker is a process of its own) with a generation the size of the failed
    job, which hangs."""
    kcpp.inject("generate", *[(500, {"detail": {"msg": "boom"}})] * 3, f"hang:{HANG_S:g}")
    for i in range(3):
        horde.send_text(f"Once {i}", max_length=16, max_attempts=1)
    worker = workers("--stop-grace", str(GRACE_S))
    until(lambda: generate_requests(kcpp) >= 4, 90, worker.log)  # the probe is in flight
    time.sleep(0.3)
    took = worker.sigterm_to_clean_exit(HANG_S + 30)
    print(f"stop under a hanging probe: {took:.2f} s")
    assert took < STOP_BOUND_S, worker.log()


@pytest.mark.parametrize("kcpp", [{"vision": True}], indirect=True)
def test_the_stop_ends_a_hanging_image_download_within_the_grace(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, workers: Callable[..., WorkerProcess]
) -> None:
    """A chat job's image URL answers only after 40 s (its download's own budget is
    up to 60 s, on a thread pool the interpreter waits for at exit)."""
    photo = "data:image/jpeg;base64," + base64.b64encode(jpeg(24, 16)).decode()
    rid = horde.send_chat(
        {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": photo}},
        ]}]},
        best_effort=True,
    )
    horde.inject("storage", f"hang:{HANG_S:g}")
    worker = workers("--stop-grace", str(GRACE_S))
    until(lambda: any(r["port"] == "storage" for r in horde.requests_log), 60, worker.log)
    assert job_ids(horde, rid)
    time.sleep(0.3)
    took = worker.sigterm_to_clean_exit(HANG_S + 30)
    print(f"stop under a hanging image download: {took:.2f} s")
    assert took < STOP_BOUND_S, worker.log()
