"""Local use of koboldcpp: a local user's request, a busy model, a koboldcpp restarted.

koboldcpp's own worker waits 20 s after a local user's last generation and
does not pop while the model is busy (1.116.1 ``koboldcpp.py`` L10127-10138).
A :class:`LocalManners` tells the pop gate (``service.gate.PopGate``, which
decides) what koboldcpp is doing: inside koboldcpp the hook reads koboldcpp's
globals (``hosts.inside_kcpp.KcppManners``); standalone,
:class:`StandaloneManners` reads koboldcpp's ``/api/extra/perf`` and notices a
koboldcpp restarted with another model or context (:class:`BackendIdentity`);
:class:`NoManners` never holds a pop. The worker's own requests are told apart
from a local user's by ``OWN_MARGIN_S`` and ``OWN_TAIL_S``.

Seed: "The pop loop" (a worker keeps serving its local users) and "Worked
example: koboldcpp's embedded worker".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..errors import BackendError
from ..jsonbody import finite_number
from .api import KcppProbes

#: A request koboldcpp noted within this many seconds of the worker's own last
#: one (sent or ended) is taken for the worker's own.
OWN_MARGIN_S = 1.0
#: koboldcpp's ``exitcounter`` (``hordeexitcounter`` in ``/api/extra/perf``) at
#: and above which its own Horde worker is exiting or gone (it sets 999 then).
KCPP_WORKER_EXITING = 100
#: Seconds after the worker's own generation ended during which a busy
#: koboldcpp is taken to be finishing that request: it holds its model lock a
#: moment after answering (about 50 ms), or hands it to a request queued behind.
OWN_TAIL_S = 0.5


class LocalManners(Protocol):
    """What the host tells the loop about local use of koboldcpp (what
    ``service.gate.PopGate`` asks before each pop).

    ``unreachable``: koboldcpp did not answer the last read of its state
    (the gate then probes it before popping). ``last_local_request_time``:
    epoch seconds of the last local (non-Horde) generation, or None when
    unknown. ``model_busy``: koboldcpp is generating. ``requests_queued``:
    requests wait for koboldcpp's model lock (True when the host cannot
    tell). ``should_stop``: the host is shutting down. ``recheck``: read
    koboldcpp now and say how it serves something else than the worker
    declares, or None (also when the host cannot tell).
    ``note_own_request`` / ``note_own_request_done``: the worker sends one of
    its own generation requests now / one of them ended now (so it is not
    taken for a local user's). ``running_genkey``: the genkey of the
    generation koboldcpp runs now, or None (none, or the host cannot read it).
    ``own_worker_running``: koboldcpp's own embedded Horde worker runs beside
    this one (koboldcpp was started with ``--hordekey``).
    """

    @property
    def unreachable(self) -> bool: ...

    def last_local_request_time(self) -> float | None: ...

    def model_busy(self) -> bool: ...

    def requests_queued(self) -> bool: ...

    def should_stop(self) -> bool: ...

    def recheck(self) -> str | None: ...

    def note_own_request(self) -> None: ...

    def note_own_request_done(self) -> None: ...

    def running_genkey(self) -> str | None: ...

    def own_worker_running(self) -> bool: ...


class NoManners:
    """Manners for a backend nobody else uses: always reachable, never busy,
    nothing queued, never stopping, never changed."""

    unreachable = False

    def last_local_request_time(self) -> float | None:
        return None

    def model_busy(self) -> bool:
        return False

    def requests_queued(self) -> bool:
        return False

    def should_stop(self) -> bool:
        return False

    def recheck(self) -> str | None:
        return None

    def note_own_request(self) -> None:
        return None

    def note_own_request_done(self) -> None:
        return None

    def running_genkey(self) -> str | None:
        return None

    def own_worker_running(self) -> bool:
        return False


@dataclass(frozen=True)
class BackendIdentity:
    """What koboldcpp serves, as far as the declaration depends on it: its model,
    context and vision, its version (which routes it has: ``versions``) and the
    model's chat template (``BackendInfo.chat_template``)."""

    model_name: str
    max_context_length: int
    vision: bool
    version: str = ""
    chat_template: str | None = None

    def describe(self) -> str:
        """``"koboldcpp/Foo (context 4096)"``; ``", vision"`` added when it reads images."""
        return (
            f"{self.model_name} (context {self.max_context_length}"
            + (", vision)" if self.vision else ")")
        )

    def change_from(self, earlier: BackendIdentity) -> str:
        """How koboldcpp, restarted, serves something else than ``earlier``, in
        words: ``"koboldcpp restarted with koboldcpp/Bar (context 8192) (it served
        koboldcpp/Foo (context 4096))"``, or ``"koboldcpp restarted as 1.45 (it
        was 1.116.1)"`` / ``"... with the model's chat template changed"`` when
        only those differ."""
        if (self.model_name, self.max_context_length, self.vision) != (
            earlier.model_name, earlier.max_context_length, earlier.vision
        ):
            return f"koboldcpp restarted with {self.describe()} (it served {earlier.describe()})"
        if self.version != earlier.version:
            return f"koboldcpp restarted as {self.version} (it was {earlier.version})"
        return "koboldcpp restarted with the model's chat template changed"


class StandaloneManners:
    """Manners read from a separate koboldcpp's ``/api/extra/perf``.

    koboldcpp reports ``idle`` (0 while generating or with requests queued) and
    ``idletime`` (seconds since the last generation request, ours included).
    A request that arrived after our own last one came from someone else: a
    local user, whom the worker yields to for ``local_idle_s``. koboldcpp
    notes a request when it takes the model lock, so one that waited behind
    the worker's own is seen otherwise: koboldcpp with a queue, or busy with
    a request that took the lock after the worker's last one ended, while
    none of the worker's requests is in flight, counts as a local user at the
    time it is seen.

    While koboldcpp is idle, ``/api/extra/perf`` is read at most once every
    :attr:`PERF_IDLE_CACHE_S` (1 s) and the last answer is reused in between
    (one GET less before most pops when jobs follow each other); after an
    answer that said busy, or none, it is read again on every call. So a local
    user who starts a generation is noticed up to 1 s later, and a pop in that
    second waits in koboldcpp's queue behind them.

    One instance serves all the pop loops of a worker (its calls are
    serialised, and it keeps its own koboldcpp client). With several loops
    (``check_busy`` False) a busy koboldcpp is not waited for, as koboldcpp's
    own worker does not wait when it batches: the loops' own requests keep it
    busy.

    Args:
        backend: the koboldcpp client (used by this object only).
        clock: epoch seconds (``idletime`` is turned into a time with it).
        monotonic: seconds, for the 1 s reuse (tests may pass fakes of both).
        check_busy: report koboldcpp's ``idle: 0`` as busy.
        identity: what koboldcpp served when the worker started (model name,
            context size, vision). After koboldcpp restarts it is read again;
            when it differs, :attr:`changed` says how and :meth:`should_stop`
            turns True, so the worker stops before it serves a job under a
            declaration koboldcpp no longer matches (the host then starts it
            again with what koboldcpp serves now).
    """

    PERF_IDLE_CACHE_S = 1.0
    """Seconds an idle ``/api/extra/perf`` answer is reused."""

    def __init__(
        self,
        backend: KcppProbes,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        *,
        check_busy: bool = True,
        identity: BackendIdentity | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._check_busy = check_busy
        self._identity = identity
        self.changed: str | None = None
        #: The last read of ``/api/extra/perf`` got no answer: koboldcpp is down.
        self.unreachable = False
        self._backend = backend
        self._clock = clock
        self._monotonic = monotonic
        self.last_own_request_time = 0.0
        self._baseline: float | None = None
        self._uptime: float | None = None
        self._own_in_flight = 0
        # Epoch seconds someone else was last seen using koboldcpp (see _read_local).
        self._other_seen_at: float | None = None
        self._maybe_restarted = False
        self._queued = False
        self._busy = False
        self._own_worker = False
        # The last idle answer: when it was read (monotonic) and the epoch time
        # of the last request it reported (None: no usable idletime).
        self._idle_read_at: float | None = None
        self._idle_last_request: float | None = None

    def note_own_request(self) -> None:
        """Record that the worker sent a generation request now."""
        with self._lock:
            self._own_in_flight += 1
            self.last_own_request_time = self._clock()

    def note_own_request_done(self) -> None:
        """Record that one of the worker's generation requests ended now.

        koboldcpp notes a request's time when it takes the model lock, which
        for a request that waited (behind another loop's, say) is later than
        when it was sent: a request noted while one of the worker's own is in
        flight, or up to its end, is the worker's own.
        """
        with self._lock:
            self._own_in_flight = max(0, self._own_in_flight - 1)
            self.last_own_request_time = self._clock()

    def last_local_request_time(self) -> float | None:
        """Epoch seconds of a local user's last request, or None (see the class)."""
        with self._lock:
            return self._read_local()

    def _read_local(self) -> float | None:
        now = self._monotonic()
        if self._idle_read_at is not None and now - self._idle_read_at < self.PERF_IDLE_CACHE_S:
            return self._local(self._idle_last_request)
        self._idle_read_at = None
        try:
            perf = self._backend.perf()
        except BackendError:
            self._busy = False
            self.unreachable = True
            # koboldcpp may be restarting: its next start is not a local user either.
            self._baseline = None
            self._maybe_restarted = True
            return None
        self.unreachable = False
        exits = perf.get("hordeexitcounter")
        # koboldcpp's own worker sets it to 0 when it starts and to 999 when it
        # exits (-1: never started; 1.116.1 koboldcpp.py L130, L10100, L10209).
        self._own_worker = isinstance(exits, int) and 0 <= exits < KCPP_WORKER_EXITING
        self._queued = bool(perf.get("queue"))
        self._busy = perf.get("idle") == 0 or self._queued
        uptime = finite_number(perf.get("uptime"))
        if uptime is not None and self._uptime is not None and uptime < self._uptime:
            self._baseline = None  # koboldcpp restarted between two reads
            self._maybe_restarted = True
        self._uptime = uptime
        if self._maybe_restarted:
            self._maybe_restarted = False
            self._check_identity()
        idletime = finite_number(perf.get("idletime"))
        last_request: float | None = None
        if idletime is not None:
            last_request = self._clock() - idletime
            if self._baseline is None:
                # Requests from before the worker started, or before koboldcpp
                # (re)started (its own start-up counts as one), are not a local
                # user to yield to.
                self._baseline = last_request
            elif self._busy and not self._own_in_flight and self._someone_else(last_request):
                self._other_seen_at = self._clock()
        if not self._busy:
            self._idle_read_at = now
            self._idle_last_request = last_request
        return self._local(last_request)

    def _someone_else(self, last_request: float) -> bool:
        """koboldcpp is busy, none of the worker's requests in flight: is the lock
        holder (stamped ``last_request``, epoch seconds) someone else's request?

        koboldcpp stamps a request when it takes the lock, so one queued behind
        the worker's own looks like the worker's to the rule in :meth:`_local`.
        It is someone else's when a request waits for the lock, when the
        holder took it after the worker's last request ended, or when the
        holder took it about when that request ended (within ``OWN_MARGIN_S``
        before the worker noted its end, which a loaded machine delays) and
        koboldcpp is still busy past ``OWN_TAIL_S`` after it. A holder stamped
        earlier is the worker's own request running on (an abort that lands
        late).
        """
        own_end = self.last_own_request_time
        if self._queued or last_request > own_end:
            return True
        return self._clock() - own_end > OWN_TAIL_S and last_request > own_end - OWN_MARGIN_S

    def _local(self, last_request: float | None) -> float | None:
        """``last_request`` when it came after the worker's own last request; else
        the last time someone else was seen using koboldcpp (or None)."""
        seen = self._other_seen_at
        if last_request is None or self._baseline is None or self._own_in_flight:
            return seen
        if last_request > max(self.last_own_request_time, self._baseline) + OWN_MARGIN_S:
            return last_request
        return seen

    def _check_identity(self) -> None:
        """After a restart: does koboldcpp still serve what the worker declares?"""
        if self._identity is None or self.changed is not None:
            return
        try:
            info = self._backend.info()
        except BackendError:
            self._maybe_restarted = True  # ask again on the next read
            return
        now = BackendIdentity(
            info.model_name,
            info.max_context_length,
            info.vision,
            version=info.version,
            chat_template=info.chat_template,
        )
        if now != self._identity:
            self.changed = now.change_from(self._identity)

    def recheck(self) -> str | None:
        """Read koboldcpp's perf and model now (not from the 1 s reuse) and say
        whether it serves something else than the worker declares:
        :attr:`changed`, or None. (A restart shows in perf's ``uptime`` only when
        the new process has run for less time than the old one had.)"""
        with self._lock:
            self._idle_read_at = None
            self._maybe_restarted = True
            self._read_local()
        return self.changed

    def model_busy(self) -> bool:
        """koboldcpp's last ``/api/extra/perf`` said it is generating or has a queue
        (always False when ``check_busy`` is off)."""
        return self._busy and self._check_busy

    def requests_queued(self) -> bool:
        """koboldcpp's last ``/api/extra/perf`` counted requests waiting for its lock."""
        return self._queued

    def should_stop(self) -> bool:
        """True once koboldcpp came back serving something else (:attr:`changed`)."""
        return self.changed is not None

    def running_genkey(self) -> str | None:
        """None: koboldcpp's HTTP API does not tell whose generation runs."""
        return None

    def own_worker_running(self) -> bool:
        """koboldcpp's last ``/api/extra/perf`` said its own Horde worker runs
        (``hordeexitcounter`` from 0 up to its exit's 100)."""
        return self._own_worker


