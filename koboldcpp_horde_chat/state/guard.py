"""Sliding-hour counters that keep an unattended worker out of the Horde's
maintenance (pure; the caller passes monotonic seconds).

* :class:`MaintenanceGuard` (seed "7. Fault a job": more than 20 aborted jobs
  an hour mean maintenance). It counts what the Horde counts as aborted
  (faults, expired leases, ``AbortedGen``, pops whose answer was lost) over
  an hour and a minute (never below the Horde's own count; the minute covers
  a submit in flight and clocks apart): at 15, chat jobs among them, chat is
  withdrawn; below 10 it is declared again; at 19 with the jobs in hand the
  worker stops popping. Faults for size count too: a narrower declaration
  would only turn away requests that fit.
* :class:`FailureStreak`: generations koboldcpp failed in a row, all kinds and
  per kind; at 3 the worker stops popping (or withdraws the kind) and probes.
* :class:`RefusalGuard` (seed "Submit refusals"): 3 refused replies in an
  hour withdraw that one declared name for its cool-off (1 h, doubled each
  time, at most 24 h); its faults count toward stopping the pops only.
  Refusals are attributed by the payload and the reply, never by message text.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal

from ..horde.codes import CHAT_SUBMIT_INVALID, CHAT_SUBMIT_NONCONFORMANT

HOUR_S: Final = 3600.0
HORDE_FAULT_LIMIT_PER_HOUR: Final = 20
"""More aborted jobs than this in an hour put a worker into maintenance."""
WITHDRAW_CHAT_AT: Final = 15
RESTORE_CHAT_BELOW: Final = 10
STOP_POPPING_AT: Final = 19
"""One short of the Horde's 20: spare for a job no count can see (a pop in
flight when the process died)."""
COUNT_WINDOW_S: Final = HOUR_S + 60.0
FAILED_IN_A_ROW: Final = 3
REFUSALS_TO_WITHDRAW: Final = 3
FEATURE_COOL_OFF_S: Final = HOUR_S
FEATURE_COOL_OFF_MAX_S: Final = 24 * HOUR_S

Transition = Literal["withdraw", "restore"]


class MaintenanceGuard:
    """Counts the jobs the Horde counts as aborted over ``COUNT_WINDOW_S``:
    withdraw chat at ``WITHDRAW_CHAT_AT``, declare it again below
    ``RESTORE_CHAT_BELOW``, stop popping at ``STOP_POPPING_AT`` with the jobs in
    hand. Call :meth:`update` and :meth:`pop_allowed` before each pop."""

    def __init__(self) -> None:
        self._faults: deque[tuple[float, str | None, str | None]] = deque(
            maxlen=HORDE_FAULT_LIMIT_PER_HOUR * 4
        )
        self.chat_enabled = True

    def record_fault(self, now: float, kind: str | None = None, feature: str | None = None) -> None:
        """Count one aborted job; ``kind`` None (not known) is taken as possibly
        chat; one with a ``feature`` (its refused reply's declared name) does
        not count toward withdrawing chat. A pop whose answer was lost counts at
        the time its job would expire on the Horde (``now`` ahead of the clock)."""
        self._faults.append((now, kind, feature))
        if len(self._faults) > 1 and self._faults[-2][0] > now:  # kept in time order
            self._faults = deque(sorted(self._faults, key=lambda f: f[0]), self._faults.maxlen)

    def recent(self, now: float) -> int:
        """Counted aborts in the last window (at most 80); forgets the older ones."""
        while self._faults and now - self._faults[0][0] >= COUNT_WINDOW_S:
            self._faults.popleft()
        return len(self._faults)

    def chat_recent(self, now: float) -> int:
        """Counted aborts not attributed to one feature."""
        self.recent(now)
        return sum(1 for _, _, feature in self._faults if feature is None)

    def update(self, now: float) -> Transition | None:
        """``"withdraw"``, ``"restore"`` or None for the next pop; updates
        :attr:`chat_enabled`. Withdrawal needs chat jobs among the counted."""
        recent = self.chat_recent(now)
        chat_failed = any(kind != "text" for _, kind, feature in self._faults if feature is None)
        if self.chat_enabled and recent >= WITHDRAW_CHAT_AT and chat_failed:
            self.chat_enabled = False
            return "withdraw"
        if not self.chat_enabled and recent < RESTORE_CHAT_BELOW:
            self.chat_enabled = True
            return "restore"
        return None

    def pop_allowed(self, now: float, in_hand: int = 0) -> bool:
        """The counted aborts plus the jobs in hand stay below ``STOP_POPPING_AT``."""
        return self.recent(now) + in_hand < STOP_POPPING_AT

    def resume_at(self, now: float, in_hand: int = 0) -> float:
        """When :meth:`pop_allowed` becomes true if nothing more is counted."""
        excess = self.recent(now) + in_hand - STOP_POPPING_AT + 1
        if excess <= 0:
            return now
        if excess > len(self._faults):  # only jobs in hand ending can allow it
            return now + COUNT_WINDOW_S
        return self._faults[excess - 1][0] + COUNT_WINDOW_S


class FailureStreak:
    """Generations koboldcpp failed in a row, all kinds together and per kind.
    A success ends the streak of all kinds and its own kind's only, so a
    koboldcpp failing only chat reaches :meth:`kind_failing` for chat."""

    def __init__(self, limit: int = FAILED_IN_A_ROW) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self.count = 0
        self._by_kind: dict[str, int] = {"text": 0, "chat": 0}

    @property
    def failing(self) -> bool:
        return self.count >= self.limit

    def kind_failing(self, kind: str) -> bool:
        return self._by_kind.get(kind, 0) >= self.limit

    def failed(self, kind: str | None = None) -> bool:
        """Count a failed generation; True when it reaches the limit of its kind
        (no kind: of all kinds)."""
        self.count += 1
        if kind in self._by_kind:
            self._by_kind[kind] += 1
            return self._by_kind[kind] == self.limit
        return self.count == self.limit

    def probation(self, kind: str | None = None) -> None:
        """A probe of ``kind`` (None: all kinds) generated: one more failure
        withdraws it again."""
        if kind in self._by_kind:
            self._by_kind[kind] = max(self._by_kind[kind], self.limit - 1)
        else:
            self.count = max(self.count, self.limit - 1)

    def succeeded(self, kind: str | None = None) -> bool:
        """True when this ends a streak at the limit of its kind (no kind: of all)."""
        was = self.failing
        self.count = 0
        if kind in self._by_kind:
            was = self.kind_failing(kind)
            self._by_kind[kind] = 0
        return was


def refusal_features(payload: Mapping[str, Any], declared: Iterable[str]) -> list[str]:
    """The ``declared`` names a ``ChatSubmitNonconformant`` refusal of this job
    points at: for ``tool_choice``/``tools``, ``"tool_choice_enforced"`` else
    ``"tools"``; for a ``json_object``/``json_schema`` response format,
    ``"structured_output_enforced"`` else that type. The guarantee is preferred:
    withdrawing it keeps the best_effort requests (seed "Submit refusals")."""
    names = set(declared)
    preferred: list[tuple[str, ...]] = []  # per point: the names it may mean, best first
    if "tool_choice" in payload or "tools" in payload:
        preferred.append(("tool_choice_enforced", "tools"))
    response_format = payload.get("response_format")
    rf_type = response_format.get("type") if isinstance(response_format, Mapping) else None
    if rf_type in ("json_object", "json_schema"):
        preferred.append(("structured_output_enforced", str(rf_type)))
    picks = (next((n for n in options if n in names), None) for options in preferred)
    return [pick for pick in picks if pick is not None]


def refused_reply_features(
    rc: str, payload: Mapping[str, Any], reply: Mapping[str, Any], declared: Iterable[str]
) -> list[str]:
    """The declared names the Horde's refusal ``rc`` of a chat ``reply`` points
    at: :func:`refusal_features` for ``ChatSubmitNonconformant``; ``"tools"``
    for ``ChatSubmitInvalid`` of a reply that made tool calls (the model's calls
    failed, not chat); nothing otherwise."""
    if rc == CHAT_SUBMIT_NONCONFORMANT:
        return refusal_features(payload, declared)
    if rc == CHAT_SUBMIT_INVALID and "tools" in payload and "tools" in set(declared):
        message = reply.get("message")
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if isinstance(calls, list) and calls:
            return ["tools"]
    return []


class RefusalGuard:
    """Refused replies per declared name: ``REFUSALS_TO_WITHDRAW`` within an hour
    withdraw the name for ``FEATURE_COOL_OFF_S``, doubled at each later
    withdrawal up to ``FEATURE_COOL_OFF_MAX_S``."""

    def __init__(self) -> None:
        self._refused: dict[str, deque[float]] = {}  # per name: its last refusals' times
        self._until: dict[str, float] = {}
        self._times: dict[str, int] = {}
        self.withdrawn: frozenset[str] = frozenset()

    def record(self, names: Iterable[str], now: float) -> list[str]:
        """Count one refusal against each of ``names``; returns those it withdraws."""
        newly: list[str] = []
        for name in dict.fromkeys(names):
            if name in self.withdrawn:
                continue
            refused = self._refused.setdefault(name, deque(maxlen=REFUSALS_TO_WITHDRAW))
            refused.append(now)
            if self.count(name, now) >= REFUSALS_TO_WITHDRAW:
                newly.append(name)
                refused.clear()
                times = self._times.get(name, 0)
                self._times[name] = times + 1
                cool_off = min(FEATURE_COOL_OFF_S * 2**min(times, 32), FEATURE_COOL_OFF_MAX_S)
                self._until[name] = now + cool_off
        if newly:
            self.withdrawn = self.withdrawn | frozenset(newly)
        return newly

    def until(self, name: str) -> float | None:
        """When a withdrawn ``name`` is declared again; None when not withdrawn."""
        return self._until.get(name) if name in self.withdrawn else None

    def restore_due(self, now: float) -> list[str]:
        """The withdrawn names whose cool-off ended, declared again from now (sorted)."""
        due = sorted(n for n in self.withdrawn if self._until.get(n, now) <= now)
        if due:
            self.withdrawn = self.withdrawn - frozenset(due)
        return due

    def count(self, name: str, now: float) -> int:
        """Refusals of ``name`` within the last hour (0 once withdrawn)."""
        return sum(now - at < HOUR_S for at in self._refused.get(name, ()))
