"""What koboldcpp does to generated text: the reasoning split (whole and streamed into
chunk deltas) and stop strings held back and trimmed.
"""

from __future__ import annotations

from typing import Any

from koboldcpp_horde_chat.devkit.kcpp.values import THINK_PAIRS


def split_reasoning(text: str) -> tuple[str, str]:
    """koboldcpp's non-stream split: ``(content, reasoning)`` (1.116.1 ``koboldcpp.py`` L5208-5225).

    The first tag pair found decides: both tags present -> the text between them
    is the reasoning; only the end tag -> everything before it. Otherwise the
    text stays whole (an unclosed ``<think>`` remains in the content).
    """
    for start, end in THINK_PAIRS:
        start_idx = text.find(start)
        end_idx = text.find(end, start_idx + len(start))
        if start_idx != -1 and end_idx != -1 and start_idx < end_idx:
            reasoning = text[start_idx + len(start) : end_idx]
            return text[:start_idx] + text[end_idx + len(end) :], reasoning
        if start not in text and end in text:
            before, after = text.split(end, 1)
            return after, before
    return text, ""


def _overlaps_stop(text: str, stops: list[str]) -> bool:
    """True when ``text`` holds a stop string or ends with the start of one."""
    for stop in stops:
        if stop in text:
            return True
        for n in range(1, len(stop)):
            if text.endswith(stop[:n]):
                return True
    return False


def _trim_stops(text: str, stops: list[str]) -> str:
    for stop in stops:
        idx = text.find(stop)
        if idx != -1 and stop:
            text = text[:idx]
    return text


class OaiStreamSplitter:
    """Turns generated pieces into chat-completion chunk deltas as koboldcpp does.

    ``step(piece)`` returns the deltas to send now (maybe none, while a possible
    tag or stop string is held back); ``finish(reason)`` returns the last ones:
    a leftover content chunk (``finish_reason`` None) when text remained, then
    the final chunk with the reason. Each item is ``(delta, finish_reason)``.
    Every delta carries ``"role": "assistant"`` (1.116.1 ``koboldcpp.py`` L5503).
    """

    def __init__(self, stops: list[str], *, encapsulate_thinking: bool = True) -> None:
        self.stops = stops
        self.encapsulate = encapsulate_thinking
        self.tag_buf = ""
        self.reserve = ""
        self.in_thinking = False
        self.pairs: list[tuple[str, str]] = list(THINK_PAIRS)

    def step(self, piece: str) -> list[tuple[dict[str, Any], str | None]]:
        return self._poll(piece, done=False, reason=None)

    def finish(self, reason: str | None) -> list[tuple[dict[str, Any], str | None]]:
        return self._poll("", done=True, reason=reason)

    def _poll(
        self, piece: str, *, done: bool, reason: str | None
    ) -> list[tuple[dict[str, Any], str | None]]:
        text = self.tag_buf + piece
        self.tag_buf = ""
        if not done and self.encapsulate:
            tail = ""
            for pair in self.pairs:
                for tag in pair:
                    for n in range(1, len(tag)):
                        if text.endswith(tag[:n]) and n > len(tail):
                            tail = tag[:n]
            if tail:
                self.tag_buf = tail
                text = text[: -len(tail)]
        if not done and self.stops and _overlaps_stop(text, self.stops):
            self.reserve += text
            return []
        if text or self.reserve:
            text = _trim_stops(self.reserve + text, self.stops)
            self.reserve = ""
        if not text and not done:
            return []
        delta = self._route(text)
        out: list[tuple[dict[str, Any], str | None]] = []
        if done and text:
            out.append((delta, None))
            delta = {"role": "assistant", "content": ""}
        out.append((delta, reason if done else None))
        return out

    def _route(self, text: str) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant"}
        if not self.encapsulate:
            delta["content"] = text
            return delta
        if self.in_thinking:
            for start, end in self.pairs:
                if end in text:
                    self.in_thinking = False
                    before, after = text.split(end, 1)
                    before = before.replace(start, "")
                    after = after.replace(end, "")
                    if before:
                        delta["reasoning_content"] = before
                    if after:
                        delta["content"] = after
                    return delta
            start = self.pairs[-1][0]
            delta["reasoning_content"] = text.replace(start, "")
            return delta
        for start, end in self.pairs:
            if start in text:
                self.in_thinking = True
                self.pairs = [(start, end)]
                before, after = text.split(start, 1)
                if before:
                    delta["content"] = before
                if after:
                    delta["reasoning_content"] = after
                if end in after:
                    self.in_thinking = False
                    thought, rest = after.split(end, 1)
                    delta["reasoning_content"] = thought
                    if rest:
                        delta["content"] = delta.get("content", "") + rest
                return delta
        if len(self.pairs) == 1 and self.pairs[0][1] in text:
            text = text.replace(self.pairs[0][1], "")
        delta["content"] = text
        return delta
