"""Crash recovery: the start-up pass over the jobs an earlier process left in hand.

As soon as the Horde answers, before the first pop and without waiting for
koboldcpp, :func:`recover` ends every job the journal (``state.journal``)
holds, by its terminal-action state and its lease
(``journal_rules.plan``):

- a kept reply is sent again, the same bytes as the submit would have sent,
  while the lease may run: the Horde stores it, or answers ``DuplicateGen``
  when it had stored it already (seed "Check the completed reply": no cost);
- a job without a terminal action is faulted while its lease surely runs
  (seed "7. Fault a job": the request gets the job back for another worker
  at once), and its local generation is aborted on koboldcpp by genkey when
  a koboldcpp client is given (seed "Worked example: koboldcpp's embedded
  worker");
- a job whose fault went before, or whose lease may have ended, is sent
  nothing: on the real Horde every faulted submit re-opens the request
  (``wp.n += 1``), also for a job that already ended.
- a job popped from another Horde than this start's (``JournalEntry.horde``)
  is left alone and kept in the journal for a start against its Horde: this
  one would answer it 404, and it would expire on its own.

A submit the Horde does not answer is tried again with a growing pause (1 s,
2 s, 4 s... at most 30 s, or the Horde's ``Retry-After``) until it answers or
the lease ends; a fault only when it is known not to have been taken
(``journal_rules.known_not_taken``), so a job gets at most one.
:class:`Recovery` runs :func:`recover` on a thread of its own, so a host can
start it before koboldcpp answers and have its loops wait for it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, Protocol

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import BackendError, HordeRefusal, HordeUnavailable
from ..horde.codes import SETTLED_RCS, is_key_refusal
from ..inflight import STOP_SUBMIT_EXTRA_S, CallDeadlines, stop_call_ends
from ..run.submit import refused_reply_fault, reward_kudos
from ..state import journal as _journal
from ..state.journal import Journal, JournalEntry
from ..state.journal_rules import FAULT_MARGIN_S, known_not_taken, plan
from ..translate.submits import job_fault_submit

log = logging.getLogger("koboldcpp_horde_chat.journal")

#: The first pause between two attempts at one recovered job's submit, seconds.
RECOVERY_PAUSE_FIRST_S: Final = 1.0
#: The longest pause between two of those attempts, seconds.
RECOVERY_PAUSE_MAX_S: Final = 30.0
#: While stopping, the last attempt of a job still pending starts this many
#: seconds before the stop's deadline (none starts after the deadline).
STOP_LAST_ATTEMPT_LEAD_S: Final = 0.25
#: How often a pause reads its clock again, seconds (a clock a test moves ends
#: it then; on the real clock a pause lasts its seconds either way).
PAUSE_SLICE_S: Final = 0.1


class HordeSubmitter(Protocol):
    """What :func:`recover` needs of ``horde.client.HordeClient``."""

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """POST the submit; raises ``HordeRefusal`` or ``HordeUnavailable``."""
        ...


class BackendAborter(Protocol):
    """What :func:`recover` needs of ``koboldcpp.client.KoboldClient``."""

    def abort(self, genkey: str, *, timeout_s: float) -> bool:
        """POST ``/api/extra/abort``; raises ``BackendError``."""
        ...


@dataclass
class RecoveryResult:
    """What :func:`recover` did with the jobs an earlier process left.

    Attributes:
        faulted: faults the Horde accepted (the requests went back to the queue).
        settled: jobs the Horde had already ended (``AbortedGen``,
            ``DuplicateGen`` or 404), or whose fault went before the restart.
        expired: jobs whose lease may have ended: nothing sent.
        failed: jobs left to expire: the Horde did not answer within the
            lease, or refused the submit for another reason.
        kept: jobs left in the journal for the next start (the Horde refused
            the API key, or the worker was stopped during the recovery).
        key_refused: the Horde refused the API key (401, or 403 for the
            credentials); the recovery stopped there.
        replied: kept replies the Horde accepted now.
        kudos: what those replies earned.
    """

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


def _fault_body(
    entry: JournalEntry, model_id_default: str, fault_reason: str | None = None
) -> dict[str, Any]:
    return job_fault_submit(
        entry.job_id, entry.kind, entry.model_id or model_id_default, fault_reason
    )


@dataclass
class _Pending:
    """One recovered job still to be answered."""

    entry: JournalEntry
    action: str  # "reply" or "fault"
    body: dict[str, Any]
    ends_at: float  # wall seconds (this run's clock) after which nothing is sent
    fault_ends_at: float  # after which no fault is sent (the lease surely runs until then)
    attempts: int = 0
    next_at: float = 0.0
    retry_after_s: float = 0.0


def recover(
    journal: Journal,
    *,
    horde: HordeSubmitter,
    backend: BackendAborter | None,
    clock: Clock = SYSTEM_CLOCK,
    model_id_default: str,
    submit_timeout_s: float = 10.0,
    abort_timeout_s: float = 2.0,
    pause: Callable[[float], None] | None = None,
    stopped: Callable[[], bool] = lambda: False,
    stop_deadline: Callable[[], float | None] = lambda: None,
) -> RecoveryResult:
    """End the jobs an earlier process left in hand; call at start, before the first pop.

    For each entry of ``Journal.load()`` (``journal_rules.plan`` on the clock
    marks of the earlier run and of now):

    - ``reply``: the kept submit body is sent as it is. Accepted: replied
      (its kudos counted); ``DuplicateGen``: the Horde had stored it;
      ``AbortedGen`` or 404: the job ended (counted as an aborted job);
      another refusal (``ChatSubmitInvalid``...): the job is faulted, once,
      while its lease surely runs.
    - ``fault``: marked ``fault_sent`` in the journal, then the fault is sent
      (seed "7. Fault a job": a chat job with ``{"id", "state": "faulted",
      "model_id"}``, the entry's ``model_id`` else ``model_id_default``; a
      text job with ``{"id", "generation": "", "state": "faulted"}``);
      ``AbortedGen``, ``DuplicateGen`` or 404: already settled. Its genkey
      is aborted on koboldcpp afterwards (``backend``; best effort, failures
      logged at debug; nothing when ``backend`` is None).
    - ``expired`` and ``fault_sent``: nothing is sent.

    ``HordeUnavailable``: a reply is sent again after a pause while its lease
    may run; a fault only when the failure shows it was not taken
    (``journal_rules.known_not_taken``) and while its lease surely runs. The
    pauses grow 1 s, 2 s, 4 s... up to :data:`RECOVERY_PAUSE_MAX_S` (the
    ``Retry-After`` when longer, within that bound); while one job waits the
    others are tried. A refused API key (401, or 403 for the credentials)
    stops the recovery: that job and the ones after it stay in the journal.

    A stop (``stopped()`` True) with a deadline (``stop_deadline()``, epoch
    seconds) cuts every pause to that deadline: each job still pending gets
    its last attempt by then (a kept reply, which costs nothing when the job
    ended; a fault, which gives the request back to the queue now), and no
    attempt starts after it. A job the Horde has not answered by then stays
    in the journal as it is (a fault whose answer was lost as sent, so the
    next start sends nothing more), for the next start. A stop without a
    deadline keeps every pending job in the journal at once.

    Every job ends in one log line with ``job=<id>``; every job ended is
    removed from the journal at once. Faults the Horde counts toward
    maintenance (a fault sent, a lease ended) are kept in the journal
    (``Journal.record_fault``). Nothing raised for the Horde's or koboldcpp's
    answers.

    Args:
        journal: the worker's journal.
        horde: the Horde client (``submit(body, *, timeout_s) -> dict``,
            raising ``HordeRefusal`` / ``HordeUnavailable``).
        backend: the koboldcpp client (``abort(genkey, *, timeout_s) -> bool``,
            raising ``BackendError``), never given the API key; None inside
            koboldcpp, whose restart ended every earlier generation.
        clock: the clock (``clock.Clock``): its epoch seconds date the
            journal's marks, the leases and the pauses' ends.
        model_id_default: the worker's ``model_id`` for a chat entry without one.
        submit_timeout_s, abort_timeout_s: read timeouts, seconds.
        pause: waits between attempts, seconds (None: a wait on ``clock``).
        stopped: True once the worker is asked to stop.
        stop_deadline: the stop's deadline, epoch seconds (None: none; the
            pending jobs are then kept at once).

    Returns:
        The counts (:class:`RecoveryResult`).
    """
    wall = clock.time
    wait: Callable[[float], object] = pause if pause is not None else partial(wait_on, clock)
    entries = journal.load()
    earlier, _ = journal.clocks()
    now_mark = _journal.clock_mark(wall())
    counts = RecoveryResult()  # counted as the jobs are answered
    aborts: list[tuple[str, str]] = []  # (job id, genkey) of each faulted generation
    pending: list[_Pending] = []
    entries = _this_hordes(entries, journal.horde)
    for entry in entries:
        step = plan(entry.to_json(), earlier, now_mark)
        fault_step = plan(entry.to_json() | {"terminal": "none"}, earlier, now_mark)
        fault_ends_at = now_mark.wall + fault_step.lease_left_s - FAULT_MARGIN_S
        if step.action == "fault_sent":
            counts.settled += 1
            journal.record_fault(now_mark.wall)  # the Horde may have counted it
            log.warning(
                "job=%s kind=%s: its fault was sent before the restart; nothing more sent "
                "(a second fault would re-open the request again)", entry.job_id, entry.kind,
            )
            journal.remove(entry.job_id)
        elif step.action == "expired":
            counts.expired += 1
            log.warning(
                "job=%s kind=%s expired on the Horde while the worker was down "
                "(lease ended %.0f s ago, or may have): nothing sent",
                entry.job_id, entry.kind, max(0.0, -step.lease_left_s),
            )
            journal.record_fault(now_mark.wall)  # an aborted job on the Horde
            journal.remove(entry.job_id)
        elif step.action == "reply":
            assert entry.reply is not None
            pending.append(_Pending(entry, "reply", dict(entry.reply),
                                    now_mark.wall + step.lease_left_s, fault_ends_at))
        else:
            pending.append(_Pending(entry, "fault", _fault_body(entry, model_id_default),
                                    fault_ends_at, fault_ends_at))
    while pending:
        last = _last_attempt_at(stopped, stop_deadline)
        if counts.key_refused or (last is not None and wall() > last):
            for item in pending:
                counts.kept += 1
                why = ("the Horde refused the API key" if counts.key_refused
                       else "the worker stopped first")
                log.warning("job=%s kind=%s kept in the journal: %s",
                            item.entry.job_id, item.entry.kind, why)
            break
        now = wall()
        if last is not None:  # a stop: no pause runs past its deadline
            for item in pending:
                item.next_at = min(item.next_at, last - STOP_LAST_ATTEMPT_LEAD_S)
        due = [item for item in pending if item.next_at <= now]
        if not due:
            wait(max(0.0, min(item.next_at for item in pending) - now))
            continue
        for item in due:
            last = _last_attempt_at(stopped, stop_deadline)
            if counts.key_refused or (last is not None and wall() > last):
                break
            if _attempt(item, journal, horde, wall, model_id_default, submit_timeout_s, counts,
                        aborts, lambda: _last_attempt_at(stopped, stop_deadline)):
                pending.remove(item)
    _abort_generations(aborts, backend, abort_timeout_s)
    result = counts
    if result.total:
        log.info(
            "jobs in hand at the last stop: %s%d faulted, %d already settled, %d expired, "
            "%d left to expire, %d kept in the journal",
            f"{counts.replied} replies submitted ({counts.kudos:.0f} kudos), "
            if counts.replied else "",
            counts.faulted, counts.settled, counts.expired, counts.failed, counts.kept,
        )
    return result


def _this_hordes(entries: list[JournalEntry], horde: str | None) -> list[JournalEntry]:
    """The entries popped from ``horde`` (an entry that does not say, from a
    version 1 file, is taken as this Horde's). The others are left alone, in
    the journal for a start against their Horde: sent to this one, a job would
    be answered 404 there and expire on its own Horde. One line per other Horde."""
    if horde is None:
        return entries
    elsewhere: dict[str, int] = {}
    mine = []
    for entry in entries:
        if entry.horde is None or entry.horde == horde:
            mine.append(entry)
        else:
            elsewhere[entry.horde] = elsewhere.get(entry.horde, 0) + 1
    for other, count in elsewhere.items():
        log.warning(
            "job journal: %d job%s popped from %s left alone (this start serves %s); "
            "kept in the journal for a start against that Horde",
            count, "" if count == 1 else "s", other, horde,
        )
    return mine


def _last_attempt_at(
    stopped: Callable[[], bool], stop_deadline: Callable[[], float | None]
) -> float | None:
    """While stopping: when the last attempts start (epoch seconds; ``-inf`` for a
    stop without a deadline: none more). None while not stopping."""
    if not stopped():
        return None
    at = stop_deadline()
    return -math.inf if at is None else at


def _attempt(
    item: _Pending,
    journal: Journal,
    horde: HordeSubmitter,
    wall: Callable[[], float],
    model_id_default: str,
    timeout_s: float,
    counts: RecoveryResult,
    aborts: list[tuple[str, str]],
    last_attempt_at: Callable[[], float | None],
) -> bool:
    """One attempt at a recovered job's submit; True when the job is done with
    (answered, given up or kept), False to try again at ``item.next_at``.
    ``last_attempt_at()``: while the worker stops, the stop's deadline (epoch
    seconds; :func:`_last_attempt_at`), else None. Stopping, the next attempt
    comes by :data:`STOP_LAST_ATTEMPT_LEAD_S` before that deadline; a job the
    Horde did not answer at its last attempt, or a fault whose answer was
    lost, stays in the journal as it is (the next start's)."""
    entry = item.entry
    if wall() >= item.ends_at:
        return _give_up(item, journal, wall, counts, "the lease ended before the Horde answered")
    if item.action == "fault":
        journal.mark_fault_sent(entry.job_id)  # before it goes: never a second one
    item.attempts += 1
    try:
        answer = horde.submit(item.body, timeout_s=timeout_s)
    except HordeRefusal as exc:
        if is_key_refusal(exc):
            counts.key_refused = True
            counts.kept += 1
            if item.action == "fault":
                journal.mark_not_taken(entry.job_id)
            log.error(
                "job=%s kind=%s not ended after a restart: the Horde refused the "
                "API key (%s); kept in the journal", entry.job_id, entry.kind, exc.reason,
            )
            return True
        if exc.rc in SETTLED_RCS or exc.status == 404:
            counts.settled += 1
            if item.action == "reply" and exc.rc == "AbortedGen":
                journal.record_fault(wall())  # it ended unanswered: an aborted job there
            log.info("job=%s kind=%s already settled on the Horde (%s): nothing more to send",
                     entry.job_id, entry.kind, exc.rc or exc.status)
            journal.remove(entry.job_id)
            return True
        if item.action == "reply":
            # The Horde refused the reply itself (seed "Submit refusals"): fault it, once.
            log.warning("job=%s kept reply refused after a restart: %s", entry.job_id, exc.reason)
            item.action = "fault"
            item.body = _fault_body(
                entry, model_id_default, refused_reply_fault(exc).fault_reason
            )
            item.ends_at = item.fault_ends_at
            item.attempts, item.next_at = 0, 0.0
            return False
        counts.failed += 1
        log.error("job=%s kind=%s left to expire: the Horde refused the fault (%s)",
                  entry.job_id, entry.kind, exc.reason)
        journal.remove(entry.job_id)
        return True
    except HordeUnavailable as exc:
        not_taken = known_not_taken(exc.status, exc.sent)
        last = last_attempt_at()
        lost_at_stop = item.action == "fault" and not not_taken and last is not None
        if lost_at_stop or (last is not None and wall() >= last - STOP_LAST_ATTEMPT_LEAD_S):
            # The stop's last attempt: the job stays in the journal as it is (a
            # fault that may have been taken as sent: none goes again).
            if item.action == "fault" and not_taken:
                journal.mark_not_taken(entry.job_id)  # the next start may send it
            counts.kept += 1
            log.warning(
                "job=%s kind=%s kept in the journal: the worker stopped before the Horde "
                "answered its %s (%s)%s", entry.job_id, entry.kind, item.action, exc.reason,
                "" if item.action == "reply" or not_taken
                else "; the fault may have been taken, so none will be sent again",
            )
            return True
        if item.action == "fault" and not not_taken:
            # It may have been counted: a second fault would re-open the request again.
            return _give_up(item, journal, wall, counts,
                            f"the fault's answer was lost ({exc.reason}); not sent twice")
        if item.action == "fault":
            journal.mark_not_taken(entry.job_id)  # not taken: it may go again
        delay = min(
            RECOVERY_PAUSE_MAX_S,
            max(RECOVERY_PAUSE_FIRST_S * 2 ** (item.attempts - 1), exc.retry_after_s or 0.0),
        )
        next_at = wall() + delay
        if last is not None:  # stopping: the last attempt comes before the deadline
            next_at = min(next_at, last - STOP_LAST_ATTEMPT_LEAD_S)
        if next_at >= item.ends_at:
            return _give_up(item, journal, wall, counts,
                            f"the Horde did not answer within the lease ({exc.reason})")
        log.debug("job=%s %s not answered (%s); trying again in %.1f s",
                  entry.job_id, item.action, exc.reason, next_at - wall())
        item.next_at = next_at
        return False
    if item.action == "reply":
        counts.replied += 1
        kudos = reward_kudos(answer.get("reward"))
        counts.kudos += kudos
        log.warning("job=%s kind=%s reply kept at the last stop submitted after a restart "
                    "(%.0f kudos)", entry.job_id, entry.kind, kudos)
    else:
        counts.faulted += 1
        journal.record_fault(wall())  # the Horde counts it as an aborted job
        log.warning("job=%s kind=%s faulted after a restart: the worker stopped with it in hand",
                    entry.job_id, entry.kind)
        if entry.genkey:
            aborts.append((entry.job_id, entry.genkey))
    journal.remove(entry.job_id)
    return True


def _give_up(
    item: _Pending, journal: Journal, wall: Callable[[], float], counts: RecoveryResult, why: str
) -> bool:
    counts.failed += 1
    journal.record_fault(wall())  # expired, or its fault taken: an aborted job on the Horde
    log.error("job=%s kind=%s left to expire: %s", item.entry.job_id, item.entry.kind, why)
    journal.remove(item.entry.job_id)
    return True


def _abort_generations(
    aborts: list[tuple[str, str]], backend: BackendAborter | None, timeout_s: float
) -> None:
    """Abort the faulted jobs' generations on koboldcpp, best effort, after the
    Horde's answers (a koboldcpp that is down or loading costs nothing there)."""
    if backend is None:
        return
    for job_id, genkey in aborts:
        try:
            backend.abort(genkey, timeout_s=timeout_s)
        except BackendError as exc:
            log.debug("job=%s abort of %s failed: %s", job_id, genkey, exc)


def wait_on(clock: Clock, seconds: float, interrupt: threading.Event | None = None) -> bool:
    """Wait ``seconds`` on ``clock`` (its monotonic seconds), or until ``interrupt``
    is set (at once when it is); True when ``interrupt`` ended the wait.

    The clock is read again every :data:`PAUSE_SLICE_S`, so a clock that a test
    moves ends the wait as the real one does.
    """
    end = clock.monotonic() + seconds
    event = interrupt if interrupt is not None else threading.Event()
    while (left := end - clock.monotonic()) > 0:
        if event.wait(min(left, PAUSE_SLICE_S)):
            return True
    return False


class Recovery:
    """:func:`recover` on a thread of its own, started at once.

    A host starts it as soon as it knows the Horde, the API key and the
    journal (before koboldcpp answers); the pop loops call :meth:`wait`
    before their first pop.

    Args:
        journal: the worker's journal (held by this process).
        horde_factory: makes the Horde client the thread uses (closed after).
        backend_factory: makes the koboldcpp client for the aborts, or None.
        model_id_default: see :func:`recover`.
        stop_event: set when the worker stops: the recovery's pauses end and
            the jobs still pending stay in the journal (after their last
            attempts by the stop's deadline, when ``deadlines`` has one).
        deadlines: the stop's deadlines (``inflight.CallDeadlines``), shared
            with the clients the factories make: the last attempts start by
            its ``"stop"`` deadline and its calls are cut to theirs. None:
            a stop keeps the pending jobs at once.
        clock: the clock of its pauses, its waits and the stop's deadline that
            :meth:`finish` sets (``clock.Clock``; the one ``deadlines`` runs on).
    """

    def __init__(
        self,
        journal: Journal,
        *,
        horde_factory: Callable[[], Any],
        backend_factory: Callable[[], Any] | None,
        model_id_default: str,
        stop_event: threading.Event,
        deadlines: CallDeadlines | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.journal = journal
        self.clock = clock
        self.deadlines = deadlines
        self.result: RecoveryResult | None = None
        self._done = threading.Event()
        self._horde_factory = horde_factory
        self._backend_factory = backend_factory
        self._model_id_default = model_id_default
        self._stop = stop_event
        #: The event that stops it (the worker's stop, shared with its state).
        self.stop_event = stop_event
        self._thread = threading.Thread(target=self._run, name="journal-recovery", daemon=True)
        self._thread.start()

    def _stop_deadline(self) -> float | None:
        return None if self.deadlines is None else self.deadlines.stop_at_wall()

    def _pause(self, seconds: float) -> None:
        if self._stop.is_set():  # stopping: the pause already ends by the deadline
            wait_on(self.clock, seconds)
        else:
            wait_on(self.clock, seconds, self._stop)  # a stop ends it: the pauses are cut then

    def _run(self) -> None:
        horde = backend = None
        try:
            horde = self._horde_factory()
            backend = self._backend_factory() if self._backend_factory is not None else None
            self.result = recover(
                self.journal,
                horde=horde,
                backend=backend,
                clock=self.clock,
                model_id_default=self._model_id_default,
                pause=self._pause,
                stopped=self._stop.is_set,
                stop_deadline=self._stop_deadline,
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
        """The host exits: end the recovery by the stop's deadline, and wait for it.

        When it still runs, the stop is made if it was not (``deadlines`` set
        ``grace_s`` seconds from now, then ``stop_event``), so each job still
        pending gets its last attempt by that deadline and the rest stays in
        the journal; then waits until the thread ended, at most until the
        submits' deadline (the stop's + ``STOP_SUBMIT_EXTRA_S``, where a call
        still in flight is hung up) and half a second more. Call it before the
        journal is released. True when the recovery ended.
        """
        if self._done.is_set():
            return True
        if self.deadlines is not None:
            self.deadlines.set(stop_call_ends(self.clock.monotonic() + grace_s))  # kept if set
        self._stop.set()
        left = None if self.deadlines is None else self.deadlines.left("submit")
        timeout_s = (grace_s + STOP_SUBMIT_EXTRA_S if left is None else max(0.0, left)) + 0.5
        return self._done.wait(timeout_s)

    def wait(
        self, stop_event: threading.Event | None = None, timeout_s: float | None = None
    ) -> bool:
        """Wait until the recovery ended (or ``stop_event`` is set, or
        ``timeout_s`` passed on its clock); True when it ended."""
        end = None if timeout_s is None else self.clock.monotonic() + timeout_s
        while not self._done.wait(0.1):
            if stop_event is not None and stop_event.is_set():
                return self._done.is_set()
            if end is not None and self.clock.monotonic() >= end:
                return False
        return True
