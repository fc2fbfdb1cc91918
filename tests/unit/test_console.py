"""The console an operator builds on: the job's submit line as a grep or a
dashboard reads it.

- after every accepted submit, the totals in koboldcpp's own bracketed shape
  (a pattern written from koboldcpp 1.116.1's format string matches the
  worker's line), the per-job kudos with two decimals, the faults after the
  bracket;
- the job's time split into koboldcpp's generation and the waits on the Horde
  (the pop's answer, progress posts, the submit's answer).

The pop loop runs against in-process fakes on a fake clock; the fakes move the
clock by the time each call takes.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from bench.harness.fakes import FakeBackend, FakeClock, FakeHorde, FakeManners, FakeStopEvent
from koboldcpp_horde_chat.service.loop import Worker
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.shared import WorkerState
from tests.unit.test_loop_decisions import KEY, MODEL, chat_pop, text_pop

#: koboldcpp 1.116.1's line after each job (``koboldcpp.py`` L10078), written from
#: its format string: ``[Total:{session_kudos_earned:.0f} kudos,
#: Time:{hrs:03d}h:{mins:02d}m:{secs:02d}s, Jobs:{session_jobs},
#: EarnRate:{earnrate:.2f} kudos/hr, JobRate:{jobrate:.2f} jobs/hr,
#: JobCost:{jobcost:.2f} kudos/job]``.
KCPP_TOTALS = re.compile(
    r"\[Total:(?P<total>-?\d+) kudos, Time:(?P<h>\d{3,})h:(?P<m>\d{2})m:(?P<s>\d{2})s, "
    r"Jobs:(?P<jobs>\d+), EarnRate:(?P<earn>-?\d+\.\d{2}) kudos/hr, "
    r"JobRate:(?P<jobrate>\d+\.\d{2}) jobs/hr, JobCost:(?P<cost>-?\d+\.\d{2}) kudos/job\]"
)


class TimedHorde(FakeHorde):
    """A Horde whose pops take ``pop_s``, submits ``submit_s`` and progress posts
    ``progress_s`` (fake clock), and which pays ``reward`` kudos a job."""

    def __init__(
        self, clock: FakeClock, pops: list[Any], *, pop_s: float, submit_s: float, reward: float,
        progress_s: float = 0.0,
    ) -> None:
        super().__init__(clock, pops=pops)
        self.pop_s = pop_s
        self.submit_s = submit_s
        self.progress_s = progress_s
        self.reward = reward

    def progress(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.clock.advance(self.progress_s)
        return super().progress(body, timeout_s=timeout_s)

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.clock.advance(self.pop_s)
        return super().pop(body, timeout_s=timeout_s)

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.clock.advance(self.submit_s)
        answer = super().submit(body, timeout_s=timeout_s)
        return {**answer, "reward": self.reward}


class TimedBackend(FakeBackend):
    """koboldcpp whose generations take ``gen_s`` (fake clock)."""

    def __init__(self, clock: FakeClock, gen_s: float) -> None:
        super().__init__()
        self.clock = clock
        self.gen_s = gen_s

    def generate(self, payload: dict[str, Any], **kwargs: Any) -> Any:
        self.clock.advance(self.gen_s)
        return super().generate(payload, **kwargs)

    def chat_completion(self, body: Any, **kwargs: Any) -> Any:
        self.clock.advance(self.gen_s)
        return super().chat_completion(body, **kwargs)


def serve(
    pops: list[Any], *, pop_s: float = 0.0, submit_s: float = 0.0, gen_s: float = 0.0,
    reward: float = 12.5, progress_s: float = 0.0,
) -> Worker:
    clock = FakeClock()
    settings = WorkerSettings(
        api_key=KEY, worker_name="console-worker", model_id=MODEL, backend_max_context_length=4096
    )
    worker = Worker(
        settings,
        horde=TimedHorde(
            clock, pops, pop_s=pop_s, submit_s=submit_s, reward=reward, progress_s=progress_s
        ),
        backend=TimedBackend(clock, gen_s),
        manners=FakeManners(),
        state=WorkerState(settings, stop_event=FakeStopEvent(clock), clock=clock),
    )
    for _ in pops:
        worker.run_once()
    return worker


def submitted_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if r.name.startswith("koboldcpp_horde_chat") and " submitted: " in r.getMessage()
    ]


# --- the totals in koboldcpp's shape ---------------------------------------------------------


def test_the_job_line_carries_koboldcpps_totals_line_and_the_faults_after_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    serve([text_pop("t1"), chat_pop("c2")], reward=8.7)
    first, second = submitted_lines(caplog)
    for line, jobs, total in ((first, "1", "9"), (second, "2", "17")):
        match = KCPP_TOTALS.search(line)
        assert match is not None, line
        assert (match["jobs"], match["total"]) == (jobs, total)
        assert line[match.end():] == " Faults:0"  # this worker's faults, after the bracket
    assert KCPP_TOTALS.search(second)["cost"] == "8.70"  # type: ignore[index]


def test_the_kudos_a_job_earned_are_shown_with_two_decimals(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    serve([text_pop("t1")], reward=8.7)
    (line,) = submitted_lines(caplog)
    assert ", 8.70 kudos | [Total:" in line


# --- the job's time: generation apart from the Horde's waits ---------------------------------


def test_the_job_line_splits_the_generation_from_the_waits_on_the_horde(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 1.2 s generation behind a pop answered in 0.3 s and a submit the Horde
    answered after 30.5 s: the line says where the 32 s went."""
    caplog.set_level(logging.INFO)
    serve([text_pop("t1")], pop_s=0.3, submit_s=30.5, gen_s=1.2)
    (line,) = submitted_lines(caplog)
    assert "submitted: tokens=5, 32.0 s (gen 1.2 s, horde 30.8 s), 12.50 kudos" in line


def test_a_quick_horde_shows_as_a_short_horde_wait(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    serve([chat_pop("c1")], pop_s=0.1, submit_s=0.2, gen_s=4.0)
    (line,) = submitted_lines(caplog)
    assert "4.3 s (gen 4.0 s, horde 0.3 s)" in line


def test_progress_posts_count_as_waits_on_the_horde_not_as_generation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A streamed job whose progress post the Horde answers after 3 s: koboldcpp had
    finished meanwhile, so the 3 s are the Horde's."""
    caplog.set_level(logging.INFO)
    serve([chat_pop("s1", stream_progress=True)], progress_s=3.0)
    (line,) = submitted_lines(caplog)
    assert "(gen 0.0 s, horde 3.0 s)" in line
