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
from .lease_fit import PerfFigures, job_max_length, perf_figures, perf_speed, reply_tokens
from .shared import WorkerState

log = logging.getLogger("koboldcpp_horde_chat.worker")

#: A failed generation that ended this close to its lease's end (seconds, with
#: the submit's margin) ran out of it.
RAN_OUT_SLACK_S = SUBMIT_MARGIN_S + 1.5
#: Read timeout of the ``/api/extra/perf`` look after a generation, seconds.
PERF_TIMEOUT_S = 2.0


class _Perf(Protocol):
    def perf(self, *, timeout_s: float = ...) -> dict[str, Any]: ...


class FiguresReader:
    """koboldcpp's figures of the generation that just ended (``/api/extra/perf``,
    ``lease_fit.perf_figures``), best effort: None when it does not answer, has
    none, or has counted no generation since the last read; after a generation
    aborted at its deadline, also when its figures are the last read's
    (koboldcpp counts a generation when it starts and writes its figures when
    it ends: they would be an older one's). Only with one loop:
    with several, koboldcpp's last generation may be another loop's."""

    def __init__(self, backend: _Perf, *, threads: int = 1) -> None:
        self.backend = backend
        self.threads = threads
        self._seen: int | None = None
        self._last: tuple[int, float, int, float] | None = None

    def saw(self, figures: PerfFigures) -> None:
        """``figures`` were read elsewhere (koboldcpp's at start): not new."""
        self._seen = figures.generations
        self._last = (figures.prompt_tokens, figures.process_s, figures.tokens, figures.eval_s)

    def read(self, *, aborted: bool = False) -> PerfFigures | None:
        """The figures of koboldcpp's newest generation (``aborted``: one aborted
        at its deadline), or None (see the class)."""
        if self.threads > 1:
            return None
        try:
            figures = perf_figures(self.backend.perf(timeout_s=PERF_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - only a measure; the job's own timing stands
            return None
        if figures is None or figures.generations == self._seen:
            return None
        self._seen = figures.generations
        these = (figures.prompt_tokens, figures.process_s, figures.tokens, figures.eval_s)
        stale = these == self._last
        self._last = these
        return None if aborted and stale else figures


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
        self.figures = FiguresReader(backend, threads=state.settings.threads)

    def read_speed(self) -> None:
        """koboldcpp's own speed figure (``/api/extra/perf``) for a first job
        before the worker measured any (best effort: none when it does not answer)."""
        try:
            perf = self.backend.perf()
        except Exception:  # noqa: BLE001 - only a hint; the jobs measure it anyway
            log.debug("koboldcpp's perf figures could not be read")
            return
        seed_speed(self.state, perf, now=self.clock())
        figures = perf_figures(perf)
        if figures is not None:
            self.figures.saw(figures)

    def generated(self, ctx: JobContext, job: TextJob | ChatJob, body: dict[str, Any]) -> None:
        """koboldcpp answered the job with the reply ``body`` (its submit body):
        a speed measurement, and the end of a streak of failed generations."""
        seconds = self.clock() - ctx.started
        record_generated(
            self.state,
            ctx.kind,
            reply_tokens(body),
            seconds,
            max_length=job_max_length(job.payload),
            ttl_s=job.ttl_s,
            now=self.clock(),
            figures=self.figures.read(),
            probe=False,
        )

    def failed(self, ctx: JobContext, job: TextJob | ChatJob) -> None:
        """koboldcpp failed the job's generation: counted toward the streak that
        stops popping; one that ran out of its lease narrows the declaration."""
        now = self.clock()
        ran_out = ctx.lease.remaining(now) <= RAN_OUT_SLACK_S
        # The aborted generation's figures: did it produce anything by its deadline?
        figures = self.figures.read(aborted=True) if ran_out else None
        self._failed(
            ctx, job, ran_out=ran_out, now=now,
            produced=figures.tokens if figures is not None else None,
        )

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
        self._failed(ctx, job, ran_out=True, now=now, produced=None)

    def _failed(
        self, ctx: JobContext, job: TextJob | ChatJob, *, ran_out: bool, now: float,
        produced: int | None,
    ) -> None:
        record_generation_failed(
            self.state,
            ctx.kind,
            ran_out=ran_out,
            max_length=job_max_length(job.payload),
            seconds=now - ctx.started,
            ttl_s=job.ttl_s,
            now=now,
            prompt_tokens=ctx.prompt_tokens,
            produced=produced,
        )


# --- the rules' numbers, under the state's lock --------------------------------------


def seed_speed(state: WorkerState, perf: dict[str, Any], now: float | None = None) -> None:
    """koboldcpp's own speed figure (``/api/extra/perf``) before any job is measured
    (at monotonic ``now``: a kind it lowers is re-measured after its cool-off)."""
    figures = perf_figures(perf)
    process_s = (
        figures.process_s / figures.prompt_tokens
        if figures is not None and figures.prompt_tokens >= 16 and figures.process_s > 0
        else None
    )
    with state.lock:
        changes = state.lease_fit.seed(perf_speed(perf), now, process_s=process_s)
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
    figures: PerfFigures | None = None,
    probe: bool = True,
) -> None:
    """koboldcpp answered a ``kind`` job of ``max_length`` tokens (base lease
    ``ttl_s``) with ``tokens`` in ``seconds`` at monotonic ``now`` (a ``probe``
    too, of its kind), koboldcpp's ``figures`` of it when read: measure the
    speeds, refit the declared limits (one line per change) and end a streak of
    failed generations (one line when it gives the kind back,
    ``guard.FailureStreak``). A real job (not a ``probe``) counts toward the
    sustained success that starts the probes' waits over (``state.probes``)."""
    with state.lock:
        state.lease_fit.note_lease(ttl_s)
        changes = state.lease_fit.record(
            kind, tokens, seconds, max_length=max_length, now=now, figures=figures
        )
        restored = state.failure_streak.succeeded(kind)
        if not probe:
            state.probe_plan.job_succeeded(kind)
    for change in changes:
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
    prompt_tokens: int | None = None,
    produced: int | None = None,
) -> None:
    """koboldcpp failed a ``kind`` job's generation (``ran_out``: it did not
    answer within the lease) of a prompt of ``prompt_tokens`` (None: not
    known), having generated ``produced`` tokens by then (None: not known). A
    job that ran out teaches the lease fit what it shows (a slow prompt narrows
    the declared context, a slow generation the ``max_length``, a hang nothing:
    ``lease_fit.LeaseFit.ran_out``; one line per change); the failure counts
    toward the streak after which the worker stops popping and probes
    koboldcpp with a job of this one's size
    (``state.probes``)."""
    with state.lock:
        state.lease_fit.note_lease(ttl_s)
        changes = (
            state.lease_fit.ran_out(
                kind, max_length=max_length, seconds=seconds, now=now,
                prompt_tokens=prompt_tokens, produced=produced,
            )
            if ran_out
            else []
        )
        state.probe_plan.note_failed(kind, prompt_tokens, max_length)
        withdrawn = state.failure_streak.failed(kind)
        others = [k for k in state.kinds_to_pop() if k != kind]
    for change in changes:
        log.warning("%s", change.line())
    if withdrawn:
        log.warning("%s", kind_withdrawn_line(kind, state.failure_streak.limit, others))


def kind_withdrawn_line(kind: str, limit: int, others: list[str]) -> str:
    """The line said when ``kind``'s generations failed ``limit`` times in a row and
    ``others`` are the kinds the worker still pops for, e.g. ``"chat generations
    failed 3 times in a row: popping without the chat declaration (text jobs
    continue); probing koboldcpp with a chat completion the size of the failed job
    until one succeeds"``."""
    if kind == "chat":
        action = (
            "popping without the chat declaration (text jobs continue)"
            if others else "not popping (no other kind to serve)"
        )
        probe = "a chat completion the size of the failed job"
    else:
        action = (
            "popping for chat jobs only (prompt_jobs false)"
            if others else "not popping (no other kind to serve)"
        )
        probe = "a text generation the size of the failed job"
    return (
        f"{kind} generations failed {limit} times in a row: {action}; probing "
        f"koboldcpp with {probe} until one succeeds"
    )


def kind_restored_line(kind: str) -> str:
    """The line said when ``kind`` generates again after it was withdrawn."""
    if kind == "chat":
        return "koboldcpp generates chat completions again: declaring chat again"
    return "koboldcpp generates text again: popping for text jobs again"
