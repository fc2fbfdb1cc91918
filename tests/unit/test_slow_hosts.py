"""Hosts the lease fit must model, run for minutes and hours on a fake clock.

A koboldcpp on the fake clock (:class:`ModelHost`) takes ``process_s`` per
prompt token and ``1 / tokens_per_s`` per generated token, reports both in
``/api/extra/perf`` as koboldcpp does, and hangs on what ``hangs`` picks until
the request's read timeout. The Horde (:class:`MatchingHorde`) always has
requests waiting and gives the worker the next one its declaration admits
(``max_length`` and ``max_context_length`` of its kind), as the Horde's
``can_generate`` does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pytest

from bench.harness.fakes import FakeBackend, FakeClock, FakeHorde, FakeStopEvent
from koboldcpp_horde_chat.errors import BackendError
from koboldcpp_horde_chat.service.loop import Worker
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.shared import WorkerState
from tests import pops

from .test_loop_decisions import KEY, MODEL

HOUR_S = 3600.0


class ModelHost(FakeBackend):
    """koboldcpp on the fake clock (see the module docstring). A token is a word."""

    def __init__(
        self,
        clock: FakeClock,
        *,
        process_s: float,
        tokens_per_s: float,
        hangs: Callable[[str, dict[str, Any]], bool] = lambda kind, body: False,
    ) -> None:
        super().__init__()
        self.clock = clock
        self.process_s = process_s
        self.tokens_per_s = tokens_per_s
        self.hangs = hangs
        self.gens = 0
        self.last = (0, 0.0, 0, 0.0)
        self.timeouts = 0

    def _serve(
        self, kind: str, body: dict[str, Any], prompt_tokens: int, max_length: int,
        timeout_s: float,
    ) -> None:
        need = prompt_tokens * self.process_s + max_length / self.tokens_per_s
        if self.hangs(kind, body) or need > timeout_s:
            self.clock.advance(timeout_s)
            self.timeouts += 1
            raise BackendError("read timed out", status=0)
        self.clock.advance(need)
        self.gens += 1
        self.last = (
            prompt_tokens, prompt_tokens * self.process_s,
            max_length, max_length / self.tokens_per_s,
        )

    def generate(
        self, payload: dict[str, Any], *, timeout_s: float, cancel: Any = None
    ) -> Any:
        self._count("generate", timeout_s)
        length = int(payload.get("max_length") or 0)
        prompt = len(str(payload.get("prompt") or "").split())
        prompt = min(prompt, int(payload.get("max_context_length") or prompt) - length)
        self._serve("text", payload, prompt, length, timeout_s)
        return {"results": [{
            "text": "abcd" * length, "finish_reason": "length",
            "prompt_tokens": prompt, "completion_tokens": length,
        }]}

    def chat_completion(self, body: Any, *, timeout_s: float, cancel: Any = None) -> Any:
        self._count("chat", timeout_s)
        request = json.loads(body) if isinstance(body, (bytes, bytearray)) else body
        length = int(request.get("max_tokens") or 0)
        prompt = 16 + sum(len(str(m.get("content")).split()) for m in request["messages"])
        self._serve("chat", request, prompt, length, timeout_s)
        return {
            "choices": [{
                "index": 0, "finish_reason": "length",
                "message": {"role": "assistant", "content": "abcd " * length},
            }],
            "usage": {"prompt_tokens": prompt, "completion_tokens": length},
        }

    def perf(self, *, timeout_s: float = 10.0) -> dict[str, Any]:
        prompt, process, tokens, evaluated = self.last
        return {
            "idle": 1, "queue": 0, "idletime": 1000.0, "total_gens": self.gens,
            "last_input_count": prompt, "last_process_time": process,
            "last_token_count": tokens, "last_eval_time": evaluated,
            "last_eval_speed": self.tokens_per_s if self.gens else 0,
        }


Request = Callable[[str], dict[str, Any]]


class MatchingHorde(FakeHorde):
    """A Horde that always has ``requests`` waiting (made fresh for each pop) and
    gives each pop the first, in turn, that the pop's declaration admits."""

    def __init__(self, clock: FakeClock, requests: dict[str, Request]) -> None:
        super().__init__(clock)
        self.requests = requests
        self.turn = 0
        self.given: dict[str, str] = {}  # job id -> request name
        self.served_at: dict[str, float] = {}

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        names = list(self.requests)
        names = names[self.turn % len(names):] + names[: self.turn % len(names)]
        self.turn += 1
        skipped: dict[str, int] = {}
        for name in names:
            job_id = f"{name}-{self.pop_calls}"
            pop = self.requests[name](job_id)
            if (reason := self._refuses(body, pop)) is None:
                self.pops.append(pop)
                self.given[job_id] = name
                break
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            self.pops.append({"id": None, "ids": [], "skipped": skipped})
        return super().pop(body, timeout_s=timeout_s)

    @staticmethod
    def _refuses(body: dict[str, Any], pop: dict[str, Any]) -> str | None:
        payload = pop["payload"]
        if pop.get("chat"):
            if body.get("chat_jobs") is not True:
                return "chat"
            limits = body["chat_limits"]
        else:
            if body.get("prompt_jobs") is False:
                return "text"
            limits = body
        if payload["max_length"] > limits["max_length"]:
            return "max_length"
        if payload["max_context_length"] > limits["max_context_length"]:
            return "max_context_length"
        return None

    def outcomes(self, name: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for job_id, verdict in self.verdicts().items():
            if self.given.get(job_id) == name:
                counts[verdict] = counts.get(verdict, 0) + 1
        return counts


def _worker(
    clock: FakeClock, horde: FakeHorde, host: ModelHost, **options: Any
) -> Worker:
    settings = WorkerSettings(
        api_key=KEY,
        worker_name="slow-host",
        model_id=MODEL,
        backend_max_context_length=4096,
        max_length=512,
        **options,
    )
    return Worker(
        settings, horde=horde, backend=host,
        state=WorkerState(settings, stop_event=FakeStopEvent(clock), clock=clock),
    )


def _run_for(worker: Worker, clock: FakeClock, seconds: float) -> None:
    end = clock() + seconds
    while clock() < end:
        worker.run_once()


def _text(words: int, *, max_length: int, context: int) -> Request:
    def make(job_id: str) -> dict[str, Any]:
        pop = pops.text_pop(job_id, MODEL, prompt="abc " * words)
        pop["payload"].update(max_length=max_length, max_context_length=context)
        return pop
    return make


# --- (a) slow only for long prompts ---------------------------------------------------


def test_a_host_slow_only_for_long_prompts_keeps_serving_short_requests_and_loses_few_long_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """20 prompt tokens/s, 20 generated tokens/s, a 150 s lease: a 3,000-token
    prompt with 200 to generate takes 160 s and runs out; a 100-token one takes
    15 s. Before, each long prompt that ran out halved max_length (512, 256,
    128...), the short requests (200 tokens) were skipped with the long ones, and
    every re-measure with a four-word prompt raised it back to let the next long
    prompt run out: 13 long prompts lost and 13 short requests served in the
    hour. Now the first run-out (or the measured processing speed) narrows the
    declared context to what processes in time: long prompts are no longer
    sent, short ones go on (1 long prompt lost, 231 short requests served)."""
    caplog.set_level(logging.INFO)
    clock = FakeClock()
    host = ModelHost(clock, process_s=0.05, tokens_per_s=20.0)
    horde = MatchingHorde(clock, {
        "long": _text(3000, max_length=200, context=4096),
        "short": _text(100, max_length=200, context=1024),
    })
    worker = _worker(clock, horde, host)
    _run_for(worker, clock, HOUR_S)
    long, short = horde.outcomes("long"), horde.outcomes("short")
    lost = sum(n for verdict, n in long.items() if verdict != "submitted")
    assert lost <= 2, long
    assert short.get("submitted", 0) >= 150, short  # about one each 15 s, for an hour
    assert set(short) == {"submitted"}, short
    body = horde.pop_bodies[-1]
    # It settles on the whole max_length and the context that processes in time:
    # (120 s - 0) / 0.05 s per prompt token = 2,400, by 64: 2,368.
    assert (body["max_length"], body["max_context_length"]) == (512, 2368)
    assert "max_length for text jobs lowered" not in caplog.text


def test_the_real_hosts_figures_keep_the_declared_limits() -> None:
    """46 s per 2,400 prompt tokens and 27 tokens/s (koboldcpp 1.116.1, one CPU
    thread, SmolLM2-135M) in a 150 s lease: the worst job the declaration admits
    (3,584 prompt tokens, 512 generated) takes 88 s of the 120 s budget."""
    clock = FakeClock()
    host = ModelHost(clock, process_s=46.0 / 2400, tokens_per_s=27.0)
    horde = MatchingHorde(clock, {
        "long": _text(2400, max_length=512, context=4096),
        "short": _text(100, max_length=200, context=1024),
    })
    worker = _worker(clock, horde, host)
    _run_for(worker, clock, 600.0)
    assert set(horde.outcomes("long")) == {"submitted"}
    body = horde.pop_bodies[-1]
    assert (body["max_length"], body["max_context_length"]) == (512, 4096)


# --- (b) hangs on real jobs, answers a probe ---------------------------------------------


def _chat_with_system(job_id: str) -> dict[str, Any]:
    pop = pops.chat_pop(
        job_id, MODEL,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name one colour."},
        ],
        max_length=16, max_context_length=2048,
    )
    pop["ttl"] = 15
    return pop


def test_a_host_hanging_on_real_chat_jobs_while_answering_probes_loses_few_chat_jobs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """koboldcpp hangs on every chat request the Horde sends (they carry a system
    message) and answers the worker's probe at once; the Horde's leases are 15 s.
    Before, every three failures the probe re-declared chat within 10 s: 15
    chat jobs lost in the first 5 minutes (until the count of aborted jobs
    withdrew chat). Now: 5 in 5 minutes, 8 in the hour. Now the first probe comes a minute after the
    withdrawal, a probe that generates declares chat on probation (one more
    failure withdraws it), and each withdrawal waits twice as long as the last."""
    caplog.set_level(logging.INFO)
    clock = FakeClock()
    host = ModelHost(
        clock, process_s=0.001, tokens_per_s=100.0,
        hangs=lambda kind, body: kind == "chat" and any(
            m.get("role") == "system" for m in body["messages"]
        ),
    )
    horde = MatchingHorde(clock, {"chat": _chat_with_system})
    worker = _worker(clock, horde, host)
    _run_for(worker, clock, 300.0)
    lost = sum(n for verdict, n in horde.outcomes("chat").items() if verdict != "submitted")
    assert 3 <= lost <= 6, horde.outcomes("chat")
    assert worker.state.lease_fit.declared("chat") == 512  # a hang is not slowness
    assert "max_length for chat jobs lowered" not in caplog.text
    _run_for(worker, clock, HOUR_S - 300.0)
    lost = sum(n for verdict, n in horde.outcomes("chat").items() if verdict != "submitted")
    assert lost <= 12, horde.outcomes("chat")  # a handful an hour, not hundreds
