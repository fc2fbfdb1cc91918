"""Long text generations back to back: koboldcpp waits for no Horde round trip
between two jobs (the next pop goes out during the generation, the reply's
submit beside the next job), and nothing changes for short ones."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bench.harness.devkit import Request, Response, TimedDevHorde
from bench.harness.worker_process import API_KEY
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply

from .conftest import RunningWorker

LATENCY_S = 0.3
TOKEN_DELAY_S = 0.02
TOKENS = 64


class _Horde(TimedDevHorde):
    """The dev Horde, noting when each submit's answer was ready (monotonic)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.submits_out: list[float] = []

    def on_call(self, req: Request, resp: Response, t_in: float, t_out: float) -> None:
        if req.path.endswith("/submit"):
            self.submits_out.append(t_out)


@pytest.fixture
def horde() -> Iterator[DevHorde]:
    h = _Horde(api_keys=(API_KEY,), latency_s=LATENCY_S)
    h.start()
    try:
        yield h
    finally:
        h.stop()
    assert h.late_faults == []


def _serve(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Callable[..., RunningWorker],
    jobs: int, tokens: int,
) -> list[float]:
    """Serve ``jobs`` text jobs of ``tokens`` tokens, queued at once; when each
    generation started at koboldcpp (monotonic seconds)."""
    starts: list[float] = []
    lock = threading.Lock()

    def script(body: dict[str, Any]) -> ScriptedReply:
        with lock:
            starts.append(time.monotonic())
        return ScriptedReply(text="word " * 400, finish="length")

    kcpp.script(script)
    kcpp.token_delay_s = TOKEN_DELAY_S
    worker = start_worker()
    rids = [horde.send_text("Once upon a time", max_length=tokens) for _ in range(jobs)]
    assert horde.wait(rids, timeout_s=120)
    assert worker.stop() == 0
    assert [e["action"] for e in horde.ledger] == ["submitted"] * jobs
    return starts


def test_long_text_generations_follow_each_other_without_a_round_trip_between(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Callable[..., RunningWorker]
) -> None:
    starts = _serve(horde, kcpp, start_worker, jobs=6, tokens=TOKENS)
    assert len(starts) == 6
    generation_s = TOKENS * TOKEN_DELAY_S
    # koboldcpp's idle time between two generations, once the worker has measured one
    # (the median: a loaded machine may delay one pop past a generation's end)
    idle = sorted(b - a - generation_s for a, b in zip(starts[1:], starts[2:], strict=False))
    assert idle[len(idle) // 2] < LATENCY_S / 2, idle
    # the next generation started before the last submit's answer came back
    assert isinstance(horde, _Horde)
    assert starts[-1] < max(horde.submits_out)


def test_short_text_generations_still_pop_beside_the_submit(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Callable[..., RunningWorker]
) -> None:
    starts = _serve(horde, kcpp, start_worker, jobs=3, tokens=4)
    generation_s = 4 * TOKEN_DELAY_S
    idle = [b - a - generation_s for a, b in zip(starts, starts[1:], strict=False)]
    # one round trip between two short jobs: the submit's, the pop beside it
    assert min(idle) >= LATENCY_S * 0.9, idle


def test_an_untrusted_owner_hears_of_a_fast_reply_sent_beside_the_next_job(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Callable[..., RunningWorker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first and last jobs are slow (50 tokens/s, 6 s); the ones between are
    popped during a generation and their replies sent beside the next job, and run
    at 250 tokens/s, above the 150 the Horde allows an untrusted owner's worker:
    the owner is told once, though no reply at that speed went the usual way."""
    caplog.set_level(logging.INFO)
    calls: list[int] = []

    def script(body: dict[str, Any]) -> ScriptedReply:
        kcpp.token_delay_s = 0.004 if 1 <= len(calls) <= 2 else 0.02
        calls.append(1)
        return ScriptedReply(text="word " * 400, finish="length")

    kcpp.script(script)
    worker = start_worker()
    rids = [horde.send_text("Once upon a time", max_length=300) for _ in range(4)]
    assert horde.wait(rids, timeout_s=120)
    assert worker.stop() == 0
    assert [e["action"] for e in horde.ledger] == ["submitted"] * 4
    assert caplog.text.count("above the 150 tokens/s the Horde allows a worker of an untrusted owner") == 1
