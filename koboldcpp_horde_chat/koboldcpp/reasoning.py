"""Split reasoning blocks off a reply, whole or streamed (pure; no I/O).

Seed section: "6. Submit the reply" (``message.reasoning_content``) and
"Streaming progress" (reasoning posted apart from content).

koboldcpp usually splits the reasoning off itself (``reasoning_content`` in
its chat completion and in its stream deltas). This module handles what is
left: content that still holds reasoning tags, from any of koboldcpp's five
tag pairs (``thinkformats``, 1.116.1 ``koboldcpp.py`` L182-186):

- a closed block ``<think>...</think>`` moves to the reasoning;
- an end tag without a start tag (the template opened the block) makes the
  text before it reasoning;
- a start tag that never closes makes everything after it reasoning
  (generation stopped inside the block).

One rule for a reply's text, whole or streamed, posted or submitted: the
content is the text generated outside reasoning blocks, exactly as generated
(koboldcpp keeps it so too); the reasoning is the text generated inside them,
in order and joined as generated, without the whitespace around the whole
(``"\\n  Let me ponder.\\n\\n"`` gives ``"Let me ponder."``). Progress posts cannot
take text back, so a stream holds back the reasoning's leading whitespace and
any trailing whitespace until more reasoning follows (see :mod:`.stream`); the
posted reasoning then equals the submitted one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger("koboldcpp_horde_chat.reasoning")

THINK_TAGS: tuple[tuple[str, str], ...] = (
    ("<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"),
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<|channel>thought", "<channel|>"),
)
"""koboldcpp's reasoning tag pairs, (start, end)."""

START_TAGS: tuple[str, ...] = tuple(start for start, _ in THINK_TAGS)
END_TAGS: tuple[str, ...] = tuple(end for _, end in THINK_TAGS)

_START, _END, _SWALLOW, _STOP = "start", "end", "swallow", "stop"


@dataclass(frozen=True)
class ReasoningSplit:
    """A reply's content and reasoning, separated.

    Attributes:
        content: the answer text without reasoning blocks; None when the
            backend sent null content.
        reasoning: the reasoning text, or None when there was none.
        unclosed: the reply ended inside a reasoning block that a start tag
            opened and no end tag closed (generation stopped while thinking).
    """

    content: str | None
    reasoning: str | None
    unclosed: bool = False


class StreamSplitter:
    """Separate reasoning from content across streamed text chunks.

    Feed the content deltas in order; each call returns the reasoning and the
    content that can be released so far. Chunk boundaries may fall anywhere,
    even inside a tag or a stop sequence: a tail that could still become a
    tag or a stop sequence is held back until the next chunk or :meth:`flush`.
    Reasoning tags are removed; a stray start tag inside reasoning and a stray
    end tag inside content are dropped. The first complete stop sequence in
    the content ends the content: it and everything after it are discarded.

    Args:
        stop_sequences: the job's stop sequences (applied to content only).
        start_in_reasoning: the prompt opened a reasoning block (the template
            ended with a start tag), so the output begins as reasoning.

    Example::

        s = StreamSplitter()
        s.feed("<thi")          # ("", "")   held: could be "<think>"
        s.feed("nk>Hmm</think>Blue.")  # ("Hmm", "Blue.")
    """

    def __init__(
        self, stop_sequences: Iterable[str] = (), start_in_reasoning: bool = False
    ) -> None:
        self._stops: tuple[str, ...] = tuple(s for s in stop_sequences if s)
        self._in_reasoning = start_in_reasoning
        self._buffer = ""
        self._stopped = False

    @property
    def in_reasoning(self) -> bool:
        """True while the text is inside a reasoning block."""
        return self._in_reasoning

    @property
    def stopped(self) -> bool:
        """True once a stop sequence ended the content; later text is ignored."""
        return self._stopped

    def feed(self, text: str) -> tuple[str, str]:
        """Add a chunk; return ``(reasoning_delta, content_delta)`` ready to release."""
        if self._stopped:
            return "", ""
        self._buffer += text
        return _join(self._process(final=False))

    def flush(self) -> tuple[str, str]:
        """Release the held tail at the end of the stream.

        A partial tag or partial stop sequence left at the end is real text.
        Returns ``(reasoning_delta, content_delta)``.
        """
        if self._stopped:
            return "", ""
        return _join(self._process(final=True))

    def _needles(self) -> list[tuple[str, str]]:
        if self._in_reasoning:
            return [(tag, _END) for tag in END_TAGS] + [(tag, _SWALLOW) for tag in START_TAGS]
        return (
            [(tag, _START) for tag in START_TAGS]
            + [(tag, _SWALLOW) for tag in END_TAGS]
            + [(stop, _STOP) for stop in self._stops]
        )

    def _process(self, *, final: bool) -> list[tuple[bool, str]]:
        """Consume the buffer as far as possible; return ``(is_reasoning, text)`` pieces."""
        pieces: list[tuple[bool, str]] = []

        def emit(text: str) -> None:
            if text:
                pieces.append((self._in_reasoning, text))

        while True:
            buf = self._buffer
            needles = self._needles()
            event = _earliest(buf, needles)
            hold = None if final else _partial_start(buf, [n for n, _ in needles])
            if event is None:
                cut = len(buf) if hold is None else hold
                emit(buf[:cut])
                self._buffer = buf[cut:]
                break
            pos, needle, kind = event
            if hold is not None and hold <= pos:
                # A longer needle may still complete from `hold`: wait for more text.
                emit(buf[:hold])
                self._buffer = buf[hold:]
                break
            emit(buf[:pos])
            self._buffer = buf[pos + len(needle) :]
            if kind == _STOP:
                self._stopped = True
                self._buffer = ""
                break
            if kind == _START:
                self._in_reasoning = True
            elif kind == _END:
                self._in_reasoning = False
        return pieces


def _join(pieces: list[tuple[bool, str]]) -> tuple[str, str]:
    reasoning = "".join(text for is_reasoning, text in pieces if is_reasoning)
    content = "".join(text for is_reasoning, text in pieces if not is_reasoning)
    return reasoning, content


def _earliest(buf: str, needles: list[tuple[str, str]]) -> tuple[int, str, str] | None:
    """The first complete needle in ``buf``; at one position the longest wins."""
    best: tuple[int, str, str] | None = None
    for needle, kind in needles:
        pos = buf.find(needle)
        if pos < 0:
            continue
        if best is None or pos < best[0] or (pos == best[0] and len(needle) > len(best[1])):
            best = (pos, needle, kind)
    return best


def _partial_start(buf: str, needles: list[str]) -> int | None:
    """The smallest index whose suffix of ``buf`` is a proper prefix of a needle."""
    if not needles:
        return None
    longest = max(len(n) for n in needles)
    for start in range(max(0, len(buf) - longest + 1), len(buf)):
        tail = buf[start:]
        if any(len(n) > len(tail) and n.startswith(tail) for n in needles):
            return start
    return None


def _has_tag(text: str) -> bool:
    return any(tag in text for tag in START_TAGS + END_TAGS)


def _opened_by_template(text: str) -> bool:
    """True when the first tag in ``text`` is an end tag (the prompt opened the block)."""
    first = _earliest(
        text, [(t, _START) for t in START_TAGS] + [(t, _END) for t in END_TAGS]
    )
    return first is not None and first[2] == _END


def _clean(text: str | None) -> str | None:
    if text is None:
        return None
    text = text.strip()
    return text or None


def split_reasoning(content: str | None, reasoning: str | None) -> ReasoningSplit:
    """Separate reasoning from a whole reply's content.

    Args:
        content: the reply's ``message.content`` (may hold reasoning tags), or None.
        reasoning: the ``reasoning_content`` koboldcpp already split off, or None.

    Returns:
        A :class:`ReasoningSplit` under the module's rule: the content is the
        text outside reasoning blocks as generated (content without tags is
        returned unchanged); the reasoning is koboldcpp's reasoning followed by
        the text of every block left in the content, joined as generated, with
        the whitespace around the whole removed; empty reasoning is None.
        ``unclosed`` is True when a start tag never closed (then the content is
        the text before that tag, usually ``""``).

    Example: ``split_reasoning("<think>Hmm</think>\\n\\nBlue.", None)`` gives
    ``ReasoningSplit("\\n\\nBlue.", "Hmm", False)`` (koboldcpp's own split of
    that text keeps the same content); ``split_reasoning("<think>Hmm", None)``
    gives ``ReasoningSplit("", "Hmm", True)``.
    """
    if content is None or not _has_tag(content):
        return ReasoningSplit(content=content, reasoning=_clean(reasoning), unclosed=False)
    splitter = StreamSplitter(start_in_reasoning=_opened_by_template(content))
    splitter._buffer = content
    pieces = splitter._process(final=True)
    unclosed = splitter.in_reasoning
    found = "".join(text for is_reasoning, text in pieces if is_reasoning)
    answer = "".join(text for is_reasoning, text in pieces if not is_reasoning)
    return ReasoningSplit(
        content=answer, reasoning=_clean((reasoning or "") + found), unclosed=unclosed
    )
