"""When the pop gate probes koboldcpp after failed generations, and with a job
of which size (pure; no I/O).

Seed "7. Fault a job": every job a failing koboldcpp is given is an aborted
job on the Horde, and more than 20 in its hour put the worker into
maintenance. ``guard.FailureStreak`` withdraws a failing subject (koboldcpp
as a whole, ``"all"``, or one kind) after failed generations in a row;
``service.gate`` probes it until a probe generates, which declares it again.
A probe that answers while real jobs fail (a koboldcpp that hangs on long
prompts, or on what the Horde's requests carry and a probe does not) would
otherwise re-declare it within seconds, every few failures.

:class:`ProbePlan` keeps the rules:

* the probe is a job of the size that failed (:meth:`ProbePlan.size`: the
  last failed job's prompt tokens and ``max_length``), not a four-word one;
* each withdrawal waits before its first probe, and each failed probe waits
  before the next: :data:`FIRST_WAIT_S` (60 s) the first time, then twice the
  last wait, up to :data:`MAX_WAIT_S` (30 min). A probe that generates ends
  the wait of that withdrawal only; the next withdrawal of the subject waits
  twice as long as the last (so withdraw-then-declare cycles are ever rarer);
* the waits start over at :data:`FIRST_WAIT_S` once :data:`SUSTAINED_SUCCESSES`
  real jobs of a kind in a row succeeded.

The caller passes monotonic seconds.
"""

from __future__ import annotations

from typing import Final

FIRST_WAIT_S: Final = 60.0
"""The wait before the first probe of a subject's first withdrawal, seconds."""
MAX_WAIT_S: Final = 1800.0
"""The longest wait before a probe, seconds."""
SUSTAINED_SUCCESSES: Final = 5
"""Real jobs of a kind succeeded in a row after which the waits start over."""
ALL: Final = "all"
"""The subject of a koboldcpp failing generations of every kind together."""


class ProbePlan:
    """The probes' waits and sizes, per subject (:data:`ALL`, ``"text"``,
    ``"chat"``; see the module docstring)."""

    def __init__(self) -> None:
        #: The wait the next withdrawal (or failed probe) of each subject gets.
        self._wait: dict[str, float] = {}
        #: When each withdrawn subject may be probed (absent: not withdrawn).
        self._next: dict[str, float] = {}
        self._sizes: dict[str, tuple[int, int]] = {}
        self._successes: dict[str, int] = {}

    def note_failed(self, kind: str, prompt_tokens: int | None, max_length: int) -> None:
        """A real ``kind`` job failed with a prompt of ``prompt_tokens`` (None: not
        known, kept as it was) and ``max_length`` tokens."""
        self._successes[kind] = 0
        old = self._sizes.get(kind)
        prompt = prompt_tokens if prompt_tokens is not None else (old[0] if old else 0)
        length = max_length if max_length > 0 else (old[1] if old else 0)
        self._sizes[kind] = (max(0, prompt), max(0, length))
        self._sizes[ALL] = self._sizes[kind]

    def size(self, subject: str) -> tuple[int, int] | None:
        """``(prompt tokens, max_length)`` of the last failed job of ``subject``
        (:data:`ALL`: of any kind), or None when none is known."""
        return self._sizes.get(subject)

    def due(self, subject: str, now: float) -> bool:
        """Whether the withdrawn ``subject`` may be probed at ``now``. The first call
        for a withdrawal starts its wait (and is False)."""
        at = self._next.get(subject)
        if at is None:
            self._next[subject] = now + self._take_wait(subject)
            return False
        return now >= at

    def next_at(self, subject: str) -> float | None:
        """When the withdrawn ``subject`` may be probed next (None: not withdrawn)."""
        return self._next.get(subject)

    def probe_failed(self, subject: str, now: float) -> None:
        """A probe of ``subject`` failed at ``now``: the next waits twice as long."""
        self._next[subject] = now + self._take_wait(subject)

    def probe_succeeded(self, subject: str) -> None:
        """A probe of ``subject`` generated: it is declared again (its next
        withdrawal waits twice as long as this one's last wait)."""
        self._next.pop(subject, None)

    def job_succeeded(self, kind: str) -> None:
        """A real ``kind`` job succeeded; :data:`SUSTAINED_SUCCESSES` in a row start
        the waits of the kind and of :data:`ALL` over."""
        count = self._successes.get(kind, 0) + 1
        self._successes[kind] = count
        if count >= SUSTAINED_SUCCESSES:
            self._wait.pop(kind, None)
            self._wait.pop(ALL, None)

    def wait_s(self, subject: str) -> float:
        """The wait the next withdrawal or failed probe of ``subject`` gets, seconds."""
        return self._wait.get(subject, FIRST_WAIT_S)

    def _take_wait(self, subject: str) -> float:
        wait = self.wait_s(subject)
        self._wait[subject] = min(MAX_WAIT_S, wait * 2)
        return wait
