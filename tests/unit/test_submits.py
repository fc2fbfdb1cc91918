"""Structured submits, faults and koboldcpp's answers (seed steps 6, 7, Submit refusals).

The koboldcpp bodies below were recorded from a real koboldcpp 1.116.1
(``kcpp-samples``: chat_nonstream, chat_tools_required, chat_tools_auto,
chat_json_schema, chat_smollm, v1_generate).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema  # type: ignore[import-untyped, unused-ignore]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from koboldcpp_horde_chat.errors import ReplyError
from koboldcpp_horde_chat.horde.codes import REFUSAL_RCS
from koboldcpp_horde_chat.koboldcpp.answers import (
    BackendReply,
    aborted_short,
    needs_stop_reason,
    parse_chat_completion,
    text_generation,
)
from koboldcpp_horde_chat.settings import kcpp_effective_max_length
from koboldcpp_horde_chat.translate.submits import (
    FAULT_PROMPT_OVERFLOW,
    FAULT_REPLY_REFUSED,
    FINISH_REASONS,
    chat_submit,
    job_fault_submit,
    map_finish_reason,
    normalise_tool_calls,
    strip_nul,
    strip_nul_json,
    text_submit,
)

CHAT_NONSTREAM = json.loads(
    '{"id": "chatcmpl-A343157", "object": "chat.completion", "created": 1795991068, "model": "koboldcpp/gemma-3-270m-q4_k_m", "usage": {"prompt_tokens": 28, "completion_tokens": 9, "total_tokens": 37}, "choices": [{"index": 0, "message": {"role": "assistant", "content": "Cats are fascinating animals.\\n", "tool_calls": []}, "finish_reason": "length", "logprobs": null}]}'
)
CHAT_TOOLS_REQUIRED = json.loads(
    '{"id": "chatcmpl-A415571", "object": "chat.completion", "created": 1795991078, "model": "koboldcpp/gemma-3-270m-q4_k_m", "usage": {"prompt_tokens": 243, "completion_tokens": 56, "total_tokens": 299}, "choices": [{"index": 0, "message": {"role": "assistant", "content": "", "tool_calls": [{"id": "call_48866", "type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"string\\"}"}}]}, "finish_reason": "tool_calls", "logprobs": null}]}'
)
CHAT_TOOLS_AUTO = json.loads(
    '{"id": "chatcmpl-A457931", "object": "chat.completion", "created": 1795991076, "model": "koboldcpp/gemma-3-270m-q4_k_m", "usage": {"prompt_tokens": 74, "completion_tokens": 13, "total_tokens": 87}, "choices": [{"index": 0, "message": {"role": "assistant", "content": "The weather in Paris right now is sunny.\\n", "tool_calls": []}, "finish_reason": "length", "logprobs": null}]}'
)
CHAT_JSON_SCHEMA = json.loads(
    '{"id": "chatcmpl-A760676", "object": "chat.completion", "created": 1795991083, "model": "koboldcpp/gemma-3-270m-q4_k_m", "usage": {"prompt_tokens": 15, "completion_tokens": 34, "total_tokens": 49}, "choices": [{"index": 0, "message": {"role": "assistant", "content": "{\\n    \\"name\\": \\"cat\\",\\n    \\"age\\": 1000000000000000\\n}", "tool_calls": []}, "finish_reason": "stop", "logprobs": null}]}'
)
CHAT_SMOLLM = json.loads(
    '{"id": "chatcmpl-A868771", "object": "chat.completion", "created": 1795994607, "model": "koboldcpp/SmolLM2-135M-Instruct.Q4_1", "usage": {"prompt_tokens": 25, "completion_tokens": 15, "total_tokens": 40}, "choices": [{"index": 0, "message": {"role": "assistant", "content": "Me, I\'m not sure. I\'m a terse assistant.", "tool_calls": []}, "finish_reason": "stop", "logprobs": null}]}'
)
V1_GENERATE = json.loads(
    '{"results": [{"text": " the capital city, but you can take a day trip to Paris and enjoy both culture and nature in one day.\\n\\nParis is an important place in Europe for many reasons. It has a unique history and architecture that\\u2019s beautiful to see", "tool_calls": [], "finish_reason": "length", "logprobs": null, "prompt_tokens": 6, "completion_tokens": 48}]}'
)

TOOL_CALL_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string", "minLength": 1},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string", "minLength": 1},
                           "arguments": {"type": "string"}},
        },
    },
}
COUNT = {"type": "integer", "minimum": 0, "maximum": 10_000_000}
# What the Horde accepts as a structured submit (seed: "6. Submit the reply", "Submit refusals").
SUBMIT_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "message", "finish_reason", "model_id", "state"],
    "properties": {
        "id": {"type": "string"},
        "model_id": {"type": "string"},
        "state": {"const": "ok"},
        "finish_reason": {"enum": ["stop", "length", "content_filter", "tool_calls"]},
        "native_finish_reason": {"type": "string", "maxLength": 32},
        "prompt_tokens": COUNT,
        "completion_tokens": COUNT,
        "message": {
            "type": "object",
            "additionalProperties": False,
            "required": ["role", "content"],
            "properties": {
                "role": {"const": "assistant"},
                "content": {"type": ["string", "null"]},
                "reasoning_content": {"type": "string", "minLength": 1},
                "tool_calls": {"type": "array", "minItems": 1, "items": TOOL_CALL_SCHEMA},
            },
            "if": {"properties": {"content": {"type": "null"}}},
            "then": {"required": ["tool_calls"]},
        },
    },
    "if": {"properties": {"finish_reason": {"const": "tool_calls"}}},
    "then": {"properties": {"message": {"required": ["tool_calls"]}}},
}


def assert_valid_submit(body: dict[str, Any]) -> None:
    jsonschema.validate(body, SUBMIT_SCHEMA)
    assert "generation" not in body
    reasoning = body["message"].get("reasoning_content", "")
    assert len(reasoning.encode("utf-8")) <= 1024 * 1024
    ids = [call["id"] for call in body["message"].get("tool_calls", [])]
    assert len(ids) == len(set(ids))


def submit_of(sample: dict[str, Any], *, max_length: int) -> dict[str, Any]:
    body = chat_submit("<job-id>", "<model-name>", parse_chat_completion(sample),
                       max_length=max_length)
    assert_valid_submit(body)
    return body


# --- the seed's bodies -------------------------------------------------------------------


def test_the_seeds_submit_shape() -> None:
    reply = BackendReply(content="Blue.", native_finish_reason="stop",
                         prompt_tokens=21, completion_tokens=3)
    body = chat_submit("<job-id>", "<model-name>", reply, max_length=512)
    assert body == {
        "id": "<job-id>",
        "message": {"role": "assistant", "content": "Blue."},
        "finish_reason": "stop",
        "native_finish_reason": "stop",
        "prompt_tokens": 21,
        "completion_tokens": 3,
        "model_id": "<model-name>",
        "state": "ok",
    }
    assert_valid_submit(body)


def test_the_seeds_fault_bodies() -> None:
    assert job_fault_submit("<job-id>", "chat", "<model-name>", FAULT_PROMPT_OVERFLOW) == {
        "id": "<job-id>",
        "state": "faulted",
        "model_id": "<model-name>",
        "fault_reason": "prompt_overflow",
    }
    assert job_fault_submit("<job-id>", "chat", "<model-name>") == {
        "id": "<job-id>",
        "state": "faulted",
        "model_id": "<model-name>",
    }
    assert job_fault_submit("j", "chat", "m", FAULT_REPLY_REFUSED)["fault_reason"] == "reply_refused"


def test_constants() -> None:
    assert FINISH_REASONS == {"stop", "length", "content_filter", "tool_calls"}
    assert REFUSAL_RCS == {"ChatSubmitInvalid", "ChatSubmitNonconformant", "ChatModelMismatch"}


# --- recorded koboldcpp answers ------------------------------------------------------------


def test_smollm_reply_is_submitted_as_stop_with_its_counts() -> None:
    assert submit_of(CHAT_SMOLLM, max_length=32) == {
        "id": "<job-id>",
        "message": {"role": "assistant", "content": "Me, I'm not sure. I'm a terse assistant."},
        "finish_reason": "stop",
        "native_finish_reason": "stop",
        "prompt_tokens": 25,
        "completion_tokens": 15,
        "model_id": "<model-name>",
        "state": "ok",
    }


def test_koboldcpps_length_for_a_stop_sequence_is_reported_as_stop() -> None:
    # 9 tokens of a 64-token budget: koboldcpp hit a stop sequence and still said "length".
    body = submit_of(CHAT_NONSTREAM, max_length=64)
    assert body["finish_reason"] == "stop"
    assert body["native_finish_reason"] == "length"
    assert body["message"]["content"] == "Cats are fascinating animals.\n"
    assert (body["prompt_tokens"], body["completion_tokens"]) == (28, 9)


def test_length_at_the_budget_stays_length() -> None:
    assert submit_of(CHAT_NONSTREAM, max_length=9)["finish_reason"] == "length"


def test_a_tool_call_reply_has_null_content_and_the_backends_call() -> None:
    body = submit_of(CHAT_TOOLS_REQUIRED, max_length=128)
    assert body["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_48866", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "string"}'}}],
    }
    assert body["finish_reason"] == "tool_calls"
    assert (body["prompt_tokens"], body["completion_tokens"]) == (243, 56)


def test_an_auto_tool_reply_without_calls_is_text() -> None:
    body = submit_of(CHAT_TOOLS_AUTO, max_length=128)
    assert body["message"] == {"role": "assistant",
                               "content": "The weather in Paris right now is sunny.\n"}
    assert body["finish_reason"] == "stop"


def test_a_json_schema_reply_is_submitted_unchanged() -> None:
    body = submit_of(CHAT_JSON_SCHEMA, max_length=128)
    assert json.loads(body["message"]["content"]) == {"name": "cat", "age": 1000000000000000}
    assert body["finish_reason"] == "stop"


def test_parse_keeps_what_koboldcpp_sent() -> None:
    reply = parse_chat_completion(CHAT_TOOLS_REQUIRED)
    assert reply == BackendReply(
        content="",
        reasoning_content=None,
        tool_calls=CHAT_TOOLS_REQUIRED["choices"][0]["message"]["tool_calls"],
        native_finish_reason="tool_calls",
        prompt_tokens=243,
        completion_tokens=56,
    )


def test_parse_reads_reasoning_content() -> None:
    body = json.loads(json.dumps(CHAT_SMOLLM))
    body["choices"][0]["message"]["reasoning_content"] = "Pick a colour."
    reply = parse_chat_completion(body)
    assert reply.reasoning_content == "Pick a colour."
    submit = chat_submit("j", "m", reply, max_length=32)
    assert submit["message"]["reasoning_content"] == "Pick a colour."


def test_missing_usage_leaves_the_counts_out() -> None:
    body = json.loads(json.dumps(CHAT_SMOLLM))
    del body["usage"]
    reply = parse_chat_completion(body)
    assert reply.prompt_tokens is None and reply.completion_tokens is None
    submit = chat_submit("j", "m", reply, max_length=32)
    assert "prompt_tokens" not in submit and "completion_tokens" not in submit


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {},
        {"choices": []},
        {"choices": ["x"]},
        {"choices": [{"finish_reason": "stop"}]},
        {"choices": [{"message": {"content": 5}, "finish_reason": "stop"}]},
        {"choices": [{"message": {"content": "a", "tool_calls": {}}, "finish_reason": "stop"}]},
        {"choices": [{"message": {"content": "a", "reasoning_content": 1}}]},
        {"choices": [{"message": {"content": "a"}, "finish_reason": 1}]},
    ],
)
def test_a_malformed_completion_is_a_reply_error(body: object) -> None:
    with pytest.raises(ReplyError):
        parse_chat_completion(body)


# --- finish reasons ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("native", "calls", "tokens", "expected"),
    [
        ("stop", False, 3, "stop"),
        ("stop", True, 3, "stop"),
        ("length", False, 512, "length"),
        ("length", False, 600, "length"),
        ("length", False, None, "length"),
        ("length", False, 511, "stop"),
        ("length", True, 20, "stop"),
        ("tool_calls", True, 56, "tool_calls"),
        ("tool_calls", False, 56, "stop"),
        ("content_filter", False, 3, "content_filter"),
    ],
)
def test_map_finish_reason(native: str, calls: bool, tokens: int | None, expected: str) -> None:
    assert map_finish_reason(native, has_tool_calls=calls, completion_tokens=tokens,
                             max_length=512) == expected


@pytest.mark.parametrize("native", ["error", None, "eos_token", "function_call", "", "STOP"])
def test_other_finish_reasons_fault_the_job(native: str | None) -> None:
    with pytest.raises(ReplyError):
        map_finish_reason(native, has_tool_calls=False, completion_tokens=3, max_length=512)
    with pytest.raises(ReplyError):
        chat_submit("j", "m", BackendReply(content="x", native_finish_reason=native), max_length=9)


# --- tool calls ------------------------------------------------------------------------------


def test_tool_calls_are_normalised() -> None:
    raw = [
        {"index": 0, "id": "call_1", "function": {"name": "a", "arguments": {"x": 1}}},
        {"id": "", "type": "function", "function": {"name": "b"}},
        {"id": "call_1", "type": "function", "function": {"name": "c", "arguments": "{}"}},
        {"type": "function", "function": {"name": "d", "arguments": "[]"}},
    ]
    assert normalise_tool_calls(raw) == [
        {"id": "call_1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "b", "arguments": "{}"}},
        {"id": "call_1_2", "type": "function", "function": {"name": "c", "arguments": "{}"}},
        {"id": "call_4", "type": "function", "function": {"name": "d", "arguments": "[]"}},
    ]


def test_a_minted_id_never_takes_an_id_the_backend_gave_a_later_call() -> None:
    raw = [
        {"function": {"name": "a", "arguments": "{}"}},
        {"id": "call_1", "function": {"name": "b", "arguments": "{}"}},
    ]
    ids = [call["id"] for call in normalise_tool_calls(raw)]
    assert ids[1] == "call_1"
    assert len(set(ids)) == 2


def test_unique_ids_are_kept_as_the_backend_minted_them() -> None:
    raw = CHAT_TOOLS_REQUIRED["choices"][0]["message"]["tool_calls"]
    assert normalise_tool_calls(raw) == raw
    assert normalise_tool_calls(None) == []


@pytest.mark.parametrize(
    "raw",
    [
        {},
        ["x"],
        [{"type": "code", "function": {"name": "a"}}],
        [{"function": "a"}],
        [{"function": {"arguments": "{}"}}],
        [{"function": {"name": ""}}],
        [{"id": 5, "function": {"name": "a"}}],
    ],
)
def test_malformed_tool_calls_are_a_reply_error(raw: object) -> None:
    with pytest.raises(ReplyError):
        normalise_tool_calls(raw)


def test_calls_beside_text_keep_the_text() -> None:
    reply = BackendReply(content="Checking.", native_finish_reason="tool_calls",
                         tool_calls=[{"id": "c", "function": {"name": "f", "arguments": "{}"}}])
    body = chat_submit("j", "m", reply, max_length=64)
    assert body["message"]["content"] == "Checking."
    assert body["finish_reason"] == "tool_calls"


def test_a_forced_tool_choice_may_finish_with_stop_and_calls() -> None:
    reply = BackendReply(content="  ", native_finish_reason="stop",
                         tool_calls=[{"id": "c", "function": {"name": "f", "arguments": "{}"}}])
    body = chat_submit("j", "m", reply, max_length=64)
    assert body["finish_reason"] == "stop"
    assert body["message"]["content"] is None
    assert_valid_submit(body)


# --- content and reasoning ----------------------------------------------------------------------


def test_an_empty_reply_is_a_valid_reply() -> None:
    for content in ("", None):
        body = chat_submit("j", "m", BackendReply(content=content, native_finish_reason="stop"),
                           max_length=64)
        assert body["message"] == {"role": "assistant", "content": ""}
        assert_valid_submit(body)


def test_reasoning_left_in_the_content_is_split_off() -> None:
    reply = BackendReply(content="<think>Blue or red?</think>\n\nBlue.",
                         native_finish_reason="stop", completion_tokens=12)
    body = chat_submit("j", "m", reply, max_length=64)
    # the content keeps the whitespace after the block, as koboldcpp's own split does
    assert body["message"] == {"role": "assistant", "content": "\n\nBlue.",
                               "reasoning_content": "Blue or red?"}


def test_thinking_cut_off_by_max_length_is_submitted_as_reasoning() -> None:
    reply = BackendReply(content="<think>Blue or red? Let me weigh", native_finish_reason="length",
                         prompt_tokens=21, completion_tokens=512)
    body = chat_submit("j", "m", reply, max_length=512)
    assert body["message"] == {"role": "assistant", "content": "",
                               "reasoning_content": "Blue or red? Let me weigh"}
    assert body["finish_reason"] == "length"
    assert_valid_submit(body)


def test_reasoning_is_capped_at_one_mebibyte_on_a_character_boundary() -> None:
    reasoning = "é" * 600_000  # 1,200,000 bytes
    body = chat_submit("j", "m", BackendReply(content="Blue.", reasoning_content=reasoning,
                                              native_finish_reason="stop"), max_length=64)
    capped = body["message"]["reasoning_content"]
    assert len(capped.encode("utf-8")) == 1024 * 1024
    assert capped == "é" * (1024 * 1024 // 2)
    odd = "a" + "é" * 600_000
    capped = chat_submit("j", "m", BackendReply(content="x", reasoning_content=odd,
                                                native_finish_reason="stop"),
                         max_length=64)["message"]["reasoning_content"]
    assert len(capped.encode("utf-8")) == 1024 * 1024 - 1
    assert odd.startswith(capped)


def test_native_finish_reason_is_koboldcpps_reason() -> None:
    for native in ("stop", "length", "tool_calls"):
        reply = BackendReply(content="x", native_finish_reason=native,
                             tool_calls=[{"function": {"name": "f"}}])
        assert chat_submit("j", "m", reply, max_length=64)["native_finish_reason"] == native


@pytest.mark.parametrize(
    ("prompt_tokens", "completion_tokens", "expected"),
    [
        (0, 0, {"prompt_tokens": 0, "completion_tokens": 0}),
        (None, 3, {"completion_tokens": 3}),
        (21, None, {"prompt_tokens": 21}),
        (-1, 10_000_001, {}),
        (10_000_000, 3, {"prompt_tokens": 10_000_000, "completion_tokens": 3}),
    ],
)
def test_token_counts_are_sent_only_when_reported_and_in_range(
    prompt_tokens: int | None, completion_tokens: int | None, expected: dict[str, int]
) -> None:
    reply = BackendReply(content="x", native_finish_reason="stop",
                         prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    body = chat_submit("j", "m", reply, max_length=10**9)
    counts = {k: body[k] for k in ("prompt_tokens", "completion_tokens") if k in body}
    assert counts == expected


CALLS = st.lists(
    st.fixed_dictionaries(
        {"function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])},
                                           optional={"arguments": st.sampled_from(["{}", {"a": 1}, None])})},
        optional={"id": st.sampled_from(["call_1", "call_2", "call_1_2", "", None]),
                  "type": st.just("function")},
    ),
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(
    content=st.one_of(st.none(), st.text(max_size=30), st.sampled_from(["<think>a", "a</think>b"])),
    reasoning=st.one_of(st.none(), st.text(max_size=10)),
    calls=CALLS,
    native=st.sampled_from(["stop", "length", "tool_calls", "content_filter"]),
    completion_tokens=st.one_of(st.none(), st.integers(min_value=0, max_value=100)),
)
def test_every_reply_koboldcpp_can_give_makes_a_submit_the_horde_accepts(
    content: str | None,
    reasoning: str | None,
    calls: list[dict[str, Any]],
    native: str,
    completion_tokens: int | None,
) -> None:
    reply = BackendReply(content=content, reasoning_content=reasoning, tool_calls=calls,
                         native_finish_reason=native, prompt_tokens=7,
                         completion_tokens=completion_tokens)
    body = chat_submit("j", "m", reply, max_length=50)
    assert_valid_submit(body)
    assert len(body["message"].get("tool_calls", [])) == len(calls)


# --- text jobs ----------------------------------------------------------------------------------


def test_a_text_job_is_submitted_with_its_generation() -> None:
    text = text_generation(V1_GENERATE)
    assert text.startswith(" the capital city, but")
    assert text_submit("t1", text) == {"id": "t1", "generation": text, "state": "ok"}


@pytest.mark.parametrize("body", [None, {}, {"results": []}, {"results": ["x"]},
                                  {"results": [{"text": None}]}])
def test_a_malformed_generate_answer_is_a_reply_error(body: object) -> None:
    with pytest.raises(ReplyError):
        text_generation(body)


# --- U+0000 (the Horde refuses any submit holding it: 400 NulByteInPayload) -------------


def no_nul(body: dict[str, Any]) -> bool:
    """True when the body's JSON holds no U+0000, neither as a character nor escaped."""
    text = json.dumps(body)
    return "\\u0000" not in text.replace("\\\\", "") and "\x00" not in text


def test_a_nul_in_the_content_is_removed_before_the_submit() -> None:
    reply = BackendReply(content="Blue\u0000.", native_finish_reason="stop",
                         prompt_tokens=21, completion_tokens=3)
    body = chat_submit("j", "m", reply, max_length=64)
    assert body["message"] == {"role": "assistant", "content": "Blue."}
    assert no_nul(body)
    assert_valid_submit(body)


def test_a_nul_in_the_reasoning_is_removed_before_the_submit() -> None:
    reply = BackendReply(content="Four.", reasoning_content="2 and\u0000 2 make 4.\u0000",
                         native_finish_reason="stop")
    body = chat_submit("j", "m", reply, max_length=64)
    assert body["message"]["reasoning_content"] == "2 and 2 make 4."
    inline = chat_submit("j", "m", BackendReply(content="<think>Hm\u0000m</think>Four.",
                                                native_finish_reason="stop"), max_length=64)
    assert inline["message"] == {"role": "assistant", "content": "Four.",
                                 "reasoning_content": "Hmm"}


def test_a_nul_in_a_tool_call_is_removed_as_a_character_and_as_a_json_escape() -> None:
    reply = BackendReply(
        content="",
        native_finish_reason="tool_calls",
        tool_calls=[
            # a literal U+0000 inside the arguments string
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Par\u0000is"}'}},
            # a JSON escape a client would decode to U+0000; an escaped backslash stays
            {"id": "call_2", "type": "function",
             "function": {"name": "get\u0000_weather",
                          "arguments": '{"city": "Lyon\\u0000", "note": "a\\\\u0000b"}'}},
            # arguments koboldcpp sent as an object
            {"id": "call_3", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Nice\u0000"}}},
        ],
    )
    body = chat_submit("j", "m", reply, max_length=64)
    calls = body["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"] * 3
    assert [c["function"]["arguments"] for c in calls] == [
        '{"city": "Paris"}',
        '{"city": "Lyon", "note": "a\\\\u0000b"}',
        '{"city": "Nice"}',
    ]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == [
        "Paris", "Lyon", "Nice"]
    assert json.loads(calls[1]["function"]["arguments"])["note"] == "a\\u0000b"
    assert no_nul(body)
    assert_valid_submit(body)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ""),
        ('{"a": "x"}', '{"a": "x"}'),
        ('{"a": "x\u0000y"}', '{"a": "xy"}'),
        ('{"a": "x\\u0000y"}', '{"a": "xy"}'),
        ('{"a": "\\u0000\\u0000"}', '{"a": ""}'),
        # an escaped backslash, then "u0000": text, kept
        ('{"a": "x\\\\u0000"}', '{"a": "x\\\\u0000"}'),
        # an escaped backslash, then a real escape
        ('{"a": "x\\\\\\u0000"}', '{"a": "x\\\\"}'),
        ('{"a": "\\u00001"}', '{"a": "1"}'),
        ('{"a": "\\u0001"}', '{"a": "\\u0001"}'),
    ],
)
def test_strip_nul_json_removes_only_real_escapes(text: str, expected: str) -> None:
    assert strip_nul_json(text) == expected


@given(st.dictionaries(st.text(max_size=5), st.text(max_size=8), max_size=4))
@settings(max_examples=200)
def test_stripped_arguments_decode_to_the_values_without_nul(value: dict[str, str]) -> None:
    for encoded in (json.dumps(value), json.dumps(value, ensure_ascii=False)):
        # keys that differ only by U+0000 become one key; the last one wins either way
        assert json.loads(strip_nul_json(encoded)) == {
            strip_nul(k): strip_nul(v) for k, v in value.items()
        }


def test_a_nul_in_a_text_generation_is_removed_before_the_submit() -> None:
    assert text_submit("t1", " Paris\u0000.") == {"id": "t1", "generation": " Paris.",
                                                 "state": "ok"}


# --- the budget koboldcpp generated under -------------------------------------------------


def test_a_reply_cut_at_koboldcpps_budget_is_length_and_a_stop_sequence_is_stop() -> None:
    # a job of max_length 900 in a 1000-token context: koboldcpp generates at most 800
    budget = kcpp_effective_max_length(900, 1000, 4096)
    cut = BackendReply(content="Once upon a ti", native_finish_reason="length",
                       prompt_tokens=40, completion_tokens=800)
    assert chat_submit("j", "m", cut, max_length=budget)["finish_reason"] == "length"
    stopped = BackendReply(content="Blue", native_finish_reason="length",
                           prompt_tokens=40, completion_tokens=11)
    assert chat_submit("j", "m", stopped, max_length=budget)["finish_reason"] == "stop"
    thinking = BackendReply(content="<think>Let me weigh", native_finish_reason="length",
                            prompt_tokens=40, completion_tokens=800)
    body = chat_submit("j", "m", thinking, max_length=budget)
    assert body["message"] == {"role": "assistant", "content": "",
                               "reasoning_content": "Let me weigh"}
    assert body["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("native", "tokens", "budget", "needed"),
    [
        ("length", 40, 300, True),  # below the budget: a stop sequence or an abort
        ("length", 300, 300, False),  # the budget ran out
        ("length", None, 300, False),  # no count: nothing to tell
        ("stop", 40, 300, False),
    ],
)
def test_only_a_length_below_the_budget_needs_koboldcpps_stop_reason(
    native: str, tokens: int | None, budget: int, needed: bool
) -> None:
    assert needs_stop_reason(native, tokens, budget) is needed


@pytest.mark.parametrize(("stop_reason", "aborted"), [(0, True), (2, False), (-1, False), (None, False), (False, False), ("0", False)])
def test_koboldcpps_out_of_tokens_below_the_budget_is_an_abort(stop_reason: object, aborted: bool) -> None:
    assert aborted_short(stop_reason) is aborted
