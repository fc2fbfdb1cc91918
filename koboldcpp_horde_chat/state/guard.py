"""Sliding-hour counters that keep an unattended worker out of trouble (pure; no I/O).

Two guards, each fed plain numbers by the worker (``state/shared.py``) with the clock passed in
(monotonic seconds), so they can be tested without waiting an hour:

* :class:`MaintenanceGuard` (seed step 7, "7. Fault a job"): the Horde puts a
  worker that aborts more than 20 jobs in an hour into maintenance, so "a
  worker that faults every chat job should withdraw its chat declaration
  instead". The guard counts every job the Horde counts as aborted (a fault,
  an expired lease, a submit answered ``AbortedGen``, a pop abandoned at a
  stop) over the last hour and a minute (:data:`COUNT_WINDOW_S`); at 15, when
  chat jobs are among them, it says to withdraw the chat declaration (text
  jobs go on), and once fewer than 10 remain it says to declare chat again.
  With :data:`STOP_POPPING_AT` counted, jobs in hand included (each may still
  become one), it says to stop popping until the window allows one more
  (:meth:`MaintenanceGuard.pop_allowed`, :meth:`MaintenanceGuard.resume_at`).
  A pop whose answer was lost (sent, but no answer came: a timeout, a reset,
  a 5xx) may have been assigned a job the worker never sees, which expires
  on the Horde: it is counted at once and until a window after the Horde
  would expire it (:meth:`MaintenanceGuard.record_lost_pop`).

  The Horde's own window (``log_aborted_job`` in the real Horde's
  ``horde/classes/base/worker.py``) starts at an aborted job that comes more
  than an hour after the window began (or at the worker's creation) and counts
  until the next such job: it always lies within the last hour, so a count
  over the last hour is never below the Horde's. The extra minute covers the
  time between the worker's count and the Horde's (a fault's submit in
  flight, clocks apart).

  What fails for time is narrowed instead (``state.lease_fit``: the
  declared ``max_length``); what fails for size is not. A chat job faulted
  ``prompt_overflow`` did not fit the job's own ``max_context_length``
  (seed step 3), a budget the Horde keeps within the declared
  ``chat_limits.max_context_length`` (seed step 2): a narrower declaration
  would only turn away requests that fit (or, where the Horde fills in the
  declared value for a request without one, shrink its budget), never keep a
  conversation from overflowing its own. Such faults count here toward the
  chat withdrawal. koboldcpp
  cuts the front of a text prompt too long for its context rather than
  refusing it, so a text job never fails for size.
* :class:`FailureStreak`: generations koboldcpp failed in a row; at
  :data:`FAILED_IN_A_ROW` the worker stops popping and probes koboldcpp with a
  small generation until one succeeds, instead of faulting every job it pops.
  It counts per kind too: at :data:`FAILED_IN_A_ROW` failed generations of one
  kind in a row (a koboldcpp that fails only chat completions, its text
  generations interleaved and succeeding) the worker withdraws that kind
  (chat: pops without the chat declaration; text: pops with
  ``prompt_jobs: false`` when chat is still declared, else not at all) and
  probes that kind until it generates again (``service.gate``).
* :class:`RefusalGuard` (seed "Submit refusals"): "withdraw a guarantee that
  the backend repeatedly fails to satisfy". It counts the Horde's refusals of
  replies per declared guarantee or feature (:func:`refused_reply_features`:
  ``ChatSubmitNonconformant`` for what the request used,
  ``ChatSubmitInvalid`` for the tool calls a reply made, such as a small
  model's call to a function the request did not offer) over the last hour;
  at 3 it withdraws that name alone from ``chat_features`` for its cool-off
  (:data:`FEATURE_COOL_OFF_S`, doubled each time the same name is withdrawn
  again, at most :data:`FEATURE_COOL_OFF_MAX_S`), while plain chat goes on;
  then the name is declared again and the requests that need it test the
  backend anew. A name that keeps failing so costs at most 3 refused replies
  per cool-off. The faults that follow those refusals are still aborted jobs
  for the Horde (after ``ChatSubmitInvalid``), so they count toward stopping
  the pops (:meth:`MaintenanceGuard.pop_allowed`), but not toward withdrawing
  chat as a whole (:meth:`MaintenanceGuard.update`): that is the one feature
  failing, withdrawn alone.

:func:`refusal_features` attributes a ``ChatSubmitNonconformant`` refusal to
the names the job's request used (``tool_choice``/``tools`` and
``response_format``), by the payload only, never by the refusal's message text;
:func:`refused_reply_features` adds ``ChatSubmitInvalid``, attributed to
``tools`` by the refused reply's own tool calls.

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
STOP_POPPING_AT: Final = 19
"""Counted aborts (jobs in hand and pops whose answer was lost included) at which
the worker stops popping: one short of the Horde's 20, spare for a job no count
can see (a pop in flight when the process died), so the 21st is never reached."""
COUNT_WINDOW_S: Final = HOUR_S + 60.0
"""The window aborted jobs are counted over, seconds: the Horde's hour and a minute."""
FAILED_IN_A_ROW: Final = 3
"""Generations failed in a row after which the worker stops popping and probes koboldcpp."""
REFUSALS_TO_WITHDRAW: Final = 3
"""Refused replies in an hour that withdraw the guarantee or feature they point at."""
FEATURE_COOL_OFF_S: Final = HOUR_S
"""How long a name withdrawn for its refused replies stays withdrawn the first
time, seconds; each later withdrawal of the same name doubles it."""
FEATURE_COOL_OFF_MAX_S: Final = 24 * HOUR_S
"""The longest cool-off of a withdrawn name, seconds."""

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
    """Count the jobs the Horde counts as aborted; withdraw chat, then stop popping,
    before its 20 an hour.

    Call :meth:`record_fault` for each job the Horde counts as aborted (a fault
    other than one that follows a ``ChatSubmitNonconformant`` refusal, which
    the Horde counts apart; an expired lease; a submit answered
    ``AbortedGen``), then :meth:`update` and :meth:`pop_allowed` before each pop.

    Args:
        withdraw_at: counted aborts in the window at which chat is withdrawn (15).
        restore_below: chat is declared again below this many (10).
        window_s: the window, seconds (:data:`COUNT_WINDOW_S`).
        stop_at: counted aborts, jobs in hand included, at which popping stops (19).

    Attributes:
        chat_enabled: whether the next pop should declare chat.
    """

    def __init__(
        self,
        *,
        withdraw_at: int = WITHDRAW_CHAT_AT,
        restore_below: int = RESTORE_CHAT_BELOW,
        window_s: float = COUNT_WINDOW_S,
        stop_at: int = STOP_POPPING_AT,
    ) -> None:
        if not 0 < restore_below <= withdraw_at:
            raise ValueError("need 0 < restore_below <= withdraw_at")
        if stop_at < 1 or not window_s > 0:
            raise ValueError("need stop_at >= 1 and a positive window_s")
        self.withdraw_at = withdraw_at
        self.restore_below = restore_below
        self.stop_at = stop_at
        self.window_s = float(window_s)
        self._faults: deque[tuple[float, str | None, str | None]] = deque(
            maxlen=HORDE_FAULT_LIMIT_PER_HOUR * 4
        )
        self.chat_enabled = True

    def record_fault(self, now: float, kind: str | None = None, feature: str | None = None) -> None:
        """Count one aborted job at ``now``; ``kind`` is the job's (None: not known,
        as for a fault kept from an earlier run, taken as possibly chat);
        ``feature`` the declared name its refused reply pointed at
        (:func:`refused_reply_features`; :class:`RefusalGuard` withdraws that
        name alone, so it does not count toward withdrawing chat)."""
        self._add(now, kind, feature)

    def record_lost_pop(self, expires_at: float, kind: str | None = None) -> None:
        """Count a pop whose answer was lost: the Horde may have assigned it a job
        that expires there at ``expires_at`` (the caller's clock, later than
        now), an aborted job the worker never sees. Counted from now until a
        window after ``expires_at``; ``kind`` is ``"text"`` when the pop did not
        declare chat, else None."""
        self._add(expires_at, kind)

    def _add(self, at: float, kind: str | None, feature: str | None = None) -> None:
        """Keep the counted times in order (a lost pop's lies ahead of now)."""
        self._faults.append((at, kind, feature))
        if len(self._faults) < 2 or self._faults[-2][0] <= at:
            return
        ordered = sorted(self._faults, key=lambda fault: fault[0])
        self._faults.clear()
        self._faults.extend(ordered)

    def _forget(self, now: float) -> None:
        while self._faults and now - self._faults[0][0] >= self.window_s:
            self._faults.popleft()

    def recent(self, now: float) -> int:
        """Counted aborts in the last window (at most 80)."""
        self._forget(now)
        return len(self._faults)

    def chat_recent(self, now: float) -> int:
        """Counted aborts in the last window that chat as a whole answers for:
        those not attributed to one feature."""
        self._forget(now)
        return sum(1 for _, _, feature in self._faults if feature is None)

    def update(self, now: float) -> Transition | None:
        """Decide the declaration for the next pop.

        Returns ``"withdraw"`` when chat was enabled and ``withdraw_at`` counted
        aborts not attributed to one feature (:meth:`chat_recent`) are in the
        window, chat jobs among them (chat fails too), ``"restore"`` when it was
        withdrawn and fewer than ``restore_below`` of them remain, else None.
        :attr:`chat_enabled` follows.
        """
        recent = self.chat_recent(now)
        chat_failed = any(
            kind != "text" for _, kind, feature in self._faults if feature is None
        )
        if self.chat_enabled and recent >= self.withdraw_at and chat_failed:
            self.chat_enabled = False
            return "withdraw"
        if not self.chat_enabled and recent < self.restore_below:
            self.chat_enabled = True
            return "restore"
        return None

    def pop_allowed(self, now: float, in_hand: int = 0) -> bool:
        """Whether one more job may be popped: the counted aborts plus the
        ``in_hand`` jobs (each may still become one) stay below ``stop_at``."""
        return self.recent(now) + in_hand < self.stop_at

    def resume_at(self, now: float, in_hand: int = 0) -> float:
        """When :meth:`pop_allowed` becomes true again if nothing more is counted
        and ``in_hand`` jobs remain (clock of ``now``); ``now`` when it already is."""
        self._forget(now)
        excess = len(self._faults) + in_hand - self.stop_at + 1
        if excess <= 0:
            return now
        if excess > len(self._faults):  # only jobs in hand ending can allow it
            return now + self.window_s
        return self._faults[excess - 1][0] + self.window_s


class FailureStreak:
    """Generations koboldcpp failed in a row (an error, a crash, a hang), all
    kinds together and per kind (``"text"``, ``"chat"``).

    Call :meth:`failed` for each job whose generation koboldcpp failed and
    :meth:`succeeded` for each it answered (or a probe it answered), with the
    job's kind. A success ends the streak of all kinds together and the one of
    its own kind, not the other kind's: a koboldcpp that fails every chat
    completion while its text generations succeed reaches :meth:`kind_failing`
    for chat though the streak of all kinds keeps being ended by text jobs.

    Args:
        limit: failures in a row after which :attr:`failing` (all kinds) or
            :meth:`kind_failing` (one kind) is True (3).
    """

    def __init__(self, limit: int = FAILED_IN_A_ROW) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self.count = 0
        self._by_kind: dict[str, int] = {"text": 0, "chat": 0}

    @property
    def failing(self) -> bool:
        """``limit`` generations failed in a row: stop popping, probe koboldcpp."""
        return self.count >= self.limit

    def kind_failing(self, kind: str) -> bool:
        """``limit`` generations of ``kind`` failed in a row: withdraw that kind,
        probe it."""
        return self._by_kind.get(kind, 0) >= self.limit

    def failed(self, kind: str | None = None) -> bool:
        """Count a failed generation (of ``kind``, when known); True when this one
        makes the streak of its kind :meth:`kind_failing` (with no kind: the
        streak of all kinds :attr:`failing`)."""
        self.count += 1
        if kind in self._by_kind:
            self._by_kind[kind] += 1
            return self._by_kind[kind] == self.limit
        return self.count == self.limit

    def probation(self, kind: str | None = None) -> None:
        """A probe of ``kind`` (None: of all kinds together) generated after a
        withdrawal: one more failure in a row withdraws it again (its count is
        ``limit - 1``), not ``limit`` more."""
        if kind in self._by_kind:
            self._by_kind[kind] = max(self._by_kind[kind], self.limit - 1)
        else:
            self.count = max(self.count, self.limit - 1)

    def succeeded(self, kind: str | None = None) -> bool:
        """A generation (of ``kind``, when known) succeeded; True when this ends a
        :meth:`kind_failing` streak of that kind (with no kind: a
        :attr:`failing` streak of all kinds)."""
        was = self.failing
        self.count = 0
        if kind in self._by_kind:
            was = self.kind_failing(kind)
            self._by_kind[kind] = 0
        return was


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


def refused_reply_features(
    rc: str,
    payload: Mapping[str, Any],
    reply: Mapping[str, Any],
    declared: Iterable[str],
) -> list[str]:
    """The declared names the Horde's refusal (``rc``) of a chat ``reply`` (the
    structured submit it refused) points at.

    * ``ChatSubmitNonconformant``: :func:`refusal_features` (what the request used);
    * ``ChatSubmitInvalid`` for a reply that made tool calls to a request that
      offered tools: ``"tools"`` when declared. The Horde refuses a call to a
      function the request did not offer, or two calls with one id, under
      either conformance mode (seed "Submit refusals"): the model's calls
      failed, not chat. Any other ``ChatSubmitInvalid`` (a reply without a
      valid message, say) and ``ChatModelMismatch`` point at no name.

    Attributed by the payload and the reply, never by the refusal's message text.
    """
    if rc == "ChatSubmitNonconformant":
        return refusal_features(payload, declared)
    if rc == "ChatSubmitInvalid" and "tools" in payload and "tools" in set(declared):
        message = reply.get("message")
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if isinstance(calls, list) and calls:
            return ["tools"]
    return []


class RefusalGuard:
    """Count refused replies per declared name; withdraw a name at the threshold,
    for its cool-off.

    Args:
        threshold: refusals within the window that withdraw a name (3).
        window_s: the window, seconds (3600).
        cool_off_s: how long a name is withdrawn the first time, seconds
            (:data:`FEATURE_COOL_OFF_S`); doubled at each later withdrawal of
            the same name, up to ``max_cool_off_s``.

    Attributes:
        withdrawn: the names withdrawn now (until :meth:`restore_due` says
            their cool-off ended).
    """

    def __init__(
        self,
        *,
        threshold: int = REFUSALS_TO_WITHDRAW,
        window_s: float = HOUR_S,
        cool_off_s: float = FEATURE_COOL_OFF_S,
        max_cool_off_s: float = FEATURE_COOL_OFF_MAX_S,
    ) -> None:
        if threshold < 1:
            raise ValueError("threshold must be at least 1")
        if not 0 < cool_off_s <= max_cool_off_s:
            raise ValueError("need 0 < cool_off_s <= max_cool_off_s")
        self.threshold = threshold
        self.window_s = window_s
        self.cool_off_s = cool_off_s
        self.max_cool_off_s = max_cool_off_s
        self._windows: dict[str, SlidingWindow] = {}
        self._until: dict[str, float] = {}
        self._times: dict[str, int] = {}
        self.withdrawn: frozenset[str] = frozenset()

    def record(self, names: Iterable[str], now: float) -> list[str]:
        """Count one refusal against each of ``names`` at ``now``.

        Returns the names this refusal withdraws (reaching ``threshold``
        refusals within the window), in the order given; empty otherwise.
        Each stays withdrawn until :meth:`until` says.
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
                times = self._times.get(name, 0)
                self._times[name] = times + 1
                cool_off = min(self.cool_off_s * 2**min(times, 32), self.max_cool_off_s)
                self._until[name] = now + cool_off
        if newly:
            self.withdrawn = self.withdrawn | frozenset(newly)
        return newly

    def until(self, name: str) -> float | None:
        """When a withdrawn ``name`` is declared again (the clock of ``record``'s
        ``now``); None when it is not withdrawn."""
        return self._until.get(name) if name in self.withdrawn else None

    def restore_due(self, now: float) -> list[str]:
        """The withdrawn names whose cool-off ended by ``now``, declared again from
        now on (sorted); empty when none."""
        due = sorted(n for n in self.withdrawn if self._until.get(n, now) <= now)
        if due:
            self.withdrawn = self.withdrawn - frozenset(due)
        return due

    def count(self, name: str, now: float) -> int:
        """Refusals of ``name`` within the window (0 once withdrawn)."""
        window = self._windows.get(name)
        return 0 if window is None else window.count(now)
