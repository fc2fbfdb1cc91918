"""The structured submit and the fault submit (pure; seed "6. Submit the reply",
"Submit refusals", "7. Fault a job").

The Horde refuses a submit holding U+0000 (400 ``NulByteInPayload``) and models do
emit it: it is removed here from all the model produced, and from the stream where
it is read, so the posts and the submit agree.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from ..errors import ReplyError
from ..horde.progress import utf8_prefix
from ..koboldcpp.answers import BackendReply
from ..koboldcpp.reasoning import split_reasoning

log = logging.getLogger("koboldcpp_horde_chat.reply")

#: The finish reasons the Horde accepts in a structured submit.
FINISH_REASONS = frozenset({"stop", "length", "content_filter", "tool_calls"})
FAULT_PROMPT_OVERFLOW = "prompt_overflow"
FAULT_REPLY_REFUSED = "reply_refused"
NATIVE_FINISH_REASON_MAX_CHARS = 32
REASONING_MAX_BYTES = 1024 * 1024
#: The Horde refuses token counts outside 0..10,000,000: they are left out.
TOKEN_COUNT_MAX = 10_000_000

_NUL = "\x00"
#: A JSON ``\\u0000`` escape whose backslash is not itself escaped.
_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def strip_nul(text: str) -> str:
    return text.replace(_NUL, "") if _NUL in text else text


def strip_nul_json(text: str) -> str:
    """JSON text (need not be valid) without U+0000, literal or as a real ``\\u0000``
    escape; ``'{"a": "x\\\\u0000"}'`` (an escaped backslash) is kept."""
    text = strip_nul(text)
    if "\\u0000" not in text:
        return text
    return _NUL_ESCAPE.sub(r"\1", text)


def map_finish_reason(
    native: str | None,
    *,
    has_tool_calls: bool,
    completion_tokens: int | None,
    max_length: int,
) -> str:
    """koboldcpp's finish reason as one of the Horde's four.

    koboldcpp says ``"length"`` for a stop sequence or an abort too (1.116.1 L5194):
    it stays ``"length"`` only when ``completion_tokens`` is unknown or reached
    ``max_length`` (the budget after koboldcpp's own cut). ``"tool_calls"`` without
    calls is ``"stop"``. Raises ReplyError for ``"error"``, None or another value.
    """
    if native == "length":
        if completion_tokens is None or completion_tokens >= max_length:
            return "length"
        return "stop"
    if native in ("stop", "content_filter"):
        return native
    if native == "tool_calls":
        return "tool_calls" if has_tool_calls else "stop"
    raise ReplyError(f"unusable finish reason {native!r}")


def normalise_tool_calls(raw: object) -> list[dict[str, Any]]:
    """The tool calls as ``{"id", "type": "function", "function": {"name",
    "arguments": str}}``, without U+0000: arguments JSON-encoded (missing: ``"{}"``),
    a missing id minted ``call_<n>``, a repeated one suffixed ``_<n>``.

    Raises ReplyError (``feature`` ``"tools"``) for a malformed call or list.
    """
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ReplyError("tool_calls is not a list", feature="tools")
    parsed: list[tuple[str | None, str, str]] = []
    for i, call in enumerate(raw):
        if not isinstance(call, dict):
            raise ReplyError(f"tool_calls[{i}] is not an object", feature="tools")
        kind = call.get("type", "function")
        if kind is not None and kind != "function":
            raise ReplyError(f"tool_calls[{i}].type is {kind!r}, not 'function'", feature="tools")
        function = call.get("function")
        if not isinstance(function, dict):
            raise ReplyError(f"tool_calls[{i}].function is not an object", feature="tools")
        name = function.get("name")
        name = strip_nul(name) if isinstance(name, str) else ""
        if not name:
            raise ReplyError(f"tool_calls[{i}].function.name is missing", feature="tools")
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = "{}" if arguments is None else json.dumps(arguments, ensure_ascii=False)
        arguments = strip_nul_json(arguments)
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise ReplyError(f"tool_calls[{i}].id is not a string", feature="tools")
        parsed.append((strip_nul(call_id) if call_id else None, name, arguments))

    given = {call_id for call_id, _, _ in parsed if call_id}
    used: set[str] = set()
    result: list[dict[str, Any]] = []
    for i, (call_id, name, arguments) in enumerate(parsed):
        if call_id is not None and call_id not in used:
            final_id = call_id
        else:
            base, n = (f"{call_id}_", 2) if call_id is not None else ("call_", i + 1)
            while f"{base}{n}" in used or f"{base}{n}" in given:
                n += 1
            final_id = f"{base}{n}"
        used.add(final_id)
        result.append(
            {"id": final_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    return result


def chat_submit(
    job_id: str, model_id: str, reply: BackendReply, *, max_length: int
) -> dict[str, Any]:
    """The structured submit of a served chat job, e.g. ``{"id": "<job-id>", "message":
    {"role": "assistant", "content": "Blue."}, "finish_reason": "stop",
    "native_finish_reason": "stop", "prompt_tokens": 21, "completion_tokens": 3,
    "model_id": "<model-name>", "state": "ok"}``.

    Reasoning tags left in the content are split off; ``reasoning_content`` is cut
    to 1 MiB of UTF-8; ``content`` is null only for tool calls without text.
    ``max_length``: the budget koboldcpp generated under, tokens. Raises ReplyError
    (the job is then faulted without a reason).
    """
    calls = normalise_tool_calls(reply.tool_calls)
    finish_reason = map_finish_reason(
        reply.native_finish_reason, has_tool_calls=bool(calls),
        completion_tokens=reply.completion_tokens, max_length=max_length,
    )
    split = split_reasoning(
        None if reply.content is None else strip_nul(reply.content),
        None if reply.reasoning_content is None else strip_nul(reply.reasoning_content),
    )
    content = None if calls and not (split.content or "").strip() else split.content or ""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if split.reasoning:
        reasoning = utf8_prefix(split.reasoning, REASONING_MAX_BYTES)
        if len(reasoning) < len(split.reasoning):
            log.warning("job %s: reasoning_content cut to %d bytes", job_id, REASONING_MAX_BYTES)
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    body: dict[str, Any] = {"id": job_id, "message": message, "finish_reason": finish_reason}
    native = strip_nul(reply.native_finish_reason or "")
    if native:
        body["native_finish_reason"] = native[:NATIVE_FINISH_REASON_MAX_CHARS]
    for key in ("prompt_tokens", "completion_tokens"):
        count = getattr(reply, key)
        if count is not None and 0 <= count <= TOKEN_COUNT_MAX:
            body[key] = count
        elif count is not None:
            log.warning("leaving out %s=%d: outside 0..%d", key, count, TOKEN_COUNT_MAX)
    body.update(model_id=model_id, state="ok")
    return body


def text_submit(job_id: str, generation: str) -> dict[str, Any]:
    return {"id": job_id, "generation": strip_nul(generation), "state": "ok"}


def job_fault_submit(
    job_id: str, kind: str, model_id: str, fault_reason: str | None = None
) -> dict[str, Any]:
    """A job's fault in its kind's shape: a chat fault's ``model_id`` marks it a chat
    submit (no generation needed); a text fault has no reason (seed step 8)."""
    if kind != "chat":
        return {"id": job_id, "generation": "", "state": "faulted"}
    body: dict[str, Any] = {"id": job_id, "state": "faulted", "model_id": model_id}
    if fault_reason:
        body["fault_reason"] = fault_reason
    return body
