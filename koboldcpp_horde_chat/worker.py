"""The pop loop: pop, dispatch by kind, pause, back off, stop.

Seed: "The pop loop" (flowchart) and "Worked example: koboldcpp's embedded
worker". The loop pops with the declaration, yields koboldcpp to local users
(``manners.py``), waits while koboldcpp does not answer or the Horde keeps
the worker in maintenance, and hands each popped job to its run
(``chat_run.py``, ``text_run.py``); the run's outcome goes to the submit
pipeline (``submit.py``). It knows that a job runs and ends, not the steps of
a chat job. Every wait is ``stop_event.wait(seconds)`` so that shutdown is
prompt.

Each popped job ends in exactly one terminal action: an accepted submit, a
fault, or a deliberate no-submit after a cancel or ``ChatJobAborted``. The
reason is logged in one line with ``job=<id>``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from . import jobs
from .backend import KoboldClient
from .backoff import Backoff, EmptyPopBackoff
from .chat_run import ChatRun
from .declaration import BackendCapabilities, pop_body
from .errors import HordeRefusal, HordeUnavailable, JobEnded, JobFault, PayloadError
from .guard import MaintenanceGuard, RefusalGuard
from .horde import HordeClient
from .manners import LocalManners, NoManners
from .runs import Edges, JobContext, Lease
from .settings import WorkerSettings
from .state import WorkerState, WorkerStats, is_key_refusal
from .submit import SubmitPipeline
from .text_run import serve_text

log = logging.getLogger(__name__)

#: Seconds between pops while the Horde keeps the worker in maintenance.
MAINTENANCE_POLL_S = 60.0
#: Seconds between readiness probes while koboldcpp does not answer.
BACKEND_PROBE_S = 3.0


class Worker:
    """One pop loop for chat and text jobs.

    Args:
        settings: the worker's configuration.
        horde: the Horde client (the only holder of the API key).
        backend: the koboldcpp client.
        stop_event: set it to stop; the loop then ends after the job in hand.
        manners: local-use signals from the host.
        caps: what the backend implements (drives the declaration).
        clock: monotonic seconds; wall: epoch seconds (tests may pass fakes).
        worker_id: the loop's number in log lines (koboldcpp counts from 1).
        state: the state shared with the worker's other loops (a new one when None).
    """

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        horde: HordeClient,
        backend: KoboldClient,
        stop_event: threading.Event | None = None,
        manners: LocalManners | None = None,
        caps: BackendCapabilities | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        worker_id: int = 1,
        state: WorkerState | None = None,
    ) -> None:
        self.settings = settings
        self.horde = horde
        self.backend = backend
        if state is None:
            state = WorkerState(settings, stop_event=stop_event, started_at=wall())
        self.state = state
        self.stop_event = state.stop_event
        self.manners: LocalManners = manners if manners is not None else NoManners()
        self.caps = caps if caps is not None else BackendCapabilities(vision=settings.vision)
        self.clock = clock
        self.wall = wall
        self.worker_id = worker_id
        self.edges = Edges(
            settings=settings,
            horde=horde,
            backend=backend,
            clock=clock,
            stop_event=self.stop_event,
            note_own_request=self._note_own_request,
        )
        self.pipeline = SubmitPipeline(
            settings, horde, state, clock=clock, wall=wall, pause=self.edges.pause
        )
        self._error_backoff = Backoff(1.0, 60.0)
        self._empty_backoff = EmptyPopBackoff()
        self._backend_suspect = False
        self._backend_down_logged = False

    # The shared state, under the names the loop has always shown.
    @property
    def stats(self) -> WorkerStats:
        return self.state.stats

    @property
    def exit_code(self) -> int:
        return self.state.exit_code

    @property
    def chat_enabled(self) -> bool:
        return self.state.chat_enabled

    @property
    def withheld(self) -> frozenset[str]:
        return self.state.withheld

    @property
    def maintenance_guard(self) -> MaintenanceGuard:
        return self.state.maintenance_guard

    @property
    def refusal_guard(self) -> RefusalGuard:
        return self.state.refusal_guard

    # ------------------------------------------------------------------ loop

    def run(self) -> int:
        """Run the pop loop until ``stop_event`` is set or the host stops.

        Returns the exit code: 0 after a requested stop, 2 when the Horde refused
        the declaration (ChatDeclarationInvalid), 3 when it refused the API key.
        """
        waited = 0
        while not self._stopping():
            if self.backend.ready():
                break
            if waited % 10 == 0:  # the first time, then every 30 s
                log.info(
                    "worker %d: waiting for koboldcpp at %s", self.worker_id, self.settings.kcpp_url
                )
            waited += 1
            self.stop_event.wait(3.0)
        if self._stopping():
            return self.exit_code
        log.info(
            "worker %d: started as %r for model %s (chat context %d, length %d)",
            self.worker_id,
            self.settings.worker_name,
            self.settings.model_id,
            self.settings.max_context_length,
            self.settings.max_length,
        )
        while not self._stopping():
            try:
                self.run_once()
            except Exception:  # the loop must survive anything; log it once
                log.exception("worker %d: unexpected error in the pop loop", self.worker_id)
                self.stop_event.wait(self._error_backoff.next_delay())
        log.info("worker %d: stopped (%s)", self.worker_id, self.state.summary(self.wall()))
        return self.exit_code

    def _stopping(self) -> bool:
        return self.stop_event.is_set() or self.manners.should_stop()

    def run_once(self) -> bool:
        """One pass of the pop loop. Returns True when a job was served."""
        last_local = self.manners.last_local_request_time()
        if last_local is not None and self.wall() - last_local < self.settings.local_idle_s:
            self.stop_event.wait(1.0)
            return False
        if self.manners.model_busy():
            self.stop_event.wait(0.2)
            return False
        if not self._backend_answers():
            self.stop_event.wait(BACKEND_PROBE_S)
            return False
        if not self.state.update_chat_withdrawal(self.clock()):
            self.stop_event.wait(MAINTENANCE_POLL_S)
            return False
        body = pop_body(
            self.settings, self.caps, withhold=self.withheld, chat_jobs=self.chat_enabled
        )
        try:
            pop = self.horde.pop(body, timeout_s=self.settings.pop_timeout_s)
        except HordeRefusal as exc:
            self._on_pop_refused(exc)
            return False
        except HordeUnavailable as exc:
            delay = self._error_backoff.next_delay(exc.retry_after_s)
            log.warning("pop failed: %s; retrying in %.1f s", exc, delay)
            self.stop_event.wait(delay)
            return False
        popped_at = self.clock()
        self._error_backoff.reset()
        raw_id = pop.get("id")
        if not (isinstance(raw_id, str) and raw_id):
            return self._serve_popped(pop, None)
        ctx = JobContext(
            id=raw_id,
            kind="chat" if pop.get("chat") is True else "text",
            lease=self._pop_lease(pop, popped_at),
            started=popped_at,
            pop_body=body,
        )
        try:
            return self._serve_popped(pop, ctx)
        except Exception:
            if ctx.settled:
                raise
            # Whatever went wrong, a popped job is answered: never left to expire.
            log.exception("job=%s unexpected error while serving it; faulting it", ctx.id)
            self.pipeline.fault(ctx, JobFault("internal error"))
            return True
        except BaseException:
            # A forced exit (a second SIGINT or SIGTERM): stop koboldcpp's generation,
            # one quick fault, then go.
            if ctx.genkey:
                self.edges.abort_quietly(ctx.genkey)
            if not ctx.settled:
                self.pipeline.fault_now(ctx.id, chat=ctx.chat)
            raise

    def _serve_popped(self, pop: dict[str, Any], ctx: JobContext | None) -> bool:
        """Parse a pop answer and serve its job, if any. True when a job was served.

        ``ctx`` is the job in hand, or None when the pop carried no usable id.
        """
        try:
            job = jobs.parse_pop(pop, default_ttl_s=self.settings.lease_s)
        except PayloadError as exc:
            self._empty_backoff.reset()
            if exc.job_id and ctx is not None:
                log.warning("job=%s malformed payload at %s: %s", exc.job_id, exc.path, exc.problem)
                self.pipeline.fault(ctx, JobFault("malformed payload"))
            else:
                log.warning("pop returned a job without a usable id (%s); skipped", exc.path)
            return True
        if job is None or ctx is None:
            self.stop_event.wait(self._empty_backoff.next_delay())
            return False
        self._empty_backoff.reset()
        # A lease never runs past the cap progress posts could extend it to.
        ctx.lease = Lease(ctx.lease.popped_at, ctx.lease.popped_at + min(
            job.ttl_s, self.settings.lease_cap_s
        ))
        ctx.started = self.clock()
        try:
            if isinstance(job, jobs.ChatJob):
                outcome = ChatRun(self.edges, self.caps, self.state, job, ctx).serve()
            else:
                outcome = serve_text(self.edges, job, ctx)
        except JobFault as fault:
            if fault.backend_failed:
                # A killed koboldcpp shows as no answer, a reset or a stream cut
                # short; check it is up before the next pop.
                self._backend_suspect = True
            self.pipeline.fault(ctx, fault)
            return True
        except JobEnded:
            ctx.settled = True  # cancelled or ended by the Horde: nothing to send
            return True
        self.pipeline.reply(ctx, outcome.body, detail=outcome.detail, on_refused=outcome.on_refused)
        return True

    def _pop_lease(self, pop: dict[str, Any], popped_at: float) -> Lease:
        """The lease of a popped job before its payload is parsed: its ``ttl`` when
        that is a usable number of seconds, else ``settings.lease_s``; never past
        the lease cap."""
        ttl = pop.get("ttl")
        seconds = self.settings.lease_s
        if isinstance(ttl, (int, float)) and not isinstance(ttl, bool):
            try:
                value = float(ttl)
            except OverflowError:
                value = math.inf
            if value > 0 and not math.isnan(value):
                seconds = value
        return Lease(popped_at, popped_at + min(seconds, self.settings.lease_cap_s))

    def _on_pop_refused(self, exc: HordeRefusal) -> None:
        if exc.rc == "ChatDeclarationInvalid":
            self.state.stop_for_declaration(exc.message)
        elif is_key_refusal(exc):
            self.state.stop_for_key(exc)
        elif exc.rc == "WorkerMaintenance" or exc.status == 403:
            log.warning("the Horde keeps this worker in maintenance: %s", exc.message)
            self.stop_event.wait(MAINTENANCE_POLL_S)
        else:
            delay = self._error_backoff.next_delay()
            log.warning("pop refused: %s; retrying in %.1f s", exc, delay)
            self.stop_event.wait(delay)

    def _backend_answers(self) -> bool:
        """False while koboldcpp, which failed a job without answering, still does not answer.

        A crashed or restarting koboldcpp would otherwise fault every job
        popped meanwhile (each one an aborted job on the Horde, on the way to
        maintenance). The probe is koboldcpp's own readiness GET.
        """
        if not self._backend_suspect:
            return True
        if self.backend.ready():
            self._backend_suspect = False
            if self._backend_down_logged:
                self._backend_down_logged = False
                log.info("koboldcpp at %s answers again: popping", self.settings.kcpp_url)
            return True
        if not self._backend_down_logged:
            self._backend_down_logged = True
            log.warning(
                "koboldcpp at %s does not answer: not popping until it does",
                self.settings.kcpp_url,
            )
        return False

    def _note_own_request(self) -> None:
        note = getattr(self.manners, "note_own_request", None)
        if callable(note):
            note()


def run_worker(
    settings: WorkerSettings,
    *,
    stop_event: threading.Event | None = None,
    manners: LocalManners | None = None,
    caps: BackendCapabilities | None = None,
    worker_id: int = 1,
    backend: KoboldClient | None = None,
) -> int:
    """Build the clients and run one pop loop until stopped; returns the exit code.

    One ``requests.Session`` per client and per thread: call this once per
    worker thread.
    """
    horde = HordeClient(
        settings.horde_url,
        settings.api_key,
        bridge_agent=settings.bridge_agent,
        connect_timeout_s=settings.connect_timeout_s,
    )
    if backend is None:
        backend = KoboldClient(
            settings.kcpp_url,
            settings.kcpp_password,
            connect_timeout_s=settings.connect_timeout_s,
        )
    worker = Worker(
        settings,
        horde=horde,
        backend=backend,
        stop_event=stop_event,
        manners=manners,
        caps=caps,
        worker_id=worker_id,
    )
    return worker.run()
