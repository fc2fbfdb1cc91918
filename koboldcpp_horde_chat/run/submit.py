"""The submit pipeline: the one place that sends a job's terminal action.

A job ends in exactly one terminal action: an accepted submit, a fault, or a
deliberate no-submit (seed "The pop loop"). This module sends the first two:

- :meth:`SubmitPipeline.reply`: the reply (structured for a chat job,
  ``generation`` for a text job);
- :meth:`SubmitPipeline.fault`: the fault, from a :class:`~errors.JobFault`
  (seed "7. Fault a job"), logged in one line with its reason;
- :meth:`SubmitPipeline.fault_now`: one quick fault when the process exits.

The job journal follows every step (``state.journal``): a reply is kept in
it before it is sent (a restart sends the same reply again, never a fault),
a fault is marked sent before it goes (a restart never sends a second one),
and the job is cleared as soon as the Horde answers.

A reply whose answer was lost (no answer, a reset, 5xx, 429) is retried with
the same body while the lease lasts; a fault only when it is known not to
have reached the Horde (``journal_rules.known_not_taken``: a refused
connection, 429, 503), since every fault the Horde takes re-opens the
request: at most one fault per job. ``DuplicateGen`` means the job was already settled,
``AbortedGen`` or 404 that it ended on the Horde; both are logged and dropped.
A refusal of the API key stops the worker. Any other refusal of a reply is
definitive (seed "Submit refusals"): the reply is never sent again, and the
job is faulted instead (``reply_refused`` for the chat refusals).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..errors import HordeError, HordeRefusal, HordeUnavailable, JobFault
from ..horde.api import HordeAPI
from ..horde.codes import is_key_refusal
from ..jsonbody import finite_number
from ..settings import WorkerSettings
from ..state.job import JobContext, Outcome
from ..state.job import refused_reply_fault as refused_reply_fault  # recovery.py imports it here
from ..state.journal_rules import known_not_taken, next_start_plan
from ..state.life import Move, Phase
from ..state.shared import WorkerState
from ..translate.submits import job_fault_submit

log = logging.getLogger("koboldcpp_horde_chat.submit")

#: Seconds one submit attempt may take when the process is exiting.
EXIT_SUBMIT_TIMEOUT_S = 5.0
#: The shortest read timeout a submit is sent with while stopping, seconds.
STOP_SUBMIT_MIN_TIMEOUT_S = 0.1

RefusalHandler = Callable[[HordeRefusal], JobFault]
"""Turns the Horde's refusal of a reply into the fault that follows it."""


class SubmitPipeline:
    """Sends terminal actions for one pop loop (see the module docstring).

    Each method takes the job's terminal action (``JobContext.settle``) first,
    so a job never gets two, and ends the job's life when the Horde's answer
    is definitive (``WorkerState.release``: out of hand, out of the journal).

    A submit whose first attempt got no answer is retried on a thread of its
    own (with a Horde client from ``retry_horde``), so that a job already
    popped beside it is served meanwhile instead of waiting behind the
    retries; while any submit is retried the loop pops nothing
    (``WorkerState.retrying_submits``): a job it could not deliver either
    would only expire on the Horde.

    Args:
        settings: the worker's configuration (``submit_timeout_s``, ``model_id``).
        horde: the Horde client.
        state: the worker's shared state (statistics, maintenance counting, stop).
        clock: monotonic seconds; wall: epoch seconds.
        pause: waits between retries (seconds).
        retry_horde: makes a Horde client for a retry thread; None: retries
            stay on the caller's thread.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        horde: HordeAPI,
        state: WorkerState,
        *,
        clock: Callable[[], float],
        wall: Callable[[], float],
        pause: Callable[[float], None],
        retry_horde: Callable[[], HordeAPI] | None = None,
    ) -> None:
        self.settings = settings
        self.horde = horde
        self.state = state
        self.clock = clock
        self.wall = wall
        self.pause = pause
        self.retry_horde = retry_horde

    def reply(
        self,
        ctx: JobContext,
        body: dict[str, Any],
        *,
        detail: str,
        on_refused: RefusalHandler = refused_reply_fault,
    ) -> None:
        """Submit a job's reply; after a refusal, fault it with ``on_refused(exc)``.

        ``detail`` goes into the log line of an accepted submit. Nothing is
        sent when the job's terminal action was already taken.
        """
        if not ctx.settle():
            return
        journal = self.state.journal
        if journal is not None:  # a restart sends this reply, not a fault
            journal.keep_reply(ctx.id, body)
        if not self._send(ctx, body, detail=detail, on_refused=on_refused):
            self.state.release(ctx)

    def fault(self, ctx: JobContext, fault: JobFault) -> None:
        """Seed step 7: submit the job's fault (with ``fault_reason`` when one applies).

        A chat fault carries the job's ``model_id`` (it marks the body as a chat
        submit); a text fault is ``{"id", "generation": "", "state": "faulted"}``.
        Nothing is sent when the job's terminal action was already taken.
        """
        if ctx.settle() and not self._fault(ctx, fault):
            self.state.release(ctx)

    def fault_after_error(self, ctx: JobContext, fault: JobFault) -> None:
        """Fault a job whose serving or submit broke unexpectedly on the loop's
        own thread (the loop may be sending its terminal action): the safety net."""
        if (ctx.phase is Phase.SETTLING or ctx.settle()) and not self._fault(ctx, fault):
            self.state.release(ctx)

    def _fault(self, ctx: JobContext, fault: JobFault) -> bool:
        """Send the fault (the job is ``settling``); True when its retries were handed off."""
        self.state.record_fault(
            self.clock(), counts=fault.counts, kind=ctx.kind, feature=fault.feature
        )
        if ctx.request:  # the Horde hands the request back at once (state/refaults.py)
            with self.state.lock:
                self.state.refaults.faulted(
                    ctx.request, self.clock(), backend_failed=fault.backend_failed
                )
        log.warning(
            "job=%s kind=%s faulted%s: %s",
            ctx.id,
            ctx.kind,
            f" ({fault.fault_reason})" if fault.fault_reason else "",
            fault.why,
        )
        body = job_fault_submit(ctx.id, ctx.kind, ctx.model_id, fault.fault_reason)
        self._mark_fault_sent(ctx)
        return self._send(ctx, body, detail="fault", on_refused=None, started=self.clock())

    def _mark_fault_sent(self, ctx: JobContext) -> None:
        """Journal the fault as sent before it goes (with the fault history):
        a restart then never sends the job a second one."""
        journal = self.state.journal
        if journal is not None:
            journal.mark_fault_sent(ctx.id)

    def _mark_not_taken(self, ctx: JobContext) -> None:
        """The terminal action just sent did not reach the Horde (journaled so)."""
        journal = self.state.journal
        if journal is not None:
            journal.mark_not_taken(ctx.id)

    def _next_start_plan(self, ctx: JobContext) -> str:
        """What the next start does with ``ctx``, from its state in the journal."""
        journal = self.state.journal
        entry = journal.entry(ctx.id) if journal is not None else None
        return next_start_plan(entry.terminal if entry is not None else None)

    def fault_now(self, ctx: JobContext) -> None:
        """Fault a job with a single short submit attempt (the process is exiting).

        It stays in the journal when the attempt fails, for the next start.
        """
        if not ctx.settle():
            return
        body = job_fault_submit(ctx.id, ctx.kind, ctx.model_id)
        timeout = min(EXIT_SUBMIT_TIMEOUT_S, self._timeout())
        self._mark_fault_sent(ctx)
        try:
            self.horde.submit(body, timeout_s=timeout)
            log.warning("job=%s faulted: the worker is exiting now", ctx.id)
        except HordeError as exc:
            if isinstance(exc, HordeUnavailable) and known_not_taken(exc.status, exc.sent):
                self._mark_not_taken(ctx)  # the next start may fault it
            log.warning(
                "job=%s fault failed (%s) and the worker is exiting now: %s",
                ctx.id, exc.reason, self._next_start_plan(ctx),
            )
            ctx.end(Move.ABANDON)
        else:
            ctx.end(Move.SETTLED)
        self.state.release(ctx)

    def _timeout(self) -> float:
        """A submit's read timeout, seconds: ``submit_timeout_s``, but when the
        worker is stopping no later than ``state.shared.STOP_SUBMIT_EXTRA_S`` after the stop's
        deadline (a supervisor kills the process soon after it): a stop never
        lengthens a wait. The Horde client itself hangs up a submit still in
        flight then, and sends none after it."""
        timeout = self.settings.submit_timeout_s
        left = self.state.call_deadlines.left("submit")
        if left is not None:
            timeout = min(timeout, max(STOP_SUBMIT_MIN_TIMEOUT_S, left))
        return timeout

    def _send(
        self,
        ctx: JobContext,
        body: dict[str, Any],
        *,
        detail: str,
        on_refused: RefusalHandler | None,
        started: float | None = None,
        attempts: int = 0,
    ) -> bool:
        """Send one submit, retrying lost answers with the same body while the lease lasts.

        ``on_refused`` is None for a fault: a refused fault is dropped. The
        reply is never sent twice after a definitive answer. Returns True when
        the retries were handed to a thread of their own (which ends the job's
        life), False when the job's life ended here.
        """
        is_fault = on_refused is None
        started = ctx.started if started is None else started
        while True:
            attempts += 1
            sent_at = self.clock()
            try:
                try:
                    answer = self.horde.submit(body, timeout_s=self._timeout())
                finally:
                    ctx.note_horde_wait(self.clock() - sent_at)
            except HordeRefusal as exc:
                if exc.rc == "DuplicateGen":
                    log.info("job=%s already settled (DuplicateGen): nothing more to send", ctx.id)
                elif is_key_refusal(exc):
                    self.state.record_dropped()
                    self.state.stop_for_key(exc)
                elif exc.rc == "AbortedGen" or exc.status == 404:
                    self.state.record_dropped()
                    if exc.rc == "AbortedGen" and not is_fault:
                        # The Horde ended the job first (its lease ran out, or a
                        # cancel settled it): counted as an aborted job, to be safe.
                        self.state.record_expired(self.clock(), ctx.kind)
                    log.warning("job=%s ended on the Horde before the submit (%s)", ctx.id, exc.rc)
                elif on_refused is not None:
                    # Any other definitive refusal of a reply: the job is still
                    # open on the Horde, so fault it now rather than let it expire.
                    log.warning("job=%s reply refused: %s", ctx.id, exc.reason)
                    return self._fault(ctx, on_refused(exc))
                else:
                    self.state.record_dropped()
                    log.error("job=%s submit refused: %s; dropped", ctx.id, exc.reason)
                ctx.end(Move.SETTLED)
                return False
            except HordeUnavailable as exc:
                remaining = ctx.lease.remaining(self.clock())
                if is_fault:
                    if not known_not_taken(exc.status, exc.sent):
                        # The Horde may have taken it: a second fault would re-open
                        # the request again. Nothing more is sent for this job.
                        log.warning(
                            "job=%s the fault's answer was lost (%s); not sent again "
                            "(the Horde may have taken it)", ctx.id, exc.reason,
                        )
                        ctx.end(Move.SETTLED)
                        return False
                    self._mark_not_taken(ctx)
                if ctx.abandoned.is_set() or self.state.stop_overdue():
                    # Stopping, and the grace period is over: the process exits now.
                    # The job stays in the journal, for the next start to end.
                    self.state.record_dropped()
                    log.error(
                        "job=%s submit failed (%s) and the worker is stopping: %s",
                        ctx.id, exc.reason, self._next_start_plan(ctx),
                    )
                    ctx.end(Move.ABANDON)
                    return False
                if attempts >= 3 and remaining <= 0:
                    self.state.record_dropped()
                    if not is_fault:  # the job expires on the Horde: an aborted job there
                        self.state.record_expired(self.clock(), ctx.kind)
                    log.error(
                        "job=%s submit failed (%s), the lease is over; dropped after %d "
                        "attempts", ctx.id, exc.reason, attempts,
                    )
                    ctx.end(Move.SETTLED)
                    return False
                delay = min(max(1.0, exc.retry_after_s or 0.0) * attempts, 10.0)
                if attempts == 1:  # one line when the submit starts failing, not one per retry
                    log.warning(
                        "job=%s submit failed (%s); retrying while its lease runs (%.0f s left)",
                        ctx.id, exc.reason, max(remaining, 0.0),
                    )
                else:
                    log.debug(
                        "job=%s submit attempt %d failed (%s); retrying in %.1f s",
                        ctx.id, attempts, exc.reason, delay,
                    )
                if self.retry_horde is not None:
                    self._retry_elsewhere(ctx, body, detail, on_refused, started, attempts, delay)
                    return True
                self._pause_for_horde(ctx, delay)
                if is_fault:
                    self._mark_fault_sent(ctx)
                continue
            except HordeError as exc:  # pragma: no cover - the two subclasses above cover all
                log.error("job=%s submit failed: %s", ctx.id, exc.reason)
                ctx.end(Move.SETTLED)
                return False
            ctx.end(Move.SETTLED)
            # Out of hand and out of the journal before the line says it was
            # answered: a kill after the line leaves nothing for the next start.
            self.state.release(ctx)
            seconds = self.clock() - started + (0.0 if is_fault else ctx.pop_wait_s)
            retried = f", at attempt {attempts}" if attempts > 1 else ""  # the failures' end
            if is_fault:
                log.info(
                    "job=%s kind=%s fault accepted (%.1f s%s)", ctx.id, ctx.kind, seconds, retried
                )
            else:
                kudos = reward_kudos(answer.get("reward", 0))
                self.state.record_reward(kudos)
                gen_s, horde_s = ctx.times()
                log.info(
                    "job=%s kind=%s submitted: %s, %.1f s (gen %.1f s, horde %.1f s)%s, "
                    "%.2f kudos | %s",
                    ctx.id,
                    ctx.kind,
                    detail,
                    seconds,
                    gen_s,
                    horde_s,
                    retried,
                    kudos,
                    self.state.summary(self.wall()),
                )
            return False

    def _pause_for_horde(self, ctx: JobContext, delay: float) -> None:
        """Wait ``delay`` seconds before the next submit attempt (a wait on the Horde)."""
        paused_at = self.clock()
        try:
            self.pause(delay)
        finally:
            ctx.note_horde_wait(self.clock() - paused_at)

    def _retry_elsewhere(
        self,
        ctx: JobContext,
        body: dict[str, Any],
        detail: str,
        on_refused: RefusalHandler | None,
        started: float,
        attempts: int,
        delay: float,
    ) -> None:
        """Go on retrying ``body`` on a thread of its own (see the class docstring)."""
        assert self.retry_horde is not None
        make_horde = self.retry_horde
        with self.state.lock:
            self.state.retrying_submits += 1

        def run() -> None:
            horde = make_horde()
            sender = SubmitPipeline(
                self.settings, horde, self.state, clock=self.clock, wall=self.wall,
                pause=self.pause,
            )
            try:
                sender._pause_for_horde(ctx, delay)
                if on_refused is None:
                    sender._mark_fault_sent(ctx)
                sender._send(
                    ctx, body, detail=detail, on_refused=on_refused, started=started,
                    attempts=attempts,
                )
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


class ReplyBeside:
    """Replies submitted on a thread of their own (``submit-<job id>``), beside the
    loop's next job, one at a time: the next waits for the one before.

    Args:
        pipeline: the loop's pipeline (its settings, state, clocks and pause).
        make_horde: makes the Horde client these submits go out on (one, made
            at the first).
    """

    def __init__(self, pipeline: SubmitPipeline, make_horde: Callable[[], HordeAPI]) -> None:
        self._sender = SubmitPipeline(
            pipeline.settings, make_horde(), pipeline.state, clock=pipeline.clock,
            wall=pipeline.wall, pause=pipeline.pause, retry_horde=make_horde,
        )
        self._thread: threading.Thread | None = None

    def send(self, ctx: JobContext, outcome: Outcome) -> None:
        """Submit the job's reply (:meth:`SubmitPipeline.reply`) on a thread of its
        own; an unexpected error there faults the job (never left to expire)."""
        if self._thread is not None:
            self._thread.join()
        sender = self._sender

        def run() -> None:
            try:
                sender.reply(
                    ctx, outcome.body, detail=outcome.detail, on_refused=outcome.on_refused
                )
            except Exception:
                log.exception("job=%s unexpected error while submitting it", ctx.id)
                sender.fault_after_error(ctx, JobFault("internal error"))

        self._thread = threading.Thread(target=run, name=f"submit-{ctx.id[:8]}", daemon=True)
        self._thread.start()


def reward_kudos(reward: object) -> float:
    """The submit answer's ``reward`` as kudos; 0.0 when it is not a finite number."""
    kudos = finite_number(reward)
    return 0.0 if kudos is None else kudos
