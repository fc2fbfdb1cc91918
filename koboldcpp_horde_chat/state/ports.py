"""The ports a job run uses: the Horde, koboldcpp, the clock, the stop, the journal.

One :class:`Ports` per pop loop, made by the loop (``service/loop.py``) and
given to its job driver (``run/driver.py``) and the runs (``run/chat.py``,
``run/text.py``, ``run/streaming.py``):

- :class:`KoboldcppPort`: the koboldcpp client with what every run needs
  around it: the notes of the worker's own requests (so a standalone worker
  does not take them for a local user's), the wait through 503 busy answers
  within the lease, the best-effort abort, and the stop of a generation from
  another thread;
- :class:`StopSignal`: the stop, its deadline, and a job's own pauses bounded
  by them;
- the clock (``clock.Clock``, injected: every wait and lease reads it);
- the Horde client and the job journal.

What moves a job (its phases, its journal entry) is on the job's owner
(``state.job.JobContext``), not here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..clock import Clock
from ..errors import BackendBusy, BackendError, BackendUnauthorized
from ..horde.api import HordeAPI
from ..koboldcpp.api import KcppAPI
from ..settings import WorkerSettings
from .job import SUBMIT_MARGIN_S, JobContext
from .journal import Journal

log = logging.getLogger("koboldcpp_horde_chat.runs")

#: Read timeout of an abort, seconds: best effort, and the fault must still fit the lease.
ABORT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class StopSignal:
    """The worker's stop, as a job run sees it.

    Attributes:
        event: set when the worker is asked to stop.
        deadline: the stop's deadline (``clock`` seconds), or None while the
            worker is not stopping under one.
        clock: the clock of the deadline and of :meth:`pause`.
    """

    event: threading.Event
    deadline: Callable[[], float | None]
    clock: Clock

    def pause(self, seconds: float) -> None:
        """Wait ``seconds`` (a job's own retry pause), never longer: a stop does not
        shorten it, but its deadline does, so that the retry after it makes its
        last attempt by the deadline."""
        clock = self.clock
        if self.deadline() is None and not self.event.is_set():
            start = clock.monotonic()
            if not self.event.wait(seconds):
                return
            seconds -= clock.monotonic() - start  # the stop came: the rest of the wait
        deadline = self.deadline()
        if deadline is not None:
            seconds = min(seconds, deadline - clock.monotonic())
        clock.sleep(seconds)


@dataclass(frozen=True)
class KoboldcppPort:
    """koboldcpp as a job run uses it (see the module docstring).

    Attributes:
        backend: the koboldcpp client of the loop's thread.
        abort_backend: a second client, for the stop of a generation sent from
            another thread (the stop's deadline).
        clock: the clock of the leases.
        stop: the stop (busy retries pause through it).
        note_own_request, note_own_request_done: called before and after each
            generation request the worker sends (:meth:`own_request`).
    """

    backend: KcppAPI
    abort_backend: KcppAPI
    clock: Clock
    stop: StopSignal
    note_own_request: Callable[[], None] = lambda: None
    note_own_request_done: Callable[[], None] = lambda: None

    @contextmanager
    def own_request(self) -> Iterator[None]:
        """Around one generation request of the worker's to koboldcpp, so that a
        standalone worker does not take it for a local user's."""
        self.note_own_request()
        try:
            yield
        finally:
            self.note_own_request_done()

    def abort_quietly(self, genkey: str) -> None:
        """Best-effort abort of the local generation (see :func:`abort_quietly`)."""
        abort_quietly(self.backend, genkey)

    def stop_generation(self, genkey: str) -> None:
        """End a job's local generation from another thread (the job was given
        up): close the connection of its request (with koboldcpp batching an
        abort by genkey stops nothing), then abort it by its genkey."""
        self.backend.hang_up()
        if genkey:
            abort_quietly(self.abort_backend, genkey)

    def with_busy_retry(
        self, call: Callable[[float], dict[str, Any]], ctx: JobContext
    ) -> dict[str, Any]:
        """Call the backend for the job in hand, waiting out 503 busy answers
        while the lease allows.

        ``call`` gets the read timeout in seconds (what is left of the lease
        before the submit margin). A timeout aborts the local generation (by
        ``ctx.genkey``) before raising.

        Raises:
            BackendError: the lease ran out or the backend failed.
            JobFault: the job was abandoned meanwhile (its generation aborted).
        """
        while True:
            ctx.check_abandoned()
            remaining = ctx.lease.remaining(self.clock.monotonic()) - SUBMIT_MARGIN_S
            if remaining <= 1.0:
                raise BackendError("the lease ran out before koboldcpp answered")
            try:
                with self.own_request():  # the worker's own, not a local user's
                    answer = call(remaining)
            except BackendUnauthorized:
                raise
            except BackendBusy:
                # Waited out until the lease or the stop's grace period ends.
                self.stop.pause(min(2.0, max(0.0, remaining - 1.0)))
                continue
            except BackendError as exc:
                ctx.check_abandoned()
                if exc.status == 0:
                    self.abort_quietly(ctx.genkey)
                raise
            ctx.check_abandoned()
            return answer


@dataclass(frozen=True)
class Ports:
    """The ports of one pop loop's job runs (see the module docstring).

    Attributes:
        settings: the worker's configuration.
        horde: the Horde client (progress posts; the only holder of the API key).
        koboldcpp: koboldcpp (:class:`KoboldcppPort`).
        clock: the clock of the leases, ``started`` and the journal's lease ends.
        stop: the stop (:class:`StopSignal`).
        journal: the worker's job journal (None: no journal).
    """

    settings: WorkerSettings
    horde: HordeAPI
    koboldcpp: KoboldcppPort
    clock: Clock
    stop: StopSignal
    journal: Journal | None = None


def abort_quietly(backend: KcppAPI, genkey: str) -> None:
    """Best-effort abort of the local generation ``genkey``, quick enough to leave
    the lease's margin to the fault that usually follows (koboldcpp answers in
    about 0.1 s); a failure is logged at debug level only."""
    try:
        backend.abort(genkey, timeout_s=ABORT_TIMEOUT_S)
    except BackendError as exc:
        log.debug("abort of %s failed: %s", genkey, exc)
