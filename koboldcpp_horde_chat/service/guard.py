"""Sliding-hour counters that keep an unattended worker out of trouble (pure; no I/O).

Two guards, each fed plain numbers by the worker (``service/state.py``) with the clock passed in
(monotonic seconds), so they can be tested without waiting an hour:

* :class:`MaintenanceGuard` (seed step 7, "7. Fault a job"): the Horde puts a
  worker that aborts more than 20 jobs in an hour into maintenance, so "a
  worker that faults every chat job should withdraw its chat declaration
  instead". The guard counts this worker's faults over the last hour; at 15
  it says to withdraw the chat declaration (text jobs go on), and once fewer
  than 10 remain in the hour it says to declare chat again.
* :class:`RefusalGuard` (seed "Submit refusals"): "withdraw a guarantee that
  the backend repeatedly fails to satisfy". It counts the Horde's
  ``ChatSubmitNonconformant`` refusals per declared guarantee or feature over
  the last hour; at 3 it withdraws that name from ``chat_features``. A
  withdrawal lasts until the worker restarts: once withdrawn, no request that
  needs the name reaches the worker, so a quiet hour would prove nothing about
  the backend, which is what broke the guarantee. Restart the worker after
  fixing the model, its chat template or koboldcpp to declare it again.

:func:`refusal_features` attributes a refusal to the names the job's request
used (``tool_choice``/``tools`` and ``response_format``), by the payload only,
never by the refusal's message text.

Every structure here is bounded: a window keeps at most ``maxlen`` times, and
the refusal counters exist only for the names :func:`refusal_features` can
return.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal

HOUR_S: Final = 3600.0
HORDE_FAULT_LIMIT_PER_HOUR: Final = 20
"""The Horde puts a worker that aborts more than this many jobs in an hour into maintenance."""
WITHDRAW_CHAT_AT: Final = 15
"""Faults in the last hour at which the chat declaration is withdrawn (5 short of the limit)."""
RESTORE_CHAT_BELOW: Final = 10
"""Chat is declared again once fewer faults than this remain in the last hour."""
REFUSALS_TO_WITHDRAW: Final = 3
"""``ChatSubmitNonconformant`` refusals in an hour that withdraw a guarantee or feature."""

TOOL_NAMES: Final = ("tool_choice_enforced", "tools")
"""What a tool-choice refusal is attributed to: the guarantee when declared, else the feature."""
FORMAT_GUARANTEE: Final = "structured_output_enforced"
FORMAT_TYPES: Final = ("json_object", "json_schema")

Transition = Literal["withdraw", "restore"]


class SlidingWindow:
    """Times of events within the last ``window_s`` seconds.

    Args:
        window_s: the window, seconds (> 0).
        maxlen: the most times kept; older ones are forgotten first, so
            :meth:`count` never exceeds it (keep it above any threshold used).

    Raises:
        ValueError: a non-positive window or ``maxlen``.
    """

    def __init__(self, window_s: float = HOUR_S, *, maxlen: int = 256) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, not {window_s!r}")
        if maxlen < 1:
            raise ValueError(f"maxlen must be at least 1, not {maxlen!r}")
        self.window_s = float(window_s)
        self._times: deque[float] = deque(maxlen=maxlen)

    def add(self, now: float) -> None:
        """Record one event at ``now`` (seconds on the caller's clock)."""
        self._times.append(now)

    def count(self, now: float) -> int:
        """Events in ``(now - window_s, now]``; forgets the older ones."""
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        return len(self._times)

    def clear(self) -> None:
        """Forget every event."""
        self._times.clear()


class MaintenanceGuard:
    """Withdraw the chat declaration before the Horde's 20 aborted jobs an hour.

    Call :meth:`record_fault` for each fault the Horde counts as an aborted
    job (not a fault that follows a ``ChatSubmitNonconformant`` refusal, which
    the Horde counts apart, and not a job the Horde ended itself), then
    :meth:`update` before each pop.

    Args:
        withdraw_at: faults in the window at which chat is withdrawn (15).
        restore_below: chat is declared again below this many (10).
        window_s: the window, seconds (3600).

    Attributes:
        chat_enabled: whether the next pop should declare chat.
    """

    def __init__(
        self,
        *,
        withdraw_at: int = WITHDRAW_CHAT_AT,
        restore_below: int = RESTORE_CHAT_BELOW,
        window_s: float = HOUR_S,
    ) -> None:
        if not 0 < restore_below <= withdraw_at:
            raise ValueError("need 0 < restore_below <= withdraw_at")
        self.withdraw_at = withdraw_at
        self.restore_below = restore_below
        self._faults = SlidingWindow(window_s, maxlen=HORDE_FAULT_LIMIT_PER_HOUR * 4)
        self.chat_enabled = True

    def record_fault(self, now: float) -> None:
        """Count one fault at ``now``."""
        self._faults.add(now)

    def recent(self, now: float) -> int:
        """Faults in the last window (at most 80)."""
        return self._faults.count(now)

    def update(self, now: float) -> Transition | None:
        """Decide the declaration for the next pop.

        Returns ``"withdraw"`` when chat was enabled and ``withdraw_at`` faults
        are in the window, ``"restore"`` when it was withdrawn and fewer than
        ``restore_below`` remain, else None. :attr:`chat_enabled` follows.
        """
        recent = self.recent(now)
        if self.chat_enabled and recent >= self.withdraw_at:
            self.chat_enabled = False
            return "withdraw"
        if not self.chat_enabled and recent < self.restore_below:
            self.chat_enabled = True
            return "restore"
        return None


def refusal_features(payload: Mapping[str, Any], declared: Iterable[str]) -> list[str]:
    """The declared names a ``ChatSubmitNonconformant`` refusal of this job points at.

    Args:
        payload: the popped job's ``payload`` (a JSON object).
        declared: the ``chat_features`` of the pop that received the job.

    Returns:
        Names in this order, each at most once:

        * when the payload has ``tool_choice`` or ``tools``:
          ``"tool_choice_enforced"`` if declared, else ``"tools"`` if declared;
        * when ``response_format.type`` is ``json_object`` or ``json_schema``:
          ``"structured_output_enforced"`` if declared, else that type if declared.

        An empty list when the refusal cannot be attributed (the caller logs it).
        A guarantee is preferred to the feature: withdrawing it still leaves the
        worker the best_effort requests that use the feature.

    Seed: "Submit refusals" (the refusal reasons) and "Features and guarantees".
    """
    names = set(declared)
    found: list[str] = []
    if "tool_choice" in payload or "tools" in payload:
        pick = next((n for n in TOOL_NAMES if n in names), None)
        if pick is not None:
            found.append(pick)
    response_format = payload.get("response_format")
    rf_type = response_format.get("type") if isinstance(response_format, Mapping) else None
    if rf_type in FORMAT_TYPES:
        if FORMAT_GUARANTEE in names:
            found.append(FORMAT_GUARANTEE)
        elif rf_type in names:
            found.append(str(rf_type))
    return found


class RefusalGuard:
    """Count ``ChatSubmitNonconformant`` refusals per name; withdraw a name at the threshold.

    Args:
        threshold: refusals within the window that withdraw a name (3).
        window_s: the window, seconds (3600).

    Attributes:
        withdrawn: the names withdrawn so far; they stay withdrawn until the
            worker restarts (see the module docstring for why).
    """

    def __init__(
        self, *, threshold: int = REFUSALS_TO_WITHDRAW, window_s: float = HOUR_S
    ) -> None:
        if threshold < 1:
            raise ValueError("threshold must be at least 1")
        self.threshold = threshold
        self.window_s = window_s
        self._windows: dict[str, SlidingWindow] = {}
        self.withdrawn: frozenset[str] = frozenset()

    def record(self, names: Iterable[str], now: float) -> list[str]:
        """Count one refusal against each of ``names`` at ``now``.

        Returns the names this refusal withdraws (reaching ``threshold``
        refusals within the window), in the order given; empty otherwise.
        """
        newly: list[str] = []
        for name in dict.fromkeys(names):
            if name in self.withdrawn:
                continue
            window = self._windows.get(name)
            if window is None:
                window = self._windows[name] = SlidingWindow(
                    self.window_s, maxlen=self.threshold + 1
                )
            window.add(now)
            if window.count(now) >= self.threshold:
                newly.append(name)
                window.clear()
        if newly:
            self.withdrawn = self.withdrawn | frozenset(newly)
        return newly

    def count(self, name: str, now: float) -> int:
        """Refusals of ``name`` within the window (0 once withdrawn)."""
        window = self._windows.get(name)
        return 0 if window is None else window.count(now)
