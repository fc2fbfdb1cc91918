"""The limits a lease allows and the figures they are fitted from (pure; no I/O):
koboldcpp's ``/api/extra/perf``, a reply's tokens, and the change lines.

With ``p`` seconds per prompt token and ``g`` tokens generated per second, a
job of context ``C`` and ``max_length`` ``L`` takes at most
``C * p + L * max(0, 1/g - p)``. Within the budget ``B`` (:func:`budget_s`:
0.8 of the lease, 120 s of the seed's 150, and the submit's margin short of
its end) :func:`fitted_limits` declares:

1. ``L = g * B``, at most the operator's ``cap``;
2. ``C = (B - L * max(0, 1/g - p)) / p``, at most ``context_cap``;
3. when ``C < L + MIN_PROMPT_TOKENS``, ``L`` lowered until it is not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..jsonbody import finite_number

FIT_SHARE: Final = 0.8
"""The share of the lease a job may take (120 s of 150)."""
MIN_MAX_LENGTH: Final = 16
STEP: Final = 16
"""Fitted ``max_length`` is a multiple of this (steady declarations)."""
CONTEXT_STEP: Final = 64
MIN_PROMPT_TOKENS: Final = 256
"""The fitted context leaves at least this many prompt tokens beside ``max_length``."""
MIN_PROCESS_SAMPLE: Final = 16
"""A shorter prompt, tokens, says too little about processing."""


@dataclass(frozen=True)
class LengthChange:
    """``kind``'s ``what`` (``"max_length"`` or ``"max_context_length"``) went
    from ``old`` to ``new`` tokens.

    ``tokens_per_s`` is the measured speed behind it (None: a job ran out of
    its lease); ``budget_s`` the seconds a job may take; ``remeasured``: the
    figures come from the worker's own probe; ``prompt_tokens``: the prompt of
    the job that ran out, for a context change it caused.
    """

    kind: str
    old: int
    new: int
    tokens_per_s: float | None
    budget_s: float
    remeasured: bool = False
    what: str = "max_length"
    process_tokens_per_s: float | None = None
    prompt_tokens: int | None = None

    def line(self) -> str:
        """The log line, e.g. ``"max_length for text jobs lowered from 512 to 112:
        koboldcpp generates 1.0 tokens/s here, and a job's generation must end
        within 120 s of its lease"``."""
        verb = "lowered" if self.new < self.old else "raised"
        again = " again (measured with a generation of the worker's own)" if self.remeasured else ""
        ends = f"must end within {self.budget_s:.0f} s of its lease"
        if self.what == "max_context_length" and self.prompt_tokens is not None:
            why = f"a job's prompt of {self.prompt_tokens} tokens ran out of its lease"
        elif self.what == "max_context_length":
            speeds = (
                f"koboldcpp processes {self.process_tokens_per_s:.1f} prompt tokens/s"
                if self.process_tokens_per_s
                else "koboldcpp's prompt processing"
            )
            if self.tokens_per_s:
                speeds += f" and generates {self.tokens_per_s:.1f} tokens/s"
            why = f"{speeds} here{again}, and a job {ends}"
        elif self.tokens_per_s is None:
            why = "a job's generation ran out of its lease"
        else:
            speeds = f"koboldcpp generates {self.tokens_per_s:.1f} tokens/s"
            why = f"{speeds} here{again}, and a job's generation {ends}"
        return f"{self.what} for {self.kind} jobs {verb} from {self.old} to {self.new}: {why}"


@dataclass(frozen=True)
class PerfFigures:
    """koboldcpp's figures of its last generation: ``last_input_count``,
    ``last_process_time`` (s), ``last_token_count``, ``last_eval_time`` (s) and
    ``total_gens`` (tells whether the figures are of a new generation)."""

    prompt_tokens: int
    process_s: float
    tokens: int
    eval_s: float
    generations: int

    def prompt_s_per_token(self) -> float | None:
        """Seconds koboldcpp took per prompt token, when these figures measured a
        prompt of at least :data:`MIN_PROCESS_SAMPLE` tokens; else None."""
        if self.prompt_tokens < MIN_PROCESS_SAMPLE or not self.process_s > 0:
            return None
        return self.process_s / self.prompt_tokens


def tokens_of_text(text: str) -> int:
    """Tokens of a text reply as the Horde estimates them: ``ceil(chars / 4)``."""
    return math.ceil(len(text) / 4)


def job_max_length(payload: Mapping[str, Any]) -> int:
    """A job payload's ``max_length``, tokens (0 when it has none that is valid)."""
    return _count(payload.get("max_length")) or 0


def reply_tokens(body: Mapping[str, Any]) -> int:
    """Tokens of a submit body: koboldcpp's ``completion_tokens`` when given, else
    the Horde's estimate of the message's content and reasoning (or of a text
    job's ``generation``)."""
    counted = _count(body.get("completion_tokens"))
    if counted is not None:
        return counted
    message = body.get("message")
    if isinstance(message, Mapping):
        text = "".join(str(message.get(key) or "") for key in ("content", "reasoning_content"))
        return tokens_of_text(text)
    return tokens_of_text(str(body.get("generation") or ""))


def _number(value: object) -> float | None:
    number = finite_number(value)
    return number if number is not None and number >= 0 else None


def _count(value: object) -> int | None:
    """``value`` when it is an int (not a bool) of at least 0, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def perf_speed(perf: Mapping[str, Any]) -> float | None:
    """koboldcpp's ``last_eval_speed``, tokens/s, once it generated something;
    None when it has no figure (a fresh koboldcpp answers 0)."""
    speed = _number(perf.get("last_eval_speed"))
    return speed if _count(perf.get("total_gens")) and speed else None


def perf_figures(perf: Mapping[str, Any]) -> PerfFigures | None:
    """The figures of koboldcpp's last generation, or None when it has none
    (no generation, a figure missing or not a number, no time measured)."""
    gens = _count(perf.get("total_gens"))
    prompt, process, tokens, evaluated = (
        _number(perf.get(key))
        for key in ("last_input_count", "last_process_time", "last_token_count", "last_eval_time")
    )
    if not gens or prompt is None or process is None or tokens is None or evaluated is None or (
        process <= 0 and evaluated <= 0
    ):
        return None
    return PerfFigures(int(prompt), process, int(tokens), evaluated, gens)


def budget_s(lease_s: float, margin_s: float = 0.0) -> float:
    """Seconds a job may take in a ``lease_s`` lease: ``FIT_SHARE`` of it, and at
    least ``margin_s`` before its end: ``(150, 5) -> 120``, ``(20, 5) -> 15``."""
    return max(0.0, min(lease_s * FIT_SHARE, lease_s - margin_s))


def fitted_length(tokens_per_s: float, lease_s: float, cap: int, margin_s: float = 0.0) -> int:
    """The ``max_length`` generated within the budget, a multiple of ``STEP``
    between ``MIN_MAX_LENGTH`` and ``cap``: ``(1.0, 150, 512) -> 112``.

    Raises:
        ValueError: a non-positive speed or lease.
    """
    if not (tokens_per_s > 0 and lease_s > 0):
        raise ValueError("tokens_per_s and lease_s must be positive")
    fit = int(tokens_per_s * budget_s(lease_s, margin_s)) // STEP * STEP
    return min(cap, max(MIN_MAX_LENGTH, fit))


def fitted_limits(
    *, tokens_per_s: float | None, process_s: float | None, lease_s: float, cap: int,
    context_cap: int, margin_s: float = 0.0,
) -> tuple[int, int]:
    """``(max_length, max_context_length)`` by steps 1 to 3 of the module
    docstring; an unmeasured ``tokens_per_s`` (``g``) or ``process_s`` (``p``)
    keeps its cap. E.g. 27 tokens/s, 46 s per 2,400 prompt tokens, 150 s lease,
    5 s margin, caps 512 and 4096: ``(512, 4096)``; in a 60 s lease ``(512, 1984)``
    (a positive lease and caps)."""
    length = cap if tokens_per_s is None else fitted_length(tokens_per_s, lease_s, cap, margin_s)
    if process_s is None or not process_s > 0:
        return length, context_cap
    budget = budget_s(lease_s, margin_s)
    per_generated = 1.0 / tokens_per_s if tokens_per_s else 0.0
    extra = max(0.0, per_generated - process_s)  # a generated token's cost beyond a prompt's
    context = (budget - length * extra) / process_s
    if context < length + MIN_PROMPT_TOKENS:
        room = (budget - MIN_PROMPT_TOKENS * process_s) / max(per_generated, process_s)
        length = min(length, max(MIN_MAX_LENGTH, int(max(0.0, room)) // STEP * STEP))
        context = max(context, float(length + MIN_PROMPT_TOKENS))
    context_fit = int(context) // CONTEXT_STEP * CONTEXT_STEP
    floor = min(context_cap, length + MIN_PROMPT_TOKENS)
    return min(cap, length), min(context_cap, max(floor, context_fit))
