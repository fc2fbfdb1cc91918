"""A call in flight that another thread can end, and the deadlines a stop puts on calls
(I/O edge, for ``koboldcpp.connection`` and ``horde.client``).

A ``requests`` read timeout bounds each socket read, not the call, and it is
fixed when the call starts: a call already waiting when the worker is told to
stop would wait out its whole timeout (30 s for a submit). What really ends a
blocked read is shutting its socket down from another thread. The tracked
connection classes here tell the call running on their thread which
connection it sends on (:class:`Call`), so that :meth:`Call.hang_up` can shut
that socket down; :class:`CallDeadlines` does so for every call of a kind
still in flight when the stop's deadline for that kind comes, and cuts the
timeouts of calls made after the stop began to that deadline.
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

from .clock import SYSTEM_CLOCK, Clock, Timer


class Call:
    """The call a client has in flight, which another thread may hang up.

    ``active`` while a call runs on thread ``thread``; ``conn`` is the urllib3
    connection it sends on, once known (the tracked connection classes below
    register themselves when that thread connects or sends). Every field is
    read and written under ``lock``.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = False
        self.hung_up = False
        self.thread = 0
        self.conn: HTTPConnection | None = None

    def hang_up(self) -> bool:
        """Shut down the connection of the call in flight (any thread); True when a
        call was in flight (it then fails at once, or is never sent)."""
        with self.lock:
            if not self.active:
                return False
            self.hung_up = True
            if self.conn is not None:
                shut(self.conn.sock)
            return True

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around one call on this thread (its answer's body read included):
        :meth:`hang_up` can end it meanwhile. ``hung_up`` tells afterwards
        whether it did (read it before the next call)."""
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
    """True while a tracked call runs on this thread (a generation the job's give-up ends)."""
    return getattr(tracking, "in_flight", None) is not None


def track(conn: HTTPConnection) -> None:
    """Register ``conn`` with the call running on this thread, if any.

    Called by the tracked connections when they connect and before they send.
    After a hang-up the socket is shut down at once and ``ConnectionAbortedError``
    raised, so a request the hang-up came before is never sent.
    """
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
    """Shut a socket down both ways, which wakes a thread blocked on it; never raises."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class TrackedHTTPConnection(HTTPConnection):
    """An HTTP connection that tells the call in flight on its thread about itself."""

    def connect(self) -> None:
        super().connect()
        track(self)

    def request(self, *args: Any, **kwargs: Any) -> None:
        track(self)
        super().request(*args, **kwargs)


class TrackedHTTPSConnection(TrackedHTTPConnection, HTTPSConnection):
    """The HTTPS twin of :class:`TrackedHTTPConnection` (its ``connect`` and
    ``request`` come first, and reach HTTPSConnection's through ``super()``)."""


class TrackedHTTPPool(HTTPConnectionPool):
    ConnectionCls = TrackedHTTPConnection


class TrackedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = TrackedHTTPSConnection


class TrackingAdapter(requests.adapters.HTTPAdapter):
    """requests' adapter whose connections register with the call in flight on their
    thread (direct connections; through a proxy a call ends by its timeouts only)."""

    def init_poolmanager(
        self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any
    ) -> None:
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)
        self.poolmanager.pool_classes_by_scheme = {
            "http": TrackedHTTPPool,
            "https": TrackedHTTPSPool,
        }


#: The kind that names the stop's deadline itself: the work that must end by
#: the stop reads it (the recovery's last attempts), and what ends there as a
#: job's generation does is hung up at it (the pop gate's probes of koboldcpp).
STOP_KIND = "stop"
#: Seconds past the stop's deadline a pop in flight is still waited for (the job
#: it brings is then faulted at once, so that another worker takes it now).
STOP_POP_EXTRA_S = 0.5
#: Seconds past the stop's deadline a submit may still take (the fault of a job
#: given up at the deadline, or popped by then); progress posts end at the deadline.
STOP_SUBMIT_EXTRA_S = 1.0


def stop_call_ends(deadline: float) -> dict[str, float]:
    """The deadlines of a stopping worker's calls, by kind (:class:`CallDeadlines`),
    for a stop whose deadline is ``deadline`` (monotonic seconds): :data:`STOP_KIND`
    the deadline itself (the recovery's last attempts start by then),
    ``"progress"`` at it, ``"pop"`` and ``"kcpp"`` :data:`STOP_POP_EXTRA_S`
    later, ``"submit"`` :data:`STOP_SUBMIT_EXTRA_S` later."""
    return {
        STOP_KIND: deadline,
        "pop": deadline + STOP_POP_EXTRA_S,
        "progress": deadline,
        "submit": deadline + STOP_SUBMIT_EXTRA_S,
        "kcpp": deadline + STOP_POP_EXTRA_S,  # the abort after a give-up
    }


class CallDeadlines:
    """When a stopping worker's calls must end, by kind of call, shared by its clients.

    The kinds: ``"pop"``, ``"submit"``, ``"progress"`` (the Horde's routes),
    ``"kcpp"`` (koboldcpp's calls other than a generation) and
    :data:`STOP_KIND` (the stop's deadline itself). Before :meth:`set` nothing
    is cut. After it, a call of kind ``kind`` made before its deadline has its
    timeouts cut to what is left (:meth:`left`); one made after it is not
    sent; and one still in flight when the deadline comes is hung up
    (:meth:`running`), whatever its own timeout.
    Thread-safe; monotonic seconds of ``clock`` (its timers hang the calls up).
    """

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ends: dict[str, float] = {}
        #: What to hang up at which kind's deadline: a :class:`Call`, or any
        #: other key with its own hang-up (:meth:`until`).
        self._calls: dict[object, tuple[str, Callable[[], object]]] = {}
        self._timers: list[Timer] = []

    def set(self, ends: dict[str, float]) -> None:
        """Set each kind's deadline (``{"pop": t, "submit": t + 1.0}``, monotonic
        seconds), once: a second call changes nothing."""
        with self._lock:
            if self._ends:
                return
            self._ends = dict(ends)
            for at in sorted(set(ends.values())):
                timer = self._clock.timer(
                    at - self._clock.monotonic(), partial(self._cut, at), name="stop-cut"
                )
                self._timers.append(timer)
        for timer in self._timers:
            timer.start()

    def ends_at(self, kind: str) -> float | None:
        """The deadline of calls of ``kind`` (monotonic seconds), or None while not stopping."""
        with self._lock:
            return self._ends.get(kind)

    def stop_at_wall(self) -> float | None:
        """The stop's deadline (:data:`STOP_KIND`) in epoch seconds, or None while
        not stopping."""
        at = self.ends_at(STOP_KIND)
        return None if at is None else self._clock.time() + (at - self._clock.monotonic())

    def left(self, kind: str) -> float | None:
        """Seconds left for a call of ``kind`` (0.0 or less: past), None: no deadline."""
        at = self.ends_at(kind)
        return None if at is None else at - self._clock.monotonic()

    def cancel(self) -> None:
        """Stop the timers (tests, a process that exits at once)."""
        with self._lock:
            timers = list(self._timers)
        for timer in timers:
            timer.cancel()

    @contextmanager
    def running(self, kind: str, call: Call) -> Iterator[None]:
        """Around ``call`` of ``kind`` (inside ``call.running()``): hung up when the
        deadline of its kind comes while it is in flight."""
        with self.until(kind, call.hang_up):
            yield

    @contextmanager
    def until(self, kind: str, hang_up: Callable[[], object]) -> Iterator[None]:
        """Around a wait that is no tracked :class:`Call` (a koboldcpp generation
        of the worker's own): ``hang_up()`` is called, from the timer's thread,
        when the deadline of ``kind`` comes meanwhile (at once when it passed)."""
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
