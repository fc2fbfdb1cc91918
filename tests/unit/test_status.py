"""What the worker says about itself: pause lines, the Horde's messages, refusals, totals."""

from __future__ import annotations

import re
import time

import pytest

from koboldcpp_horde_chat.state.skipped import SKIPPED_EVERY_S, SkippedReporter, describe_skipped
from koboldcpp_horde_chat.state.status import (
    PAUSE_REPORT_AFTER_S,
    PauseTracker,
    WorkerStats,
    abort_limit_line,
    aborted_count,
    describe_pop_refusal,
    earnings_line,
    moderator_lines,
    summary_line,
)


def tracker() -> PauseTracker:
    return PauseTracker(local_idle_s=20.0, kcpp_url="http://127.0.0.1:5001")


def test_a_short_flicker_of_a_busy_koboldcpp_is_not_said() -> None:
    t = tracker()
    assert t.pausing("busy", 100.0) is None
    assert t.pausing("busy", 100.0 + PAUSE_REPORT_AFTER_S - 0.1) is None
    assert t.popping(101.0) is None


def test_a_lasting_pause_is_said_once_and_popping_again_once() -> None:
    t = tracker()
    lines = [t.pausing("local_user", 100.0 + i) for i in range(10)]
    said = [line for line in lines if line]
    assert said == [
        "koboldcpp had a local request (or just started): not popping until 20 s after it, "
        "as koboldcpp's own worker does"
    ]
    assert t.popping(111.0) == "no local request for 20 s: popping again"
    assert t.popping(112.0) is None


def test_koboldcpp_down_is_said_at_once_with_its_url() -> None:
    t = tracker()
    assert t.pausing("backend_down", 5.0) == (
        "koboldcpp at http://127.0.0.1:5001 does not answer: not popping until it does"
    )
    assert t.pausing("backend_down", 6.0) is None
    assert t.popping(9.0) == "koboldcpp at http://127.0.0.1:5001 answers again: popping"


def test_a_change_of_reason_while_paused_is_said_and_the_last_one_resumes() -> None:
    t = tracker()
    assert t.pausing("backend_down", 0.0)
    assert t.pausing("busy", 1.0) is None
    assert t.pausing("busy", 1.0 + PAUSE_REPORT_AFTER_S) == (
        "koboldcpp is busy with another client's request: not popping until it is free"
    )
    assert t.popping(10.0) == "koboldcpp is free: popping again"


def test_a_refusal_line_is_said_again_only_when_it_changes() -> None:
    t = tracker()
    assert t.pausing("refused", 0.0, line="A") == "A"
    assert t.pausing("refused", 60.0, line="A") is None
    assert t.pausing("refused", 120.0, line="B") == "B"
    assert t.popping(180.0) == "the Horde takes pops again: popping"


def test_each_moderator_message_is_said_once_by_id() -> None:
    seen: set[str] = set()
    messages = [
        {
            "id": "m1",
            "message": "Your model name\nlooks wrong.",
            "origin": "AI Horde Moderators",
            "expiry": "Thu, 24 Dec 2026 12:00:00 -0000",
        }
    ]
    assert moderator_lines(messages, seen) == [
        "message from the Horde (origin AI Horde Moderators, expires Thu, 24 Dec 2026 "
        "12:00:00 -0000): Your model name looks wrong."
    ]
    assert moderator_lines(messages, seen) == []
    assert moderator_lines([{"id": "m2", "message": "Second."}], seen) == [
        "message from the Horde: Second."
    ]


@pytest.mark.parametrize(
    "messages", [None, "text", [None, 3, {"id": "x"}, {"message": "   "}], {"message": "a"}]
)
def test_malformed_moderator_messages_are_ignored(messages: object) -> None:
    assert moderator_lines(messages, set()) == []


def test_a_long_moderator_message_is_shortened_to_one_line() -> None:
    (line,) = moderator_lines([{"message": "x" * 5000}], set())
    assert len(line) < 600 and line.endswith("…")


def test_skipped_counts_are_described_in_order() -> None:
    assert describe_skipped({"untrusted": 2, "matching_softprompt": 1, "kudos": 0}) == (
        "3 requests skipped: matching_softprompt=1, untrusted=2"
    )
    assert describe_skipped({}) is None
    assert describe_skipped({"models": True, "x": "2"}) is None
    assert describe_skipped(None) is None


def test_skipped_lines_come_at_most_once_a_minute() -> None:
    reporter = SkippedReporter()
    assert reporter.line({"untrusted": 1}, 0.0) == "1 request skipped: untrusted=1"
    assert reporter.line({"untrusted": 1}, SKIPPED_EVERY_S - 1) is None
    assert reporter.line({}, SKIPPED_EVERY_S + 1) is None
    assert reporter.line({"untrusted": 4}, SKIPPED_EVERY_S + 1) == (
        "4 requests skipped: untrusted=4"
    )


def test_a_skip_reason_that_repeats_is_said_once_until_it_changes() -> None:
    """The same request waiting under max_length for an hour: one line, not one a minute."""
    reporter = SkippedReporter()
    said = [reporter.line({"max_length": 1}, 2.0 * i) for i in range(1800)]
    assert [s for s in said if s] == ["1 request skipped: max_length=1"]
    # more requests under the same reason are no change
    assert reporter.line({"max_length": 3}, 3700.0) is None
    # another reason is: said (at most once a minute)
    assert reporter.line({"max_length": 1, "models": 2}, 3702.0) == (
        "3 requests skipped: max_length=1, models=2"
    )
    assert reporter.line({"max_length": 1}, 3704.0) is None  # within the minute
    assert reporter.line({"max_length": 1}, 3702.0 + SKIPPED_EVERY_S) == (
        "1 request skipped: max_length=1"
    )
    # nothing skipped, then the same reason again: said again
    assert reporter.line({}, 3800.0) is None
    assert reporter.line({"max_length": 1}, 3900.0) == "1 request skipped: max_length=1"


def test_the_summary_line_gives_jobs_kudos_faults_and_uptime() -> None:
    assert summary_line(WorkerStats(jobs=3, kudos=40.4, faults=1, dropped=0), 125) == (
        "3 jobs, 40 kudos, 1 faults, 0 dropped, uptime 0:02:05"
    )
    assert summary_line(WorkerStats(jobs=12, kudos=340, faults=0, dropped=2), 3600) == (
        "12 jobs, 340 kudos (340 kudos/h), 0 faults, 2 dropped, uptime 1:00:00"
    )


def test_too_many_workers_is_named_and_says_to_keep_the_name() -> None:
    advice = describe_pop_refusal(
        403,
        "TooManyWorkers",
        "To avoid abuse, untrusted users can only have up to 3 distinct workers.",
    )
    assert advice.action == "owner"
    assert advice.line.startswith(
        "the Horde refused the pop (403 TooManyWorkers: To avoid abuse, untrusted users "
        "can only have up to 3 distinct workers.): the account's worker limit"
    )
    assert "keep --hordeworkername the same across runs" in advice.line
    assert "maintenance" not in advice.line


@pytest.mark.parametrize(
    ("status", "rc", "action"),
    [
        (401, "InvalidAPIKey", "stop_key"),
        (401, "", "stop_key"),
        (403, "WrongCredentials", "stop_key"),
        (400, "ChatDeclarationInvalid", "stop_config"),
        (403, "WorkerMaintenance", "owner"),
        (403, "TooManyWorkersTrusted", "owner"),
        (403, "TimeoutIP", "retry"),
        (403, "SomethingNew", "retry"),
        (400, "", "retry"),
    ],
)
def test_each_refusal_has_its_action(status: int, rc: str, action: str) -> None:
    advice = describe_pop_refusal(status, rc, "why")
    assert advice.action == action
    assert advice.line.startswith(f"the Horde refused the pop ({status}{' ' + rc if rc else ''}: why)")


def test_wrong_credentials_names_the_worker_name_not_the_key() -> None:
    advice = describe_pop_refusal(403, "WrongCredentials", "Wrong credentials to submit as this worker.")
    assert "choose another --hordeworkername" in advice.line


#: koboldcpp 1.116.1's after-job totals, exactly as its format string prints them
#: (``koboldcpp.py`` L10078: ``[Total:{kudos:.0f} kudos, Time:{hrs:03d}h:{mins:02d}m:
#: {secs:02d}s, Jobs:{jobs}, EarnRate:{rate:.2f} kudos/hr, JobRate:{rate:.2f} jobs/hr,
#: JobCost:{cost:.2f} kudos/job]``).
KCPP_TOTALS = re.compile(
    r"\[Total:(?P<total>-?\d+) kudos, Time:(?P<h>\d{3,})h:(?P<m>\d{2})m:(?P<s>\d{2})s, "
    r"Jobs:(?P<jobs>\d+), EarnRate:(?P<earn>-?\d+\.\d{2}) kudos/hr, "
    r"JobRate:(?P<jobrate>\d+\.\d{2}) jobs/hr, JobCost:(?P<cost>-?\d+\.\d{2}) kudos/job\]"
)


def test_the_earnings_line_is_koboldcpps_own_bracketed_line_then_the_faults() -> None:
    line = earnings_line(WorkerStats(kudos=5570, jobs=85, faults=2), 900)
    assert line == (
        "[Total:5570 kudos, Time:000h:15m:00s, Jobs:85, EarnRate:22280.00 kudos/hr, "
        "JobRate:340.00 jobs/hr, JobCost:65.53 kudos/job] Faults:2"
    )
    match = KCPP_TOTALS.search(line)
    assert match is not None
    assert match.group("earn") == "22280.00"
    assert line[match.end():] == " Faults:2"


def test_the_earnings_line_keeps_koboldcpps_shape_at_the_edges() -> None:
    """No job yet (the stop line): JobCost 0.00, no division by zero; over a day:
    hours keep counting in koboldcpp's three-digit field."""
    for stats, elapsed_s in (
        (WorkerStats(kudos=0, jobs=0, faults=0), 0),
        (WorkerStats(kudos=6, jobs=1, faults=1), 36),
        (WorkerStats(kudos=10, jobs=1, faults=0), 90061),
        (WorkerStats(kudos=8.7, jobs=1, faults=0), 3_600_000),
    ):
        line = earnings_line(stats, elapsed_s)
        assert KCPP_TOTALS.fullmatch(line.split(" Faults:")[0]), (stats, elapsed_s)
    assert earnings_line(WorkerStats(kudos=0, jobs=0, faults=0), 0) == (
        "[Total:0 kudos, Time:000h:00m:00s, Jobs:0, EarnRate:0.00 kudos/hr, "
        "JobRate:0.00 jobs/hr, JobCost:0.00 kudos/job] Faults:0"
    )
    assert "Time:025h:01m:01s" in earnings_line(WorkerStats(kudos=10, jobs=1, faults=0), 90061)
    assert "Time:1000h:00m:00s" in earnings_line(WorkerStats(kudos=1, jobs=1, faults=0), 3_600_000)


# --- the guard against the Horde's maintenance -----------------------------------------


def test_the_aborted_count_names_the_hordes_hour_and_its_threshold() -> None:
    assert aborted_count(3, 20) == "aborted 3 in the Horde's hour (maintenance above 20)"


def test_the_stop_line_says_why_and_when_popping_resumes() -> None:
    resume = time.mktime((2030, 1, 2, 14, 5, 12, 0, 0, -1))
    assert abort_limit_line(count=19, in_hand=0, limit=20, resume_wall=resume, wait_s=3480.0) == (
        "aborted 19 in the Horde's hour (maintenance above 20): not popping, to stay out "
        "of maintenance; popping again at 14:05:12 (in 58 min) unless more are counted"
    )
    line = abort_limit_line(count=17, in_hand=2, limit=20, resume_wall=resume, wait_s=10.0)
    assert line.startswith("aborted 17 in the Horde's hour (maintenance above 20), 2 jobs in hand:")
    assert line.endswith("(in 1 min) unless more are counted")  # never "in 0 min"
    line = abort_limit_line(count=18, in_hand=1, limit=20, resume_wall=resume, wait_s=60.0)
    assert ", 1 job in hand:" in line


def test_a_guard_pause_is_said_once_for_the_same_line_and_popping_again_after() -> None:
    t = PauseTracker(failed_in_a_row=3)
    line = "aborted 19 in the Horde's hour (maintenance above 20): not popping, ..."
    assert t.pausing("abort_limit", 0.0, line=line) == line  # at once
    assert t.pausing("abort_limit", 60.0, line=line) is None
    assert t.popping(120.0) == "the Horde's hour allows another aborted job: popping again"
    assert t.pausing("backend_failing", 130.0) == (
        "koboldcpp failed 3 generations in a row: not popping; probing it with a "
        "generation the size of the failed job until one succeeds"
    )
    assert t.popping(140.0) == "koboldcpp generates again: popping"
