"""What the next pop declares and whether the worker pops at all: the part of
the shared state (``state.shared.WorkerState``) that reads the guards.

Seed "7. Fault a job" (maintenance after 20 aborted jobs an hour) and "Submit
refusals" (withdraw a guarantee the backend keeps failing).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..clock import Clock
from ..horde.declaration import BackendCapabilities, pop_body
from ..settings import WorkerSettings
from . import guard, status
from .guard import FailureStreak, MaintenanceGuard, RefusalGuard
from .lease_fit import KINDS, LeaseFit
from .skipped import SkipContext

if TYPE_CHECKING:
    from .job import JobContext

log = logging.getLogger("koboldcpp_horde_chat.state")


class Declaring:
    """The declaration's methods of ``WorkerState``, under its lock."""

    settings: WorkerSettings
    clock: Clock
    lock: threading.RLock
    withheld: frozenset[str]
    maintenance_guard: MaintenanceGuard
    refusal_guard: RefusalGuard
    failure_streak: FailureStreak
    lease_fit: LeaseFit
    no_chat_route: bool
    _in_hand: dict[str, JobContext]

    @property
    def chat_enabled(self) -> bool:
        """Whether the next pop declares chat (False while withdrawn)."""
        return self.maintenance_guard.chat_enabled

    def update_chat_withdrawal(self, now: float) -> bool:
        """Withdraw chat at 15 aborted jobs in the Horde's hour (chat jobs among
        them, faults of one withdrawn feature not counted), declare it again
        below 10, and declare again the features whose cool-off ended; a line
        each. False when the next pop must be skipped (a chat-only worker
        without chat)."""
        with self.lock:
            mguard = self.maintenance_guard
            change = mguard.update(now)
            recent = mguard.recent(now)
            enabled = mguard.chat_enabled
            restored = self.refusal_guard.restore_due(now)
        for name in restored:
            log.info("declaring %r again: its cool-off after refused replies ended", name)
        count = status.aborted_count(recent, guard.HORDE_FAULT_LIMIT_PER_HOUR)
        if change == "withdraw":
            log.warning(
                "%s, chat jobs among them: withdrawing the chat declaration%s until "
                "fewer than %d remain",
                count,
                " (text jobs continue)" if self.settings.prompt_jobs else
                " and pausing pops (chat-only worker)",
                guard.RESTORE_CHAT_BELOW,
            )
        elif change == "restore":
            log.info("%s: declaring chat again", count)
        return enabled or self.settings.prompt_jobs

    def outcome_may_withdraw(self, ctx: JobContext, *, is_fault: bool, now: float) -> bool:
        """Could the Horde's answer to this job's terminal action change the next
        pop's declaration (one more fault would withdraw chat, one more refusal
        a feature the job's pop declared)? The next pop then waits for it."""
        with self.lock:
            mguard = self.maintenance_guard
            if (is_fault or ctx.chat) and mguard.chat_enabled and (
                mguard.recent(now) + 1 >= guard.WITHDRAW_CHAT_AT
            ):
                return True
            if is_fault or not ctx.chat:
                return False
            return any(self.refusal_guard.count(name, now) + 1 >= guard.REFUSALS_TO_WITHDRAW
                       for name in ctx.declared_features if name not in self.withheld)

    def record_feature_failure(self, names: Iterable[str], now: float) -> None:
        """Count a reply refused or unusable against the declared names it points
        at; at ``guard.REFUSALS_TO_WITHDRAW`` in an hour a name is withdrawn
        alone for its cool-off, one line saying until when (local time)."""
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
                name, at, max(1, round((until - now) / 60.0)), guard.REFUSALS_TO_WITHDRAW,
            )

    def chat_route_missing(self) -> None:
        """koboldcpp answered its chat route 404, whatever version it reports: no
        later pop declares chat (until a new state); one line, once."""
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

    def abort_limit(self, now: float) -> tuple[int, int, float] | None:
        """None when one more job may be popped; else ``(counted, in_hand,
        resume_at)``: the aborted jobs counted, the jobs in hand (each may still
        become one) and when popping may resume if nothing more is counted."""
        with self.lock:
            mguard = self.maintenance_guard
            in_hand = len(self._in_hand)
            if mguard.pop_allowed(now, in_hand):
                return None
            return mguard.recent(now), in_hand, mguard.resume_at(now, in_hand)

    def pop_body(self, caps: BackendCapabilities) -> dict[str, Any]:
        """The next pop's body with the declaration as it stands: chat on or
        withdrawn, the features withheld, the limits that fit the lease, and
        without a kind whose generations failed in a row."""
        with self.lock:
            fit = self.lease_fit
            return pop_body(
                self.settings, caps, withhold=self.withheld | self.refusal_guard.withdrawn,
                chat_jobs=self._pops("chat"), prompt_jobs=self._pops("text"),
                limits={k: (fit.declared(k), fit.declared_context(k)) for k in KINDS},
            )

    def skip_context(self, body: dict[str, Any]) -> SkipContext:
        """What the pop ``body`` declared and why a kind is lowered, for the line
        about an empty pop's ``skipped`` requests."""
        with self.lock:
            lowered = {k: why for k in KINDS if (why := self.lease_fit.lowered_because(k))}
        return SkipContext.of_pop(body, lowered)

    def kinds_to_pop(self) -> tuple[str, ...]:
        """The kinds the next pop may ask for (empty: do not pop)."""
        with self.lock:
            return tuple(kind for kind in KINDS if self._pops(kind))

    def _pops(self, kind: str) -> bool:
        """Whether the next pop may ask for ``kind`` (under the lock)."""
        if self.failure_streak.kind_failing(kind):
            return False
        if kind == "text":
            return self.settings.prompt_jobs
        return self.chat_enabled and not self.no_chat_route
