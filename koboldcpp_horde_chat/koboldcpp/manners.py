"""Local use of koboldcpp: a local user's request, a busy model, a koboldcpp restarted.

koboldcpp's own worker waits 20 s after a local user's last generation and
does not pop while the model is busy (1.116.1 ``koboldcpp.py`` L10127-10138);
the pop gate (``service.gate.PopGate``) asks a :class:`LocalManners` the same.
Seed: "The pop loop" and "Worked example: koboldcpp's embedded worker".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import BackendError
from ..jsonbody import finite_number
from .api import BackendInfo, KcppProbes

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
    """What the host tells the pop gate about local use of koboldcpp; the bodies
    here are :class:`NoManners`' answers.

    ``unreachable``: the last read of koboldcpp's state got no answer.
    ``last_local_request_time``: epoch seconds of a local user's last
    generation, or None. ``requests_queued``: True also when the host cannot
    tell. ``recheck``: read koboldcpp now and say how it serves something other
    than what is declared, or None. ``note_own_request`` /
    ``note_own_request_done``: one of the worker's generations starts / ends
    now. ``running_genkey``: the genkey koboldcpp generates for now, or None.
    ``own_worker_running``: koboldcpp's own Horde worker runs beside this one.
    """

    @property
    def unreachable(self) -> bool:
        return False

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


class NoManners(LocalManners):
    """Manners for a backend nobody else uses: never busy, never stopping."""

    unreachable = False


@dataclass(frozen=True)
class BackendIdentity:
    """What koboldcpp serves, as far as the declaration depends on it."""

    model_name: str
    max_context_length: int
    vision: bool
    version: str = ""
    chat_template: str | None = None

    @classmethod
    def of(cls, info: BackendInfo) -> BackendIdentity:
        return cls(
            info.model_name, info.max_context_length, info.vision, info.version, info.chat_template
        )

    def describe(self) -> str:
        """``"koboldcpp/Foo (context 4096)"``; ``", vision"`` added when it reads images."""
        return (
            f"{self.model_name} (context {self.max_context_length}"
            + (", vision)" if self.vision else ")")
        )

    def change_from(self, earlier: BackendIdentity) -> str:
        """E.g. ``"koboldcpp restarted with koboldcpp/Bar (context 8192) (it served
        koboldcpp/Foo (context 4096))"``."""
        if (self.model_name, self.max_context_length, self.vision) != (
            earlier.model_name, earlier.max_context_length, earlier.vision
        ):
            return f"koboldcpp restarted with {self.describe()} (it served {earlier.describe()})"
        if self.version != earlier.version:
            return f"koboldcpp restarted as {self.version} (it was {earlier.version})"
        return "koboldcpp restarted with the model's chat template changed"


class StandaloneManners(NoManners):
    """Manners read from a separate koboldcpp's ``/api/extra/perf`` (whose HTTP API
    does not tell whose generation runs: no ``running_genkey``).

    koboldcpp reports ``idle`` (0 while generating or with requests queued) and
    ``idletime`` (seconds since the last generation request, ours included): a
    request after the worker's own last one is a local user's. koboldcpp
    stamps a request when it takes the model lock, so one queued behind the
    worker's own is caught otherwise (:meth:`_someone_else`).

    An idle answer is reused for ``PERF_IDLE_CACHE_S`` (one GET less before
    most pops); a local user is then noticed up to 1 s late. One instance
    serves all of a worker's loops. With ``check_busy`` False (several loops,
    which keep koboldcpp busy themselves) a busy koboldcpp is not waited for,
    as koboldcpp's own worker does when it batches. ``identity``: what
    koboldcpp served at start; once a restart serves something else,
    :attr:`changed` says how and :meth:`should_stop` turns True, so no job is
    served under a stale declaration.
    """

    PERF_IDLE_CACHE_S = 1.0

    def __init__(
        self, backend: KcppProbes, clock: Clock = SYSTEM_CLOCK, *, check_busy: bool = True,
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
        self.last_own_request_time = 0.0
        self._baseline: float | None = None
        self._uptime: float | None = None
        self._own_in_flight = 0
        # Epoch seconds someone else was last seen using koboldcpp (see _read_local).
        self._other_seen_at: float | None = None
        self._maybe_restarted = self._queued = self._busy = self._own_worker = False
        # The last idle answer: when it was read (monotonic) and the epoch time
        # of the last request it reported (None: no usable idletime).
        self._idle_read_at: float | None = None
        self._idle_last_request: float | None = None

    def note_own_request(self) -> None:
        with self._lock:
            self._own_in_flight += 1
            self.last_own_request_time = self._clock.time()

    def note_own_request_done(self) -> None:
        # A request stamped while one of the worker's own is in flight, or up
        # to its end, is the worker's own (it may have waited for the lock).
        with self._lock:
            self._own_in_flight = max(0, self._own_in_flight - 1)
            self.last_own_request_time = self._clock.time()

    def last_local_request_time(self) -> float | None:
        with self._lock:
            return self._read_local()

    def _read_local(self) -> float | None:
        now = self._clock.monotonic()
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
            last_request = self._clock.time() - idletime
            if self._baseline is None:
                # Requests from before the worker started, or before koboldcpp
                # (re)started (its own start-up counts as one), are not a local
                # user to yield to.
                self._baseline = last_request
            elif self._busy and not self._own_in_flight and self._someone_else(last_request):
                self._other_seen_at = self._clock.time()
        if not self._busy:
            self._idle_read_at = now
            self._idle_last_request = last_request
        return self._local(last_request)

    def _someone_else(self, last_request: float) -> bool:
        """Busy koboldcpp, none of the worker's requests in flight: is the lock
        holder (stamped ``last_request``, epoch seconds) someone else's?

        Yes when a request waits for the lock, when the holder took it after
        the worker's last request ended, or about then (within ``OWN_MARGIN_S``:
        a loaded machine notes the end late) with koboldcpp still busy past
        ``OWN_TAIL_S``. Stamped earlier, it is the worker's own request running
        on (an abort that lands late).
        """
        own_end = self.last_own_request_time
        if self._queued or last_request > own_end:
            return True
        return self._clock.time() - own_end > OWN_TAIL_S and last_request > own_end - OWN_MARGIN_S

    def _local(self, last_request: float | None) -> float | None:
        seen = self._other_seen_at
        if last_request is None or self._baseline is None or self._own_in_flight:
            return seen
        if last_request > max(self.last_own_request_time, self._baseline) + OWN_MARGIN_S:
            return last_request
        return seen

    def _check_identity(self) -> None:
        if self._identity is None or self.changed is not None:
            return
        try:
            info = self._backend.info()
        except BackendError:
            self._maybe_restarted = True  # ask again on the next read
            return
        now = BackendIdentity.of(info)
        if now != self._identity:
            self.changed = now.change_from(self._identity)

    def recheck(self) -> str | None:
        """Read koboldcpp now (no reuse): :attr:`changed`, or None. A restart
        shows in ``uptime`` only when the new process has run for less time than
        the old one had."""
        with self._lock:
            self._idle_read_at = None
            self._maybe_restarted = True
            self._read_local()
        return self.changed

    def model_busy(self) -> bool:
        return self._busy and self._check_busy

    def requests_queued(self) -> bool:
        return self._queued

    def should_stop(self) -> bool:
        return self.changed is not None

    def own_worker_running(self) -> bool:
        return self._own_worker
