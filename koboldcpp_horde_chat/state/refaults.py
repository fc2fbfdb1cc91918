"""Requests this worker faulted, recognised when the Horde hands them back (pure).

On the real Horde every faulted submit puts the request straight back at the
head of the queue (``wp.n += 1``), to this worker too, and only a sweep every
60 s marks a request with more than 2 faulted jobs faulted: a request that
always fails here was popped and faulted 19 times in 3 s. So a request
faulted :data:`FAULTS_BEFORE_HOLDING` times within :data:`WINDOW_S` that
comes back is neither generated nor faulted: its lease runs out, the sweep
aborts it and marks the request faulted, and it costs 3 aborted jobs in all.
Two faults, not one: the first may be the worker's bad moment.

A job of the request that koboldcpp generates clears its faults. A job left
to expire after koboldcpp's own failure counts as a failed generation, so
repeated payloads cannot hide a koboldcpp that fails everything.

A request is known by :func:`request_digest` of its payload, model and kind
(URL queries left out: a signed URL changes at each pop); identical payloads
count as one request.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any, Final

FAULTS_BEFORE_HOLDING: Final = 2
WINDOW_S: Final = 600.0
"""Seconds: past the Horde's ttl (150 s) and its sweep (60 s) twice over."""
MAX_REQUESTS: Final = 256


def _without_queries(value: Any) -> Any:
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        return value.split("?", 1)[0]
    if isinstance(value, Mapping):
        return {str(k): _without_queries(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_queries(v) for v in value]
    return value


def request_digest(pop: Mapping[str, Any]) -> str:
    """A hex digest naming the request of a pop's answer; never raises."""
    named = {"payload": _without_queries(pop.get("payload")), "model": pop.get("model"),
             "chat": pop.get("chat") is True}
    text = json.dumps(named, sort_keys=True, ensure_ascii=True, default=repr)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


class RequestFaults:
    """The times this worker faulted each request (at most ``max_requests``,
    the oldest forgotten first). Not thread-safe: the shared state's lock guards it."""

    def __init__(self, *, max_requests: int = MAX_REQUESTS) -> None:
        self.max_requests = max(1, int(max_requests))
        #: Per request: its last fault times, and whether koboldcpp failed the last one.
        self._faults: OrderedDict[str, tuple[deque[float], bool]] = OrderedDict()

    def faulted(self, digest: str, now: float, *, backend_failed: bool = False) -> None:
        """``backend_failed``: koboldcpp failed its generation."""
        times, _ = self._faults.pop(digest, (deque(maxlen=FAULTS_BEFORE_HOLDING), False))
        times.append(now)
        self._faults[digest] = times, backend_failed
        while len(self._faults) > self.max_requests:
            self._faults.popitem(last=False)

    def served(self, digest: str) -> None:
        self._faults.pop(digest, None)

    def backend_failed(self, digest: str) -> bool:
        return digest in self._faults and self._faults[digest][1]

    def hold(self, digest: str, now: float) -> bool:
        """Whether a job of request ``digest`` is left to expire."""
        times, _ = self._faults.get(digest, ((), False))
        return sum(1 for t in times if now - t <= WINDOW_S) >= FAULTS_BEFORE_HOLDING
