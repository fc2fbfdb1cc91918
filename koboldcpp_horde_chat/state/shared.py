"""What a worker's pop loops share: statistics, the declaration's withdrawals, stop.

One :class:`WorkerState` per worker: every pop loop of it (a slot) and its
submit pipeline read and change it under its lock. It holds

- the running totals (:class:`WorkerStats`), as koboldcpp's worker prints them;
- what the next pop declares: chat on or withdrawn (``guard.MaintenanceGuard``,
  before the Horde's 20 aborted jobs an hour), the ``max_length`` per kind
  that fits the lease (``lease_fit.LeaseFit``) and the features withheld by
  the operator or withdrawn, for their cool-off, after repeated refusals of
  their replies (``guard.RefusalGuard``);
- whether the worker may pop at all: not with the Horde's hour nearly full
  of aborted jobs (``guard.MaintenanceGuard.pop_allowed``), nor while
  koboldcpp fails every generation (``guard.FailureStreak``);
- the stop event and the exit code (a refused API key or declaration stops
  every loop).

Seed: "7. Fault a job" (maintenance after 20 aborted jobs an hour) and
"Submit refusals" (withdraw a guarantee the backend keeps failing).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..clock import SYSTEM_CLOCK, Clock, Timer
from ..errors import HordeRefusal
from ..horde.declaration import BackendCapabilities, pop_body
from ..inflight import STOP_POP_EXTRA_S as STOP_POP_EXTRA_S  # the stop's deadlines
from ..inflight import STOP_SUBMIT_EXTRA_S as STOP_SUBMIT_EXTRA_S
from ..inflight import CallDeadlines, stop_call_ends
from ..settings import WorkerSettings
from . import guard, status
from .guard import FailureStreak, MaintenanceGuard, RefusalGuard
from .job import SUBMIT_MARGIN_S
from .journal import Journal
from .lease_fit import LeaseFit
from .life import Phase
from .probes import ProbePlan
from .refaults import RequestFaults
from .skipped import SkipContext

if TYPE_CHECKING:
    from .job import JobContext

log = logging.getLogger("koboldcpp_horde_chat.state")

#: The Horde puts a worker that aborts more than this many jobs in an hour into maintenance.
HORDE_FAULT_LIMIT_PER_HOUR = guard.HORDE_FAULT_LIMIT_PER_HOUR
#: How long after a job's ``ttl`` the Horde's sweep may take to expire it, seconds.
LOST_POP_SWEEP_S = 60.0
class StartupRecovery(Protocol):
    """The start-up recovery as the shared state waits for it
    (``service.recovery.Recovery``; the service floor sets it)."""

    def wait(
        self, stop_event: threading.Event | None = None, timeout_s: float | None = None
    ) -> bool:
        """Block until the recovery ended (True), ``stop_event`` is set or
        ``timeout_s`` seconds passed (False unless it ended)."""
        ...


class Slot(Protocol):
    """A pop loop as the shared state sees it (for a forced exit)."""

    def fault_job_now(self) -> None:
        """Fault the jobs the loop holds at once (the process is exiting)."""


@dataclass
class WorkerStats:
    """Running totals, like koboldcpp's worker prints after each job.

    Attributes:
        started_at: epoch seconds when the worker started.
        kudos: kudos earned by accepted submits.
        jobs: accepted submits (faults not counted).
        faults: faults sent.
        dropped: jobs that ended without an accepted submit or fault (the
            Horde ended them, or the submit could not be delivered in the lease).
    """

    started_at: float = field(default_factory=time.time)
    kudos: float = 0.0
    jobs: int = 0
    faults: int = 0
    dropped: int = 0

    def summary(self, now: float) -> str:
        """The totals and rates after a job (``status.earnings_line``), at epoch ``now``:
        ``"[Total:12 kudos, Time:000h:00m:40s, Jobs:1, EarnRate:1080.00 kudos/hr,
        JobRate:90.00 jobs/hr, JobCost:12.00 kudos/job] Faults:0"``."""
        return status.earnings_line(
            kudos=self.kudos,
            jobs=self.jobs,
            faults=self.faults,
            elapsed_s=now - self.started_at,
        )


class WorkerState:
    """The state a worker's pop loops share (see the module docstring).

    Args:
        settings: the worker's configuration (``chat_withhold``, ``prompt_jobs``).
        stop_event: set to stop every loop.
        started_at: epoch seconds, for the statistics.
        journal: the worker's job journal, shared by its loops (None: none kept).
        call_deadlines: the stop's deadlines of the worker's calls, when the host
            made them before this state (standalone: the recovery's calls and the
            wait for koboldcpp end by them too), on the same clock; None: new
            ones on ``clock``.
        clock: the clock of the stop's deadline, its grace timer, the waits for
            the jobs in hand, the calls' deadlines and the journal's fault times.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        stop_event: threading.Event | None = None,
        started_at: float | None = None,
        journal: Journal | None = None,
        call_deadlines: CallDeadlines | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.journal = journal
        self.stop_event = stop_event if stop_event is not None else threading.Event()
        self.stats = WorkerStats(started_at=clock.time() if started_at is None else started_at)
        self.exit_code = 0
        self.withheld: frozenset[str] = frozenset(settings.chat_withhold)
        self.maintenance_guard = MaintenanceGuard()
        self.refusal_guard = RefusalGuard()
        self.lease_fit = LeaseFit(
            settings.declared_max_length,
            settings.lease_s,
            margin_s=SUBMIT_MARGIN_S,
            context_cap=settings.max_context_length,
        )
        self.failure_streak = FailureStreak()
        #: The failure streak's probes: their waits and sizes (``state.probes``).
        self.probe_plan = ProbePlan()
        #: The requests this worker faulted lately (``state/refaults.py``), under ``lock``.
        self.refaults = RequestFaults()
        #: The Horde was asked whether the key's owner is trusted (once, ``run/driver.py``).
        self.owner_checked = False
        #: The key's owner is trusted (True/False, from the start's key check), or None: not known.
        self.owner_trusted: bool | None = None
        self.lock = threading.RLock()
        self._key_refused = False
        self.slots: list[Slot] = []
        self.stop_deadline: float | None = None
        #: When a stopping worker's calls end, by kind (its clients share it).
        self.call_deadlines = (
            call_deadlines if call_deadlines is not None else CallDeadlines(clock)
        )
        self.moderator_messages_seen: set[str] = set()
        self._next_summary: float | None = None
        self._watchdog: Timer | None = None
        self._grace_s = 0.0
        self._in_hand: dict[str, JobContext] = {}
        self._ended = threading.Condition(self.lock)
        #: Submits being retried on threads of their own (no pop meanwhile).
        self.retrying_submits = 0
        #: The recovery of the jobs an earlier run left in hand (None: none).
        self.recovery: StartupRecovery | None = None
        self._faults_restored = False
        #: A chat job was popped (:meth:`first_chat_job`).
        self.chat_job_seen = False
        #: koboldcpp answered its chat route 404 (:meth:`chat_route_missing`).
        self.no_chat_route = False

    def carry_over(self, earlier: WorkerState) -> None:
        """Go on from ``earlier``, this worker's state before it declared anew
        (standalone: koboldcpp came back serving another model or context).

        The Horde counts a worker's aborted jobs and its nonconformant replies
        by its name, whatever koboldcpp serves: the fault window, the refusal
        counts, the features those withdrew, the Horde's messages already said
        and the totals go on here, so that a koboldcpp that keeps crashing and
        coming back changed still has chat withdrawn before the Horde's
        maintenance (``guard.MaintenanceGuard``).
        """
        with earlier.lock:
            self.maintenance_guard = earlier.maintenance_guard
            self.refusal_guard = earlier.refusal_guard
            self.failure_streak = earlier.failure_streak
            self.probe_plan = earlier.probe_plan
            self.withheld = self.withheld | earlier.withheld
            self.moderator_messages_seen = set(earlier.moderator_messages_seen)
            self.stats = earlier.stats
            self._next_summary = earlier._next_summary
            self._faults_restored = earlier._faults_restored
            self.chat_job_seen = earlier.chat_job_seen

    def wait_recovered(self) -> bool:
        """Before a loop's first pop: wait for the recovery of the jobs an earlier
        run left in hand (it ends when the Horde answered each, or its lease
        ended), then count the faults the journal keeps (an earlier process's
        and the recovery's) in this worker's maintenance window, once. False
        when the worker stops first."""
        recovery = self.recovery
        if recovery is not None and not recovery.wait(self.stop_event):
            return False
        with self.lock:
            if self._faults_restored or self.journal is None:
                self._faults_restored = True
                return True
            self._faults_restored = True
        self.restore_faults(
            self.journal.recent_faults(self.clock.time()),
            now=self.clock.monotonic(),
            wall=self.clock.time(),
        )
        return True

    @property
    def chat_enabled(self) -> bool:
        """Whether the next pop declares chat (False while withdrawn)."""
        return self.maintenance_guard.chat_enabled

    # ------------------------------------------------------------------ stop

    def stop_for_key(self, exc: HordeRefusal, line: str | None = None) -> None:
        """The API key (or the worker name) is not the owner's: say so once
        (``line``, or "check your API key"), stop every loop, exit code 3."""
        with self.lock:
            first = not self._key_refused
            self._key_refused = True
            self.exit_code = 3
        if first:
            if line is None:
                line = (
                    f"the Horde refused the API key (HTTP {exc.status} {exc.rc or 'no rc'}): "
                    "check your API key"
                )
            log.error("%s; stopping", line)
        self.stop_event.set()

    def stop_for_config(self, line: str) -> None:
        """The Horde will never take this setting (e.g. the chat declaration):
        say so, stop every loop, exit code 2."""
        log.error("%s; stopping", line)
        with self.lock:
            self.exit_code = 2
        self.stop_event.set()

    def request_stop(self, grace_s: float) -> None:
        """Stop popping now; give the jobs in hand until ``grace_s`` seconds from
        now (the stop's deadline) to end.

        At the deadline every job still in hand, whenever it was popped (also a
        job whose pop was in flight at the signal), is given up
        (``JobContext.give_up``: its blocking step ends, its generation is
        stopped, and its loop faults it); a job received after the deadline is
        given up at once. Every Horde call ends by the deadline too
        (``call_deadlines``): a progress post still in flight then is hung
        up, a pop and a koboldcpp call other than a generation (a generation
        ends with its job's give-up) ``STOP_POP_EXTRA_S`` later, a submit (the
        fault of a job given up) ``STOP_SUBMIT_EXTRA_S`` later. Calling it
        again keeps the first deadline.
        """
        with self.lock:
            if self.stop_deadline is not None:
                return
            self.stop_deadline = deadline = self.clock.monotonic() + grace_s
            self.call_deadlines.set(stop_call_ends(deadline))
            self._grace_s = grace_s
            timer = self.clock.timer(grace_s, self._grace_over, name="stop-grace")
            self._watchdog = timer
        self.stop_event.set()
        timer.start()

    def _grace_why(self) -> str:
        return f"the job did not end within the {self._grace_s:g} s stop grace period"

    def stop_overdue(self) -> bool:
        """The worker is stopping and the stop's deadline has passed."""
        deadline = self.stop_deadline
        return deadline is not None and self.clock.monotonic() >= deadline

    def _grace_over(self) -> None:
        for ctx in self.jobs_in_hand():
            ctx.give_up(self._grace_why())

    def fault_jobs_now(self) -> None:
        """Fault every job in hand at once (a second signal: the process exits)."""
        with self.lock:
            slots = list(self.slots)
            if self._watchdog is not None:
                self._watchdog.cancel()
        for slot in slots:
            slot.fault_job_now()

    # ------------------------------------------------------------ jobs in hand

    def hold(self, ctx: JobContext) -> None:
        """A popped job is in hand (before anything else happens to it): counted
        for the stop, and given up at once when the stop's deadline has passed."""
        with self.lock:
            self._in_hand[ctx.id] = ctx
        if self.stop_overdue():
            ctx.give_up(self._grace_why())

    def release(self, ctx: JobContext) -> None:
        """The job's life ended: no longer in hand; cleared from the journal when
        it was settled (an abandoned job stays there for the next start). The
        removal is written now, before anything else happens (the next pop's
        job, a pause, an exit path), so a restart never sends it anything."""
        with self.lock:
            if self._in_hand.get(ctx.id) is ctx:
                del self._in_hand[ctx.id]
            self._ended.notify_all()
        if self.journal is not None and ctx.phase is Phase.SETTLED:
            self.journal.remove(ctx.id)

    def flush_journal(self) -> None:
        """Write the journal's pending removals (when the loop is idle or stops)."""
        if self.journal is not None:
            self.journal.flush()

    def jobs_in_hand(self, worker_id: int | None = None) -> list[JobContext]:
        """The jobs in hand (of loop ``worker_id`` only, when given)."""
        with self.lock:
            return [
                c for c in self._in_hand.values() if worker_id is None or c.worker_id == worker_id
            ]

    def wait_jobs_ended(self, worker_id: int, timeout_s: float) -> bool:
        """Wait until loop ``worker_id`` holds no job (at most ``timeout_s``); True when none."""
        end = self.clock.monotonic() + timeout_s
        with self._ended:
            while self.jobs_in_hand(worker_id):
                left = end - self.clock.monotonic()
                if left <= 0:
                    return False
                self._ended.wait(left)
        return True

    # -------------------------------------------------------------- counting

    def record_fault(
        self,
        now: float,
        *,
        counts: bool = True,
        kind: str | None = None,
        feature: str | None = None,
    ) -> None:
        """Count a fault sent (of a ``kind`` job); ``counts`` False for one the
        Horde counts apart; ``feature`` the declared name a refused reply
        pointed at (it counts toward stopping the pops, not toward withdrawing
        chat: ``guard.MaintenanceGuard``).

        One that counts toward maintenance is kept in the journal too, so a
        restarted worker goes on counting it (:meth:`restore_faults`)."""
        with self.lock:
            self.stats.faults += 1
            if counts:
                self._count_toward_maintenance(now, kind, feature)

    def record_expired(self, now: float, kind: str | None = None) -> None:
        """A job ended on the Horde without our terminal action (its lease ran out:
        a submit not delivered in time, answered ``AbortedGen``, a progress post
        answered ``ChatJobAborted``): an aborted job there, so it counts toward
        maintenance."""
        with self.lock:
            self._count_toward_maintenance(now, kind)

    def record_lost_pop(self, now: float, *, chat: bool = True) -> None:
        """A pop was sent but its answer lost (a timeout, a reset, a 5xx): the
        Horde may have assigned it a job this worker never sees, which expires
        there (its ``ttl``, :attr:`WorkerSettings.lease_s`, and the Horde's
        60 s sweep after it): an aborted job on the Horde, counted toward
        maintenance now and until the Horde's hour after that expiry
        (``guard.MaintenanceGuard.record_lost_pop``). ``chat``: the pop
        declared chat."""
        expires_at = now + self.settings.lease_s + LOST_POP_SWEEP_S
        with self.lock:
            self.maintenance_guard.record_lost_pop(expires_at, None if chat else "text")
            if self.journal is not None:
                self.journal.record_fault(self.clock.time())

    def _count_toward_maintenance(
        self, now: float, kind: str | None = None, feature: str | None = None
    ) -> None:
        self.maintenance_guard.record_fault(now, kind, feature)
        if self.journal is not None:
            self.journal.record_fault(self.clock.time())

    def restore_faults(self, faults: Iterable[float], *, now: float, wall: float) -> None:
        """Count the faults an earlier process made (epoch seconds, from the journal:
        ``Journal.recent_faults``) in this one's maintenance window, which runs
        on monotonic seconds (``now``; ``wall`` is the epoch time of the same
        instant)."""
        with self.lock:
            for at in faults:
                self.maintenance_guard.record_fault(now - (wall - at))

    def record_dropped(self) -> None:
        """A job ended without an accepted submit or fault of ours."""
        with self.lock:
            self.stats.dropped += 1

    def record_reward(self, kudos: float) -> None:
        """An accepted submit earned ``kudos``."""
        with self.lock:
            self.stats.kudos += kudos
            self.stats.jobs += 1

    def summary(self, now: float) -> str:
        """The statistics line (see :meth:`WorkerStats.summary`)."""
        with self.lock:
            return self.stats.summary(now)

    def stop_summary(self, now: float) -> str:
        """The statistics line for the stop (epoch ``now``; its ``Time`` is the uptime)."""
        return self.summary(now)

    def first_chat_job(self) -> bool:
        """A chat job was popped: True the first time (of all the worker's loops),
        for ``status.first_chat_job_line``."""
        with self.lock:
            first = not self.chat_job_seen
            self.chat_job_seen = True
        return first

    def periodic_summary(self, now: float, wall: float) -> str | None:
        """The totals line once every ``status.SUMMARY_EVERY_S`` (monotonic ``now``),
        for one loop of the worker only; None in between."""
        with self.lock:
            if self._next_summary is None:
                self._next_summary = now + status.SUMMARY_EVERY_S
                return None
            if now < self._next_summary:
                return None
            self._next_summary = now + status.SUMMARY_EVERY_S
            stats = self.stats
            line = status.summary_line(
                jobs=stats.jobs,
                kudos=stats.kudos,
                faults=stats.faults,
                dropped=stats.dropped,
                uptime_s=wall - stats.started_at,
            )
            aborted = self.maintenance_guard.recent(now)
        return f"{line}, {status.aborted_count(aborted, HORDE_FAULT_LIMIT_PER_HOUR)}"

    def new_moderator_lines(self, messages: object) -> list[str]:
        """Lines for the Horde's messages to the owner not said before (by any loop)."""
        with self.lock:
            return status.moderator_lines(messages, self.moderator_messages_seen)

    # ---------------------------------------------------------- declaration

    def update_chat_withdrawal(self, now: float) -> bool:
        """Withdraw the chat declaration before the Horde's 20 aborted jobs an hour.

        The counting is ``guard.MaintenanceGuard``'s: withdrawn at 15 aborted
        jobs in the Horde's hour (and a minute), chat jobs among them, declared
        again below 10 (the faults a withdrawn feature answers for not among
        them). A feature whose cool-off ended (``guard.RefusalGuard``) is
        declared again here, one line each. A worker that also serves text jobs keeps popping
        without the declaration; a chat-only worker (``prompt_jobs`` False)
        cannot pop without it, so it pauses popping. Each change is one line
        worded as the totals line counts (``status.aborted_count``).
        Returns False when the next pop must be skipped.
        """
        with self.lock:
            mguard = self.maintenance_guard
            change = mguard.update(now)
            recent = mguard.recent(now)
            enabled = mguard.chat_enabled
            restored = self.refusal_guard.restore_due(now)
        for name in restored:
            log.info("declaring %r again: its cool-off after refused replies ended", name)
        count = status.aborted_count(recent, HORDE_FAULT_LIMIT_PER_HOUR)
        if change == "withdraw":
            log.warning(
                "%s, chat jobs among them: withdrawing the chat declaration%s until "
                "fewer than %d remain",
                count,
                " (text jobs continue)" if self.settings.prompt_jobs else
                " and pausing pops (chat-only worker)",
                mguard.restore_below,
            )
        elif change == "restore":
            log.info("%s: declaring chat again", count)
        return enabled or self.settings.prompt_jobs

    def outcome_may_withdraw(self, ctx: JobContext, *, is_fault: bool, now: float) -> bool:
        """Could the Horde's answer to this job's terminal action change what the
        next pop declares? True when one more counted fault would withdraw chat
        (a fault, or a chat reply the Horde could refuse, which is then faulted)
        or one more ``ChatSubmitNonconformant`` refusal would withdraw a feature
        this job's pop declared. The next pop then waits for that answer."""
        with self.lock:
            mguard = self.maintenance_guard
            if (is_fault or ctx.chat) and mguard.chat_enabled and (
                mguard.recent(now) + 1 >= mguard.withdraw_at
            ):
                return True
            if is_fault or not ctx.chat:
                return False
            rguard = self.refusal_guard
            return any(
                rguard.count(name, now) + 1 >= rguard.threshold
                for name in ctx.declared_features
                if name not in self.withheld
            )

    def record_feature_failure(self, names: Iterable[str], now: float) -> None:
        """Count a failed reply against the declared guarantees or features it
        points at: refused by the Horde (``guard.refused_reply_features``) or
        unusable (a malformed tool call: ``errors.ReplyError.feature``); at
        ``guard.REFUSALS_TO_WITHDRAW`` in an hour a name is withdrawn alone from
        the later pops for its cool-off, one WARNING line saying which and until
        when (local time); plain chat goes on."""
        wall = self.clock.time()
        with self.lock:
            rguard = self.refusal_guard
            withdrawn = [(name, rguard.until(name) or now) for name in rguard.record(names, now)]
        for name, until in withdrawn:
            at = time.strftime("%H:%M:%S", time.localtime(wall + (until - now)))
            log.warning(
                "withdrawing %r from the chat declaration until %s (for %d min): %d of its "
                "replies within an hour were refused by the Horde or unusable; chat without "
                "it goes on",
                name,
                at,
                max(1, round((until - now) / 60.0)),
                rguard.threshold,
            )

    def chat_route_missing(self) -> None:
        """koboldcpp answered ``POST /v1/chat/completions`` 404: it has no chat
        route, whatever version it reports (``koboldcpp.versions``). No later
        pop declares chat, until koboldcpp comes back changed (standalone, the
        host declares anew with a new state); one WARNING line, once."""
        with self.lock:
            first = not self.no_chat_route
            self.no_chat_route = True
        if first:
            log.warning(
                "koboldcpp at %s answered 404 for /v1/chat/completions: it has no chat "
                "route; popping without the chat declaration until koboldcpp restarts%s",
                self.settings.kcpp_url,
                " (text jobs continue)" if self.settings.prompt_jobs else "",
            )

    # ------------------------------------------------ the guard: pops and lengths

    def abort_limit(self, now: float) -> tuple[int, int, float] | None:
        """None when one more job may be popped; else ``(counted, in_hand,
        resume_at)``: the aborted jobs counted in the window, the jobs in hand
        (each may still become one) and when popping is allowed again if
        nothing more is counted (clock of ``now``; ``guard.MaintenanceGuard``)."""
        with self.lock:
            mguard = self.maintenance_guard
            in_hand = len(self._in_hand)
            if mguard.pop_allowed(now, in_hand):
                return None
            return mguard.recent(now), in_hand, mguard.resume_at(now, in_hand)

    def pop_body(self, caps: BackendCapabilities) -> dict[str, Any]:
        """The next pop's body (``declaration.pop_body``) with the declaration as
        it stands now: chat on or withdrawn, the features withheld, and the
        ``max_length`` and ``max_context_length`` per kind that fit the lease
        (``lease_fit.LeaseFit``), and
        without a kind whose generations failed in a row (``guard.FailureStreak``:
        chat without the chat declaration, text with ``prompt_jobs: false``)."""
        with self.lock:
            return pop_body(
                self.settings,
                caps,
                withhold=self.withheld | self.refusal_guard.withdrawn,
                chat_jobs=self.chat_enabled
                and not self.no_chat_route
                and not self.failure_streak.kind_failing("chat"),
                max_length=self.lease_fit.declared("text"),
                chat_max_length=self.lease_fit.declared("chat"),
                max_context_length=self.lease_fit.declared_context("text"),
                chat_max_context_length=self.lease_fit.declared_context("chat"),
                prompt_jobs=not self.failure_streak.kind_failing("text"),
            )

    def skip_context(self, body: dict[str, Any]) -> SkipContext:
        """What the pop ``body`` declared, and why a kind's ``max_length`` is
        lowered, for the line about an empty pop's ``skipped`` requests."""
        with self.lock:
            lowered = {
                kind: why
                for kind in ("text", "chat")
                if (why := self.lease_fit.lowered_because(kind)) is not None
            }
        return SkipContext.of_pop(body, lowered)

    def kinds_to_pop(self) -> tuple[str, ...]:
        """The kinds the next pop may ask for: text unless a chat-only worker's or
        its generations failed in a row, chat unless withdrawn (by the aborted
        jobs or by its generations failing in a row). Empty: do not pop."""
        with self.lock:
            streak = self.failure_streak
            kinds = []
            if self.settings.prompt_jobs and not streak.kind_failing("text"):
                kinds.append("text")
            if self.chat_enabled and not self.no_chat_route and not streak.kind_failing("chat"):
                kinds.append("chat")
            return tuple(kinds)
