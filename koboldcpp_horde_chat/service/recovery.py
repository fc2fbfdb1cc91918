"""The start-up recovery: ends the jobs an earlier process left in the journal.

Before the first pop, :func:`recover` sends for each entry what its plan says
(``state.journal_rules.plan``): a kept reply again while its lease may run
(the Horde answers ``DuplicateGen`` when it had it: no cost); a fault for a
job without a terminal action while its lease surely runs, then its genkey
aborted on koboldcpp; nothing for a job whose fault went before or whose
lease may have ended (on the real Horde every fault re-opens the request, also
for a job that ended). Jobs popped from another Horde stay in the journal.
The answers are read by ``state.submit_answers``. A submit not answered is
sent again after 1 s, 2 s, 4 s... (at most 30 s, or the Horde's
``Retry-After``) until its lease ends; a fault only when it is known not to
have reached the Horde, so a job gets at most one.
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
from ..errors import BackendError, HordeRefusal, HordeUnavailable
from ..horde.api import HordeAPI
from ..inflight import STOP_SUBMIT_EXTRA_S, CallDeadlines, stop_call_ends
from ..koboldcpp.api import KcppAPI
from ..state.journal import Journal, JournalEntry, clock_mark
from ..state.journal_rules import FAULT_MARGIN_S, plan
from ..state.submit_answers import Answer, Reading, read_answer, refused_reply_fault
from ..translate.submits import job_fault_submit

log = logging.getLogger("koboldcpp_horde_chat.journal")

#: The first pause between two attempts at one recovered job's submit, seconds.
RECOVERY_PAUSE_FIRST_S: Final = 1.0
#: The longest pause between two of those attempts, seconds.
RECOVERY_PAUSE_MAX_S: Final = 30.0
#: While stopping, the last attempt of a pending job starts this many seconds
#: before the stop's deadline (none starts after it).
STOP_LAST_ATTEMPT_LEAD_S: Final = 0.25
#: How often a pause reads its clock again, seconds (so a test's clock ends it).
PAUSE_SLICE_S: Final = 0.1


@dataclass
class RecoveryResult:
    """How many jobs :func:`recover` ended each way: ``faulted`` (faults accepted),
    ``settled`` (``AbortedGen``, ``DuplicateGen`` or 404, or a fault sent before
    the restart), ``expired`` (the lease may have ended: nothing sent), ``failed``
    (left to expire), ``kept`` (left in the journal: a refused API key, a stop),
    ``replied`` (kept replies accepted, earning ``kudos``); ``key_refused``: the
    Horde refused the API key."""

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
        """Every job the journal held."""
        return (
            self.faulted + self.settled + self.expired + self.failed + self.kept + self.replied
        )


class RecoveryStop:
    """The worker's stop as the recovery reads it: ``event`` set at the stop, its
    deadline from ``deadlines`` (None: no deadline, the pending jobs are kept at
    once); pauses on ``clock`` that the stop ends early."""

    def __init__(
        self,
        clock: Clock = SYSTEM_CLOCK,
        event: threading.Event | None = None,
        deadlines: CallDeadlines | None = None,
    ) -> None:
        self.clock = clock
        self.event = event if event is not None else threading.Event()
        self.deadlines = deadlines

    def stopped(self) -> bool:
        return self.event.is_set()

    def stop_deadline(self) -> float | None:
        """The stop's deadline, epoch seconds."""
        return None if self.deadlines is None else self.deadlines.stop_at_wall()

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
    journal: Journal,
    *,
    horde: HordeAPI,
    backend: KcppAPI | None,
    clock: Clock = SYSTEM_CLOCK,
    model_id_default: str,
    submit_timeout_s: float = 10.0,
    abort_timeout_s: float = 2.0,
    stop: RecoveryStop | None = None,
) -> RecoveryResult:
    """End the jobs an earlier process left (see the module docstring); call at
    start, before the first pop. Nothing is raised for the Horde's or
    koboldcpp's answers.

    ``backend`` is None inside koboldcpp, whose restart ended every earlier
    generation; its aborts are best effort. ``clock``'s epoch seconds date the
    journal's marks, the leases and the pauses. A chat fault names the entry's
    ``model_id``, else ``model_id_default``. A refused API key (401, or 403 for
    the credentials) ends the recovery: that job and the ones left stay in the
    journal. A stop with a deadline gives each pending job its last attempt by
    then and none after; without one the pending jobs are kept at once. A job
    not answered by then stays in the journal as it is (a fault whose answer
    was lost as sent). Each job ends in one ``job=<id>`` line and leaves the
    journal at once; the faults the Horde counts go to its history.
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
    if counts.total:
        log.info(
            "jobs in hand at the last stop: %s%d faulted, %d already settled, %d expired, "
            "%d left to expire, %d kept in the journal",
            f"{counts.replied} replies submitted ({counts.kudos:.0f} kudos), "
            if counts.replied else "",
            counts.faulted, counts.settled, counts.expired, counts.failed, counts.kept,
        )
    return counts


@dataclass
class _Pass:
    """One pass over the journal: the counts, and the faulted generations to abort."""

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

    def _end(
        self, entry: JournalEntry, count: str, level: int, line: str, *args: object,
        aborted: bool = False, remove: bool = True,
    ) -> bool:
        """Count the job done with (``count``: a :class:`RecoveryResult` field), say
        so in its line, and clear it from the journal (``remove``). ``aborted``: the
        Horde counts an aborted job for it (kept in the journal's fault history)."""
        setattr(self.counts, count, getattr(self.counts, count) + 1)
        if aborted:
            self.journal.record_fault(self.clock.time())
        log.log(level, f"job=%s kind=%s {line}", entry.job_id, entry.kind, *args)
        if remove:
            self.journal.remove(entry.job_id)
        return True

    def plan(self) -> list[_Pending]:
        """The jobs to send something to; the others are ended now."""
        entries = self.journal.load()
        earlier, _ = self.journal.clocks()
        now = clock_mark(self.clock.time())
        pending: list[_Pending] = []
        for entry in _this_hordes(entries, self.journal.horde):
            step = plan(entry.to_json(), earlier, now)
            fault_ends_at = now.wall + step.least_left_s - FAULT_MARGIN_S
            if step.action == "reply" and entry.reply is not None:
                ends_at = now.wall + step.lease_left_s
                pending.append(_Pending(entry, "reply", dict(entry.reply), ends_at, fault_ends_at))
            elif step.action == "fault":
                body = self._fault_body(entry)
                pending.append(_Pending(entry, "fault", body, fault_ends_at, fault_ends_at))
            elif step.action == "fault_sent":  # the Horde may have counted it
                self._end(entry, "settled", logging.WARNING, "its fault was sent before the "
                          "restart; nothing more sent (a second fault would re-open the request "
                          "again)", aborted=True)
            else:
                self._end(entry, "expired", logging.WARNING, "expired on the Horde while the "
                          "worker was down (lease ended %.0f s ago, or may have): nothing sent",
                          max(0.0, -step.lease_left_s), aborted=True)
        return pending

    def _last_attempt_at(self) -> float | None:
        """While stopping: when the last attempts start (epoch seconds; ``-inf``
        for a stop without a deadline: none more). None while not stopping."""
        if not self.stop.stopped():
            return None
        at = self.stop.stop_deadline()
        return -math.inf if at is None else at

    def _over(self) -> bool:
        last = self._last_attempt_at()
        return self.counts.key_refused or (last is not None and self.clock.time() > last)

    def serve(self, pending: list[_Pending]) -> None:
        """Send the pending jobs' submits, each at its time, until each is done with."""
        while pending:
            if self._over():
                why = ("the Horde refused the API key" if self.counts.key_refused
                       else "the worker stopped first")
                for item in pending:
                    self._end(item.entry, "kept", logging.WARNING, "kept in the journal: %s",
                              why, remove=False)
                return
            now, last = self.clock.time(), self._last_attempt_at()
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
        """One attempt at a job's submit; True when the job is done with
        (answered, given up or kept), False to try again at ``item.next_at``."""
        entry, fault = item.entry, item.action == "fault"
        if self.clock.time() >= item.ends_at:
            return self._give_up(item, "the lease ended before the Horde answered")
        if fault:
            self.journal.mark_fault_sent(entry.job_id)  # before it goes: never a second one
        item.attempts += 1
        try:
            answer: dict[str, Any] | HordeRefusal | HordeUnavailable = self.horde.submit(
                item.body, timeout_s=self.timeout_s
            )
        except (HordeRefusal, HordeUnavailable) as exc:
            answer = exc
        reading = read_answer(answer, fault=fault)
        if reading.not_taken:
            self.journal.mark_not_taken(entry.job_id)  # it may be sent again
        if reading.aborted:  # it ended unanswered: an aborted job there
            self.journal.record_fault(self.clock.time())
        kind, why = reading.answer, reading.why
        if kind in (Answer.RETRY, Answer.LOST):
            return self._unanswered(item, reading)
        if kind is Answer.KEY_REFUSED:
            self.counts.key_refused = True
            if fault:
                self.journal.mark_not_taken(entry.job_id)  # it never reached the Horde
            return self._end(entry, "kept", logging.ERROR, "not ended after a restart: the "
                             "Horde refused the API key (%s); kept in the journal", why,
                             remove=False)
        if kind is Answer.REFUSED and not fault:
            # The Horde refused the reply itself (seed "Submit refusals"): fault it, once.
            log.warning("job=%s kept reply refused after a restart: %s", entry.job_id, why)
            reason = refused_reply_fault(reading.refusal).fault_reason
            item.action, item.body = "fault", self._fault_body(entry, reason)
            item.ends_at, item.attempts, item.next_at = item.fault_ends_at, 0, 0.0
            return False
        if kind is Answer.REFUSED:
            return self._end(entry, "failed", logging.ERROR,
                             "left to expire: the Horde refused the fault (%s)", why)
        if kind is not Answer.ACCEPTED:
            settled = reading.refusal.rc or reading.refusal.status
            return self._end(entry, "settled", logging.INFO,
                             "already settled on the Horde (%s): nothing more to send", settled)
        if fault:
            if entry.genkey:
                self.aborts.append((entry.job_id, entry.genkey))
            return self._end(entry, "faulted", logging.WARNING, "faulted after a restart: the "
                             "worker stopped with it in hand", aborted=True)
        self.counts.kudos += reading.kudos
        return self._end(entry, "replied", logging.WARNING, "reply kept at the last stop "
                         "submitted after a restart (%.0f kudos)", reading.kudos)

    def _unanswered(self, item: _Pending, reading: Reading) -> bool:
        """The schedule after a lost answer: kept at the stop's last attempt, given
        up past the lease (or when a fault may have been taken), else tried again."""
        lost, last = reading.answer is Answer.LOST, self._last_attempt_at()
        if last is not None and (lost or self.clock.time() >= last - STOP_LAST_ATTEMPT_LEAD_S):
            # The stop's last attempt: the job stays in the journal as it is.
            return self._end(
                item.entry, "kept", logging.WARNING, "kept in the journal: the worker stopped "
                "before the Horde answered its %s (%s)%s", item.action, reading.why,
                "; the fault may have been taken, so none will be sent again" if lost else "",
                remove=False,
            )
        if lost:  # it may have been counted: a second fault would re-open the request again
            why = f"the fault's answer was lost ({reading.why}); not sent twice"
            return self._give_up(item, why)
        delay = min(
            RECOVERY_PAUSE_MAX_S,
            max(RECOVERY_PAUSE_FIRST_S * 2 ** (item.attempts - 1), reading.retry_after_s),
        )
        next_at = self.clock.time() + delay
        if last is not None:  # stopping: the last attempt comes before the deadline
            next_at = min(next_at, last - STOP_LAST_ATTEMPT_LEAD_S)
        if next_at >= item.ends_at:
            why = f"the Horde did not answer within the lease ({reading.why})"
            return self._give_up(item, why)
        log.debug("job=%s %s not answered (%s); trying again in %.1f s",
                  item.entry.job_id, item.action, reading.why, next_at - self.clock.time())
        item.next_at = next_at
        return False

    def _give_up(self, item: _Pending, why: str) -> bool:
        # expired, or its fault taken: an aborted job on the Horde
        return self._end(item.entry, "failed", logging.ERROR, "left to expire: %s", why,
                         aborted=True)


def _this_hordes(entries: list[JournalEntry], horde: str | None) -> list[JournalEntry]:
    """The entries popped from ``horde`` (or that do not say); the others stay in
    the journal for a start against their Horde (this one would answer 404)."""
    if horde is None:
        return entries
    elsewhere = Counter(e.horde for e in entries if e.horde not in (None, horde))
    for other, count in elsewhere.items():
        log.warning(
            "job journal: %d job%s popped from %s left alone (this start serves %s); "
            "kept in the journal for a start against that Horde",
            count, "" if count == 1 else "s", other, horde,
        )
    return [e for e in entries if e.horde in (None, horde)]


class Recovery:
    """:func:`recover` on a thread of its own (``journal-recovery``), started at
    once: a host starts it before koboldcpp answers; the pop loops :meth:`wait`.

    The factories make the clients on that thread (closed after;
    ``backend_factory`` None: no aborts). ``stop_event``: the worker's stop;
    ``deadlines``: its deadlines (``inflight.CallDeadlines``, the clients' too;
    None: a stop keeps the pending jobs at once); ``clock``: theirs.
    """

    def __init__(
        self,
        journal: Journal,
        *,
        horde_factory: Callable[[], HordeAPI],
        backend_factory: Callable[[], KcppAPI] | None,
        model_id_default: str,
        stop_event: threading.Event,
        deadlines: CallDeadlines | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.journal = journal
        self.clock = clock
        self.deadlines = deadlines
        self.stop_event = stop_event
        self.result: RecoveryResult | None = None
        self._done = threading.Event()
        self._stop = RecoveryStop(clock, stop_event, deadlines)
        self._factories = (horde_factory, backend_factory)
        self._model_id_default = model_id_default
        self._thread = threading.Thread(target=self._run, name="journal-recovery", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        horde_factory, backend_factory = self._factories
        horde = backend = None
        try:
            horde = horde_factory()
            backend = backend_factory() if backend_factory is not None else None
            self.result = recover(
                self.journal, horde=horde, backend=backend, clock=self.clock,
                model_id_default=self._model_id_default, stop=self._stop,
            )
        except Exception:  # never let the recovery hold the worker's start
            log.exception("the recovery of the jobs in hand at the last stop failed")
        finally:
            for client in (horde, backend):
                close = getattr(client, "close", None)
                if callable(close):
                    close()
            self._done.set()

    @property
    def done(self) -> bool:
        """True once the recovery ended."""
        return self._done.is_set()

    def finish(self, grace_s: float) -> bool:
        """The host exits: end the recovery by the stop's deadline and wait for it
        (call it before the journal is released); True when it ended.

        When it still runs, the stop is made if it was not (``deadlines`` set
        ``grace_s`` from now, then ``stop_event``); the wait lasts at most until
        the submits' deadline (the stop's + ``STOP_SUBMIT_EXTRA_S``) and 0.5 s.
        """
        if self._done.is_set():
            return True
        if self.deadlines is not None:
            self.deadlines.set(stop_call_ends(self.clock.monotonic() + grace_s))  # kept if set
        self.stop_event.set()
        left = None if self.deadlines is None else self.deadlines.left("submit")
        timeout_s = (grace_s + STOP_SUBMIT_EXTRA_S if left is None else max(0.0, left)) + 0.5
        return self._done.wait(timeout_s)

    def wait(
        self, stop_event: threading.Event | None = None, timeout_s: float | None = None
    ) -> bool:
        """Wait until the recovery ended (True), ``stop_event`` is set or
        ``timeout_s`` passed on its clock."""
        end = None if timeout_s is None else self.clock.monotonic() + timeout_s
        while not self._done.wait(0.1):
            if stop_event is not None and stop_event.is_set():
                return self._done.is_set()
            if end is not None and self.clock.monotonic() >= end:
                return False
        return True
