"""The submit pipeline: the one place that sends a job's reply or fault.

The journal keeps a reply before it is sent and marks a fault sent before it
goes; the job leaves it once the Horde answers (read by
``state.submit_answers``). A lost answer is sent again while the lease lasts,
a fault only when it surely did not reach the Horde. A refused API key stops
the worker; another refused reply is faulted instead (seed "Submit refusals").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import HordeRefusal, JobFault
from ..horde.api import HordeAPI
from ..settings import WorkerSettings
from ..state.job import JobContext, Outcome
from ..state.journal import send_terminal
from ..state.journal_rules import next_start_plan
from ..state.life import Move, Phase
from ..state.ports import StopSignal
from ..state.shared import WorkerState
from ..state.submit_answers import Answer, Reading, refused_reply_fault
from ..translate.submits import job_fault_submit

log = logging.getLogger("koboldcpp_horde_chat.submit")

#: Seconds one submit attempt may take when the process is exiting.
EXIT_SUBMIT_TIMEOUT_S = 5.0
#: The shortest read timeout a submit is sent with while stopping, seconds.
STOP_SUBMIT_MIN_TIMEOUT_S = 0.1

RefusalHandler = Callable[[HordeRefusal], JobFault]
"""Turns the Horde's refusal of a reply into the fault that follows it."""


@dataclass
class _Submit:
    """A terminal action being sent (``on_refused`` None: a fault)."""

    ctx: JobContext
    body: dict[str, Any]
    detail: str
    on_refused: RefusalHandler | None
    started: float
    attempts: int = 0


@dataclass(eq=False)
class SubmitPipeline:
    """Sends terminal actions for one pop loop, on ``state``'s clock.

    Each method takes the job's terminal action (``JobContext.settle``) first,
    and releases the job once the answer is definitive. A lost answer is retried
    after ``stop.pause`` on a thread of its own with a client from
    ``retry_horde`` (None: on the caller's), while the loop pops nothing.
    """

    settings: WorkerSettings
    horde: HordeAPI
    state: WorkerState
    stop: StopSignal
    retry_horde: Callable[[], HordeAPI] | None = None
    #: Replies sent beside the loop's next job: their pipeline, and the last one's thread.
    _beside: SubmitPipeline | None = field(default=None, init=False)
    _beside_thread: threading.Thread | None = field(default=None, init=False)

    def _now(self) -> float:
        return self.state.clock.monotonic()

    def reply(
        self,
        ctx: JobContext,
        body: dict[str, Any],
        *,
        detail: str,
        on_refused: RefusalHandler = refused_reply_fault,
    ) -> None:
        """Submit a job's reply (``detail`` goes into the accepted line); after a
        refusal, fault it with ``on_refused(exc)``."""
        if not ctx.settle():
            return
        journal = self.state.journal
        if journal is not None:  # a restart sends this reply, not a fault
            journal.keep_reply(ctx.id, body)
        if not self._send(_Submit(ctx, body, detail, on_refused, ctx.started)):
            self.state.release(ctx)

    def reply_beside(self, ctx: JobContext, outcome: Outcome) -> None:
        """Submit the job's reply (:meth:`reply`) on a thread of its own
        (``submit-<job id>``), beside the loop's next job, once the one before was
        answered, on a Horde client of their own made by ``retry_horde``; an
        unexpected error faults the job."""
        if self._beside is None:
            assert self.retry_horde is not None
            self._beside = replace(self, horde=self.retry_horde())
        if self._beside_thread is not None:
            self._beside_thread.join()
        sender = self._beside

        def run() -> None:
            try:
                sender.reply(
                    ctx, outcome.body, detail=outcome.detail, on_refused=outcome.on_refused
                )
            except Exception:
                log.exception("job=%s unexpected error while submitting it", ctx.id)
                sender.fault(ctx, JobFault("internal error"), after_error=True)

        thread = threading.Thread(target=run, name=f"submit-{ctx.id[:8]}", daemon=True)
        self._beside_thread = thread
        thread.start()

    def fault(self, ctx: JobContext, fault: JobFault, *, after_error: bool = False) -> None:
        """Seed step 7: submit the job's fault (``translate.submits.job_fault_submit``).
        ``after_error``: the safety net, its serving or submit broke unexpectedly
        on the loop's own thread (which may be sending its terminal action)."""
        settling = after_error and ctx.phase is Phase.SETTLING
        if (settling or ctx.settle()) and not self._fault(ctx, fault):
            self.state.release(ctx)

    def _fault(self, ctx: JobContext, fault: JobFault) -> bool:
        """Send the fault (the job is ``settling``); True when its retries were handed off."""
        now = self._now()
        self.state.record_fault(now, counts=fault.counts, kind=ctx.kind, feature=fault.feature)
        if ctx.request:  # the Horde hands the request back at once (state/refaults.py)
            with self.state.lock:
                self.state.refaults.faulted(ctx.request, now, backend_failed=fault.backend_failed)
        reason = f" ({fault.fault_reason})" if fault.fault_reason else ""
        log.warning("job=%s kind=%s faulted%s: %s", ctx.id, ctx.kind, reason, fault.why)
        body = job_fault_submit(ctx.id, ctx.kind, ctx.model_id, fault.fault_reason)
        return self._send(_Submit(ctx, body, "fault", None, self._now()))

    def _next_start_plan(self, ctx: JobContext) -> str:
        journal = self.state.journal
        entry = journal.entry(ctx.id) if journal is not None else None
        return next_start_plan(entry.terminal if entry is not None else None)

    def fault_now(self, ctx: JobContext) -> None:
        """Fault a job with one short submit attempt (the process is exiting);
        it stays in the journal when the attempt fails, for the next start."""
        if not ctx.settle():
            return
        body = job_fault_submit(ctx.id, ctx.kind, ctx.model_id)
        timeout = min(EXIT_SUBMIT_TIMEOUT_S, self._timeout())
        reading = self._attempt(ctx, body, fault=True, timeout=timeout)
        if reading.answer is Answer.ACCEPTED:
            log.warning("job=%s faulted: the worker is exiting now", ctx.id)
            ctx.end(Move.SETTLED)
        else:
            log.warning(
                "job=%s fault failed (%s) and the worker is exiting now: %s",
                ctx.id, reading.why, self._next_start_plan(ctx),
            )
            ctx.end(Move.ABANDON)
        self.state.release(ctx)

    def _timeout(self) -> float:
        """A submit's read timeout, seconds: ``submit_timeout_s``, but no later
        than the submits' stop deadline (``inflight.CallDeadlines``) when stopping."""
        timeout, left = self.settings.submit_timeout_s, self.state.call_deadlines.left("submit")
        return timeout if left is None else min(timeout, max(STOP_SUBMIT_MIN_TIMEOUT_S, left))

    def _attempt(
        self, ctx: JobContext, body: dict[str, Any], *, fault: bool, timeout: float | None = None
    ) -> Reading:
        """One submit, its answer read and journaled (``state.journal.send_terminal``)."""
        sent_at = self._now()
        try:
            reading = send_terminal(self.horde, self.state.journal, ctx.id, body, fault=fault,
                                    timeout_s=self._timeout() if timeout is None else timeout)
        finally:
            ctx.note_horde_wait(self._now() - sent_at)
        if reading.aborted:  # the Horde ended the job first (lease or cancel): an aborted job
            self.state.record_expired(self._now(), ctx.kind)
        return reading

    def _send(self, sub: _Submit) -> bool:
        """Send one submit, its lost answers again while the lease lasts. True when
        the retries went to a thread of their own, False when the job's life ended
        here."""
        ctx, is_fault = sub.ctx, sub.on_refused is None
        while True:
            sub.attempts += 1
            reading = self._attempt(ctx, sub.body, fault=is_fault)
            if reading.answer is Answer.RETRY:
                delay = self._retry_delay(sub, reading)
                if delay is None:
                    return False
                if self.retry_horde is not None:
                    self._retry_elsewhere(sub, delay)
                    return True
                self._pause_for_horde(ctx, delay)
                continue
            if reading.answer is Answer.REFUSED and sub.on_refused is not None:
                # The job is still open on the Horde: fault it now rather than let it expire.
                log.warning("job=%s reply refused: %s", ctx.id, reading.why)
                return self._fault(ctx, sub.on_refused(reading.refusal))
            if reading.answer is Answer.ACCEPTED:
                ctx.end(Move.SETTLED)
                # Out of the journal before the line: a kill after it leaves nothing to send.
                self.state.release(ctx)
                self._log_accepted(sub, reading)
            else:
                self._log_ended(ctx, reading)
                ctx.end(Move.SETTLED)
            return False

    def _log_ended(self, ctx: JobContext, reading: Reading) -> None:
        """The job's line (and counts) after a definitive answer other than accepted."""
        if reading.answer is Answer.DUPLICATE:
            log.info("job=%s already settled (DuplicateGen): nothing more to send", ctx.id)
        elif reading.answer is Answer.LOST:
            log.warning(
                "job=%s the fault's answer was lost (%s); not sent again "
                "(the Horde may have taken it)", ctx.id, reading.why,
            )
        else:
            self.state.record_dropped()
            if reading.answer is Answer.KEY_REFUSED:
                self.state.stop_for_key(reading.refusal)
            elif reading.answer is Answer.ENDED:
                log.warning(
                    "job=%s ended on the Horde before the submit (%s)", ctx.id, reading.refusal.rc
                )
            else:
                log.error("job=%s submit refused: %s; dropped", ctx.id, reading.why)

    def _log_accepted(self, sub: _Submit, reading: Reading) -> None:
        ctx = sub.ctx
        seconds = self._now() - sub.started + (0.0 if sub.on_refused is None else ctx.pop_wait_s)
        retried = f", at attempt {sub.attempts}" if sub.attempts > 1 else ""  # the failures' end
        if sub.on_refused is None:
            log.info("job=%s kind=%s fault accepted (%.1f s%s)", ctx.id, ctx.kind, seconds, retried)
            return
        self.state.record_reward(reading.kudos)
        gen_s, horde_s = ctx.times()
        log.info(
            "job=%s kind=%s submitted: %s, %.1f s (gen %.1f s, horde %.1f s)%s, %.2f kudos | %s",
            ctx.id, ctx.kind, sub.detail, seconds, gen_s, horde_s, retried, reading.kudos,
            self.state.summary(self.state.clock.time()),
        )

    def _retry_delay(self, sub: _Submit, reading: Reading) -> float | None:
        """Seconds before the next attempt; None when the job's life ended here
        (stopping past the grace: left to the next start; the lease over after
        3 attempts: dropped)."""
        ctx, attempts = sub.ctx, sub.attempts
        remaining = ctx.lease.remaining(self._now())
        if ctx.abandoned.is_set() or self.state.stop_overdue():
            self.state.record_dropped()
            log.error(
                "job=%s submit failed (%s) and the worker is stopping: %s",
                ctx.id, reading.why, self._next_start_plan(ctx),
            )
            ctx.end(Move.ABANDON)
            return None
        if attempts >= 3 and remaining <= 0:
            self.state.record_dropped()
            if sub.on_refused is not None:  # the job expires on the Horde: an aborted job there
                self.state.record_expired(self._now(), ctx.kind)
            log.error(
                "job=%s submit failed (%s), the lease is over; dropped after %d attempts",
                ctx.id, reading.why, attempts,
            )
            ctx.end(Move.SETTLED)
            return None
        delay = min(max(1.0, reading.retry_after_s) * attempts, 10.0)
        if attempts == 1:  # one line when the submit starts failing, not one per retry
            log.warning(
                "job=%s submit failed (%s); retrying while its lease runs (%.0f s left)",
                ctx.id, reading.why, max(remaining, 0.0),
            )
        else:
            log.debug(
                "job=%s submit attempt %d failed (%s); retrying in %.1f s",
                ctx.id, attempts, reading.why, delay,
            )
        return delay

    def _pause_for_horde(self, ctx: JobContext, delay: float) -> None:
        paused_at = self._now()
        try:
            self.stop.pause(delay)
        finally:
            ctx.note_horde_wait(self._now() - paused_at)

    def _retry_elsewhere(self, sub: _Submit, delay: float) -> None:
        """Go on retrying on a thread of its own (``submit-retry-<job id>``)."""
        assert self.retry_horde is not None
        make_horde, ctx = self.retry_horde, sub.ctx
        with self.state.lock:
            self.state.retrying_submits += 1

        def run() -> None:
            horde = make_horde()
            sender = SubmitPipeline(self.settings, horde, self.state, stop=self.stop)
            try:
                sender._pause_for_horde(ctx, delay)
                sender._send(sub)
            except Exception:  # never lose the job to an unexpected error: fault it
                log.exception("job=%s unexpected error while retrying its submit", ctx.id)
                if ctx.phase is Phase.SETTLING:
                    sender._fault(ctx, JobFault("internal error"))
            finally:
                with self.state.lock:
                    self.state.retrying_submits -= 1
                self.state.release(ctx)
                horde.close()

        threading.Thread(target=run, name=f"submit-retry-{ctx.id[:8]}", daemon=True).start()
