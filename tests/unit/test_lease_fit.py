"""lease_fit.py: the declared max_length that koboldcpp generates within the lease
(seed "Streaming progress": a 150 s lease; capacity to generate max_length within
120 s), with plain numbers."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from koboldcpp_horde_chat.state import lease_fit
from koboldcpp_horde_chat.state.lease_fit import (
    MIN_MAX_LENGTH,
    LeaseFit,
    LengthChange,
    budget_s,
    fitted_length,
    job_max_length,
    perf_speed,
    reply_tokens,
    tokens_of_text,
)

#: The submit's margin the worker passes (``state.job.SUBMIT_MARGIN_S``).
MARGIN_S = 5.0


def test_lease_fit_is_pure() -> None:
    imported: set[str] = set()
    for node in ast.walk(ast.parse(Path(lease_fit.__file__).read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "collections", "dataclasses", "math", "typing"}, imported


# --- the arithmetic --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "tokens"), [("", 0), ("a", 1), ("abcd", 1), ("abcde", 2), ("x" * 400, 100)]
)
def test_a_text_reply_is_counted_as_the_horde_estimates_it(text: str, tokens: int) -> None:
    assert tokens_of_text(text) == tokens  # ceil(chars / 4)


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"message": {"content": "Blue."}, "completion_tokens": 3}, 3),  # koboldcpp's count
        ({"message": {"content": "Blue."}, "completion_tokens": 0}, 0),
        ({"message": {"content": "x" * 40, "reasoning_content": "y" * 40}}, 20),
        ({"message": {"content": None, "tool_calls": []}}, 0),
        ({"message": {"content": "x" * 8}, "completion_tokens": True}, 2),  # not a count
        ({"message": {"content": "x" * 8}, "completion_tokens": -1}, 2),
        ({"generation": "x" * 400}, 100),  # a text job's reply
        ({"generation": None}, 0),
        ({}, 0),
    ],
)
def test_a_replys_tokens_are_koboldcpps_count_else_the_hordes_estimate(
    body: dict[str, object], tokens: int
) -> None:
    assert reply_tokens(body) == tokens


@pytest.mark.parametrize(
    ("payload", "max_length"),
    [({"max_length": 512}, 512), ({"max_length": 0}, 0), ({"max_length": -3}, 0),
     ({"max_length": True}, 0), ({"max_length": "512"}, 0), ({}, 0)],
)
def test_a_jobs_max_length_is_read_only_when_valid(
    payload: dict[str, object], max_length: int
) -> None:
    assert job_max_length(payload) == max_length


@pytest.mark.parametrize(
    ("lease_s", "margin_s", "budget"),
    [
        (150.0, MARGIN_S, 120.0),  # 80 % of the seed's 150 s lease
        (150.0, 0.0, 120.0),
        (20.0, MARGIN_S, 15.0),  # the margin before the lease's end is tighter than 80 %
        (25.0, MARGIN_S, 20.0),  # both give 20 s
        (3.0, MARGIN_S, 0.0),  # never negative
    ],
)
def test_a_generation_may_take_80_percent_of_the_lease_and_ends_before_its_margin(
    lease_s: float, margin_s: float, budget: float
) -> None:
    assert budget_s(lease_s, margin_s) == pytest.approx(budget)


@pytest.mark.parametrize(
    ("tokens_per_s", "lease_s", "cap", "fitted"),
    [
        (1.0, 150.0, 512, 112),  # 120 tokens in 120 s, down to a multiple of 16
        (2.0, 150.0, 512, 240),
        (4.0, 150.0, 512, 480),
        (4.3, 150.0, 512, 512),  # 516 tokens fit: the operator's 512
        (100.0, 150.0, 512, 512),  # never above --hordegenlen
        (25.0, 20.0, 512, 368),  # 15 s of a 20 s lease: 375 tokens
        (0.01, 150.0, 512, MIN_MAX_LENGTH),  # never below 16
        (0.01, 150.0, 8, 8),  # ... unless --hordegenlen is smaller
    ],
)
def test_the_fitted_max_length_is_what_the_speed_generates_within_the_budget(
    tokens_per_s: float, lease_s: float, cap: int, fitted: int
) -> None:
    assert fitted_length(tokens_per_s, lease_s, cap, MARGIN_S) == fitted


@pytest.mark.parametrize(("speed", "lease"), [(0.0, 150.0), (-1.0, 150.0), (1.0, 0.0)])
def test_a_fit_refuses_a_speed_or_lease_that_is_not_positive(speed: float, lease: float) -> None:
    with pytest.raises(ValueError):
        fitted_length(speed, lease, 512)


# --- koboldcpp's own figure -------------------------------------------------------------


@pytest.mark.parametrize(
    ("perf", "speed"),
    [
        ({"total_gens": 3, "last_eval_speed": 2.0}, 2.0),
        ({"total_gens": 1, "last_eval_speed": 17}, 17.0),
        ({"total_gens": 0, "last_eval_speed": 0}, None),  # a fresh koboldcpp
        ({"total_gens": 0, "last_eval_speed": 5.0}, None),  # no generation behind it
        ({"total_gens": 3, "last_eval_speed": 0.0}, None),
        ({"total_gens": 3, "last_eval_speed": -2.0}, None),
        ({"total_gens": 3, "last_eval_speed": math.nan}, None),
        ({"total_gens": 3, "last_eval_speed": math.inf}, None),
        ({"total_gens": 3, "last_eval_speed": "2.0"}, None),
        ({"total_gens": 3, "last_eval_speed": True}, None),
        ({"total_gens": True, "last_eval_speed": 2.0}, None),
        ({"last_eval_speed": 2.0}, None),
        ({}, None),
    ],
)
def test_koboldcpps_perf_figure_is_used_only_when_it_measured_a_generation(
    perf: dict[str, object], speed: float | None
) -> None:
    assert perf_speed(perf) == speed


def test_koboldcpps_figure_fits_both_kinds_before_any_job() -> None:
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S)
    assert (fit.declared("text"), fit.declared("chat")) == (512, 512)
    assert fit.speed("text") is None
    changes = fit.seed(2.0)
    assert [(c.kind, c.old, c.new, c.tokens_per_s) for c in changes] == [
        ("text", 512, 240, 2.0),
        ("chat", 512, 240, 2.0),
    ]
    assert changes[0].line() == (
        "max_length for text jobs lowered from 512 to 240: koboldcpp generates 2.0 tokens/s "
        "here, and a job's generation must end within 120 s of its lease"
    )
    assert (fit.declared("text"), fit.declared("chat")) == (240, 240)


@pytest.mark.parametrize("figure", [None, 0.0, -1.0])
def test_no_figure_changes_nothing(figure: float | None) -> None:
    fit = LeaseFit(512)
    assert fit.seed(figure) == []
    assert fit.declared("text") == 512


def test_a_fast_koboldcpps_figure_keeps_the_operators_length() -> None:
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S)
    assert fit.seed(30.0) == []  # 3600 tokens fit: --hordegenlen stays
    assert fit.declared("text") == 512


# --- measuring jobs -----------------------------------------------------------------------


def test_a_measured_kind_is_fitted_and_the_other_kind_is_not() -> None:
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S)
    changes = fit.record("text", 100, 100.0, max_length=512)  # 1 token/s
    assert changes == [LengthChange("text", 512, 112, 1.0, 120.0)]
    assert (fit.declared("text"), fit.declared("chat")) == (112, 512)


def test_measured_jobs_win_over_koboldcpps_figure() -> None:
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S)
    fit.seed(2.0)
    fit.record("text", 400, 100.0, max_length=512)  # 4 tokens/s
    assert fit.speed("text") == 4.0
    assert fit.declared("text") == 480
    assert fit.speed("chat") == 2.0  # still koboldcpp's figure


def test_the_speed_is_the_tokens_of_the_last_jobs_over_their_seconds() -> None:
    fit = LeaseFit(512)
    fit.record("chat", 100, 50.0, max_length=512)
    fit.record("chat", 300, 50.0, max_length=512)
    assert fit.speed("chat") == 4.0  # 400 tokens in 100 s
    for _ in range(lease_fit.SAMPLES_KEPT):
        fit.record("chat", 50, 50.0, max_length=512)
    assert fit.speed("chat") == 1.0  # the older, faster jobs are forgotten


def test_a_short_reply_that_stopped_early_is_not_measured() -> None:
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S)
    assert fit.record("text", 15, 100.0, max_length=512) == []  # an early stop says little
    assert fit.speed("text") is None
    # A short job that used its whole max_length is a measurement.
    assert fit.record("text", 10, 100.0, max_length=10) == [LengthChange(
        "text", 512, MIN_MAX_LENGTH, 0.1, 120.0
    )]


@pytest.mark.parametrize(("tokens", "seconds"), [(100, 0.0), (100, -1.0), (-1, 10.0)])
def test_an_impossible_measurement_is_ignored(tokens: int, seconds: float) -> None:
    fit = LeaseFit(512)
    assert fit.record("text", tokens, seconds, max_length=512) == []
    assert fit.speed("text") is None


def test_a_lowered_length_is_raised_only_when_the_fit_is_a_quarter_larger_or_the_cap() -> None:
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S)
    fit.record("text", 100, 100.0, max_length=512)  # 1.0 token/s: 112
    assert fit.record("text", 130, 100.0, max_length=512) == []  # 1.15: 128 < 140
    assert fit.declared("text") == 112
    [change] = fit.record("text", 1000, 100.0, max_length=512)  # 1230 / 300 s: 4.1
    assert change is not None and (change.old, change.new) == (112, 480)
    assert change.line().startswith("max_length for text jobs raised from 112 to 480: ")
    # From 480 the cap is less than a quarter more, and is still reached.
    [change] = fit.record("text", 100_000, 100.0, max_length=512)
    assert change is not None and (change.old, change.new) == (480, 512)


def test_the_declared_length_never_goes_above_hordegenlen() -> None:
    fit = LeaseFit(64, 150.0, margin_s=MARGIN_S)
    assert fit.seed(1000.0) == []
    for _ in range(3):
        assert fit.record("chat", 64, 0.1, max_length=64) == []
    assert fit.declared("chat") == 64


def test_the_lease_of_the_jobs_is_the_one_fitted_to() -> None:
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S)
    fit.note_lease(20.0)
    fit.note_lease(0.0)  # not a lease: ignored
    fit.note_lease(-3.0)
    assert fit.lease_s == 20.0
    assert fit.record("text", 250, 10.0, max_length=512) == [LengthChange(
        "text", 512, 368, 25.0, 15.0
    )]


def test_a_lease_fit_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        LeaseFit(0)
    with pytest.raises(ValueError):
        LeaseFit(512, 0.0)


# --- a job that ran out of its lease -------------------------------------------------------


def test_a_job_that_ran_out_of_its_lease_halves_its_kinds_length() -> None:
    fit = LeaseFit(512, 20.0, margin_s=MARGIN_S)
    [change] = fit.ran_out("text", max_length=512, seconds=20.0)
    # half of 512; what 25.6 tokens/s (at most) fits in 15 s would be 384
    assert change == LengthChange("text", 512, 256, None, 15.0)
    assert change.line() == (
        "max_length for text jobs lowered from 512 to 256: a job's generation ran out of "
        "its lease"
    )
    assert fit.declared("chat") == 512
    [change] = fit.ran_out("text", max_length=256, seconds=20.0)
    assert change.new == 128


def test_a_job_that_ran_out_narrows_to_what_its_speed_fits_when_that_is_less() -> None:
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S)
    # 400 tokens were not done in 145 s: less than 2.76 tokens/s, at most 320 in 120 s;
    # half of 400 is less still.
    assert fit.ran_out("chat", max_length=400, seconds=145.0) == [LengthChange(
        "chat", 512, 200, None, 120.0
    )]
    # A job asking 512 that ran out after 300 s (a streamed lease): at most 1.7 tokens/s,
    # 204 tokens in 120 s, 192 by 16: less than half of 512.
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S)
    [change] = fit.ran_out("chat", max_length=512, seconds=300.0)
    assert change.new == 192


def test_running_out_never_narrows_below_the_smallest_length_nor_raises() -> None:
    fit = LeaseFit(512, 20.0, margin_s=MARGIN_S)
    for _ in range(10):
        fit.ran_out("text", max_length=fit.declared("text"), seconds=20.0)
    assert fit.declared("text") == MIN_MAX_LENGTH
    assert fit.ran_out("text", max_length=MIN_MAX_LENGTH, seconds=20.0) == []
    # A job bigger than what is declared now (popped before the change) cannot raise it.
    assert fit.ran_out("text", max_length=512, seconds=20.0) == []
    assert fit.declared("text") == MIN_MAX_LENGTH


def test_running_out_forgets_the_speed_it_proved_too_high() -> None:
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S)
    fit.record("text", 512, 10.0, max_length=512)  # 51 tokens/s: 512 kept
    assert fit.speed("text") == pytest.approx(51.2)
    fit.ran_out("text", max_length=512, seconds=150.0)
    assert fit.speed("text") is None
    assert fit.declared("text") == 256
    # The next measured job fits from its own speed alone.
    assert fit.record("text", 240, 120.0, max_length=256) == [LengthChange(
        "text", 256, 240, 2.0, 120.0
    )]
