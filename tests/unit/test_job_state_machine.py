"""A job's life through the real pop loop, as a hypothesis state machine.

The real :class:`~service.loop.Worker` (one or two slots sharing one
:class:`~state.shared.WorkerState` and a real :class:`~journal.Journal` in a
temporary folder) runs on the in-process fakes of ``bench/harness/fakes.py``. Rules,
in any order, queue chat and text jobs (streamed, with tools, offloaded to a
``messages_url``, malformed, without a usable id), script what the next pop,
submit or progress post answers and how koboldcpp's next call fails or how
long it takes, run one pass of a loop (with or without the pop beside the
submit, that pop held in flight or not), hold the submits retried on their own
threads, request a stop with a grace period, give up a job in hand, send the
second signal (``fault_jobs_now``), restart koboldcpp with another context,
and let time pass.

After every step, and at the end after the loops drained, the seed's rule
"every popped job ends in one terminal action" is checked from the Horde's
side and from the worker's:

* no job gets two accepted submits, nothing is sent for a job after a
  definitive answer (but the fault that follows a refused reply), nothing
  after a cancel or ``ChatJobAborted``;
* every job in hand is in the journal on disk (what a SIGKILL leaves);
* no pop is sent after the stop was requested (a pop already in flight
  beside a submit is allowed), nor by the loop while a submit is retried;
* a job in hand is always where the loop will come back to it (the answer of
  the pop beside a submit, or a submit retried on its own);
* no job is sent to koboldcpp once it is known to have restarted;
* at the end, every popped job was submitted, faulted, ended by the Horde,
  cancelled, or left to expire after its submits failed until its lease ran
  out, or else it is still in the journal (abandoned at exit, faulted by the
  next start); none is lost, and none is in hand after the stop's deadline.

Time is a :class:`FakeClock`, the worker's one clock (``clock.Clock``, given
to its shared state): the worker's waits, the stop's deadline, its grace timer and
the calls' deadlines all run on it, so that the stop's deadline comes at a
step the machine chose; no module of the worker is patched for it. The threads the worker starts (the pop beside a
submit, a submit retried on its own) run only while the machine waits for
them at the end of a step, one at a time, so that a run can be replayed.

Seed: "The pop loop", "7. Fault a job", "Submit refusals", "Streaming
progress", "Fetch offloaded messages".
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import threading
import time
import time as _real_time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from bench.harness.fakes import (
    FakeBackend,
    FakeClock,
    FakeHorde,
    FakeManners,
    FakeStopEvent,
    FakeStream,
    FakeTimer,
    backend_error,
    sse_chunks,
)
from koboldcpp_horde_chat.errors import BackendError, FetchError, HordeRefusal, HordeUnavailable
from koboldcpp_horde_chat.run import chat as chat_run
from koboldcpp_horde_chat.service.loop import Worker
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.journal import Journal
from koboldcpp_horde_chat.state.life import Phase
from koboldcpp_horde_chat.state.shared import WorkerState

MODEL = "koboldcpp/fake"
#: Real seconds the machine waits for a thread of the worker before calling it hung.
HUNG_S = 10.0
#: Verdicts (``FakeHorde.verdict``) of a job whose life ended as the seed allows.
ENDED_WELL = frozenset({"submitted", "faulted", "ended", "cancelled", "expired"})


# --- the fake clock runs the stop's deadline too ----------------------------------------


class TimerClock(FakeClock):
    """A :class:`FakeClock` (it runs the timers due when it passes their time)
    whose wall time stays the real one, as the journal's own marks are: the
    worker's ``clock.Clock``, given to the shared state, so the loops, the
    leases, the stop's deadline and the calls' deadlines all run on it."""

    def __init__(self) -> None:
        super().__init__()
        #: Called just before a timer's action (the stop's deadline came).
        self.on_fire: list[Callable[[], None]] = []

    def time(self) -> float:
        return _real_time.time()

    def run_timer(self, timer: FakeTimer) -> None:
        for hook in self.on_fire:
            hook()
        super().run_timer(timer)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Wait (real time, briefly) for a thread of the worker to reach a point."""
    end = time.monotonic() + HUNG_S
    while not condition():
        assert time.monotonic() < end, f"hung: {what}"
        time.sleep(0.0002)


# --- the Horde, koboldcpp and the messages host, as the machine scripts them ------------


class SeamHorde(FakeHorde):
    """The fake Horde, also recording what the invariants need: pops sent (counted
    when they go out, before any answer), the loop's pops while a submit is
    retried, and submits sent after a definitive answer for their job."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.keep_pop_bodies = False
        self.state: WorkerState | None = None
        self.pops_sent = 0
        self.loop_pops_while_retrying = 0
        self.final: set[str] = set()
        self.reply_refused: set[str] = set()
        self.after_final: list[tuple[str, object]] = []
        self.retried_after_deadline: list[str] = []
        self._lock = threading.Lock()

    def pop(
        self, body: dict[str, Any], *, timeout_s: float, beside: AheadPops | None = None
    ) -> dict[str, Any]:
        with self._lock:
            self.pops_sent += 1
            if beside is None and self.state is not None and self.state.retrying_submits:
                self.loop_pops_while_retrying += 1
        if beside is not None:
            beside.in_flight()
        return super().pop(body, timeout_s=timeout_s)

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        job_id = str(body.get("id"))
        faulted = body.get("state") == "faulted"
        job = self.jobs.get(job_id)
        deadline = self.state.stop_deadline if self.state is not None else None
        with self._lock:
            if job_id in self.final or (job_id in self.reply_refused and not faulted):
                self.after_final.append((job_id, body.get("state")))
            if (
                deadline is not None and job is not None and job.last_attempt_failed
                and job.last_attempt_at > deadline
            ):
                self.retried_after_deadline.append(job_id)
        try:
            answer = super().submit(body, timeout_s=timeout_s)
        except HordeRefusal as exc:
            with self._lock:
                definitive = (
                    faulted
                    or exc.rc in ("DuplicateGen", "AbortedGen")
                    or exc.status in (401, 403, 404)
                )
                (self.final if definitive else self.reply_refused).add(job_id)
            raise
        with self._lock:
            self.final.add(job_id)
        return answer


class AheadPops:
    """One slot's Horde client for the pop sent beside a submit: that pop can be
    held in flight (sent, not yet answered) across the machine's steps."""

    def __init__(self, horde: SeamHorde) -> None:
        self.horde = horde
        self.hold = False
        self.held = 0
        self.dead = False
        self._gate = threading.Event()
        self._lock = threading.Lock()

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        return self.horde.pop(body, timeout_s=timeout_s, beside=self)

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        raise AssertionError("the client of the pop beside a submit only pops")

    def progress(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        raise AssertionError("the client of the pop beside a submit only pops")

    def close(self) -> None:
        return None

    def in_flight(self) -> None:
        if not self.hold:
            return
        with self._lock:
            self.held += 1
        self._gate.wait(HUNG_S)
        with self._lock:
            self.held -= 1
        if self.dead:  # the process exited before the answer came
            raise HordeUnavailable("pop: connection lost", status=0, sent=None)

    def release(self) -> None:
        self.hold = False
        self._gate.set()
        self._gate = threading.Event()


class RetryClient:
    """The Horde client of one submit retried on its own thread."""

    def __init__(self, horde: SeamHorde) -> None:
        self.horde = horde
        self.closed = threading.Event()

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        raise AssertionError("the client of a submit retried on its own thread only submits")

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        return self.horde.submit(body, timeout_s=timeout_s)

    def progress(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        raise AssertionError("the client of a submit retried on its own thread only submits")

    def close(self) -> None:
        """The retry thread's last step: its job was released."""
        self.closed.set()


class RetryDesk:
    """Makes the Horde clients of submits retried on threads of their own, and
    lets those threads go on one at a time when the machine says so. A client
    made elsewhere (the loop's, for replies sent beside the next job) is not held."""

    def __init__(self, horde: SeamHorde) -> None:
        self.horde = horde
        self.waiting: deque[tuple[threading.Event, RetryClient]] = deque()
        self.hold = False
        self._lock = threading.Lock()

    def make(self) -> RetryClient:
        client = RetryClient(self.horde)
        if not threading.current_thread().name.startswith("submit-retry-"):
            return client  # the client of replies sent beside the next job, made by the loop
        go = threading.Event()
        with self._lock:
            self.waiting.append((go, client))
        go.wait(HUNG_S)
        return client

    def arrived(self) -> int:
        with self._lock:
            return len(self.waiting)

    def release_one(self) -> threading.Event:
        """Let the first retry thread go on; its ``closed`` is set when it ended."""
        with self._lock:
            go, client = self.waiting.popleft()
        go.set()
        return client.closed


class SeamBackend(FakeBackend):
    """koboldcpp in process whose next calls may also take time (on the fake clock).

    A call's scripted answer is taken when it is called, then its time passes;
    a call slower than its timeout raises as the real client does.
    """

    SLOW = ("tokencount", "chat", "generate")

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self.slow: dict[str, deque[float]] = {name: deque() for name in self.SLOW}
        self.generations = 0

    def _takes(self, name: str, timeout_s: float) -> None:
        delay = self.slow[name].popleft() if self.slow[name] else 0.0
        if delay > timeout_s:
            self.clock.advance(timeout_s)
            raise BackendError(f"{name}: read timed out", status=0)
        self.clock.advance(delay)

    def tokencount(self, prompt: str, *, timeout_s: float) -> Any:
        answer = super().tokencount(prompt, timeout_s=timeout_s)
        self._takes("tokencount", timeout_s)
        return answer

    def chat_completion(
        self,
        body: dict[str, Any] | bytes | bytearray,
        *,
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> Any:
        self.generations += 1
        answer = super().chat_completion(body, timeout_s=timeout_s, cancel=cancel)
        self._takes("chat", timeout_s)
        return answer

    def open_chat_stream(
        self,
        body: dict[str, Any] | bytes | bytearray,
        *,
        read_timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> FakeStream:
        self.generations += 1
        return super().open_chat_stream(body, read_timeout_s=read_timeout_s, cancel=cancel)

    def generate(
        self, payload: dict[str, Any], *, timeout_s: float, cancel: threading.Event | None = None
    ) -> Any:
        self.generations += 1
        answer = super().generate(payload, timeout_s=timeout_s, cancel=cancel)
        self._takes("generate", timeout_s)
        return answer


class MessagesHost:
    """The host of offloaded messages (``run.chat.fetch_messages``), scripted."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.script: deque[str | float] = deque()

    def fetch(self, url: str, *, timeout_s: float, max_bytes: int) -> list[Any]:
        item = self.script.popleft() if self.script else 0.0
        if isinstance(item, str):
            raise FetchError(f"messages_url: {item}")
        if item > timeout_s:
            self.clock.advance(timeout_s)
            raise FetchError("messages_url: timed out")
        self.clock.advance(item)
        return [{"role": "user", "content": "Name one colour."}]


class Manners(FakeManners):
    """Local-use signals of a koboldcpp nobody else uses, which may restart with
    another context (seen by another loop's read, say)."""

    def __init__(self) -> None:
        self.changed: str | None = None

    def should_stop(self) -> bool:
        return self.changed is not None

    def recheck(self) -> str | None:
        return self.changed


# --- jobs -----------------------------------------------------------------------------

JOB_KINDS = ("chat", "stream", "tools", "messages_url", "text", "malformed", "no_id")


def job_pop(kind: str, job_id: str, ttl: int) -> dict[str, Any]:
    """A pop answer carrying a job of ``kind``, of a request of its own (its payload
    names the job: a payload faulted twice that comes back is left to expire,
    tests/integration/test_refaults.py)."""
    if kind == "text":
        return {
            "payload": {"prompt": f"Once ({job_id})", "max_length": 40, "max_context_length": 1024},
            "id": job_id, "ids": [job_id], "ttl": ttl, "model": MODEL,
        }
    payload: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"Name one colour. ({job_id})"}],
        "temperature": 1.0, "top_p": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "rep_pen": 1.0, "top_k": 0, "min_p": 0.0, "max_length": 64,
        "max_context_length": 2048, "n": 1,
    }
    if kind == "stream":
        payload["stream_progress"] = True
    elif kind == "tools":
        payload["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        payload["tool_choice"] = "required"
    elif kind == "messages_url":
        del payload["messages"]
        payload["messages_url"] = f"https://messages.invalid/m/{job_id}"
    pop: dict[str, Any] = {
        "payload": payload, "id": job_id, "ids": [job_id], "messages": [], "ttl": ttl,
        "skipped": {}, "model": MODEL, "chat": True,
    }
    if kind == "malformed":
        pop["payload"] = f"not an object ({job_id})"
    elif kind == "no_id":
        pop["id"] = 5
    return pop


SUBMIT_ANSWERS = (
    "ok", "lost_before", "lost_after", "unavailable", "unavailable", "AbortedGen", "not_found",
    "ChatSubmitInvalid", "ChatSubmitNonconformant", "bad_request", "key_refused",
)
#: Grace periods of a requested stop, seconds (``--stop-grace``).
GRACES_S = (0.0, 1.0, 10.0, 60.0)
SCRIPTS = st.one_of(
    st.tuples(st.just("pop"), st.sampled_from(("unavailable", "lost", "rate_limited"))),
    st.tuples(st.just("outage"), st.integers(1, 30)),
    st.tuples(st.just("progress"), st.sampled_from(
        ("cancel", "lost", "unavailable", "ChatJobAborted", "ChatProgressCapReached"))),
    st.tuples(st.just("kcpp"), st.sampled_from(("tokencount", "chat", "generate")),
              st.sampled_from(("error", "reset", "server_error", "busy", "unauthorized"))),
    st.tuples(st.just("stream"),
              st.sampled_from(("error", "reset", "server_error", "unauthorized", "cut"))),
    st.tuples(st.just("slow"), st.sampled_from(SeamBackend.SLOW),
              st.sampled_from((2.0, 20.0, 90.0, 400.0))),
    st.tuples(st.just("messages"), st.sampled_from(("HTTP 404", 1.0, 30.0, 200.0))),
)
"""What the next answer of one edge is (``JobLife.script_the_next_answer``)."""


# --- the machine ------------------------------------------------------------------------


class JobLife(RuleBasedStateMachine):
    """One worker's loops, driven step by step (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = TimerClock()
        self.folder = Path(tempfile.mkdtemp(prefix="job-life-"))
        self.journal_path = self.folder / "jobs.json"
        self.horde = SeamHorde(self.clock)
        self.desk = RetryDesk(self.horde)
        self.backend = SeamBackend(self.clock)
        self.messages = MessagesHost(self.clock)
        self.manners = Manners()
        self.workers: list[Worker] = []
        self.ahead: list[AheadPops] = []
        self.state: WorkerState | None = None
        self.next_id = 0
        self.passes = 0
        self.pops_at_stop: int | None = None
        self.generations_at_restart: int | None = None
        self.generations_at_deadline: int | None = None
        self.clock.on_fire.append(self.deadline_came)
        self.stopped = False
        self.exited = False
        chat_run.fetch_messages = self.messages.fetch  # type: ignore[assignment,attr-defined]

    # -- building ---------------------------------------------------------------------

    @initialize(slots=st.sampled_from((1, 2)))
    def build(self, slots: int) -> None:
        options = WorkerSettings(
            api_key="machine-key-5f2e9c", worker_name="machine", model_id=MODEL,
            backend_max_context_length=4096, max_length=512, threads=slots,
        )
        stop = FakeStopEvent(self.clock)
        state = WorkerState(
            options, stop_event=stop, journal=Journal(self.journal_path), clock=self.clock
        )
        self.state = state
        self.horde.state = state
        for worker_id in range(1, slots + 1):
            ahead = AheadPops(self.horde)
            worker = Worker(
                options,
                horde=self.horde,
                backend=self.backend,
                manners=self.manners,
                worker_id=worker_id,
                state=state,
                pop_horde=ahead,
                retry_horde=self.desk.make,
            )
            state.slots.append(worker.driver)
            self.workers.append(worker)
            self.ahead.append(ahead)

    @property
    def ws(self) -> WorkerState:
        assert self.state is not None
        return self.state

    # -- the threads the worker starts run here, one at a time --------------------------

    def settle_threads(self, *, retries: bool = True) -> None:
        """Wait for each slot's pop beside a submit to be answered (or held in
        flight) and its reply sent beside the next job to be answered, then let
        the submits retried on their own go on, one by one, unless they are held."""
        for worker, ahead in zip(self.workers, self.ahead, strict=True):
            pending = worker.next_pop.ahead
            if pending is not None:
                wait_until(lambda p=pending, a=ahead: p.join(0.001) or a.held > 0,  # type: ignore[misc]
                           "the pop beside a submit")
        for worker in self.workers:
            beside = worker.pipeline._beside_thread  # noqa: SLF001 - a reply sent beside
            if beside is not None:
                wait_until(lambda b=beside: not b.is_alive(),  # type: ignore[misc]
                           "a reply sent beside the next job")
        state = self.ws
        wait_until(lambda: self.desk.arrived() == state.retrying_submits, "a submit retry start")
        while retries and not self.desk.hold and state.retrying_submits:
            closed = self.desk.release_one()
            wait_until(closed.is_set, "a submit retried on its own")
            wait_until(lambda: self.desk.arrived() == state.retrying_submits,
                       "a submit retry start")

    def release_held_pops(self) -> None:
        for ahead in self.ahead:
            ahead.release()
        self.settle_threads()

    def deadline_came(self) -> None:
        if self.generations_at_deadline is None:
            self.generations_at_deadline = self.backend.generations

    def seam(self, what: str) -> str:
        """``what`` and where the jobs are at that instant (for ``event``)."""
        where = []
        if any(a.held for a in self.ahead):
            where.append("a pop in flight beside a submit")
        if self.ws.retrying_submits:
            where.append("a submit retried")
        if any(w.next_pop.ahead is not None and w.next_pop.ahead.ctx is not None for w in self.workers):
            where.append("a job waiting behind a submit")
        return f"{what} with " + (", ".join(where) or "no job in hand")

    def new_id(self) -> str:
        self.next_id += 1
        return f"job-{self.next_id}"

    # -- what the Horde and koboldcpp will do --------------------------------------------

    @rule(what=SCRIPTS)
    def script_the_next_answer(self, what: tuple[Any, ...]) -> None:
        """What the next pop, submit, progress post, koboldcpp call or messages
        fetch does."""
        kind, *args = what
        if kind == "pop":
            self.horde.pops.append(args[0])
        elif kind == "outage":  # the next submits get no answer
            self.horde.submit_script.extend(["unavailable"] * args[0])
        elif kind == "progress":
            self.horde.progress_script.append(args[0])
        elif kind == "kcpp":
            call, failure = args
            queue = {"tokencount": self.backend.tokencounts, "chat": self.backend.chats,
                     "generate": self.backend.generates}[call]
            queue.append(backend_error(failure))
        elif kind == "stream":
            cut = sse_chunks()[:3] + [backend_error("reset")]
            self.backend.streams.append(cut if args[0] == "cut" else backend_error(args[0]))
        elif kind == "slow":
            self.backend.slow[args[0]].append(args[1])
        else:
            self.messages.script.append(args[0])

    @precondition(
        lambda self: self.manners.changed is None and not self.exited and self.passes >= 4
    )
    @rule()
    def koboldcpp_restarts_with_a_smaller_context(self) -> None:
        """Another loop's read saw koboldcpp come back with a smaller context: the
        worker stops (``should_stop``) and serves nothing more under the old one."""
        self.manners.changed = (
            "koboldcpp restarted with koboldcpp/fake (context 2048) "
            "(it served koboldcpp/fake (context 4096))"
        )
        self.generations_at_restart = self.backend.generations
        if self.pops_at_stop is None:
            self.pops_at_stop = self.horde.pops_sent

    # -- the loop --------------------------------------------------------------------------

    @precondition(lambda self: not self.exited)
    @rule(
        jobs=st.lists(st.tuples(st.sampled_from(JOB_KINDS), st.sampled_from((150, 30, 8))),
                      max_size=2),
        submits=st.lists(st.sampled_from(SUBMIT_ANSWERS), max_size=3)
        | st.integers(2, 20).map(lambda n: ["unavailable"] * n),
        slot=st.integers(0, 1),
        beside=st.booleans(),
        hold=st.booleans(),
        hold_retries=st.booleans(),
        stop=st.sampled_from((None,) * 16 + GRACES_S),
    )
    def run_once(
        self, jobs: list[tuple[str, int]], submits: list[str], slot: int, beside: bool,
        hold: bool, hold_retries: bool, stop: float | None,
    ) -> None:
        """One pass of a loop, after ``jobs`` are queued and the next submits'
        answers scripted (an outage, say); the pop beside its submit (when sent)
        may stay in flight, a submit retried on its own may wait, and the stop may
        be requested right after the pass (a signal at that instant of the job's
        life)."""
        self.desk.hold = hold_retries
        for kind, ttl in jobs:
            self.horde.pops.append(job_pop(kind, self.new_id(), ttl))
        self.horde.submit_script.extend(submits)
        self.release_held_pops()
        index = slot % len(self.workers)
        worker, ahead = self.workers[index], self.ahead[index]
        worker.pop_horde = ahead if beside else None
        ahead.hold = beside and hold
        worker.run_once()
        self.passes += 1
        self.settle_threads()
        if stop is not None and not self.stopped:
            self.request_stop(stop)

    @precondition(lambda self: not self.exited)
    @rule(
        slot=st.integers(0, 1),
        passes=st.integers(2, 4),
        jobs=st.lists(st.sampled_from(JOB_KINDS), max_size=4),
    )
    def run_passes(self, slot: int, passes: int, jobs: list[str]) -> None:
        """A few passes of a loop (after ``jobs`` are queued), the pop beside each
        submit sent and answered."""
        for kind in jobs:
            self.horde.pops.append(job_pop(kind, self.new_id(), 150))
        self.release_held_pops()
        worker = self.workers[slot % len(self.workers)]
        worker.pop_horde = self.ahead[slot % len(self.workers)]
        for _ in range(passes):
            worker.run_once()
            self.passes += 1
            self.settle_threads()

    @precondition(lambda self: not self.exited)
    @rule(hold=st.booleans())
    def hold_submit_retries(self, hold: bool) -> None:
        """Submits retried on their own threads wait (or go on) meanwhile."""
        self.desk.hold = hold
        self.settle_threads()

    @rule(seconds=st.sampled_from((0.5, 3.0, 20.0, 100.0, 250.0)))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.settle_threads()

    # -- the stop ------------------------------------------------------------------------

    @precondition(lambda self: not self.stopped and not self.exited and self.passes >= 2)
    @rule(grace=st.sampled_from(GRACES_S))
    def request_stop(self, grace: float) -> None:
        """The first signal: stop popping, give the jobs in hand ``grace`` seconds."""
        self.stopped = True
        if self.pops_at_stop is None:
            self.pops_at_stop = self.horde.pops_sent
        event(self.seam("stop"))
        self.ws.request_stop(grace)
        self.settle_threads()

    @precondition(lambda self: not self.exited)
    @rule(pick=st.integers(0, 7))
    def give_up_a_job_in_hand(self, pick: int) -> None:
        """The stop's deadline for one job (as ``WorkerState`` gives one up)."""
        in_hand = sorted(self.ws.jobs_in_hand(), key=lambda c: c.id)
        event(self.seam("give up"))
        if in_hand:
            in_hand[pick % len(in_hand)].give_up("given up by the machine")
        self.settle_threads()

    @precondition(lambda self: self.stopped and not self.exited and self.passes >= 4)
    @rule()
    def second_signal(self) -> None:
        """Fault the jobs in hand at once; the process then exits."""
        event(self.seam("second signal"))
        self.ws.fault_jobs_now()
        self.exited = True

    # -- invariants ----------------------------------------------------------------------

    def on_disk(self) -> set[str]:
        """The jobs the journal file holds now (what a SIGKILL would leave)."""
        return {entry.job_id for entry in Journal(self.journal_path).load()}

    @invariant()
    def one_terminal_action_and_nothing_after_it(self) -> None:
        horde = self.horde
        double = {j: job.accepted for j, job in horde.jobs.items() if job.accepted > 1}
        assert not double, f"two submits accepted: {double}"
        late = {j: job.late_submits for j, job in horde.jobs.items() if job.late_submits}
        assert not late, f"submitted after a cancel, an end or a refusal: {late}"
        assert not horde.after_final, f"sent after a definitive answer: {horde.after_final}"

    @invariant()
    def every_job_in_hand_is_journaled(self) -> None:
        if self.state is None:
            return
        in_hand = {c.id for c in self.ws.jobs_in_hand()}
        missing = in_hand - self.on_disk()
        assert not missing, f"in hand but not in the journal: {sorted(missing)}"

    @invariant()
    def no_pop_after_the_stop(self) -> None:
        if self.pops_at_stop is not None:
            assert self.horde.pops_sent <= self.pops_at_stop, (
                f"{self.horde.pops_sent - self.pops_at_stop} pop(s) sent after the stop"
            )
        assert self.horde.loop_pops_while_retrying == 0, "the loop popped while a submit retried"

    @invariant()
    def a_job_in_hand_is_one_the_loop_comes_back_to(self) -> None:
        if self.state is None or self.exited:
            return
        waiting = {
            w.next_pop.ahead.ctx.id for w in self.workers
            if w.next_pop.ahead is not None and w.next_pop.ahead.ctx is not None
        }
        for ctx in self.ws.jobs_in_hand():
            assert ctx.id in waiting or ctx.phase is Phase.SETTLING, (
                f"job {ctx.id} in hand in phase {ctx.phase.value}, and nothing will end it"
            )

    @invariant()
    def nothing_generated_or_retried_after_the_stops_deadline(self) -> None:
        """A job given up at the deadline, or received after it, is faulted, not
        served; a submit that fails after it is left to the journal, not retried."""
        if self.generations_at_deadline is not None:
            assert self.backend.generations == self.generations_at_deadline, (
                "a job was sent to koboldcpp after the stop's deadline"
            )
        assert not self.horde.retried_after_deadline, (
            f"submits retried after the stop's deadline: {self.horde.retried_after_deadline}"
        )

    @invariant()
    def nothing_sent_to_a_restarted_koboldcpp(self) -> None:
        if self.generations_at_restart is not None:
            assert self.backend.generations == self.generations_at_restart, (
                "a job popped under the old declaration was sent to the restarted koboldcpp"
            )

    # -- the end -------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            if self.state is not None:
                if self.exited:
                    self.check_the_end()
                else:
                    self.drain_and_check()
        finally:
            for ahead in self.ahead:
                ahead.dead = True
                ahead.release()
            self.desk.hold = False
            while self.desk.arrived():
                self.desk.release_one()
            if self.state is not None:
                state = self.state
                end = time.monotonic() + HUNG_S
                while state.retrying_submits and time.monotonic() < end:
                    time.sleep(0.001)
            shutil.rmtree(self.folder, ignore_errors=True)

    def drain_and_check(self) -> None:
        """Stop (when no step did), let the loops drain and the retries end, let the
        stop's deadline pass: then nothing is in hand, and no job is lost."""
        state = self.ws
        if not self.stopped:
            self.stopped = True
            if self.pops_at_stop is None:
                self.pops_at_stop = self.horde.pops_sent
            state.request_stop(10.0)
        self.desk.hold = False
        self.release_held_pops()
        for worker in self.workers:
            worker.drain()
            self.settle_threads()
        self.clock.advance(max(0.0, (state.stop_deadline or 0.0) - self.clock()) + 1.0)
        self.settle_threads()
        self.no_pop_after_the_stop()
        self.one_terminal_action_and_nothing_after_it()
        self.nothing_sent_to_a_restarted_koboldcpp()
        self.nothing_generated_or_retried_after_the_stops_deadline()
        left = [(c.id, c.phase.value) for c in state.jobs_in_hand()]
        assert not left, f"in hand after the stop's deadline, the loops drained: {left}"
        self.check_the_end()

    def check_the_end(self) -> None:
        """Every popped job ended as the seed allows, or is in the journal for the
        next start to fault (abandoned at exit)."""
        self.every_job_in_hand_is_journaled()
        journaled = self.on_disk()
        lost = {
            job_id: verdict
            for job_id, verdict in self.horde.verdicts().items()
            if verdict not in ENDED_WELL and job_id not in journaled
        }
        assert not lost, f"popped and lost (no terminal action, not in the journal): {lost}"


@pytest.fixture
def quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Quiet logs (thousands of faults log thousands of warnings); the messages
    host the machine scripts put back afterwards."""
    monkeypatch.setattr(chat_run, "fetch_messages", chat_run.fetch_messages)  # type: ignore[attr-defined]
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def test_a_jobs_life_through_the_real_loop_keeps_every_seam(quiet: None) -> None:
    run_state_machine_as_test(  # type: ignore[no-untyped-call, unused-ignore]
        JobLife,
        settings=settings(
            max_examples=150,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


# --- what the machine found, as plain examples ----------------------------------------------


def test_a_job_popped_beside_a_submit_is_not_served_once_koboldcpp_is_known_to_have_changed() -> None:
    """The pop beside the first job's submit brings a second job; before the loop
    serves it, another loop's read of koboldcpp saw it come back with a smaller
    context. The second job, popped under the old declaration, is faulted at
    once: koboldcpp gets no request for it."""
    from tests.unit.test_loop_decisions import chat_pop

    clock = FakeClock()
    horde = FakeHorde(clock, pops=[chat_pop("j1"), chat_pop("j2")])
    backend = FakeBackend()
    manners = Manners()
    options = WorkerSettings(api_key="machine-key-5f2e9c", worker_name="machine", model_id=MODEL,
                             backend_max_context_length=4096, max_length=512)
    worker = Worker(
        options,
        horde=horde,
        backend=backend,
        manners=manners,
        state=WorkerState(options, stop_event=FakeStopEvent(clock), clock=clock),
        pop_horde=horde,
    )
    worker.run_once()  # j1 served; j2 popped beside its submit
    ahead = worker.next_pop.ahead
    assert ahead is not None and ahead.join(5.0) and ahead.ctx is not None
    manners.changed = "koboldcpp restarted with koboldcpp/fake (context 2048)"
    worker.run_once()
    assert horde.verdicts() == {"j1": "submitted", "j2": "faulted"}
    assert backend.calls.get("chat") == 1  # j1's only


def test_a_reply_sent_beside_the_next_job_leaves_the_retried_submits_to_their_own_threads(
    quiet: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence the machine found: a text generation of 2 s teaches the loop to
    pop during the next one and to send that job's reply beside the job it brings.
    The reply's Horde client is made on the loop's thread; the machine must not
    take it for a submit retried on its own (it held the loop 10 s, then waited
    forever for a retry that never started). Every job still ends once."""
    monkeypatch.setattr(sys.modules[__name__], "event", lambda *args, **kwargs: None)
    machine = JobLife()
    machine.build(slots=1)
    machine.script_the_next_answer(what=("slow", "generate", 2.0))
    machine.give_up_a_job_in_hand(pick=0)
    machine.hold_submit_retries(hold=False)
    machine.run_once(beside=True, hold=False, hold_retries=False, jobs=[], slot=0, stop=None,
                     submits=[])
    started = time.monotonic()
    machine.run_passes(jobs=["chat", "text", "text", "text"], passes=4, slot=0)
    assert time.monotonic() - started < HUNG_S / 2
    machine.one_terminal_action_and_nothing_after_it()
    machine.teardown()
