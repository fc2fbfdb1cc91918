"""The job journal's rules, pure: what a restart may send for a job an earlier
process left, and how far apart two runs were in time.

Seed sections: "7. Fault a job" (a fault re-opens the request: the real Horde's
``set_generation`` runs ``wp.n += 1`` for every faulted submit before it looks
at the job, so a fault for a job that already ended makes another worker
generate it again), "Streaming progress" (the lease: the pop's ``ttl``,
extended by accepted posts) and "Check the completed reply" (a second submit
of a stored reply is answered ``DuplicateGen`` and costs nothing).

**A job's terminal-action state** (:data:`TERMINAL_STATES`), as the journal
records it:

- ``none``: no terminal action yet. A restart faults the job while its lease
  surely runs.
- ``reply_kept``: the reply is generated and kept in the journal, not sent
  yet (a stop keeps it to send before its deadline).
- ``reply_sent``: the reply was sent (or is on the wire) and the Horde's answer
  is not known. A restart sends the same reply again while the lease may run:
  the Horde answers ``DuplicateGen`` when it had stored it, at no cost.
- ``fault_sent``: the fault was sent (or is on the wire) and its answer is not
  known. A restart sends nothing: a second fault would re-open the request a
  second time (at most one fault per job).
- answered: the Horde answered the terminal action definitively; the job is
  removed from the journal before anything else happens.

**Time between two runs.** The journal writes, with each file, the wall clock,
the boot id (``/proc/sys/kernel/random/boot_id``) and the time since boot
(``CLOCK_BOOTTIME``, which counts a suspend). :func:`elapsed_bounds` turns
the earlier run's mark and this one's into the least and the most time that
can have passed. The restart then assumes the worst for what the Horde
counts (a kept fault is as recent as it can be) and the best for what it
sends (a fault only for a job whose lease surely runs; a reply, which costs
nothing when the job ended, while the lease may run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from ..jsonbody import finite_number

#: The terminal-action states a journal entry may hold (see the module docstring).
TERMINAL_STATES: Final = frozenset({"none", "reply_kept", "reply_sent", "fault_sent"})
#: The states in which the journal keeps a reply to send.
REPLY_STATES: Final = frozenset({"reply_kept", "reply_sent"})

#: Seconds of lease a restart leaves for a fault to reach the Horde in time
#: (the pop's own round trip included: the lease began on the Horde before
#: the worker read the pop's answer).
FAULT_MARGIN_S: Final = 5.0

#: HTTP statuses that say the Horde did not take a submit (rate limit, unavailable).
NOT_TAKEN_STATUSES: Final = frozenset({429, 503})


@dataclass(frozen=True)
class ClockMark:
    """One instant on the three clocks a journal file is written with.

    Attributes:
        wall: epoch seconds (``time.time()``); may jump when the clock is set.
        boot_id: the kernel's boot id, ``""`` when unknown (not Linux).
        boottime: seconds since boot, counting a suspend (``CLOCK_BOOTTIME``);
            None when the platform has no such clock.
    """

    wall: float
    boot_id: str = ""
    boottime: float | None = None

    def to_json(self) -> dict[str, Any]:
        """``{"wall", "boot_id", "boottime"}`` (``boottime`` null when unknown)."""
        return {
            "wall": round(self.wall, 3),
            "boot_id": self.boot_id,
            "boottime": None if self.boottime is None else round(self.boottime, 3),
        }

    @classmethod
    def from_json(cls, obj: object) -> ClockMark | None:
        """The mark a JSON object describes; None when it is not one."""
        if not isinstance(obj, dict):
            return None
        wall, boot_id, boottime = obj.get("wall"), obj.get("boot_id", ""), obj.get("boottime")
        wall_s = finite_number(wall)
        if wall_s is None or not isinstance(boot_id, str):
            return None
        if boottime is None:
            return cls(wall_s, boot_id, None)
        boottime_s = finite_number(boottime)
        if boottime_s is None:
            return None
        return cls(wall_s, boot_id, boottime_s)




def elapsed_bounds(then: ClockMark | None, now: ClockMark) -> tuple[float, float]:
    """The least and the most seconds that can have passed from ``then`` to ``now``.

    - ``then`` None (a file of an earlier version, which wrote no mark): the
      wall clock is all there is; ``(0, 0)``, so stored epoch times are read
      as they are.
    - Same boot, both times since boot known: exactly their difference (the
      wall clock may have been set meanwhile; this clock cannot be).
    - Otherwise (another boot, or no boot clock): at least the time since
      this boot when the boot changed (the earlier run ended before it), else
      0. A wall-clock difference at least that large is believed for the most;
      a smaller one means the wall clock was set back, and the most is
      unknown (``math.inf``).

    Returns:
        ``(least, most)`` seconds, ``0 <= least <= most``.
    """
    if then is None:
        return 0.0, 0.0
    wall_elapsed = now.wall - then.wall
    same_boot = bool(then.boot_id) and then.boot_id == now.boot_id
    if same_boot and then.boottime is not None and now.boottime is not None:
        exact = now.boottime - then.boottime
        if exact >= 0:
            return exact, exact
    floor = 0.0
    if then.boot_id and now.boot_id and not same_boot and now.boottime is not None:
        floor = max(0.0, now.boottime)
    if wall_elapsed >= floor:
        return floor, wall_elapsed
    return floor, math.inf


@dataclass(frozen=True)
class RestartPlan:
    """What a restart does for one journal entry (:func:`plan`).

    Attributes:
        action: ``"reply"`` (send the kept reply), ``"fault"`` (fault the job),
            ``"expired"`` (the lease may have ended and no fault may go:
            nothing sent) or ``"fault_sent"`` (its fault went before: nothing
            more sent).
        lease_left_s: seconds the lease still runs at most (a reply) or at
            least (a fault), at the instant of planning; for the sends'
            retries.
    """

    action: str
    lease_left_s: float
    least_left_s: float


def plan(entry: dict[str, Any], then: ClockMark | None, now: ClockMark) -> RestartPlan:
    """What a restart sends for a journal entry left by an earlier run.

    Args:
        entry: the entry's JSON (``JournalEntry.to_json``): ``lease_end``
            (epoch seconds on the earlier run's wall clock), ``terminal``
            (absent: ``"none"``) and ``reply`` (the kept submit body).
        then: the clock mark the earlier run wrote with the file (None: none).
        now: this run's mark.

    Returns:
        A :class:`RestartPlan`: a kept reply is sent while the lease may still
        run (the most remaining lease above 0: a reply for an ended job costs
        nothing); a job without a terminal action is faulted only while its
        lease surely runs with :data:`FAULT_MARGIN_S` to spare; a job whose
        fault was sent gets nothing more.
    """
    terminal = entry.get("terminal", "none")
    least, most = elapsed_bounds(then, now)
    at_write = then.wall if then is not None else now.wall
    left_at_write = float(entry["lease_end"]) - at_write
    most_left = left_at_write - least
    least_left = left_at_write - most
    if terminal == "fault_sent":
        return RestartPlan("fault_sent", least_left, least_left)
    if terminal in REPLY_STATES and isinstance(entry.get("reply"), dict):
        return RestartPlan("reply" if most_left > 0 else "expired", most_left, least_left)
    action = "fault" if least_left > FAULT_MARGIN_S else "expired"
    return RestartPlan(action, least_left, least_left)


def fault_ages_shift(then: ClockMark | None, now: ClockMark) -> float:
    """Seconds to add to an earlier run's epoch times of counted faults so that
    they read on this run's wall clock, assuming the least time passed (the
    worst for what the Horde counts: each fault as recent as it can be).

    0 for a file without a mark. A wall clock set back between runs gives a
    positive shift (the faults are not made older by it).
    """
    if then is None:
        return 0.0
    least, _ = elapsed_bounds(then, now)
    return (now.wall - then.wall) - least


def known_not_taken(status: int, sent: bool | None) -> bool:
    """True when a failed submit is known not to have been taken by the Horde:
    the connection was refused or never made (``sent`` False), or the answer
    was 429 or 503 (the Horde, or the proxy before it, did not take it). A
    fault that failed so may be sent again; after any other failure (no
    answer in time, a connection lost after the request went out, another
    5xx) it may have been counted, and is not sent again."""
    return sent is False or status in NOT_TAKEN_STATUSES


def next_start_plan(terminal: str | None) -> str:
    """What the next start does with a job this process leaves, in a log line's words.

    ``terminal`` is the job's terminal-action state in the journal
    (:data:`TERMINAL_STATES`), None when the journal does not hold the job
    (crash recovery off). The words follow the restart's rules above:

    - ``"reply_kept"``, ``"reply_sent"``: ``"left to the next start, which sends
      the reply again"``;
    - ``"none"``: ``"left to the next start, which faults it while its lease runs"``;
    - ``"fault_sent"``: ``"a fault may have reached the Horde; none is sent again"``;
    - None: ``"not in a journal: nothing is sent; its lease runs out on the Horde"``.

    Raises ValueError for any other state.
    """
    if terminal is None:
        return "not in a journal: nothing is sent; its lease runs out on the Horde"
    if terminal in REPLY_STATES:
        return "left to the next start, which sends the reply again"
    if terminal == "none":
        return "left to the next start, which faults it while its lease runs"
    if terminal == "fault_sent":
        return "a fault may have reached the Horde; none is sent again"
    raise ValueError(f"not a terminal-action state: {terminal!r}")
