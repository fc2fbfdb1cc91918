"""guard.py: sliding-hour counters for maintenance avoidance and guarantee withdrawal."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from koboldcpp_horde_chat.state import guard
from koboldcpp_horde_chat.state.guard import (
    COUNT_WINDOW_S,
    FEATURE_COOL_OFF_MAX_S,
    HORDE_FAULT_LIMIT_PER_HOUR,
    HOUR_S,
    REFUSALS_TO_WITHDRAW,
    STOP_POPPING_AT,
    FailureStreak,
    MaintenanceGuard,
    RefusalGuard,
    refusal_features,
    refused_reply_features,
)

KOBOLDCPP_FEATURES = [
    "seed",
    "presence_penalty",
    "tools",
    "json_object",
    "json_schema",
    "reasoning_effort",
    "prompt_overflow_refused",
]


def test_guard_is_pure() -> None:
    source = (Path(guard.__file__)).read_text()
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "collections", "typing"}, imported


# --- MaintenanceGuard ----------------------------------------------------------------


def test_chat_is_withdrawn_at_the_fifteenth_fault_of_the_hour() -> None:
    g = MaintenanceGuard()
    for i in range(14):
        g.record_fault(float(i))
    assert g.update(14.0) is None and g.chat_enabled
    g.record_fault(14.0)
    assert g.update(15.0) == "withdraw"
    assert not g.chat_enabled
    assert g.update(16.0) is None  # said once


def test_chat_is_declared_again_once_fewer_than_ten_faults_remain_in_the_hour() -> None:
    g = MaintenanceGuard()
    for i in range(15):
        g.record_fault(float(i * 10))  # faults at 0, 10, ..., 140 s
    assert g.update(150.0) == "withdraw"
    # The window is the Horde's hour and a minute: at 3660 + 50 s the faults at
    # 0..50 (6 of them) left it, 9 remain.
    assert g.update(3660.0 + 40.0) is None  # 10 remain (50..140)
    assert g.update(3660.0 + 50.0) == "restore"
    assert g.chat_enabled
    assert g.recent(3710.0) == 9


def test_the_maintenance_guard_stays_bounded_over_a_long_run() -> None:
    g = MaintenanceGuard()
    for i in range(100_000):
        g.record_fault(float(i))
    assert g.recent(100_000.0) <= 80
    assert g.update(100_000.0) == "withdraw"


def test_the_thresholds_are_the_hordes_twenty_less_a_margin() -> None:
    assert HORDE_FAULT_LIMIT_PER_HOUR == 20
    assert (guard.WITHDRAW_CHAT_AT, guard.RESTORE_CHAT_BELOW, STOP_POPPING_AT) == (15, 10, 19)
    assert COUNT_WINDOW_S == 3660.0  # the Horde's hour and a minute


def test_text_jobs_failing_alone_do_not_withdraw_chat() -> None:
    g = MaintenanceGuard()
    for i in range(18):
        g.record_fault(float(i), "text")
    assert g.update(20.0) is None and g.chat_enabled  # chat did not fail: keep it
    g.record_fault(21.0, "chat")
    assert g.update(22.0) == "withdraw"


@pytest.mark.parametrize("kind", ["chat", None])
def test_a_chat_fault_or_one_of_unknown_kind_among_fifteen_withdraws_chat(
    kind: str | None,
) -> None:
    g = MaintenanceGuard()
    for i in range(14):
        g.record_fault(float(i), "text")
    g.record_fault(14.0, kind)  # None: kept from an earlier run, may have been chat
    assert g.update(15.0) == "withdraw"


def test_an_aborted_job_is_counted_for_the_horde_hour_and_a_minute() -> None:
    g = MaintenanceGuard()
    g.record_fault(100.0)
    assert g.recent(100.0 + 3659.9) == 1
    assert g.recent(100.0 + 3660.0) == 0


def test_popping_stops_at_nineteen_aborted_jobs_in_the_window() -> None:
    g = MaintenanceGuard()
    for i in range(18):
        g.record_fault(float(i))
    assert g.pop_allowed(18.0)
    g.record_fault(18.0)
    assert not g.pop_allowed(18.0)
    assert not g.pop_allowed(3659.9)
    assert g.pop_allowed(3660.0)  # the fault at 0 left the window: 18 remain


def test_jobs_in_hand_count_toward_the_stop_as_each_may_still_abort() -> None:
    g = MaintenanceGuard()
    for i in range(16):
        g.record_fault(float(i))
    assert g.pop_allowed(20.0, in_hand=2)  # 18
    assert not g.pop_allowed(20.0, in_hand=3)  # 19
    assert g.pop_allowed(20.0, in_hand=0)


def test_popping_resumes_when_the_oldest_aborted_jobs_leave_the_window() -> None:
    g = MaintenanceGuard()
    for i in range(19):
        g.record_fault(float(i * 10))  # at 0, 10, ..., 180
    assert g.resume_at(200.0) == 3660.0  # the first leaves: 18 remain
    assert g.resume_at(200.0, in_hand=2) == 20.0 + 3660.0  # three must leave
    assert not g.pop_allowed(3659.0) and g.pop_allowed(3660.0)
    assert not g.pop_allowed(3679.0, in_hand=2) and g.pop_allowed(3680.0, in_hand=2)
    # Already allowed: now.
    assert g.resume_at(3700.0) == 3700.0


def test_with_only_jobs_in_hand_in_the_way_popping_resumes_within_the_window() -> None:
    g = MaintenanceGuard()
    g.record_fault(0.0)
    assert g.resume_at(10.0, in_hand=19) == 10.0 + COUNT_WINDOW_S
    assert MaintenanceGuard().resume_at(5.0, in_hand=19) == 5.0 + COUNT_WINDOW_S


def _horde_counts(times: list[float]) -> int:
    """The most aborted jobs the real Horde's ``log_aborted_job`` counts at once:
    its window starts at an aborted job more than an hour after the last start."""
    count, since, most = 0, -1e18, 0
    for t in times:
        if t - since > 3600.0:
            count, since = 0, t
        count += 1
        most = max(most, count)
    return most


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=400.0),
            st.integers(min_value=0, max_value=4),  # pops tried
            st.integers(min_value=0, max_value=4),  # jobs in hand that abort
            st.integers(min_value=0, max_value=2),  # jobs in hand that complete
        ),
        min_size=5,
        max_size=100,
    )
)
def test_a_worker_that_pops_only_when_allowed_never_reaches_the_hordes_limit(
    steps: list[tuple[float, int, int, int]],
) -> None:
    """Whatever the timing, however many jobs are in hand and however many of them
    abort, the Horde's own window never counts more than 19 (maintenance is above 20)."""
    g = MaintenanceGuard()
    now, in_hand, aborted = 0.0, 0, []
    for gap, pops, aborts, completes in steps:
        now += gap
        for _ in range(pops):
            if g.pop_allowed(now, in_hand):
                in_hand += 1
        for _ in range(min(aborts, in_hand)):
            in_hand -= 1
            g.record_fault(now)
            aborted.append(now)
        in_hand -= min(completes, in_hand)
        assert _horde_counts(aborted) <= STOP_POPPING_AT < HORDE_FAULT_LIMIT_PER_HOUR


# --- FailureStreak ---------------------------------------------------------------------


def test_three_failed_generations_in_a_row_stop_the_popping() -> None:
    streak = FailureStreak()
    assert [streak.failed(), streak.failed()] == [False, False]
    assert not streak.failing
    assert streak.failed() is True  # the third: said once
    assert streak.failing
    assert streak.failed() is False and streak.failing


def test_a_success_ends_the_streak_and_says_so_only_when_it_was_failing() -> None:
    streak = FailureStreak()
    streak.failed()
    streak.failed()
    assert streak.succeeded() is False  # was not failing
    streak.failed()
    streak.failed()
    assert not streak.failing  # failures with a success between are not in a row
    streak.failed()
    assert streak.succeeded() is True
    assert not streak.failing and streak.count == 0


def test_a_streak_refuses_a_limit_below_one() -> None:
    with pytest.raises(ValueError):
        FailureStreak(0)
    assert FailureStreak(1).failed() is True


# --- refusal attribution -------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "declared", "expected"),
    [
        ({"tools": [{}], "tool_choice": "required"}, KOBOLDCPP_FEATURES, ["tools"]),
        ({"tool_choice": "none"}, KOBOLDCPP_FEATURES, ["tools"]),
        (
            {"tools": [{}], "tool_choice": "required"},
            [*KOBOLDCPP_FEATURES, "tool_choice_enforced"],
            ["tool_choice_enforced"],
        ),
        ({"response_format": {"type": "json_object"}}, KOBOLDCPP_FEATURES, ["json_object"]),
        ({"response_format": {"type": "json_schema"}}, KOBOLDCPP_FEATURES, ["json_schema"]),
        (
            {"response_format": {"type": "json_schema"}},
            [*KOBOLDCPP_FEATURES, "structured_output_enforced"],
            ["structured_output_enforced"],
        ),
        (
            {"tools": [{}], "response_format": {"type": "json_object"}},
            KOBOLDCPP_FEATURES,
            ["tools", "json_object"],
        ),
        ({"response_format": {"type": "text"}}, KOBOLDCPP_FEATURES, []),
        ({"response_format": "json_object"}, KOBOLDCPP_FEATURES, []),
        ({"messages": []}, KOBOLDCPP_FEATURES, []),
        ({"response_format": {"type": "json_schema"}}, ["seed"], []),  # not declared: nothing
    ],
)
def test_a_refusal_is_attributed_to_what_the_request_used(
    payload: dict[str, object], declared: list[str], expected: list[str]
) -> None:
    assert refusal_features(payload, declared) == expected


# --- RefusalGuard --------------------------------------------------------------------


def test_refusals_count_only_the_last_hour() -> None:
    g = RefusalGuard()
    for t in (0.0, 3599.0):
        g.record(["tools"], t)
    assert g.count("tools", 3599.0) == 2
    assert g.count("tools", 3600.0) == 1  # the refusal at 0 is exactly an hour old: gone
    assert g.count("tools", 7199.0) == 0


def test_the_refusal_guard_keeps_at_most_a_withdrawal_of_times_per_name() -> None:
    g = RefusalGuard()
    for t in range(1000):
        g.record(["tools"], t * 3600.0)  # one an hour: never withdrawn
    assert g.count("tools", 999 * 3600.0) == 1
    assert len(g._refused["tools"]) == REFUSALS_TO_WITHDRAW
    assert not g.withdrawn


def test_the_third_refusal_within_an_hour_withdraws_the_name_once() -> None:
    g = RefusalGuard()
    assert g.record(["json_schema"], 0.0) == []
    assert g.record(["json_schema"], 1000.0) == []
    assert g.count("json_schema", 1000.0) == 2
    assert g.record(["json_schema"], 3000.0) == ["json_schema"]
    assert g.withdrawn == frozenset({"json_schema"})
    assert g.record(["json_schema"], 3001.0) == []  # already withdrawn: not said again
    assert g.withdrawn == frozenset({"json_schema"})


def test_refusals_spread_over_more_than_an_hour_withdraw_nothing() -> None:
    g = RefusalGuard()
    for t in (0.0, 2000.0, 3700.0, 5700.0, 7500.0):
        assert g.record(["tools"], t) == []
    assert g.withdrawn == frozenset()


def test_names_are_counted_apart() -> None:
    g = RefusalGuard()
    g.record(["tools"], 0.0)
    g.record(["json_object"], 1.0)
    g.record(["tools", "json_object"], 2.0)
    assert g.record(["tools"], 3.0) == ["tools"]
    assert g.withdrawn == frozenset({"tools"})
    assert g.count("json_object", 3.0) == 2


def test_a_name_given_twice_in_one_refusal_counts_once() -> None:
    g = RefusalGuard()
    g.record(["tools", "tools"], 0.0)
    assert g.count("tools", 0.0) == 1


def test_a_lost_pop_counts_at_once_and_until_an_hour_after_the_horde_would_expire_it() -> None:
    """A pop whose answer was lost may hold a job the Horde expires 150-210 s
    later and counts for its hour after that: the guard counts it from now until
    a window after that expiry, and in order with the faults around it."""
    g = MaintenanceGuard()
    for t in range(17):
        g.record_fault(float(t))
    g.record_fault(100.0 + 210.0)  # the lost pop, at its job's expiry
    assert g.recent(100.0) == 18
    g.record_fault(101.0)
    assert not g.pop_allowed(101.0)
    assert g.resume_at(101.0) == 0.0 + 3660.0  # the oldest fault leaves first
    assert g.recent(310.0 + 3659.0) == 1  # the expiry's hour is not over yet
    assert g.recent(310.0 + 3660.0) == 0


# --- a feature withdrawn alone -------------------------------------------------------

CALL = {"id": "call_1", "type": "function", "function": {"name": "GetWeather", "arguments": "{}"}}
TOOLS_PAYLOAD = {"messages": [], "tools": [{"type": "function", "function": {"name": "w"}}]}


def test_an_invalid_reply_with_tool_calls_points_at_tools() -> None:
    reply = {"message": {"role": "assistant", "content": None, "tool_calls": [CALL]}}
    declared = ["seed", "tools"]
    assert refused_reply_features("ChatSubmitInvalid", TOOLS_PAYLOAD, reply, declared) == [
        "tools"
    ]
    # No call in the reply, no tools offered, tools not declared, another refusal: no name.
    plain = {"message": {"role": "assistant", "content": "hi"}}
    assert refused_reply_features("ChatSubmitInvalid", TOOLS_PAYLOAD, plain, declared) == []
    assert refused_reply_features("ChatSubmitInvalid", {"messages": []}, reply, declared) == []
    assert refused_reply_features("ChatSubmitInvalid", TOOLS_PAYLOAD, reply, ["seed"]) == []
    assert refused_reply_features("ChatModelMismatch", TOOLS_PAYLOAD, reply, declared) == []
    # Nonconformant: what the request used, as before.
    assert refused_reply_features(
        "ChatSubmitNonconformant", TOOLS_PAYLOAD, plain, declared
    ) == ["tools"]


def test_faults_a_withdrawn_feature_answers_for_do_not_withdraw_chat_but_stop_the_pops() -> None:
    g = MaintenanceGuard()
    for i in range(STOP_POPPING_AT - 1):
        g.record_fault(float(i), "chat", "tools")
    assert g.update(20.0) is None and g.chat_enabled
    assert g.chat_recent(20.0) == 0 and g.recent(20.0) == STOP_POPPING_AT - 1
    assert not g.pop_allowed(20.0, in_hand=1)  # the Horde counts them all the same
    g.record_fault(21.0, "chat")
    assert g.update(21.0) is None  # one fault of chat as a whole: far from 15


def test_a_withdrawn_name_comes_back_after_its_cool_off_which_doubles_each_time() -> None:
    g = RefusalGuard()
    for t in (0.0, 1.0, 2.0):
        withdrawn = g.record(["tools"], t)
    assert withdrawn == ["tools"] and g.until("tools") == 2.0 + HOUR_S
    assert g.restore_due(2.0 + HOUR_S - 1) == []
    assert g.withdrawn == frozenset({"tools"})
    assert g.restore_due(2.0 + HOUR_S) == ["tools"]
    assert g.withdrawn == frozenset() and g.until("tools") is None
    start = 10_000.0
    for t in (start, start + 1, start + 2):
        withdrawn = g.record(["tools"], t)
    assert withdrawn == ["tools"] and g.until("tools") == start + 2 + 2 * HOUR_S
    g.restore_due(start + 2 + 2 * HOUR_S)
    for i in range(10):  # withdrawn again and again: never more than a day
        for t in (0.0, 1.0, 2.0):
            g.record(["tools"], 1e6 * (i + 1) + t)
        assert (g.until("tools") or 0.0) - (1e6 * (i + 1) + 2.0) <= FEATURE_COOL_OFF_MAX_S
        g.restore_due(1e7 * 2)
