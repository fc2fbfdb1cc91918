"""A call in flight that another thread can end, and the deadlines a stop puts on calls.

A ``requests`` timeout bounds each socket read, not the call, and is fixed when
the call starts; what ends a blocked read at once is shutting its socket down
from another thread, so the tracked connections here tell their thread's
:class:`Call` which socket it uses.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import requests
import requests.adapters
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from .clock import SYSTEM_CLOCK, Clock


class Call:
    """The call a client has in flight, which another thread may hang up (every
    field under ``lock``; ``conn``: the connection it sends on, once known)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = False
        self.hung_up = False
        self.thread = 0
        self.conn: HTTPConnection | None = None

    def hang_up(self) -> bool:
        """True when a call was in flight: it then fails at once, or is never sent."""
        with self.lock:
            if not self.active:
                return False
            self.hung_up = True
            if self.conn is not None:
                shut(self.conn.sock)
            return True

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around one call on this thread, its body read included; ``hung_up`` tells
        afterwards whether :meth:`hang_up` ended it."""
        with self.lock:
            self.active = True
            self.hung_up = False
            self.thread = threading.get_ident()
            self.conn = None
        tracking.in_flight = self
        try:
            yield
        finally:
            tracking.in_flight = None
            with self.lock:
                self.active = False
                self.conn = None


tracking = threading.local()
"""``in_flight``: the :class:`Call` running on this thread."""


def in_generation() -> bool:
    """A tracked call runs on this thread."""
    return getattr(tracking, "in_flight", None) is not None


def track(conn: HTTPConnection) -> None:
    """Register ``conn`` with this thread's call, if any; after a hang-up shut it and
    raise ``ConnectionAbortedError``, so the request is never sent."""
    in_flight: Call | None = getattr(tracking, "in_flight", None)
    if in_flight is None:
        return
    with in_flight.lock:
        if not in_flight.active or in_flight.thread != threading.get_ident():
            return
        in_flight.conn = conn
        if not in_flight.hung_up:
            return
        shut(conn.sock)
    raise ConnectionAbortedError("the worker hung up")


def shut(sock: socket.socket | None) -> None:
    """Shut a socket down both ways, waking a thread blocked on it; never raises."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class TrackedHTTPConnection(HTTPConnection):

    def connect(self) -> None:
        super().connect()
        track(self)

    def request(self, *args: Any, **kwargs: Any) -> None:
        track(self)
        super().request(*args, **kwargs)


class TrackedHTTPSConnection(TrackedHTTPConnection, HTTPSConnection):
    """Its ``connect`` and ``request`` come first and reach HTTPSConnection's by ``super()``."""


class TrackedHTTPPool(HTTPConnectionPool):
    ConnectionCls = TrackedHTTPConnection


class TrackedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = TrackedHTTPSConnection


class TrackingAdapter(requests.adapters.HTTPAdapter):
    """Its direct connections are tracked (through a proxy, a call ends by its timeouts)."""

    def init_poolmanager(
        self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any
    ) -> None:
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)
        pools = {"http": TrackedHTTPPool, "https": TrackedHTTPSPool}
        self.poolmanager.pool_classes_by_scheme = pools


#: The kind that names the stop's deadline itself.
STOP_KIND = "stop"
#: Seconds past the stop's deadline a pop in flight is still waited for (the job
#: it brings is then faulted at once, so that another worker takes it now).
STOP_POP_EXTRA_S = 0.5
#: Seconds past the stop's deadline a submit may still take (the fault of a job
#: given up at the deadline, or popped by then); progress posts end at the deadline.
STOP_SUBMIT_EXTRA_S = 1.0


def stop_call_ends(deadline: float) -> dict[str, float]:
    """The deadlines of a stopping worker's calls by kind, for a stop at ``deadline``
    (monotonic seconds)."""
    return {
        STOP_KIND: deadline,
        "pop": deadline + STOP_POP_EXTRA_S,
        "progress": deadline,
        "submit": deadline + STOP_SUBMIT_EXTRA_S,
        "kcpp": deadline + STOP_POP_EXTRA_S,  # the abort after a give-up
    }


class CallDeadlines:
    """When a stopping worker's calls must end, by kind, shared by its clients.

    Kinds: ``"pop"``, ``"submit"``, ``"progress"``, ``"kcpp"`` (koboldcpp's calls
    but generations) and :data:`STOP_KIND`. Once :meth:`set`, a call's timeouts
    are cut to what is left and one still in flight at its deadline is hung up.
    Thread-safe; monotonic seconds of ``clock``.
    """

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ends: dict[str, float] = {}
        self._calls: dict[object, tuple[str, Callable[[], object]]] = {}

    def set(self, ends: dict[str, float]) -> None:
        """Set each kind's deadline (monotonic seconds), once."""
        with self._lock:
            if self._ends:
                return
            self._ends = dict(ends)
            now = self._clock.monotonic()
            timers = [
                self._clock.timer(at - now, partial(self._cut, at), name="stop-cut")
                for at in sorted(set(ends.values()))
            ]
        for timer in timers:
            timer.start()

    def ends_at(self, kind: str) -> float | None:
        with self._lock:
            return self._ends.get(kind)

    def stop_at_wall(self) -> float | None:
        """The stop's deadline in epoch seconds, or None while not stopping."""
        at = self.ends_at(STOP_KIND)
        return None if at is None else self._clock.time() + (at - self._clock.monotonic())

    def left(self, kind: str) -> float | None:
        """Seconds left for a call of ``kind`` (0 or less: past), None: no deadline."""
        at = self.ends_at(kind)
        return None if at is None else at - self._clock.monotonic()

    @contextmanager
    def until(self, kind: str, hang_up: Callable[[], object]) -> Iterator[None]:
        """Around a wait that is no tracked :class:`Call`: ``hang_up()`` runs, on the
        timer's thread, when the deadline of ``kind`` comes (at once when past)."""
        key = object()
        with self._lock:
            self._calls[key] = (kind, hang_up)
            at = self._ends.get(kind)
        if at is not None and self._clock.monotonic() >= at:
            hang_up()
        try:
            yield
        finally:
            with self._lock:
                self._calls.pop(key, None)

    def _cut(self, at: float) -> None:
        with self._lock:
            due = [
                hang_up for kind, hang_up in self._calls.values()
                if self._ends.get(kind, at + 1) <= at
            ]
        for hang_up in due:
            hang_up()
