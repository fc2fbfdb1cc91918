"""The pop gate's probes follow one rule (``state.probes``): a failing subject
(koboldcpp failing generations of every kind, or one kind failing alone) is
probed with a job the size of the one that failed, first a minute after its
withdrawal, each failed probe waiting twice as long as the last; a probe that
generates declares it again on probation, and the next withdrawal waits twice
as long as the last wait; the pause says how long to the next probe."""

from __future__ import annotations

from typing import Any

from bench.harness.fakes import FakeBackend
from koboldcpp_horde_chat.errors import BackendError
from koboldcpp_horde_chat.service.gate import probe_prompt
from koboldcpp_horde_chat.state.probes import (
    FIRST_WAIT_S,
    MAX_WAIT_S,
    SUSTAINED_SUCCESSES,
    ProbePlan,
)

from .test_loop_decisions import make


class _Recording(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict[str, Any]] = []

    def generate(self, payload: dict[str, Any], **kwargs: Any) -> Any:
        self.bodies.append(payload)
        return super().generate(payload, **kwargs)

    def chat_completion(self, body: Any, **kwargs: Any) -> Any:
        self.bodies.append(body)
        return super().chat_completion(body, **kwargs)


def test_a_koboldcpp_failing_every_generation_waits_a_minute_then_ever_longer_between_probes(
) -> None:
    backend = _Recording()
    backend.generates.extend(BackendError("boom", status=500) for _ in range(2))
    worker, _, _, clock = make([])
    worker.gate.backend = backend
    streak = worker.state.failure_streak
    for _ in range(streak.limit):
        worker.state.probe_plan.note_failed("text", 900, 200)
        streak.failed()
    assert worker.gate.pause() == ("backend_failing", FIRST_WAIT_S)  # no probe yet
    assert backend.calls == {}
    clock.advance(FIRST_WAIT_S - 1)
    assert worker.gate.pause() == ("backend_failing", 1.0)
    assert backend.calls == {}
    clock.advance(1.0)
    assert worker.gate.pause() == ("backend_failing", 2 * FIRST_WAIT_S)  # the first failed
    assert backend.calls == {"generate": 1}
    # The probe is the failed job's size: about 900 prompt tokens, 200 to generate.
    body = backend.bodies[0]
    assert body["max_length"] == 200
    assert len(body["prompt"].split()) == 900
    clock.advance(2 * FIRST_WAIT_S)
    assert worker.gate.pause() == ("backend_failing", 4 * FIRST_WAIT_S)  # the second failed
    clock.advance(4 * FIRST_WAIT_S)
    assert worker.gate.pause() is None  # the third generated: pop
    assert backend.calls == {"generate": 3} and not streak.failing
    # On probation: one more failure withdraws it again, and that waits longer still.
    streak.failed()
    assert streak.failing
    assert worker.gate.pause() == ("backend_failing", 8 * FIRST_WAIT_S)


def test_a_kind_failing_alone_is_probed_apart_from_the_other() -> None:
    backend = FakeBackend()
    backend.chats.extend({"choices": []} for _ in range(2))
    backend.generates.append(BackendError("boom", status=500))
    worker, _, _, clock = make([], prompt_jobs=True)
    worker.gate.backend = backend
    streak = worker.state.failure_streak
    for _ in range(streak.limit):
        streak.failed("chat")
        streak.failed("text")
    streak.count = 0  # the kinds fail alone, not koboldcpp as a whole
    assert worker.gate.pause() == ("kind_failing", FIRST_WAIT_S)
    assert backend.calls == {}
    clock.advance(FIRST_WAIT_S)
    assert worker.gate.pause() == ("kind_failing", 2 * FIRST_WAIT_S)  # both probes failed
    assert backend.calls == {"chat": 1, "generate": 1}
    clock.advance(2 * FIRST_WAIT_S)
    assert worker.gate.pause() is None  # text generated: text jobs may be popped
    assert backend.calls == {"chat": 2, "generate": 2}
    assert streak.kind_failing("chat") and not streak.kind_failing("text")
    clock.advance(FIRST_WAIT_S)
    assert worker.gate.pause() is None
    assert backend.calls == {"chat": 2, "generate": 2}  # chat's next probe is not due
    clock.advance(3 * FIRST_WAIT_S)
    worker.gate.pause()
    assert backend.calls == {"chat": 3, "generate": 2} and not streak.kind_failing("chat")


def test_the_waits_double_up_to_half_an_hour_and_start_over_after_sustained_success() -> None:
    plan = ProbePlan()
    now, waits = 0.0, []
    for _ in range(8):  # each withdrawal, its probe answering at once
        assert not plan.due("chat", now)
        at = plan.next_at("chat")
        assert at is not None
        waits.append(at - now)
        now = at
        assert plan.due("chat", now)
        plan.probe_succeeded("chat")
    assert waits == [60.0, 120.0, 240.0, 480.0, 960.0, 1800.0, 1800.0, 1800.0]
    assert plan.wait_s("chat") == MAX_WAIT_S
    for _ in range(SUSTAINED_SUCCESSES - 1):
        plan.job_succeeded("chat")
    plan.note_failed("chat", 50, 64)  # not sustained: a failure in between
    for _ in range(SUSTAINED_SUCCESSES - 1):
        plan.job_succeeded("chat")
    assert plan.wait_s("chat") == MAX_WAIT_S
    plan.job_succeeded("chat")
    assert plan.wait_s("chat") == FIRST_WAIT_S


def test_a_probe_prompt_has_about_the_tokens_asked_for() -> None:
    assert probe_prompt(0) == "Once upon a time"
    assert len(probe_prompt(2400).split()) == 2400
