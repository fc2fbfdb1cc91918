"""The start-up recovery: ends the jobs an earlier process left in the journal.

Before the first pop, :func:`recover` sends what each entry's plan says
(``state.journal_rules.plan``): a kept reply again, a fault (then the genkey
aborted on koboldcpp), or nothing; jobs popped from another Horde stay in the
journal. The answers are read by ``state.submit_answers``. A submit not
answered is sent again after 1 s, 2 s, 4 s... (at most 30 s, or the Horde's
``Retry-After``) until its lease ends; a fault only when it surely did not
reach the Horde.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import BackendError
from ..horde.api import HordeAPI
from ..inflight import STOP_SUBMIT_EXTRA_S, CallDeadlines, stop_call_ends
from ..koboldcpp.api import KcppAPI
from ..state.journal import Journal, JournalEntry, clock_mark, send_terminal
from ..state.journal_rules import FAULT_MARGIN_S, plan
from ..state.submit_answers import Answer, Reading, refused_reply_fault
from ..translate.submits import job_fault_submit

log = logging.getLogger("koboldcpp_horde_chat.journal")

#: The first pause between two attempts at one recovered job's submit, seconds.
RECOVERY_PAUSE_FIRST_S: Final = 1.0
#: The longest pause between two of those attempts, seconds.
RECOVERY_PAUSE_MAX_S: Final = 30.0
#: While stopping, the last attempts start this many seconds before the stop's deadline.
STOP_LAST_ATTEMPT_LEAD_S: Final = 0.25
#: How often a pause reads its clock again, seconds (so a test's clock ends it).
PAUSE_SLICE_S: Final = 0.1


@dataclass
class RecoveryResult:
    """How many jobs :func:`recover` ended each way: ``settled`` (already ended on
    the Horde, or its fault sent before), ``expired`` (nothing sent), ``failed``
    (left to expire), ``kept`` (left in the journal), ``replied`` (earning
    ``kudos``)."""

    faulted: int = 0
    settled: int = 0
    expired: int = 0
    failed: int = 0
    kept: int = 0
    key_refused: bool = False
    replied: int = 0
    kudos: float = 0.0

    @property
    def total(self) -> int:
        return self.faulted + self.settled + self.expired + self.failed + self.kept + self.replied


@dataclass
class RecoveryStop:
    """The worker's stop as the recovery reads it: ``event``, its deadline from
    ``deadlines`` (None: none), pauses on ``clock`` that the stop ends early."""

    clock: Clock = SYSTEM_CLOCK
    event: threading.Event = field(default_factory=threading.Event)
    deadlines: CallDeadlines | None = None

    def last_attempt_at(self) -> float | None:
        """While stopping, the stop's deadline (``-inf`` without one); else None."""
        if not self.event.is_set():
            return None
        at = None if self.deadlines is None else self.deadlines.stop_at_wall()
        return -math.inf if at is None else at

    def pause(self, seconds: float) -> None:
        # Stopping, the pause already ends by the deadline; else the stop ends it.
        interrupt = threading.Event() if self.event.is_set() else self.event
        end = self.clock.monotonic() + seconds
        while (left := end - self.clock.monotonic()) > 0:
            if interrupt.wait(min(left, PAUSE_SLICE_S)):
                return


@dataclass
class _Pending:
    """One recovered job still to be answered; its times are epoch seconds."""

    entry: JournalEntry
    action: str  # "reply" or "fault"
    body: dict[str, Any]
    ends_at: float  # after which nothing is sent
    fault_ends_at: float  # after which no fault is sent (the lease surely runs until then)
    attempts: int = 0
    next_at: float = 0.0


def recover(
    journal: Journal, *, horde: HordeAPI, backend: KcppAPI | None, clock: Clock = SYSTEM_CLOCK,
    model_id_default: str, submit_timeout_s: float = 10.0, abort_timeout_s: float = 2.0,
    stop: RecoveryStop | None = None,
) -> RecoveryResult:
    """End the jobs an earlier process left; call at start, before the first pop.

    ``backend``: None inside koboldcpp (its restart ended every generation);
    aborts are best effort. ``clock``'s epoch seconds date the marks, leases
    and pauses. A refused API key ends the recovery: the jobs left stay in the
    journal. A stop gives each pending job its last attempt by its deadline
    (none without one), then keeps it as it is. Each job ends in one
    ``job=<id>`` line; nothing is raised for the answers.
    """
    run = _Pass(journal, horde, clock, model_id_default, submit_timeout_s,
                stop if stop is not None else RecoveryStop(clock))
    run.serve(run.plan())
    for job_id, genkey in run.aborts:  # after the Horde's answers: koboldcpp may be loading
        try:
            if backend is not None:
                backend.abort(genkey, timeout_s=abort_timeout_s)
        except BackendError as exc:
            log.debug("job=%s abort of %s failed: %s", job_id, genkey, exc)
    counts = run.counts
    replies = f"{counts.replied} replies submitted ({counts.kudos:.0f} kudos), "
    if counts.total:
        log.info("jobs in hand at the last stop: %s%d faulted, %d already settled, %d expired, "
                 "%d left to expire, %d kept in the journal", replies if counts.replied else "",
                 counts.faulted, counts.settled, counts.expired, counts.failed, counts.kept)
    return counts


@dataclass
class _Pass:
    journal: Journal
    horde: HordeAPI
    clock: Clock
    model_id_default: str
    timeout_s: float
    stop: RecoveryStop
    counts: RecoveryResult = field(default_factory=RecoveryResult)
    aborts: list[tuple[str, str]] = field(default_factory=list)  # (job id, genkey)

    def _fault_body(self, entry: JournalEntry, fault_reason: str | None = None) -> dict[str, Any]:
        model_id = entry.model_id or self.model_id_default
        return job_fault_submit(entry.job_id, entry.kind, model_id, fault_reason)

    def _end(self, entry: JournalEntry, count: str, level: int, line: str, *args: object,
             aborted: bool = False) -> bool:
        """Count the job in ``count`` (a :class:`RecoveryResult` field), log ``line``
        (its id and kind first), clear it from the journal unless ``kept`` there;
        ``aborted``: an aborted job."""
        setattr(self.counts, count, getattr(self.counts, count) + 1)
        if aborted:
            self.journal.record_fault(self.clock.time())
        log.log(level, line, entry.job_id, entry.kind, *args)
        if count != "kept":
            self.journal.remove(entry.job_id)
        return True

    def plan(self) -> list[_Pending]:
        entries = self.journal.load()
        now, pending = clock_mark(self.clock.time()), []
        for entry in _this_hordes(entries, self.journal.horde):
            step = plan(entry.to_json(), self.journal.earlier_clock, now)
            fault_ends_at = now.wall + step.least_left_s - FAULT_MARGIN_S
            if step.action == "reply" and entry.reply is not None:
                ends_at = now.wall + step.lease_left_s
                pending.append(_Pending(entry, "reply", dict(entry.reply), ends_at, fault_ends_at))
            elif step.action == "fault":
                body = self._fault_body(entry)
                pending.append(_Pending(entry, "fault", body, fault_ends_at, fault_ends_at))
            elif step.action == "fault_sent":  # the Horde may have counted it
                self._end(entry, "settled", logging.WARNING, "job=%s kind=%s: its fault was sent "
                          "before the restart; nothing more sent (a second fault would re-open "
                          "the request again)", aborted=True)
            else:
                self._end(entry, "expired", logging.WARNING, "job=%s kind=%s expired on the Horde "
                          "while the worker was down (lease ended %.0f s ago, or may have): "
                          "nothing sent", max(0.0, -step.lease_left_s), aborted=True)
        return pending

    def _over(self) -> bool:
        last = self.stop.last_attempt_at()
        return self.counts.key_refused or (last is not None and self.clock.time() > last)

    def serve(self, pending: list[_Pending]) -> None:
        while pending:
            if self._over():
                why = ("the Horde refused the API key" if self.counts.key_refused
                       else "the worker stopped first")
                for item in pending:
                    self._end(item.entry, "kept", logging.WARNING,
                              "job=%s kind=%s kept in the journal: %s", why)
                return
            now, last = self.clock.time(), self.stop.last_attempt_at()
            if last is not None:  # a stop: no pause runs past its deadline
                for item in pending:
                    item.next_at = min(item.next_at, last - STOP_LAST_ATTEMPT_LEAD_S)
            due = [item for item in pending if item.next_at <= now]
            if not due:
                self.stop.pause(max(0.0, min(item.next_at for item in pending) - now))
                continue
            for item in due:
                if self._over():
                    break
                if self._attempt(item):
                    pending.remove(item)

    def _attempt(self, item: _Pending) -> bool:
        """One attempt; True when the job is done with, False to try again at ``next_at``."""
        entry, fault = item.entry, item.action == "fault"
        if self.clock.time() >= item.ends_at:
            return self._give_up(item, "the lease ended before the Horde answered")
        item.attempts += 1
        reading = send_terminal(self.horde, self.journal, entry.job_id, item.body, fault=fault,
                                timeout_s=self.timeout_s)
        if reading.aborted:  # it ended unanswered: an aborted job there
            self.journal.record_fault(self.clock.time())
        kind, why = reading.answer, reading.why
        if kind in (Answer.RETRY, Answer.LOST):
            return self._unanswered(item, reading)
        if kind is Answer.KEY_REFUSED:
            self.counts.key_refused = True
            if fault:
                self.journal.mark_not_taken(entry.job_id)  # it never reached the Horde
            return self._end(entry, "kept", logging.ERROR, "job=%s kind=%s not ended after a "
                             "restart: the Horde refused the API key (%s); kept in the "
                             "journal", why)
        if kind is Answer.REFUSED and not fault:
            # The Horde refused the reply itself (seed "Submit refusals"): fault it, once.
            log.warning("job=%s kept reply refused after a restart: %s", entry.job_id, why)
            reason = refused_reply_fault(reading.refusal).fault_reason
            item.action, item.body = "fault", self._fault_body(entry, reason)
            item.ends_at, item.attempts, item.next_at = item.fault_ends_at, 0, 0.0
            return False
        if kind is Answer.REFUSED:
            return self._end(entry, "failed", logging.ERROR,
                             "job=%s kind=%s left to expire: the Horde refused the fault (%s)", why)
        if kind is not Answer.ACCEPTED:
            settled = reading.refusal.rc or reading.refusal.status
            return self._end(entry, "settled", logging.INFO, "job=%s kind=%s already settled on "
                             "the Horde (%s): nothing more to send", settled)
        if fault:
            if entry.genkey:
                self.aborts.append((entry.job_id, entry.genkey))
            return self._end(entry, "faulted", logging.WARNING, "job=%s kind=%s faulted after a "
                             "restart: the worker stopped with it in hand", aborted=True)
        self.counts.kudos += reading.kudos
        return self._end(entry, "replied", logging.WARNING, "job=%s kind=%s reply kept at the "
                         "last stop submitted after a restart (%.0f kudos)", reading.kudos)

    def _unanswered(self, item: _Pending, reading: Reading) -> bool:
        """After a lost answer: kept at the stop's last attempt, given up past the
        lease or when a fault may have been taken, else tried again."""
        lost, last = reading.answer is Answer.LOST, self.stop.last_attempt_at()
        if last is not None and (lost or self.clock.time() >= last - STOP_LAST_ATTEMPT_LEAD_S):
            # The stop's last attempt: the job stays in the journal as it is.
            taken = "; the fault may have been taken, so none will be sent again" if lost else ""
            return self._end(item.entry, "kept", logging.WARNING, "job=%s kind=%s kept in the "
                             "journal: the worker stopped before the Horde answered its %s (%s)%s",
                             item.action, reading.why, taken)
        if lost:  # it may have been counted: a second fault would re-open the request again
            why = f"the fault's answer was lost ({reading.why}); not sent twice"
            return self._give_up(item, why)
        backoff = RECOVERY_PAUSE_FIRST_S * 2 ** (item.attempts - 1)
        next_at = self.clock.time() + min(RECOVERY_PAUSE_MAX_S, max(backoff, reading.retry_after_s))
        if last is not None:  # stopping: the last attempt comes before the deadline
            next_at = min(next_at, last - STOP_LAST_ATTEMPT_LEAD_S)
        if next_at >= item.ends_at:
            return self._give_up(item, f"the Horde did not answer within the lease ({reading.why})")
        log.debug("job=%s %s not answered (%s); trying again in %.1f s",
                  item.entry.job_id, item.action, reading.why, next_at - self.clock.time())
        item.next_at = next_at
        return False

    def _give_up(self, item: _Pending, why: str) -> bool:  # expired, or its fault taken
        return self._end(item.entry, "failed", logging.ERROR, "job=%s kind=%s left to expire: %s",
                         why, aborted=True)


def _this_hordes(entries: list[JournalEntry], horde: str | None) -> list[JournalEntry]:
    """The entries popped from ``horde`` (or that do not say); this Horde would
    answer the others 404."""
    mine = [e for e in entries if horde is None or e.horde in (None, horde)]
    for other, count in Counter(e.horde for e in entries if e not in mine).items():
        log.warning("job journal: %d job%s popped from %s left alone (this start serves %s); "
                    "kept in the journal for a start against that Horde",
                    count, "" if count == 1 else "s", other, horde)
    return mine


class Recovery:
    """:func:`recover` on a thread of its own, started at once (before koboldcpp
    answers); the pop loops :meth:`wait` for it. The factories make its clients
    there (closed after); ``deadlines``: the stop's (None: a stop keeps the
    pending jobs at once), on ``clock``."""

    def __init__(
        self, journal: Journal, *, horde_factory: Callable[[], HordeAPI],
        backend_factory: Callable[[], KcppAPI] | None, model_id_default: str,
        stop_event: threading.Event, deadlines: CallDeadlines | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.journal = journal
        self.stop_event = stop_event
        self.result: RecoveryResult | None = None
        self._done = threading.Event()
        self._stop = RecoveryStop(clock, stop_event, deadlines)
        self._factories = (horde_factory, backend_factory)
        threading.Thread(target=self._run, args=(model_id_default,), name="journal-recovery",
                         daemon=True).start()

    def _run(self, model_id_default: str) -> None:
        horde_factory, backend_factory = self._factories
        horde = backend = None
        try:
            horde = horde_factory()
            backend = backend_factory() if backend_factory is not None else None
            self.result = recover(
                self.journal, horde=horde, backend=backend, clock=self._stop.clock,
                model_id_default=model_id_default, stop=self._stop,
            )
        except Exception:  # never let the recovery hold the worker's start
            log.exception("the recovery of the jobs in hand at the last stop failed")
        finally:
            for client in (horde, backend):
                close = getattr(client, "close", None)
                if callable(close):
                    close()
            self._done.set()

    def finish(self, grace_s: float) -> bool:
        """The host exits (before the journal is released): stop the recovery,
        its deadline ``grace_s`` from now unless set, and wait for it until the
        submits' deadline and 0.5 s more; True when it ended."""
        if self._done.is_set():
            return True
        clock, deadlines = self._stop.clock, self._stop.deadlines
        if deadlines is not None:
            deadlines.set(stop_call_ends(clock.monotonic() + grace_s))  # kept if set
        self.stop_event.set()
        left = None if deadlines is None else deadlines.left("submit")
        timeout_s = (grace_s + STOP_SUBMIT_EXTRA_S if left is None else max(0.0, left)) + 0.5
        return self._done.wait(timeout_s)

    def wait(self, stop_event: threading.Event | None = None,
             timeout_s: float | None = None) -> bool:
        """Wait until it ended (True), ``stop_event`` is set or ``timeout_s`` passed."""
        clock = self._stop.clock
        end = None if timeout_s is None else clock.monotonic() + timeout_s
        while not self._done.wait(0.1):
            if stop_event is not None and stop_event.is_set():
                return self._done.is_set()
            if end is not None and clock.monotonic() >= end:
                return False
        return True
