"""koboldcpp's answers to a generation, read (pure): a chat completion, a text
generation, and the raw stop reason that tells an abort from a stop sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ReplyError


@dataclass(frozen=True)
class BackendReply:
    """One chat generation as koboldcpp sent it, whole or streamed: ``content`` may
    still hold reasoning tags; None where koboldcpp sent null or nothing."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    native_finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def _optional_count(usage: dict[str, Any], key: str) -> int | None:
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _optional_str(holder: dict[str, Any], key: str, where: str) -> str | None:
    value = holder.get(key)
    if value is not None and not isinstance(value, str):
        raise ReplyError(f"{where}{key} is not a string or null")
    return value


def parse_chat_completion(body: object) -> BackendReply:
    """The first choice of a decoded ``/v1/chat/completions`` answer.

    Raises ReplyError: no first choice or message, or a field of the wrong type.
    """
    if not isinstance(body, dict):
        raise ReplyError("the chat completion is not a JSON object")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ReplyError("the chat completion has no choices")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise ReplyError("choices[0] is not an object")
    message = choice.get("message")
    if not isinstance(message, dict):
        raise ReplyError("choices[0].message is not an object")
    content = _optional_str(message, "content", "choices[0].message.")
    reasoning = _optional_str(message, "reasoning_content", "choices[0].message.")
    tool_calls = message.get("tool_calls")
    if tool_calls is None:
        tool_calls = []
    if not isinstance(tool_calls, list):
        raise ReplyError("choices[0].message.tool_calls is not a list")
    finish = _optional_str(choice, "finish_reason", "choices[0].")
    usage = body.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    return BackendReply(
        content=content,
        reasoning_content=reasoning,
        tool_calls=tool_calls,
        native_finish_reason=finish,
        prompt_tokens=_optional_count(usage, "prompt_tokens"),
        completion_tokens=_optional_count(usage, "completion_tokens"),
    )


def _first_result(body: object) -> dict[str, Any] | None:
    results = body.get("results") if isinstance(body, dict) else None
    if isinstance(results, list) and results and isinstance(results[0], dict):
        return results[0]
    return None


def text_generation(body: object) -> str:
    """The text of ``{"results": [{"text": str, ...}]}``; ReplyError for another shape."""
    first = _first_result(body)
    if first is None:
        raise ReplyError("the generate answer has no results")
    text = first.get("text")
    if not isinstance(text, str):
        raise ReplyError("results[0].text is not a string")
    return text


def text_completion_tokens(body: object) -> int | None:
    """``results[0].completion_tokens`` (1.116.1 L5340-5341), or None (an older
    koboldcpp). Never raises."""
    first = _first_result(body)
    return None if first is None else _optional_count(first, "completion_tokens")


#: ``/api/extra/perf``'s ``stop_reason`` for a generation out of tokens: its budget,
#: or an abort (1.116.1 ``expose.h`` L24, ``gpttype_adapter.cpp`` L5217).
KCPP_STOP_OUT_OF_TOKENS = 0


def needs_stop_reason(native: str | None, completion_tokens: int | None, max_length: int) -> bool:
    """True for ``"length"`` below the budget: a stop sequence or an abort, told
    apart only by the raw stop reason (:func:`aborted_short`)."""
    return native == "length" and completion_tokens is not None and completion_tokens < max_length


def aborted_short(stop_reason: object) -> bool:
    """True for an abort (``0``), False for a stop sequence (``2``) or unknown."""
    return stop_reason == KCPP_STOP_OUT_OF_TOKENS and not isinstance(stop_reason, bool)
