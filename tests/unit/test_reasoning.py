"""Reasoning split off replies, whole and streamed (seed step 6)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from koboldcpp_horde_chat.koboldcpp.reasoning import (
    THINK_TAGS,
    ReasoningSplit,
    StreamSplitter,
    split_reasoning,
)


def test_koboldcpps_five_tag_pairs() -> None:
    assert THINK_TAGS == (
        ("<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"),
        ("<think>", "</think>"),
        ("<seed:think>", "</seed:think>"),
        ("<|START_THINKING|>", "<|END_THINKING|>"),
        ("<|channel>thought", "<channel|>"),
    )


# --- whole replies --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "reasoning", "expected"),
    [
        # koboldcpp already split it off
        ("Blue.", "Hmm.", ReasoningSplit("Blue.", "Hmm.", False)),
        ("Blue.", "\nHmm.\n", ReasoningSplit("Blue.", "Hmm.", False)),
        # content without tags is left exactly as sent
        ("Cats are fascinating animals.\n", None, ReasoningSplit("Cats are fascinating animals.\n",
                                                                 None, False)),
        ("", None, ReasoningSplit("", None, False)),
        (None, None, ReasoningSplit(None, None, False)),
        (None, "Hmm.", ReasoningSplit(None, "Hmm.", False)),
        ("Blue.", "   ", ReasoningSplit("Blue.", None, False)),
        # a closed block
        # (the content keeps its whitespace, as koboldcpp's own split keeps it)
        ("<think>Blue or red?</think>\n\nBlue.", None,
         ReasoningSplit("\n\nBlue.", "Blue or red?", False)),
        ("<think>\n  Let me ponder.\n\n</think>Blue.", None,
         ReasoningSplit("Blue.", "Let me ponder.", False)),
        ("<think></think>Blue.", None, ReasoningSplit("Blue.", None, False)),
        # only an end tag: the template opened the block
        ("Blue or red?\n</think>\nBlue.", None, ReasoningSplit("\nBlue.", "Blue or red?", False)),
        # a block that never closed (generation stopped while thinking)
        ("<think>Blue or red? Maybe", None, ReasoningSplit("", "Blue or red? Maybe", True)),
        ("<think>", None, ReasoningSplit("", None, True)),
        ("Sure. <think>Blue or", None, ReasoningSplit("Sure. ", "Blue or", True)),
        # both sources: koboldcpp's reasoning first, joined as generated
        ("<think>\nSecond.\n</think>Blue.", "\nFirst.\n",
         ReasoningSplit("Blue.", "First.\n\nSecond.", False)),
        # several blocks: joined as generated (as a stream of them is posted)
        ("<think>A\n</think>x<think>\nB</think>y", None, ReasoningSplit("xy", "A\n\nB", False)),
        ("A</think>x<think>B", None, ReasoningSplit("x", "AB", True)),
    ],
)
def test_split_reasoning(
    content: str | None, reasoning: str | None, expected: ReasoningSplit
) -> None:
    assert split_reasoning(content, reasoning) == expected


@pytest.mark.parametrize(("start", "end"), THINK_TAGS)
def test_every_tag_pair_is_split(start: str, end: str) -> None:
    assert split_reasoning(f"{start}Weighing it.{end}Blue.", None) == ReasoningSplit(
        "Blue.", "Weighing it.", False
    )
    assert split_reasoning(f"Weighing it.{end}Blue.", None) == ReasoningSplit(
        "Blue.", "Weighing it.", False
    )
    assert split_reasoning(f"{start}Weighing", None) == ReasoningSplit("", "Weighing", True)


def test_no_text_is_lost() -> None:
    text = "<think>α β\nγ</think> Das ist  grün.  "
    result = split_reasoning(text, None)
    assert result.reasoning == "α β\nγ"
    assert result.content == " Das ist  grün.  "


# --- streams ----------------------------------------------------------------------------

STREAM_CASES: list[tuple[tuple[str, ...], bool, str, str, str]] = [
    # (stop_sequences, start_in_reasoning, text, reasoning, content)
    ((), False, "<think>Hmm, blue or red.</think>Blue.", "Hmm, blue or red.", "Blue."),
    (("\nuser:",), False, "<think>a\nuser: b</think>Blue.\nuser: next turn", "a\nuser: b", "Blue."),
    ((), True, "Let me see.</think>Red.", "Let me see.", "Red."),
    ((), False, "Blue <thin", "", "Blue <thin"),
    (("STOP",), False, "abc STO", "", "abc STO"),
    (("STOP",), False, "abc STOP and more <think>x</think>", "", "abc "),
    ((), False, THINK_TAGS[0][0] + "think" + THINK_TAGS[0][1] + "Answer", "think", "Answer"),
    ((), False, "<seed:think>x</seed:think>y<|START_THINKING|>z<|END_THINKING|>w", "xz", "yw"),
    ((), False, "<|channel>thought deep<channel|>ok", " deep", "ok"),
    ((), False, "a</think>b", "", "ab"),
    ((), False, "<think>still thinking", "still thinking", ""),
    (("x<think>y",), False, "ax<think>yb", "", "a"),
    (("x<think>y",), False, "ax<think>zb", "zb", "ax"),
    (("hi",), False, "a<think>hi</think>b", "hi", "ab"),
    (("END",), False, "textEND<think>r</think>", "", "text"),
    (("<th",), False, "a<think>b</think>c", "b", "ac"),
    (("</",), False, "a</b", "", "a"),
    (("\n\n\n",), False, "line\n\nline\n\n", "", "line\n\nline\n\n"),
    ((), False, "No tags at all, just an answer with < and > signs.", "",
     "No tags at all, just an answer with < and > signs."),
]


def run(stops: tuple[str, ...], start: bool, chunks: list[str]) -> tuple[str, str]:
    splitter = StreamSplitter(stop_sequences=stops, start_in_reasoning=start)
    reasoning, content = "", ""
    for chunk in chunks:
        r, c = splitter.feed(chunk)
        reasoning += r
        content += c
    r, c = splitter.flush()
    return reasoning + r, content + c


@pytest.mark.parametrize(("stops", "start", "text", "reasoning", "content"), STREAM_CASES)
def test_the_stream_splitter_gives_the_same_result_at_every_split(
    stops: tuple[str, ...], start: bool, text: str, reasoning: str, content: str
) -> None:
    assert run(stops, start, [text]) == (reasoning, content)
    assert run(stops, start, list(text)) == (reasoning, content)
    for i in range(len(text) + 1):
        assert run(stops, start, [text[:i], text[i:]]) == (reasoning, content), i
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            assert run(stops, start, [text[:i], text[i:j], text[j:]]) == (reasoning, content)


def test_plain_text_is_released_at_once() -> None:
    splitter = StreamSplitter(stop_sequences=["\nuser:"])
    assert splitter.feed("Hello wor") == ("", "Hello wor")
    assert splitter.feed("ld <") == ("", "ld ")
    assert splitter.feed("b>") == ("", "<b>")
    assert splitter.feed("!\nus") == ("", "!")
    assert splitter.feed("e") == ("", "")
    assert splitter.feed("d it") == ("", "\nused it")


def test_reasoning_is_released_as_it_streams() -> None:
    splitter = StreamSplitter()
    assert splitter.feed("<think>") == ("", "")
    assert splitter.in_reasoning
    assert splitter.feed("Blue or") == ("Blue or", "")
    assert splitter.feed(" red?</thi") == (" red?", "")
    assert splitter.feed("nk>Blue.") == ("", "Blue.")
    assert not splitter.in_reasoning


def test_a_stop_sequence_ends_the_content_for_good() -> None:
    splitter = StreamSplitter(stop_sequences=["\nuser:"])
    assert splitter.feed("Blue.\nuser: and") == ("", "Blue.")
    assert splitter.stopped
    assert splitter.feed(" more") == ("", "")
    assert splitter.flush() == ("", "")


def test_a_partial_stop_sequence_at_the_end_is_real_text() -> None:
    splitter = StreamSplitter(stop_sequences=["\nuser:"])
    assert splitter.feed("Blue.\nuse") == ("", "Blue.")
    assert splitter.flush() == ("", "\nuse")
    assert not splitter.stopped


def test_an_unclosed_block_stays_in_reasoning_at_the_end() -> None:
    splitter = StreamSplitter()
    splitter.feed("<think>Blue or red")
    assert splitter.flush() == ("", "")
    assert splitter.in_reasoning


FRAGMENTS = ["<think>", "</think>", "<th", "ink>", "</", "a", "b ", "\n", "STOP", "ST", "<", ">",
             "<|channel|>", "analysis<|message|>", "<channel|>", "é"]


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=14),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=6),
    start=st.booleans(),
)
def test_any_chunking_gives_the_one_shot_result(
    pieces: list[str], cuts: list[int], start: bool
) -> None:
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    assert run(("STOP",), start, chunks) == run(("STOP",), start, [text])
