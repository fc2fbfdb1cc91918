"""The journal's pure rules: what a restart sends, and the time between two runs.

Seed sections: "7. Fault a job" (a fault re-opens the request), "Streaming
progress" (the lease), "Check the completed reply" (DuplicateGen).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from koboldcpp_horde_chat.state.journal_rules import (
    FAULT_MARGIN_S,
    ClockMark,
    elapsed_bounds,
    fault_ages_shift,
    plan,
)

BOOT = "5d354a73-b7f9-400e-9d7a-bd1ee6b3c585"
OTHER_BOOT = "0b6f1c2e-0000-4000-8000-000000000000"
T0 = 1_700_000_000.0
REPLY = {"id": "j", "message": {"role": "assistant", "content": "Blue."},
         "finish_reason": "stop", "model_id": "m", "state": "ok"}


def entry(lease_left_s: float, terminal: str = "none", **more: Any) -> dict[str, Any]:
    """A journal entry written at T0 whose lease had ``lease_left_s`` left then."""
    obj: dict[str, Any] = {"job_id": "j", "kind": "chat", "model_id": "m", "genkey": "",
                           "lease_end": T0 + lease_left_s, "terminal": terminal}
    obj.update(more)
    return obj


THEN = ClockMark(T0, BOOT, 1000.0)


def test_on_the_same_boot_the_time_since_boot_is_believed_whatever_the_wall_clock_did() -> None:
    # 10 s passed; the wall clock was set back an hour meanwhile.
    now = ClockMark(T0 + 10 - 3600, BOOT, 1010.0)
    assert elapsed_bounds(THEN, now) == (10.0, 10.0)


def test_a_wall_clock_set_back_an_hour_does_not_fault_a_job_whose_lease_ended() -> None:
    """The lease ended 1,000 s before the restart; the wall clock says it still runs."""
    now = ClockMark(T0 + 1150 - 3600, BOOT, 1000.0 + 1150)
    assert plan(entry(150.0), THEN, now).action == "expired"


def test_a_wall_clock_set_back_keeps_the_faults_the_horde_still_counts() -> None:
    """A fault 60 s before the last write is 70 s old 10 s later, whatever the wall says."""
    now = ClockMark(T0 + 10 - 3600, BOOT, 1010.0)
    fault_at = T0 - 60
    assert now.wall - (fault_at + fault_ages_shift(THEN, now)) == pytest.approx(70.0)


def test_across_a_reboot_at_least_the_uptime_passed() -> None:
    now = ClockMark(T0 + 20, OTHER_BOOT, 90.0)  # the wall says 20 s; the machine is up 90 s
    assert elapsed_bounds(THEN, now) == (90.0, math.inf)  # the wall clock was set back
    assert plan(entry(150.0), THEN, now).action == "expired"  # not shown to be leased
    assert plan(entry(150.0, "reply_sent", reply=REPLY), THEN, now).action == "reply"
    later = ClockMark(T0 + 120, OTHER_BOOT, 90.0)
    assert elapsed_bounds(THEN, later) == (90.0, 120.0)
    assert plan(entry(150.0), THEN, later).action == "fault"  # a consistent wall: 30 s left


def test_a_file_without_a_mark_is_read_on_the_wall_clock() -> None:
    now = ClockMark(T0 + 10, BOOT, 5.0)
    assert elapsed_bounds(None, now) == (0.0, 0.0)
    assert plan(entry(150.0 - 10 + 10), None, now).lease_left_s == pytest.approx(140.0)
    assert fault_ages_shift(None, now) == 0.0


@pytest.mark.parametrize(
    ("terminal", "left", "action"),
    [
        ("none", 100.0, "fault"),
        ("none", FAULT_MARGIN_S - 0.1, "expired"),
        ("none", -1.0, "expired"),
        ("reply_kept", 1.0, "reply"),
        ("reply_sent", 1.0, "reply"),
        ("reply_sent", -1.0, "expired"),
        ("fault_sent", 100.0, "fault_sent"),
    ],
)
def test_what_a_restart_sends_by_terminal_action_state(terminal: str, left: float, action: str) -> None:
    now = ClockMark(T0, BOOT, 1000.0)
    extra = {"reply": REPLY} if terminal.startswith("reply") else {}
    assert plan(entry(left, terminal, **extra), THEN, now).action == action


marks = st.builds(
    ClockMark,
    wall=st.floats(T0 - 1e6, T0 + 1e6),
    boot_id=st.sampled_from(["", BOOT, OTHER_BOOT]),
    boottime=st.one_of(st.none(), st.floats(0, 1e6)),
)


@given(marks, marks, st.floats(-1000, 1000), st.sampled_from(["none", "reply_sent", "fault_sent"]))
def test_a_fault_is_planned_only_when_every_reading_of_the_clocks_leaves_the_lease_running(
    then: ClockMark, now: ClockMark, left: float, terminal: str
) -> None:
    least, most = elapsed_bounds(then, now)
    assert 0 <= least <= most
    extra = {"reply": REPLY} if terminal == "reply_sent" else {}
    step = plan(entry(left, terminal, **extra) | {"lease_end": then.wall + left}, then, now)
    if step.action == "fault":
        assert terminal == "none" and left - most > FAULT_MARGIN_S
    if terminal == "fault_sent":
        assert step.action == "fault_sent"
