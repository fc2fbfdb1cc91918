"""The pop loop: pop, hand each job to its driver, pause, back off, stop.

Seed "The pop loop" and "Worked example: koboldcpp's embedded worker". The loop
pops when the pop gate lets it (``service.gate``) and runs each popped job's
steps through its driver (``run.driver``), acting on what each step returns.
Every wait is ``stop_event.wait(seconds)``, so a stop is prompt. Like
koboldcpp's own worker, the loop overlaps a job's submit with the next pop
(``service.pop_ahead``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..errors import HordeRefusal, HordeUnavailable
from ..horde.api import HordeAPI
from ..horde.codes import WORKER_MAINTENANCE
from ..horde.declaration import BackendCapabilities
from ..horde.pop import PopAnswer
from ..inflight import STOP_POP_EXTRA_S, STOP_SUBMIT_EXTRA_S
from ..koboldcpp.api import KcppAPI
from ..koboldcpp.manners import LocalManners, NoManners
from ..run.driver import JobDriver
from ..run.submit import SubmitPipeline
from ..settings import WorkerSettings
from ..state.guard import FAILED_IN_A_ROW
from ..state.job import JobContext
from ..state.meter import JobMeter
from ..state.ports import KoboldcppPort, Ports, StopSignal
from ..state.shared import WorkerState
from ..state.skipped import SkippedReporter
from ..state.status import PauseTracker, describe_pop_refusal
from .backoff import Backoff, EmptyPopBackoff
from .gate import MAINTENANCE_POLL_S, PopGate
from .pop_ahead import NextPop, Popped, pop_now

log = logging.getLogger("koboldcpp_horde_chat.worker")

#: Seconds past the pops' stop deadline the loop still waits for the pop sent ahead
#: (a backstop: the Horde client hangs it up then).
DRAIN_POP_EXTRA_S = 0.25
#: Said when the worker exits with a pop unanswered (and counted as an aborted job).
POP_LEFT_LINE = ("a job may be assigned to this stopped worker and expire on the Horde "
                 "(counted as a possible aborted job)")
#: A job served this many seconds after its pop or later is served only after
#: koboldcpp is read again (it may have restarted meanwhile).
RECHECK_AFTER_WAIT_S = 1.0

class Worker:
    """One pop loop for chat and text jobs.

    Args:
        state: shared with the worker's other loops; its clock is the loop's
            only clock (a test gives it a fake one).
        pop_horde: a second Horde client, for the pop sent ahead (a
            ``requests.Session`` is not shared between threads); None: none.
        abort_backend: a second koboldcpp client for aborts sent from another
            thread at the stop's deadline (default ``backend``).
        retry_horde: makes a Horde client for a submit retried on a thread of
            its own; None: retries on the loop's thread.
    """

    def __init__(
        self, settings: WorkerSettings, *, horde: HordeAPI, backend: KcppAPI, state: WorkerState,
        manners: LocalManners | None = None, caps: BackendCapabilities | None = None,
        worker_id: int = 1, pop_horde: HordeAPI | None = None,
        abort_backend: KcppAPI | None = None, retry_horde: Callable[[], HordeAPI] | None = None,
    ) -> None:
        self.settings, self.horde, self.backend, self.state = settings, horde, backend, state
        self.stop_event, self.clock, self.worker_id = state.stop_event, state.clock, worker_id
        self.pop_horde = pop_horde
        self.manners: LocalManners = manners if manners is not None else NoManners()
        self.caps = caps if caps is not None else BackendCapabilities(vision=settings.vision)
        self.meter = JobMeter(state, backend, self.clock.monotonic)
        self.gate = PopGate(self)
        stop = StopSignal(self.stop_event, lambda: state.stop_deadline, self.clock)
        kcpp = KoboldcppPort(backend, abort_backend if abort_backend is not None else backend,
                             stop, self.manners)
        ports = Ports(settings, horde, kcpp, self.clock, stop, state.journal)
        self.pipeline = SubmitPipeline(settings, horde, state, stop=stop, retry_horde=retry_horde)
        self.next_pop = NextPop(self)
        self._error_backoff, self._empty_backoff = Backoff(1.0, 60.0), EmptyPopBackoff()
        self._pauses = PauseTracker(local_idle_s=settings.local_idle_s, kcpp_url=settings.kcpp_url,
                                    horde_url=settings.horde_url, failed_in_a_row=FAILED_IN_A_ROW)
        self._skipped = SkippedReporter()
        self.driver = JobDriver(ports, self.caps, state, self.pipeline, self.meter, worker_id)

    def run(self) -> int:
        """Run the pop loop until it is to stop. Returns the exit code: 0 after a
        requested stop, 2 when the Horde refused the declaration, 3 the API key."""
        waited = 0
        while not self.stopping() and not self.backend.ready():
            if waited % 10 == 0:  # the first time, then every 30 s
                self._say(f"waiting for koboldcpp at {self.settings.kcpp_url}")
            waited += 1
            self.stop_event.wait(3.0)
        if self.stopping():
            return self.state.exit_code
        s = self.settings
        self._say(f"started as {s.worker_name!r} for model {s.model_id} (chat context "
                  f"{s.max_context_length}, length {s.declared_max_length})")
        if self.worker_id == 1 and (warning := s.max_length_warning()) is not None:
            log.warning("worker %d: %s", self.worker_id, warning)
        if not self.state.wait_recovered():  # the earlier run's jobs first
            return self.state.exit_code
        if self.worker_id == 1:
            self.meter.read_speed()
        with self.state.lock:
            self.state.slots.append(self.driver)
        try:
            while not self.stopping():
                self._pass()
            self.drain()
            deadline = self.state.stop_deadline
            bound = self.settings.lease_cap_s if deadline is None else (
                deadline + STOP_SUBMIT_EXTRA_S + 0.25 - self.clock.monotonic())
            self.state.wait_jobs_ended(self.worker_id, max(0.0, bound))
            self.state.flush_journal()
        finally:
            with self.state.lock:
                self.state.slots.remove(self.driver)
        self._say(f"stopped ({self.state.summary(self.clock.time())})")
        return self.state.exit_code

    def _pass(self) -> None:
        try:
            self.run_once()
        except Exception:  # the loop must survive anything; log it once
            log.exception("worker %d: unexpected error in the pop loop", self.worker_id)
            self.stop_event.wait(self._error_backoff.next_delay())

    def drain(self) -> None:
        """Take the answer of a pop still in flight, if any, so that a popped job gets
        its terminal action also when stopping. Under the stop's deadline it is
        waited for until ``STOP_POP_EXTRA_S`` after it; one that did not answer is
        said and counted."""
        while self.next_pop.ahead is not None:
            deadline = self.state.stop_deadline
            if deadline is not None:
                wait_s = deadline + STOP_POP_EXTRA_S + DRAIN_POP_EXTRA_S - self.clock.monotonic()
                if not self.next_pop.ahead.join(max(0.0, wait_s)):
                    self.next_pop.ahead = None
                    self._pop_left("the pop sent beside the last submit did not answer")
                    return
            self._pass()

    def _pop_left(self, what: str, body: dict[str, Any] | None = None) -> None:
        """A pop got no answer and the worker stops: a job the Horde assigned it
        expires there, an aborted job. Say so and count it toward maintenance."""
        log.warning("worker %d: %s by the stop's deadline: %s", self.worker_id, what,
                    POP_LEFT_LINE)
        self.state.record_lost_pop(self.clock.monotonic(), chat=body is None or "chat_jobs" in body)

    def stopping(self) -> bool:
        return self.stop_event.is_set() or self.manners.should_stop()

    def run_once(self) -> bool:
        """One pass of the pop loop: the answer of the pop sent ahead, or a pop now
        when the gate lets it. True when a job was served."""
        self._say(self.state.periodic_summary(self.clock.monotonic(), self.clock.time()))
        if (popped := self.next_pop.take()) is not None:
            return self._after_pop(popped)
        if self.stopping():
            return False
        if (pause := self.gate.pause()) is not None:
            self._say(self._pauses.pausing(pause[0], self.clock.monotonic(), line=self.gate.line))
            self.stop_event.wait(pause[1])
            return False
        if self.stopping():  # the checks may have found koboldcpp serving something else
            return False
        return self._after_pop(pop_now(self, self.horde, self.state.pop_body(self.caps)))

    def _after_pop(self, popped: Popped) -> bool:
        body, error, answer = popped.body, popped.error, popped.answer
        if answer is None:
            unanswered = (isinstance(error, HordeUnavailable) and error.status == 0
                          and error.sent is not False)
            if unanswered and self.state.stop_deadline is not None:
                # No answer while stopping: the Horde may have assigned a job.
                self._pop_left("the pop in flight at the stop got no answer", body)
                return False
            if unanswered or (isinstance(error, HordeUnavailable) and error.status >= 500):
                # The Horde may have assigned a job, which expires unseen (not so
                # after a 429 or a refusal, answered before that).
                self.state.record_lost_pop(self.clock.monotonic(), chat="chat_jobs" in body)
            if isinstance(error, HordeRefusal):
                self._on_pop_refused(error)
            else:
                retry_after = error.retry_after_s if isinstance(error, HordeUnavailable) else None
                delay = self._error_backoff.next_delay(retry_after)
                self._pause("horde_down", delay, None, f" ({error})",
                            again=f"pop failed: {error}; retrying in {delay:.1f} s")
            return False
        self._error_backoff.reset()
        self._say(self._pauses.popping(popped.popped_at))
        for message in self.state.new_moderator_lines(answer.messages):
            log.warning("worker %d: %s", self.worker_id, message)
        ctx = popped.ctx or self.driver.take_in_hand(  # not taken in hand on the pop's thread
            body, answer, popped.popped_at, pop_wait_s=popped.wait_s)
        if ctx is None:
            return self._no_job(answer, body)
        try:
            with self.driver.serving(ctx):
                self._serve(ctx, answer)
        finally:
            self.next_pop.generation_over()
        return True

    def _say(self, line: str | None) -> None:
        if line is not None:
            log.info("worker %d: %s", self.worker_id, line)

    def _no_job(self, answer: PopAnswer, body: dict[str, Any]) -> bool:
        """A pop's answer without a usable job id: say why, and wait the empty-pop
        backoff when it carried no job at all. False: no job was served."""
        if answer.error is not None:
            self._empty_backoff.reset()
            log.warning("pop returned a job without a usable id (%s); skipped", answer.error.path)
            return True
        self.state.flush_journal()  # idle: write what the last jobs' ends left
        line = self._skipped.line(answer.skipped, self.clock.monotonic(),
                                  self.state.skip_context(body))
        self._say(None if line is None else f"no job for this worker: {line}")
        if not self.stopping():
            self.stop_event.wait(self._empty_backoff.next_delay())
        return False

    def _serve(self, ctx: JobContext, answer: PopAnswer) -> None:
        """The job's steps (``run.driver``) and what the loop does around them: the
        early pop during a text generation, the next pop beside the terminal action."""
        driver, next_pop = self.driver, self.next_pop
        served = driver.open(ctx, answer)
        self._empty_backoff.reset()  # a job came, valid or malformed
        if not served.ended:
            # How koboldcpp now differs from the job's pop's declaration, read only for
            # a job that waited, after koboldcpp failed, or once the host says stop.
            waited = self.clock.monotonic() - ctx.lease.popped_at >= RECHECK_AFTER_WAIT_S
            recheck = waited or self.gate.backend_suspect or self.manners.should_stop()
            served = driver.prepare(ctx, served, self.manners.recheck() if recheck else None)
        if served.text_max_length is not None:
            next_pop.text_generation_starts(ctx, served.text_max_length)
        if not served.ended:
            served = driver.generate(ctx, served)
        fault, outcome = served.fault, served.outcome
        if served.backend_failed:
            # A killed koboldcpp shows as no answer, a reset or a stream cut short.
            self.gate.backend_suspect = True
            if fault is not None and served.job is not None:
                self.meter.failed(ctx, served.job)
        if served.generation_ended:
            next_pop.generation_ended()
        if fault is not None:
            next_pop.terminal_action_next(ctx, is_fault=True)
            self.pipeline.fault(ctx, fault)
        elif outcome is not None and served.job is not None:
            self.meter.generated(ctx, served.job, outcome.body)
            seconds = self.clock.monotonic() - ctx.started
            next_pop.terminal_action_next(ctx, is_fault=False)
            if not next_pop.reply_beside(ctx, outcome):
                driver.reply(ctx, outcome)
            driver.check_speed(outcome, seconds)

    def _on_pop_refused(self, exc: HordeRefusal) -> None:
        """Say the refusal and what the owner can do; stop, wait a minute, or back off."""
        advice = describe_pop_refusal(exc.status, exc.rc, exc.message)
        if advice.action == "stop_key":
            self.state.stop_for_key(exc, advice.line)
        elif advice.action == "stop_config":
            self.state.stop_for_config(advice.line)
        elif advice.action == "owner":
            reason = "maintenance" if exc.rc == WORKER_MAINTENANCE else "refused"
            self._pause(reason, MAINTENANCE_POLL_S, advice.line,
                        again=f"worker {self.worker_id}: still refused ({exc.rc or exc.status})")
        else:
            delay = self._error_backoff.next_delay()
            self._pause("refused", delay, f"{advice.line}; trying again, up to a minute apart",
                        again=f"worker {self.worker_id}: pop refused again "
                        f"({exc.rc or exc.status}); retrying in {delay:.1f} s")

    def _pause(self, reason: str, wait_s: float, line: str | None, suffix: str = "", *,
               again: str) -> None:
        """Say a pause in one line when it starts or changes (``again``, at debug
        level, while it lasts; "popping again" once a pop is answered), then wait."""
        said = self._pauses.pausing(reason, self.clock.monotonic(), line=line)
        if said is not None:
            log.warning("worker %d: %s%s", self.worker_id, said, suffix)
        else:
            log.debug("%s", again)
        self.stop_event.wait(wait_s)
