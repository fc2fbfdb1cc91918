"""Who keeps koboldcpp busy, named in the pause line, from what the worker can see:

- inside koboldcpp, the genkey of the generation koboldcpp runs
  (``currentusergenkey`` while ``modelbusy`` is held): koboldcpp's own Horde
  worker's (``HORDEREQ_`` and three digits), another process of this worker's
  (``HORDEREQ_`` and this package's longer key, held by no job of this process),
  or a local client's (any other key);
- standalone, koboldcpp's ``/api/extra/perf`` ``hordeexitcounter``: 0 up to 99
  while koboldcpp's own Horde worker runs (koboldcpp started with
  ``--hordekey``), -1 when it never started.

The pop loop runs on a fake clock until the pause is said.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from bench.harness.fakes import FakeBackend, FakeClock, FakeHorde, FakeStopEvent
from koboldcpp_horde_chat.hosts.inside_kcpp import KcppManners
from koboldcpp_horde_chat.koboldcpp.manners import LocalManners, StandaloneManners
from koboldcpp_horde_chat.service.loop import Worker
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.job import new_genkey
from koboldcpp_horde_chat.state.shared import WorkerState
from tests.unit.test_inside_kcpp import make_kcpp
from tests.unit.test_loop_decisions import KEY, MODEL

KCPP_WORKER = (
    "worker 1: koboldcpp's own Horde worker runs beside this one (koboldcpp was started "
    "with --hordekey) and keeps it busy with its jobs: not popping until it is free; start "
    "koboldcpp without --hordekey so that only this worker serves the Horde"
)
SAME_WORKER = (
    "worker 1: koboldcpp is generating a Horde job this process does not hold: another "
    "process of this worker serves the Horde through this koboldcpp (a second start of this "
    "worker name, with another journal directory, say): not popping until it is free; stop "
    "one of them"
)
BUSY = "worker 1: koboldcpp is busy with another client's request: not popping until it is free"
LOCAL = (
    "worker 1: koboldcpp had a local request (or just started): not popping until 20 s "
    "after it, as koboldcpp's own worker does"
)


def pause_lines(manners: LocalManners, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the loop says over a few passes that do not pop."""
    clock = FakeClock()
    settings = WorkerSettings(
        api_key=KEY, worker_name="busy-worker", model_id=MODEL, backend_max_context_length=4096
    )
    horde = FakeHorde(clock)
    worker = Worker(
        settings,
        horde=horde,
        backend=FakeBackend(),
        manners=manners,
        state=WorkerState(settings, stop_event=FakeStopEvent(clock), clock=clock),
    )
    with caplog.at_level(logging.INFO, logger="koboldcpp_horde_chat"):
        for _ in range(30):
            worker.run_once()
    assert horde.pop_calls == 0
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("worker 1: ")]


def busy_kcpp(genkey: str) -> Any:
    """koboldcpp generating under ``genkey`` (its model lock held)."""
    lock = threading.Lock()
    lock.acquire()
    return make_kcpp(modelbusy=lock, currentusergenkey=genkey, last_non_horde_req_time=0.0)


# --- inside koboldcpp: the running generation's genkey --------------------------------------


def test_inside_koboldcpp_another_process_of_this_worker_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lines = pause_lines(KcppManners(busy_kcpp(new_genkey())), caplog)
    assert lines == [SAME_WORKER]


def test_inside_koboldcpp_koboldcpps_own_workers_job_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lines = pause_lines(KcppManners(busy_kcpp("HORDEREQ_512")), caplog)
    assert lines == [KCPP_WORKER]


@pytest.mark.parametrize("genkey", ["KCPP4821", "", "HORDEREQ"])
def test_inside_koboldcpp_a_local_clients_generation_stays_a_busy_koboldcpp(
    genkey: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert pause_lines(KcppManners(busy_kcpp(genkey)), caplog) == [BUSY]


# --- standalone: koboldcpp's perf says its own worker runs ------------------------------------


class PerfBackend(FakeBackend):
    """koboldcpp busy with a request that came after the worker's last one."""

    def __init__(self, hordeexitcounter: int) -> None:
        super().__init__()
        self.exits = hordeexitcounter
        self.reads = 0

    def perf(self, *, timeout_s: float = 10.0) -> dict[str, Any]:
        self.reads += 1
        return {
            "idle": 0, "queue": 0, "hordeexitcounter": self.exits,
            "idletime": 5.0 if self.reads == 1 else 0.5, "uptime": 100.0 + self.reads,
        }


def test_standalone_koboldcpps_own_worker_is_named_when_koboldcpp_says_it_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert pause_lines(StandaloneManners(PerfBackend(0)), caplog) == [KCPP_WORKER]


def test_standalone_without_koboldcpps_own_worker_the_cause_stays_unnamed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lines = pause_lines(StandaloneManners(PerfBackend(-1)), caplog)
    assert lines and lines[0] in (BUSY, LOCAL)
    assert KCPP_WORKER not in lines and SAME_WORKER not in lines


def test_standalone_a_worker_that_exited_inside_koboldcpp_is_not_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """koboldcpp sets ``exitcounter`` to 999 when its worker gave up."""
    assert KCPP_WORKER not in pause_lines(StandaloneManners(PerfBackend(999)), caplog)
