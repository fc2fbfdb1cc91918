"""A streamed chat generation: koboldcpp's SSE stream in, Horde progress posts out.

Seed "Streaming progress": for a job with ``stream_progress: true`` (and no
tools) the worker reads koboldcpp's ``/v1/chat/completions`` stream and posts
the text produced since the previous post about once a second. The pure core
decides (``sse``, ``chat_stream``, ``progress``); this module reads, posts and
waits, and journals the lease when accepted posts moved it.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from ..errors import (
    BackendBusy,
    BackendError,
    HordeRefusal,
    HordeUnavailable,
    JobEnded,
    JobFault,
    ReplyError,
)
from ..horde.pop import ChatJob
from ..horde.progress import ProgressAction, ProgressPoster
from ..koboldcpp.answers import BackendReply
from ..koboldcpp.api import KcppStream
from ..koboldcpp.sse import SSEDecoder
from ..state.job import SUBMIT_MARGIN_S, JobContext
from ..state.ports import Ports, abort_quietly
from ..translate.chat_stream import ChatStreamAccumulator

log = logging.getLogger("koboldcpp_horde_chat.streamed")

#: Seconds between checks of the lease and of posts that are due while koboldcpp is silent.
POLL_S = 0.1


def generate_streamed(
    ports: Ports, job: ChatJob, ctx: JobContext, backend_body: bytes | bytearray
) -> BackendReply:
    """The whole reply of koboldcpp's stream of ``backend_body``, relayed as progress posts.

    The stream is read on a thread of its own (koboldcpp is silent while it
    waits for its model lock and processes the prompt), so this thread keeps
    the lease: every 0.1 s at most it posts what is due and checks the
    deadline, which accepted posts extend. The read timeout is only a backstop
    at the latest end the lease can reach. A lease ending within
    ``SUBMIT_MARGIN_S`` aborts the generation and faults the job.

    Raises:
        JobEnded: cancelled or ended by the Horde (the generation aborted).
        JobFault: the lease ran out while streaming.
        BackendError, ReplyError: a failed stream, an in-band error, or an end
            without a finish reason (the generation aborted first).
    """
    return _StreamedGeneration(ports, job, ctx, backend_body).run()


class _StreamedGeneration:

    def __init__(
        self, ports: Ports, job: ChatJob, ctx: JobContext, body: bytes | bytearray
    ) -> None:
        self.ports, self.ctx, self.body = ports, ctx, body
        lease = ctx.lease
        self.poster = ProgressPoster(
            job.id, max_length=job.max_length, lease=lease, lease_cap_s=ports.settings.lease_cap_s,
        )
        #: The lease end last journaled (monotonic seconds).
        self.journaled_deadline = lease.deadline
        self.accumulator = ChatStreamAccumulator(stop_sequences=job.stop_sequences)
        self.slot = _StreamSlot()

    def run(self) -> BackendReply:
        clock, ctx, accumulator, poster = self.ports.clock, self.ctx, self.accumulator, self.poster
        lease = ctx.lease
        decoder = SSEDecoder()
        chunks: queue.Queue[bytes | BaseException | None] = queue.Queue()
        threading.Thread(
            target=self._pump, args=(chunks,), name=f"kcpp-stream-{ctx.id}", daemon=True
        ).start()
        try:
            ended = False
            while not ended:
                now = clock.monotonic()
                self._journal_lease()
                if ctx.abandoned.is_set() or lease.remaining(now) <= SUBMIT_MARGIN_S:
                    self._close_and_abort()
                    ctx.check_abandoned()  # given up: its fault, else the lease's
                    raise JobFault("the lease ran out while streaming")
                try:
                    item = chunks.get(timeout=POLL_S)
                except queue.Empty:
                    self._post(poster.due(clock.monotonic()))
                    continue
                ended = self._take(item, decoder)
                # What koboldcpp sent while the last post was answered goes into the
                # next post whole: a slow Horde must not turn into one post per chunk
                # (this thread alone takes from the queue).
                while not ended and not chunks.empty():
                    ended = self._take(chunks.get_nowait(), decoder)
                if not ended:
                    self._post(poster.due(clock.monotonic()))
            if accumulator.native_finish_reason is None:
                raise ReplyError(
                    "the stream ended without a finish reason"
                    + ("" if accumulator.done else " (and without [DONE]: cut off)")
                )
            tail = accumulator.flush()
            poster.add(tail.content, tail.reasoning)
            self._post(poster.pending_final(clock.monotonic()))
            self._journal_lease()  # the lease the last post extended
            return accumulator.result()
        finally:
            self.slot.close()

    def _take(self, item: bytes | BaseException | None, decoder: SSEDecoder) -> bool:
        """Feed one item of the reader's queue; True when the stream ended. Raises
        BackendError or ReplyError (in-band) after aborting the generation."""
        accumulator = self.accumulator
        if isinstance(item, BaseException):
            self._close_and_abort()
            if isinstance(item, BackendError):
                raise item
            raise BackendError(f"stream failed: {item!r}")
        for event in decoder.close() if item is None else decoder.feed(item):
            delta = accumulator.feed_event(event.data)
            self.poster.add(delta.content, delta.reasoning)
            if accumulator.done or accumulator.error is not None:
                break
        if accumulator.error is not None:
            if item is not None:  # abort at once: what koboldcpp sends after an error is not used
                self._close_and_abort()
            raise ReplyError(f"koboldcpp reported an error mid-stream: {accumulator.error}")
        return item is None or accumulator.done

    def _open_stream(self) -> KcppStream:
        """Open koboldcpp's stream, waiting out 503 busy answers (BackendError when
        the job ended meanwhile); the read timeout is the lease's latest end."""
        ports, lease = self.ports, self.ctx.lease
        while True:
            now = ports.clock.monotonic()
            latest_end = max(lease.deadline, lease.popped_at + ports.settings.lease_cap_s)
            try:
                return ports.koboldcpp.backend.open_chat_stream(
                    self.body, read_timeout_s=max(1.0, latest_end - now)
                )
            except BackendBusy:
                if self.slot.closed.wait(2.0):
                    raise BackendError("the job ended while koboldcpp was busy") from None

    def _pump(self, out: queue.Queue[bytes | BaseException | None]) -> None:
        try:
            stream = self._open_stream()
            if not self.slot.attach(stream):
                return
            while chunk := stream.read_chunk():
                out.put(chunk)
        except BaseException as exc:  # handed to the job thread, which decides
            out.put(exc)
            return
        out.put(None)

    def _journal_lease(self) -> None:
        deadline = self.ctx.lease.deadline
        if deadline > self.journaled_deadline:
            self.journaled_deadline = deadline
            self.ctx.record_lease()

    def _post(self, body: dict[str, Any] | None) -> None:
        """Post one progress body (None: none due), retrying as ``ProgressPoster`` says (a lost
        answer with the identical body) until the lease nears its end; nothing
        once the job is given up. Raises JobEnded (the generation aborted) when
        the job was cancelled or ended by the Horde."""
        ports, poster, lease = self.ports, self.poster, self.ctx.lease
        clock = ports.clock
        while body is not None:
            if self.ctx.abandoned.is_set():
                return  # given up (the stop's deadline): no more posts, no retries
            room = lease.remaining(clock.monotonic()) - SUBMIT_MARGIN_S
            timeout = max(1.0, min(ports.settings.progress_timeout_s, room))
            sent_at = clock.monotonic()
            try:
                try:
                    answer = ports.horde.progress(body, timeout_s=timeout)
                finally:
                    self.ctx.note_horde_wait(clock.monotonic() - sent_at)
                action = poster.on_response(200, answer, clock.monotonic())
            except (HordeRefusal, HordeUnavailable) as exc:
                if isinstance(exc, HordeRefusal) or exc.status == 429 or exc.status >= 500:
                    answered = exc.body or {"rc": exc.rc}
                    action = poster.on_response(exc.status, answered, clock.monotonic())
                else:
                    log.info(
                        "job=%s progress seq %s: answer lost (%s)", self.ctx.id, body["seq"],
                        exc.reason,
                    )
                    action = poster.on_lost(clock.monotonic())
            if action is ProgressAction.RETRY:
                body = poster.retry_body()
                self._journal_lease()
                if lease.remaining(clock.monotonic()) - SUBMIT_MARGIN_S <= 0.5:
                    return  # the caller's lease check aborts and faults the job
                paused_at = clock.monotonic()
                ports.stop.pause(0.5)
                self.ctx.note_horde_wait(clock.monotonic() - paused_at)
                continue
            if action is ProgressAction.STOP_GENERATING:
                log.info("job=%s cancelled or ended by the Horde: not submitted", self.ctx.id)
                self._close_and_abort()
                counted = poster.stopped_generating != "cancelled"
                raise JobEnded("cancelled or ended by the Horde", counted=counted)
            if action is ProgressAction.STOP_POSTING:
                log.info(
                    "job=%s progress posts stopped (%s); the job goes on to its submit",
                    self.ctx.id, poster.stop_reason or "the Horde said so",
                )
            return

    def _close_and_abort(self) -> None:
        """Close the stream, then abort by ``genkey`` (which also covers a request
        still queued for koboldcpp's model lock)."""
        self.slot.close()
        abort_quietly(self.ports.koboldcpp.backend, self.ctx.genkey)


class _StreamSlot:
    """A job's koboldcpp stream, shared by the job thread and its reader; a
    ``close()`` before it opens closes it as soon as it opens."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stream: KcppStream | None = None
        self.closed = threading.Event()

    def attach(self, stream: KcppStream) -> bool:
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
