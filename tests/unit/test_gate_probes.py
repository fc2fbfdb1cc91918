"""The pop gate's probes follow one rule: a failing subject (koboldcpp failing
generations of every kind, or one kind failing alone) is probed with a short
generation at most every ``PROBE_EVERY_S`` until one generates; the pause says
how long to the next probe."""

from __future__ import annotations

from bench.harness.fakes import FakeBackend
from koboldcpp_horde_chat.errors import BackendError
from koboldcpp_horde_chat.service.gate import PROBE_EVERY_S

from .test_loop_decisions import make


def test_a_koboldcpp_failing_every_generation_is_probed_every_ten_seconds_until_it_generates(
) -> None:
    backend = FakeBackend()
    backend.generates.extend(BackendError("boom") for _ in range(2))
    worker, _, _, clock = make([])
    worker.gate.backend = backend
    streak = worker.state.failure_streak
    for _ in range(streak.limit):
        streak.failed()
    assert worker.gate.pause() == ("backend_failing", PROBE_EVERY_S)  # the first probe failed
    assert backend.calls == {"generate": 1}
    clock.advance(4.0)
    assert worker.gate.pause() == ("backend_failing", PROBE_EVERY_S - 4.0)  # not due: no probe
    assert backend.calls == {"generate": 1}
    clock.advance(PROBE_EVERY_S - 4.0)
    assert worker.gate.pause() == ("backend_failing", PROBE_EVERY_S)  # the second failed
    assert backend.calls == {"generate": 2}
    clock.advance(PROBE_EVERY_S)
    assert worker.gate.pause() is None  # the third generated: pop
    assert backend.calls == {"generate": 3} and not streak.failing


def test_a_kind_failing_alone_is_probed_every_ten_seconds_apart_from_the_other(
) -> None:
    backend = FakeBackend()
    backend.chats.extend({"choices": []} for _ in range(2))
    backend.generates.append(BackendError("boom"))
    worker, _, _, clock = make([], prompt_jobs=True)
    worker.gate.backend = backend
    streak = worker.state.failure_streak
    for _ in range(streak.limit):
        streak.failed("chat")
        streak.failed("text")
    streak.count = 0  # the kinds fail alone, not koboldcpp as a whole
    assert worker.gate.pause() == ("kind_failing", PROBE_EVERY_S)
    assert backend.calls == {"chat": 1, "generate": 1}
    clock.advance(PROBE_EVERY_S)
    assert worker.gate.pause() is None  # text generated: text jobs may be popped
    assert backend.calls == {"chat": 2, "generate": 2}
    assert streak.kind_failing("chat") and not streak.kind_failing("text")
    clock.advance(PROBE_EVERY_S / 2)
    assert worker.gate.pause() is None
    assert backend.calls == {"chat": 2, "generate": 2}  # chat's next probe is not due
    clock.advance(PROBE_EVERY_S / 2)
    worker.gate.pause()
    assert backend.calls == {"chat": 3, "generate": 2} and not streak.kind_failing("chat")
