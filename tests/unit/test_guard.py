"""guard.py: sliding-hour counters for maintenance avoidance and guarantee withdrawal."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from koboldcpp_horde_chat.service import guard
from koboldcpp_horde_chat.service.guard import (
    MaintenanceGuard,
    RefusalGuard,
    SlidingWindow,
    refusal_features,
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


# --- SlidingWindow -------------------------------------------------------------------


def test_a_window_counts_only_the_last_hour() -> None:
    w = SlidingWindow(3600.0)
    for t in (0.0, 100.0, 3599.0):
        w.add(t)
    assert w.count(3599.0) == 3
    assert w.count(3600.0) == 2  # the event at 0 is exactly an hour old: gone
    assert w.count(3700.0) == 1
    assert w.count(7199.0) == 0


def test_a_window_never_holds_more_than_maxlen() -> None:
    w = SlidingWindow(3600.0, maxlen=5)
    for t in range(1000):
        w.add(float(t))
    assert w.count(1000.0) == 5
    assert len(w._times) == 5


@pytest.mark.parametrize("kwargs", [{"window_s": 0}, {"window_s": -1}, {"maxlen": 0}])
def test_a_window_refuses_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SlidingWindow(**kwargs)  # type: ignore[arg-type]


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


def test_the_maintenance_guard_refuses_inverted_thresholds() -> None:
    with pytest.raises(ValueError):
        MaintenanceGuard(withdraw_at=5, restore_below=10)


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


def test_the_threshold_is_configurable_and_checked() -> None:
    assert RefusalGuard(threshold=1).record(["tools"], 0.0) == ["tools"]
    with pytest.raises(ValueError):
        RefusalGuard(threshold=0)
