"""Requests this worker faulted, recognised when the Horde hands them back (pure; no I/O).

Seed "7. Fault a job" says to fault a job the worker cannot serve, and that
"the request gets the job back for another worker". On the real AI Horde the
request comes straight back, to this worker too: every faulted submit runs
``wp.n += 1`` (horde/classes/kobold/processing_generation.py
``set_generation``), which puts the request back in the queue at once, in its
old place at the head, and only a sweep every 60 s
(horde/database/threads.py ``check_waiting_prompts``) marks a request with
more than 2 faulted jobs faulted. A request that always fails on this worker
(a prompt that crashes koboldcpp, a payload it cannot serve) was so popped
and faulted 19 times in 3 s, each an aborted job of the worker's hour
(``state/guard.py``), until the worker stopped popping for an hour.

What the worker does instead (``run/driver.py``): a request it faulted
:data:`FAULTS_BEFORE_HOLDING` times within :data:`WINDOW_S` that comes back
is neither generated nor faulted: the job is released without a submit and
its lease runs out. The same sweep aborts a job whose ttl passed
(``is_stale``: ``abort()``, which counts it as one aborted job of the worker,
and ``wp.n += 1``), and then, in the same pass, marks the request faulted,
since it now has 3 faulted jobs. So the request costs the worker 3 aborted
jobs in all (2 faults and 1 expiry) and reaches its requester as faulted
within 150-210 s of the third pop; a third fault instead would put it back at
the head of the queue for a fourth pop, and so on until the sweep. A pop
cannot turn one request away (its declaration filters kinds and limits, not
requests), so letting the lease run out is the one way not to be handed it
again before the sweep. Two faults, not one: the first fault may be the
worker's bad moment, and the request deserves its second chance here or
with another worker.

A job of the request that koboldcpp generates clears its faults (it does not
always fail). When the request's last fault was koboldcpp's (a failed
generation, not a job the worker could not serve), the job left to expire
counts as one more failed generation toward the streak that stops the popping
and probes koboldcpp (``state/guard.py``, ``FailureStreak``): requests with the
same payload then cannot hide a koboldcpp that fails everything.

A job has a new id at each pop, so a request is recognised by what its job
carries: :func:`request_digest` of the pop's payload, model and kind, with
the query of every http(s) URL in it left out (a signed URL changes at each
pop). Identical payloads of two requests count as one: the second is as sure
to fail.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any, Final

FAULTS_BEFORE_HOLDING: Final = 2
"""Faults of one request after which the worker lets its next job's lease run out."""
WINDOW_S: Final = 600.0
"""How long a request's faults are remembered, seconds: past the real Horde's ttl
(150 s) and its sweep (60 s) twice over."""
MAX_REQUESTS: Final = 256
"""The most requests remembered; the oldest is forgotten first."""


def _without_queries(value: Any) -> Any:
    """``value`` with the query of each http(s) URL string dropped, recursively."""
    if isinstance(value, str):
        if value.startswith(("http://", "https://")):
            return value.split("?", 1)[0]
        return value
    if isinstance(value, Mapping):
        return {str(k): _without_queries(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_queries(v) for v in value]
    return value


def request_digest(pop: Mapping[str, Any]) -> str:
    """A hex digest naming the request a pop's answer ``pop`` carries a job of.

    Made of its ``payload``, ``model`` and ``chat`` keys (URL queries left out);
    never raises: a value JSON cannot hold is named by its ``repr``.
    """
    named = {
        "payload": _without_queries(pop.get("payload")),
        "model": pop.get("model"),
        "chat": pop.get("chat") is True,
    }
    text = json.dumps(named, sort_keys=True, ensure_ascii=True, default=repr)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


class RequestFaults:
    """The times this worker faulted each request, within :data:`WINDOW_S`.

    Bounded: at most ``max_requests`` requests and
    :data:`FAULTS_BEFORE_HOLDING` times each. Not thread-safe (the shared
    state's lock guards it).
    """

    def __init__(self, window_s: float = WINDOW_S, *, max_requests: int = MAX_REQUESTS) -> None:
        self.window_s = float(window_s)
        self.max_requests = max(1, int(max_requests))
        self._faults: OrderedDict[str, deque[float]] = OrderedDict()
        self._backend: dict[str, bool] = {}

    def faulted(self, digest: str, now: float, *, backend_failed: bool = False) -> None:
        """This worker faulted a job of request ``digest`` at ``now`` (monotonic s);
        ``backend_failed``: koboldcpp failed its generation."""
        times = self._faults.pop(digest, None)
        if times is None:
            times = deque(maxlen=FAULTS_BEFORE_HOLDING)
        times.append(now)
        self._faults[digest] = times
        self._backend[digest] = backend_failed
        while len(self._faults) > self.max_requests:
            oldest, _ = self._faults.popitem(last=False)
            self._backend.pop(oldest, None)

    def served(self, digest: str) -> None:
        """koboldcpp generated a job of request ``digest``: its faults are forgotten."""
        self._faults.pop(digest, None)
        self._backend.pop(digest, None)

    def backend_failed(self, digest: str) -> bool:
        """Whether the last fault of request ``digest`` was a failed generation."""
        return self._backend.get(digest, False)

    def recent(self, digest: str, now: float) -> int:
        """How many faults of request ``digest`` lie within the window."""
        times = self._faults.get(digest)
        if times is None:
            return 0
        return sum(1 for t in times if now - t <= self.window_s)

    def hold(self, digest: str, now: float) -> bool:
        """Whether a job of request ``digest`` popped at ``now`` is left to expire:
        this worker faulted the request :data:`FAULTS_BEFORE_HOLDING` times within
        the window."""
        return self.recent(digest, now) >= FAULTS_BEFORE_HOLDING
