"""When the Horde stops answering and when it answers again: one line each per episode.

Every Horde call tells :class:`HordeWatch` when it starts and whether it was
answered (2xx or a refusal) or failed (``errors.HordeUnavailable``). The Horde is
not answering once no call was answered for ``quiet_after_s`` (10 s) while one
waits, or after ``FAILURES_IN_A_ROW`` (3) failed calls in a row; it answers again at the
next answered call::

    Horde not answering for 12 s (pop): waiting
    Horde answering again after 31 s

Seconds count from the start of the first unanswered call. A waiting call is
noticed by the ``horde-watch`` thread, which ends after ``LINGER_S`` without calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import HordeRefusal

log = logging.getLogger("koboldcpp_horde_chat.horde")

QUIET_AFTER_S = 10.0
FAILURES_IN_A_ROW = 3
LINGER_S = 30.0


class HordeWatch:
    """Watches a worker's calls to the Horde; thread-safe."""

    def __init__(self, *, quiet_after_s: float | None = None) -> None:
        self.quiet_after_s = QUIET_AFTER_S if quiet_after_s is None else quiet_after_s
        self._cond = threading.Condition()
        self._in_flight: dict[object, tuple[str, float]] = {}  # by call token
        # The start of the first call made since the last answer (None: none).
        self._quiet_since: float | None = None
        self._failed_in_a_row = 0
        # The start of the episode said (None: none said).
        self._said_since: float | None = None
        self._monitor: threading.Thread | None = None

    @contextmanager
    def call(self, kind: str) -> Iterator[None]:
        """Around one call of ``kind`` (``"pop"``...): answered when it returns or
        raises ``HordeRefusal``, failed on any other exception."""
        with self._cond:
            now = time.monotonic()
            token = object()
            self._in_flight[token] = (kind, now)
            if self._quiet_since is None:
                self._quiet_since = now
            if self._monitor is None:
                self._monitor = threading.Thread(
                    target=self._watch, name="horde-watch", daemon=True)
                self._monitor.start()
            self._cond.notify_all()
        failed = False
        try:
            yield
        except BaseException as exc:
            failed = not isinstance(exc, HordeRefusal)
            raise
        finally:
            self._ended(token, failed=failed)

    def _ended(self, token: object, *, failed: bool) -> None:
        line = None
        with self._cond:
            now = time.monotonic()
            kind, _ = self._in_flight.pop(token, ("call", now))
            if failed:
                self._failed_in_a_row += 1
                if self._said_since is None and self._failed_in_a_row >= FAILURES_IN_A_ROW:
                    line = self._say(now, f"{kind}; {self._failed_in_a_row} calls failed in a row")
            else:
                self._failed_in_a_row = 0
                if self._said_since is not None:
                    line = f"Horde answering again after {now - self._said_since:.0f} s"
                    self._said_since = None
                # Calls still waiting count their silence from this answer on.
                self._quiet_since = now if self._in_flight else None
            self._cond.notify_all()
        if line is not None:
            log.log(logging.WARNING if failed else logging.INFO, "%s", line)

    def _say(self, now: float, what: str) -> str:
        """Start the episode said now (under the lock); returns its line."""
        self._said_since = since = now if self._quiet_since is None else self._quiet_since
        return f"Horde not answering for {now - since:.0f} s ({what}): waiting"

    def _watch(self) -> None:
        idle_since = time.monotonic()
        while True:
            line = None
            with self._cond:
                now = time.monotonic()
                if self._in_flight:
                    idle_since = now
                elif now - idle_since >= LINGER_S:
                    self._monitor = None
                    return
                due = None  # when a waiting call makes the Horde not answering
                if self._said_since is None and self._in_flight and self._quiet_since is not None:
                    due = self._quiet_since + self.quiet_after_s
                if due is not None and now >= due:
                    line = self._say(now, min(self._in_flight.values(), key=lambda c: c[1])[0])
                else:
                    wait = LINGER_S if due is None else due - now
                    self._cond.wait(max(0.01, min(wait, LINGER_S)))
            if line is not None:
                log.warning("%s", line)
