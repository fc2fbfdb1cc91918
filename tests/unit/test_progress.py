"""ProgressPoster: the seed's "Streaming progress" rules as a state machine."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from koboldcpp_horde_chat.horde.pop import Lease
from koboldcpp_horde_chat.horde.progress import ProgressAction, ProgressPoster

A = ProgressAction
T0 = 1000.0  # popped_at


def poster(**kw: Any) -> ProgressPoster:
    kw.setdefault("max_length", 512)
    kw.setdefault("lease", Lease(T0, T0 + kw.pop("base_lease_s", 150.0)))
    return ProgressPoster("job-1", **kw)


def ok(seq: int, cancelled: bool = False) -> dict[str, Any]:
    return {"accepted_seq": seq, "cancelled": cancelled}


def refusal(rc: str, **extra: Any) -> dict[str, Any]:
    return {"message": "refused", "rc": rc, **extra}


# --- bodies, seq, interval ---------------------------------------------------------------


def test_nothing_is_due_before_text_arrives() -> None:
    p = poster()
    assert p.due(T0 + 5) is None
    assert p.pending_final() is None


def test_the_first_post_goes_as_soon_as_text_exists_with_seq_1() -> None:
    p = poster()
    p.add("Blue", "")
    assert p.due(T0) == {"id": "job-1", "seq": 1, "delta": {"content": "Blue"}}
    assert p.retry_body() == {"id": "job-1", "seq": 1, "delta": {"content": "Blue"}}


def test_reasoning_is_posted_beside_an_empty_content_until_the_answer_starts() -> None:
    p = poster()
    p.add("", "Let me think")
    body = p.due(T0)
    assert body == {"id": "job-1", "seq": 1, "delta": {"content": "", "reasoning_content": "Let me think"}}
    assert p.on_response(200, ok(1), T0 + 0.1) is A.CONTINUE
    p.add("", " more.")
    p.add("Blue.", "")
    assert p.due(T0 + 1.0) == {
        "id": "job-1", "seq": 2, "delta": {"content": "Blue.", "reasoning_content": " more."}
    }


def test_one_post_in_flight_at_a_time_and_about_one_per_interval() -> None:
    p = poster(interval_s=1.0)
    p.add("a", "")
    assert p.due(T0)["seq"] == 1  # type: ignore[index]
    p.add("b", "")
    assert p.due(T0 + 5) is None  # still in flight
    assert p.on_response(200, ok(1), T0 + 0.2) is A.CONTINUE
    assert p.due(T0 + 0.5) is None  # only 0.5 s since the previous post was sent
    assert p.due(T0 + 0.999) is None
    assert p.due(T0 + 1.0) == {"id": "job-1", "seq": 2, "delta": {"content": "b"}}


def test_text_added_while_a_post_is_in_flight_goes_in_the_next_post() -> None:
    p = poster(interval_s=0)
    p.add("a", "")
    p.due(T0)
    p.add("b", "x")
    p.add("c", "y")
    p.on_response(200, ok(1), T0)
    assert p.due(T0) == {"id": "job-1", "seq": 2, "delta": {"content": "bc", "reasoning_content": "xy"}}


def test_pending_final_ignores_the_interval_but_waits_for_the_post_in_flight() -> None:
    p = poster(interval_s=10.0)
    p.add("a", "")
    p.due(T0)
    p.add("b", "")
    assert p.pending_final() is None
    p.on_response(200, ok(1), T0 + 0.1)
    assert p.due(T0 + 0.2) is None
    assert p.pending_final() == {"id": "job-1", "seq": 2, "delta": {"content": "b"}}
    p.on_response(200, ok(2), T0 + 0.3)
    assert p.pending_final() is None
    assert p.posted_content == "ab"


def test_accepted_posts_are_recorded() -> None:
    p = poster(interval_s=0)
    for i, (c, r) in enumerate([("", "think"), ("Bl", ""), ("ue", "")], start=1):
        p.add(c, r)
        p.due(T0 + i)
        assert p.on_response(200, ok(i), T0 + i) is A.CONTINUE
    assert (p.posted_content, p.posted_reasoning) == ("Blue", "think")
    assert p.posts_accepted == 3
    assert p.seq == 4
    assert p.bytes_accepted == 9


def test_answers_without_a_post_in_flight_are_a_programming_error() -> None:
    p = poster()
    with pytest.raises(RuntimeError):
        p.on_response(200, ok(1), T0)
    with pytest.raises(RuntimeError):
        p.on_lost(T0)
    with pytest.raises(RuntimeError):
        p.retry_body()


# --- cancelled and ended jobs ---------------------------------------------------------------


def test_cancelled_true_stops_generation_and_the_delta_counts_as_accepted() -> None:
    p = poster()
    p.add("Blue", "")
    p.due(T0)
    assert p.on_response(200, ok(1, cancelled=True), T0 + 0.1) is A.STOP_GENERATING
    assert p.posted_content == "Blue"
    assert p.stopped_generating == "cancelled"
    assert not p.posting
    p.add("more", "")
    assert p.due(T0 + 5) is None
    assert p.pending_final() is None


def test_cancelled_on_the_answer_to_a_retry_stops_generation_too() -> None:
    p = poster()
    p.add("Blue", "")
    p.due(T0)
    assert p.on_lost(T0 + 10) is A.RETRY
    assert p.on_response(200, ok(1, cancelled=True), T0 + 11) is A.STOP_GENERATING


def test_a_cancel_logs_one_debug_line_naming_the_job(caplog: pytest.LogCaptureFixture) -> None:
    """The job run logs the cancel at INFO; the poster adds one DEBUG line, not two INFO ones."""
    caplog.set_level(logging.DEBUG, logger="koboldcpp_horde_chat.progress")
    p = poster()
    p.add("Blue", "")
    p.due(T0)
    assert p.on_response(200, ok(1, cancelled=True), T0 + 0.1) is A.STOP_GENERATING
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "job=job-1 progress: stop generating: cancelled on seq 1"),
    ]


def test_every_progress_line_names_the_job_as_job_equals_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="koboldcpp_horde_chat.progress")
    p = poster(max_length=1)  # a 16-byte cap
    p.add("Blue", "")
    p.due(T0)
    assert p.on_response(200, ok(7), T0 + 0.1) is A.CONTINUE  # accepted_seq mismatch
    p.add("Green", "")
    p.due(T0 + 2)
    assert p.on_response(409, refusal("ChatProgressOutOfSequence", expected_seq=1), T0 + 2.1) is (
        A.RETRY
    )
    assert p.on_response(409, refusal("ChatProgressOutOfSequence", expected_seq=3), T0 + 2.2) is (
        A.CONTINUE
    )
    p.add("x" * 40, "")
    p.due(T0 + 4)  # trimmed to the cap: the last post
    assert p.on_response(200, ok(3), T0 + 4.1) is A.STOP_POSTING
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5, lines
    assert all(line.startswith("job=job-1 progress") for line in lines), lines
    assert [r.levelno for r in caplog.records if r.levelno > logging.DEBUG] == [
        logging.WARNING, logging.WARNING,
    ]


def test_chat_job_aborted_stops_generation() -> None:
    p = poster()
    p.add("Blue", "")
    p.due(T0)
    assert p.on_response(404, refusal("ChatJobAborted"), T0 + 0.1) is A.STOP_GENERATING
    assert p.stopped_generating == "aborted"
    assert p.posted_content == ""


@pytest.mark.parametrize(
    ("status", "rc"),
    [
        (404, "ChatProgressNotStreaming"),
        (413, "ChatProgressCapReached"),
        (400, "ValidationError"),
        (401, "InvalidAPIKey"),
        (403, "WrongCredentials"),
        (404, ""),
        (409, "SomethingElse"),
    ],
)
def test_definitive_refusals_stop_posting_but_not_generating(status: int, rc: str) -> None:
    p = poster()
    p.add("Blue", "")
    p.due(T0)
    assert p.on_response(status, refusal(rc), T0 + 0.1) is A.STOP_POSTING
    assert not p.posting
    assert p.stopped_generating is None
    with pytest.raises(RuntimeError):
        p.retry_body()
    p.add("more", "")
    assert p.due(T0 + 5) is None
    assert p.pending_final() is None


# --- unavailable and lost answers -------------------------------------------------------------


@pytest.mark.parametrize("status", [503, 500, 502, 504, 429])
def test_unavailable_is_retried_with_the_same_body_and_stops_at_the_third_in_a_row(status: int) -> None:
    p = poster()
    p.add("Blue", "r")
    body = p.due(T0)
    assert p.on_response(status, refusal("ChatProgressUnavailable"), T0 + 0.1) is A.RETRY
    assert p.retry_body() == body
    assert p.on_response(status, refusal("ChatProgressUnavailable"), T0 + 0.6) is A.RETRY
    assert p.retry_body() == body
    assert p.on_response(status, refusal("ChatProgressUnavailable"), T0 + 1.1) is A.STOP_POSTING
    assert not p.posting


def test_a_success_resets_the_unavailable_count() -> None:
    p = poster(interval_s=0)
    for seq in (1, 2, 3):
        p.add("x", "")
        p.due(T0 + seq)
        assert p.on_response(503, {}, T0 + seq) is A.RETRY
        assert p.on_response(503, {}, T0 + seq) is A.RETRY
        assert p.on_response(200, ok(seq), T0 + seq) is A.CONTINUE
    assert p.posted_content == "xxx"


def test_a_lost_answer_is_retried_with_the_identical_body() -> None:
    p = poster()
    p.add("Bl\u00fce", "th\u00efnk")
    body = p.due(T0)
    p.add("later", "")  # must not leak into the retry
    assert p.on_lost(T0 + 10) is A.RETRY
    assert p.retry_body() == body
    assert p.on_lost(T0 + 20) is A.RETRY
    assert p.retry_body() == body
    assert p.on_response(200, ok(1), T0 + 21) is A.CONTINUE
    assert p.posted_content == "Bl\u00fce"
    assert p.due(T0 + 22) == {"id": "job-1", "seq": 2, "delta": {"content": "later"}}


def test_the_third_lost_answer_in_a_row_stops_posting() -> None:
    p = poster()
    p.add("a", "")
    p.due(T0)
    assert p.on_lost(T0 + 1) is A.RETRY
    assert p.on_lost(T0 + 2) is A.RETRY
    assert p.on_lost(T0 + 3) is A.STOP_POSTING
    assert not p.posting


def test_retry_body_is_a_copy() -> None:
    p = poster()
    p.add("a", "")
    p.due(T0)
    p.on_lost(T0)
    b = p.retry_body()
    b["delta"]["content"] = "changed"
    assert p.retry_body()["delta"]["content"] == "a"


# --- 409 out of sequence ----------------------------------------------------------------------


def accept_posts(p: ProgressPoster, texts: list[str], t: float = T0) -> None:
    for text in texts:
        p.add(text, "")
        body = p.due(t)
        assert body is not None
        assert p.on_response(200, ok(body["seq"]), t) is A.CONTINUE
        t += 1


def test_409_expecting_the_next_seq_means_the_post_was_already_accepted() -> None:
    p = poster(interval_s=0)
    accept_posts(p, ["a", "b"])
    p.add("c", "")
    assert p.due(T0 + 5)["seq"] == 3  # type: ignore[index]
    action = p.on_response(409, refusal("ChatProgressOutOfSequence", expected_seq=4), T0 + 5)
    assert action is A.CONTINUE
    assert p.posted_content == "abc"
    p.add("d", "")
    assert p.due(T0 + 6) == {"id": "job-1", "seq": 4, "delta": {"content": "d"}}


def test_409_expecting_a_later_seq_continues_from_it() -> None:
    p = poster(interval_s=0)
    p.add("a", "")
    p.due(T0)
    assert p.on_response(409, refusal("ChatProgressOutOfSequence", expected_seq=7), T0) is A.CONTINUE
    p.add("b", "")
    assert p.due(T0 + 1)["seq"] == 7  # type: ignore[index]


def test_409_expecting_an_earlier_seq_resends_the_missing_text_without_touching_accepted_posts() -> None:
    p = poster(interval_s=0)
    accept_posts(p, ["one ", "two ", "three "])  # seqs 1..3 believed accepted
    p.add("four", "")
    assert p.due(T0 + 10)["seq"] == 4  # type: ignore[index]
    # The horde holds only seq 1: "two " and "three " never reached it.
    action = p.on_response(409, refusal("ChatProgressOutOfSequence", expected_seq=2), T0 + 10)
    assert action is A.RETRY
    assert p.retry_body() == {"id": "job-1", "seq": 2, "delta": {"content": "two three four"}}
    assert p.posted_content == "one "
    assert p.on_response(200, ok(2), T0 + 11) is A.CONTINUE
    assert p.posted_content == "one two three four"
    p.add("five", "")
    assert p.due(T0 + 12) == {"id": "job-1", "seq": 3, "delta": {"content": "five"}}


def test_409_rewind_keeps_reasoning_and_content_apart() -> None:
    p = poster(interval_s=0)
    p.add("", "r1")
    p.due(T0)
    p.on_response(200, ok(1), T0)
    p.add("c2", "r2")
    p.due(T0)
    p.on_response(200, ok(2), T0)
    p.add("c3", "")
    p.due(T0)
    assert p.on_response(409, refusal("ChatProgressOutOfSequence", expected_seq=1), T0) is A.RETRY
    assert p.retry_body() == {"id": "job-1", "seq": 1, "delta": {"content": "c2c3", "reasoning_content": "r1r2"}}
    assert (p.posted_content, p.posted_reasoning, p.bytes_accepted) == ("", "", 0)


@pytest.mark.parametrize("body", [
    refusal("ChatProgressOutOfSequence"),
    refusal("ChatProgressOutOfSequence", expected_seq="2"),
    refusal("ChatProgressOutOfSequence", expected_seq=0),
    refusal("ChatProgressOutOfSequence", expected_seq=True),
])
def test_409_without_a_usable_expected_seq_stops_posting(body: dict[str, Any]) -> None:
    p = poster()
    p.add("a", "")
    p.due(T0)
    assert p.on_response(409, body, T0) is A.STOP_POSTING


def test_409_expecting_our_own_seq_stops_posting() -> None:
    p = poster()
    p.add("a", "")
    p.due(T0)
    assert p.on_response(409, refusal("ChatProgressOutOfSequence", expected_seq=1), T0) is A.STOP_POSTING


def test_repeated_409s_stop_posting() -> None:
    p = poster(interval_s=0)
    accept_posts(p, ["a", "b", "c", "d"])
    p.add("e", "")
    assert p.due(T0 + 10) is not None
    assert p.on_response(409, refusal("ChatProgressOutOfSequence", expected_seq=4), T0) is A.RETRY
    assert p.on_response(409, refusal("ChatProgressOutOfSequence", expected_seq=3), T0) is A.RETRY
    assert p.on_response(409, refusal("ChatProgressOutOfSequence", expected_seq=2), T0) is A.STOP_POSTING


# --- the cap ----------------------------------------------------------------------------------


def test_the_byte_cap_trims_the_last_post_on_a_character_boundary() -> None:
    p = poster(max_length=1, interval_s=0)  # 16 bytes
    p.add("0123456789", "")
    p.due(T0)
    assert p.on_response(200, ok(1), T0) is A.CONTINUE
    p.add("ab\u20accd", "")  # "ab" 2 bytes + euro 3 bytes: 10 + 2 + 3 = 15, "c" makes 16
    assert p.due(T0 + 1) == {"id": "job-1", "seq": 2, "delta": {"content": "ab\u20acc"}}
    assert p.on_response(200, ok(2), T0 + 1) is A.STOP_POSTING
    assert p.bytes_accepted == 16
    assert not p.posting
    p.add("more", "")
    assert p.pending_final() is None


def test_the_byte_cap_never_splits_a_character() -> None:
    p = poster(max_length=1, interval_s=0)
    p.add("x" * 14 + "\u20ac\u20ac", "")  # 14 + 3 > 16: the euro does not fit
    assert p.due(T0) == {"id": "job-1", "seq": 1, "delta": {"content": "x" * 14}}


def test_the_byte_cap_counts_reasoning_and_content_together_reasoning_first() -> None:
    p = poster(max_length=1, interval_s=0)
    p.add("content", "reasoning-text")  # 7 + 14 bytes > 16
    assert p.due(T0) == {"id": "job-1", "seq": 1, "delta": {"content": "co", "reasoning_content": "reasoning-text"}}


def test_a_post_that_exactly_fills_the_cap_is_the_last() -> None:
    p = poster(max_length=1, interval_s=0)
    p.add("x" * 16, "")
    p.due(T0)
    assert p.on_response(200, ok(1), T0) is A.STOP_POSTING


def test_when_nothing_fits_no_post_is_sent() -> None:
    p = poster(max_length=1, interval_s=0)
    p.add("x" * 15, "")
    p.due(T0)
    p.on_response(200, ok(1), T0)
    p.add("\u20ac", "")  # 3 bytes, 1 left
    assert p.due(T0 + 1) is None
    assert not p.posting


def test_the_post_cap_allows_exactly_max_posts_posts() -> None:
    p = poster(max_posts=1000, interval_s=0)
    for seq in range(1, 1001):
        p.add("x", "")
        body = p.due(T0 + seq)
        assert body is not None and body["seq"] == seq
        action = p.on_response(200, ok(seq), T0 + seq)
        assert action is (A.CONTINUE if seq < 1000 else A.STOP_POSTING)
    p.add("x", "")
    assert p.due(T0 + 2000) is None
    assert p.posts_accepted == 1000


def test_a_cancel_on_the_last_capped_post_still_stops_generation() -> None:
    p = poster(max_length=1, interval_s=0)
    p.add("x" * 20, "")
    p.due(T0)
    assert p.on_response(200, ok(1, cancelled=True), T0) is A.STOP_GENERATING


# --- the lease ----------------------------------------------------------------------------------


def test_the_lease_starts_at_the_ttl_and_is_extended_by_an_accepted_post() -> None:
    p = poster(base_lease_s=150, lease_cap_s=200)
    assert p.lease.deadline == T0 + 150
    p.add("a", "")
    p.due(T0 + 30)
    p.on_response(200, ok(1), T0 + 30.5)
    assert p.lease.deadline == T0 + 180  # 150 s after the post was sent


def test_an_accepted_post_extends_the_jobs_own_lease_not_a_copy() -> None:
    """One lease per job: the poster extends the lease it is given, the one the
    job's owner holds and every other reader sees."""
    lease = Lease(T0, T0 + 150)
    p = ProgressPoster("job-1", max_length=100, lease=lease, lease_cap_s=200)
    p.add("a", "")
    p.due(T0 + 30)
    p.on_response(200, ok(1), T0 + 30.5)
    assert lease.deadline == T0 + 180 and p.lease.deadline == T0 + 180
    lease.extend_to(T0 + 170)  # never earlier
    assert lease.deadline == T0 + 180


def test_the_lease_never_passes_the_cap_from_pop() -> None:
    p = poster(base_lease_s=150, lease_cap_s=200, interval_s=0)
    p.add("a", "")
    p.due(T0 + 100)
    p.on_response(200, ok(1), T0 + 100)
    assert p.lease.deadline == T0 + 200
    trusted = poster(base_lease_s=150, lease_cap_s=600, interval_s=0)
    trusted.add("a", "")
    trusted.due(T0 + 100)
    trusted.on_response(200, ok(1), T0 + 100)
    assert trusted.lease.deadline == T0 + 250


def test_a_retried_post_does_not_extend_the_lease() -> None:
    p = poster(base_lease_s=150, lease_cap_s=600)
    p.add("a", "")
    p.due(T0 + 40)
    p.on_lost(T0 + 50)
    p.on_response(200, ok(1), T0 + 51)
    assert p.lease.deadline == T0 + 150
    p.add("b", "")
    p.due(T0 + 60)
    p.on_response(503, {}, T0 + 60)
    p.on_response(200, ok(2), T0 + 61)
    assert p.lease.deadline == T0 + 150


def test_the_lease_never_moves_backwards() -> None:
    p = poster(base_lease_s=150, lease_cap_s=600, interval_s=0)
    p.add("a", "")
    p.due(T0 + 50)
    p.on_response(200, ok(1), T0 + 50)
    assert p.lease.deadline == T0 + 200
    p.add("b", "")
    assert p.pending_final(T0 + 20) is not None  # a clock that went backwards
    p.on_response(200, ok(2), T0 + 20)
    assert p.lease.deadline == T0 + 200


def test_pending_final_without_a_time_extends_from_the_answer_time() -> None:
    p = poster(base_lease_s=150, lease_cap_s=600)
    p.add("a", "")
    p.pending_final()
    p.on_response(200, ok(1), T0 + 70)
    assert p.lease.deadline == T0 + 220


def test_a_rejected_post_does_not_extend_the_lease() -> None:
    p = poster(base_lease_s=150, lease_cap_s=600)
    p.add("a", "")
    p.due(T0 + 40)
    p.on_response(413, refusal("ChatProgressCapReached"), T0 + 40)
    assert p.lease.deadline == T0 + 150


# --- property: the accepted text is the added text, whatever the answers ----------------------


@dataclass
class FakeHorde:
    """The horde's side of progress posts, written from the seed, independently of the poster."""

    max_length: int
    entries: list[tuple[int, str, str]] = field(default_factory=list)
    cancel_at_post: int | None = None

    def handle(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        seq = body["seq"]
        content = body["delta"]["content"]
        reasoning = body["delta"].get("reasoning_content", "")
        assert isinstance(content, str)
        assert content or reasoning, "a post carries text"
        expected = len(self.entries) + 1
        if seq < expected:
            # A retry: accepted again without a new entry only when unchanged.
            if self.entries[seq - 1] == (seq, content, reasoning):
                return 200, {"accepted_seq": seq, "cancelled": self.cancelled}
            return 409, {"rc": "ChatProgressOutOfSequence", "expected_seq": expected}
        if seq > expected:
            return 409, {"rc": "ChatProgressOutOfSequence", "expected_seq": expected}
        if expected > 1000:
            return 413, {"rc": "ChatProgressCapReached"}
        if self.bytes + len(content.encode()) + len(reasoning.encode()) > 16 * self.max_length:
            return 413, {"rc": "ChatProgressCapReached"}
        self.entries.append((seq, content, reasoning))
        return 200, {"accepted_seq": seq, "cancelled": self.cancelled}

    def forget_last(self) -> None:
        """Lose the newest entry (a store that failed over), so the next post is out of sequence."""
        if self.entries:
            self.entries.pop()

    @property
    def cancelled(self) -> bool:
        return self.cancel_at_post is not None and len(self.entries) >= self.cancel_at_post

    @property
    def bytes(self) -> int:
        return sum(len(c.encode()) + len(r.encode()) for _, c, r in self.entries)

    @property
    def content(self) -> str:
        return "".join(c for _, c, _ in self.entries)

    @property
    def reasoning(self) -> str:
        return "".join(r for _, _, r in self.entries)


_text = st.text(alphabet=st.sampled_from(["a", "b", " ", "\u00e9", "\u20ac", "\U0001f600"]), max_size=6)
_step = st.one_of(
    st.tuples(st.just("add"), _text, _text),
    st.tuples(st.just("tick"), st.floats(0.0, 2.0), st.just("")),
)
_fate = st.sampled_from(["ok", "ok", "ok", "lost_before", "lost_after", "unavailable", "forget"])


@settings(max_examples=400, deadline=None)
@given(
    steps=st.lists(_step, max_size=40),
    fates=st.lists(_fate, min_size=1, max_size=30),
    max_length=st.sampled_from([1, 2, 4, 1000]),
    max_posts=st.sampled_from([3, 1000]),
    cancel_at_post=st.one_of(st.none(), st.integers(1, 5)),
)
def test_accepted_text_is_the_added_text_under_any_interleaving_of_answers(
    steps: list[tuple[str, Any, str]],
    fates: list[str],
    max_length: int,
    max_posts: int,
    cancel_at_post: int | None,
) -> None:
    horde = FakeHorde(max_length=max_length, cancel_at_post=cancel_at_post)
    p = poster(max_length=max_length, max_posts=max_posts, interval_s=1.0)
    fate_iter = iter(fates * 200)
    added_c: list[str] = []
    added_r: list[str] = []
    now = T0
    forgot = False

    def send(body: dict[str, Any]) -> None:
        nonlocal forgot
        while True:
            fate = next(fate_iter)
            if fate == "lost_before":
                action = p.on_lost(now)
            elif fate == "lost_after":
                horde.handle(body)
                action = p.on_lost(now)
            elif fate == "unavailable":
                action = p.on_response(503, {"rc": "ChatProgressUnavailable"}, now)
            else:
                if fate == "forget" and horde.entries:
                    horde.forget_last()
                    forgot = True
                status, answer = horde.handle(body)
                assert status in (200, 409), (status, answer)  # never over the cap
                action = p.on_response(status, answer, now)
            if action is A.RETRY:
                resent = p.retry_body()
                if fate != "forget":
                    assert resent == body  # retried with the identical body
                body = resent
                continue
            return

    for kind, a, b in steps:
        if kind == "add":
            if p.stopped_generating is None:
                p.add(a, b)
                added_c.append(a)
                added_r.append(b)
        else:
            now += a
        body = p.due(now)
        if body is not None:
            send(body)
    while (body := p.pending_final(now)) is not None:
        send(body)

    total_c, total_r = "".join(added_c), "".join(added_r)
    # The poster kept within the cap itself and used consecutive seqs.
    assert horde.bytes <= 16 * max_length
    assert len(horde.entries) <= max_posts
    assert [e[0] for e in horde.entries] == list(range(1, len(horde.entries) + 1))
    # What the horde holds is a prefix of what was produced, content and reasoning each:
    # nothing rewritten, nothing twice, nothing out of order.
    assert total_c.startswith(horde.content)
    assert total_r.startswith(horde.reasoning)
    # The poster's accepted text is what the horde holds, except a post whose answer
    # was lost when posting stopped.
    assert horde.content.startswith(p.posted_content)
    assert horde.reasoning.startswith(p.posted_reasoning)
    if p.posting:
        # Never stopped: everything produced reached the horde exactly once.
        assert (horde.content, horde.reasoning) == (total_c, total_r)
        assert (p.posted_content, p.posted_reasoning) == (total_c, total_r)
    elif p.stopped_generating is None and "cap" in (p.stop_reason or "") and not forgot:
        # Stopped by the cap: the horde holds all it could, short of one character.
        assert len(horde.entries) == max_posts or horde.bytes > 16 * max_length - 4
