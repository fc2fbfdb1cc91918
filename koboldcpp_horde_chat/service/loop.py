"""The pop loop: pop, dispatch by kind, pause, back off, stop.

Seed: "The pop loop" (flowchart) and "Worked example: koboldcpp's embedded
worker". The loop pops with the declaration when the pop gate lets it
(``service.gate``), hands each popped job to its run (``run.chat``,
``run.text``) and the run's outcome to the submit pipeline (``run.submit``).
It knows that a job runs and ends, not the steps of a chat job. Each popped
job ends in one terminal action (``state.life``), logged with ``job=<id>``.
Every wait is ``stop_event.wait(seconds)``, so a stop is prompt.

Like koboldcpp's own worker, the loop overlaps a job's submit with the next
pop (``service.pop_ahead``), so koboldcpp waits for the Horde about one
round trip per job, not two.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..errors import (
    HordeError,
    HordeRefusal,
    HordeUnavailable,
    JobEnded,
    JobFault,
    PayloadError,
)
from ..horde.api import HordeAPI
from ..horde.declaration import BackendCapabilities
from ..horde.pop import ChatJob, parse_pop
from ..koboldcpp.api import KcppAPI
from ..koboldcpp.manners import OWN_TAIL_S, LocalManners, NoManners
from ..run.chat import ChatRun
from ..run.submit import SubmitPipeline
from ..run.text import serve_text
from ..settings import WorkerSettings
from ..state.guard import FAILED_IN_A_ROW
from ..state.job import Edges, JobContext, Lease, abort_quietly
from ..state.life import Move, Phase
from ..state.meter import JobMeter
from ..state.shared import STOP_POP_EXTRA_S, STOP_SUBMIT_EXTRA_S, WorkerState
from ..state.skipped import SkippedReporter
from ..state.status import PauseTracker, describe_pop_refusal, first_chat_job_line
from .backoff import Backoff, EmptyPopBackoff
from .gate import MAINTENANCE_POLL_S, OWN_TAIL_POLL_S, PopGate
from .pop_ahead import PopAhead

log = logging.getLogger("koboldcpp_horde_chat.worker")

#: Seconds past the pops' stop deadline (``state.shared.STOP_POP_EXTRA_S`` after the
#: stop's) the loop still waits for the pop sent beside a submit: a backstop, for
#: the Horde client hangs it up then.
DRAIN_POP_EXTRA_S = 0.25
#: Said when the worker exits with a pop unanswered (and counted as an aborted job).
POP_LEFT_LINE = (
    "a job may be assigned to this stopped worker and expire on the Horde "
    "(counted as a possible aborted job)"
)
#: A job served this many seconds after its pop or later is served only after
#: koboldcpp is read again (it may have restarted meanwhile).
RECHECK_AFTER_WAIT_S = 1.0

class Worker:
    """One pop loop for chat and text jobs.

    Args:
        settings: the worker's configuration.
        horde: the Horde client (the only holder of the API key).
        backend: the koboldcpp client.
        stop_event: set it to stop; the loop then ends after the job in hand.
        manners: local-use signals from the host.
        caps: what the backend implements (drives the declaration).
        clock: monotonic seconds; wall: epoch seconds (default: the shared
            state's clock; tests may pass fakes). The stop's deadline is on the
            state's clock, and the drain reads that clock.
        worker_id: the loop's number in log lines (koboldcpp counts from 1).
        state: the state shared with the worker's other loops (a new one when None).
        pop_horde: a second Horde client, used only by the pop that overlaps a
            submit (a ``requests.Session`` is not shared between threads);
            None: no overlap, each submit ends before the next pop.
        abort_backend: a second koboldcpp client for aborts sent from another
            thread at the end of a stop's grace period (default ``backend``).
        retry_horde: makes a Horde client for a submit retried on a thread of
            its own (``submit.SubmitPipeline``); None: retries on the loop's thread.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        horde: HordeAPI,
        backend: KcppAPI,
        stop_event: threading.Event | None = None,
        manners: LocalManners | None = None,
        caps: BackendCapabilities | None = None,
        clock: Callable[[], float] | None = None,
        wall: Callable[[], float] | None = None,
        worker_id: int = 1,
        state: WorkerState | None = None,
        pop_horde: HordeAPI | None = None,
        abort_backend: KcppAPI | None = None,
        retry_horde: Callable[[], HordeAPI] | None = None,
    ) -> None:
        self.settings = settings
        self.horde = horde
        self.backend = backend
        if state is None:
            state = WorkerState(
                settings, stop_event=stop_event, started_at=None if wall is None else wall()
            )
        if clock is None:
            clock = state.clock.monotonic
        if wall is None:
            wall = state.clock.time
        self.state = state
        self.stop_event = state.stop_event
        self.manners: LocalManners = manners if manners is not None else NoManners()
        self.caps = caps if caps is not None else BackendCapabilities(vision=settings.vision)
        self.clock = clock
        self.wall = wall
        self.worker_id = worker_id
        self.pop_horde = pop_horde
        self.abort_backend = abort_backend if abort_backend is not None else backend
        self.gate = PopGate(self.manners, backend, state, settings, clock=clock, wall=wall)
        self.edges = Edges(
            settings=settings,
            horde=horde,
            backend=backend,
            clock=clock,
            stop_event=self.stop_event,
            note_own_request=self.gate.note_own_request,
            note_own_request_done=self.gate.note_own_request_done,
            wall=wall,
            journal=state.journal,
            stop_deadline=lambda: state.stop_deadline,
        )
        self.pipeline = SubmitPipeline(
            settings, horde, state, clock=clock, wall=wall, pause=self.edges.pause,
            retry_horde=retry_horde,
        )
        self._ahead: PopAhead | None = None
        self._error_backoff = Backoff(1.0, 60.0)
        self._empty_backoff = EmptyPopBackoff()
        self._pauses = PauseTracker(
            local_idle_s=settings.local_idle_s,
            kcpp_url=settings.kcpp_url,
            horde_url=settings.horde_url,
            failed_in_a_row=FAILED_IN_A_ROW,
        )
        self._skipped = SkippedReporter()
        self.meter = JobMeter(state, backend, clock)

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
            return self.state.exit_code
        log.info(
            "worker %d: started as %r for model %s (chat context %d, length %d)",
            self.worker_id,
            self.settings.worker_name,
            self.settings.model_id,
            self.settings.max_context_length,
            self.settings.declared_max_length,
        )
        warning = self.settings.max_length_warning()
        if warning is not None and self.worker_id == 1:
            log.warning("worker %d: %s", self.worker_id, warning)
        if not self.state.wait_recovered():  # the earlier run's jobs first
            return self.state.exit_code
        if self.worker_id == 1:
            self.meter.read_speed()
        with self.state.lock:
            self.state.slots.append(self)
        try:
            while not self._stopping():
                self._pass()
            self.drain()
            self._wait_jobs_ended()
            self.state.flush_journal()
        finally:
            with self.state.lock:
                self.state.slots.remove(self)
        log.info("worker %d: stopped (%s)", self.worker_id, self.state.stop_summary(self.wall()))
        return self.state.exit_code

    def _pass(self) -> None:
        try:
            self.run_once()
        except Exception:  # the loop must survive anything; log it once
            log.exception("worker %d: unexpected error in the pop loop", self.worker_id)
            self.stop_event.wait(self._error_backoff.next_delay())

    def drain(self) -> None:
        """Take the answer of a pop still in flight, if any: a popped job always
        gets its terminal action, also when the loop is stopping (a job popped
        after the stop's signal is faulted at once, see :meth:`_serve_popped`).
        Under the stop's deadline the pop is waited for until
        ``state.shared.STOP_POP_EXTRA_S`` after it (the Horde client hangs it up then);
        one that did not answer is said and counted (:meth:`_pop_left`)."""
        while self._ahead is not None:
            deadline = self.state.stop_deadline
            if deadline is not None:
                until = deadline + STOP_POP_EXTRA_S + DRAIN_POP_EXTRA_S
                wait_s = max(0.0, until - self.state.clock.monotonic())
                if not self._ahead.join(wait_s):
                    self._ahead = None
                    self._pop_left("the pop sent beside the last submit did not answer")
                    return
            self._pass()

    def _pop_left(self, what: str) -> None:
        """A pop got no answer and the worker stops: whatever job the Horde assigned
        it goes to a worker that is gone and expires there, an aborted job on the
        worker's count. Say so in one line and count it toward maintenance."""
        log.warning("worker %d: %s by the stop's deadline: %s", self.worker_id, what,
                    POP_LEFT_LINE)
        self.state.record_expired(self.clock())

    def _wait_jobs_ended(self) -> None:
        """Wait for submits of this loop still retried on threads of their own
        (bounded by the stop's deadline, or by the longest lease)."""
        deadline = self.state.stop_deadline
        bound = (
            deadline + STOP_SUBMIT_EXTRA_S + 0.25 - self.state.clock.monotonic()
            if deadline is not None
            else self.settings.lease_cap_s
        )
        self.state.wait_jobs_ended(self.worker_id, max(0.0, bound))

    def _stopping(self) -> bool:
        return self.stop_event.is_set() or self.manners.should_stop()

    def run_once(self) -> bool:
        """One pass of the pop loop. Returns True when a job was served.

        The pop's answer is the one the previous pass sent while it submitted,
        when there is one; otherwise the loop checks its manners and pops now.
        """
        summary = self.state.periodic_summary(self.clock(), self.wall())
        if summary is not None:
            log.info("worker %d: %s", self.worker_id, summary)
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.join()
            if not ahead.skipped:
                return self._after_pop(
                    ahead.body, ahead.answer, ahead.error, ahead.popped_at, ahead.ctx
                )
        if self._stopping():
            return False
        pause = self.gate.pause()
        if pause is not None:
            reason, wait_s = pause
            line = self._pauses.pausing(reason, self.clock(), line=self.gate.line)
            if line is not None:
                log.info("worker %d: %s", self.worker_id, line)
            self.stop_event.wait(wait_s)
            return False
        if self._stopping():  # the checks may have found koboldcpp serving something else
            return False
        body = self.state.pop_body(self.caps)
        try:
            pop = self.horde.pop(body, timeout_s=self.settings.pop_timeout_s)
        except HordeError as exc:
            return self._after_pop(body, None, exc, self.clock())
        return self._after_pop(body, pop, None, self.clock())

    def _after_pop(
        self,
        body: dict[str, Any],
        pop: dict[str, Any] | None,
        error: HordeError | None,
        popped_at: float,
        ctx: JobContext | None = None,
    ) -> bool:
        """Handle a pop's answer (or its failure): serve the job it carries, if any.

        ``ctx`` is the job already taken in hand where the answer arrived
        (the pop sent beside a submit), else None.
        """
        if error is not None or pop is None:
            if (
                self.state.stop_deadline is not None
                and isinstance(error, HordeUnavailable)
                and error.status == 0
                and error.sent is not False
            ):
                # No answer while stopping: the Horde may have assigned a job.
                self._pop_left("the pop in flight at the stop got no answer")
                return False
            if isinstance(error, HordeRefusal):
                self._on_pop_refused(error)
            else:
                delay = self._error_backoff.next_delay(
                    error.retry_after_s if isinstance(error, HordeUnavailable) else None
                )
                line = self._pauses.pausing("horde_down", self.clock())
                if line is not None:
                    log.warning("worker %d: %s (%s)", self.worker_id, line, error)
                else:
                    log.debug("pop failed: %s; retrying in %.1f s", error, delay)
                self.stop_event.wait(delay)
            return False
        self._error_backoff.reset()
        line = self._pauses.popping(popped_at)
        if line is not None:
            log.info("worker %d: %s", self.worker_id, line)
        for message in self.state.new_moderator_lines(pop.get("messages")):
            log.warning("worker %d: %s", self.worker_id, message)
        if ctx is None:
            ctx = self.receive(body, pop, popped_at)
        if ctx is None:
            return self._serve_popped(pop, None, body)
        try:
            return self._serve_popped(pop, ctx, body)
        except Exception:
            if ctx.settled:
                raise
            # Whatever went wrong, a popped job is answered: never left to expire.
            log.exception("job=%s unexpected error while serving it; faulting it", ctx.id)
            self.pipeline.fault_after_error(ctx, JobFault("internal error"))
            return True
        except BaseException:
            # A forced exit (a second SIGINT or SIGTERM): stop koboldcpp's generation,
            # one quick fault, then go.
            self.fault_job_now()
            raise

    def receive(
        self, body: dict[str, Any], pop: dict[str, Any], popped_at: float
    ) -> JobContext | None:
        """Take the job a pop's answer carries in hand, before anything else happens
        to it: its owner (``state.job.JobContext``) is made, counted in hand for the
        stop (given up at once past the stop's deadline) and journaled, so a
        SIGKILL from here on leaves it for the next start to fault. None when
        the answer carries no usable job id. Runs on the thread the answer
        arrived on."""
        raw_id = pop.get("id")
        if not (isinstance(raw_id, str) and raw_id):
            return None
        declared = body.get("chat_features")
        ctx = JobContext(
            id=raw_id,
            kind="chat" if pop.get("chat") is True else "text",
            lease=Lease.from_pop(pop, popped_at, self.settings.lease_s, self.settings.lease_cap_s),
            started=popped_at,
            model_id=str(body.get("model_id") or self.settings.model_id),
            declared_features=tuple(map(str, declared)) if isinstance(declared, list) else (),
            worker_id=self.worker_id,
        )
        ctx.stop_generation = lambda: self._stop_generation(ctx)
        ctx.popped_in_stop = self.state.stop_deadline is not None
        self.state.hold(ctx)
        self.edges.record(ctx)
        ctx.move(Move.JOURNAL)
        return ctx

    def _serve_popped(
        self, pop: dict[str, Any], ctx: JobContext | None, body: dict[str, Any] | None = None
    ) -> bool:
        """Parse a pop answer and serve its job, if any. True when a job was served.

        ``ctx`` is the job in hand, or None when the pop carried no usable id;
        ``body`` the pop's own (what an empty pop's ``skipped`` line words).
        """
        try:
            job = parse_pop(pop, default_ttl_s=self.settings.lease_s)
        except PayloadError as exc:
            self._empty_backoff.reset()
            if ctx is not None:
                log.warning("job=%s malformed payload at %s: %s", ctx.id, exc.path, exc.problem)
                self._send_fault(ctx, JobFault("malformed payload"))
            else:
                log.warning("pop returned a job without a usable id (%s); skipped", exc.path)
            return True
        if job is None and ctx is not None:  # an id, yet no job the payload describes
            self._send_fault(ctx, JobFault("malformed payload"))
            return True
        if job is None or ctx is None:
            self.state.flush_journal()  # idle: write what the last jobs' ends left
            line = self._skipped.line(
                pop.get("skipped"),
                self.clock(),
                None if body is None else self.state.skip_context(body),
            )
            if line is not None:
                log.info("worker %d: no job for this worker: %s", self.worker_id, line)
            if not self._stopping():
                self.stop_event.wait(self._empty_backoff.next_delay())
            return False
        self._empty_backoff.reset()
        ctx.started = self.clock()
        if isinstance(job, ChatJob) and self.state.first_chat_job():
            log.info("worker %d: %s", self.worker_id, first_chat_job_line(self.settings))
        try:
            ctx.check_abandoned()  # given up already: popped after the stop's deadline
            if ctx.popped_in_stop:
                # The stop has a deadline the job's generation cannot be known to
                # meet. Faulted now, the request goes to another worker at once;
                # left to expire, it would wait out the lease first, and the Horde
                # counts either as an aborted job (abort(), then wp.n += 1).
                raise JobFault("popped after the stop's signal: not generated")
            self._check_backend_unchanged(ctx)
            if isinstance(job, ChatJob):
                outcome = ChatRun(self.edges, self.caps, self.state, job, ctx).serve()
            else:
                outcome = serve_text(self.edges, job, ctx)
        except JobFault as fault:
            if fault.backend_failed:
                # A killed koboldcpp shows as no answer, a reset or a stream cut
                # short; check it is up before the next pop.
                self.gate.backend_suspect = True
                self.meter.failed(ctx, job)
            self._send_fault(ctx, fault)
            return True
        except JobEnded as ended:
            # Cancelled or ended by the Horde: nothing to send.
            if ended.counted:  # its lease ran out: an aborted job on the Horde
                self.meter.ended_by_horde(ctx, job)
            ctx.end(Move.NO_SUBMIT)
            self.state.release(ctx)
            self.gate.own_generation_ended()
            return True
        ctx.move(Move.OUTCOME)
        self.gate.own_generation_ended()
        self.meter.generated(ctx, job, outcome.body)
        self._pop_ahead(ctx, is_fault=False)
        self.pipeline.reply(ctx, outcome.body, detail=outcome.detail, on_refused=outcome.on_refused)
        return True

    def _check_backend_unchanged(self, ctx: JobContext) -> None:
        """Before serving a job that waited since its pop (behind a slow submit, say),
        after koboldcpp failed, or once the host says stop (another loop may have
        seen koboldcpp come back changed): has koboldcpp restarted serving
        another model or context than the job's pop declared? Then the job is
        not served under limits koboldcpp no longer has.

        Raises:
            JobFault: koboldcpp serves something else now.
        """
        waited = self.clock() - ctx.lease.popped_at
        if (
            waited < RECHECK_AFTER_WAIT_S
            and not self.gate.backend_suspect
            and not self.manners.should_stop()
        ):
            return
        changed = self.gate.backend_changed()
        if changed is not None:
            raise JobFault(f"{changed}: the job was popped under the old declaration")

    def _send_fault(self, ctx: JobContext, fault: JobFault) -> None:
        if ctx.phase is Phase.GENERATING:
            self.gate.own_generation_ended()
        self._pop_ahead(ctx, is_fault=True)
        self.pipeline.fault(ctx, fault)

    def _pop_ahead(self, ctx: JobContext, *, is_fault: bool) -> None:
        """Send the next pop on its own thread, so that it overlaps this job's submit.

        Only when the loop would pop now anyway (``PopGate.pause``, checked on
        that thread, waiting at most ``OWN_TAIL_S`` for koboldcpp to release
        the lock of the worker's own request); never while stopping, and never
        when the answer to this job's terminal action could change what the
        next pop declares (``WorkerState.outcome_may_withdraw``): that pop
        waits for the answer.
        """
        if (
            self.pop_horde is None
            or self._ahead is not None
            or self.gate.backend_suspect
            or self.state.failure_streak.failing
            or self._stopping()
            or self.state.outcome_may_withdraw(ctx, is_fault=is_fault, now=self.clock())
        ):
            return
        self._ahead = PopAhead(
            self.pop_horde,
            self._prepare_pop_ahead,
            self.receive,
            self.settings.pop_timeout_s,
            self.clock,
        )

    def _prepare_pop_ahead(self) -> dict[str, Any] | None:
        """The next pop's body when the loop may pop now, else None (see ``_pop_ahead``)."""
        deadline = self.clock() + OWN_TAIL_S
        while True:
            pause = self.gate.pause()
            if pause is None:
                return None if self._stopping() else self.state.pop_body(self.caps)
            if pause[0] != "busy" or self.clock() >= deadline or self._stopping():
                return None
            self.stop_event.wait(OWN_TAIL_POLL_S)

    def _on_pop_refused(self, exc: HordeRefusal) -> None:
        """Name the refusal by its ``rc`` and say what the owner can do
        (``status.describe_pop_refusal``); stop, wait a minute, or back off."""
        advice = describe_pop_refusal(exc.status, exc.rc, exc.message)
        if advice.action == "stop_key":
            self.state.stop_for_key(exc, advice.line)
        elif advice.action == "stop_config":
            self.state.stop_for_config(advice.line)
        elif advice.action == "owner":
            reason = "maintenance" if exc.rc == "WorkerMaintenance" else "refused"
            line = self._pauses.pausing(reason, self.clock(), line=advice.line)
            if line is not None:
                log.warning("worker %d: %s", self.worker_id, line)
            else:
                log.debug("worker %d: still refused (%s)", self.worker_id, exc.rc or exc.status)
            self.stop_event.wait(MAINTENANCE_POLL_S)
        else:
            # One line when pops start being refused so (and when the refusal changes),
            # not one per retry; "popping again" when a pop is answered again.
            delay = self._error_backoff.next_delay()
            line = self._pauses.pausing(
                "refused", self.clock(), line=f"{advice.line}; trying again, up to a minute apart"
            )
            if line is not None:
                log.warning("worker %d: %s", self.worker_id, line)
            else:
                log.debug("worker %d: pop refused again (%s); retrying in %.1f s",
                          self.worker_id, exc.rc or exc.status, delay)
            self.stop_event.wait(delay)

    # ------------------------------------------------------------ bounded stop

    def _stop_generation(self, ctx: JobContext) -> None:
        """End the job's local generation from another thread (the job was given
        up): close the connection of its request (with koboldcpp batching an
        abort by genkey stops nothing), then abort it by its genkey."""
        self.backend.hang_up()
        if ctx.genkey:
            abort_quietly(self.abort_backend, ctx.genkey)

    def fault_job_now(self) -> None:
        """Fault the jobs this loop holds with one quick submit each (the process
        exits now). Each job's terminal action is taken first, so that the loop,
        whose generation the abort ends, sends nothing more for it."""
        for ctx in self.state.jobs_in_hand(self.worker_id):
            if ctx.phase is Phase.SETTLING:
                continue  # its submit is on the wire: the journal keeps it if that fails
            ctx.give_up("the worker is exiting")
            self.pipeline.fault_now(ctx)

