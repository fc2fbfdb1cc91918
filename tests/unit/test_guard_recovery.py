"""The guard gives back what it took once koboldcpp can serve it again: a
``max_length`` lowered for a lease run-out is re-measured while the kind is idle,
a kind whose generations fail alone is withdrawn after three in a row and probed
until it generates; and an empty pop's skipped requests are said in the terms of
what the worker declared."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from bench.harness.fakes import FakeBackend, FakeClock
from koboldcpp_horde_chat.errors import BackendError
from koboldcpp_horde_chat.state.guard import FailureStreak
from koboldcpp_horde_chat.state.lease_fit import (
    RECHECK_AFTER_S,
    RECHECK_MAX_S,
    LeaseFit,
)
from koboldcpp_horde_chat.state.probes import FIRST_WAIT_S
from koboldcpp_horde_chat.state.skipped import SkipContext, SkippedReporter, describe_skipped

from .test_loop_decisions import chat_pop, log_text, make, run, text_pop

EMPTY: dict[str, Any] = {"id": None, "ids": [], "skipped": {}, "messages": []}

# --- a lowered max_length comes back --------------------------------------------------


def test_a_max_length_cut_for_a_run_out_is_due_a_remeasure_after_its_cooloff() -> None:
    fit = LeaseFit(1024)
    fit.ran_out("text", max_length=100, seconds=150.0, now=0.0)
    assert fit.declared("text") == 50
    assert fit.recheck_due(RECHECK_AFTER_S - 1) == []
    assert fit.recheck_due(RECHECK_AFTER_S) == ["text"]
    assert fit.recheck_due(RECHECK_AFTER_S + 1) == []  # one probe at a time
    [change] = fit.remeasured("text", 40.0, RECHECK_AFTER_S + 5)  # 4800 tokens in 120 s
    assert (change.old, change.new) == (50, 1024)
    assert "again (measured with a generation of the worker's own)" in change.line()
    assert fit.recheck_due(10_000.0) == []  # at the cap: nothing to re-measure


def test_a_koboldcpp_that_stays_slow_is_remeasured_ever_less_often() -> None:
    fit = LeaseFit(1024)
    fit.ran_out("text", max_length=100, seconds=150.0, now=0.0)
    now, gaps = 0.0, []
    for _ in range(7):
        due_at = now + fit.cooloff_s("text")
        assert fit.recheck_due(due_at - 0.5) == []
        assert fit.recheck_due(due_at) == ["text"]
        gaps.append(due_at - now)
        now = due_at
        changes = fit.remeasured("text", 0.4, now)  # 48 tokens in 120 s: no raise
        assert all(c.new < c.old for c in changes)
    assert gaps == [60.0, 120.0, 240.0, 480.0, 960.0, 1800.0, 1800.0]
    assert fit.cooloff_s("text") == RECHECK_MAX_S


def test_a_run_out_soon_after_a_raise_doubles_the_cooloff() -> None:
    fit = LeaseFit(1024)
    fit.ran_out("chat", max_length=512, seconds=150.0, now=0.0)
    assert fit.recheck_due(60.0) == ["chat"]
    fit.remeasured("chat", 2.0, 60.0)  # 240 tokens in 120 s: raised from 128
    assert fit.declared("chat") == 240
    fit.ran_out("chat", max_length=240, seconds=150.0, now=200.0)  # the raise did not hold
    assert fit.cooloff_s("chat") == 2 * RECHECK_AFTER_S
    assert fit.recheck_due(200.0 + 119) == []
    assert fit.recheck_due(200.0 + 120) == ["chat"]


def test_a_measured_job_of_the_kind_puts_the_remeasure_off() -> None:
    fit = LeaseFit(1024)
    fit.ran_out("text", max_length=100, seconds=150.0, now=0.0)
    fit.record("text", 48, 100.0, max_length=48, now=50.0)  # slow still: measured by a job
    assert fit.recheck_due(60.0) == []
    assert fit.recheck_due(110.0) == ["text"]


def test_a_declaration_lowered_by_koboldcpps_own_figure_is_remeasured_too() -> None:
    fit = LeaseFit(1024)
    fit.seed(1.0, now=0.0)  # 112 tokens in 120 s
    assert fit.declared("text") == 112
    assert fit.recheck_due(60.0) == ["text", "chat"]


class _TimedBackend(FakeBackend):
    """A koboldcpp whose text generations take ``seconds`` on the fake clock."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        super().__init__()
        self.clock = clock
        self.seconds = seconds
        self.genkeys: list[str] = []

    def generate(self, payload: dict[str, Any], **kwargs: Any) -> Any:
        self.clock.advance(self.seconds)
        self.genkeys.append(str(payload.get("genkey")))
        return {"results": [{"text": "word " * 200, "finish_reason": "length"}]}


def test_an_idle_worker_gets_its_max_length_back_when_koboldcpp_is_fast_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The operator's case: text max_length cut to 50 by a run-out, koboldcpp fast
    again, and only requests longer than 50 waiting (empty pops). Before, the
    worker declared 50 until a short job happened to come; now it re-measures
    koboldcpp with a short generation of its own once the cool-off has passed and
    declares the operator's max_length again."""
    caplog.set_level(logging.INFO)
    worker, horde, _, clock = make([EMPTY] * 200, max_length=1024)
    backend = _TimedBackend(clock, 0.5)
    worker.backend = worker.gate.backend = backend
    worker.state.lease_fit.ran_out("text", max_length=100, seconds=150.0, now=clock())
    run(worker, 3)
    assert horde.pop_bodies[-1]["max_length"] == 50
    assert backend.genkeys == []
    start = clock()
    while clock() - start < RECHECK_AFTER_S + 10:
        worker.run_once()
    assert len(backend.genkeys) == 1 and backend.genkeys[0].startswith("HORDEREQ_")
    assert horde.pop_bodies[-1]["max_length"] == 1024
    assert "max_length for text jobs raised from 50 to 1024" in log_text(caplog)


# --- a kind that fails alone ---------------------------------------------------------


def _unreadable_chats(backend: FakeBackend, n: int) -> None:
    backend.chats.extend({"choices": []} for _ in range(n))


def test_chat_generations_failing_alone_withdraw_chat_after_three_and_a_probe_restores_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """koboldcpp fails every chat completion while text generations succeed:
    the streak of all kinds is ended by each text job, yet the third chat failure
    in a row withdraws chat (text jobs go on); a chat probe, a minute later, brings it
    back once koboldcpp generates chat again. Before, chat jobs were faulted until
    the Horde's count withdrew chat at 15."""
    caplog.set_level(logging.INFO)
    pops = [p for i in range(10) for p in (chat_pop(f"c{i}"), text_pop(f"t{i}"))]
    backend = FakeBackend()
    _unreadable_chats(backend, 100)
    worker, horde, _, clock = make(pops, backend=backend)
    faulted_with_chat = 0
    for _ in range(20):
        before = horde.verdicts()
        body_before = len(horde.pop_bodies)
        worker.run_once()
        new = {j: v for j, v in horde.verdicts().items() if j not in before}
        if any(v == "faulted" for v in new.values()) and horde.pop_bodies[body_before:]:
            if horde.pop_bodies[body_before].get("chat_jobs") is True:
                faulted_with_chat += 1
    assert faulted_with_chat == 3
    bodies = horde.pop_bodies
    first_without = next(i for i, b in enumerate(bodies) if "chat_jobs" not in b)
    assert all("chat_jobs" not in b for b in bodies[first_without:])
    assert "prompt_jobs" not in bodies[-1]  # text jobs continue
    lines = log_text(caplog)
    assert lines.count(
        "chat generations failed 3 times in a row: popping without the chat declaration "
        "(text jobs continue); probing koboldcpp with a chat completion the size of the "
        "failed job until one succeeds"
    ) == 1
    assert any(v == "submitted" for j, v in horde.verdicts().items() if j.startswith("t"))
    # koboldcpp generates chat again: the next probe says so and chat is declared.
    backend.chats.clear()
    horde.pops.append(EMPTY)
    clock.advance(FIRST_WAIT_S)
    worker.run_once()
    assert "koboldcpp generates chat completions again: declaring chat again" in log_text(caplog)
    assert horde.pop_bodies[-1].get("chat_jobs") is True


def test_text_generations_failing_alone_pop_for_chat_jobs_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    pops = [p for i in range(6) for p in (text_pop(f"t{i}"), chat_pop(f"c{i}"))]
    backend = FakeBackend()
    backend.generates.extend(BackendError("boom") for _ in range(100))
    worker, horde, _, _ = make(pops, backend=backend)
    run(worker, 10)
    assert horde.pop_bodies[-1]["prompt_jobs"] is False
    assert horde.pop_bodies[-1]["chat_jobs"] is True
    assert (
        "text generations failed 3 times in a row: popping for chat jobs only (prompt_jobs "
        "false); probing koboldcpp with a text generation the size of the failed job until "
        "one succeeds"
    ) in log_text(caplog)


def test_a_chat_only_worker_whose_chat_fails_stops_popping_and_probes_chat(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    backend = FakeBackend()
    _unreadable_chats(backend, 100)
    worker, horde, _, clock = make(
        [chat_pop(f"c{i}") for i in range(10)], backend=backend, prompt_jobs=False
    )
    worker.state.failure_streak = FailureStreak()
    run(worker, 12)
    assert sum(v == "faulted" for v in horde.verdicts().values()) == 3
    assert "not popping (no other kind to serve)" in log_text(caplog)
    calls = backend.calls.get("chat", 0)
    clock.advance(FIRST_WAIT_S)
    run(worker, 1)
    assert backend.calls.get("chat", 0) == calls + 1  # the probe, not a job


# --- the skipped line ----------------------------------------------------------------


def test_skipped_requests_are_said_with_the_declared_value_and_why_it_was_lowered() -> None:
    context = SkipContext(
        max_length={"text": 50, "chat": 1024},
        max_context_length={"text": 4096, "chat": 4096},
        models=("koboldcpp/m",),
        lowered={"text": "koboldcpp ran out of a lease"},
    )
    assert describe_skipped({"max_length": 2}, context) == (
        "2 requests skipped: they ask for more than the max_length declared for their kind "
        "(50 tokens for text jobs (lowered: koboldcpp ran out of a lease), 1024 tokens for "
        "chat jobs)"
    )
    text_only = SkipContext.of_pop(
        {"max_length": 50, "max_context_length": 4096, "models": ["koboldcpp/m"]},
        {"text": "koboldcpp ran out of a lease"},
    )
    assert describe_skipped({"max_length": 2}, text_only) == (
        "2 requests skipped: they ask for more than the 50 tokens max_length declared for "
        "text jobs (lowered: koboldcpp ran out of a lease)"
    )
    assert describe_skipped({"max_context_length": 1, "models": 2, "untrusted": 1}, context) == (
        "4 requests skipped: 1 asks for a longer context than the 4096 tokens "
        "max_context_length declared; 2 ask for other models than koboldcpp/m; untrusted=1"
    )


def test_the_skipped_line_is_said_again_when_the_declaration_behind_it_changes() -> None:
    reporter = SkippedReporter()
    low = SkipContext({"text": 50}, {"text": 4096}, lowered={"text": "koboldcpp ran out of a lease"})
    assert reporter.line({"max_length": 1}, 0.0, low) is not None
    assert reporter.line({"max_length": 3}, 100.0, low) is None  # said once
    high = SkipContext({"text": 1024}, {"text": 4096})
    assert reporter.line({"max_length": 1}, 200.0, high) == (
        "1 request skipped: it asks for more than the 1024 tokens max_length declared"
    )


def test_the_empty_pop_line_words_the_lowered_max_length(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    skipped = dict(EMPTY, skipped={"max_length": 2})
    worker, _, _, clock = make([skipped] * 3, max_length=1024)
    worker.state.lease_fit.ran_out("text", max_length=100, seconds=150.0, now=clock())
    run(worker, 3)
    assert (
        "no job for this worker: 2 requests skipped: they ask for more than the max_length "
        "declared for their kind (50 tokens for text jobs (lowered: koboldcpp ran out of a "
        "lease), 1024 tokens for chat jobs)"
    ) in log_text(caplog)
