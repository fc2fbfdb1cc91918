"""What docs/protocol.md's "What it declares" says of strict requests: the worker declares
no structured_output_enforced or tool_choice_enforced guarantee, so a strict request
that needs one never reaches it, and the same request with best_effort does (seed 000
"Features and guarantees", "Worked example: koboldcpp's embedded worker")."""

from __future__ import annotations

import time
from typing import Any

from koboldcpp_horde_chat.devkit.horde import DevHorde

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NEEDS_A_GUARANTEE = {
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "cat", "schema": {"type": "object", "properties": {"name": {"type": "string"}}}},
        }
    },
    "tool_choice required": {"tools": [WEATHER], "tool_choice": "required"},
    "tool_choice named": {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
}


def test_strict_requests_that_need_an_enforced_guarantee_never_reach_the_worker(
    horde: DevHorde, start_worker: Any
) -> None:
    def body(extra: dict[str, Any]) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": "Paris?"}], "max_tokens": 64, **extra}

    strict = {name: horde.send_chat(body(extra)) for name, extra in NEEDS_A_GUARANTEE.items()}
    best_effort = {name: horde.send_chat(body(extra), best_effort=True) for name, extra in NEEDS_A_GUARANTEE.items()}
    plain_strict = horde.send_chat(body({}))  # needs only prompt_overflow_refused, which is declared
    worker = start_worker()
    try:
        assert horde.wait([*best_effort.values(), plain_strict], timeout_s=30)
        popped = len(horde.pops)
        deadline = time.monotonic() + 10
        while len(horde.pops) < popped + 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # a few more pops, each passing the strict requests over
    finally:
        worker.stop()
    assert len(horde.pops) >= popped + 3
    features = horde.pops[-1]["body"]["chat_features"]
    assert "prompt_overflow_refused" in features
    assert "structured_output_enforced" not in features and "tool_choice_enforced" not in features
    for name, rid in best_effort.items():
        assert horde.status(rid)["done"] and not horde.status(rid)["faulted"], name
    assert horde.status(plain_strict)["done"]
    for name, rid in strict.items():
        assert horde.status(rid)["state"] == "waiting", name
        assert horde.status(rid)["job_ids"] == [], name
