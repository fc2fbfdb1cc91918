"""Split reasoning blocks off a reply, whole or streamed (pure; seed "6. Submit the
reply" and "Streaming progress").

koboldcpp usually splits reasoning off itself; this handles content that still holds
one of its tag pairs (``thinkformats``, 1.116.1 L182-186): a closed block becomes
reasoning, an end tag without a start makes the text before it reasoning, a start
tag never closed makes the rest reasoning. The content is the text outside blocks
exactly as generated; the reasoning the text inside, joined, without the whitespace
around the whole. A stream holds that whitespace back (posts cannot take text
back), so the posted reasoning equals the submitted one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

THINK_TAGS: tuple[tuple[str, str], ...] = (
    ("<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"),
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<|channel>thought", "<channel|>"),
)

START_TAGS: tuple[str, ...] = tuple(start for start, _ in THINK_TAGS)
END_TAGS: tuple[str, ...] = tuple(end for _, end in THINK_TAGS)

_START, _END, _SWALLOW, _STOP = "start", "end", "swallow", "stop"
# What ends or swallows text inside a block, and what starts or swallows one outside.
_IN_REASONING = [(tag, _END) for tag in END_TAGS] + [(tag, _SWALLOW) for tag in START_TAGS]
_IN_CONTENT = [(tag, _START) for tag in START_TAGS] + [(tag, _SWALLOW) for tag in END_TAGS]


@dataclass(frozen=True)
class ReasoningSplit:
    """``unclosed``: the reply ended inside a block a start tag opened."""

    content: str | None
    reasoning: str | None
    unclosed: bool = False


class StreamSplitter:
    """Separates reasoning from content across streamed chunks split anywhere: a
    tail that could still become a tag or a stop sequence is held back. Stray tags
    are dropped; the first stop sequence in the content ends it. ``start_in_reasoning``:
    the prompt opened a block.

    ``feed("<thi")`` gives ``("", "")``, then ``feed("nk>Hmm</think>Blue.")``
    gives ``("Hmm", "Blue.")``.
    """

    def __init__(
        self, stop_sequences: Iterable[str] = (), start_in_reasoning: bool = False
    ) -> None:
        self._content_needles = _IN_CONTENT + [(stop, _STOP) for stop in stop_sequences if stop]
        self.in_reasoning = start_in_reasoning
        self._buffer = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, str]:
        """Add a chunk; returns ``(reasoning, content)`` ready to release."""
        if self.stopped:
            return "", ""
        self._buffer += text
        return _join(self._process(final=False))

    def flush(self) -> tuple[str, str]:
        """Release the held tail at the end (a partial tag there is text)."""
        if self.stopped:
            return "", ""
        return _join(self._process(final=True))

    def _process(self, *, final: bool) -> list[tuple[bool, str]]:
        """Consume the buffer as far as possible; ``(is_reasoning, text)`` pieces."""
        pieces: list[tuple[bool, str]] = []

        def emit(text: str) -> None:
            if text:
                pieces.append((self.in_reasoning, text))

        while True:
            buf = self._buffer
            needles = _IN_REASONING if self.in_reasoning else self._content_needles
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
                self.stopped = True
                self._buffer = ""
                break
            if kind in (_START, _END):
                self.in_reasoning = kind == _START
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
    """The smallest index whose suffix of ``buf`` is a proper prefix of a needle
    (``needles`` not empty)."""
    longest = max(len(n) for n in needles)
    for start in range(max(0, len(buf) - longest + 1), len(buf)):
        tail = buf[start:]
        if any(len(n) > len(tail) and n.startswith(tail) for n in needles):
            return start
    return None


def _clean(text: str | None) -> str | None:
    return (text or "").strip() or None


def split_reasoning(content: str | None, reasoning: str | None) -> ReasoningSplit:
    """A whole reply's content and reasoning (koboldcpp's, then the blocks left in
    the content); empty reasoning is None. ``"<think>Hmm</think>\\n\\nBlue."`` gives
    ``("\\n\\nBlue.", "Hmm", False)``, ``"<think>Hmm"`` gives ``("", "Hmm", True)``.
    """
    tags = [(t, _START) for t in START_TAGS] + [(t, _END) for t in END_TAGS]
    first = None if content is None else _earliest(content, tags)
    if content is None or first is None:
        return ReasoningSplit(content=content, reasoning=_clean(reasoning), unclosed=False)
    # An end tag first: the prompt opened the block.
    splitter = StreamSplitter(start_in_reasoning=first[2] == _END)
    splitter._buffer = content
    found, answer = _join(splitter._process(final=True))
    return ReasoningSplit(
        content=answer, reasoning=_clean((reasoning or "") + found), unclosed=splitter.in_reasoning
    )
