"""The ``max_length`` and ``max_context_length`` declared per kind so that
koboldcpp processes and generates a job within its lease (pure; no I/O).

Seed "Streaming progress": the lease is the pop's ttl, 150 s; the pop prefers
workers that generate max_length within 120 s. Per kind this keeps ``p``
(seconds per prompt token) and ``g`` (tokens/s) from koboldcpp's figures
after each job, and fits with ``lease_figures.fitted_limits``.

A job that runs out of its lease (prompt ``P``, ``max_length`` ``L``, ``T``
seconds) was a hang when ``P * p + L / g <= T / 2`` (nothing lowered); a slow
prompt when ``P * p >= L / g`` (``p`` raised to ``(T - L / g) / P``, the
context refitted); else a slow generation (``max_length`` halved and fitted
to ``L / T`` tokens/s). With no figure, a prompt of 1024+ tokens was slow.

Raises wait for the kind's cool-off (60 s, doubled up to 30 min after a
re-measure that raises nothing or a run-out within an hour of a raise). A
kind below its caps and idle for its cool-off is re-measured with a job the
size of the one that lowered it (a short probe would raise it again).
"""

from __future__ import annotations

from collections import deque
from typing import Final

from .lease_figures import (
    MIN_MAX_LENGTH,
    MIN_PROMPT_TOKENS,
    LengthChange,
    PerfFigures,
    budget_s,
    fitted_length,
    fitted_limits,
)

KINDS: Final = ("text", "chat")
LONG_PROMPT_TOKENS: Final = 1024
HANG_SHARE: Final = 0.5
RAISE_FACTOR: Final = 1.25
"""A lowered limit is raised only once the fit is this much larger (or at the cap)."""
MIN_SAMPLE_TOKENS: Final = 16
SAMPLES_KEPT: Final = 8
RECHECK_AFTER_S: Final = 60.0
"""The first cool-off, seconds."""
RECHECK_MAX_S: Final = 1800.0
HOUR_S: Final = 3600.0
PROBE_PROMPT_TOKENS: Final = 256
"""A re-measure's prompt, tokens, when no job of the kind ran out."""
PROBE_MAX_LENGTH: Final = 64
_Samples = deque[tuple[int, float]]  # (tokens, seconds) per job


class LeaseFit:
    """The per-kind declared limits that fit the lease (see the module docstring).

    ``cap`` is the operator's ``max_length``; ``lease_s`` the base lease (the
    pop's ``ttl``, updated by :meth:`note_lease`); ``margin_s`` the submit's
    margin; ``context_cap`` the declared context (0: the context is not fitted).
    """

    def __init__(
        self, cap: int, lease_s: float = 150.0, margin_s: float = 0.0, context_cap: int = 0
    ) -> None:
        if cap < 1 or not lease_s > 0 or context_cap < 0:
            raise ValueError("cap must be at least 1, lease_s positive, context_cap >= 0")
        self.cap = cap
        self.context_cap = context_cap
        self.margin_s = margin_s
        self.lease_s = float(lease_s)
        self._declared = {kind: cap for kind in KINDS}
        self._context = {kind: context_cap for kind in KINDS}
        # Per kind: generations (tokens, seconds) and prompts processed (tokens, seconds).
        self._samples: dict[str, _Samples] = {kind: deque(maxlen=SAMPLES_KEPT) for kind in KINDS}
        self._process: dict[str, _Samples] = {kind: deque(maxlen=SAMPLES_KEPT) for kind in KINDS}
        self._seed_speed: float | None = None
        self._seed_process: float | None = None
        self._recheck_at: dict[str, float | None] = {kind: None for kind in KINDS}
        self._cooloff = {kind: RECHECK_AFTER_S for kind in KINDS}
        self._raised_at: dict[str, float | None] = {kind: None for kind in KINDS}
        self._hold_until: dict[str, float | None] = {kind: None for kind in KINDS}
        self._why: dict[str, str | None] = {kind: None for kind in KINDS}  # "ran_out", "slow"
        # (prompt tokens, max_length) of the last job that ran out, and of the
        # last measured job that lowered the context.
        self._failed_size: dict[str, tuple[int, int] | None] = {kind: None for kind in KINDS}
        self._lowering_size: dict[str, tuple[int, int] | None] = {kind: None for kind in KINDS}

    def declared(self, kind: str) -> int:
        """The ``max_length`` the next pop declares for ``kind``."""
        return self._declared[kind]

    def declared_context(self, kind: str) -> int | None:
        """The ``max_context_length`` the next pop declares (None: not fitted)."""
        return self._context[kind] if self.context_cap else None

    def _below_caps(self, kind: str) -> bool:
        return self._declared[kind] < self.cap or self._context[kind] < self.context_cap

    def lowered_because(self, kind: str) -> str | None:
        """Why ``kind`` is below its caps, in an operator's words; None at the caps."""
        if not self._below_caps(kind):
            return None
        ran_out = self._why[kind] == "ran_out"
        return "koboldcpp ran out of a lease" if ran_out else "koboldcpp's measured speed"

    def cooloff_s(self, kind: str) -> float:
        return self._cooloff[kind]

    def speed(self, kind: str) -> float | None:
        """``g``: the measured tokens/s of ``kind``, else koboldcpp's figure, else None."""
        tokens, seconds = _sums(self._samples[kind])
        return tokens / seconds if seconds > 0 else self._seed_speed

    def process_s(self, kind: str) -> float | None:
        """``p``: the measured seconds per prompt token, else koboldcpp's, else None."""
        tokens, seconds = _sums(self._process[kind])
        return seconds / tokens if tokens > 0 else self._seed_process

    def probe_size(self, kind: str) -> tuple[int, int]:
        """``(prompt tokens, max_length)`` of a re-measure: the last job that ran
        out, else the last that lowered the context, else a small default."""
        size = self._failed_size[kind] or self._lowering_size[kind]
        return size or (PROBE_PROMPT_TOKENS, min(PROBE_MAX_LENGTH, self.cap))

    def recheck_due(self, now: float, *, take: bool = True) -> list[str]:
        """The kinds below their caps due a re-measure at ``now``; each is named
        once until a measurement schedules it anew (``take`` False: only look)."""
        due = []
        for kind in KINDS:
            at = self._recheck_at[kind]
            if self._below_caps(kind) and at is not None and at <= now:
                if take:
                    self._recheck_at[kind] = None
                due.append(kind)
        return due

    def _schedule(self, kind: str, now: float | None) -> None:
        if not self._below_caps(kind):
            self._recheck_at[kind] = None
            self._cooloff[kind] = RECHECK_AFTER_S
            self._why[kind] = None
            self._failed_size[kind] = None
        elif now is not None:
            self._recheck_at[kind] = now + self._cooloff[kind]

    def note_lease(self, ttl_s: float) -> None:
        """A job's base lease, seconds; a non-positive one is ignored."""
        if ttl_s > 0:
            self.lease_s = float(ttl_s)

    def seed(self, tokens_per_s: float | None, now: float | None = None,
             process_s: float | None = None) -> list[LengthChange]:
        """koboldcpp's own figures, for kinds not measured yet (``now``: monotonic,
        schedules the re-measure of a kind it lowers)."""
        if process_s is not None and process_s > 0:
            self._seed_process = process_s
        if tokens_per_s is not None and tokens_per_s > 0:
            self._seed_speed = tokens_per_s
        elif self._seed_process is None:
            return []
        changes = [c for kind in KINDS for c in self._refit(kind)]
        for kind in KINDS:
            self._schedule(kind, now)
        return changes

    def record(self, kind: str, tokens: int, seconds: float, *, max_length: int,
               now: float | None = None, figures: PerfFigures | None = None) -> list[LengthChange]:
        """A ``kind`` job generated ``tokens`` in ``seconds`` (koboldcpp's
        ``figures`` measure processing and generation apart). A reply shorter
        than ``MIN_SAMPLE_TOKENS`` that stopped before ``max_length`` is not
        measured. ``now`` (monotonic) schedules the next re-measure."""
        if seconds <= 0 or tokens < 0:
            return []
        measured = False
        if figures and figures.prompt_s_per_token() is not None:
            self._process[kind].append((figures.prompt_tokens, figures.process_s))
            measured = True
        if figures is not None and figures.eval_s > 0 and figures.tokens > 0:
            tokens, seconds = figures.tokens, figures.eval_s
        if tokens >= MIN_SAMPLE_TOKENS or tokens >= max_length:
            self._samples[kind].append((tokens, seconds))
            measured = True
        if not measured:
            return []
        changes = self._refit(kind, now=now)
        lowered = any(c.what == "max_context_length" and c.new < c.old for c in changes)
        if figures is not None and lowered:
            self._lowering_size[kind] = (figures.prompt_tokens, max_length)
        self._schedule(kind, now)
        return changes

    def remeasured(self, kind: str, tokens_per_s: float | None, now: float,
                   process_s: float | None = None) -> list[LengthChange]:
        """A re-measure of ``kind`` found these figures (None, None: it failed):
        refit from them alone; no raise doubles the cool-off."""
        changes: list[LengthChange] = []
        if tokens_per_s is not None and tokens_per_s > 0:
            self._samples[kind].clear()
            # One sample of a minute at that speed, so a job's own measure soon weighs in.
            self._samples[kind].append((max(1, round(tokens_per_s * 60.0)), 60.0))
        if process_s is not None and process_s > 0:
            self._process[kind].clear()
            self._process[kind].append((1000, process_s * 1000))
        if (tokens_per_s or 0) > 0 or (process_s or 0) > 0:
            self._hold_until[kind] = None
            changes = self._refit(kind, now=now, remeasured=True)
        if not any(c.new > c.old for c in changes):
            self._cooloff[kind] = min(RECHECK_MAX_S, self._cooloff[kind] * 2)
        self._schedule(kind, now)
        return changes

    def ran_out(self, kind: str, *, max_length: int, seconds: float, now: float | None = None,
                prompt_tokens: int | None = None,
                produced: int | None = None) -> list[LengthChange]:
        """A ``kind`` job did not finish in ``seconds`` (its lease), having
        generated ``produced`` tokens (None: not known): the module docstring's
        lesson. Holds the kind's raises for its cool-off (doubled first after a
        raise within the hour). Returns no change for a hang."""
        lesson = "length" if produced else self._lesson(kind, max_length, seconds, prompt_tokens)
        if lesson == "hang":
            return []
        raised = self._raised_at[kind]
        if now is not None and raised is not None and now - raised < HOUR_S:
            self._cooloff[kind] = min(RECHECK_MAX_S, self._cooloff[kind] * 2)
            self._raised_at[kind] = None
        if now is not None:
            self._hold_until[kind] = now + self._cooloff[kind]
        if prompt_tokens is not None:
            self._failed_size[kind] = (max(1, prompt_tokens), max(1, max_length))
        if lesson == "prompt" and prompt_tokens is not None:
            changes = self._prompt_ran_out(kind, max_length, seconds, prompt_tokens)
        else:
            changes = self._length_ran_out(kind, max_length=max_length, seconds=seconds)
        self._why[kind] = "ran_out"
        self._schedule(kind, now)
        return changes

    def _lesson(self, kind: str, max_length: int, seconds: float, prompt_tokens: int | None) -> str:
        """``"hang"``, ``"prompt"`` or ``"length"``."""
        if prompt_tokens is None or seconds <= 0:
            return "length"
        p, g = self.process_s(kind), self.speed(kind)
        generating = max_length / g if g else None
        if p is not None and generating is not None:
            if prompt_tokens * p + generating <= HANG_SHARE * seconds:
                return "hang"
            return "prompt" if prompt_tokens * p >= generating else "length"
        if generating is not None:  # generation alone cannot explain it: can the prompt?
            if generating > HANG_SHARE * seconds:
                return "length"
            # A prompt token processed at most as slowly as two generated ones.
            slowest = prompt_tokens * 2 / g if g else 0.0
            return "prompt" if slowest + generating > HANG_SHARE * seconds else "hang"
        if p is not None:
            return "prompt" if prompt_tokens * p > HANG_SHARE * seconds else "length"
        long = prompt_tokens >= LONG_PROMPT_TOKENS and prompt_tokens > max_length
        return "prompt" if long else "hang"

    def _prompt_ran_out(self, kind: str, max_length: int, seconds: float,
                        prompt_tokens: int) -> list[LengthChange]:
        g = self.speed(kind)
        generating = min(max_length / g, seconds / 2) if g else 0.0
        # The prompt took at least the rest: p is at least that over its tokens.
        slowest = max(seconds - generating, seconds / 2) / prompt_tokens
        known = self.process_s(kind)
        if known is None or slowest > known:
            self._process[kind].clear()
            self._process[kind].append((prompt_tokens, slowest * prompt_tokens))
        # Say what taught it: the run-out, not a measured speed.
        return [
            LengthChange(c.kind, c.old, c.new, None, c.budget_s, what=c.what,
                         prompt_tokens=prompt_tokens if c.what == "max_context_length" else None)
            for c in self._refit(kind)
        ]

    def _length_ran_out(self, kind: str, *, max_length: int, seconds: float) -> list[LengthChange]:
        old = self._declared[kind]
        bound = old
        if seconds > 0:
            bound = fitted_length(max_length / seconds, self.lease_s, self.cap, self.margin_s)
        new = max(min(MIN_MAX_LENGTH, self.cap), min(old, max_length // 2, bound))
        self._samples[kind].clear()
        if new >= old:
            return []
        self._declared[kind] = new
        return [LengthChange(kind, old, new, None, budget_s(self.lease_s, self.margin_s))]

    def _refit(self, kind: str, *, now: float | None = None,
               remeasured: bool = False) -> list[LengthChange]:
        g, p = self.speed(kind), self.process_s(kind)
        if g is None and (p is None or not self.context_cap):
            return []
        length, context = fitted_limits(
            tokens_per_s=g, process_s=p if self.context_cap else None, lease_s=self.lease_s,
            cap=self.cap, context_cap=self.context_cap or self.cap + MIN_PROMPT_TOKENS,
            margin_s=self.margin_s,
        )
        budget = budget_s(self.lease_s, self.margin_s)
        hold = self._hold_until[kind]  # a run-out's cool-off holds the raises
        held = now is not None and hold is not None and now < hold
        changes = []
        old = self._declared[kind]
        # Nothing measured about generation is no reason to raise max_length.
        if (g is not None or length < old) and self._moves(old, length, self.cap, held):
            self._declared[kind] = length
            changes.append(LengthChange(kind, old, length, g, budget, remeasured))
        if self.context_cap:
            old_context = self._context[kind]
            if self._moves(old_context, context, self.context_cap, held):
                self._context[kind] = context
                changes.append(LengthChange(
                    kind, old_context, context, g, budget, remeasured, what="max_context_length",
                    process_tokens_per_s=1.0 / p if p else None,
                ))
        for change in changes:
            if change.new < change.old:
                self._why[kind] = "slow"
            elif now is not None:
                self._raised_at[kind] = now
        return changes

    @staticmethod
    def _moves(old: int, fit: int, cap: int, held: bool) -> bool:
        """A fit lowers at once; out of a hold it raises once ``RAISE_FACTOR``
        larger or at ``cap``."""
        if fit < old:
            return True
        return fit > old and not held and (fit >= cap or fit >= old * RAISE_FACTOR)


def _sums(samples: _Samples) -> tuple[int, float]:
    """``(tokens, seconds)`` of all ``samples``."""
    return sum(t for t, _ in samples), sum(s for _, s in samples)
