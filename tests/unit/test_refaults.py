"""Requests faulted lately, known by their payload when the Horde hands them back."""

from __future__ import annotations

from typing import Any

from koboldcpp_horde_chat.state.refaults import (
    FAULTS_BEFORE_HOLDING,
    WINDOW_S,
    RequestFaults,
    request_digest,
)


def pop(job_id: str, **payload: Any) -> dict[str, Any]:
    body = {"prompt": "Once", "max_length": 32, **payload}
    return {"id": job_id, "ids": [job_id], "payload": body, "model": "m", "ttl": 150}


def test_a_request_is_known_by_its_payload_not_its_job_id() -> None:
    assert request_digest(pop("a")) == request_digest(pop("b"))
    assert request_digest(pop("a")) != request_digest(pop("a", prompt="Twice"))
    chat = {**pop("a"), "chat": True}
    assert request_digest(chat) != request_digest(pop("a"))


def test_a_signed_url_that_changes_at_each_pop_names_the_same_request() -> None:
    first = pop("a", messages_url="http://127.0.0.1:9/o/k1?exp=1&sig=aa")
    second = pop("b", messages_url="http://127.0.0.1:9/o/k1?exp=2&sig=bb")
    other = pop("c", messages_url="http://127.0.0.1:9/o/k2?exp=2&sig=bb")
    assert request_digest(first) == request_digest(second) != request_digest(other)


def test_a_payload_json_cannot_hold_still_has_a_digest() -> None:
    assert len(request_digest({"payload": {"x": object(), 1: float("nan")}})) == 64
    assert len(request_digest({})) == 64


def test_a_request_faulted_twice_within_the_window_is_held_back() -> None:
    faults = RequestFaults()
    d = request_digest(pop("a"))
    assert not faults.hold(d, 0.0)
    faults.faulted(d, 0.0)
    assert not faults.hold(d, 1.0)
    faults.faulted(d, 1.0)
    assert FAULTS_BEFORE_HOLDING == 2 and faults.hold(d, 2.0)
    assert not faults.hold(request_digest(pop("b", prompt="other")), 2.0)
    assert faults.hold(d, 0.0 + WINDOW_S) and not faults.hold(d, 1.0 + WINDOW_S + 0.1)


def test_the_memory_is_bounded() -> None:
    faults = RequestFaults(max_requests=3)
    for i in range(10):
        for _ in range(5):
            faults.faulted(f"r{i}", float(i))
    assert len(faults._faults) == 3
    assert all(len(times) <= FAULTS_BEFORE_HOLDING for times in faults._faults.values())
    assert faults.hold("r9", 10.0) and not faults.hold("r0", 10.0)


def test_a_request_generated_once_is_forgotten_and_the_last_fault_says_whose() -> None:
    faults = RequestFaults()
    faults.faulted("r", 0.0, backend_failed=True)
    faults.faulted("r", 1.0)
    assert faults.hold("r", 2.0) and not faults.backend_failed("r")
    faults.faulted("r", 2.0, backend_failed=True)
    assert faults.backend_failed("r")
    faults.served("r")
    assert not faults.hold("r", 3.0) and not faults.backend_failed("r")
