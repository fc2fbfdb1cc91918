"""The job journal's rules, pure: what a restart sends for a job an earlier
process left, and how far apart two runs were in time.

A job's terminal-action state (:data:`TERMINAL_STATES`): ``none`` (a restart
faults it while its lease surely runs), ``reply_kept`` / ``reply_sent`` (the
reply is kept; a restart sends it again while the lease may run: a stored
reply is answered ``DuplicateGen`` at no cost, seed "Check the completed
reply"), ``fault_sent`` (a restart sends nothing: every fault the Horde takes
re-opens the request, seed "7. Fault a job"). An answered job leaves the journal.

Each journal file carries the wall clock, the boot id and the time since boot
(``CLOCK_BOOTTIME``, which counts a suspend); a restart assumes the worst for
what the Horde counts and the best for what it sends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from ..jsonbody import finite_number

#: The terminal-action states a journal entry may hold.
TERMINAL_STATES: Final = frozenset({"none", "reply_kept", "reply_sent", "fault_sent"})
#: The states in which the journal keeps a reply to send.
REPLY_STATES: Final = frozenset({"reply_kept", "reply_sent"})

#: Seconds of lease a restart leaves for a fault to reach the Horde in time
#: (the pop's round trip included: the lease began before its answer was read).
FAULT_MARGIN_S: Final = 5.0


@dataclass(frozen=True)
class ClockMark:
    """One instant on three clocks: ``wall`` (epoch seconds; may jump), ``boot_id``
    (``""`` when unknown) and ``boottime`` (seconds since boot, counting a
    suspend; None when the platform has none)."""

    wall: float
    boot_id: str = ""
    boottime: float | None = None

    def to_json(self) -> dict[str, Any]:
        boottime = None if self.boottime is None else round(self.boottime, 3)
        return {"wall": round(self.wall, 3), "boot_id": self.boot_id, "boottime": boottime}

    @classmethod
    def from_json(cls, obj: object) -> ClockMark | None:
        """The mark a JSON object describes; None when it is not one."""
        if not isinstance(obj, dict):
            return None
        wall, boot_id, boottime = obj.get("wall"), obj.get("boot_id", ""), obj.get("boottime")
        wall_s, boottime_s = finite_number(wall), finite_number(boottime)
        if wall_s is None or not isinstance(boot_id, str):
            return None
        if boottime_s is None and boottime is not None:  # a boottime that is not a number
            return None
        return cls(wall_s, boot_id, boottime_s)

def elapsed_bounds(then: ClockMark | None, now: ClockMark) -> tuple[float, float]:
    """``(least, most)`` seconds that can have passed from ``then`` to ``now``.

    ``(0, 0)`` without ``then`` (an older file). Same boot with both boot
    clocks: exactly their difference. Otherwise at least the time since this
    boot when the boot changed, else 0; the wall clock's difference is the
    most, unless it is smaller than the least (the clock was set back): then
    ``math.inf``.
    """
    if then is None:
        return 0.0, 0.0
    wall_elapsed = now.wall - then.wall
    same_boot = bool(then.boot_id) and then.boot_id == now.boot_id
    if same_boot and then.boottime is not None and now.boottime is not None:
        exact = now.boottime - then.boottime
        if exact >= 0:
            return exact, exact
    rebooted = bool(then.boot_id and now.boot_id) and not same_boot
    floor = max(0.0, now.boottime) if rebooted and now.boottime is not None else 0.0
    return floor, wall_elapsed if wall_elapsed >= floor else math.inf


@dataclass(frozen=True)
class RestartPlan:
    """What a restart does for one entry: ``action`` ``"reply"``, ``"fault"``,
    ``"expired"`` or ``"fault_sent"`` (nothing sent for these two);
    ``lease_left_s``: the most the lease may still run for a reply, the least
    otherwise; ``least_left_s``: the least."""

    action: str
    lease_left_s: float
    least_left_s: float


def plan(entry: dict[str, Any], then: ClockMark | None, now: ClockMark) -> RestartPlan:
    """What a restart sends for ``entry`` (``JournalEntry.to_json``: ``lease_end``
    in epoch seconds of the earlier run, ``terminal``, ``reply``), ``then`` the
    earlier run's mark: a kept reply while the lease may run, a fault only while
    it surely runs with :data:`FAULT_MARGIN_S` to spare."""
    terminal = entry.get("terminal", "none")
    least, most = elapsed_bounds(then, now)
    left_at_write = float(entry["lease_end"]) - (then or now).wall
    most_left, least_left = left_at_write - least, left_at_write - most
    if terminal == "fault_sent":
        return RestartPlan("fault_sent", least_left, least_left)
    if terminal in REPLY_STATES and isinstance(entry.get("reply"), dict):
        return RestartPlan("reply" if most_left > 0 else "expired", most_left, least_left)
    action = "fault" if least_left > FAULT_MARGIN_S else "expired"
    return RestartPlan(action, least_left, least_left)


def fault_ages_shift(then: ClockMark | None, now: ClockMark) -> float:
    """Seconds to add to an earlier run's fault times to read them on this run's
    wall clock, taking the least time passed (each fault as recent as it can be)."""
    return 0.0 if then is None else (now.wall - then.wall) - elapsed_bounds(then, now)[0]


def next_start_plan(terminal: str | None) -> str:
    """What the next start does with a job left in terminal-action state
    ``terminal`` (None: not in a journal), in a log line's words; ValueError
    for another state."""
    if terminal is None:
        return "not in a journal: nothing is sent; its lease runs out on the Horde"
    if terminal in REPLY_STATES:
        return "left to the next start, which sends the reply again"
    if terminal == "none":
        return "left to the next start, which faults it while its lease runs"
    if terminal == "fault_sent":
        return "a fault may have reached the Horde; none is sent again"
    raise ValueError(f"not a terminal-action state: {terminal!r}")
