"""In-process fakes of the worker's I/O edges, for property tests and the soak.

:class:`FakeHorde` implements ``horde.api.HordeAPI`` (the Horde client's
``pop``, ``submit``, ``progress``, ``close``), :class:`FakeBackend`
``koboldcpp.api.KcppAPI`` (koboldcpp's client) and :class:`FakeManners`
``koboldcpp.manners.LocalManners``; ``mypy --strict`` checks them against those
Protocols (``tests/test_static.py``), so a fake cannot drift from the seam it
stands in for. The clients' fakes raise
the worker's own ``errors`` classes, as the real edges do, and both follow a
script of outcomes (then behave). No sockets: a :class:`~koboldcpp_horde_chat.service.loop.Worker` built
on them runs thousands of jobs a second. :class:`FakeClock` and
:class:`FakeStopEvent` make the worker's waits advance a fake clock instead of
sleeping.

:class:`FakeHorde` keeps the Horde's side of each job (lease, state, accepted
submits) and :meth:`FakeHorde.verdicts` classifies every popped job at the end:
``submitted``, ``faulted``, ``ended`` (the Horde ended it: 404, ``AbortedGen``,
a key refusal), ``cancelled`` (progress said so), ``expired`` (the worker's
last submit attempt failed after the lease), ``double`` (two accepted submits:
a bug), ``lost`` (no terminal action at all: a bug).
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from koboldcpp_horde_chat.errors import (
    BackendBusy,
    BackendError,
    BackendUnauthorized,
    HordeRefusal,
    HordeUnavailable,
)
from koboldcpp_horde_chat.koboldcpp.api import BackendInfo
from koboldcpp_horde_chat.koboldcpp.manners import NoManners

if TYPE_CHECKING:
    from koboldcpp_horde_chat.clock import Clock
    from koboldcpp_horde_chat.horde.api import HordeAPI
    from koboldcpp_horde_chat.koboldcpp.api import KcppAPI, KcppStream
    from koboldcpp_horde_chat.koboldcpp.manners import LocalManners


class FakeClock:
    """Seconds on a clock that moves only when told (monotonic and wall alike).

    A ``koboldcpp_horde_chat.clock.Clock``: give it to the shared state
    (``WorkerState(settings, ..., clock=FakeClock())``) and the pop loop built
    on that state reads it for everything. Its sleeps move it; its timers
    (:class:`FakeTimer`) run on the thread that moves it past their time, in the
    order they are due. Called, it says ``monotonic()``.
    """

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start
        self._lock = threading.Lock()
        self._timers: list[FakeTimer] = []

    def __call__(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def timer(self, seconds: float, action: Callable[[], None], *, name: str) -> FakeTimer:
        return FakeTimer(self, seconds, action, name)

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float | None) -> None:
        if seconds is not None and seconds > 0:
            with self._lock:
                self.now += float(seconds)
        self._fire()

    def schedule(self, timer: FakeTimer) -> None:
        """Keep a started timer (run at once when its time has come)."""
        with self._lock:
            self._timers.append(timer)
        self._fire()

    def run_timer(self, timer: FakeTimer) -> None:
        """Run a due timer's action (a subclass may hook in before it)."""
        timer.action()

    def _fire(self) -> None:
        with self._lock:
            due = sorted((t for t in self._timers if t.due <= self.now), key=lambda t: t.due)
            for timer in due:
                self._timers.remove(timer)
        for timer in due:
            if not timer.cancelled:
                self.run_timer(timer)


class FakeTimer:
    """A ``koboldcpp_horde_chat.clock.Timer`` on a :class:`FakeClock`."""

    def __init__(
        self, clock: FakeClock, seconds: float, action: Callable[[], None], name: str
    ) -> None:
        self.clock = clock
        self.seconds = seconds
        self.action = action
        self.name = name
        self.cancelled = False
        self.due = 0.0

    def start(self) -> None:
        self.due = self.clock.now + self.seconds
        self.clock.schedule(self)

    def cancel(self) -> None:
        self.cancelled = True


class FakeStopEvent(threading.Event):
    """A stop event whose ``wait`` advances the fake clock instead of sleeping."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self._clock = clock
        self.waited = 0.0

    def wait(self, timeout: float | None = None) -> bool:
        if self.is_set():
            return True
        self._clock.advance(timeout)
        self.waited += timeout or 0.0
        return self.is_set()


# ---------------------------------------------------------------- the Horde


@dataclass
class FakeJob:
    """The Horde's record of one popped job."""

    id: str
    chat: bool
    popped_at: float
    ttl_s: float
    state: str | None = None  # submitted | faulted | ended | cancelled
    accepted: int = 0
    attempts: int = 0
    last_attempt_failed: bool = False
    last_attempt_at: float = 0.0
    late_submits: int = 0  # submits after a cancel or ChatJobAborted
    refusals: list[str] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)


SUBMIT_OUTCOMES = (
    "ok",
    "lost_before",
    "lost_after",
    "unavailable",
    "rate_limited",
    "garbage_reward",
    "ChatSubmitInvalid",
    "ChatSubmitNonconformant",
    "ChatModelMismatch",
    "AbortedGen",
    "not_found",
    "bad_request",
    "key_refused",
)
"""What :meth:`FakeHorde.submit` can be scripted to do (``"ok"``: behave)."""

PROGRESS_OUTCOMES = (
    "ok",
    "cancel",
    "lost",
    "unavailable",
    "ChatJobAborted",
    "ChatProgressNotStreaming",
    "ChatProgressCapReached",
    "out_of_sequence",
    "garbage",
)
"""What :meth:`FakeHorde.progress` can be scripted to do."""

POP_ERRORS = (
    "unavailable",
    "rate_limited",
    "lost",
    "maintenance",
    "bad_request",
)
"""Pop errors a script may raise (besides returning a pop answer)."""


class FakeHorde:
    """A Horde in process: scripted pops, submits and progress answers.

    Args:
        clock: the fake clock (leases are on it).
        pops: pop answers (dicts, returned as they are) or ``POP_ERRORS`` names
            (raised); when exhausted, pops return no job.
        submit_script: ``SUBMIT_OUTCOMES`` names used one per submit call, then ``"ok"``.
        progress_script: ``PROGRESS_OUTCOMES`` names used one per post, then ``"ok"``.
        default_ttl_s: the lease of a job whose pop has no usable ``ttl``.
    """

    def __init__(
        self,
        clock: FakeClock,
        *,
        pops: Iterable[Any] = (),
        submit_script: Iterable[str] = (),
        progress_script: Iterable[str] = (),
        default_ttl_s: float = 150.0,
        lease_cap_s: float = 200.0,
    ) -> None:
        self.clock = clock
        self.lease_cap_s = lease_cap_s
        self.pops: deque[Any] = deque(pops)
        self.submit_script: deque[str] = deque(submit_script)
        self.progress_script: deque[str] = deque(progress_script)
        self.default_ttl_s = default_ttl_s
        self.jobs: dict[str, FakeJob] = {}
        self.pop_bodies: list[dict[str, Any]] = []
        self.progress_bodies: list[dict[str, Any]] = []
        self.pop_calls = 0
        self.submit_calls = 0
        self.progress_calls = 0
        self.keep_pop_bodies = True
        self.closed = False

    # -- the client's interface ------------------------------------------------------

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.pop_calls += 1
        if self.keep_pop_bodies:
            self.pop_bodies.append(copy.deepcopy(body))
        item = self.pops.popleft() if self.pops else {"id": None, "ids": [], "skipped": {}}
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, str):
            raise _pop_error(item)
        answer = copy.deepcopy(item)
        job_id = answer.get("id") if isinstance(answer, dict) else None
        if isinstance(job_id, str) and job_id and job_id not in self.jobs:
            ttl_s = _lease_s(answer.get("ttl"), self.default_ttl_s, self.lease_cap_s)
            self.jobs[job_id] = FakeJob(
                job_id, answer.get("chat") is True, self.clock(), ttl_s
            )
        return answer if isinstance(answer, dict) else {"id": None}

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.submit_calls += 1
        job_id = body.get("id")
        job = self.jobs.get(job_id) if isinstance(job_id, str) else None
        outcome = self.submit_script.popleft() if self.submit_script else "ok"
        if job is not None:
            job.attempts += 1
            job.last_attempt_at = self.clock()
            job.last_attempt_failed = False
            job.bodies.append(body)
            if job.state in ("cancelled", "ended"):
                job.late_submits += 1
        if outcome == "lost_before":
            self._failed(job)
            raise HordeUnavailable("submit: could not connect", status=0, sent=False)
        if outcome == "unavailable":
            self._failed(job)
            raise HordeUnavailable("submit: HTTP 503", status=503, rc="", body={})
        if outcome == "rate_limited":
            self._failed(job)
            raise HordeUnavailable("submit: HTTP 429", status=429, retry_after_s=3.0)
        if outcome == "key_refused":
            if job is not None:
                job.state = job.state or "ended"  # nothing can be sent with this key
            raise HordeRefusal("No user matching sent API Key.", status=401, rc="InvalidAPIKey")
        if outcome == "not_found" or job is None:
            if job is not None:
                job.state = job.state or "ended"
            raise HordeRefusal("No job with this id.", status=404, rc="InvalidJobID")
        if outcome == "AbortedGen":
            job.state = job.state or "ended"
            raise HordeRefusal("This job has ended.", status=400, rc="AbortedGen")
        if outcome == "bad_request" and body.get("state") == "faulted":
            job.state = job.state or "ended"  # nothing more the worker can send
            raise HordeRefusal("Bad request.", status=400, rc="BadRequest")
        if job.state in ("submitted", "faulted"):
            raise HordeRefusal("Already submitted.", status=400, rc="DuplicateGen", job_id=job.id)
        if job.state in ("cancelled", "ended"):
            raise HordeRefusal("This job has ended.", status=400, rc="AbortedGen", job_id=job.id)
        faulted = body.get("state") == "faulted"
        if outcome in (
            "ChatSubmitInvalid", "ChatSubmitNonconformant", "ChatModelMismatch", "bad_request"
        ):
            if not faulted:
                job.refusals.append(outcome)
                rc = "BadRequest" if outcome == "bad_request" else outcome
                raise HordeRefusal("refused", status=400, rc=rc, job_id=job.id)
        if job.refusals and not faulted:
            job.late_submits += 1  # a refused reply was sent again: forbidden
        job.state = "faulted" if faulted else "submitted"
        job.accepted += 1
        if outcome == "lost_after":
            raise HordeUnavailable("submit: connection lost", status=0, sent=None)
        if outcome == "garbage_reward":
            return {"reward": 10**400, "extra": [1, {"x": None}]}
        return {"reward": 0 if faulted else 12.5}

    def progress(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.progress_calls += 1
        self.progress_bodies.append(copy.deepcopy(body))
        job_id = body.get("id")
        job = self.jobs.get(job_id) if isinstance(job_id, str) else None
        seq = body.get("seq")
        outcome = self.progress_script.popleft() if self.progress_script else "ok"
        if job is not None and job.state in ("cancelled", "ended"):
            outcome = "cancel" if job.state == "cancelled" else "ChatJobAborted"
        if outcome == "lost":
            raise HordeUnavailable("progress: connection lost", status=0, sent=None)
        if outcome == "unavailable":
            raise HordeUnavailable(
                "unavailable", status=503, rc="ChatProgressUnavailable",
                body={"rc": "ChatProgressUnavailable"},
            )
        if outcome == "ChatJobAborted":
            if job is not None and job.state is None:
                job.state = "ended"
            raise HordeRefusal(
                "ended", status=404, rc="ChatJobAborted", body={"rc": "ChatJobAborted"}
            )
        if outcome == "ChatProgressNotStreaming":
            raise HordeRefusal(
                "not streaming", status=404, rc=outcome, body={"rc": outcome}
            )
        if outcome == "ChatProgressCapReached":
            raise HordeRefusal("cap", status=413, rc=outcome, body={"rc": outcome})
        if outcome == "out_of_sequence":
            expected = seq if isinstance(seq, int) else 1
            raise HordeRefusal(
                "out of sequence", status=409, rc="ChatProgressOutOfSequence",
                body={"rc": "ChatProgressOutOfSequence", "expected_seq": expected},
            )
        if outcome == "garbage":
            return {"accepted_seq": "x", "cancelled": "maybe"}
        if outcome == "cancel":
            if job is not None and job.state is None:
                job.state = "cancelled"
            return {"accepted_seq": seq, "cancelled": True}
        return {"accepted_seq": seq, "cancelled": False}

    def close(self) -> None:
        self.closed = True

    # -- results ---------------------------------------------------------------------

    def _failed(self, job: FakeJob | None) -> None:
        if job is not None:
            job.last_attempt_failed = True

    def verdict(self, job: FakeJob) -> str:
        """How this job ended, from the Horde's side (see the module docstring)."""
        if job.accepted > 1:
            return "double"
        if job.state in ("submitted", "faulted", "ended", "cancelled"):
            return job.state
        if job.attempts and job.last_attempt_failed and (
            job.last_attempt_at >= job.popped_at + job.ttl_s - 1e-6
        ):
            return "expired"
        return "lost"

    def verdicts(self) -> dict[str, str]:
        """``{job_id: verdict}`` for every popped job with a usable id."""
        return {job_id: self.verdict(job) for job_id, job in self.jobs.items()}

    def forget_settled(self) -> None:
        """Drop finished jobs (keeps a long soak's memory flat); call after counting them."""
        for job_id in [j for j, job in self.jobs.items() if job.state is not None]:
            del self.jobs[job_id]


def _lease_s(ttl: Any, default_s: float, cap_s: float) -> float:
    """A job's lease on the Horde: its ``ttl`` (a positive number), at most the cap."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        return default_s
    try:
        value = float(ttl)
    except OverflowError:
        return cap_s
    if not value > 0:  # NaN included
        return default_s
    return min(value, cap_s)


def _pop_error(name: str) -> Exception:
    if name == "unavailable":
        return HordeUnavailable("pop: HTTP 502", status=502)
    if name == "rate_limited":
        return HordeUnavailable("pop: HTTP 429", status=429, retry_after_s=2.0)
    if name == "lost":
        return HordeUnavailable("pop: connection lost", status=0, sent=None)
    if name == "maintenance":
        return HordeRefusal("in maintenance", status=403, rc="WorkerMaintenance")
    if name == "bad_request":
        return HordeRefusal("bad", status=400, rc="BadRequest")
    raise ValueError(name)


# ---------------------------------------------------------------- koboldcpp


class FakeStream:
    """A ``BackendStream`` over scripted chunks; an exception item is raised when reached."""

    def __init__(self, chunks: Iterable[bytes | BaseException]) -> None:
        self._chunks: deque[bytes | BaseException] = deque(chunks)
        self.closed = False

    def read_chunk(self) -> bytes:
        if self.closed or not self._chunks:
            return b""
        item = self._chunks.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.closed = True


BACKEND_ERRORS = ("error", "reset", "busy", "unauthorized", "server_error")
"""Errors a backend script may raise."""


def backend_error(name: str) -> Exception:
    """The ``errors`` exception the real ``KoboldClient`` raises for ``name``."""
    if name == "error":
        return BackendError("connection failed", status=0)
    if name == "reset":
        return BackendError("reading the answer failed: reset", status=200)
    if name == "busy":
        return BackendBusy("503 Server is busy", status=503)
    if name == "unauthorized":
        return BackendUnauthorized("401", status=401)
    if name == "server_error":
        return BackendError("HTTP 500", status=500)
    raise ValueError(name)


def chat_body(content: str = "Blue.", finish: str = "stop") -> dict[str, Any]:
    """A plausible koboldcpp chat completion answer."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "koboldcpp/fake",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": []},
                "finish_reason": finish,
            }
        ],
        "usage": {"prompt_tokens": 21, "completion_tokens": 3, "total_tokens": 24},
    }


def sse_chunks(text: str = "Blue sky.") -> list[bytes]:
    """A plausible koboldcpp event stream for ``text``, split mid-line."""
    import json

    events = []
    for i, piece in enumerate(text.split(" ")):
        delta = {"role": "assistant", "content": piece if i == 0 else " " + piece}
        events.append({"id": "koboldcpp", "choices": [{"index": 0, "delta": delta}]})
    events.append(
        {"id": "koboldcpp", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    )
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    raw += b"data: [DONE]\n\n"
    return [raw[i : i + 37] for i in range(0, len(raw), 37)]


class FakeBackend:
    """koboldcpp in process: each method takes the next scripted item, then behaves.

    Script items per method (deques, public): a value to return, an exception
    to raise, or for ``streams`` a list of chunks (bytes or exceptions).
    """

    def __init__(self) -> None:
        self.tokencounts: deque[Any] = deque()
        self.chats: deque[Any] = deque()
        self.streams: deque[Any] = deque()
        self.generates: deque[Any] = deque()
        self.aborts: deque[Any] = deque()
        self.calls: dict[str, int] = {}
        self.open_streams: list[FakeStream] = []
        self.last_timeout_s: dict[str, float] = {}

    def _count(self, name: str, timeout_s: float | None = None) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if timeout_s is not None:
            self.last_timeout_s[name] = timeout_s

    @staticmethod
    def _next(queue: deque[Any], default: Any) -> Any:
        item = queue.popleft() if queue else default
        if isinstance(item, BaseException):
            raise item
        return copy.deepcopy(item)

    def ready(self, *, timeout_s: float = 10.0) -> bool:
        return True

    def info(self, *, timeout_s: float = 10.0) -> BackendInfo:
        return BackendInfo(
            model_name="koboldcpp/fake", max_context_length=4096, vision=False,
            version="1.116.1",
        )

    def perf(self, *, timeout_s: float = 10.0) -> dict[str, Any]:
        return {"idle": 1, "queue": 0, "idletime": 1000.0}

    def tokencount(self, prompt: str, *, timeout_s: float) -> Any:
        self._count("tokencount", timeout_s)
        return self._next(self.tokencounts, max(1, len(prompt) // 4))

    def chat_completion(
        self,
        body: dict[str, Any] | bytes | bytearray,
        *,
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> Any:
        self._count("chat", timeout_s)
        return self._next(self.chats, chat_body())

    def open_chat_stream(
        self,
        body: dict[str, Any] | bytes | bytearray,
        *,
        read_timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> FakeStream:
        self._count("stream", read_timeout_s)
        item = self.streams.popleft() if self.streams else sse_chunks()
        if isinstance(item, BaseException):
            raise item
        stream = FakeStream(item)
        self.open_streams.append(stream)
        return stream

    def generate(
        self, payload: dict[str, Any], *, timeout_s: float, cancel: threading.Event | None = None
    ) -> Any:
        self._count("generate", timeout_s)
        return self._next(
            self.generates,
            {
                "results": [
                    {
                        "text": "Once upon a time.",
                        "finish_reason": "stop",
                        "prompt_tokens": 6,
                        "completion_tokens": 5,
                    }
                ]
            },
        )

    def abort(self, genkey: str, *, timeout_s: float = 10.0) -> Any:
        self._count("abort", timeout_s)
        return self._next(self.aborts, True)

    def hang_up(self) -> bool:
        self._count("hang_up")
        return False

    def close(self) -> None:
        self._count("close")


# ---------------------------------------------------------------- local use


class FakeManners(NoManners):
    """Local-use signals of a koboldcpp nobody else uses; tests override what they script.

    As :class:`NoManners` (reachable, no local user, not busy, not stopping,
    never changed, the worker's own requests noted nowhere), except that
    ``requests_queued`` is True (a manners that cannot tell: a busy koboldcpp
    is waited for even in the tail of the worker's own request).
    """

    def requests_queued(self) -> bool:
        return True


if TYPE_CHECKING:
    # The fakes implement the seams they stand in for (checked by mypy --strict).
    _clock: Clock = FakeClock()
    _horde: HordeAPI = FakeHorde(FakeClock())
    _backend: KcppAPI = FakeBackend()
    _stream: KcppStream = FakeStream(())
    _manners: LocalManners = FakeManners()
