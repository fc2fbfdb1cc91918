"""Accumulate koboldcpp's streamed chat completion (pure; seed "Streaming progress",
"6. Submit the reply").

Input: each SSE event's ``data`` of ``/v1/chat/completions`` (1.116.1 L5368-5768):
chunks (``"object": "chat.completion.chunk"``) whose ``choices[0].delta`` holds ``content`` and
``reasoning_content``, the last one the finish reason; a ``"choices": []`` chunk
with ``usage``; for tools, after generation, a chunk per call with its id and name,
then one per call with its arguments; ``[DONE]``.

Each event releases client-visible text: content goes through
``reasoning.StreamSplitter`` (reasoning tags, stop sequences), koboldcpp's own
``reasoning_content`` passes through, U+0000 is removed from both, and the
reasoning's surrounding whitespace is held back, so the released text is what the
submit stores. An in-band error (``error`` or ``detail``) or data that is not a
JSON object sets ``error``: ``result()`` then raises ReplyError.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ReplyError
from ..koboldcpp.answers import BackendReply
from ..koboldcpp.reasoning import StreamSplitter
from .submits import strip_nul

log = logging.getLogger("koboldcpp_horde_chat.stream")

_ERROR_TEXT_MAX = 300


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """New client-visible text released by one event or by ``flush()``."""

    content: str = ""
    reasoning: str = ""


_EMPTY = StreamDelta()


@dataclass
class _ToolCall:
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: list[str] = field(default_factory=list)


class ChatStreamAccumulator:
    """One streamed chat completion: ``done`` once ``[DONE]`` came, ``error`` the
    in-band error or malformed event, the finish reason and usage as last sent."""

    def __init__(
        self, *, stop_sequences: Iterable[str] = (), start_in_reasoning: bool = False
    ) -> None:
        self._splitter = StreamSplitter(
            stop_sequences=tuple(stop_sequences), start_in_reasoning=start_in_reasoning
        )
        self._content: list[str] = []
        self._reasoning: list[str] = []
        # Reasoning whitespace not released yet: nothing is released before the
        # first non-whitespace reasoning, and a trailing run waits for more.
        self._reasoning_started = False
        self._reasoning_held = ""
        self._saw_content = False
        self._tool_calls: dict[int, _ToolCall] = {}
        self._flushed = False
        self.done = False
        self.error: str | None = None
        self.native_finish_reason: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None

    def feed_event(self, data: str) -> StreamDelta:
        """The text one event's data releases (often none). Never raises; events after
        ``[DONE]`` or an error are ignored."""
        if self.done or self.error is not None:
            return _EMPTY
        if data.strip() == "[DONE]":
            self.done = True
            return _EMPTY
        try:
            chunk = json.loads(data)
        except ValueError:
            return self._fail(f"event data is not JSON: {data[:80]!r}")
        if not isinstance(chunk, dict):
            return self._fail(f"event data is not a JSON object: {data[:80]!r}")
        if chunk.get("error") is not None or chunk.get("detail") is not None:
            return self._fail(f"koboldcpp reported an error: {_error_text(chunk)}")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            for key in ("prompt_tokens", "completion_tokens"):
                value = usage.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    setattr(self, key, value)
        choices = chunk.get("choices")
        if choices is not None and not isinstance(choices, list):
            return self._fail("chunk choices is not a list")
        if not choices:
            return _EMPTY
        choice = choices[0]  # koboldcpp sends one choice (1.116.1 L5634)
        if not isinstance(choice, dict):
            return self._fail("chunk choice is not an object")
        finish = choice.get("finish_reason")
        if isinstance(finish, str):
            self.native_finish_reason = finish
        delta = choice.get("delta")
        if delta is not None and not isinstance(delta, dict):
            return self._fail("chunk delta is not an object")
        if not delta:
            return _EMPTY
        tool_calls = delta.get("tool_calls")
        if tool_calls is not None:
            problem = self._add_tool_calls(tool_calls)
            if problem:
                return self._fail(problem)
        reasoning = delta.get("reasoning_content")
        reasoning = strip_nul(reasoning) if isinstance(reasoning, str) else ""
        content = delta.get("content")
        split_reasoning = split_content = ""
        if isinstance(content, str):
            self._saw_content = True
            content = strip_nul(content)
            if content:
                split_reasoning, split_content = self._splitter.feed(content)
        return self._emit(split_content, reasoning + split_reasoning)

    def flush(self) -> StreamDelta:
        """Release the held-back text at the end (trailing reasoning whitespace dropped)."""
        if self._flushed:
            return _EMPTY
        self._flushed = True
        reasoning, content = self._splitter.flush()
        released = self._emit(content, reasoning)
        self._reasoning_held = ""
        return released

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls so far, in index order: id, type and name from the first fragment
        carrying them, arguments joined (checked later by ``submits.normalise_tool_calls``)."""
        return [
            {
                "id": call.id,
                "type": call.type if call.type is not None else "function",
                "function": {"name": call.name, "arguments": "".join(call.arguments)},
            }
            for _, call in sorted(self._tool_calls.items())
        ]

    def result(self) -> BackendReply:
        """The whole reply (flushed). ``content`` is None when no content came and
        there are tool calls; ``reasoning_content`` None when empty.

        Raises ReplyError after an in-band error or a malformed event.
        """
        if self.error is not None:
            raise ReplyError(self.error)
        self.flush()
        calls = self.tool_calls()
        content: str | None = "".join(self._content)
        if not content and not self._saw_content and calls:
            content = None
        return BackendReply(
            content=content, reasoning_content="".join(self._reasoning) or None,
            tool_calls=calls, native_finish_reason=self.native_finish_reason,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
        )

    def _emit(self, content: str, reasoning: str) -> StreamDelta:
        # Reasoning releasable now: the whole reasoning's leading whitespace
        # dropped, a trailing run held back until more reasoning follows.
        if not self._reasoning_started:
            reasoning = reasoning.lstrip()
            self._reasoning_started = bool(reasoning)
        text = self._reasoning_held + reasoning
        reasoning = text.rstrip()
        self._reasoning_held = text[len(reasoning) :]
        self._content.append(content)
        self._reasoning.append(reasoning)
        return StreamDelta(content, reasoning)

    def _fail(self, problem: str) -> StreamDelta:
        log.warning("chat stream failed: %s", problem)
        self.error = problem
        return _EMPTY

    def _add_tool_calls(self, raw: object) -> str | None:
        if not isinstance(raw, list):
            return "delta tool_calls is not a list"
        for item in raw:
            if not isinstance(item, dict):
                return "a tool_calls fragment is not an object"
            index = item.get("index")
            if not isinstance(index, int) or isinstance(index, bool):
                # No index: a fragment with an id starts a call, one without
                # continues the latest call.
                starts = item.get("id") is not None or not self._tool_calls
                index = max(self._tool_calls, default=-1) + (1 if starts else 0)
            call = self._tool_calls.setdefault(index, _ToolCall())
            for key in ("id", "type"):
                if getattr(call, key) is None and isinstance(item.get(key), str):
                    setattr(call, key, item[key])
            function = item.get("function")
            if function is None:
                continue
            if not isinstance(function, dict):
                return "a tool_calls fragment's function is not an object"
            if call.name is None and isinstance(function.get("name"), str):
                call.name = function["name"]
            arguments = function.get("arguments")
            if arguments is None:
                continue
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            call.arguments.append(arguments)
        return None


def _error_text(chunk: dict[str, Any]) -> str:
    value = chunk["error"] if chunk.get("error") is not None else chunk.get("detail")
    if isinstance(value, dict):
        texts = [value.get(key) for key in ("message", "msg", "error", "type")]
        value = next((text for text in texts if isinstance(text, str) and text), value)
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text[:_ERROR_TEXT_MAX]
