"""The worker's clock is one object passed in: the shared state's stop deadline,
its grace timer, the calls' deadlines and a job's pauses run on the clock they
are given, and no test patches ``time`` or ``threading`` inside a module of
the worker."""

from __future__ import annotations

import ast
import threading
from collections.abc import Callable
from pathlib import Path

from koboldcpp_horde_chat.clock import SYSTEM_CLOCK, Clock
from koboldcpp_horde_chat.horde.pop import Lease
from koboldcpp_horde_chat.inflight import CallDeadlines
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.job import JobContext
from koboldcpp_horde_chat.state.ports import StopSignal
from koboldcpp_horde_chat.state.shared import WorkerState

ROOT = Path(__file__).resolve().parents[2]


class StepClock:
    """A clock that moves only when told and runs its timers when their time comes."""

    def __init__(self) -> None:
        self.now = 500.0
        self.wall = 1_700_000_000.0
        self.timers: list[StepTimer] = []

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.wall

    def timer(self, seconds: float, action: Callable[[], None], *, name: str) -> StepTimer:
        timer = StepTimer(self, seconds, action, name)
        self.timers.append(timer)
        return timer

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.wall += seconds
        for timer in list(self.timers):
            if timer.due is not None and timer.due <= self.now and not timer.cancelled:
                timer.due = None
                timer.action()


class StepTimer:
    def __init__(self, clock: StepClock, seconds: float, action: Callable[[], None], name: str) -> None:
        self.clock, self.seconds, self.action, self.name = clock, seconds, action, name
        self.due: float | None = None
        self.cancelled = False

    def start(self) -> None:
        self.due = self.clock.now + self.seconds

    def cancel(self) -> None:
        self.cancelled = True


def test_the_step_clock_is_a_clock() -> None:
    clock: Clock = StepClock()
    assert clock.monotonic() == 500.0
    assert SYSTEM_CLOCK.monotonic() > 0


def test_a_stop_gives_up_the_job_in_hand_when_the_given_clock_reaches_its_grace() -> None:
    clock = StepClock()
    settings = WorkerSettings(
        api_key="k" * 22, worker_name="w", model_id="m", backend_max_context_length=4096
    )
    state = WorkerState(settings, stop_event=threading.Event(), clock=clock)
    assert state.stats.started_at == 1_700_000_000.0
    ctx = JobContext(
        id="j1", kind="chat", lease=Lease(popped_at=clock.now, deadline=clock.now + 150),
        started=clock.now,
    )
    state.hold(ctx)
    state.request_stop(5.0)
    assert state.stop_deadline == 505.0
    assert [t.name for t in clock.timers] == ["stop-cut"] * 3 + ["stop-grace"]
    assert state.call_deadlines.left("progress") == 5.0
    clock.advance(4.9)
    assert not ctx.abandoned.is_set() and not state.stop_overdue()
    clock.advance(0.1)
    assert state.stop_overdue()
    assert ctx.abandoned.is_set()  # given up at the grace's end, on the given clock


def test_a_jobs_pause_waits_on_the_given_clock_and_ends_at_the_stops_deadline() -> None:
    """A job's retry pause reads the clock it is given: without a stop it waits its
    seconds on it; under the stop's deadline it ends at the deadline."""
    clock = StepClock()
    stop = threading.Event()
    deadline: list[float | None] = [None]
    signal = StopSignal(stop, lambda: deadline[0], clock)
    stop.set()  # the stop came without a deadline: the pause is not shortened
    signal.pause(2.0)
    assert clock.now == 502.0
    deadline[0] = clock.now + 0.5
    signal.pause(2.0)
    assert clock.now == 502.5
    signal.pause(2.0)  # past the deadline: no wait at all
    assert clock.now == 502.5


def test_the_calls_deadlines_hang_up_a_call_when_the_given_clock_reaches_them() -> None:
    clock = StepClock()
    deadlines = CallDeadlines(clock)

    class Hung:
        hung = 0

        def hang_up(self) -> None:
            self.hung += 1

    call = Hung()
    deadlines.set({"submit": 501.5})
    with deadlines.until("submit", call.hang_up):
        clock.advance(1.0)
        assert call.hung == 0
        clock.advance(0.5)
        assert call.hung == 1
    assert deadlines.left("submit") == 0.0


def test_no_test_patches_time_or_threading_inside_a_module_of_the_worker() -> None:
    """A test drives time through the clock it passes, not by patching ``time``,
    ``threading`` or a function of them where a module of the worker reads it."""
    found = []
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in {"setattr", "patch"} or not node.args:
                continue
            texts = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            for text in texts:
                parts = text.split(".")
                if text in {"time", "threading"} or (
                    parts[0] == "koboldcpp_horde_chat" and {"time", "threading"} & set(parts[1:])
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert found == []
