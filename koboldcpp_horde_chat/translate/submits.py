"""The structured submit and the fault submit (pure; no I/O).

Seed sections: "6. Submit the reply", "Submit refusals", "7. Fault a job".

The Horde's database cannot store U+0000, so the Horde refuses a submit whose
JSON holds it (400 ``NulByteInPayload``); models do emit it. The submit
builders here remove it from everything the model produced (:func:`strip_nul`,
:func:`strip_nul_json`); the streamed text loses it where the stream is read
(:mod:`.stream`), so the posts and the submit agree.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from ..errors import ReplyError
from ..koboldcpp.answers import BackendReply
from ..koboldcpp.reasoning import split_reasoning

log = logging.getLogger("koboldcpp_horde_chat.reply")


# --- constants ------------------------------------------------------------------

FINISH_REASONS = frozenset({"stop", "length", "content_filter", "tool_calls"})
"""The finish reasons the Horde accepts in a structured submit."""

FAULT_PROMPT_OVERFLOW = "prompt_overflow"
FAULT_REPLY_REFUSED = "reply_refused"
"""Return codes of a refused reply: the job is then faulted with ``reply_refused``."""

NATIVE_FINISH_REASON_MAX_CHARS = 32
REASONING_MAX_BYTES = 1024 * 1024
"""``reasoning_content`` is capped at 1 MiB of UTF-8."""
TOKEN_COUNT_MAX = 10_000_000
"""Token counts outside 0..10,000,000 are refused by the Horde, so they are left out."""


# --- U+0000 ------------------------------------------------------------------------

_NUL = "\x00"
_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")
"""A JSON ``\\u0000`` escape whose backslash is not itself escaped (pairs of
backslashes before it are kept)."""


def strip_nul(text: str) -> str:
    """``text`` without any U+0000 character (``"Blue\\x00."`` -> ``"Blue."``)."""
    return text.replace(_NUL, "") if _NUL in text else text


def strip_nul_json(text: str) -> str:
    """JSON text (a tool call's ``arguments``) without U+0000, literal or escaped.

    Removes every literal U+0000 character and every real ``\\u0000`` escape,
    which a client would decode to U+0000; an escaped backslash followed by
    ``u0000`` is text and stays. E.g. ``'{"a": "x\\u0000y"}'`` ->
    ``'{"a": "xy"}'``, ``'{"a": "x\\\\u0000"}'`` unchanged. The text need not
    be valid JSON.
    """
    text = strip_nul(text)
    if "\\u0000" not in text:
        return text
    return _NUL_ESCAPE.sub(r"\1", text)


# --- koboldcpp's answers ----------------------------------------------------------


def map_finish_reason(
    native: str | None,
    *,
    has_tool_calls: bool,
    completion_tokens: int | None,
    max_length: int,
) -> str:
    """Map koboldcpp's finish reason onto the Horde's four.

    ``max_length`` is the budget koboldcpp generated under: the job's
    ``max_length`` after koboldcpp's own cut
    (:func:`.settings.kcpp_effective_max_length`), which can be below the job's.

    - ``"length"``: koboldcpp reports it for the budget and also for a stop
      sequence hit or an abort (1.116.1 ``koboldcpp.py`` L5194), so it stays ``"length"`` only when
      ``completion_tokens`` is None or reached ``max_length``; else ``"stop"``.
    - ``"stop"`` gives ``"stop"``; ``"content_filter"`` gives itself.
    - ``"tool_calls"`` gives ``"tool_calls"`` when there are calls, else ``"stop"``.
    - Calls with ``"stop"`` or ``"length"`` keep the mapped reason (a forced
      ``tool_choice`` may finish with stop and calls).

    Raises:
        ReplyError: ``"error"``, None or any other value (the job is faulted
            without a reason; seed worked example).
    """
    if native == "length":
        if completion_tokens is None or completion_tokens >= max_length:
            return "length"
        return "stop"
    if native == "stop":
        return "stop"
    if native == "tool_calls":
        return "tool_calls" if has_tool_calls else "stop"
    if native == "content_filter":
        return "content_filter"
    raise ReplyError(f"unusable finish reason {native!r}")


def normalise_tool_calls(raw: object) -> list[dict[str, Any]]:
    """The backend's tool calls in the submit's shape.

    Each call becomes ``{"id": str, "type": "function", "function": {"name":
    str, "arguments": str}}``: non-string ``arguments`` are JSON-encoded
    (missing ones become ``"{}"``), a missing ``type`` is ``"function"``, a
    missing or empty ``id`` is minted as ``call_<n>``. An id that collides with
    an earlier call's id gets a ``_<n>`` suffix; other ids are kept as the
    backend minted them. Other keys (such as ``index``) are dropped. U+0000 is
    removed from ids and names, and from ``arguments`` both as a character and
    as a JSON ``\\u0000`` escape (:func:`strip_nul_json`).

    Raises:
        ReplyError: ``raw`` is not a list (None is an empty list), a call is not
            an object, its type is not ``function``, or its function has no name
            (its ``feature`` is ``"tools"``).
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
        if isinstance(name, str):
            name = strip_nul(name)
        if not isinstance(name, str) or not name:
            raise ReplyError(f"tool_calls[{i}].function.name is missing", feature="tools")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = "{}"
        elif not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
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


def _cap_utf8(text: str, max_bytes: int) -> str:
    encoded = text.encode("utf-8")
    if len(encoded) <= max_bytes:
        return text
    return encoded[:max_bytes].decode("utf-8", errors="ignore")


def _count_ok(value: int | None, name: str) -> bool:
    if value is None:
        return False
    if 0 <= value <= TOKEN_COUNT_MAX:
        return True
    log.warning("leaving out %s=%d: outside 0..%d", name, value, TOKEN_COUNT_MAX)
    return False


# --- submit bodies ------------------------------------------------------------------


def chat_submit(
    job_id: str, model_id: str, reply: BackendReply, *, max_length: int
) -> dict[str, Any]:
    """The structured submit body of a served chat job.

    Returns ``{"id", "message": {"role": "assistant", "content", optional
    "reasoning_content", optional "tool_calls"}, "finish_reason", optional
    "native_finish_reason" (at most 32 characters), optional "prompt_tokens"
    and "completion_tokens" (only when reported and within 0..10,000,000),
    "model_id", "state": "ok"}``, e.g. the seed's ``{"id": "<job-id>",
    "message": {"role": "assistant", "content": "Blue."}, "finish_reason":
    "stop", "native_finish_reason": "stop", "prompt_tokens": 21,
    "completion_tokens": 3, "model_id": "<model-name>", "state": "ok"}``.

    U+0000 is removed first from the content, the reasoning, the tool calls
    and the native finish reason (the Horde refuses a submit holding it).
    Reasoning tags left in the content are split off (:func:`split_reasoning`);
    a block that never closed becomes ``reasoning_content`` with the content
    before it (usually ``""``). The content is otherwise kept as generated;
    ``reasoning_content`` is the reasoning without its surrounding whitespace,
    the same text the progress posts of a streamed job carry. It is cut to
    1 MiB of UTF-8 on a character boundary and left out when empty.
    ``content`` is null only when there are tool calls and no text; otherwise
    ``""`` is a valid reply.

    Args:
        job_id: the job.
        model_id: the job's assigned model (the declaration's ``model_id``).
        reply: what koboldcpp returned.
        max_length: the budget koboldcpp generated under, in tokens: the job's
            ``max_length`` after koboldcpp's cut
            (:func:`.settings.kcpp_effective_max_length`), to tell a real
            ``length`` apart from a stop sequence hit.

    Raises:
        ReplyError: an unusable finish reason or a malformed tool call; the job
            is then faulted without a reason.

    Seed: "6. Submit the reply", "Submit refusals".
    """
    calls = normalise_tool_calls(reply.tool_calls)
    finish_reason = map_finish_reason(
        reply.native_finish_reason,
        has_tool_calls=bool(calls),
        completion_tokens=reply.completion_tokens,
        max_length=max_length,
    )
    split = split_reasoning(
        None if reply.content is None else strip_nul(reply.content),
        None if reply.reasoning_content is None else strip_nul(reply.reasoning_content),
    )
    content: str | None = split.content
    if calls and not (content or "").strip():
        content = None
    elif content is None:
        content = ""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if split.reasoning:
        reasoning = _cap_utf8(split.reasoning, REASONING_MAX_BYTES)
        if len(reasoning) < len(split.reasoning):
            log.warning("job %s: reasoning_content cut to %d bytes", job_id, REASONING_MAX_BYTES)
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    body: dict[str, Any] = {"id": job_id, "message": message, "finish_reason": finish_reason}
    native = strip_nul(reply.native_finish_reason or "")
    if native:
        body["native_finish_reason"] = native[:NATIVE_FINISH_REASON_MAX_CHARS]
    if _count_ok(reply.prompt_tokens, "prompt_tokens"):
        body["prompt_tokens"] = reply.prompt_tokens
    if _count_ok(reply.completion_tokens, "completion_tokens"):
        body["completion_tokens"] = reply.completion_tokens
    body["model_id"] = model_id
    body["state"] = "ok"
    return body


def fault_submit(job_id: str, model_id: str, fault_reason: str | None = None) -> dict[str, Any]:
    """The faulted submit body: ``{"id", "state": "faulted", "model_id"}``.

    ``fault_reason`` (``"prompt_overflow"``, ``"reply_refused"``...) is added
    only when given; a failed fetch or generation faults without one. The
    ``model_id`` marks the body as a chat submit, which needs no generation.

    Seed: "7. Fault a job".
    """
    body: dict[str, Any] = {"id": job_id, "state": "faulted", "model_id": model_id}
    if fault_reason:
        body["fault_reason"] = fault_reason
    return body


def text_submit(job_id: str, generation: str) -> dict[str, Any]:
    """A text job's submit body: ``{"id", "generation", "state": "ok"}`` (seed step 8).

    U+0000 is removed from ``generation`` (the Horde refuses a submit holding it).
    """
    return {"id": job_id, "generation": strip_nul(generation), "state": "ok"}


def text_fault_submit(job_id: str) -> dict[str, Any]:
    """A text job's faulted submit body: ``{"id", "generation": "", "state": "faulted"}``
    (seed step 8: a text job is submitted in its own kind's shape)."""
    return {"id": job_id, "generation": "", "state": "faulted"}


def job_fault_submit(
    job_id: str, kind: str, model_id: str, fault_reason: str | None = None
) -> dict[str, Any]:
    """The faulted submit body of a job of either kind: :func:`fault_submit` for a
    ``"chat"`` job (with its ``model_id`` and ``fault_reason``), else
    :func:`text_fault_submit` (a text fault carries no reason).

    Seed: "7. Fault a job", step 8."""
    if kind == "chat":
        return fault_submit(job_id, model_id, fault_reason)
    return text_fault_submit(job_id)
