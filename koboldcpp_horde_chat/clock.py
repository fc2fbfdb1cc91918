"""The worker's clock, one object passed in: monotonic and wall time and timers.

What reads time through a :class:`Clock` (the shared state's stop deadline,
its grace timer and its waits for the jobs in hand; the stop's deadlines of
the calls in flight; the start-up recovery's pauses and waits; a job's lease,
its journaled lease end and its pauses) is given one at construction;
:data:`SYSTEM_CLOCK` is the real one. A pop loop has no clock of its own: it
reads its shared state's (``state.shared.WorkerState``), so the loop, its
jobs and the stop all run on one clock. A test passes a clock of its own that
moves when told and runs its timers when their time comes, instead of
patching ``time`` or ``threading`` inside the worker's modules.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    """A one-shot timer (``threading.Timer``'s two calls the worker makes)."""

    def start(self) -> None:
        """Start counting; the action runs once its seconds passed (unless cancelled)."""
        ...

    def cancel(self) -> None:
        """Do not run the action (nothing happens when it ran already)."""
        ...


class Clock(Protocol):
    """Monotonic seconds, epoch seconds and timers on the same clock."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (``time.monotonic``)."""
        ...

    def time(self) -> float:
        """Epoch seconds (``time.time``): what outlives the process (the journal)."""
        ...

    def timer(self, seconds: float, action: Callable[[], None], *, name: str) -> Timer:
        """A timer (not started) that runs ``action`` ``seconds`` from its start
        (0 or less: at once), on a daemon thread named ``name``."""
        ...

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on this clock (0 or less: not at all)."""
        ...


class SystemClock:
    """The real clock: ``time.monotonic``, ``time.time`` and ``threading.Timer``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def timer(self, seconds: float, action: Callable[[], None], *, name: str) -> Timer:
        timer = threading.Timer(max(0.0, seconds), action)
        timer.daemon = True
        timer.name = name
        return timer

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


#: The real clock, the default of everything that takes one.
SYSTEM_CLOCK: Clock = SystemClock()
