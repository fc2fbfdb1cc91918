"""Real chat requests written by people (Berkeley Function Calling Leaderboard,
``tests/data/bfcl``) through the real worker: each ends in exactly one terminal
action that the dev Horde accepts."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp
from tests.samples import BFCL


def load_requests() -> list[dict[str, Any]]:
    with BFCL.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_the_bfcl_sample_is_what_its_readme_says() -> None:
    records = load_requests()
    assert len(records) == 320
    assert Counter(r["category"] == "plain_chat" for r in records) == {False: 300, True: 20}


@pytest.mark.parametrize("kcpp", [{"max_context_length": 16384}], indirect=True)
def test_every_bfcl_request_ends_in_one_accepted_terminal_action(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, start_worker: Any
) -> None:
    records = load_requests()
    ids: dict[str, dict[str, Any]] = {}
    for record in records:
        body: dict[str, Any] = {"messages": record["messages"], "max_tokens": 256}
        if "tools" in record:
            body["tools"] = record["tools"]
            body["tool_choice"] = record["tool_choice"]
        ids[horde.send_chat(body, max_attempts=1)] = record
    worker = start_worker("--log-level", "WARNING")
    try:
        assert horde.wait(list(ids), timeout_s=120)
    finally:
        worker.stop()

    ledger = horde.ledger
    refused = [e for e in ledger if e["action"] == "refused"]
    assert refused == [], refused[:3]
    by_request: dict[str, list[dict[str, Any]]] = {}
    for entry in ledger:
        by_request.setdefault(entry["request_id"], []).append(entry)
    assert set(by_request) == set(ids)
    outcomes: Counter[str] = Counter()
    for request_id, record in ids.items():
        (entry,) = by_request[request_id]
        assert entry["status"] == 200
        body = entry["body"]
        if entry["action"] == "faulted":
            # the only fault a well-formed request may meet here: it does not fit
            assert body.get("fault_reason") == "prompt_overflow", (record["id"], body)
            outcomes["prompt_overflow"] += 1
            continue
        assert entry["action"] == "submitted", (record["id"], entry)
        message = body["message"]
        calls = message.get("tool_calls") or []
        offered = {t["function"]["name"] for t in record.get("tools", [])}
        assert {c["function"]["name"] for c in calls} <= offered
        for call in calls:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
        if calls:
            assert body["finish_reason"] == "tool_calls" and message["content"] is None
        else:
            assert isinstance(message["content"], str)
        outcomes["tool_calls" if calls else "text"] += 1
    # the tool requests were served with calls, the plain chats with text
    assert outcomes["tool_calls"] >= 250 and outcomes["text"] >= 20, outcomes
    # tools reached koboldcpp unchanged
    sent_tools = [
        r["body"]["tools"] for r in kcpp.requests if r["path"] == "/v1/chat/completions" and "tools" in r["body"]
    ]
    offered_tools = [r["tools"] for r in records if "tools" in r]
    assert all(tools in offered_tools for tools in sent_tools)
