"""ChatStreamAccumulator over koboldcpp's streamed chat completions."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from koboldcpp_horde_chat.errors import ReplyError
from koboldcpp_horde_chat.horde.pop import Lease
from koboldcpp_horde_chat.horde.progress import ProgressAction, ProgressPoster
from koboldcpp_horde_chat.koboldcpp.answers import BackendReply
from koboldcpp_horde_chat.koboldcpp.reasoning import START_TAGS
from koboldcpp_horde_chat.koboldcpp.sse import SSEDecoder
from koboldcpp_horde_chat.translate.chat_stream import ChatStreamAccumulator, StreamDelta
from koboldcpp_horde_chat.translate.submits import chat_submit
from tests.samples import SAMPLES


def chunk(
    content: str | None = None,
    *,
    reasoning: str | None = None,
    finish: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> str:
    delta: dict[str, Any] = {"role": "assistant"}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    if tool_calls is not None:
        delta = {"tool_calls": tool_calls}
    return json.dumps(
        {
            "id": "chatcmpl-A123456",
            "object": "chat.completion.chunk",
            "created": 1795991072,
            "model": "koboldcpp/test",
            "choices": [{"index": 0, "finish_reason": finish, "delta": delta}],
        }
    )


def usage(prompt: int, completion: int) -> str:
    return json.dumps(
        {
            "id": "chatcmpl-A123456",
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion},
        }
    )


def run(events: list[str], **kwargs: Any) -> tuple[ChatStreamAccumulator, str, str]:
    """Feed events, flush; return the accumulator and the concatenated released text."""
    acc = ChatStreamAccumulator(**kwargs)
    content, reasoning = [], []
    for data in events:
        d = acc.feed_event(data)
        content.append(d.content)
        reasoning.append(d.reasoning)
    d = acc.flush()
    content.append(d.content)
    reasoning.append(d.reasoning)
    return acc, "".join(content), "".join(reasoning)


def sample_events(name: str, *cuts: int) -> list[str]:
    raw = (SAMPLES / name).read_bytes()
    dec = SSEDecoder()
    events = []
    for a, b in zip((0, *cuts), (*cuts, len(raw)), strict=True):
        events += dec.feed(raw[a:b])
    events += dec.close()
    return [e.data for e in events]


def oracle_content(name: str) -> str:
    """The concatenated delta.content of a recorded stream, read without the code under test."""
    text = []
    for block in (SAMPLES / name).read_bytes().split(b"\n\n"):
        if not block or block == b"data: [DONE]":
            continue
        obj = json.loads(block[len(b"data: ") :])
        for choice in obj["choices"]:
            text.append(choice["delta"].get("content") or "")
    return "".join(text)


# --- the recorded streams -----------------------------------------------------------------


def test_chat_stream_stop_gives_the_text_the_finish_reason_and_the_usage() -> None:
    acc, content, reasoning = run(sample_events("chat_stream_stop.raw"))
    assert acc.done
    assert content == "Hello! I\u2019m Tom.\n"
    assert reasoning == ""
    assert acc.result() == BackendReply(
        content="Hello! I\u2019m Tom.\n",
        reasoning_content=None,
        tool_calls=[],
        native_finish_reason="length",
        prompt_tokens=14,
        completion_tokens=11,
    )


def test_chat_stream_without_usage_reports_no_token_counts() -> None:
    acc, content, _ = run(sample_events("chat_stream.raw"))
    reply = acc.result()
    assert content == "1" + "0" * 47
    assert reply.content == content
    assert reply.native_finish_reason == "length"
    assert reply.prompt_tokens is None
    assert reply.completion_tokens is None


def test_chat_stream_smollm_ends_with_stop_and_usage() -> None:
    acc, content, _ = run(sample_events("chat_stream_smollm.raw"))
    reply = acc.result()
    assert content == oracle_content("chat_stream_smollm.raw")
    assert content.startswith("Abe no kudere no kakara\nThe sea is a vast")
    assert content.endswith("the sea's vastness and mystery.")
    assert (reply.native_finish_reason, reply.prompt_tokens, reply.completion_tokens) == ("stop", 16, 69)


def test_the_tools_fake_stream_accumulates_one_call_with_null_content() -> None:
    acc, content, reasoning = run(sample_events("chat_tools_required_stream.raw"))
    assert (content, reasoning) == ("", "")
    assert acc.result() == BackendReply(
        content=None,
        reasoning_content=None,
        tool_calls=[
            {
                "id": "call_84652",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "string"}'},
            }
        ],
        native_finish_reason="tool_calls",
        prompt_tokens=None,
        completion_tokens=None,
    )


def test_an_aborted_stream_ends_normally_with_length() -> None:
    acc, content, _ = run(sample_events("abort_chat_stream.raw"))
    assert acc.done
    assert content == oracle_content("abort_chat_stream.raw")
    assert content.startswith("Write an essay, in a very short essay")
    assert content.endswith("in this course.\nYou")
    assert acc.result().native_finish_reason == "length"


@pytest.mark.parametrize(
    "name",
    ["chat_stream.raw", "chat_stream_stop.raw", "chat_stream_smollm.raw",
     "chat_tools_required_stream.raw", "abort_chat_stream.raw"],
)
def test_every_byte_split_of_a_recorded_stream_gives_the_same_reply(name: str) -> None:
    raw_len = (SAMPLES / name).stat().st_size
    whole = run(sample_events(name))[0].result()
    # Every offset of the first two and the last few events (first chunk, finish
    # chunk, usage, [DONE]) and every 97th in between, to keep the test fast;
    # test_sse checks the events themselves at every offset.
    offsets = set(range(0, min(raw_len, 500) + 1)) | set(range(max(0, raw_len - 800), raw_len + 1))
    offsets |= set(range(0, raw_len + 1, 97))
    for k in sorted(offsets):
        acc, _, _ = run(sample_events(name, k))
        assert acc.result() == whole, k


@pytest.mark.parametrize("name", ["chat_stream_stop.raw", "chat_stream_smollm.raw", "abort_chat_stream.raw"])
def test_every_split_of_the_content_across_two_events_gives_the_same_text(name: str) -> None:
    text = oracle_content(name)
    for k in range(len(text) + 1):
        acc, content, _ = run([chunk(text[:k]), chunk(text[k:]), chunk("", finish="stop"), "[DONE]"])
        assert content == text, k
        assert acc.result().content == text


# --- reasoning, held-back tails, stop sequences -----------------------------------------


def test_reasoning_content_from_koboldcpp_passes_through_as_reasoning() -> None:
    acc = ChatStreamAccumulator()
    # a trailing space waits for more reasoning (it could end the reasoning)
    assert acc.feed_event(chunk(reasoning="Thinking ")) == StreamDelta("", "Thinking")
    assert acc.feed_event(chunk(reasoning="hard.")) == StreamDelta("", " hard.")
    assert acc.feed_event(chunk("Blue.")) == StreamDelta("Blue.", "")
    acc.feed_event(chunk(reasoning="", finish="stop"))
    reply = acc.result()
    assert (reply.content, reasoning_of(reply)) == ("Blue.", "Thinking hard.")


def reasoning_of(reply: BackendReply) -> str | None:
    return reply.reasoning_content


def test_think_tags_left_in_content_are_split_even_across_events() -> None:
    events = [chunk("<thi"), chunk("nk>Let me"), chunk(" see</th"), chunk("ink>Blue."), "[DONE]"]
    acc, content, reasoning = run(events)
    assert (content, reasoning) == ("Blue.", "Let me see")
    assert (acc.result().content, acc.result().reasoning_content) == ("Blue.", "Let me see")


def test_a_partial_tag_is_held_back_until_it_cannot_be_a_tag() -> None:
    acc = ChatStreamAccumulator()
    assert acc.feed_event(chunk("a <thi")) == StreamDelta("a ", "")
    assert acc.feed_event(chunk("s is")) == StreamDelta("<this is", "")


def test_held_back_text_is_released_by_flush_and_included_in_the_result() -> None:
    acc = ChatStreamAccumulator(stop_sequences=("\nUser:",))
    assert acc.feed_event(chunk("Blue.\nUs")) == StreamDelta("Blue.", "")
    assert acc.flush() == StreamDelta("\nUs", "")
    assert acc.flush() == StreamDelta()
    assert acc.result().content == "Blue.\nUs"


def test_result_without_flush_still_includes_the_held_tail() -> None:
    acc = ChatStreamAccumulator(stop_sequences=("\nUser:",))
    acc.feed_event(chunk("Blue.\nUs"))
    assert acc.result().content == "Blue.\nUs"


def test_a_stop_sequence_split_across_events_ends_the_content() -> None:
    events = [chunk("Blue.\nUs"), chunk("er: more"), chunk(" text"), chunk("", finish="length"), "[DONE]"]
    acc, content, _ = run(events, stop_sequences=("\nUser:",))
    assert content == "Blue."
    assert acc.result().content == "Blue."
    assert acc.result().native_finish_reason == "length"


def test_start_in_reasoning_treats_content_as_reasoning_until_the_end_tag() -> None:
    acc, content, reasoning = run([chunk("hmm"), chunk("</think>Red."), "[DONE]"], start_in_reasoning=True)
    assert (content, reasoning) == ("Red.", "hmm")


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(["a", "b", "<", "think", ">", "</", "\n", "User", ":", "\u00e9", " "]), max_size=30),
    cuts=st.lists(st.integers(0, 200), max_size=5),
)
def test_any_chunking_of_the_content_gives_the_same_split(pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    whole = run([chunk(text), "[DONE]"], stop_sequences=("\nUser:",))
    points = sorted({min(c, len(text)) for c in cuts})
    parts = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    split = run([chunk(p) for p in parts] + ["[DONE]"], stop_sequences=("\nUser:",))
    assert split[1:] == whole[1:]
    assert split[0].result() == whole[0].result()


# --- posted and submitted text agree (U+0000, reasoning whitespace) ------------------------


def post_all(deltas: list[StreamDelta]) -> ProgressPoster:
    """Post every delta as the worker does, each post accepted at once."""
    poster = ProgressPoster("job-1", max_length=100_000, lease=Lease(0.0, 150.0), interval_s=0.0)
    for delta in deltas:
        poster.add(delta.content, delta.reasoning)
        body = poster.due(1.0)
        if body is not None:
            assert "\x00" not in json.dumps(body, ensure_ascii=False)
            assert "\\u0000" not in json.dumps(body)
            assert poster.on_response(200, {"accepted_seq": body["seq"]}, 1.0) is (
                ProgressAction.CONTINUE
            )
    return poster


def stream_and_post(events: list[str]) -> tuple[ProgressPoster, dict[str, Any]]:
    """(the poster after every post, the submitted message) for a streamed reply."""
    acc = ChatStreamAccumulator()
    deltas = [acc.feed_event(data) for data in events]
    deltas.append(acc.flush())
    poster = post_all(deltas)
    body = chat_submit("job-1", "m", acc.result(), max_length=512)
    return poster, body["message"]


def test_a_nul_is_never_posted_and_the_posts_add_up_to_the_submitted_reply() -> None:
    poster, message = stream_and_post([
        chunk(reasoning="Hm\u0000m."), chunk("Blue"), chunk("\u0000"), chunk("."),
        chunk("", finish="stop"), "[DONE]",
    ])
    assert message == {"role": "assistant", "content": "Blue.", "reasoning_content": "Hmm."}
    assert (poster.posted_content, poster.posted_reasoning) == ("Blue.", "Hmm.")


def test_reasoning_whitespace_is_held_back_so_posts_and_submit_agree() -> None:
    # koboldcpp streams the reasoning as generated: '\n', '  Let me ponder.', '\n\n'
    events = [chunk(reasoning="\n"), chunk(reasoning="  Let me"), chunk(reasoning=" ponder."),
              chunk(reasoning="\n\n"), chunk("Blue."), chunk("", finish="stop"), "[DONE]"]
    acc = ChatStreamAccumulator()
    released = [acc.feed_event(data).reasoning for data in events]
    assert released == ["", "Let me", " ponder.", "", "", "", ""]
    assert acc.flush() == StreamDelta()
    poster, message = stream_and_post(events)
    assert poster.posted_reasoning == message["reasoning_content"] == "Let me ponder."
    # the non-streamed reply of the same generation (koboldcpp's own split) agrees
    whole = chat_submit("job-1", "m", BackendReply(
        content="Blue.", reasoning_content="\n  Let me ponder.\n\n", native_finish_reason="stop"
    ), max_length=512)
    assert whole["message"] == message


def test_whitespace_between_two_reasoning_blocks_is_kept() -> None:
    poster, message = stream_and_post([
        chunk(reasoning="A \n"), chunk("x"), chunk(reasoning=" \nB\n"), chunk("", finish="stop"),
        "[DONE]",
    ])
    assert poster.posted_reasoning == message["reasoning_content"] == "A \n \nB"
    assert poster.posted_content == message["content"] == "x"


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(
        st.sampled_from(["a", "b", "<think>", "</think>", "\n", " ", "\u0000", "\u00e9", "<th"]),
        max_size=30,
    ),
    cuts=st.lists(st.integers(0, 300), max_size=6),
)
def test_a_reply_is_the_same_posted_submitted_streamed_or_whole(
    pieces: list[str], cuts: list[int]
) -> None:
    """Content left with reasoning tags, as koboldcpp might send it either way."""
    text = "".join(pieces)
    plain = text.replace("\x00", "")
    end = plain.find("</think>")
    if end >= 0 and not any(0 <= plain.find(tag) < end for tag in START_TAGS):
        return  # a block the template opened: koboldcpp splits that one itself
    points = sorted({min(c, len(text)) for c in cuts})
    parts = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    poster, streamed = stream_and_post([chunk(p) for p in parts] + [chunk("", finish="stop"),
                                                                    "[DONE]"])
    whole = chat_submit("job-1", "m", BackendReply(content=text, native_finish_reason="stop"),
                        max_length=512)["message"]
    assert streamed == whole
    assert poster.posted_content == whole["content"]
    assert poster.posted_reasoning == whole.get("reasoning_content", "")
    assert "\x00" not in json.dumps(whole, ensure_ascii=False)


# --- tool calls ---------------------------------------------------------------------------


def test_two_tool_calls_are_accumulated_by_index() -> None:
    events = [
        chunk(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": ""}}]),
        chunk(tool_calls=[{"index": 1, "id": "call_2", "type": "function",
                           "function": {"name": "get_time", "arguments": ""}}]),
        chunk(tool_calls=[{"index": 1, "function": {"arguments": '{"tz": '}}]),
        chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]),
        chunk(tool_calls=[{"index": 1, "id": "ignored", "function": {"name": "x", "arguments": '"UTC"}'}}]),
        chunk(finish="tool_calls", tool_calls=[]),
        "[DONE]",
    ]
    acc, _, _ = run(events)
    assert acc.result().tool_calls == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}},
    ]
    assert acc.result().native_finish_reason == "tool_calls"
    assert acc.result().content is None


def test_tool_call_fragments_without_index_start_a_call_with_an_id_and_continue_it_without() -> None:
    events = [
        chunk(tool_calls=[{"id": "call_1", "function": {"name": "f", "arguments": "{"}}]),
        chunk(tool_calls=[{"function": {"arguments": "}"}}]),
        chunk(tool_calls=[{"id": "call_2", "function": {"name": "g", "arguments": {"a": 1}}}]),
    ]
    acc, _, _ = run(events)
    assert acc.tool_calls() == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}},
    ]


def test_content_beside_tool_calls_is_kept() -> None:
    events = [
        chunk("Let me check."),
        chunk(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                           "function": {"name": "f", "arguments": "{}"}}]),
        "[DONE]",
    ]
    acc, content, _ = run(events)
    assert content == "Let me check."
    assert acc.result().content == "Let me check."


# --- ends, errors -------------------------------------------------------------------------


def test_done_is_set_by_done_and_later_events_are_ignored() -> None:
    acc = ChatStreamAccumulator()
    acc.feed_event(chunk("a"))
    assert not acc.done
    assert acc.feed_event("[DONE]") == StreamDelta()
    assert acc.done
    assert acc.feed_event(chunk("b")) == StreamDelta()
    assert acc.result().content == "a"


def test_a_stream_that_ends_without_a_finish_reason_reports_none() -> None:
    acc, _, _ = run([chunk("partial")])
    assert not acc.done
    reply = acc.result()
    assert reply.content == "partial"
    assert reply.native_finish_reason is None


def test_an_empty_stream_has_empty_content() -> None:
    acc, _, _ = run(["[DONE]"])
    assert acc.result() == BackendReply(content="")


@pytest.mark.parametrize(
    "data",
    [
        '{"error": {"message": "model crashed", "type": "server_error"}}',
        '{"detail": {"msg": "Error parsing input.", "type": "bad_input"}}',
        '{"error": "boom"}',
        "not json at all",
        '["a", "list"]',
        '{"choices": [{"index": 0, "delta": "text"}]}',
        '{"choices": "nope"}',
    ],
)
def test_an_in_band_error_or_malformed_event_makes_result_raise(data: str) -> None:
    acc = ChatStreamAccumulator()
    assert acc.feed_event(chunk("Hello")) == StreamDelta("Hello", "")
    assert acc.feed_event(data) == StreamDelta()
    assert acc.error is not None
    assert acc.feed_event(chunk(" more")) == StreamDelta()
    with pytest.raises(ReplyError):
        acc.result()


def test_a_null_error_field_is_not_an_error() -> None:
    acc, content, _ = run([json.dumps({"error": None, "choices": [{"index": 0, "delta": {"content": "ok"}}]})])
    assert acc.error is None
    assert acc.result().content == "ok"


def test_the_error_message_names_koboldcpps_text() -> None:
    acc = ChatStreamAccumulator()
    acc.feed_event('{"detail": {"msg": "Error parsing input.", "type": "bad_input"}}')
    with pytest.raises(ReplyError, match="Error parsing input"):
        acc.result()


def test_a_logprobs_chunk_without_delta_and_a_chunk_without_choices_are_harmless() -> None:
    events = [
        chunk("a"),
        json.dumps({"choices": [{"index": 0, "finish_reason": None, "logprobs": {"content": []}}]}),
        json.dumps({"id": "x", "object": "chat.completion.chunk"}),
        chunk("b", finish="stop"),
        "[DONE]",
    ]
    acc, content, _ = run(events)
    assert content == "ab"
    assert acc.result().native_finish_reason == "stop"


def test_usage_with_bad_counts_is_ignored_and_a_reported_zero_is_kept() -> None:
    acc, _, _ = run([chunk("a"), json.dumps({"choices": [], "usage": {"prompt_tokens": -3, "completion_tokens": True}})])
    assert (acc.result().prompt_tokens, acc.result().completion_tokens) == (None, None)
    acc, _, _ = run([chunk(""), usage(0, 0)])
    assert (acc.result().prompt_tokens, acc.result().completion_tokens) == (0, 0)

