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

    def line(self) -> str:
        """The one log line for the change, e.g. ``"max_length for text jobs lowered
        from 512 to 112: koboldcpp generates 1.0 tokens/s here, and a job's generation
        must end within 120 s of its lease"``."""
        verb = "lowered" if self.new < self.old else "raised"
        if self.tokens_per_s is None:
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

    def seed(self, tokens_per_s: float | None) -> list[LengthChange]:
        """koboldcpp's own speed figure (:func:`perf_speed`) for kinds not measured yet."""
        if tokens_per_s is None or not tokens_per_s > 0:
            return []
        self._seed_speed = tokens_per_s
        return [c for c in (self._refit(kind) for kind in KINDS) if c is not None]

    def record(
        self, kind: str, tokens: int, seconds: float, *, max_length: int
    ) -> LengthChange | None:
        """A ``kind`` job's reply came back: ``tokens`` generated in ``seconds``.

        A reply shorter than :data:`MIN_SAMPLE_TOKENS` that stopped before the
        job's ``max_length`` says little about the speed and is not measured.
        Returns the change of the declaration it makes, or None.
        """
        if seconds <= 0 or tokens < 0:
            return None
        if tokens < MIN_SAMPLE_TOKENS and tokens < max_length:
            return None
        self._samples[kind].append((tokens, seconds))
        return self._refit(kind)

    def ran_out(self, kind: str, *, max_length: int, seconds: float) -> LengthChange | None:
        """A ``kind`` job of ``max_length`` tokens did not finish in ``seconds``
        (its lease): narrow the declaration to half of ``max_length`` at most, and
        to what fewer than ``max_length / seconds`` tokens/s fit. Forgets the
        measured speed of the kind, which it proved too high."""
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

    def _refit(self, kind: str) -> LengthChange | None:
        speed = self.speed(kind)
        if speed is None:
            return None
        old = self._declared[kind]
        fit = fitted_length(speed, self.lease_s, self.cap, self.margin_s)
        if fit < old or (fit > old and (fit >= self.cap or fit >= old * RAISE_FACTOR)):
            self._declared[kind] = fit
            return LengthChange(kind, old, fit, speed, budget_s(self.lease_s, self.margin_s))
        return None
