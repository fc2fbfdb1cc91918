"""The worker's clock, one object passed in: monotonic and wall time, sleeps and timers.

A test passes a clock of its own that moves when told, instead of patching
``time`` or ``threading`` inside the worker's modules.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    """A one-shot timer (``threading.Timer``'s two calls the worker makes)."""

    def start(self) -> None: ...

    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic seconds, epoch seconds and timers on the same clock."""

    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    def timer(self, seconds: float, action: Callable[[], None], *, name: str) -> Timer:
        """A timer, not started, running ``action`` ``seconds`` after its start (0 or
        less: at once) on a daemon thread named ``name``."""
        ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)

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
