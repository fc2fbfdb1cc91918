"""A declared ``max_length`` that koboldcpp generates within the job's lease (pure; no I/O).

Seed "Streaming progress": "The job's lease is the pop's ttl, 150 seconds"
and "A job without progress keeps the base lease"; "The pop prefers workers
with enough measured capacity to generate max_length within 120 seconds" and
"a slower worker without progress can lose the job when the lease expires".
A lost job is an aborted job on the Horde (its ``log_aborted_job``), and more
than 20 in its hour put the worker into maintenance.

:class:`LeaseFit` measures koboldcpp's speed from the worker's own jobs, per
kind (``"text"``, ``"chat"``): tokens of the reply over the seconds from the
job's start to koboldcpp's answer (prompt processing included, so the
figure is on the safe side). It declares, per kind, the largest
``max_length`` that this speed generates within :data:`FIT_SHARE` of the
base lease (120 s of 150 s), never above the operator's ``--hordegenlen``
(the ``cap``). Before the first measured job it uses koboldcpp's own figure
(``/api/extra/perf`` ``last_eval_speed``) when koboldcpp has one.

A job whose generation ran out of its lease gives no speed; it narrows that
kind's ``max_length`` to half the job's own (and to what the speed it
cannot have beaten allows), so the next job is smaller whatever was measured
before.

A lowered ``max_length`` comes back when koboldcpp is faster again, also when
no job of that kind arrives to show it (the requests that wait ask for more
than is declared, so the Horde skips them). The rule: a kind declared below
the cap that has had no measured job for its *cool-off* (:data:`RECHECK_AFTER_S`,
60 s, at first) is due a re-measure (:meth:`LeaseFit.recheck_due`): the worker
times a short generation of its own (``service.gate``) and
:meth:`LeaseFit.remeasured` refits the kind from that speed alone (the kind's
older measurements are forgotten: they were taken while it was slower). The
cool-off doubles, up to :data:`RECHECK_MAX_S` (30 min), after each re-measure
that raises nothing (koboldcpp really is that slow) and after each run-out
that comes within :data:`HOUR_S` of a raise (the speed a raise trusted did
not hold), so a koboldcpp that stays slow is neither probed every minute nor
lets a raise cost an aborted job every few minutes (each counts toward the
Horde's maintenance). It is back to 60 s once the kind is declared at the cap.

Every change of a declared ``max_length`` is returned as one
:class:`LengthChange`, which the caller logs.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

KINDS: Final = ("text", "chat")
FIT_SHARE: Final = 0.8
"""The share of a job's base lease its generation may take (120 s of the 150 s ttl)."""
MIN_MAX_LENGTH: Final = 16
"""The smallest ``max_length`` declared, tokens (below it a reply says too little)."""
STEP: Final = 16
"""A fitted ``max_length`` is a multiple of this many tokens (steady declarations)."""
RAISE_FACTOR: Final = 1.25
"""A lowered ``max_length`` is raised only once the fit is this much larger (or reaches the cap)."""
MIN_SAMPLE_TOKENS: Final = 16
"""A reply shorter than this, tokens, says too little about the speed to be measured."""
SAMPLES_KEPT: Final = 8
"""The most recent measured jobs the speed is averaged over, per kind."""
RECHECK_AFTER_S: Final = 60.0
"""A kind declared below the cap is re-measured after this many seconds without
a measured job, at first (its cool-off; see the module docstring)."""
RECHECK_MAX_S: Final = 1800.0
"""The longest cool-off, seconds."""
HOUR_S: Final = 3600.0
"""A run-out this soon after a raise doubles the kind's cool-off, seconds."""


@dataclass(frozen=True)
class LengthChange:
    """A changed declaration: ``kind``'s ``max_length`` went from ``old`` to ``new``.

    Attributes:
        kind: ``"text"`` or ``"chat"``.
        old, new: the declared ``max_length`` before and after, tokens.
        tokens_per_s: the measured speed behind it, or None (a job ran out of its lease).
        budget_s: the seconds a job's generation may take (:func:`budget_s`).
    """

    kind: str
    old: int
    new: int
    tokens_per_s: float | None
    budget_s: float

    remeasured: bool = False
    """True when the speed is a re-measure of an idle kind (:meth:`LeaseFit.remeasured`)."""

    def line(self) -> str:
        """The one log line for the change, e.g. ``"max_length for text jobs lowered
        from 512 to 112: koboldcpp generates 1.0 tokens/s here, and a job's generation
        must end within 120 s of its lease"``; a re-measure says ``"koboldcpp
        generates 40.0 tokens/s here again (measured with a short generation of its
        own), ..."``."""
        verb = "lowered" if self.new < self.old else "raised"
        if self.tokens_per_s is not None and self.remeasured:
            why = (
                f"koboldcpp generates {self.tokens_per_s:.1f} tokens/s here again (measured "
                f"with a short generation of the worker's own), and a job's generation "
                f"must end within {self.budget_s:.0f} s of its lease"
            )
        elif self.tokens_per_s is None:
            why = "a job's generation ran out of its lease"
        else:
            why = (
                f"koboldcpp generates {self.tokens_per_s:.1f} tokens/s here, and a job's "
                f"generation must end within {self.budget_s:.0f} s of its lease"
            )
        return f"max_length for {self.kind} jobs {verb} from {self.old} to {self.new}: {why}"


def tokens_of_text(text: str) -> int:
    """Tokens of a text reply as the Horde estimates them: ``ceil(chars / 4)``
    (its ``get_things_count``), at least 0."""
    return math.ceil(len(text) / 4)


def job_max_length(payload: Mapping[str, Any]) -> int:
    """A job payload's ``max_length``, tokens (0 when it has none that is valid)."""
    value = payload.get("max_length")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def reply_tokens(body: Mapping[str, Any]) -> int:
    """Tokens of a reply's submit body: ``completion_tokens`` when koboldcpp
    counted them (a chat reply), else the Horde's estimate of the reply's text
    (:func:`tokens_of_text` of the message's content and reasoning, or of the
    text job's ``generation``)."""
    counted = body.get("completion_tokens")
    if isinstance(counted, int) and not isinstance(counted, bool) and counted >= 0:
        return counted
    message = body.get("message")
    if isinstance(message, Mapping):
        text = "".join(str(message.get(key) or "") for key in ("content", "reasoning_content"))
        return tokens_of_text(text)
    return tokens_of_text(str(body.get("generation") or ""))


def budget_s(lease_s: float, margin_s: float = 0.0) -> float:
    """The seconds a generation may take in a ``lease_s`` lease: :data:`FIT_SHARE`
    of it, and no more than ``margin_s`` short of its end (the submit's margin):
    ``(150, 5) -> 120``, ``(20, 5) -> 15``."""
    return max(0.0, min(lease_s * FIT_SHARE, lease_s - margin_s))


def fitted_length(tokens_per_s: float, lease_s: float, cap: int, margin_s: float = 0.0) -> int:
    """The ``max_length`` generated within :func:`budget_s` of ``lease_s`` at ``tokens_per_s``.

    A multiple of :data:`STEP`, at least :data:`MIN_MAX_LENGTH` and at most
    ``cap`` (which wins when smaller): ``(1.0, 150, 512) -> 112``,
    ``(100.0, 150, 512) -> 512``.

    Raises:
        ValueError: a non-positive speed or lease.
    """
    if not (tokens_per_s > 0 and lease_s > 0):
        raise ValueError("tokens_per_s and lease_s must be positive")
    fit = int(tokens_per_s * budget_s(lease_s, margin_s)) // STEP * STEP
    return min(cap, max(MIN_MAX_LENGTH, fit))


def perf_speed(perf: Mapping[str, Any]) -> float | None:
    """koboldcpp's own measured generation speed from ``/api/extra/perf``, tokens/s.

    ``last_eval_speed`` once koboldcpp generated something (``total_gens`` > 0);
    None when it has no figure (a fresh koboldcpp answers 0) or the answer is
    not one.
    """
    gens = perf.get("total_gens")
    speed = perf.get("last_eval_speed")
    if isinstance(gens, bool) or not isinstance(gens, int) or gens <= 0:
        return None
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        return None
    return float(speed) if math.isfinite(speed) and speed > 0 else None


class LeaseFit:
    """The per-kind declared ``max_length`` that fits the lease (see the module docstring).

    Args:
        cap: the operator's ``max_length`` (``--hordegenlen`` as declared), tokens.
        lease_s: the base lease, seconds (the pop's ``ttl``; 150).
        margin_s: seconds before the lease's end the generation must be over
            (the submit's margin).

    Attributes:
        lease_s: the base lease the fit uses; :meth:`note_lease` updates it
            from each job's ``ttl``.
    """

    def __init__(self, cap: int, lease_s: float = 150.0, margin_s: float = 0.0) -> None:
        if cap < 1 or not lease_s > 0:
            raise ValueError("cap must be at least 1 and lease_s positive")
        self.cap = cap
        self.margin_s = margin_s
        self.lease_s = float(lease_s)
        self._declared = {kind: cap for kind in KINDS}
        self._samples: dict[str, deque[tuple[int, float]]] = {
            kind: deque(maxlen=SAMPLES_KEPT) for kind in KINDS
        }
        self._seed_speed: float | None = None
        #: Per kind: when it is due a re-measure (None: declared at the cap, or
        #: no clock given yet), its cool-off, and when it was last raised.
        self._recheck_at: dict[str, float | None] = {kind: None for kind in KINDS}
        self._cooloff = {kind: RECHECK_AFTER_S for kind in KINDS}
        self._raised_at: dict[str, float | None] = {kind: None for kind in KINDS}
        #: Why each kind is declared below the cap: ``"ran_out"``, ``"slow"`` or None.
        self._why: dict[str, str | None] = {kind: None for kind in KINDS}

    def lowered_because(self, kind: str) -> str | None:
        """Why ``kind``'s ``max_length`` is below the cap, in an operator's words
        (``"koboldcpp ran out of a lease"``, ``"koboldcpp's measured speed"``),
        or None while it is declared at the cap."""
        if self._declared[kind] >= self.cap:
            return None
        if self._why[kind] == "ran_out":
            return "koboldcpp ran out of a lease"
        return "koboldcpp's measured speed"

    def cooloff_s(self, kind: str) -> float:
        """``kind``'s cool-off: seconds without a measured job before a re-measure."""
        return self._cooloff[kind]

    def recheck_due(self, now: float) -> list[str]:
        """The kinds declared below the cap that are due a re-measure at ``now``
        (no measured job for their cool-off), in :data:`KINDS` order. A kind
        named here is not named again until :meth:`remeasured` or another
        measurement schedules it anew (at most one probe at a time)."""
        due = []
        for kind in KINDS:
            at = self._recheck_at[kind]
            if self._declared[kind] < self.cap and at is not None and at <= now:
                self._recheck_at[kind] = None
                due.append(kind)
        return due

    def remeasured(
        self, kind: str, tokens_per_s: float | None, now: float
    ) -> LengthChange | None:
        """A re-measure of ``kind`` (:meth:`recheck_due`) found ``tokens_per_s``
        (None: it failed): refit from that speed alone. No raise doubles the
        cool-off (up to :data:`RECHECK_MAX_S`). Returns the change it makes, or None."""
        change = None
        if tokens_per_s is not None and tokens_per_s > 0:
            self._samples[kind].clear()
            # One sample of a minute at that speed, so a job's own measure soon weighs in.
            self._samples[kind].append((max(1, round(tokens_per_s * 60.0)), 60.0))
            change = self._refit(kind, now=now, remeasured=True)
        if change is None or change.new <= change.old:
            self._cooloff[kind] = min(RECHECK_MAX_S, self._cooloff[kind] * 2)
        self._schedule(kind, now)
        return change

    def _schedule(self, kind: str, now: float | None) -> None:
        """The next re-measure of ``kind``: its cool-off after ``now`` while it is
        below the cap; none at the cap (and the cool-off back to its first)."""
        if self._declared[kind] >= self.cap:
            self._recheck_at[kind] = None
            self._cooloff[kind] = RECHECK_AFTER_S
            self._why[kind] = None
        elif now is not None:
            self._recheck_at[kind] = now + self._cooloff[kind]

    def declared(self, kind: str) -> int:
        """The ``max_length`` the next pop declares for ``kind``, tokens."""
        return self._declared[kind]

    def note_lease(self, ttl_s: float) -> None:
        """A job's base lease (its pop's ``ttl``), seconds; a non-positive one is ignored."""
        if ttl_s > 0:
            self.lease_s = float(ttl_s)

    def speed(self, kind: str) -> float | None:
        """The measured speed of ``kind``'s jobs, tokens/s (their tokens over their
        seconds), else koboldcpp's own figure (:meth:`seed`), else None."""
        samples = self._samples[kind]
        seconds = sum(s for _, s in samples)
        if samples and seconds > 0:
            return sum(t for t, _ in samples) / seconds
        return self._seed_speed

    def seed(self, tokens_per_s: float | None, now: float | None = None) -> list[LengthChange]:
        """koboldcpp's own speed figure (:func:`perf_speed`) for kinds not measured
        yet (at monotonic ``now``, which schedules the re-measure of a kind it lowers)."""
        if tokens_per_s is None or not tokens_per_s > 0:
            return []
        self._seed_speed = tokens_per_s
        changes = [c for c in (self._refit(kind) for kind in KINDS) if c is not None]
        for kind in KINDS:
            self._schedule(kind, now)
        return changes

    def record(
        self,
        kind: str,
        tokens: int,
        seconds: float,
        *,
        max_length: int,
        now: float | None = None,
    ) -> LengthChange | None:
        """A ``kind`` job's reply came back: ``tokens`` generated in ``seconds``
        (at monotonic ``now``, which schedules the kind's next re-measure; None:
        none scheduled).

        A reply shorter than :data:`MIN_SAMPLE_TOKENS` that stopped before the
        job's ``max_length`` says little about the speed and is not measured.
        Returns the change of the declaration it makes, or None.
        """
        if seconds <= 0 or tokens < 0:
            return None
        if tokens < MIN_SAMPLE_TOKENS and tokens < max_length:
            return None
        self._samples[kind].append((tokens, seconds))
        change = self._refit(kind, now=now)
        self._schedule(kind, now)
        return change

    def ran_out(
        self, kind: str, *, max_length: int, seconds: float, now: float | None = None
    ) -> LengthChange | None:
        """A ``kind`` job of ``max_length`` tokens did not finish in ``seconds``
        (its lease): narrow the declaration to half of ``max_length`` at most, and
        to what fewer than ``max_length / seconds`` tokens/s fit. Forgets the
        measured speed of the kind, which it proved too high. At monotonic ``now``
        it schedules the kind's re-measure (a run-out within :data:`HOUR_S` of a
        raise doubles the cool-off first)."""
        raised = self._raised_at[kind]
        if now is not None and raised is not None and now - raised < HOUR_S:
            self._cooloff[kind] = min(RECHECK_MAX_S, self._cooloff[kind] * 2)
            self._raised_at[kind] = None
        self._why[kind] = "ran_out"
        try:
            return self._ran_out(kind, max_length=max_length, seconds=seconds)
        finally:
            self._schedule(kind, now)

    def _ran_out(self, kind: str, *, max_length: int, seconds: float) -> LengthChange | None:
        old = self._declared[kind]
        bound = (
            fitted_length(max_length / seconds, self.lease_s, self.cap, self.margin_s)
            if seconds > 0
            else old
        )
        new = max(min(MIN_MAX_LENGTH, self.cap), min(old, max_length // 2, bound))
        self._samples[kind].clear()
        if new >= old:
            return None
        self._declared[kind] = new
        return LengthChange(kind, old, new, None, budget_s(self.lease_s, self.margin_s))

    def _refit(
        self, kind: str, *, now: float | None = None, remeasured: bool = False
    ) -> LengthChange | None:
        speed = self.speed(kind)
        if speed is None:
            return None
        old = self._declared[kind]
        fit = fitted_length(speed, self.lease_s, self.cap, self.margin_s)
        if fit < old or (fit > old and (fit >= self.cap or fit >= old * RAISE_FACTOR)):
            self._declared[kind] = fit
            if fit < old:
                self._why[kind] = "slow"
            elif now is not None:
                self._raised_at[kind] = now
            return LengthChange(
                kind, old, fit, speed, budget_s(self.lease_s, self.margin_s), remeasured
            )
        return None
