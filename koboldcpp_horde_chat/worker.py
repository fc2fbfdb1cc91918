"""The pop loop: pop, dispatch chat or text, serve, exactly one terminal action.

Seed: "The pop loop" (flowchart), steps 1 to 8, and "Worked example:
koboldcpp's embedded worker". The pure rules live in the core modules; this
module only sequences them and does the waiting. Every wait is
``stop_event.wait(seconds)`` so that shutdown is prompt.

Each popped job ends in exactly one terminal action: an accepted submit, a
fault, or a deliberate no-submit after a cancel or ``ChatJobAborted``. The
reason is logged in one line with ``job=<id>``.
"""

from __future__ import annotations

import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import fit, guard, images, jobs, reply
from .backend import BackendStream, KoboldClient, encode_json
from .backoff import Backoff, EmptyPopBackoff
from .declaration import BackendCapabilities, pop_body
from .errors import (
    BackendBusy,
    BackendError,
    BackendUnauthorized,
    FetchError,
    HordeError,
    HordeRefusal,
    HordeUnavailable,
    PayloadError,
    ReplyError,
)
from .fetch import fetch_image, fetch_messages
from .guard import MaintenanceGuard, RefusalGuard, refusal_features
from .horde import HordeClient
from .progress import ProgressAction, ProgressPoster
from .reply import BackendReply
from .settings import MIB, WorkerSettings, kcpp_effective_max_length
from .sse import SSEDecoder
from .stream import ChatStreamAccumulator

log = logging.getLogger(__name__)

#: Return codes that mean the API key is wrong (seed: not a chat rule; the Horde's API).
CREDENTIAL_RCS = frozenset({"InvalidAPIKey", "WrongCredentials", "NotTrusted"})
#: Seconds kept free at the end of a lease for the submit.
SUBMIT_MARGIN_S = 5.0
#: Seconds between pops while the Horde keeps the worker in maintenance.
MAINTENANCE_POLL_S = 60.0
#: Read timeout of an abort, seconds: best effort, and the fault must still fit the lease.
ABORT_TIMEOUT_S = 2.0
#: Seconds between readiness probes while koboldcpp does not answer.
BACKEND_PROBE_S = 3.0
#: Image URLs fetched at once for one job (seed 004: url transport).
IMAGE_FETCH_THREADS = 4
#: The Horde puts a worker that aborts more than this many jobs in an hour into maintenance.
HORDE_FAULT_LIMIT_PER_HOUR = guard.HORDE_FAULT_LIMIT_PER_HOUR


class LocalManners(Protocol):
    """What the host tells the loop about local use of koboldcpp.

    ``last_local_request_time``: epoch seconds of the last local (non-Horde)
    generation, or None when unknown. ``model_busy``: koboldcpp is generating.
    ``should_stop``: the host is shutting down.
    """

    def last_local_request_time(self) -> float | None: ...

    def model_busy(self) -> bool: ...

    def should_stop(self) -> bool: ...


class NoManners:
    """Manners for a backend nobody else uses: never busy, never stopping."""

    def last_local_request_time(self) -> float | None:
        return None

    def model_busy(self) -> bool:
        return False

    def should_stop(self) -> bool:
        return False


class StandaloneManners:
    """Manners read from a separate koboldcpp's ``/api/extra/perf``.

    koboldcpp reports ``idle`` (0 while generating or with requests queued) and
    ``idletime`` (seconds since the last generation request, ours included).
    A request that arrived after our own last one came from someone else: a
    local user, whom the worker yields to for ``local_idle_s``.

    While koboldcpp is idle, ``/api/extra/perf`` is read at most once every
    :attr:`PERF_IDLE_CACHE_S` (1 s) and the last answer is reused in between
    (one GET less before most pops when jobs follow each other); after an
    answer that said busy, or none, it is read again on every call. So a local
    user who starts a generation is noticed up to 1 s later, and a pop in that
    second waits in koboldcpp's queue behind them.

    Args:
        backend: the koboldcpp client.
        clock: epoch seconds (``idletime`` is turned into a time with it).
        monotonic: seconds, for the 1 s reuse (tests may pass fakes of both).
    """

    PERF_IDLE_CACHE_S = 1.0
    """Seconds an idle ``/api/extra/perf`` answer is reused."""

    def __init__(
        self,
        backend: KoboldClient,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend = backend
        self._clock = clock
        self._monotonic = monotonic
        self.last_own_request_time = 0.0
        self._baseline: float | None = None
        self._busy = False
        # The last idle answer: when it was read (monotonic) and the epoch time
        # of the last request it reported (None: no usable idletime).
        self._idle_read_at: float | None = None
        self._idle_last_request: float | None = None

    def note_own_request(self) -> None:
        """Record that the worker sent a generation request now."""
        self.last_own_request_time = self._clock()

    def last_local_request_time(self) -> float | None:
        """Epoch seconds of a local user's last request, or None (see the class)."""
        now = self._monotonic()
        if self._idle_read_at is not None and now - self._idle_read_at < self.PERF_IDLE_CACHE_S:
            return self._local(self._idle_last_request)
        self._idle_read_at = None
        try:
            perf = self._backend.perf()
        except BackendError:
            self._busy = False
            return None
        self._busy = perf.get("idle") == 0 or bool(perf.get("queue"))
        idletime = perf.get("idletime")
        last_request: float | None = None
        if isinstance(idletime, (int, float)) and not isinstance(idletime, bool):
            last_request = self._clock() - float(idletime)
            if self._baseline is None:
                # Requests from before the worker started (koboldcpp's own start-up
                # included) are not a local user to yield to.
                self._baseline = last_request
        if not self._busy:
            self._idle_read_at = now
            self._idle_last_request = last_request
        return self._local(last_request)

    def _local(self, last_request: float | None) -> float | None:
        """``last_request`` when it came after the worker's own last request."""
        if last_request is None or self._baseline is None:
            return None
        if last_request > max(self.last_own_request_time, self._baseline) + 1.0:
            return last_request
        return None

    def model_busy(self) -> bool:
        return self._busy

    def should_stop(self) -> bool:
        return False


@dataclass
class WorkerStats:
    """Running totals, like koboldcpp's worker prints after each job."""

    started_at: float = field(default_factory=time.time)
    kudos: float = 0.0
    jobs: int = 0
    faults: int = 0
    dropped: int = 0

    def summary(self, now: float) -> str:
        elapsed = now - self.started_at
        # A rate over the first minutes says nothing: show it after ten.
        rate = f"{self.kudos / (elapsed / 3600.0):.1f} kudos/h" if elapsed >= 600 else "n/a"
        return (
            f"total kudos={self.kudos:.0f} jobs={self.jobs} faults={self.faults} rate={rate}"
        )


@dataclass
class _Lease:
    """A job's lease on the monotonic clock (seed: "Streaming progress", lease)."""

    popped_at: float
    deadline: float

    def remaining(self, now: float) -> float:
        return self.deadline - now


class Worker:
    """One pop loop for chat and text jobs.

    Args:
        settings: the worker's configuration.
        horde: the Horde client (the only holder of the API key).
        backend: the koboldcpp client.
        stop_event: set it to stop; the loop then ends after the job in hand.
        manners: local-use signals from the host.
        caps: what the backend implements (drives the declaration).
        clock: monotonic seconds; wall: epoch seconds (tests may pass fakes).
    """

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        horde: HordeClient,
        backend: KoboldClient,
        stop_event: threading.Event | None = None,
        manners: LocalManners | None = None,
        caps: BackendCapabilities | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        worker_id: int = 1,
    ) -> None:
        self.settings = settings
        self.horde = horde
        self.backend = backend
        self.stop_event = stop_event if stop_event is not None else threading.Event()
        self.manners: LocalManners = manners if manners is not None else NoManners()
        self.caps = caps if caps is not None else BackendCapabilities(vision=settings.vision)
        self.clock = clock
        self.wall = wall
        self.worker_id = worker_id
        self.stats = WorkerStats(started_at=wall())
        self.exit_code = 0
        self._current_genkey = ""
        self.withheld: frozenset[str] = frozenset(settings.chat_withhold)
        self.chat_enabled = True
        self._error_backoff = Backoff(1.0, 60.0)
        self._empty_backoff = EmptyPopBackoff()
        self.maintenance_guard = MaintenanceGuard()
        self.refusal_guard = RefusalGuard()
        self._key_refused = False
        self._settled_job: str | None = None
        self._backend_suspect = False
        self._backend_down_logged = False
        self._last_pop_body: dict[str, Any] = {}

    # ------------------------------------------------------------------ loop

    def run(self) -> int:
        """Run the pop loop until ``stop_event`` is set or the host stops.

        Returns the exit code: 0 after a requested stop, 2 when the Horde refused
        the declaration (ChatDeclarationInvalid), 3 when it refused the API key.
        """
        waited = 0
        while not self._stopping():
            if self.backend.ready():
                break
            if waited % 10 == 0:  # the first time, then every 30 s
                log.info(
                    "worker %d: waiting for koboldcpp at %s", self.worker_id, self.settings.kcpp_url
                )
            waited += 1
            self.stop_event.wait(3.0)
        if self._stopping():
            return self.exit_code
        log.info(
            "worker %d: started as %r for model %s (chat context %d, length %d)",
            self.worker_id,
            self.settings.worker_name,
            self.settings.model_id,
            self.settings.max_context_length,
            self.settings.declared_max_length,
        )
        if (warning := self.settings.max_length_warning()) and self.worker_id == 1:
            log.warning("worker %d: %s", self.worker_id, warning)
        while not self._stopping():
            try:
                self.run_once()
            except Exception:  # the loop must survive anything; log it once
                log.exception("worker %d: unexpected error in the pop loop", self.worker_id)
                self.stop_event.wait(self._error_backoff.next_delay())
        log.info("worker %d: stopped (%s)", self.worker_id, self.stats.summary(self.wall()))
        return self.exit_code

    def _stopping(self) -> bool:
        return self.stop_event.is_set() or self.manners.should_stop()

    def run_once(self) -> bool:
        """One pass of the pop loop. Returns True when a job was served."""
        last_local = self.manners.last_local_request_time()
        if last_local is not None and self.wall() - last_local < self.settings.local_idle_s:
            self.stop_event.wait(1.0)
            return False
        if self.manners.model_busy():
            self.stop_event.wait(0.2)
            return False
        if not self._backend_answers():
            self.stop_event.wait(BACKEND_PROBE_S)
            return False
        if not self._update_chat_withdrawal():
            self.stop_event.wait(MAINTENANCE_POLL_S)
            return False
        body = pop_body(
            self.settings, self.caps, withhold=self.withheld, chat_jobs=self.chat_enabled
        )
        self._last_pop_body = body
        try:
            pop = self.horde.pop(body, timeout_s=self.settings.pop_timeout_s)
        except HordeRefusal as exc:
            self._on_pop_refused(exc)
            return False
        except HordeUnavailable as exc:
            delay = self._error_backoff.next_delay(exc.retry_after_s)
            log.warning("pop failed: %s; retrying in %.1f s", exc, delay)
            self.stop_event.wait(delay)
            return False
        popped_at = self.clock()
        self._error_backoff.reset()
        raw_id = pop.get("id")
        job_id = raw_id if isinstance(raw_id, str) and raw_id else None
        self._current_genkey = ""
        self._settled_job = None
        try:
            return self._serve_popped(pop, popped_at)
        except Exception:
            if job_id is None or self._settled_job == job_id:
                raise
            # Whatever went wrong, a popped job is answered: never left to expire.
            log.exception("job=%s unexpected error while serving it; faulting it", job_id)
            lease = self._pop_lease(pop, popped_at)
            if pop.get("chat") is True:
                self._fault_chat(job_id, None, lease, "internal error")
            else:
                self._fault_text(job_id, lease, "internal error")
            return True
        except BaseException:
            # A forced exit (a second SIGINT or SIGTERM): stop koboldcpp's generation,
            # one quick fault, then go.
            if self._current_genkey:
                self._abort_quietly(self._current_genkey)
            if job_id is not None and self._settled_job != job_id:
                self._fault_once(job_id, chat=pop.get("chat") is True)
            raise
        finally:
            self._current_genkey = ""

    def _fault_once(self, job_id: str, *, chat: bool) -> None:
        """Fault a job with a single short submit attempt (the process is exiting)."""
        body = (
            reply.fault_submit(job_id, self.settings.model_id)
            if chat
            else {"id": job_id, "generation": "", "state": "faulted"}
        )
        try:
            self.horde.submit(body, timeout_s=min(5.0, self.settings.submit_timeout_s))
            log.warning("job=%s faulted: the worker is exiting now", job_id)
        except HordeError as exc:
            log.warning("job=%s left to expire: the worker is exiting now (%s)", job_id, exc)

    def _serve_popped(self, pop: dict[str, Any], popped_at: float) -> bool:
        """Parse a pop answer and serve its job, if any. True when a job was served."""
        try:
            job = jobs.parse_pop(pop, default_ttl_s=self.settings.lease_s)
        except PayloadError as exc:
            self._empty_backoff.reset()
            if exc.job_id:
                log.warning("job=%s malformed payload at %s: %s", exc.job_id, exc.path, exc.problem)
                lease = self._pop_lease(pop, popped_at)
                if pop.get("chat") is True:  # the same test as jobs.parse_pop's
                    self._fault_chat(exc.job_id, None, lease, "malformed payload")
                else:
                    self._fault_text(exc.job_id, lease, "malformed payload")
            else:
                log.warning("pop returned a job without a usable id (%s); skipped", exc.path)
            return True
        if job is None:
            self.stop_event.wait(self._empty_backoff.next_delay())
            return False
        self._empty_backoff.reset()
        # A lease never runs past the cap progress posts could extend it to.
        lease = _Lease(popped_at, popped_at + min(job.ttl_s, self.settings.lease_cap_s))
        if isinstance(job, jobs.ChatJob):
            self._serve_chat(job, lease)
        else:
            self._serve_text(job, lease)
        return True

    def _pop_lease(self, pop: dict[str, Any], popped_at: float) -> _Lease:
        """The lease of a job whose pop could not be parsed: its ``ttl`` when that is a
        usable number of seconds, else ``settings.lease_s``; never past the lease cap."""
        ttl = pop.get("ttl")
        seconds = self.settings.lease_s
        if isinstance(ttl, int | float) and not isinstance(ttl, bool):
            try:
                value = float(ttl)
            except OverflowError:
                value = math.inf
            if value > 0 and not math.isnan(value):
                seconds = value
        return _Lease(popped_at, popped_at + min(seconds, self.settings.lease_cap_s))

    def _on_pop_refused(self, exc: HordeRefusal) -> None:
        if exc.rc == "ChatDeclarationInvalid":
            log.error("the Horde refused the chat declaration: %s; stopping", exc.message)
            self.exit_code = 2
            self.stop_event.set()
        elif self._is_key_refusal(exc):
            self._stop_for_key(exc)
        elif exc.rc == "WorkerMaintenance" or exc.status == 403:
            log.warning("the Horde keeps this worker in maintenance: %s", exc.message)
            self.stop_event.wait(MAINTENANCE_POLL_S)
        else:
            delay = self._error_backoff.next_delay()
            log.warning("pop refused: %s; retrying in %.1f s", exc, delay)
            self.stop_event.wait(delay)

    def _note_backend_failure(self, exc: Exception) -> None:
        """After koboldcpp failed a job, check it is up before the next pop.

        A killed koboldcpp shows as no answer, a reset or a stream cut short
        (a ``ReplyError``); the probe is one cheap GET, so any failure counts.
        """
        if isinstance(exc, BackendError | ReplyError):
            self._backend_suspect = True

    def _backend_answers(self) -> bool:
        """False while koboldcpp, which failed a job without answering, still does not answer.

        A crashed or restarting koboldcpp would otherwise fault every job
        popped meanwhile (each one an aborted job on the Horde, on the way to
        maintenance). The probe is koboldcpp's own readiness GET.
        """
        if not self._backend_suspect:
            return True
        if self.backend.ready():
            self._backend_suspect = False
            if self._backend_down_logged:
                self._backend_down_logged = False
                log.info("koboldcpp at %s answers again: popping", self.settings.kcpp_url)
            return True
        if not self._backend_down_logged:
            self._backend_down_logged = True
            log.warning(
                "koboldcpp at %s does not answer: not popping until it does",
                self.settings.kcpp_url,
            )
        return False

    @staticmethod
    def _is_key_refusal(exc: HordeRefusal) -> bool:
        """401, or 403 with a credentials ``rc``: the API key is wrong (by status and rc only)."""
        return exc.status == 401 or (exc.status == 403 and exc.rc in CREDENTIAL_RCS)

    def _stop_for_key(self, exc: HordeRefusal) -> None:
        """Say "check your API key" once, stop popping, and exit with code 3."""
        if not self._key_refused:
            self._key_refused = True
            log.error(
                "the Horde refused the API key (HTTP %d %s): check your API key; stopping",
                exc.status,
                exc.rc or "no rc",
            )
        self.exit_code = 3
        self.stop_event.set()

    # ------------------------------------------------------- maintenance guard

    def _update_chat_withdrawal(self) -> bool:
        """Withdraw the chat declaration before the Horde's 20 faults an hour.

        The counting is ``guard.MaintenanceGuard``'s: withdrawn at 15 faults
        in the last hour, declared again below 10. A worker that also serves
        text jobs keeps popping without the declaration; a chat-only worker
        (``prompt_jobs`` False) cannot pop without it, so it pauses popping.
        Returns False when the next pop must be skipped.
        """
        now = self.clock()
        mguard = self.maintenance_guard
        change = mguard.update(now)
        recent = mguard.recent(now)
        if change == "withdraw":
            log.warning(
                "%d faults in the last hour (the Horde puts a worker into maintenance "
                "after %d): withdrawing the chat declaration%s until fewer than %d "
                "faults remain in the hour",
                recent,
                HORDE_FAULT_LIMIT_PER_HOUR,
                " (text jobs continue)" if self.settings.prompt_jobs else
                " and pausing pops (chat-only worker)",
                mguard.restore_below,
            )
        elif change == "restore":
            log.info("faults have quietened (%d in the last hour): declaring chat again", recent)
        self.chat_enabled = mguard.chat_enabled
        return self.chat_enabled or self.settings.prompt_jobs

    # -------------------------------------------------------------- text jobs

    def _serve_text(self, job: jobs.TextJob, lease: _Lease) -> None:
        """Seed step 8: forward the payload to ``/api/v1/generate``, submit ``generation``."""
        log.info(
            "job=%s kind=text received: %s tokens, %s context",
            job.id,
            job.payload.get("max_length", "?"),
            job.payload.get("max_context_length", "?"),
        )
        started = self.clock()
        genkey = self._current_genkey = _genkey()
        try:
            body = self._with_busy_retry(
                lambda timeout: self.backend.generate(
                    jobs.text_request_body(job, genkey=genkey), timeout_s=timeout
                ),
                lease,
                genkey,
            )
            generation = reply.text_generation(body)
        except (BackendError, ReplyError) as exc:
            self._note_backend_failure(exc)
            self._fault_text(job.id, lease, f"backend failed: {exc}")
            return
        self._submit(
            job.id,
            reply.text_submit(job.id, generation),
            lease,
            kind="text",
            started=started,
            detail=f"{len(generation)} chars",
            on_refused=lambda exc: self._fault_text(
                job.id, lease, f"reply refused ({exc.rc or exc.status}): {exc.message}"
            ),
        )

    # -------------------------------------------------------------- chat jobs

    def _serve_chat(self, job: jobs.ChatJob, lease: _Lease) -> None:
        """Seed steps 2 to 7 for one chat job."""
        model_id = str(self._last_pop_body.get("model_id") or self.settings.model_id)
        started = self.clock()
        payload_keys = _keys(job.payload)
        log.info(
            "job=%s kind=chat received: max_length=%d max_context_length=%d stream=%s keys=%s",
            job.id,
            job.max_length,
            job.max_context_length,
            job.stream_progress,
            payload_keys,
        )
        # Offloaded messages (seed: "Fetch offloaded messages").
        if job.messages is not None:
            raw_messages: object = job.messages
        else:
            assert job.messages_url is not None
            try:
                raw_messages = fetch_messages(
                    job.messages_url,
                    timeout_s=max(1.0, min(120.0, lease.remaining(self.clock()) - SUBMIT_MARGIN_S)),
                    max_bytes=self.settings.messages_max_bytes,
                )
            except FetchError as exc:
                self._fault_chat(job.id, model_id, lease, f"messages_url fetch failed: {exc}")
                return
        try:
            messages = jobs.validate_messages(raw_messages, job_id=job.id)
        except PayloadError as exc:
            self._fault_chat(job.id, model_id, lease, f"malformed messages at {exc.path}")
            return
        if fit.count_images(messages):
            if not self.caps.vision:
                self._fault_chat(job.id, model_id, lease, "images sent to a worker without vision")
                return
            try:
                messages = self._prepare_images(messages, lease)
            except FetchError as exc:
                self._fault_chat(job.id, model_id, lease, f"image unusable: {exc}")
                return
        if job.max_length > self.settings.declared_max_length:
            # The Horde validates budgets within chat_limits (seed step 2): a larger
            # one is not ours to generate, and not a prompt overflow either.
            self._fault_chat(
                job.id,
                model_id,
                lease,
                f"max_length {job.max_length} is above the declared chat_limits.max_length "
                f"{self.settings.declared_max_length}",
            )
            return
        # Fit check (seed step 3): count JSON text, never render.
        tools = job.payload.get("tools")
        response_format = job.payload.get("response_format")
        try:
            counted = self.backend.tokencount(
                fit.fit_prompt(messages, tools, response_format),
                # The fault that follows a failure must still land within the lease.
                timeout_s=max(
                    1.0, min(60.0, lease.remaining(self.clock()) - SUBMIT_MARGIN_S)
                ),
            )
        except BackendError as exc:
            self._note_backend_failure(exc)
            self._fault_chat(job.id, model_id, lease, f"tokencount failed: {exc}")
            return
        limit = min(job.max_context_length, self.settings.max_context_length)
        result = fit.check_fit(
            counted, messages, max_length=job.max_length, max_context_length=limit
        )
        if not result.fits:
            self._fault_chat(
                job.id,
                model_id,
                lease,
                f"does not fit: estimate {result.estimate} + max_length {job.max_length} "
                f"> {limit}",
                fault_reason=reply.FAULT_PROMPT_OVERFLOW,
            )
            return
        genkey = self._current_genkey = _genkey()
        stream = job.stream_progress and not job.has_tools
        backend_body = encode_json(
            jobs.chat_request_body(job, messages, genkey=genkey, stream=stream)
        )
        limit = self.settings.kcpp_max_request_bytes
        if len(backend_body) > limit:
            # koboldcpp would answer 500 "Payload is too big" (its --maxrequestsize).
            self._fault_chat(
                job.id,
                model_id,
                lease,
                f"the chat request is {len(backend_body)} bytes, over koboldcpp's "
                f"--maxrequestsize of {limit} bytes ({limit / MIB:g} MiB): not sent "
                "(start koboldcpp with a larger --maxrequestsize to serve such jobs)",
            )
            return
        self._note_own_request()
        try:
            if stream:
                outcome = self._generate_streamed(job, model_id, backend_body, genkey, lease)
                if outcome is None:
                    self._settled_job = job.id
                    return  # ended: cancelled, aborted or faulted
                backend_reply = outcome
            else:
                body = self._with_busy_retry(
                    lambda timeout: self.backend.chat_completion(backend_body, timeout_s=timeout),
                    lease,
                    genkey,
                )
                backend_reply = reply.parse_chat_completion(body)
            submit_body = reply.chat_submit(
                job.id,
                model_id,
                backend_reply,
                max_length=kcpp_effective_max_length(
                    job.max_length, job.max_context_length,
                    self.settings.backend_max_context_length,
                ),
            )
        except (BackendError, ReplyError) as exc:
            self._note_backend_failure(exc)
            self._fault_chat(job.id, model_id, lease, f"generation failed: {exc}")
            return
        message = submit_body.get("message", {})
        detail = (
            f"finish={submit_body.get('finish_reason')} "
            f"tokens={submit_body.get('completion_tokens', '?')} "
            f"calls={len(message.get('tool_calls') or [])}"
        )
        self._submit(
            job.id,
            submit_body,
            lease,
            kind="chat",
            started=started,
            detail=detail,
            on_refused=lambda exc: self._on_reply_refused(job, model_id, lease, exc),
        )

    def _on_reply_refused(
        self, job: jobs.ChatJob, model_id: str, lease: _Lease, exc: HordeRefusal
    ) -> None:
        """Seed "Submit refusals": fault the refused job; never resubmit the reply.

        The fault carries ``reply_refused`` after ``ChatSubmitInvalid``,
        ``ChatSubmitNonconformant`` or ``ChatModelMismatch`` (worked example),
        and no reason after any other refusal (such as 400 for a token count
        out of range), which would otherwise leave the job to expire.

        A ``ChatSubmitNonconformant`` refusal is counted against the declared
        guarantee or feature the request used (``guard.refusal_features``); at
        ``guard.REFUSALS_TO_WITHDRAW`` in an hour that name is withdrawn from
        every later pop's ``chat_features`` until the worker restarts. The
        fault that follows it does not count toward maintenance: the Horde
        counts it as a nonconformant reply, not an aborted job.
        """
        nonconformant = exc.rc == "ChatSubmitNonconformant"
        if nonconformant:
            declared = self._last_pop_body.get("chat_features")
            names = refusal_features(job.payload, declared if isinstance(declared, list) else [])
            if not names:
                log.warning(
                    "job=%s nonconformant reply not attributable to a declared guarantee "
                    "or feature (payload keys %s)",
                    job.id,
                    _keys(job.payload),
                )
            for name in self.refusal_guard.record(names, self.clock()):
                self.withheld = self.withheld | {name}
                log.warning(
                    "withdrawing %r from the chat declaration: the Horde refused %d replies "
                    "as ChatSubmitNonconformant for it within an hour; restart the worker "
                    "(after fixing the model, its chat template or koboldcpp) to declare it again",
                    name,
                    self.refusal_guard.threshold,
                )
        self._fault_chat(
            job.id,
            model_id,
            lease,
            f"reply refused ({exc.rc or exc.status}): {exc.message}",
            fault_reason=reply.FAULT_REPLY_REFUSED if exc.rc in reply.REFUSAL_RCS else None,
            counts=not nonconformant,
        )

    def _prepare_images(
        self, messages: list[dict[str, Any]], lease: _Lease
    ) -> list[dict[str, Any]]:
        """Seed step 5 and seed 004: every image reaches koboldcpp as a checked data URL.

        Signed image URLs are fetched (without credentials, bounded, in
        parallel up to ``IMAGE_FETCH_THREADS``) and data URLs decoded; each
        image's media type is taken from its bytes, and one koboldcpp cannot
        decode raises ``images.ImageError`` (a ``FetchError``): the job is then
        faulted without ``fault_reason`` instead of answered without the image.
        """
        plan = images.plan_images(messages)
        fetched: dict[tuple[int, int], bytes] = {}
        if plan.to_fetch:
            timeout = max(1.0, min(60.0, lease.remaining(self.clock()) - SUBMIT_MARGIN_S))
            workers = min(IMAGE_FETCH_THREADS, len(plan.to_fetch))
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="image")
            try:
                futures = {
                    (i, j): pool.submit(
                        fetch_image, url, timeout_s=timeout, max_bytes=images.MAX_IMAGE_BYTES
                    )
                    for i, j, url in plan.to_fetch
                }
                for key, future in futures.items():
                    fetched[key] = future.result()
            finally:
                # A failed fetch faults the job at once: queued fetches are cancelled
                # and those under way end by their own deadline.
                pool.shutdown(wait=False, cancel_futures=True)
        return images.finish_images(messages, plan, fetched)

    def _note_own_request(self) -> None:
        note = getattr(self.manners, "note_own_request", None)
        if callable(note):
            note()

    def _with_busy_retry(
        self, call: Callable[[float], dict[str, Any]], lease: _Lease, genkey: str
    ) -> dict[str, Any]:
        """Call the backend, waiting out 503 busy answers while the lease allows.

        A timeout aborts the local generation (by ``genkey``) before raising.
        Raises BackendError when the lease runs out or the backend fails.
        """
        while True:
            remaining = lease.remaining(self.clock()) - SUBMIT_MARGIN_S
            if remaining <= 1.0:
                raise BackendError("the lease ran out before koboldcpp answered")
            # Every generation request is the worker's own, not a local user's.
            self._note_own_request()
            try:
                return call(remaining)
            except BackendUnauthorized:
                raise
            except BackendBusy:
                if self.stop_event.wait(min(2.0, max(0.0, remaining - 1.0))):
                    raise BackendError("stopping while koboldcpp was busy") from None
                continue
            except BackendError as exc:
                if exc.status == 0:
                    self._abort_quietly(genkey)
                raise

    def _pause(self, seconds: float) -> None:
        """Wait; a requested stop shortens waits between pops, not a job's own retries."""
        if not self.stop_event.wait(seconds):
            return
        threading.Event().wait(seconds)

    def _abort_quietly(self, genkey: str) -> None:
        """Best-effort abort of the local generation, quick enough to leave the lease's
        margin to the fault that usually follows (koboldcpp answers in about 0.1 s)."""
        try:
            self.backend.abort(genkey, timeout_s=ABORT_TIMEOUT_S)
        except BackendError as exc:
            log.debug("abort of %s failed: %s", genkey, exc)

    # ---------------------------------------------------------- streamed jobs

    def _generate_streamed(
        self,
        job: jobs.ChatJob,
        model_id: str,
        backend_body: bytes | bytearray,
        genkey: str,
        lease: _Lease,
    ) -> BackendReply | None:
        """Seed "Streaming progress": relay koboldcpp's SSE stream as progress posts.

        koboldcpp is opened and read on a thread of its own (its answer's
        headers wait for koboldcpp's model lock, and it sends nothing during
        prompt processing), so this loop keeps the job's lease: every 0.1 s at
        most it posts what is due and checks the deadline, which each accepted
        post with new text moves to 150 s after the post (up to the cap from
        pop). The stream's read timeout is only a backstop at the latest end the
        lease can reach, so neither a silent prompt processing nor a pause in a
        stream whose lease the posts extended is cut short by it. When the lease
        would end within ``SUBMIT_MARGIN_S``, the generation is aborted and the
        job faulted rather than submitted late.

        Returns the whole reply to submit, or None when the job ended here
        (cancelled, ChatJobAborted, or faulted because the lease ran out).
        Raises BackendError or ReplyError for the caller to fault (the local
        generation is aborted first): a failed stream, an in-band error (without
        waiting for the stream's end), or a stream that ended without a finish
        reason.
        """
        stop = job.payload.get("stop_sequence")
        stop_sequences = tuple(s for s in stop if isinstance(s, str) and s) if isinstance(
            stop, list
        ) else ()
        poster = ProgressPoster(
            job.id,
            max_length=job.max_length,
            popped_at=lease.popped_at,
            base_lease_s=lease.deadline - lease.popped_at,
            lease_cap_s=self.settings.lease_cap_s,
        )
        accumulator = ChatStreamAccumulator(stop_sequences=stop_sequences)
        decoder = SSEDecoder()
        slot = _StreamSlot()
        chunks: queue.Queue[bytes | BaseException | None] = queue.Queue()
        reader = threading.Thread(
            target=_pump,
            args=(lambda: self._open_stream(backend_body, lease, slot), slot, chunks),
            name=f"kcpp-stream-{job.id}",
            daemon=True,
        )
        reader.start()
        try:
            while True:
                now = self.clock()
                lease.deadline = max(lease.deadline, poster.lease_deadline)
                if lease.remaining(now) <= SUBMIT_MARGIN_S:
                    self._close_and_abort(slot, genkey)
                    self._fault_chat(job.id, model_id, lease, "the lease ran out while streaming")
                    return None
                try:
                    item = chunks.get(timeout=0.1)
                except queue.Empty:
                    if not self._post_due(poster, job, slot, genkey, lease):
                        return None
                    continue
                if item is None:
                    for event in decoder.close():
                        self._feed(accumulator, poster, event.data)
                    break
                if isinstance(item, BaseException):
                    self._close_and_abort(slot, genkey)
                    if isinstance(item, BackendError):
                        raise item
                    raise BackendError(f"stream failed: {item!r}")
                for event in decoder.feed(item):
                    self._feed(accumulator, poster, event.data)
                    if accumulator.done or accumulator.error is not None:
                        break
                if accumulator.error is not None:
                    # Abort at once: what koboldcpp sends after an error is not used.
                    self._close_and_abort(slot, genkey)
                    raise ReplyError(f"koboldcpp reported an error mid-stream: {accumulator.error}")
                if accumulator.done:
                    break
                if not self._post_due(poster, job, slot, genkey, lease):
                    return None
            if accumulator.error is not None:
                raise ReplyError(f"koboldcpp reported an error mid-stream: {accumulator.error}")
            if accumulator.native_finish_reason is None:
                raise ReplyError(
                    "the stream ended without a finish reason"
                    + ("" if accumulator.done else " (and without [DONE]: cut off)")
                )
            tail = accumulator.flush()
            poster.add(tail.content, tail.reasoning)
            final = poster.pending_final(self.clock())
            if final is not None and not self._post(poster, final, job, slot, genkey, lease):
                return None
            return accumulator.result()
        finally:
            slot.close()

    def _open_stream(
        self, body: bytes | bytearray, lease: _Lease, slot: _StreamSlot
    ) -> BackendStream:
        """Open koboldcpp's stream (on the reader thread), waiting out 503 busy answers.

        The read timeout is a backstop at the latest end the lease can reach
        (the pop's ttl or the lease cap from pop, whichever is later): the job
        thread enforces the lease itself and closes the stream. Raises
        BackendError when the job ended (the slot was closed) while koboldcpp
        was busy, and whatever ``open_chat_stream`` raises otherwise.
        """
        while True:
            now = self.clock()
            latest_end = max(lease.deadline, lease.popped_at + self.settings.lease_cap_s)
            try:
                return self.backend.open_chat_stream(
                    body, read_timeout_s=max(1.0, latest_end - now)
                )
            except BackendBusy:
                if slot.closed.wait(2.0):
                    raise BackendError("the job ended while koboldcpp was busy") from None

    @staticmethod
    def _feed(accumulator: ChatStreamAccumulator, poster: ProgressPoster, data: str) -> None:
        delta = accumulator.feed_event(data)
        if delta.content or delta.reasoning:
            poster.add(delta.content, delta.reasoning)

    def _post_due(
        self,
        poster: ProgressPoster,
        job: jobs.ChatJob,
        slot: _StreamSlot,
        genkey: str,
        lease: _Lease,
    ) -> bool:
        """Send the post that is due, if any. False when generation must stop."""
        body = poster.due(self.clock())
        if body is None:
            return True
        return self._post(poster, body, job, slot, genkey, lease)

    def _post(
        self,
        poster: ProgressPoster,
        body: dict[str, Any],
        job: jobs.ChatJob,
        slot: _StreamSlot,
        genkey: str,
        lease: _Lease,
    ) -> bool:
        """Post one progress body, retrying as the state machine says.

        A lost answer (no answer, a reset, or a 2xx answer that could not be
        read: the post may have been processed) is retried with the identical
        body; 429 and 5xx are answers for ``on_response``. Retries stop when the
        lease nears its end (the caller then faults the job).

        Returns False when the job ended (cancelled or ChatJobAborted): the
        local generation is then aborted and nothing is submitted.
        """
        while True:
            room = lease.remaining(self.clock()) - SUBMIT_MARGIN_S
            timeout = max(1.0, min(self.settings.progress_timeout_s, room))
            try:
                answer = self.horde.progress(body, timeout_s=timeout)
                action = poster.on_response(200, answer, self.clock())
            except HordeRefusal as exc:
                action = poster.on_response(exc.status, exc.body or {"rc": exc.rc}, self.clock())
            except HordeUnavailable as exc:
                if exc.status == 429 or exc.status >= 500:
                    action = poster.on_response(
                        exc.status, exc.body or {"rc": exc.rc}, self.clock()
                    )
                else:
                    log.info("job=%s progress seq %s: answer lost (%s)", job.id, body["seq"], exc)
                    action = poster.on_lost(self.clock())
            if action is ProgressAction.RETRY:
                body = poster.retry_body()
                lease.deadline = max(lease.deadline, poster.lease_deadline)
                if lease.remaining(self.clock()) - SUBMIT_MARGIN_S <= 0.5:
                    return True  # the caller's lease check aborts and faults the job
                self._pause(0.5)
                continue
            if action is ProgressAction.STOP_GENERATING:
                log.info("job=%s cancelled or ended by the Horde: not submitted", job.id)
                self._close_and_abort(slot, genkey)
                return False
            if action is ProgressAction.STOP_POSTING:
                log.info("job=%s progress posts stopped; the job goes on to its submit", job.id)
            return True

    def _close_and_abort(self, slot: _StreamSlot, genkey: str) -> None:
        """Stop the local generation: close the stream, then abort by ``genkey``.

        The abort also covers a request still queued for koboldcpp's model lock
        (koboldcpp keeps one pending abort key, facts §5.2).
        """
        slot.close()
        self._abort_quietly(genkey)

    # ---------------------------------------------------------------- submits

    def _submit(
        self,
        job_id: str,
        body: dict[str, Any],
        lease: _Lease,
        *,
        kind: str,
        started: float,
        detail: str,
        on_refused: Callable[[HordeRefusal], None] | None,
        fault: bool = False,
    ) -> None:
        """Send one submit, retrying lost responses with the same body while the lease lasts.

        ``DuplicateGen`` means it was already settled and ``AbortedGen`` or 404
        that the job ended: both are logged and dropped (not counted as
        faults). A refusal of the API key stops the worker. Any other refusal
        of a reply (``REFUSAL_RCS``, or e.g. 400 for a token count out of
        range) calls ``on_refused``, which faults the job; a refused fault is
        dropped. The reply is never sent twice after a definitive answer.
        """
        attempts = 0
        while True:
            attempts += 1
            try:
                answer = self.horde.submit(body, timeout_s=self.settings.submit_timeout_s)
            except HordeRefusal as exc:
                self._settled_job = job_id
                if exc.rc == "DuplicateGen":
                    log.info("job=%s already settled (DuplicateGen): nothing more to send", job_id)
                elif self._is_key_refusal(exc):
                    self.stats.dropped += 1
                    self._stop_for_key(exc)
                elif exc.rc == "AbortedGen" or exc.status == 404:
                    self.stats.dropped += 1
                    log.warning("job=%s ended on the Horde before the submit (%s)", job_id, exc.rc)
                elif on_refused is not None:
                    # Any other definitive refusal of a reply: the job is still
                    # open on the Horde, so fault it now rather than let it expire.
                    log.warning("job=%s reply refused: %s", job_id, exc)
                    on_refused(exc)
                else:
                    self.stats.dropped += 1
                    log.error("job=%s submit refused: %s; dropped", job_id, exc)
                return
            except HordeUnavailable as exc:
                remaining = lease.remaining(self.clock())
                if attempts >= 3 and remaining <= 0:
                    self._settled_job = job_id
                    self.stats.dropped += 1
                    if not fault:  # the job expires on the Horde: an aborted job there
                        self.maintenance_guard.record_fault(self.clock())
                    log.error("job=%s submit failed (%s), the lease is over; dropped", job_id, exc)
                    return
                delay = min(max(1.0, exc.retry_after_s or 0.0) * attempts, 10.0)
                log.warning("job=%s submit failed (%s); retrying in %.1f s", job_id, exc, delay)
                self._pause(delay)
                continue
            except HordeError as exc:  # pragma: no cover - the two subclasses above cover all
                log.error("job=%s submit failed: %s", job_id, exc)
                return
            self._settled_job = job_id
            kudos = _kudos(answer.get("reward", 0))
            seconds = self.clock() - started
            if fault:
                log.info("job=%s kind=%s fault accepted (%.1f s)", job_id, kind, seconds)
            else:
                self.stats.kudos += kudos
                self.stats.jobs += 1
                log.info(
                    "job=%s kind=%s submitted: %s, %.1f s, %.0f kudos | %s",
                    job_id,
                    kind,
                    detail,
                    seconds,
                    kudos,
                    self.stats.summary(self.wall()),
                )
            return

    def _fault_chat(
        self,
        job_id: str,
        model_id: str | None,
        lease: _Lease,
        why: str,
        *,
        fault_reason: str | None = None,
        counts: bool = True,
    ) -> None:
        """Seed step 7: submit a chat fault (with ``fault_reason`` when one applies).

        ``counts`` is False for a fault that follows a ``ChatSubmitNonconformant``
        refusal: the Horde counts it apart (``nonconformant_replies``), not as an
        aborted job, so it does not count toward maintenance either.
        """
        self.stats.faults += 1
        if counts:
            self.maintenance_guard.record_fault(self.clock())
        model = model_id or self.settings.model_id
        log.warning(
            "job=%s kind=chat faulted%s: %s",
            job_id,
            f" ({fault_reason})" if fault_reason else "",
            why,
        )
        self._submit(
            job_id,
            reply.fault_submit(job_id, model, fault_reason),
            lease,
            kind="chat",
            started=self.clock(),
            detail="fault",
            on_refused=None,
            fault=True,
        )

    def _fault_text(self, job_id: str, lease: _Lease, why: str) -> None:
        self.stats.faults += 1
        self.maintenance_guard.record_fault(self.clock())
        log.warning("job=%s kind=text faulted: %s", job_id, why)
        self._submit(
            job_id,
            {"id": job_id, "generation": "", "state": "faulted"},
            lease,
            kind="text",
            started=self.clock(),
            detail="fault",
            on_refused=None,
            fault=True,
        )


class _StreamSlot:
    """A job's koboldcpp stream, shared by the job thread and its reader thread.

    ``close()`` may come before the stream is open (koboldcpp still waiting
    for its model lock): the reader then closes the stream as soon as it opens.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stream: BackendStream | None = None
        self.closed = threading.Event()

    def attach(self, stream: BackendStream) -> bool:
        """Keep the opened stream; False (and the stream closed) after ``close()``."""
        with self._lock:
            if not self.closed.is_set():
                self._stream = stream
                return True
        stream.close()
        return False

    def close(self) -> None:
        """Close the stream (now or when it opens); safe to call twice, from any thread."""
        with self._lock:
            self.closed.set()
            stream = self._stream
        if stream is not None:
            stream.close()


def _pump(
    open_stream: Callable[[], BackendStream],
    slot: _StreamSlot,
    out: queue.Queue[bytes | BaseException | None],
) -> None:
    """Open a backend stream and read it into a queue: bytes chunks, then None or the error."""
    try:
        stream = open_stream()
        if not slot.attach(stream):
            return
        while True:
            chunk = stream.read_chunk()
            if not chunk:
                break
            out.put(chunk)
    except BaseException as exc:  # handed to the job thread, which decides
        out.put(exc)
        return
    out.put(None)


def _keys(obj: dict[str, Any], limit: int = 32) -> str:
    """``"a,b,c"``: an object's keys for a log line, at most ``limit`` and 40 characters each."""
    keys = sorted(str(k)[:40] for k in obj)
    more = f",... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return ",".join(keys[:limit]) + more


def _kudos(reward: object) -> float:
    """The submit answer's ``reward`` as kudos; 0.0 when it is not a finite number."""
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        return 0.0
    try:
        kudos = float(reward)
    except OverflowError:
        return 0.0
    return kudos if math.isfinite(kudos) else 0.0


def _genkey() -> str:
    """A ``HORDEREQ_`` genkey: koboldcpp does not pause the worker for these requests."""
    return "HORDEREQ_" + secrets.token_hex(6)


def run_worker(
    settings: WorkerSettings,
    *,
    stop_event: threading.Event | None = None,
    manners: LocalManners | None = None,
    caps: BackendCapabilities | None = None,
    worker_id: int = 1,
    backend: KoboldClient | None = None,
) -> int:
    """Build the clients and run one pop loop until stopped; returns the exit code.

    One ``requests.Session`` per client and per thread: call this once per
    worker thread.
    """
    horde = HordeClient(
        settings.horde_url,
        settings.api_key,
        bridge_agent=settings.bridge_agent,
        connect_timeout_s=settings.connect_timeout_s,
    )
    if backend is None:
        backend = KoboldClient(
            settings.kcpp_url,
            settings.kcpp_password,
            connect_timeout_s=settings.connect_timeout_s,
        )
    worker = Worker(
        settings,
        horde=horde,
        backend=backend,
        stop_event=stop_event,
        manners=manners,
        caps=caps,
        worker_id=worker_id,
    )
    return worker.run()
