"""lease_fit.py: the declared max_length that koboldcpp generates within the lease
(seed "Streaming progress": a 150 s lease; capacity to generate max_length within
120 s), with plain numbers."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import pytest

from koboldcpp_horde_chat.state import lease_figures, lease_fit
from koboldcpp_horde_chat.state.lease_figures import (
    MIN_MAX_LENGTH,
    LengthChange,
    budget_s,
    fitted_length,
    job_max_length,
    perf_speed,
    reply_tokens,
    tokens_of_text,
)
from koboldcpp_horde_chat.state.lease_fit import LeaseFit

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


# --- the host's model: prompt processing and generation apart ------------------------------


@pytest.mark.parametrize(
    ("tokens_per_s", "process_s", "lease_s", "limits"),
    [
        # koboldcpp 1.116.1, one CPU thread, SmolLM2-135M: 46 s per 2,400 prompt
        # tokens and 27 tokens/s. The worst job (3,584 prompt tokens, 512
        # generated) takes 88 s of the 120 s budget: the caps stay.
        (27.0, 46.0 / 2400, 150.0, (512, 4096)),
        # The same host in a 60 s lease: 48 s for (C - 512) * p + 512 / 27.
        (27.0, 46.0 / 2400, 60.0, (512, 1984)),
        # 20 prompt tokens/s and 20 generated: 2,400 tokens of context in 120 s.
        (20.0, 0.05, 150.0, (512, 2368)),
        # Nothing known about prompts: the context stays.
        (2.0, None, 150.0, (240, 4096)),
        # Prompts known, generation not: max_length stays.
        (None, 0.05, 150.0, (512, 2368)),
        # A prompt token slower than a generated one: 400 tokens of context in
        # 120 s, and max_length leaves MIN_PROMPT_TOKENS of them to the prompt.
        (10.0, 0.3, 150.0, (144, 400)),
    ],
)
def test_the_fitted_limits_process_and_generate_within_the_budget(
    tokens_per_s: float | None, process_s: float | None, lease_s: float,
    limits: tuple[int, int],
) -> None:
    fitted = lease_figures.fitted_limits(
        tokens_per_s=tokens_per_s, process_s=process_s, lease_s=lease_s,
        cap=512, context_cap=4096, margin_s=MARGIN_S,
    )
    assert fitted == limits
    length, context = fitted
    if tokens_per_s and process_s and context > length + lease_figures.MIN_PROMPT_TOKENS:
        worst = (context - length) * process_s + length / tokens_per_s
        assert worst <= budget_s(lease_s, MARGIN_S)


def _figures(prompt: int, process_s: float, tokens: int, eval_s: float, gens: int = 1) -> Any:
    return lease_figures.PerfFigures(prompt, process_s, tokens, eval_s, gens)


def test_koboldcpps_figures_measure_prompts_and_generation_apart() -> None:
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S, context_cap=4096)
    # A short job: 100 prompt tokens in 5 s, 200 generated in 10 s.
    changes = fit.record("text", 200, 15.0, max_length=200, figures=_figures(100, 5.0, 200, 10.0))
    assert fit.speed("text") == 20.0 and fit.process_s("text") == 0.05
    assert [(c.what, c.old, c.new) for c in changes] == [("max_context_length", 4096, 2368)]
    assert changes[0].line() == (
        "max_context_length for text jobs lowered from 4096 to 2368: koboldcpp processes "
        "20.0 prompt tokens/s and generates 20.0 tokens/s here, and a job must end within "
        "120 s of its lease"
    )
    assert fit.declared("text") == 512  # every reply keeps its length
    assert fit.declared_context("chat") == 4096  # the other kind is not measured


def test_the_re_measure_of_a_context_a_long_job_lowered_is_a_prompt_as_long() -> None:
    """koboldcpp processes a 256-token prompt about twice as fast per token as a
    1,935-token one (58 against 29 tokens/s on one CPU thread): a short probe would
    raise the context the long job lowered, and the next long job lower it again."""
    fit = LeaseFit(256, 150.0, margin_s=MARGIN_S, context_cap=4096)
    changes = fit.record(
        "text", 64, 72.0, max_length=128, figures=_figures(1935, 66.08, 64, 5.7)
    )
    assert [(c.what, c.old) for c in changes] == [("max_context_length", 4096)]
    assert fit.probe_size("text") == (1935, 128)


def test_a_long_prompt_that_ran_out_narrows_the_context_not_the_length() -> None:
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S, context_cap=4096)
    fit.record("text", 200, 10.0, max_length=200)  # 20 tokens/s, nothing known of prompts
    changes = fit.ran_out("text", max_length=200, seconds=145.0, now=0.0, prompt_tokens=3000)
    assert [(c.what, c.old) for c in changes] == [("max_context_length", 4096)]
    # The prompt took at least 135 s of the 145: 0.045 s a token;
    # (120 - 512 * (0.05 - 0.045)) / 0.045 = 2,609, by 64.
    assert fit.declared_context("text") == 2560
    assert fit.declared("text") == 512
    assert changes[0].line() == (
        "max_context_length for text jobs lowered from 4096 to 2560: a job's prompt of "
        "3000 tokens ran out of its lease"
    )
    assert fit.lowered_because("text") == "koboldcpp ran out of a lease"
    assert fit.probe_size("text") == (3000, 200)


def test_a_run_out_the_measured_figures_cannot_explain_is_a_hang_and_lowers_nothing() -> None:
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S, context_cap=4096)
    fit.record("chat", 64, 1.0, max_length=64, figures=_figures(100, 0.1, 64, 0.64))
    declared = (fit.declared("chat"), fit.declared_context("chat"))
    # 60 prompt tokens and 512 to generate: 5 s predicted, 145 s not enough.
    assert fit.ran_out("chat", max_length=512, seconds=145.0, now=0.0, prompt_tokens=60) == []
    assert (fit.declared("chat"), fit.declared_context("chat")) == declared
    # Nothing measured at all: a short prompt that ran out teaches nothing either.
    fresh = LeaseFit(512, 15.0, margin_s=MARGIN_S, context_cap=4096)
    assert fresh.ran_out("chat", max_length=16, seconds=10.0, now=0.0, prompt_tokens=88) == []
    assert (fresh.declared("chat"), fresh.declared_context("chat")) == (512, 4096)


def test_a_slow_generation_that_ran_out_still_narrows_the_length() -> None:
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S, context_cap=4096)
    fit.record("text", 100, 20.0, max_length=100, figures=_figures(100, 1.0, 100, 19.0))
    [change] = fit.ran_out("text", max_length=512, seconds=145.0, now=0.0, prompt_tokens=100)
    assert (change.what, change.old, change.new) == ("max_length", 512, 256)


def test_no_measurement_raises_a_limit_before_the_run_outs_cooloff_ends() -> None:
    """A probe (or a job) that measures koboldcpp fast right after a run-out does
    not undo it: raises wait for the cool-off, then the re-measure decides."""
    fit = LeaseFit(512, 150.0, margin_s=MARGIN_S, context_cap=4096)
    fit.ran_out("text", max_length=200, seconds=145.0, now=0.0, prompt_tokens=3000)
    narrowed = fit.declared_context("text")
    assert narrowed is not None and narrowed < 4096
    fast = _figures(20, 0.01, 64, 0.5)  # a four-word probe looks fast
    assert fit.record("text", 64, 1.0, max_length=64, now=10.0, figures=fast) == []
    assert fit.declared_context("text") == narrowed
    assert fit.recheck_due(59.0) == []
    # After the cool-off a re-measure of the failed size that answers in time raises.
    assert fit.recheck_due(80.0) == ["text"]
    changes = fit.remeasured("text", 64.0, 80.0, process_s=0.001)
    assert [(c.what, c.new) for c in changes] == [("max_context_length", 4096)]


@pytest.mark.parametrize(
    ("perf", "figures"),
    [
        (
            {"total_gens": 2, "last_input_count": 2400, "last_process_time": 46.0,
             "last_token_count": 100, "last_eval_time": 3.7},
            lease_figures.PerfFigures(2400, 46.0, 100, 3.7, 2),
        ),
        ({"total_gens": 0, "last_input_count": 0, "last_process_time": 0.0,
          "last_token_count": 0, "last_eval_time": 0.0}, None),  # a fresh koboldcpp
        ({"total_gens": 2, "last_input_count": "2400", "last_process_time": 46.0,
          "last_token_count": 100, "last_eval_time": 3.7}, None),
        ({"total_gens": 2, "last_input_count": 10, "last_process_time": math.nan,
          "last_token_count": 100, "last_eval_time": 3.7}, None),
        ({"idle": 1}, None),
    ],
)
def test_koboldcpps_figures_are_read_only_when_they_describe_a_generation(
    perf: dict[str, Any], figures: Any
) -> None:
    assert lease_figures.perf_figures(perf) == figures


def test_a_run_out_whose_aborted_generation_produced_tokens_was_slow_generation() -> None:
    """Nothing measured yet, a short prompt: a hang unless koboldcpp's figures of
    the aborted generation show tokens generated by the deadline."""
    fit = LeaseFit(512, 20.0, margin_s=MARGIN_S, context_cap=4096)
    assert fit.ran_out("text", max_length=512, seconds=15.0, prompt_tokens=2, produced=0) == []
    [change] = fit.ran_out(
        "text", max_length=512, seconds=15.0, prompt_tokens=2, produced=375
    )
    assert (change.what, change.old, change.new) == ("max_length", 512, 256)
