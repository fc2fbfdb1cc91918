"""What a worker's pop loops share under one lock: the jobs in hand, the stop
and its deadline, the guards (``state.declaring``: what the next pop
declares), the totals and the exit code.

Seed: "7. Fault a job" (maintenance after 20 aborted jobs an hour).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Protocol

from ..clock import SYSTEM_CLOCK, Clock, Timer
from ..errors import HordeRefusal
from ..inflight import CallDeadlines, stop_call_ends
from ..settings import WorkerSettings
from . import guard, status
from .declaring import Declaring
from .guard import FailureStreak, MaintenanceGuard, RefusalGuard
from .job import SUBMIT_MARGIN_S
from .journal import Journal
from .lease_fit import LeaseFit
from .life import Phase
from .probes import ProbePlan
from .refaults import RequestFaults

if TYPE_CHECKING:
    from .job import JobContext

log = logging.getLogger("koboldcpp_horde_chat.state")

HORDE_FAULT_LIMIT_PER_HOUR = guard.HORDE_FAULT_LIMIT_PER_HOUR
#: How long after a job's ``ttl`` the Horde's sweep may take to expire it, seconds.
LOST_POP_SWEEP_S = 60.0


class StartupRecovery(Protocol):
    """The start-up recovery (``service.recovery.Recovery``) as the state waits for it."""

    def wait(self, stop_event: threading.Event) -> bool:
        """True once the recovery ended; False when stopped first."""
        ...


class Slot(Protocol):
    """A pop loop's job driver (``run.driver.JobDriver``), for a forced exit."""

    def fault_jobs_now(self) -> None:
        """Fault the loop's jobs at once (the process is exiting)."""


class WorkerState(Declaring):
    """The state a worker's pop loops share.

    ``journal`` is the worker's job journal (None: none kept);
    ``call_deadlines`` the stop's deadlines of the worker's calls when the
    host made them first (None: new ones on ``clock``); ``clock`` times the
    stop, the waits for the jobs in hand and the journal's faults.
    """

    #: What :meth:`carry_over` takes over as it is.
    _CARRIED = (
        "maintenance_guard", "refusal_guard", "failure_streak", "probe_plan", "stats",
        "_next_summary", "_faults_restored", "chat_job_seen",
    )

    def __init__(
        self, settings: WorkerSettings, *, stop_event: threading.Event | None = None,
        journal: Journal | None = None, call_deadlines: CallDeadlines | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.journal = journal
        self.stop_event = stop_event if stop_event is not None else threading.Event()
        self.stats = status.WorkerStats(started_at=clock.time())
        self.exit_code = 0
        self.withheld: frozenset[str] = frozenset(settings.chat_withhold)
        self.maintenance_guard = MaintenanceGuard()
        self.refusal_guard = RefusalGuard()
        self.lease_fit = LeaseFit(
            settings.declared_max_length, settings.lease_s,
            margin_s=SUBMIT_MARGIN_S, context_cap=settings.max_context_length,
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
        self.call_deadlines = call_deadlines or CallDeadlines(clock)
        self.moderator_messages_seen: set[str] = set()
        self._next_summary: float | None = None
        self._watchdog: Timer | None = None
        #: Why a job in hand at the stop's deadline is given up.
        self._grace_why = ""
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
        (standalone: koboldcpp came back changed). The Horde counts aborted jobs
        and refused replies by worker name, so the guards, the messages said and
        the totals go on: a koboldcpp that keeps crashing still gets chat
        withdrawn before maintenance."""
        with earlier.lock:
            for name in self._CARRIED:
                setattr(self, name, getattr(earlier, name))
            self.withheld = self.withheld | earlier.withheld
            self.moderator_messages_seen = set(earlier.moderator_messages_seen)

    def wait_recovered(self) -> bool:
        """Before a loop's first pop: wait for the start-up recovery, then count
        the journal's faults in the maintenance window, once. False when the
        worker stops first."""
        recovery = self.recovery
        if recovery is not None and not recovery.wait(self.stop_event):
            return False
        # The earlier faults (epoch seconds) on the monotonic clock of this window.
        now, wall = self.clock.monotonic(), self.clock.time()
        with self.lock:
            restored = self._faults_restored
            self._faults_restored = True
            if not restored and self.journal is not None:
                for at in self.journal.recent_faults(wall):
                    self.maintenance_guard.record_fault(now - (wall - at))
        return True

    # ------------------------------------------------------------------ stop

    def stop_for_key(self, exc: HordeRefusal, line: str | None = None) -> None:
        """The API key or worker name is not the owner's: say so once, stop, exit 3."""
        with self.lock:
            first = not self._key_refused
            self._key_refused = True
            self.exit_code = 3
        if first:
            log.error("%s; stopping", line or (
                f"the Horde refused the API key (HTTP {exc.status} {exc.rc or 'no rc'}): "
                "check your API key"
            ))
        self.stop_event.set()

    def stop_for_config(self, line: str) -> None:
        """The Horde will never take this setting: say so, stop, exit 2."""
        log.error("%s; stopping", line)
        with self.lock:
            self.exit_code = 2
        self.stop_event.set()

    def request_stop(self, grace_s: float) -> None:
        """Stop popping; the jobs in hand have ``grace_s`` seconds (the stop's
        deadline), then each is given up (``JobContext.give_up``), as is any
        job received later. Horde calls end by the deadline too (pops and
        koboldcpp calls ``STOP_POP_EXTRA_S`` later, submits
        ``STOP_SUBMIT_EXTRA_S`` later). A second call keeps the first deadline."""
        with self.lock:
            if self.stop_deadline is not None:
                return
            self.stop_deadline = deadline = self.clock.monotonic() + grace_s
            self.call_deadlines.set(stop_call_ends(deadline))
            self._grace_why = f"the job did not end within the {grace_s:g} s stop grace period"
            self._watchdog = timer = self.clock.timer(grace_s, self._grace_over, name="stop-grace")
        self.stop_event.set()
        timer.start()

    def stop_overdue(self) -> bool:
        """The worker is stopping and the stop's deadline has passed."""
        deadline = self.stop_deadline
        return deadline is not None and self.clock.monotonic() >= deadline

    def _grace_over(self) -> None:
        for ctx in self.jobs_in_hand():
            ctx.give_up(self._grace_why)

    def fault_jobs_now(self) -> None:
        """Fault every job in hand at once (a second signal: the process exits)."""
        with self.lock:
            slots = list(self.slots)
            if self._watchdog is not None:
                self._watchdog.cancel()
        for slot in slots:
            slot.fault_jobs_now()

    # ------------------------------------------------------------ jobs in hand

    def hold(self, ctx: JobContext) -> None:
        """A popped job is in hand; given up at once past the stop's deadline."""
        with self.lock:
            self._in_hand[ctx.id] = ctx
        if self.stop_overdue():
            ctx.give_up(self._grace_why)

    def release(self, ctx: JobContext) -> None:
        """The job's life ended; a settled job's removal from the journal is
        written now, before anything else, so a restart never sends it anything
        (an abandoned one stays for the next start)."""
        with self.lock:
            if self._in_hand.get(ctx.id) is ctx:
                del self._in_hand[ctx.id]
            self._ended.notify_all()
        if self.journal is not None and ctx.phase is Phase.SETTLED:
            self.journal.remove(ctx.id)

    def flush_journal(self) -> None:
        """Write the journal's pending changes (the loop is idle or stops)."""
        if self.journal is not None:
            self.journal.flush()

    def jobs_in_hand(self, worker_id: int | None = None) -> list[JobContext]:
        """The jobs in hand (of loop ``worker_id`` only, when given)."""
        with self.lock:
            return [c for c in self._in_hand.values() if worker_id in (None, c.worker_id)]

    def wait_jobs_ended(self, worker_id: int, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` until loop ``worker_id`` holds no job; True when none."""
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
        self, now: float, *, counts: bool = True, kind: str | None = None,
        feature: str | None = None,
    ) -> None:
        """Count a fault sent; ``counts`` False for one the Horde counts apart;
        ``feature``: the declared name a refused reply pointed at (it counts
        toward stopping the pops, not toward withdrawing chat). One that counts
        is kept in the journal for a restarted worker."""
        with self.lock:
            self.stats.faults += 1
            if counts:
                self._count_toward_maintenance(now, kind, feature)

    def record_expired(self, now: float, kind: str | None = None) -> None:
        """A job ended on the Horde without our terminal action (its lease ran
        out): an aborted job there, counted toward maintenance."""
        with self.lock:
            self._count_toward_maintenance(now, kind)

    def record_lost_pop(self, now: float, *, chat: bool = True) -> None:
        """A pop's answer was lost: the Horde may have assigned a job that expires
        after its lease and the 60 s sweep, so it counts toward maintenance
        until the Horde's hour after that. ``chat``: the pop declared chat."""
        with self.lock:
            self._count_toward_maintenance(
                now + self.settings.lease_s + LOST_POP_SWEEP_S, None if chat else "text"
            )

    def _count_toward_maintenance(
        self, now: float, kind: str | None = None, feature: str | None = None
    ) -> None:
        self.maintenance_guard.record_fault(now, kind, feature)
        if self.journal is not None:
            self.journal.record_fault(self.clock.time())

    def record_dropped(self) -> None:
        with self.lock:
            self.stats.dropped += 1

    def record_reward(self, kudos: float) -> None:
        with self.lock:
            self.stats.kudos += kudos
            self.stats.jobs += 1

    def summary(self, now: float) -> str:
        """The totals line after a job and at the stop (``status.earnings_line``;
        its ``Time`` is the uptime), at epoch ``now``."""
        with self.lock:
            return status.earnings_line(self.stats, now - self.stats.started_at)

    def first_chat_job(self) -> bool:
        """True the first time a chat job is popped (by any loop)."""
        with self.lock:
            first = not self.chat_job_seen
            self.chat_job_seen = True
        return first

    def periodic_summary(self, now: float, wall: float) -> str | None:
        """The totals line once every ``status.SUMMARY_EVERY_S`` (monotonic
        ``now``) for one loop of the worker; None in between."""
        with self.lock:
            due = self._next_summary is not None and now >= self._next_summary
            if due or self._next_summary is None:
                self._next_summary = now + status.SUMMARY_EVERY_S
            if not due:
                return None
            line = status.summary_line(self.stats, wall - self.stats.started_at)
            aborted = self.maintenance_guard.recent(now)
        return f"{line}, {status.aborted_count(aborted, HORDE_FAULT_LIMIT_PER_HOUR)}"

    def new_moderator_lines(self, messages: object) -> list[str]:
        """Lines for the Horde's messages to the owner not said before (by any loop)."""
        with self.lock:
            return status.moderator_lines(messages, self.moderator_messages_seen)
