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
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import fit, jobs, reply
from .backend import BackendStream, KoboldClient
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
from .fetch import fetch_messages
from .horde import HordeClient
from .progress import ProgressAction, ProgressPoster
from .reply import BackendReply
from .settings import WorkerSettings
from .sse import SSEDecoder
from .stream import ChatStreamAccumulator

log = logging.getLogger(__name__)

#: Return codes that mean the API key is wrong (seed: not a chat rule; the Horde's API).
CREDENTIAL_RCS = frozenset({"InvalidAPIKey", "WrongCredentials", "NotTrusted"})
#: Seconds kept free at the end of a lease for the submit.
SUBMIT_MARGIN_S = 5.0
#: Seconds between pops while the Horde keeps the worker in maintenance.
MAINTENANCE_POLL_S = 60.0
#: The Horde puts a worker that aborts more than this many jobs in an hour into maintenance.
HORDE_FAULT_LIMIT_PER_HOUR = 20


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
    """

    def __init__(self, backend: KoboldClient, clock: Callable[[], float] = time.time) -> None:
        self._backend = backend
        self._clock = clock
        self.last_own_request_time = 0.0
        self._baseline: float | None = None
        self._busy = False

    def note_own_request(self) -> None:
        """Record that the worker sent a generation request now."""
        self.last_own_request_time = self._clock()

    def last_local_request_time(self) -> float | None:
        try:
            perf = self._backend.perf()
        except BackendError:
            self._busy = False
            return None
        self._busy = perf.get("idle") == 0 or bool(perf.get("queue"))
        idletime = perf.get("idletime")
        if not isinstance(idletime, (int, float)) or isinstance(idletime, bool):
            return None
        last_request = self._clock() - float(idletime)
        if self._baseline is None:
            # Requests from before the worker started (koboldcpp's own start-up
            # included) are not a local user to yield to.
            self._baseline = last_request
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
        hours = max((now - self.started_at) / 3600.0, 1e-9)
        return (
            f"total kudos={self.kudos:.0f} jobs={self.jobs} faults={self.faults} "
            f"rate={self.kudos / hours:.1f} kudos/h"
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
        self.withheld: frozenset[str] = frozenset(settings.chat_withhold)
        self.chat_enabled = True
        self._error_backoff = Backoff(1.0, 60.0)
        self._empty_backoff = EmptyPopBackoff()
        self._fault_times: deque[float] = deque(maxlen=HORDE_FAULT_LIMIT_PER_HOUR * 4)
        self._last_pop_body: dict[str, Any] = {}

    # ------------------------------------------------------------------ loop

    def run(self) -> int:
        """Run the pop loop until ``stop_event`` is set or the host stops.

        Returns the exit code: 0 after a requested stop, 2 when the Horde refused
        the declaration (ChatDeclarationInvalid), 3 when it refused the API key.
        """
        log.info("worker %d: waiting for koboldcpp at %s", self.worker_id, self.settings.kcpp_url)
        while not self._stopping():
            if self.backend.ready():
                break
            self.stop_event.wait(3.0)
        if self._stopping():
            return self.exit_code
        log.info(
            "worker %d: started as %r for model %s (chat context %d, length %d)",
            self.worker_id,
            self.settings.worker_name,
            self.settings.model_id,
            self.settings.max_context_length,
            self.settings.max_length,
        )
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
        self._update_chat_withdrawal()
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
        try:
            job = jobs.parse_pop(pop, default_ttl_s=self.settings.lease_s)
        except PayloadError as exc:
            self._empty_backoff.reset()
            if exc.job_id:
                log.warning("job=%s malformed payload at %s: %s", exc.job_id, exc.path, exc.problem)
                lease = _Lease(popped_at, popped_at + self.settings.lease_s)
                kind_chat = bool(pop.get("chat")) if isinstance(pop, dict) else True
                if kind_chat:
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
        lease = _Lease(popped_at, popped_at + job.ttl_s)
        if isinstance(job, jobs.ChatJob):
            self._serve_chat(job, lease)
        else:
            self._serve_text(job, lease)
        return True

    def _on_pop_refused(self, exc: HordeRefusal) -> None:
        if exc.rc == "ChatDeclarationInvalid":
            log.error("the Horde refused the chat declaration: %s; stopping", exc.message)
            self.exit_code = 2
            self.stop_event.set()
        elif exc.status in (401, 403) and (exc.rc in CREDENTIAL_RCS or exc.status == 401):
            log.error("the Horde refused the API key (%s): check your API key; stopping", exc.rc)
            self.exit_code = 3
            self.stop_event.set()
        elif exc.rc == "WorkerMaintenance" or exc.status == 403:
            log.warning("the Horde keeps this worker in maintenance: %s", exc.message)
            self.stop_event.wait(MAINTENANCE_POLL_S)
        else:
            delay = self._error_backoff.next_delay()
            log.warning("pop refused: %s; retrying in %.1f s", exc, delay)
            self.stop_event.wait(delay)

    # ------------------------------------------------------- maintenance guard

    def _update_chat_withdrawal(self) -> None:
        """Withdraw the chat declaration before the Horde's 20 faults an hour."""
        now = self.clock()
        while self._fault_times and now - self._fault_times[0] > 3600.0:
            self._fault_times.popleft()
        recent = len(self._fault_times)
        if self.chat_enabled and recent >= HORDE_FAULT_LIMIT_PER_HOUR - 5:
            if self.settings.prompt_jobs:
                self.chat_enabled = False
                log.warning(
                    "%d faults in the last hour: withdrawing the chat declaration "
                    "(text jobs continue) until the hour is quiet",
                    recent,
                )
        elif not self.chat_enabled and recent < HORDE_FAULT_LIMIT_PER_HOUR // 2:
            self.chat_enabled = True
            log.info("faults have quietened (%d in the last hour): declaring chat again", recent)

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
        genkey = _genkey()
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
            self._fault_text(job.id, lease, f"backend failed: {exc}")
            return
        self._submit(
            job.id,
            reply.text_submit(job.id, generation),
            lease,
            kind="text",
            started=started,
            detail=f"{len(generation)} chars",
            on_refused=None,
        )

    # -------------------------------------------------------------- chat jobs

    def _serve_chat(self, job: jobs.ChatJob, lease: _Lease) -> None:
        """Seed steps 2 to 7 for one chat job."""
        model_id = str(self._last_pop_body.get("model_id") or self.settings.model_id)
        started = self.clock()
        payload_keys = ",".join(sorted(job.payload))
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
        if fit.count_images(messages) and not self.caps.vision:
            self._fault_chat(job.id, model_id, lease, "images sent to a worker without vision")
            return
        # Fit check (seed step 3): count JSON text, never render.
        tools = job.payload.get("tools")
        response_format = job.payload.get("response_format")
        try:
            counted = self.backend.tokencount(
                fit.fit_prompt(messages, tools, response_format),
                timeout_s=max(1.0, min(60.0, lease.remaining(self.clock()))),
            )
        except BackendError as exc:
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
        genkey = _genkey()
        stream = job.stream_progress and not job.has_tools
        backend_body = jobs.chat_request_body(job, messages, genkey=genkey, stream=stream)
        self._note_own_request()
        try:
            if stream:
                outcome = self._generate_streamed(job, model_id, backend_body, genkey, lease)
                if outcome is None:
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
                job.id, model_id, backend_reply, max_length=job.max_length
            )
        except (BackendError, ReplyError) as exc:
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
            on_refused=lambda exc: self._fault_chat(
                job.id,
                model_id,
                lease,
                f"reply refused ({exc.rc}): {exc.message}",
                fault_reason=reply.FAULT_REPLY_REFUSED,
            ),
        )

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
        try:
            self.backend.abort(genkey)
        except BackendError as exc:
            log.debug("abort of %s failed: %s", genkey, exc)

    # ---------------------------------------------------------- streamed jobs

    def _generate_streamed(
        self,
        job: jobs.ChatJob,
        model_id: str,
        backend_body: dict[str, Any],
        genkey: str,
        lease: _Lease,
    ) -> BackendReply | None:
        """Seed "Streaming progress": relay koboldcpp's SSE stream as progress posts.

        Returns the whole reply to submit, or None when the job ended here
        (cancelled, ChatJobAborted, or faulted because the lease ran out).
        Raises BackendError or ReplyError for the caller to fault.
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
        backend_stream = self._open_stream(backend_body, lease, genkey)
        chunks: queue.Queue[bytes | BaseException | None] = queue.Queue()
        reader = threading.Thread(
            target=_pump, args=(backend_stream, chunks), name=f"kcpp-stream-{job.id}", daemon=True
        )
        reader.start()
        ended = False
        try:
            while not ended:
                now = self.clock()
                lease.deadline = max(lease.deadline, poster.lease_deadline)
                if lease.remaining(now) <= SUBMIT_MARGIN_S:
                    self._close_and_abort(backend_stream, genkey)
                    self._fault_chat(job.id, model_id, lease, "the lease ran out while streaming")
                    return None
                try:
                    item = chunks.get(timeout=0.1)
                except queue.Empty:
                    item = b""
                    if not self._post_due(poster, job, backend_stream, genkey, lease):
                        return None
                    continue
                if item is None:
                    for event in decoder.close():
                        self._feed(accumulator, poster, event.data)
                    ended = True
                elif isinstance(item, BaseException):
                    if isinstance(item, BackendError):
                        raise item
                    raise BackendError(f"stream failed: {item!r}")
                else:
                    for event in decoder.feed(item):
                        self._feed(accumulator, poster, event.data)
                    if accumulator.done:
                        ended = True
                if not self._post_due(poster, job, backend_stream, genkey, lease):
                    return None
            tail = accumulator.flush()
            poster.add(tail.content, tail.reasoning)
            final = poster.pending_final()
            if final is not None and not self._post(poster, final, job, backend_stream, genkey):
                return None
            return accumulator.result()
        finally:
            backend_stream.close()

    def _open_stream(
        self, body: dict[str, Any], lease: _Lease, genkey: str
    ) -> BackendStream:
        while True:
            remaining = lease.remaining(self.clock()) - SUBMIT_MARGIN_S
            if remaining <= 1.0:
                raise BackendError("the lease ran out before koboldcpp answered")
            try:
                return self.backend.open_chat_stream(body, read_timeout_s=remaining)
            except BackendBusy:
                if self.stop_event.wait(min(2.0, max(0.0, remaining - 1.0))):
                    raise BackendError("stopping while koboldcpp was busy") from None

    @staticmethod
    def _feed(accumulator: ChatStreamAccumulator, poster: ProgressPoster, data: str) -> None:
        delta = accumulator.feed_event(data)
        if delta.content or delta.reasoning:
            poster.add(delta.content, delta.reasoning)

    def _post_due(
        self,
        poster: ProgressPoster,
        job: jobs.ChatJob,
        backend_stream: BackendStream,
        genkey: str,
        lease: _Lease,
    ) -> bool:
        """Send the post that is due, if any. False when generation must stop."""
        body = poster.due(self.clock())
        if body is None:
            return True
        return self._post(poster, body, job, backend_stream, genkey)

    def _post(
        self,
        poster: ProgressPoster,
        body: dict[str, Any],
        job: jobs.ChatJob,
        backend_stream: BackendStream,
        genkey: str,
    ) -> bool:
        """Post one progress body, retrying as the state machine says.

        Returns False when the job ended (cancelled or ChatJobAborted): the
        local generation is then aborted and nothing is submitted.
        """
        while True:
            try:
                answer = self.horde.progress(body, timeout_s=self.settings.progress_timeout_s)
                action = poster.on_response(200, answer, self.clock())
            except HordeRefusal as exc:
                action = poster.on_response(exc.status, exc.body or {"rc": exc.rc}, self.clock())
            except HordeUnavailable as exc:
                if exc.status:
                    action = poster.on_response(
                        exc.status, exc.body or {"rc": exc.rc}, self.clock()
                    )
                else:
                    action = poster.on_lost(self.clock())
            if action is ProgressAction.RETRY:
                body = poster.retry_body()
                if self.stop_event.wait(0.5):
                    return True
                continue
            if action is ProgressAction.STOP_GENERATING:
                log.info("job=%s cancelled or ended by the Horde: not submitted", job.id)
                self._close_and_abort(backend_stream, genkey)
                return False
            if action is ProgressAction.STOP_POSTING:
                log.info("job=%s progress posts stopped; the job goes on to its submit", job.id)
            return True

    def _close_and_abort(self, backend_stream: BackendStream, genkey: str) -> None:
        backend_stream.close()
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

        A refusal with a ``REFUSAL_RCS`` code calls ``on_refused`` (which faults
        the job with ``reply_refused``); ``DuplicateGen`` means it was already
        settled and ``AbortedGen`` or 404 that the job ended: both are logged
        and dropped. The reply is never sent twice after a definitive answer.
        """
        attempts = 0
        while True:
            attempts += 1
            try:
                answer = self.horde.submit(body, timeout_s=self.settings.submit_timeout_s)
            except HordeRefusal as exc:
                if exc.rc == "DuplicateGen":
                    log.info("job=%s already settled (DuplicateGen): nothing more to send", job_id)
                elif exc.rc == "AbortedGen" or exc.status == 404:
                    self.stats.dropped += 1
                    log.warning("job=%s ended on the Horde before the submit (%s)", job_id, exc.rc)
                elif on_refused is not None and exc.rc in reply.REFUSAL_RCS:
                    log.warning("job=%s reply refused: %s", job_id, exc)
                    on_refused(exc)
                else:
                    self.stats.dropped += 1
                    log.error("job=%s submit refused: %s; dropped", job_id, exc)
                return
            except HordeUnavailable as exc:
                remaining = lease.remaining(self.clock())
                if attempts >= 3 and remaining <= 0:
                    self.stats.dropped += 1
                    log.error("job=%s submit failed (%s), the lease is over; dropped", job_id, exc)
                    return
                delay = min(max(1.0, exc.retry_after_s or 0.0) * attempts, 10.0)
                log.warning("job=%s submit failed (%s); retrying in %.1f s", job_id, exc, delay)
                self._pause(delay)
                continue
            except HordeError as exc:  # pragma: no cover - the two subclasses above cover all
                log.error("job=%s submit failed: %s", job_id, exc)
                return
            reward = answer.get("reward", 0)
            kudos = float(reward) if isinstance(reward, (int, float)) else 0.0
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
    ) -> None:
        """Seed step 7: submit a chat fault (with ``fault_reason`` when one applies)."""
        self.stats.faults += 1
        self._fault_times.append(self.clock())
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
        self._fault_times.append(self.clock())
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


def _pump(stream: BackendStream, out: queue.Queue[bytes | BaseException | None]) -> None:
    """Read a backend stream into a queue: bytes chunks, then None or the error."""
    try:
        while True:
            chunk = stream.read_chunk()
            if not chunk:
                break
            out.put(chunk)
    except BaseException as exc:  # handed to the job thread, which decides
        out.put(exc)
        return
    out.put(None)


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
