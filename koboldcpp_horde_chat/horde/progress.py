"""Streaming progress posts for one job, as a pure state machine (no I/O, no clock).

The worker owns the clock and the HTTP calls; this module decides what to post
and what to do with each answer (one :class:`ProgressPoster` per streamed job)::

    poster.add(content_delta, reasoning_delta)     # client-visible text as it arrives
    body = poster.due(now)                          # a post to send now, or None
    ... POST <horde>/api/v2/generate/text/progress with body ...
    action = poster.on_response(status, json_body, now)   # or poster.on_lost(now)
    RETRY -> send poster.retry_body() again; STOP_GENERATING -> abort, do not submit;
    STOP_POSTING -> keep generating, post nothing more; CONTINUE -> carry on.
    before submitting: poster.pending_final(now) for the last buffered text.

Post body (seed "Streaming progress"): ``{"id": "<job-id>", "seq": 1, "delta":
{"content": "Blue", "reasoning_content": "..."}}``; ``content`` always
(``""`` while only reasoning came), ``reasoning_content`` only when there is some.

Rules implemented, with the seed's values:

* seq is 1 for the first post and one more for each accepted post; one post in
  flight at a time; about one post per ``interval_s`` (1 s); a lost response is
  retried with the identical body (same seq, content and reasoning).
* The cap: at most 1000 posts and 16 bytes per ``max_length`` token of UTF-8
  content plus reasoning over all posts. A post that would pass it is trimmed (on
  a character boundary, reasoning kept before content) and is the last one.
* ``200``: accepted; ``"cancelled": true`` means stop generating and do not
  submit (checked on every response, retries included).
* ``409 ChatProgressOutOfSequence`` with ``expected_seq`` (the seq the horde
  wants next), compared with the seq of the post in flight, ``s``:

  - ``expected_seq > s``: the horde already holds post ``s`` (an earlier copy of
    it was accepted). It counts as accepted and the next post uses
    ``expected_seq``.
  - ``expected_seq < s``: the horde holds only posts ``1 .. expected_seq-1``;
    the posts we believed accepted from ``expected_seq`` on never reached it.
    Their text and the text in flight are merged into one post sent under
    ``expected_seq`` (returned as ``RETRY``; ``retry_body()`` gives it). Posts
    the horde holds are never sent again or changed, so no accepted text is
    rewritten ("do not rewrite text already posted"), and the client still
    receives every character once.
  - ``expected_seq == s`` or a missing/invalid ``expected_seq``: the horde's
    state cannot be reconciled; stop posting.
  - Three 409s in a row: stop posting.
* ``404 ChatJobAborted``: stop generating, do not submit. ``404
  ChatProgressNotStreaming``, ``413 ChatProgressCapReached`` and any other 4xx
  but 429: stop posting, keep generating. ``503 ChatProgressUnavailable``, any
  other 5xx and 429: retry the same body; the ``max_unavailable``-th in a row
  (3) stops posting. A lost response (timeout, reset): retry the same body; the
  ``max_lost``-th in a row (3) stops posting.
* The lease: the job's own (``horde.pop.Lease``), the pop's ttl (``base_lease_s``,
  150 s) from ``popped_at``. A post
  with new text accepted on its first send extends it to 150 s after the post
  was sent (the time passed to ``due``/``pending_final``; the response time when
  none was given), never past ``popped_at + lease_cap_s`` (200 s untrusted, 600 s
  trusted) and never backwards. A post that needed a resend (lost response,
  503, 409) does not extend it: the horde does not extend for a retried post, and
  the worker cannot tell which copy the horde counted.

Seed section: "Streaming progress" (and the pop-loop flowchart: progress posts).
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from .pop import Lease

log = logging.getLogger("koboldcpp_horde_chat.progress")

MAX_POSTS = 1000
"""The horde's cap on progress posts per job."""
CAP_BYTES_PER_TOKEN = 16
"""The horde's cap on posted UTF-8 bytes (content + reasoning) per ``max_length`` token."""
BASE_LEASE_S = 150.0
UNTRUSTED_LEASE_CAP_S = 200.0
TRUSTED_LEASE_CAP_S = 600.0
MAX_CONFLICTS = 3
"""409 answers in a row after which posting stops."""

RC_OUT_OF_SEQUENCE = "ChatProgressOutOfSequence"
RC_JOB_ABORTED = "ChatJobAborted"
RC_NOT_STREAMING = "ChatProgressNotStreaming"
RC_CAP_REACHED = "ChatProgressCapReached"
RC_UNAVAILABLE = "ChatProgressUnavailable"


class ProgressAction(enum.Enum):
    """What the worker does after a progress answer."""

    CONTINUE = "continue"
    """The post was accepted; keep generating and posting."""
    RETRY = "retry"
    """Send ``retry_body()`` (possibly after a short backoff)."""
    STOP_POSTING = "stop_posting"
    """Post nothing more for this job; keep generating and submit as usual."""
    STOP_GENERATING = "stop_generating"
    """The client cancelled or the job ended: abort generation and do not submit."""


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def _trim_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of ``text`` whose UTF-8 encoding fits ``max_bytes``."""
    if max_bytes <= 0:
        return ""
    raw = text.encode("utf-8")
    if len(raw) <= max_bytes:
        return text
    return raw[:max_bytes].decode("utf-8", "ignore")


class ProgressPoster:
    """Progress posting for one streamed job.

    Args:
        job_id: the job's id (the post body's ``id``).
        max_length: the job's ``payload.max_length`` in tokens; the byte cap is
            ``16 * max_length`` bytes of UTF-8 content plus reasoning.
        interval_s: the least time between two posts, seconds (the seed's "about
            once a second").
        max_posts: the post cap (1000).
        max_unavailable: 503/5xx/429 answers in a row after which posting stops.
        max_lost: lost responses in a row after which posting stops.
        lease: the job's lease, extended here (``Lease.extend_to``) as posts are
            accepted; None: one of the poster's own, ``base_lease_s`` from
            ``popped_at``.
        popped_at: when the job was popped, seconds on the caller's clock (the
            same clock as every ``now`` argument, e.g. ``time.monotonic()``);
            ignored when ``lease`` is given (its ``popped_at``).
        base_lease_s: the pop's ``ttl``, seconds (150): how long after a post
            the lease it extends runs.
        lease_cap_s: the longest lease from pop, seconds (200 untrusted, 600 trusted).

    Attributes:
        posting: False once posting stopped for good (any STOP action, or the cap).
        seq: the seq of the post in flight, or of the next post.
        lease: the job's lease.
        lease_deadline: when the job's lease ends, absolute seconds on the caller's clock.
        bytes_accepted: UTF-8 bytes of content plus reasoning accepted so far.
        posts_accepted: posts accepted so far.
        stopped_generating: None, or ``"cancelled"`` / ``"aborted"`` after a
            STOP_GENERATING answer.
        stop_reason: why posting stopped (for the log), or None.
    """

    def __init__(
        self,
        job_id: str,
        *,
        max_length: int,
        interval_s: float = 1.0,
        max_posts: int = MAX_POSTS,
        max_unavailable: int = 3,
        max_lost: int = 3,
        lease: Lease | None = None,
        popped_at: float = 0.0,
        base_lease_s: float = BASE_LEASE_S,
        lease_cap_s: float = UNTRUSTED_LEASE_CAP_S,
    ) -> None:
        if lease is None:
            lease = Lease(popped_at, popped_at + base_lease_s)
        self.job_id = job_id
        self.max_length = max_length
        self.interval_s = interval_s
        self.max_posts = max_posts
        self.max_unavailable = max(1, max_unavailable)
        self.max_lost = max(1, max_lost)
        self.lease = lease
        self.popped_at = lease.popped_at
        self.base_lease_s = base_lease_s
        self.lease_cap_s = lease_cap_s
        self.cap_bytes = CAP_BYTES_PER_TOKEN * max(0, max_length)

        self.posting = True
        self.seq = 1
        self.bytes_accepted = 0
        self.posts_accepted = 0
        self.stopped_generating: str | None = None
        self.stop_reason: str | None = None

        self._buf_content: list[str] = []
        self._buf_reasoning: list[str] = []
        self._posted_content = ""
        self._posted_reasoning = ""
        # (seq, content chars, reasoning chars, utf-8 bytes) of each accepted post.
        self._history: list[tuple[int, int, int, int]] = []

        self._in_flight: dict[str, Any] | None = None
        self._in_flight_bytes = 0
        self._in_flight_sent_at: float | None = None
        self._in_flight_resent = False
        self._in_flight_last = False
        self._last_sent_at: float | None = None

        self._unavailable_in_row = 0
        self._lost_in_row = 0
        self._conflicts_in_row = 0

    @property
    def lease_deadline(self) -> float:
        """When the job's lease ends, seconds on the caller's clock."""
        return self.lease.deadline

    # --- text in -----------------------------------------------------------------

    def add(self, content: str, reasoning: str) -> None:
        """Buffer client-visible text not yet posted.

        Args:
            content: new answer text (reasoning blocks, tool-call markup and stop
                sequences already removed), may be ``""``.
            reasoning: new reasoning text, may be ``""``.

        Both as the chat stream's accumulator
        (``translate.chat_stream.ChatStreamAccumulator``) releases them: without
        U+0000 and with the reasoning's surrounding whitespace held back, so
        the posts add up to the submitted reply.

        Ignored once posting has stopped (the submit carries the whole reply).
        """
        if not self.posting:
            return
        if content:
            self._buf_content.append(content)
        if reasoning:
            self._buf_reasoning.append(reasoning)

    @property
    def has_buffered(self) -> bool:
        """True when text waits for a post."""
        return bool(self._buf_content or self._buf_reasoning)

    # --- posts out ---------------------------------------------------------------

    def due(self, now: float) -> dict[str, Any] | None:
        """The next post to send now, or None.

        A post is due when posting is on, no post is in flight, text is buffered
        and at least ``interval_s`` seconds passed since the previous post was
        sent (the first post goes as soon as there is text). The returned body is
        then in flight: send it and report the answer with ``on_response`` or
        ``on_lost``.

        Args:
            now: the current time, seconds on the caller's clock.

        Returns:
            ``{"id", "seq", "delta": {"content", ["reasoning_content"]}}`` or None.
        """
        if not self.posting or self._in_flight is not None or not self.has_buffered:
            return None
        if self._last_sent_at is not None and now - self._last_sent_at < self.interval_s:
            return None
        return self._send(now)

    def pending_final(self, now: float | None = None) -> dict[str, Any] | None:
        """A last post of the buffered text before the submit, ignoring the interval.

        Returns None when nothing is buffered, posting stopped, or a post is still
        in flight (wait for its answer, then ask again). The returned body is in
        flight like one from ``due``.

        Args:
            now: the current time, seconds (used for the lease; optional).
        """
        if not self.posting or self._in_flight is not None or not self.has_buffered:
            return None
        return self._send(now)

    def retry_body(self) -> dict[str, Any]:
        """The post in flight, to send again after a RETRY.

        Raises:
            RuntimeError: no post is in flight.
        """
        if self._in_flight is None:
            raise RuntimeError("no progress post in flight")
        return _copy_body(self._in_flight)

    @property
    def in_flight(self) -> dict[str, Any] | None:
        """A copy of the post awaiting its answer, or None."""
        return None if self._in_flight is None else _copy_body(self._in_flight)

    @property
    def posted_content(self) -> str:
        """The content of every accepted post, concatenated."""
        return self._posted_content

    @property
    def posted_reasoning(self) -> str:
        """The reasoning of every accepted post, concatenated."""
        return self._posted_reasoning

    # --- answers in --------------------------------------------------------------

    def on_response(self, status: int, body: object, now: float) -> ProgressAction:
        """Handle the horde's answer to the post in flight.

        Args:
            status: the HTTP status.
            body: the decoded JSON body (anything not a dict counts as ``{}``),
                e.g. ``{"accepted_seq": 3, "cancelled": false}`` or
                ``{"rc": "ChatProgressOutOfSequence", "expected_seq": 4, ...}``.
            now: the time the answer arrived, seconds.

        Returns:
            The :class:`ProgressAction` for the worker (see the module docstring).

        Raises:
            RuntimeError: no post is in flight.
        """
        if self._in_flight is None:
            raise RuntimeError("progress answer without a post in flight")
        data: dict[str, Any] = body if isinstance(body, dict) else {}
        rc = data.get("rc") if isinstance(data.get("rc"), str) else ""
        cancelled = data.get("cancelled") is True
        seq = self._in_flight["seq"]

        if 200 <= status < 300:
            accepted = data.get("accepted_seq")
            if isinstance(accepted, int) and accepted != seq:
                log.warning(
                    "job=%s progress post seq %d answered with accepted_seq %d",
                    self.job_id, seq, accepted,
                )
            last = self._accept(now, extend=not self._in_flight_resent)
            if cancelled:
                return self._stop_generating("cancelled", f"cancelled on seq {seq}")
            if last:
                return self._stop_posting(f"cap reached at seq {seq}")
            return ProgressAction.CONTINUE
        if cancelled:
            return self._stop_generating("cancelled", f"cancelled on seq {seq} ({status})")
        if status == 404 and rc == RC_JOB_ABORTED:
            return self._stop_generating("aborted", f"{status} {rc}")
        if status == 409 and rc == RC_OUT_OF_SEQUENCE:
            return self._out_of_sequence(data.get("expected_seq"), now)
        if status >= 500 or status == 429:
            self._unavailable_in_row += 1
            if self._unavailable_in_row >= self.max_unavailable:
                return self._stop_posting(
                    f"{self._unavailable_in_row} unavailable answers in a row ({status} {rc})"
                )
            self._in_flight_resent = True
            return ProgressAction.RETRY
        return self._stop_posting(f"{status} {rc}".strip())

    def on_lost(self, now: float) -> ProgressAction:
        """Handle a post whose answer never arrived (timeout, reset connection).

        Returns RETRY (resend ``retry_body()``, the identical body) or, at the
        ``max_lost``-th lost answer in a row, STOP_POSTING. A post that was
        resent does not extend the lease when it is accepted.

        Raises:
            RuntimeError: no post is in flight.
        """
        if self._in_flight is None:
            raise RuntimeError("lost progress answer without a post in flight")
        self._lost_in_row += 1
        if self._lost_in_row >= self.max_lost:
            return self._stop_posting(f"{self._lost_in_row} lost answers in a row")
        self._in_flight_resent = True
        return ProgressAction.RETRY

    # --- internals ---------------------------------------------------------------

    def _send(self, now: float | None) -> dict[str, Any] | None:
        if self.seq > self.max_posts:
            self._stop_posting(f"post cap of {self.max_posts} reached")
            return None
        content = "".join(self._buf_content)
        reasoning = "".join(self._buf_reasoning)
        self._buf_content = []
        self._buf_reasoning = []
        remaining = self.cap_bytes - self.bytes_accepted
        r_bytes = _utf8_len(reasoning)
        c_bytes = _utf8_len(content)
        last = self.seq >= self.max_posts
        if r_bytes + c_bytes >= remaining:
            last = True
            if r_bytes + c_bytes > remaining:
                reasoning = _trim_utf8(reasoning, remaining)
                r_bytes = _utf8_len(reasoning)
                content = _trim_utf8(content, remaining - r_bytes)
                c_bytes = _utf8_len(content)
                log.debug(
                    "job=%s progress byte cap of %d bytes reached; last post trimmed",
                    self.job_id, self.cap_bytes,
                )
            if r_bytes + c_bytes == 0:
                self._stop_posting(f"byte cap of {self.cap_bytes} bytes reached")
                return None
        body = _make_body(self.job_id, self.seq, content, reasoning)
        self._in_flight = body
        self._in_flight_bytes = r_bytes + c_bytes
        self._in_flight_sent_at = now
        self._in_flight_resent = False
        self._in_flight_last = last
        if now is not None:
            self._last_sent_at = now
        return _copy_body(body)

    def _accept(self, now: float, *, extend: bool) -> bool:
        """Record the post in flight as accepted; returns True when it was the last."""
        assert self._in_flight is not None
        delta = self._in_flight["delta"]
        content: str = delta["content"]
        reasoning: str = delta.get("reasoning_content", "")
        self._posted_content += content
        self._posted_reasoning += reasoning
        self._history.append((self._in_flight["seq"], len(content), len(reasoning),
                              self._in_flight_bytes))
        self.bytes_accepted += self._in_flight_bytes
        self.posts_accepted += 1
        if extend:
            sent = self._in_flight_sent_at if self._in_flight_sent_at is not None else now
            new_deadline = min(sent + self.base_lease_s, self.popped_at + self.lease_cap_s)
            self.lease.extend_to(new_deadline)
        self.seq = self._in_flight["seq"] + 1
        last = self._in_flight_last
        self._in_flight = None
        self._unavailable_in_row = 0
        self._lost_in_row = 0
        self._conflicts_in_row = 0
        return last

    def _out_of_sequence(self, expected: object, now: float) -> ProgressAction:
        assert self._in_flight is not None
        seq: int = self._in_flight["seq"]
        if not isinstance(expected, int) or isinstance(expected, bool) or expected < 1:
            return self._stop_posting(f"409 {RC_OUT_OF_SEQUENCE} without a valid expected_seq")
        if expected == seq:
            return self._stop_posting(f"409 {RC_OUT_OF_SEQUENCE} expecting our own seq {seq}")
        conflicts = self._conflicts_in_row + 1
        if expected > seq:
            # The horde already holds this post (an earlier copy was accepted).
            log.debug(
                "job=%s progress: the Horde expects seq %d after our seq %d; "
                "counting it as accepted",
                self.job_id, expected, seq,
            )
            last = self._accept(now, extend=False)
            self._conflicts_in_row = conflicts
            self.seq = expected
            if conflicts >= MAX_CONFLICTS:
                return self._stop_posting(f"{conflicts} out-of-sequence answers in a row")
            if last:
                return self._stop_posting(f"cap reached at seq {seq}")
            return ProgressAction.CONTINUE
        # expected < seq: the horde lacks our posts from `expected` on. Merge their
        # text with the post in flight and send it as `expected`.
        self._conflicts_in_row = conflicts
        keep = [h for h in self._history if h[0] < expected]
        drop = self._history[len(keep):]
        c_chars = sum(h[1] for h in drop)
        r_chars = sum(h[2] for h in drop)
        d_bytes = sum(h[3] for h in drop)
        c_cut = len(self._posted_content) - c_chars
        r_cut = len(self._posted_reasoning) - r_chars
        c_tail, self._posted_content = self._posted_content[c_cut:], self._posted_content[:c_cut]
        r_tail, self._posted_reasoning = (
            self._posted_reasoning[r_cut:], self._posted_reasoning[:r_cut]
        )
        self._history = keep
        self.bytes_accepted -= d_bytes
        self.posts_accepted -= len(drop)
        self.seq = expected
        if conflicts >= MAX_CONFLICTS:
            return self._stop_posting(f"{conflicts} out-of-sequence answers in a row")
        delta = self._in_flight["delta"]
        log.warning(
            "job=%s progress: the Horde expects seq %d, below our seq %d; "
            "resending %d posts' text as seq %d",
            self.job_id, expected, seq, len(drop), expected,
        )
        self._in_flight = _make_body(
            self.job_id,
            expected,
            c_tail + delta["content"],
            r_tail + delta.get("reasoning_content", ""),
        )
        self._in_flight_bytes += d_bytes
        self._in_flight_resent = True
        self._in_flight_last = self._in_flight_last or expected >= self.max_posts
        return ProgressAction.RETRY

    def _stop_posting(self, reason: str, *, logged: bool = False) -> ProgressAction:
        if self.posting and not logged:
            log.debug("job=%s progress: stop posting: %s", self.job_id, reason)
        self.posting = False
        self.stop_reason = self.stop_reason or reason
        self._in_flight = None
        self._buf_content = []
        self._buf_reasoning = []
        return ProgressAction.STOP_POSTING

    def _stop_generating(self, why: str, reason: str) -> ProgressAction:
        log.debug("job=%s progress: stop generating: %s", self.job_id, reason)
        self._stop_posting(reason, logged=True)
        self.stopped_generating = why
        return ProgressAction.STOP_GENERATING


def _make_body(job_id: str, seq: int, content: str, reasoning: str) -> dict[str, Any]:
    delta: dict[str, str] = {"content": content}
    if reasoning:
        delta["reasoning_content"] = reasoning
    return {"id": job_id, "seq": seq, "delta": delta}


def _copy_body(body: dict[str, Any]) -> dict[str, Any]:
    return {"id": body["id"], "seq": body["seq"], "delta": dict(body["delta"])}
