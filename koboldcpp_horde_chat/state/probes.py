"""When the pop gate probes koboldcpp after failed generations, and with a job
of which size (pure; monotonic seconds).

A probe that answers while real jobs fail (a koboldcpp that hangs on long
prompts) would re-declare a failing kind within seconds, every few failures,
each failure an aborted job on the Horde (seed "7. Fault a job"). So a probe
is the size of the last failed job, and each withdrawal waits before its first
probe, each failed probe before the next: 60 s at first, then twice the last
wait, up to 30 min. The waits start over after :data:`SUSTAINED_SUCCESSES`
real jobs of a kind in a row.
"""

from __future__ import annotations

from typing import Final

FIRST_WAIT_S: Final = 60.0
MAX_WAIT_S: Final = 1800.0
SUSTAINED_SUCCESSES: Final = 5
ALL: Final = "all"
"""The subject of a koboldcpp failing every kind together."""


class ProbePlan:
    """The probes' waits and sizes per subject (:data:`ALL`, ``"text"``, ``"chat"``)."""

    def __init__(self) -> None:
        self._wait: dict[str, float] = {}
        self._next: dict[str, float] = {}
        self._sizes: dict[str, tuple[int, int]] = {}
        self._successes: dict[str, int] = {}

    def note_failed(self, kind: str, prompt_tokens: int | None, max_length: int) -> None:
        """A real job failed (``prompt_tokens`` None: not known, kept as it was)."""
        self._successes[kind] = 0
        old_prompt, old_length = self._sizes.get(kind, (0, 0))
        prompt = prompt_tokens if prompt_tokens is not None else old_prompt
        length = max_length if max_length > 0 else old_length
        self._sizes[kind] = self._sizes[ALL] = (max(0, prompt), max(0, length))

    def size(self, subject: str) -> tuple[int, int] | None:
        """``(prompt tokens, max_length)`` of the last failed job, or None."""
        return self._sizes.get(subject)

    def due(self, subject: str, now: float) -> bool:
        """Whether the withdrawn ``subject`` may be probed; the first call of a
        withdrawal starts its wait (and is False)."""
        if (at := self._next.get(subject)) is None:
            self.wait_next(subject, now)
            return False
        return now >= at

    def next_at(self, subject: str) -> float | None:
        """When the withdrawn ``subject`` may be probed (None: not withdrawn)."""
        return self._next.get(subject)

    def wait_next(self, subject: str, now: float) -> None:
        """The next probe of ``subject`` after its wait (at a withdrawal, after a failed probe)."""
        wait = self.wait_s(subject)
        self._wait[subject] = min(MAX_WAIT_S, wait * 2)
        self._next[subject] = now + wait

    def probe_succeeded(self, subject: str) -> None:
        self._next.pop(subject, None)

    def job_succeeded(self, kind: str) -> None:
        count = self._successes.get(kind, 0) + 1
        self._successes[kind] = count
        if count >= SUSTAINED_SUCCESSES:
            self._wait.pop(kind, None)
            self._wait.pop(ALL, None)

    def wait_s(self, subject: str) -> float:
        return self._wait.get(subject, FIRST_WAIT_S)
