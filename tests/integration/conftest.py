"""Fixtures: a dev Horde and a scripted koboldcpp on 127.0.0.1, and the real worker."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.harness.worker_process import API_KEY, WorkerProcess
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp
from koboldcpp_horde_chat.hosts.standalone import run_standalone


@pytest.fixture
def horde(request: pytest.FixtureRequest) -> Iterator[DevHorde]:
    """A dev Horde; parametrize it indirectly with DevHorde keyword arguments."""
    options = dict(getattr(request, "param", {}) or {})
    h = DevHorde(api_keys=(API_KEY,), **options)
    h.start()
    try:
        yield h
    finally:
        h.stop()
    # A fault for a job that already ended re-opens its request on the real Horde
    # (wp.n += 1): another worker generates it again. No test may cause one
    # unless it says so.
    if request.node.get_closest_marker("late_fault_expected") is None:
        assert h.late_faults == [], f"faults sent for jobs that had ended: {h.late_faults}"


@pytest.fixture
def kcpp(request: pytest.FixtureRequest) -> Iterator[ScriptedKoboldcpp]:
    """A scripted koboldcpp; parametrize it indirectly with keyword arguments."""
    options = {"max_context_length": 4096, **(getattr(request, "param", {}) or {})}
    k = ScriptedKoboldcpp(**options)
    k.start()
    try:
        yield k
    finally:
        k.stop()


@dataclass
class RunningWorker:
    """The standalone worker running in a thread; ``stop()`` joins it."""

    thread: threading.Thread
    stop_event: threading.Event
    result: dict[str, int] = field(default_factory=dict)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        self.stop_event.set()
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the worker did not stop"
        return self.result.get("code")


@pytest.fixture
def start_worker(
    horde: DevHorde, kcpp: ScriptedKoboldcpp
) -> Iterator[Callable[..., RunningWorker]]:
    """Start the real standalone worker (``standalone.run_standalone``) against the fixtures."""
    started: list[RunningWorker] = []

    def start(*extra: str, key: str = API_KEY, kcpp_url: str | None = None) -> RunningWorker:
        argv = [
            "--hordekey",
            key,
            "--hordeworkername",
            "test-worker",
            "--horde-url",
            horde.url,
            "--kcpp-url",
            kcpp_url or kcpp.url,
            "--hordegenlen",
            "512",
            "--log-level",
            "DEBUG",
            *extra,
        ]
        stop_event = threading.Event()
        running = RunningWorker(threading.Thread(target=lambda: None), stop_event)
        running.thread = threading.Thread(
            target=lambda: running.result.setdefault(
                "code", run_standalone(argv, stop_event=stop_event)
            ),
            daemon=True,
        )
        running.thread.start()
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop_event.set()
        running.thread.join(15)


@pytest.fixture
def workers(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker processes (``worker_process.WorkerProcess``) with extra flags;
    each one still running at the test's end is killed."""

    started: list[WorkerProcess] = []

    def start(*extra: str) -> WorkerProcess:
        worker = WorkerProcess(horde, kcpp, tmp_path / "state", *extra)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
