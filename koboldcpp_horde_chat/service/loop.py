"""The pop loop: pop, dispatch by kind, pause, back off, stop.

Seed: "The pop loop" (flowchart) and "Worked example: koboldcpp's embedded
worker". The loop pops with the declaration when the pop gate lets it
(``service.gate``) and hands each popped job to its driver (``run.driver``),
which takes it in hand, serves it and settles it through the submit pipeline
(``run.submit``). The loop knows that a job runs and ends, not its steps or
its phases. Each popped job ends in one terminal action (``state.life``),
logged with ``job=<id>``.
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

from ..clock import Clock
from ..errors import HordeError, HordeRefusal, HordeUnavailable, PayloadError
from ..horde.api import HordeAPI
from ..horde.declaration import BackendCapabilities
from ..horde.pop import parse_pop
from ..koboldcpp.api import KcppAPI
from ..koboldcpp.manners import OWN_TAIL_S, LocalManners, NoManners
from ..run.driver import JobDriver
from ..run.submit import ReplyBeside, SubmitPipeline
from ..settings import WorkerSettings
from ..state.guard import FAILED_IN_A_ROW
from ..state.job import JobContext, Outcome
from ..state.meter import JobMeter
from ..state.ports import KoboldcppPort, Ports, StopSignal
from ..state.shared import STOP_POP_EXTRA_S, STOP_SUBMIT_EXTRA_S, WorkerState
from ..state.skipped import SkippedReporter
from ..state.status import PauseTracker, describe_pop_refusal
from .backoff import Backoff, EmptyPopBackoff
from .gate import MAINTENANCE_POLL_S, OWN_TAIL_POLL_S, PopGate
from .pop_ahead import EarlyPopTiming, PopAhead

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
        worker_id: the loop's number in log lines (koboldcpp counts from 1).
        state: the state shared with the worker's other loops (a new one on the
            real clock when None). Its clock (``state.shared.WorkerState.clock``)
            is the loop's only clock: the pops, leases, submits, pauses, the
            stop's deadline and the drain all read it; a test gives the state
            a fake clock.
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
            state = WorkerState(settings, stop_event=stop_event)
        clock = state.clock
        self.state = state
        self.stop_event = state.stop_event
        self.manners: LocalManners = manners if manners is not None else NoManners()
        self.caps = caps if caps is not None else BackendCapabilities(vision=settings.vision)
        self.clock: Clock = clock
        self.worker_id = worker_id
        self.pop_horde = pop_horde
        self.abort_backend = abort_backend if abort_backend is not None else backend
        self.gate = PopGate(
            self.manners, backend, state, settings, clock=clock.monotonic, wall=clock.time
        )
        stop = StopSignal(self.stop_event, lambda: state.stop_deadline, clock)
        self.ports = Ports(
            settings=settings,
            horde=horde,
            koboldcpp=KoboldcppPort(
                backend=backend,
                abort_backend=self.abort_backend,
                clock=clock,
                stop=stop,
                note_own_request=self.gate.note_own_request,
                note_own_request_done=self.gate.note_own_request_done,
            ),
            clock=clock,
            stop=stop,
            journal=state.journal,
        )
        self.pipeline = SubmitPipeline(settings, horde, state, stop=stop, retry_horde=retry_horde)
        self._ahead: PopAhead | None = None
        self.retry_horde = retry_horde
        #: Wakes the pop sent during the generation (set when the generation ends).
        self._early_go: threading.Event | None = None
        self._early_timing = EarlyPopTiming()
        #: (monotonic start, max_length) of the text generation under way, and when it ended.
        self._text_generation: tuple[float, int] | None = None
        self._generation_end: float | None = None
        self._beside: ReplyBeside | None = None
        self._error_backoff = Backoff(1.0, 60.0)
        self._empty_backoff = EmptyPopBackoff()
        self._pauses = PauseTracker(
            local_idle_s=settings.local_idle_s,
            kcpp_url=settings.kcpp_url,
            horde_url=settings.horde_url,
            failed_in_a_row=FAILED_IN_A_ROW,
        )
        self._skipped = SkippedReporter()
        self.meter = JobMeter(state, backend, clock.monotonic)
        self.gate.figures = self.meter.figures  # one reader: a probe's figures are seen once
        self.driver = JobDriver(
            self.ports, self.caps, state, self.pipeline, self.meter, self, worker_id
        )

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
        log.info(
            "worker %d: stopped (%s)", self.worker_id, self.state.stop_summary(self.clock.time())
        )
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
        after the stop's signal is faulted at once, see ``run.driver.JobDriver``).
        Under the stop's deadline the pop is waited for until
        ``state.shared.STOP_POP_EXTRA_S`` after it (the Horde client hangs it up then);
        one that did not answer is said and counted (:meth:`_pop_left`)."""
        while self._ahead is not None:
            deadline = self.state.stop_deadline
            if deadline is not None:
                until = deadline + STOP_POP_EXTRA_S + DRAIN_POP_EXTRA_S
                wait_s = max(0.0, until - self.clock.monotonic())
                if not self._ahead.join(wait_s):
                    self._ahead = None
                    self._pop_left("the pop sent beside the last submit did not answer")
                    return
            self._pass()

    def _pop_left(self, what: str, body: dict[str, Any] | None = None) -> None:
        """A pop got no answer and the worker stops: whatever job the Horde assigned
        it goes to a worker that is gone and expires there, an aborted job on the
        worker's count. Say so in one line and count it toward maintenance."""
        log.warning("worker %d: %s by the stop's deadline: %s", self.worker_id, what,
                    POP_LEFT_LINE)
        chat = body is None or "chat_jobs" in body
        self.state.record_lost_pop(self.clock.monotonic(), chat=chat)

    def _wait_jobs_ended(self) -> None:
        """Wait for submits of this loop still retried on threads of their own
        (bounded by the stop's deadline, or by the longest lease)."""
        deadline = self.state.stop_deadline
        bound = (
            deadline + STOP_SUBMIT_EXTRA_S + 0.25 - self.clock.monotonic()
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
        summary = self.state.periodic_summary(self.clock.monotonic(), self.clock.time())
        if summary is not None:
            log.info("worker %d: %s", self.worker_id, summary)
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            early = self._early_go is not None
            ahead.join()
            self._early_go = None
            self._early_timing.popped(ahead.round_trip_s)
            if early and ahead.ctx is not None and self._stopping():
                # It waited behind the last generation: its own could not be known
                # to end by the stop's deadline. Faulted now, never generated.
                ahead.ctx.give_up("popped during the last generation, not generated at the stop")
            if not ahead.skipped:
                return self._after_pop(
                    ahead.body, ahead.answer, ahead.error, ahead.popped_at, ahead.ctx
                )
        if self._stopping():
            return False
        pause = self.gate.pause()
        if pause is not None:
            reason, wait_s = pause
            line = self._pauses.pausing(reason, self.clock.monotonic(), line=self.gate.line)
            if line is not None:
                log.info("worker %d: %s", self.worker_id, line)
            self.stop_event.wait(wait_s)
            return False
        if self._stopping():  # the checks may have found koboldcpp serving something else
            return False
        body = self.state.pop_body(self.caps)
        sent_at = self.clock.monotonic()
        try:
            pop = self.horde.pop(body, timeout_s=self.settings.pop_timeout_s)
        except HordeError as exc:
            return self._after_pop(body, None, exc, self.clock.monotonic())
        popped_at = self.clock.monotonic()
        self._early_timing.popped(popped_at - sent_at)
        return self._after_pop(body, pop, None, popped_at, pop_wait_s=popped_at - sent_at)

    def _after_pop(
        self,
        body: dict[str, Any],
        pop: dict[str, Any] | None,
        error: HordeError | None,
        popped_at: float,
        ctx: JobContext | None = None,
        *,
        pop_wait_s: float = 0.0,
    ) -> bool:
        """Handle a pop's answer (or its failure): serve the job it carries, if any.

        ``ctx`` is the job already taken in hand where the answer arrived
        (the pop sent beside a submit), else None; ``pop_wait_s`` is how long
        the pop waited for its answer.
        """
        if error is not None or pop is None:
            if (
                self.state.stop_deadline is not None
                and isinstance(error, HordeUnavailable)
                and error.status == 0
                and error.sent is not False
            ):
                # No answer while stopping: the Horde may have assigned a job.
                self._pop_left("the pop in flight at the stop got no answer", body)
                return False
            if _answer_lost(error):  # a job may be assigned that expires unseen
                self.state.record_lost_pop(self.clock.monotonic(), chat="chat_jobs" in body)
            if isinstance(error, HordeRefusal):
                self._on_pop_refused(error)
            else:
                delay = self._error_backoff.next_delay(
                    error.retry_after_s if isinstance(error, HordeUnavailable) else None
                )
                line = self._pauses.pausing("horde_down", self.clock.monotonic())
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
            ctx = self.driver.take_in_hand(body, pop, popped_at, pop_wait_s=pop_wait_s)
        if ctx is None:
            return self._no_job(pop, body)
        try:
            self.driver.drive(ctx, pop)
        finally:
            self._generation_over()
        return True

    def _no_job(self, pop: dict[str, Any], body: dict[str, Any]) -> bool:
        """A pop's answer without a job in hand (no usable job id): say why, and
        wait the empty-pop backoff when it carried no job at all. False: no job
        was served."""
        try:
            parse_pop(pop, default_ttl_s=self.settings.lease_s)
        except PayloadError as exc:
            self._empty_backoff.reset()
            log.warning("pop returned a job without a usable id (%s); skipped", exc.path)
            return True
        self.state.flush_journal()  # idle: write what the last jobs' ends left
        line = self._skipped.line(
            pop.get("skipped"), self.clock.monotonic(), self.state.skip_context(body)
        )
        if line is not None:
            log.info("worker %d: no job for this worker: %s", self.worker_id, line)
        if not self._stopping():
            self.stop_event.wait(self._empty_backoff.next_delay())
        return False

    # ------------------------------------------- the driver's hooks (run.driver)

    def payload_read(self) -> None:
        """A job came: the empty-pop backoff starts over (``run.driver.LoopHooks``)."""
        self._empty_backoff.reset()

    def backend_changed(self, ctx: JobContext) -> str | None:
        """Before serving a job that waited since its pop (behind a slow submit, say),
        after koboldcpp failed, or once the host says stop (another loop may have
        seen koboldcpp come back changed): has koboldcpp restarted serving
        another model or context than the job's pop declared? What changed, or
        None (then the job is served under the limits it was popped under)."""
        waited = self.clock.monotonic() - ctx.lease.popped_at
        if (
            waited < RECHECK_AFTER_WAIT_S
            and not self.gate.backend_suspect
            and not self.manners.should_stop()
        ):
            return None
        return self.gate.backend_changed()

    def generation_ended(self) -> None:
        """The job's own request to koboldcpp ended (``PopGate.own_generation_ended``)."""
        self._generation_end = self.clock.monotonic()
        self.gate.own_generation_ended()
        if self._early_go is not None:
            self._early_go.set()

    def _generation_over(self) -> None:
        """The job's serving ended, however: a pop waiting for its generation's end
        goes now, and koboldcpp's lock is no longer taken for the worker's own."""
        self.gate.own_generation_over()
        self._text_generation = None
        if self._early_go is not None:
            self._early_go.set()

    def text_generation_starts(self, ctx: JobContext, max_length: int) -> None:
        """A text job's generation of at most ``max_length`` tokens starts now.

        When koboldcpp's past text generations say this one lasts a while
        (``pop_ahead.EarlyPopTiming``), the next pop goes out during it, on a
        thread of its own, timed so that its answer arrives before the generation
        ends, or at once when it ends earlier. The job it
        brings is taken in hand there and served next, its reply's submit beside it
        (:meth:`reply_beside`): koboldcpp waits for neither round trip. Only when
        the pop beside the submit could go (:meth:`_pop_ahead`) and a fault of this
        job could not change what the next pop declares.
        """
        now = self.clock.monotonic()
        self._text_generation = (now, max_length)
        self.gate.own_generation_started()
        delay = self._early_timing.delay_s(max_length)
        if (
            delay is None
            or self.pop_horde is None
            or self._ahead is not None
            or self.gate.backend_suspect
            or self.state.failure_streak.failing
            or self._stopping()
            or self.state.outcome_may_withdraw(ctx, is_fault=True, now=now)
        ):
            return
        go = threading.Event()
        self._early_go = go
        self._ahead = PopAhead(
            self.pop_horde,
            lambda: self._prepare_early_pop(go, delay),
            self.driver.take_in_hand,
            self.settings.pop_timeout_s,
            self.clock.monotonic,
        )

    def _prepare_early_pop(self, go: threading.Event, delay_s: float) -> dict[str, Any] | None:
        """The pop body of the pop sent during a generation, ``delay_s`` after its
        start or once it ended (see :meth:`_prepare_pop_ahead`); None: no pop then.
        Never while a probe or a re-measure of koboldcpp is due (the gate would
        send it beside the worker's generation)."""
        go.wait(delay_s)
        now = self.clock.monotonic()
        with self.state.lock:
            due = bool(self.state.lease_fit.recheck_due(now))
            failing = any(self.state.failure_streak.kind_failing(k) for k in ("text", "chat"))
        if due or failing or self.state.failure_streak.failing:
            return None
        return self._prepare_pop_ahead()

    def reply_beside(self, ctx: JobContext, outcome: Outcome) -> bool:
        """Send the reply on a thread of its own when the pop sent during the
        generation brought the next job or is still to answer, so that koboldcpp
        starts that job without waiting for the submit's answer, as koboldcpp's
        own worker submits; one such submit at a time per loop, with a Horde
        client of its own. False (the driver sends it) otherwise."""
        ahead = self._ahead
        if (
            self.retry_horde is None
            or ahead is None
            or self._early_go is None  # not the pop sent during the generation
            or (ahead.join(0) and ahead.ctx is None)  # it brought no job
        ):
            return False
        if self._beside is None:
            self._beside = ReplyBeside(self.pipeline)
        self._beside.send(ctx, outcome)
        return True

    def backend_failed(self) -> None:
        """koboldcpp failed a job: checked before the next pop."""
        self.gate.backend_suspect = True

    def terminal_action_next(self, ctx: JobContext, *, is_fault: bool) -> None:
        """The job's terminal action goes out next: the next pop goes beside it
        when it may (:meth:`_pop_ahead`)."""
        started, end = self._text_generation, self._generation_end
        if not is_fault and started is not None and end is not None:
            self._early_timing.generated(end - started[0], started[1])
        self._pop_ahead(ctx, is_fault=is_fault)

    def _pop_ahead(self, ctx: JobContext, *, is_fault: bool) -> None:
        """Send the next pop on its own thread, so that it overlaps this job's submit.

        Only when the loop would pop now anyway (``PopGate.pause``, checked on
        that thread, waiting at most ``OWN_TAIL_S`` for koboldcpp to release
        the lock of the worker's own request); never while stopping, and never
        when the answer to this job's terminal action could change what the
        next pop declares (``WorkerState.outcome_may_withdraw``): that pop
        waits for the answer.
        """
        early = self._ahead
        if early is not None and early.join(0) and early.skipped:
            self._ahead = self._early_go = None  # that pop did not go: one beside
        if (
            self.pop_horde is None
            or self._ahead is not None
            or self.gate.backend_suspect
            or self.state.failure_streak.failing
            or self._stopping()
            or self.state.outcome_may_withdraw(ctx, is_fault=is_fault, now=self.clock.monotonic())
        ):
            return
        self._ahead = PopAhead(
            self.pop_horde,
            self._prepare_pop_ahead,
            self.driver.take_in_hand,
            self.settings.pop_timeout_s,
            self.clock.monotonic,
        )

    def _prepare_pop_ahead(self) -> dict[str, Any] | None:
        """The next pop's body when the loop may pop now, else None (see ``_pop_ahead``)."""
        deadline = self.clock.monotonic() + OWN_TAIL_S
        while True:
            pause = self.gate.pause()
            if pause is None:
                return None if self._stopping() else self.state.pop_body(self.caps)
            if pause[0] != "busy" or self.clock.monotonic() >= deadline or self._stopping():
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
            line = self._pauses.pausing(reason, self.clock.monotonic(), line=advice.line)
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
                "refused",
                self.clock.monotonic(),
                line=f"{advice.line}; trying again, up to a minute apart",
            )
            if line is not None:
                log.warning("worker %d: %s", self.worker_id, line)
            else:
                log.debug("worker %d: pop refused again (%s); retrying in %.1f s",
                          self.worker_id, exc.rc or exc.status, delay)
            self.stop_event.wait(delay)

    # ------------------------------------------------------------ bounded stop

    def fault_job_now(self) -> None:
        """Fault the jobs this loop holds with one quick submit each (the process
        exits now; ``run.driver.JobDriver.fault_jobs_now``)."""
        self.driver.fault_jobs_now()


def _answer_lost(error: HordeError | None) -> bool:
    """A pop sent whose answer never came (a timeout or a reset after sending,
    ``sent`` None) or came as a 5xx (the outcome unknown): the Horde may have
    assigned it a job. Not a 429 or a refusal, which it answers before that."""
    if not isinstance(error, HordeUnavailable):
        return False
    return (error.status == 0 and error.sent is not False) or error.status >= 500
