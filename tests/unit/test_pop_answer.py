"""A pop's answer is read once, where it arrives, into a typed value
(``horde.pop.read_pop``); the loop, the pop sent ahead and the driver take that value."""

from __future__ import annotations

from typing import Any

import pytest

from bench.harness.fakes import FakeBackend, FakeClock, FakeHorde, FakeStopEvent
from koboldcpp_horde_chat.horde import pop as pop_module
from koboldcpp_horde_chat.horde.pop import ChatJob, PopAnswer, TextJob, read_pop
from koboldcpp_horde_chat.service.loop import Worker
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.life import Phase
from koboldcpp_horde_chat.state.shared import WorkerState
from tests import pops

MODEL = "koboldcpp/fake"


def test_a_chat_answer_is_read_into_its_job() -> None:
    raw = pops.chat_pop("j1", MODEL, messages=[{"role": "user", "content": "Hi"}])
    raw["ttl"] = 90
    raw["messages"] = ["a moderator's word"]
    answer = read_pop(raw, default_ttl_s=150.0)
    assert answer.id == "j1" and answer.chat and answer.ttl_s == 90.0
    assert isinstance(answer.job, ChatJob) and answer.job.id == "j1"
    assert answer.error is None and answer.messages == ["a moderator's word"]


def test_a_text_answer_and_an_empty_one() -> None:
    text = read_pop(pops.text_pop("t1", MODEL, prompt="Once"), default_ttl_s=150.0)
    assert text.id == "t1" and not text.chat and isinstance(text.job, TextJob)
    empty = read_pop({"id": None, "skipped": {"models": 2}}, default_ttl_s=150.0)
    assert empty.id is None and empty.job is None and empty.error is None
    assert empty.skipped == {"models": 2} and empty.ttl_s == 150.0


def test_a_malformed_answer_keeps_its_id_and_says_where() -> None:
    bad = read_pop({"id": "j2", "chat": True, "payload": {"messages": 3}}, default_ttl_s=150.0)
    assert bad.id == "j2" and bad.chat and bad.job is None
    assert bad.error is not None and bad.error.path == "payload.messages"
    no_id = read_pop({"id": 7, "payload": {}}, default_ttl_s=150.0)
    assert no_id.id is None and no_id.error is not None and no_id.error.path == "id"
    not_an_object = read_pop([], default_ttl_s=150.0)  # type: ignore[arg-type]
    assert not_an_object.id is None and not_an_object.error is not None


def _worker(horde: FakeHorde, clock: FakeClock) -> Worker:
    options = WorkerSettings(api_key="answer-key-3c9d1e", worker_name="answer", model_id=MODEL,
                             backend_max_context_length=4096, max_length=512)
    return Worker(
        options,
        horde=horde,
        backend=FakeBackend(),
        state=WorkerState(options, stop_event=FakeStopEvent(clock), clock=clock),
        pop_horde=horde,
    )


def test_each_pop_answer_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's own pop and the pop beside the submit: one parse per answer."""
    parsed: list[Any] = []
    parse = pop_module.parse_pop

    def counting_parse(pop: dict[str, Any], **kwargs: Any) -> Any:
        parsed.append(pop.get("id"))
        return parse(pop, **kwargs)

    monkeypatch.setattr(pop_module, "parse_pop", counting_parse)
    clock = FakeClock()
    chat = [{"role": "user", "content": "Name one colour."}]
    horde = FakeHorde(clock, pops=[pops.chat_pop("j1", MODEL, messages=chat),
                                   pops.text_pop("j2", MODEL, prompt="Once")])
    worker = _worker(horde, clock)
    worker.run_once()  # j1 served; j2 popped beside its submit
    ahead = worker.next_pop.ahead
    assert ahead is not None and ahead.join(5.0) and ahead.ctx is not None
    worker.run_once()  # j2 served from the answer the pop ahead read
    assert horde.verdicts() == {"j1": "submitted", "j2": "submitted"}
    assert parsed[:2] == ["j1", "j2"] and parsed.count("j1") == 1 and parsed.count("j2") == 1


def test_the_driver_takes_the_typed_answer() -> None:
    clock = FakeClock()
    horde = FakeHorde(clock)
    worker = _worker(horde, clock)
    body = worker.state.pop_body(worker.caps)
    answer = read_pop(pops.text_pop("t9", MODEL, prompt="Once"), default_ttl_s=60.0)
    assert isinstance(answer, PopAnswer)
    ctx = worker.driver.take_in_hand(body, answer, clock.monotonic())
    assert ctx is not None and ctx.id == "t9" and ctx.kind == "text"
    assert ctx.phase is Phase.JOURNALED
    assert ctx.lease.deadline - ctx.lease.popped_at == 150.0  # the pop's ttl
    served = worker.driver.open(ctx, answer)
    assert served.job is answer.job and not served.ended
    assert worker.driver.take_in_hand(body, read_pop({"id": ""}), clock.monotonic()) is None
