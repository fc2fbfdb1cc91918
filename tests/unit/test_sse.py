"""SSEDecoder: WHATWG event-stream parsing over arbitrarily split bytes."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from koboldcpp_horde_chat.errors import BackendError
from koboldcpp_horde_chat.koboldcpp.sse import SSEDecoder, SSEEvent
from tests.samples import SAMPLES

RECORDED = (
    "chat_stream.raw",
    "chat_stream_stop.raw",
    "chat_stream_smollm.raw",
    "chat_tools_required_stream.raw",
    "abort_chat_stream.raw",
)


def decode(*pieces: bytes) -> list[SSEEvent]:
    dec = SSEDecoder()
    events: list[SSEEvent] = []
    for piece in pieces:
        events.extend(dec.feed(piece))
    events.extend(dec.close())
    return events


def datas(events: list[SSEEvent]) -> list[str]:
    return [e.data for e in events]


def reference(raw: bytes) -> list[SSEEvent]:
    """A straightforward, non-incremental reading of the standard, for comparison."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    text = raw.decode("utf-8", "replace")
    parts = re.split(r"\r\n|\r|\n", text)
    complete = parts[:-1]  # the last part has no line end: discarded at close
    events = []
    data_buf = ""
    have_data = False
    event_type = ""
    last_id: str | None = None
    retry: int | None = None
    for line in complete:
        if line == "":
            if have_data:
                events.append(SSEEvent(data_buf[:-1], event_type or "message", last_id, retry))
            data_buf, have_data, event_type, retry = "", False, "", None
            continue
        if line.startswith(":"):
            continue
        if ":" in line:
            name, value = line.split(":", 1)
            if value.startswith(" "):
                value = value[1:]
        else:
            name, value = line, ""
        if name == "data":
            data_buf += value + "\n"
            have_data = True
        elif name == "event":
            event_type = value
        elif name == "id" and "\0" not in value:
            last_id = value
        elif name == "retry" and re.fullmatch(r"[0-9]+", value):
            retry = int(value)
    return events


# --- recorded koboldcpp streams ----------------------------------------------------------


def recorded_payloads(raw: bytes) -> list[str]:
    """The data of each event, read with the knowledge that koboldcpp writes ``data: X\\n\\n``."""
    return [block[len(b"data: ") :].decode() for block in raw.split(b"\n\n") if block]


@pytest.mark.parametrize("name", RECORDED)
def test_a_recorded_stream_decodes_to_its_events_at_every_split_offset(name: str) -> None:
    raw = (SAMPLES / name).read_bytes()
    expected = [SSEEvent(d) for d in recorded_payloads(raw)]
    assert expected[-1] == SSEEvent("[DONE]")
    assert decode(raw) == expected
    for k in range(len(raw) + 1):
        dec = SSEDecoder()
        got = dec.feed(raw[:k])
        got += dec.feed(raw[k:])
        got += dec.close()
        assert got == expected, k
        assert not dec.discarded_partial


@pytest.mark.parametrize("name", RECORDED)
def test_a_recorded_stream_fed_one_byte_at_a_time_gives_the_same_events(name: str) -> None:
    raw = (SAMPLES / name).read_bytes()
    pieces = [raw[i : i + 1] for i in range(len(raw))]
    assert decode(*pieces) == decode(raw)


def test_the_recorded_stop_stream_has_the_exact_chunks_koboldcpp_sent() -> None:
    raw = (SAMPLES / "chat_stream_stop.raw").read_bytes()
    events = decode(raw)
    assert len(events) == 4
    first = json.loads(events[0].data)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hello! I\u2019m Tom.\n"}
    assert json.loads(events[2].data)["usage"] == {
        "prompt_tokens": 14,
        "completion_tokens": 11,
        "total_tokens": 25,
    }
    assert all(e.event == "message" and e.id is None and e.retry is None for e in events)


@pytest.mark.parametrize("name", RECORDED)
@pytest.mark.parametrize("ending", [b"\r\n", b"\r"])
def test_a_recorded_stream_rewritten_with_other_line_ends_decodes_the_same(
    name: str, ending: bytes
) -> None:
    raw = (SAMPLES / name).read_bytes()
    rewritten = raw.replace(b"\n", ending)
    expected = decode(raw)
    assert decode(rewritten) == expected
    step = max(1, len(rewritten) // 400)
    for k in range(0, len(rewritten) + 1, step):
        assert decode(rewritten[:k], rewritten[k:]) == expected, k


# --- line ends --------------------------------------------------------------------------


def test_crlf_split_between_two_reads_is_one_line_end() -> None:
    # If the LF were a second line end, "a" and "b" would be two events.
    assert decode(b"data: a\r", b"\ndata: b\r\n\r\n") == [SSEEvent("a\nb")]


def test_cr_at_the_end_of_a_read_followed_by_cr_is_a_blank_line() -> None:
    assert decode(b"data: a\r", b"\rdata: b\r\r") == [SSEEvent("a"), SSEEvent("b")]


def test_cr_then_empty_reads_then_lf_is_still_one_line_end() -> None:
    assert decode(b"data: a\r", b"", b"", b"\n", b"\n") == [SSEEvent("a")]


def test_an_lf_long_after_a_crlf_is_a_line_end_of_its_own() -> None:
    assert decode(b"data: a\r\n", b"\n") == [SSEEvent("a")]


def test_mixed_line_ends_in_one_stream() -> None:
    raw = b"data: 1\r\n\r\ndata: 2\r\rdata: 3\n\ndata: 4\r\n\n"
    assert datas(decode(raw)) == ["1", "2", "3", "4"]
    for k in range(len(raw) + 1):
        assert datas(decode(raw[:k], raw[k:])) == ["1", "2", "3", "4"], k


# --- UTF-8 and BOM ------------------------------------------------------------------------


def test_a_utf8_character_split_across_reads_decodes_whole() -> None:
    raw = 'data: {"content": "caf\u00e9 \u20ac \U0001f600"}\n\n'.encode()
    for k in range(len(raw) + 1):
        assert decode(raw[:k], raw[k:]) == [SSEEvent('{"content": "caf\u00e9 \u20ac \U0001f600"}')]
    assert decode(*[raw[i : i + 1] for i in range(len(raw))]) == [
        SSEEvent('{"content": "caf\u00e9 \u20ac \U0001f600"}')
    ]


def test_invalid_utf8_becomes_a_replacement_character() -> None:
    assert decode(b"data: a\xffb\n\ndata: \xe2\x82\n\n") == [SSEEvent("a\ufffdb"), SSEEvent("\ufffd")]


def test_a_bom_at_the_start_is_dropped_even_when_split() -> None:
    raw = b"\xef\xbb\xbfdata: x\n\n"
    for k in range(len(raw) + 1):
        assert decode(raw[:k], raw[k:]) == [SSEEvent("x")], k
    assert decode(b"\xef", b"\xbb", b"\xbf", b"data: x\n\n") == [SSEEvent("x")]


def test_only_one_bom_is_dropped_and_only_at_the_start() -> None:
    # A second BOM makes the first line's field name "\ufeffdata", an unknown field.
    assert decode(b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\ndata: y\n\n") == [SSEEvent("y")]
    assert decode(b"data: \xef\xbb\xbfx\n\n") == [SSEEvent("\ufeffx")]


def test_a_partial_bom_that_is_not_a_bom_is_kept_as_text() -> None:
    assert decode(b"\xef", b"data: x\n\n") == []  # "\ufffddata" is an unknown field
    assert decode(b"\xef\xbb", b"\n", b"data: y\n\n") == [SSEEvent("y")]


# --- fields -----------------------------------------------------------------------------


def test_multi_line_data_is_joined_with_newlines() -> None:
    assert decode(b"data: line 1\ndata: line 2\ndata:\ndata: line 4\n\n") == [
        SSEEvent("line 1\nline 2\n\nline 4")
    ]


def test_only_one_leading_space_is_removed_from_a_value() -> None:
    assert decode(b"data:  two\ndata:none\n\n") == [SSEEvent(" two\nnone")]


def test_comments_are_ignored_and_a_comment_only_block_dispatches_nothing() -> None:
    raw = b": keep-alive\n\n:\n\ndata: a\n: inside\ndata: b\n\n"
    assert decode(raw) == [SSEEvent("a\nb")]


def test_an_event_without_data_dispatches_nothing_but_empty_data_does() -> None:
    assert decode(b"event: ping\n\n") == []
    assert decode(b"data\n\n") == [SSEEvent("")]
    assert decode(b"data:\n\n") == [SSEEvent("")]


def test_event_type_applies_to_one_event_only() -> None:
    raw = b"event: message\ndata: a\n\nevent: update\ndata: b\n\ndata: c\n\nevent:\ndata: d\n\n"
    assert [(e.event, e.data) for e in decode(raw)] == [
        ("message", "a"),
        ("update", "b"),
        ("message", "c"),
        ("message", "d"),
    ]


def test_event_type_of_an_empty_block_is_reset() -> None:
    assert decode(b"event: x\n\ndata: a\n\n") == [SSEEvent("a", "message")]


def test_id_carries_over_and_an_id_with_nul_is_ignored() -> None:
    raw = b"id: 1\ndata: a\n\ndata: b\n\nid: 2\x00x\ndata: c\n\nid\ndata: d\n\n"
    assert [(e.data, e.id) for e in decode(raw)] == [("a", "1"), ("b", "1"), ("c", "1"), ("d", "")]


def test_retry_takes_only_ascii_digits() -> None:
    dec = SSEDecoder()
    events = dec.feed(b"retry: 1500\ndata: a\n\nretry: 2x\ndata: b\n\nretry: -1\nretry: \xd9\xa3\ndata: c\n\n")
    assert [(e.data, e.retry) for e in events] == [("a", 1500), ("b", None), ("c", None)]
    assert dec.retry_ms == 1500


def test_a_retry_in_an_event_without_data_still_sets_the_reconnection_time() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"retry: 3000\n\n") == []
    assert dec.retry_ms == 3000


def test_unknown_fields_and_a_field_without_colon_are_ignored() -> None:
    raw = b"foo: bar\nData: x\nDATA: y\nbar\ndata: z\n\n"
    assert decode(raw) == [SSEEvent("z")]


def test_a_colon_inside_the_value_is_kept() -> None:
    assert decode(b'data: {"a": "b:c"}\n\n') == [SSEEvent('{"a": "b:c"}')]


def test_other_unicode_line_separators_do_not_end_lines() -> None:
    raw = "data: a\u2028b\x85c\x0bd\x0ce\x1cf\n\n".encode()
    assert decode(raw) == [SSEEvent("a\u2028b\x85c\x0bd\x0ce\x1cf")]


# --- the end of the stream ----------------------------------------------------------------


def test_an_unterminated_event_is_discarded_at_close() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\n\ndata: b\n") == [SSEEvent("a")]
    assert dec.close() == []
    assert dec.discarded_partial


def test_an_unterminated_line_is_discarded_at_close() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\n\ndata: [DONE]") == [SSEEvent("a")]
    assert dec.close() == []
    assert dec.discarded_partial


def test_a_cleanly_ended_stream_discards_nothing() -> None:
    dec = SSEDecoder()
    dec.feed(b"data: a\n\n")
    assert dec.close() == []
    assert not dec.discarded_partial
    assert dec.close() == []


def test_feed_after_close_is_an_error() -> None:
    dec = SSEDecoder()
    dec.close()
    with pytest.raises(ValueError):
        dec.feed(b"data: a\n\n")


def test_an_endless_line_is_refused_once_it_passes_the_limit() -> None:
    dec = SSEDecoder(max_line_bytes=1000)
    dec.feed(b"data: " + b"x" * 900)
    with pytest.raises(BackendError):
        dec.feed(b"x" * 200)


def test_a_long_line_in_many_reads_is_within_the_limit() -> None:
    dec = SSEDecoder(max_line_bytes=100_000)
    for _ in range(500):
        assert dec.feed(b"x" * 100) == []
    assert dec.feed(b"\n\ndata: ok\n\n") == [SSEEvent("ok")]


# --- against a reference reading, with random streams and splits --------------------------

_line = st.one_of(
    st.builds(lambda v: "data: " + v, st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=12)),
    st.builds(lambda v: "data:" + v, st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=5)),
    st.sampled_from(["", "", "", ":comment", "event: x", "event:", "id: 7", "id", "retry: 250",
                     "retry: x1", "data", "foo: bar", "id: a\0b", "\u00e9t\u00e9: 1"]),
)
_stream = st.lists(st.tuples(_line, st.sampled_from(["\n", "\r", "\r\n"])), max_size=25)


@settings(max_examples=300, deadline=None)
@given(
    lines=_stream,
    bom=st.booleans(),
    tail=st.sampled_from(["", "data: cut", "data: x\n", "\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
)
def test_random_streams_split_anywhere_match_the_reference_reading(
    lines: list[tuple[str, str]], bom: bool, tail: str, cuts: list[int]
) -> None:
    raw = ("\ufeff" if bom else "") + "".join(line + end for line, end in lines) + tail
    data = raw.encode()
    points = sorted({min(c, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    assert decode(*pieces) == reference(data)
