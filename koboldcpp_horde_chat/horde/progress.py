"""Streaming progress posts for one job: a pure state machine (no I/O, no clock).

Seed section "Streaming progress". The caller owns the clock and the HTTP calls::

    poster.add(content, reasoning)          # released text
    body = poster.due(now)                  # a post to send now, or None
    action = poster.on_response(status, json_body, now)   # or poster.on_lost(now)
    RETRY: send poster.retry_body(); STOP_GENERATING: abort, do not submit;
    STOP_POSTING: keep generating, post no more. Before the submit: pending_final(now).

Body: ``{"id", "seq", "delta": {"content", "reasoning_content" (only when some)}}``.
The seed's values: seq starts at 1, one post in flight, about one post per second;
at most 1000 posts and 16 UTF-8 bytes per ``max_length`` token (the post that
passes it is trimmed, reasoning kept first, and is the last). 409
``ChatProgressOutOfSequence``: an ``expected_seq`` above ours means the Horde holds
our post (accepted); below ours, the posts it lacks are merged into one resent as
``expected_seq`` (accepted text is never rewritten); equal or invalid, or three
409s in a row: stop posting. 404 ``ChatJobAborted`` or ``"cancelled": true``:
stop generating. 429, 5xx and lost answers are retried with the same body, the
third in a row stops posting; any other 4xx stops posting. An accepted post sent
once extends the lease to 150 s after it was sent, never past ``popped_at +
lease_cap_s`` (200 s untrusted, 600 s trusted); a resent post does not (the Horde
does not extend for a retried post).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from .codes import JOB_ABORTED, PROGRESS_OUT_OF_SEQUENCE
from .pop import Lease

log = logging.getLogger("koboldcpp_horde_chat.progress")

MAX_POSTS = 1000
CAP_BYTES_PER_TOKEN = 16
UNTRUSTED_LEASE_CAP_S = 200.0
#: 409, unavailable or lost answers in a row after which posting stops.
MAX_IN_A_ROW = 3


class ProgressAction(enum.Enum):
    """What the worker does after a progress answer."""

    CONTINUE = "continue"
    RETRY = "retry"
    STOP_POSTING = "stop_posting"
    STOP_GENERATING = "stop_generating"


def utf8_prefix(text: str, max_bytes: int) -> str:
    """The longest prefix of ``text`` within ``max_bytes`` of UTF-8."""
    return text.encode("utf-8")[: max(max_bytes, 0)].decode("utf-8", "ignore")


@dataclass
class _Post:
    """A post in flight, or accepted (kept to be resent after a 409)."""

    seq: int
    content: str
    reasoning: str
    sent_at: float | None
    resent: bool = False
    last: bool = False

    @property
    def size(self) -> int:
        """Its text's UTF-8 bytes."""
        return len((self.content + self.reasoning).encode("utf-8"))

    def body(self, job_id: str) -> dict[str, Any]:
        reasoning = {"reasoning_content": self.reasoning} if self.reasoning else {}
        return {"id": job_id, "seq": self.seq, "delta": {"content": self.content, **reasoning}}


class ProgressPoster:
    """Progress posting for one streamed job; times are seconds on the caller's clock.

    ``max_length`` (tokens) sets the byte cap; ``lease`` is the job's lease as
    popped (its length is the base lease), extended as posts are accepted.
    ``posting`` turns False for good at any stop; ``stopped_generating`` is then
    None, ``"cancelled"`` or ``"aborted"``; ``stop_reason`` says why, for the log.
    """

    def __init__(self, job_id: str, *, max_length: int, lease: Lease, interval_s: float = 1.0,
                 max_posts: int = MAX_POSTS, lease_cap_s: float = UNTRUSTED_LEASE_CAP_S) -> None:
        self.job_id = job_id
        self.interval_s = interval_s
        self.max_posts = max_posts
        self.lease = lease
        self.base_lease_s = lease.deadline - lease.popped_at
        self.lease_cap_s = lease_cap_s
        self.cap_bytes = CAP_BYTES_PER_TOKEN * max(0, max_length)

        self.posting = True
        self.seq = 1
        self.bytes_accepted = 0
        self.posts_accepted = 0
        self.stopped_generating: str | None = None
        self.stop_reason: str | None = None

        self._buf_content = self._buf_reasoning = ""
        self._history: list[_Post] = []  # the accepted posts
        self._in_flight: _Post | None = None
        self._last_sent_at: float | None = None

        self._unavailable_in_row = self._lost_in_row = self._conflicts_in_row = 0

    def add(self, content: str, reasoning: str) -> None:
        """Buffer released text (as the chat stream's accumulator gives it, so the
        posts add up to the submitted reply); ignored once posting stopped."""
        if self.posting:
            self._buf_content += content
            self._buf_reasoning += reasoning

    def due(self, now: float) -> dict[str, Any] | None:
        """The next post, now in flight, or None: nothing buffered, a post in flight,
        posting stopped, or less than ``interval_s`` since the last post."""
        if self._last_sent_at is not None and now - self._last_sent_at < self.interval_s:
            return None
        return self.pending_final(now)

    def pending_final(self, now: float | None = None) -> dict[str, Any] | None:
        """Like :meth:`due` without the interval: the last post before the submit."""
        buffered = self._buf_content or self._buf_reasoning
        if not self.posting or self._in_flight is not None or not buffered:
            return None
        return self._send(now)

    def retry_body(self) -> dict[str, Any]:
        """The post in flight, to send again. Raises RuntimeError without one."""
        if self._in_flight is None:
            raise RuntimeError("no progress post in flight")
        return self._in_flight.body(self.job_id)

    @property
    def posted_content(self) -> str:
        return "".join(post.content for post in self._history)

    @property
    def posted_reasoning(self) -> str:
        return "".join(post.reasoning for post in self._history)

    def on_response(self, status: int, body: object, now: float) -> ProgressAction:
        """Handle the Horde's answer (``body`` decoded; not a dict counts as ``{}``).

        Raises RuntimeError when no post is in flight.
        """
        post = self._in_flight
        if post is None:
            raise RuntimeError("progress answer without a post in flight")
        data: dict[str, Any] = body if isinstance(body, dict) else {}
        rc = data.get("rc") if isinstance(data.get("rc"), str) else ""
        cancelled = data.get("cancelled") is True
        seq = post.seq

        if 200 <= status < 300:
            accepted = data.get("accepted_seq")
            if isinstance(accepted, int) and accepted != seq:
                log.warning("job=%s progress post seq %d answered with accepted_seq %d",
                            self.job_id, seq, accepted)
            last = self._accept(now, extend=not post.resent)
            if cancelled:
                return self._stop_generating("cancelled", f"cancelled on seq {seq}")
            if last:
                return self._stop_posting(f"cap reached at seq {seq}")
            return ProgressAction.CONTINUE
        if cancelled:
            return self._stop_generating("cancelled", f"cancelled on seq {seq} ({status})")
        if status == 404 and rc == JOB_ABORTED:
            return self._stop_generating("aborted", f"{status} {rc}")
        if status == 409 and rc == PROGRESS_OUT_OF_SEQUENCE:
            return self._out_of_sequence(post, data.get("expected_seq"), now)
        if status >= 500 or status == 429:
            self._unavailable_in_row = n = self._unavailable_in_row + 1
            if n >= MAX_IN_A_ROW:
                return self._stop_posting(f"{n} unavailable answers in a row ({status} {rc})")
            post.resent = True
            return ProgressAction.RETRY
        return self._stop_posting(f"{status} {rc}".strip())

    def on_lost(self, now: float) -> ProgressAction:
        """Handle a post whose answer never came. Raises RuntimeError without one."""
        if self._in_flight is None:
            raise RuntimeError("lost progress answer without a post in flight")
        self._lost_in_row += 1
        if self._lost_in_row >= MAX_IN_A_ROW:
            return self._stop_posting(f"{self._lost_in_row} lost answers in a row")
        self._in_flight.resent = True
        return ProgressAction.RETRY

    def _send(self, now: float | None) -> dict[str, Any] | None:
        if self.seq > self.max_posts:
            self._stop_posting(f"post cap of {self.max_posts} reached")
            return None
        post = _Post(self.seq, self._buf_content, self._buf_reasoning, now)
        self._buf_content = self._buf_reasoning = ""
        remaining = self.cap_bytes - self.bytes_accepted
        post.last = self.seq >= self.max_posts or post.size >= remaining
        if post.size > remaining:
            post.reasoning = utf8_prefix(post.reasoning, remaining)
            room = remaining - len(post.reasoning.encode("utf-8"))
            post.content = utf8_prefix(post.content, room)
            log.debug("job=%s progress byte cap of %d bytes reached; last post trimmed",
                      self.job_id, self.cap_bytes)
            if post.size == 0:
                self._stop_posting(f"byte cap of {self.cap_bytes} bytes reached")
                return None
        self._in_flight = post
        if now is not None:
            self._last_sent_at = now
        return post.body(self.job_id)

    def _accept(self, now: float, *, extend: bool) -> bool:
        """Record the post in flight as accepted; True when it was the last."""
        post = self._in_flight
        assert post is not None
        self._history.append(post)
        self.bytes_accepted += post.size
        self.posts_accepted += 1
        if extend:
            sent = post.sent_at if post.sent_at is not None else now
            lease = self.lease
            lease.extend_to(min(sent + self.base_lease_s, lease.popped_at + self.lease_cap_s))
        self.seq = post.seq + 1
        self._in_flight = None
        self._unavailable_in_row = self._lost_in_row = self._conflicts_in_row = 0
        return post.last

    def _out_of_sequence(self, post: _Post, expected: object, now: float) -> ProgressAction:
        seq = post.seq
        if not isinstance(expected, int) or isinstance(expected, bool) or expected < 1:
            return self._stop_posting(f"409 {PROGRESS_OUT_OF_SEQUENCE} without a valid "
                                      "expected_seq")
        if expected == seq:
            return self._stop_posting(f"409 {PROGRESS_OUT_OF_SEQUENCE} expecting our own seq {seq}")
        conflicts = self._conflicts_in_row + 1
        last = False
        drop: list[_Post] = []
        if expected > seq:
            # The horde already holds this post (an earlier copy was accepted).
            log.debug("job=%s progress: the Horde expects seq %d after our seq %d; counting it "
                      "as accepted", self.job_id, expected, seq)
            last = self._accept(now, extend=False)
        else:
            # The horde lacks our posts from `expected` on: their text goes with the post
            # in flight, sent as `expected`.
            keep = [h for h in self._history if h.seq < expected]
            drop = self._history[len(keep):]
            self._history = keep
            self.bytes_accepted -= sum(h.size for h in drop)
            self.posts_accepted -= len(drop)
        self._conflicts_in_row = conflicts
        self.seq = expected
        if conflicts >= MAX_IN_A_ROW:
            return self._stop_posting(f"{conflicts} out-of-sequence answers in a row")
        if last:
            return self._stop_posting(f"cap reached at seq {seq}")
        if expected > seq:
            return ProgressAction.CONTINUE
        log.warning("job=%s progress: the Horde expects seq %d, below our seq %d; resending %d "
                    "posts' text as seq %d", self.job_id, expected, seq, len(drop), expected)
        post.seq = expected
        post.content = "".join(h.content for h in drop) + post.content
        post.reasoning = "".join(h.reasoning for h in drop) + post.reasoning
        post.resent = True
        post.last = post.last or expected >= self.max_posts
        return ProgressAction.RETRY

    def _stop_posting(self, reason: str, *, logged: bool = False) -> ProgressAction:
        if self.posting and not logged:
            log.debug("job=%s progress: stop posting: %s", self.job_id, reason)
        self.posting = False
        self.stop_reason = self.stop_reason or reason
        self._in_flight = None
        self._buf_content = self._buf_reasoning = ""
        return ProgressAction.STOP_POSTING

    def _stop_generating(self, why: str, reason: str) -> ProgressAction:
        log.debug("job=%s progress: stop generating: %s", self.job_id, reason)
        self._stop_posting(reason, logged=True)
        self.stopped_generating = why
        return ProgressAction.STOP_GENERATING
