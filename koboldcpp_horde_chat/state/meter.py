"""What a job's generation tells the guard: koboldcpp's speed, its failures,
a lease that ran out (thin glue between the loop and ``state/shared.py``).

Seed "Streaming progress" (the lease; "a slower worker without progress can
lose the job when the lease expires") and step 7 (an aborted job counts
toward the Horde's maintenance). The rules are pure and live elsewhere:
``lease_fit.LeaseFit`` fits the declared ``max_length`` to the measured
speed, ``guard.FailureStreak`` stops the popping after failed generations in
a row, ``guard.MaintenanceGuard`` counts the aborted jobs. This module only
turns a job's outcome into their plain numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from ..horde.pop import ChatJob, TextJob
from .job import SUBMIT_MARGIN_S, JobContext
from .lease_fit import job_max_length, perf_speed, reply_tokens
from .shared import WorkerState

log = logging.getLogger("koboldcpp_horde_chat.worker")

#: A failed generation that ended this close to its lease's end (seconds, with
#: the submit's margin) ran out of it.
RAN_OUT_SLACK_S = SUBMIT_MARGIN_S + 1.5


class _Perf(Protocol):
    def perf(self) -> dict[str, Any]: ...


class JobMeter:
    """Feeds each job's outcome to the guard's rules in ``state``.

    Args:
        state: the worker's shared state.
        backend: what reads koboldcpp's ``/api/extra/perf``.
        clock: monotonic seconds (the clock of ``ctx.started`` and the leases).
    """

    def __init__(self, state: WorkerState, backend: _Perf, clock: Callable[[], float]) -> None:
        self.state = state
        self.backend = backend
        self.clock = clock

    def read_speed(self) -> None:
        """koboldcpp's own speed figure (``/api/extra/perf``) for a first job
        before the worker measured any (best effort: none when it does not answer)."""
        try:
            perf = self.backend.perf()
        except Exception:  # noqa: BLE001 - only a hint; the jobs measure it anyway
            log.debug("koboldcpp's perf figures could not be read")
            return
        seed_speed(self.state, perf, now=self.clock())

    def generated(self, ctx: JobContext, job: TextJob | ChatJob, body: dict[str, Any]) -> None:
        """koboldcpp answered the job with the reply ``body`` (its submit body):
        a speed measurement, and the end of a streak of failed generations."""
        record_generated(
            self.state,
            ctx.kind,
            reply_tokens(body),
            self.clock() - ctx.started,
            max_length=job_max_length(job.payload),
            ttl_s=job.ttl_s,
            now=self.clock(),
        )

    def failed(self, ctx: JobContext, job: TextJob | ChatJob) -> None:
        """koboldcpp failed the job's generation: counted toward the streak that
        stops popping; one that ran out of its lease narrows the declaration."""
        now = self.clock()
        self._failed(ctx, job, ran_out=ctx.lease.remaining(now) <= RAN_OUT_SLACK_S, now=now)

    def failed_again(self, ctx: JobContext) -> None:
        """A job of a request whose generation koboldcpp failed twice lately, left
        to expire without a generation (``state/refaults.py``): counted toward the
        streak that stops popping as one more failed generation."""
        with self.state.lock:
            withdrawn = self.state.failure_streak.failed(ctx.kind)
            others = [k for k in self.state.kinds_to_pop() if k != ctx.kind]
        if withdrawn:
            log.warning(
                "%s", kind_withdrawn_line(ctx.kind, self.state.failure_streak.limit, others)
            )

    def ended_by_horde(self, ctx: JobContext, job: TextJob | ChatJob) -> None:
        """The Horde ended the job during its generation (``ChatJobAborted``: its
        lease ran out): an aborted job there, and a generation that ran out."""
        now = self.clock()
        self.state.record_expired(now, ctx.kind)
        self._failed(ctx, job, ran_out=True, now=now)

    def _failed(
        self, ctx: JobContext, job: TextJob | ChatJob, *, ran_out: bool, now: float
    ) -> None:
        record_generation_failed(
            self.state,
            ctx.kind,
            ran_out=ran_out,
            max_length=job_max_length(job.payload),
            seconds=now - ctx.started,
            ttl_s=job.ttl_s,
            now=now,
        )


# --- the rules' numbers, under the state's lock --------------------------------------


def seed_speed(state: WorkerState, perf: dict[str, Any], now: float | None = None) -> None:
    """koboldcpp's own speed figure (``/api/extra/perf``) before any job is measured
    (at monotonic ``now``: a kind it lowers is re-measured after its cool-off)."""
    with state.lock:
        changes = state.lease_fit.seed(perf_speed(perf), now)
    for change in changes:
        log.warning("%s (koboldcpp's own figure)", change.line())


def record_generated(
    state: WorkerState,
    kind: str,
    tokens: int,
    seconds: float,
    *,
    max_length: int,
    ttl_s: float,
    now: float | None = None,
) -> None:
    """koboldcpp answered a ``kind`` job of ``max_length`` tokens (base lease
    ``ttl_s``) with ``tokens`` in ``seconds`` at monotonic ``now`` (a probe too,
    of its kind): measure the speed, refit the declared ``max_length`` (one line
    when it changes) and end a streak of failed generations (one line when it
    gives the kind back, ``guard.FailureStreak``)."""
    with state.lock:
        state.lease_fit.note_lease(ttl_s)
        change = state.lease_fit.record(kind, tokens, seconds, max_length=max_length, now=now)
        restored = state.failure_streak.succeeded(kind)
    if change is not None:
        log.warning("%s", change.line())
    if restored:
        log.info("%s", kind_restored_line(kind))


def record_generation_failed(
    state: WorkerState,
    kind: str,
    *,
    ran_out: bool,
    max_length: int,
    seconds: float,
    ttl_s: float,
    now: float | None = None,
) -> None:
    """koboldcpp failed a ``kind`` job's generation (``ran_out``: it did not
    answer within the lease). A job that ran out narrows that kind's declared
    ``max_length`` (one line); the failure counts toward the streak after
    which the worker stops popping and probes koboldcpp."""
    with state.lock:
        state.lease_fit.note_lease(ttl_s)
        change = (
            state.lease_fit.ran_out(kind, max_length=max_length, seconds=seconds, now=now)
            if ran_out
            else None
        )
        withdrawn = state.failure_streak.failed(kind)
        others = [k for k in state.kinds_to_pop() if k != kind]
    if change is not None:
        log.warning("%s", change.line())
    if withdrawn:
        log.warning("%s", kind_withdrawn_line(kind, state.failure_streak.limit, others))


def kind_withdrawn_line(kind: str, limit: int, others: list[str]) -> str:
    """The line said when ``kind``'s generations failed ``limit`` times in a row and
    ``others`` are the kinds the worker still pops for, e.g. ``"chat generations
    failed 3 times in a row: popping without the chat declaration (text jobs
    continue); probing koboldcpp with a short chat completion until one succeeds"``."""
    if kind == "chat":
        action = (
            "popping without the chat declaration (text jobs continue)"
            if others else "not popping (no other kind to serve)"
        )
        probe = "a short chat completion"
    else:
        action = (
            "popping for chat jobs only (prompt_jobs false)"
            if others else "not popping (no other kind to serve)"
        )
        probe = "a short text generation"
    return (
        f"{kind} generations failed {limit} times in a row: {action}; probing "
        f"koboldcpp with {probe} until one succeeds"
    )


def kind_restored_line(kind: str) -> str:
    """The line said when ``kind`` generates again after it was withdrawn."""
    if kind == "chat":
        return "koboldcpp generates chat completions again: declaring chat again"
    return "koboldcpp generates text again: popping for text jobs again"
