"""What a pop loop's job runs use: the Horde, koboldcpp, the clock, the stop
and the journal (one :class:`Ports` per loop)."""

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
from ..koboldcpp.manners import LocalManners
from ..settings import WorkerSettings
from .job import SUBMIT_MARGIN_S, JobContext
from .journal import Journal

log = logging.getLogger("koboldcpp_horde_chat.runs")

#: Read timeout of an abort, seconds: best effort, and the fault must still fit the lease.
ABORT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class StopSignal:
    """The worker's stop as a job run sees it: ``deadline()`` is None until
    the worker stops under one."""

    event: threading.Event
    deadline: Callable[[], float | None]
    clock: Clock

    def pause(self, seconds: float) -> None:
        """A job's retry pause: a stop does not shorten it, its deadline does (the
        retry after it then comes by the deadline)."""
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
    """koboldcpp as a job run uses it; ``abort_backend`` is a second client, to
    stop a generation from another thread; ``manners`` hears of the worker's
    own generation requests."""

    backend: KcppAPI
    abort_backend: KcppAPI
    stop: StopSignal
    manners: LocalManners

    @contextmanager
    def own_request(self) -> Iterator[None]:
        """Around the worker's own generation request, so that a standalone
        worker does not take it for a local user's."""
        self.manners.note_own_request()
        try:
            yield
        finally:
            self.manners.note_own_request_done()

    def stop_generation(self, genkey: str) -> None:
        """End a given-up job's generation from another thread: hang up its
        request (with koboldcpp batching, an abort by genkey stops nothing),
        then abort it by genkey."""
        self.backend.hang_up()
        if genkey:
            abort_quietly(self.abort_backend, genkey)

    def with_busy_retry(
        self, call: Callable[[float], dict[str, Any]], ctx: JobContext
    ) -> dict[str, Any]:
        """Call koboldcpp for the job, waiting out 503 busy answers while the
        lease allows; ``call`` gets the read timeout (the lease left before the
        submit margin). A timeout aborts the generation before raising.

        Raises:
            BackendError: the lease ran out or the backend failed.
            JobFault: the job was abandoned meanwhile (its generation aborted).
        """
        while True:
            ctx.check_abandoned()
            remaining = ctx.lease.remaining(self.stop.clock.monotonic()) - SUBMIT_MARGIN_S
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
                    abort_quietly(self.backend, ctx.genkey)
                raise
            ctx.check_abandoned()
            return answer


@dataclass(frozen=True)
class Ports:
    """The ports of one pop loop's job runs (``journal`` None: none kept)."""

    settings: WorkerSettings
    horde: HordeAPI
    koboldcpp: KoboldcppPort
    clock: Clock
    stop: StopSignal
    journal: Journal | None = None


def abort_quietly(backend: KcppAPI, genkey: str) -> None:
    """Best-effort abort of the generation ``genkey``, quick enough to leave the
    lease's margin to the fault that usually follows."""
    try:
        backend.abort(genkey, timeout_s=ABORT_TIMEOUT_S)
    except BackendError as exc:
        log.debug("abort of %s failed: %s", genkey, exc)
