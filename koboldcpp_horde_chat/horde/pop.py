"""A pop's answer read once (:func:`read_pop`) into a job with a validated payload (pure).

Seed "2. Recognise a chat job", "4. Serve tools and structured output", "8. Keep
serving text jobs": ``"chat": true`` at the top level makes a chat job; any other
job is a text job, whose payload goes to koboldcpp unchanged.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import PayloadError

log = logging.getLogger("koboldcpp_horde_chat.jobs")

DEFAULT_TTL_S = 150.0
"""The job's base lease when the pop has no usable ``ttl``, seconds (seed: "Streaming progress")."""

ROLES = frozenset({"system", "user", "assistant", "tool"})
"""The message roles a chat payload carries (a client's developer message arrives as system)."""

_HTTP_URL = re.compile(r"^https?://[^\s/?#]+", re.IGNORECASE)


@dataclass(frozen=True)
class _Job:
    """A popped job (``ttl_s``: the lease, seconds; ``model``: the pop's, or None)."""

    id: str
    payload: dict[str, Any]
    ttl_s: float
    model: str | None


class TextJob(_Job):
    """A text job: its payload goes to koboldcpp's ``/api/v1/generate`` unchanged."""


@dataclass(frozen=True)
class ChatJob(_Job):
    """A chat job. ``messages`` is None when offloaded to ``messages_url``;
    ``max_length`` counts reasoning and answer tokens together."""

    messages: list[dict[str, Any]] | None
    messages_url: str | None
    max_length: int
    max_context_length: int
    stream_progress: bool

    @property
    def has_tools(self) -> bool:
        """True when the payload offers tools (then the reply is generated whole)."""
        tools = self.payload.get("tools")
        return isinstance(tools, list) and len(tools) > 0

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        """The payload's ``stop_sequence`` as a tuple of non-empty strings."""
        stop = self.payload.get("stop_sequence")
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        return tuple(s for s in stops if isinstance(s, str) and s)


_T = TypeVar("_T")
_NOT_A: dict[type, str] = {str: "not a string", list: "not a list", dict: "not an object"}


def _expect(value: object, kind: type[_T], path: str, job_id: str) -> _T:
    if not isinstance(value, kind):
        raise PayloadError(path, _NOT_A[kind], job_id=job_id)
    return value


def _positive_int(payload: dict[str, Any], key: str, job_id: str) -> int:
    value = payload.get(key)
    if value is None:
        raise PayloadError(f"payload.{key}", "missing", job_id=job_id)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PayloadError(f"payload.{key}", f"not a positive integer: {value!r}", job_id=job_id)
    return value


def ttl_seconds(pop: dict[str, Any], default_s: float) -> float:
    """The pop's ``ttl`` in seconds when positive (not a boolean; a huge one is
    infinite), else ``default_s``."""
    ttl = pop.get("ttl")
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        return default_s
    try:
        seconds = float(ttl)
    except OverflowError:
        seconds = math.inf
    return seconds if seconds > 0 else default_s


@dataclass
class Lease:
    """A job's lease, monotonic seconds: from the pop's ``ttl``, extended by
    accepted progress posts (seed "Streaming progress"). Only the job's thread
    extends it and the deadline only grows, so other threads read it without a lock."""

    popped_at: float
    deadline: float

    def remaining(self, now: float) -> float:
        return self.deadline - now

    def extend_to(self, deadline: float) -> None:
        """Move the deadline later (never earlier)."""
        self.deadline = max(self.deadline, deadline)


@dataclass(frozen=True)
class PopAnswer:
    """A pop's answer, read once where it arrives: ``id`` None without a usable
    job id, ``job`` None without a job or when ``error`` says it is malformed;
    ``messages`` are the moderators', ``skipped`` the reasons for no job."""

    raw: dict[str, Any]
    id: str | None
    chat: bool
    ttl_s: float
    job: TextJob | ChatJob | None
    error: PayloadError | None
    messages: object = None
    skipped: object = None


def read_pop(answer: dict[str, Any], *, default_ttl_s: float = DEFAULT_TTL_S) -> PopAnswer:
    """Parse a pop's answer (:func:`parse_pop`) into a :class:`PopAnswer`; never raises."""
    raw = answer if isinstance(answer, dict) else {}
    job_id = raw.get("id")
    job: TextJob | ChatJob | None = None
    error: PayloadError | None = None
    try:
        job = parse_pop(answer, default_ttl_s=default_ttl_s)
    except PayloadError as exc:
        error = exc
    return PopAnswer(
        raw=raw, id=job_id if isinstance(job_id, str) and job_id else None,
        chat=raw.get("chat") is True, ttl_s=ttl_seconds(raw, default_ttl_s), job=job,
        error=error, messages=raw.get("messages"), skipped=raw.get("skipped"),
    )


#: The sampler fields of a chat payload (seed step 2: always present): each must be
#: a number when present, and goes to koboldcpp exactly as sent (``translate.bodies``).
SAMPLER_KEYS = (
    "temperature", "top_p", "frequency_penalty", "presence_penalty", "rep_pen", "top_k", "min_p",
)


def _check_optional_fields(payload: dict[str, Any], job_id: str) -> None:
    stream_progress = payload.get("stream_progress")
    if stream_progress is not None and not isinstance(stream_progress, bool):
        raise PayloadError("payload.stream_progress", "not a boolean", job_id=job_id)
    for key in SAMPLER_KEYS:
        value = payload.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise PayloadError(f"payload.{key}", "not a number", job_id=job_id)
    seed = payload.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise PayloadError("payload.seed", "not an integer", job_id=job_id)
    stop = payload.get("stop_sequence")
    if stop is not None and not isinstance(stop, str):
        for i, item in enumerate(_expect(stop, list, "payload.stop_sequence", job_id)):
            _expect(item, str, f"payload.stop_sequence[{i}]", job_id)
    if payload.get("tools") is not None:
        for i, tool in enumerate(_expect(payload["tools"], list, "payload.tools", job_id)):
            _expect(tool, dict, f"payload.tools[{i}]", job_id)
    if payload.get("response_format") is not None:
        fmt = _expect(payload["response_format"], dict, "payload.response_format", job_id)
        _expect(fmt.get("type"), str, "payload.response_format.type", job_id)


def parse_pop(pop: dict[str, Any], *,
              default_ttl_s: float = DEFAULT_TTL_S) -> TextJob | ChatJob | None:
    """The job in the answer of ``POST /api/v2/generate/text/pop``: None when
    ``id`` is missing, null or empty. Inline ``messages`` are validated; without
    them the chat job's ``messages_url`` is to be fetched and validated.

    Raises:
        PayloadError: ``path`` names the bad field (``"payload.messages[1].role"``)
            and ``job_id`` the job to fault, when the id is usable.
    """
    if not isinstance(pop, dict):
        raise PayloadError("$", "the pop response is not an object")
    job_id = pop.get("id")
    if job_id is None or job_id == "":
        return None
    if not isinstance(job_id, str):
        raise PayloadError("id", f"not a string: {job_id!r}")
    ttl_s = ttl_seconds(pop, default_ttl_s)
    model = pop.get("model") if isinstance(pop.get("model"), str) else None
    payload = pop.get("payload")
    if not isinstance(payload, dict):
        raise PayloadError("payload", "missing or not an object", job_id=job_id)
    log.debug("job %s: chat=%r, %d payload keys %s", job_id, pop.get("chat"), len(payload),
              sorted(str(k) for k in payload)[:40])
    if pop.get("chat") is not True:
        if not isinstance(payload.get("prompt"), str):
            raise PayloadError("payload.prompt", "missing or not a string", job_id=job_id)
        return TextJob(id=job_id, payload=payload, ttl_s=ttl_s, model=model)

    messages: list[dict[str, Any]] | None = None
    inline = payload.get("messages")
    url = payload.get("messages_url")
    if url is not None and not (isinstance(inline, list) and inline):
        if not isinstance(url, str) or not _HTTP_URL.match(url):
            raise PayloadError("payload.messages_url", "not an http(s) URL", job_id=job_id)
    elif inline is None:
        raise PayloadError("payload.messages", "missing (and no messages_url)", job_id=job_id)
    else:
        messages = validate_messages(inline, job_id=job_id)

    max_length = _positive_int(payload, "max_length", job_id)
    max_context_length = _positive_int(payload, "max_context_length", job_id)
    _check_optional_fields(payload, job_id)
    return ChatJob(
        id=job_id, payload=payload, ttl_s=ttl_s, model=model, messages=messages,
        messages_url=None if messages is not None else url, max_length=max_length,
        max_context_length=max_context_length,
        stream_progress=payload.get("stream_progress") is True,
    )


def _validate_content(content: object, path: str, job_id: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise PayloadError(path, "not a string, null or a list of parts", job_id=job_id)
    for j, part in enumerate(content):
        part_path = f"{path}[{j}]"
        kind = _expect(part, dict, part_path, job_id).get("type")
        if kind == "text":
            _expect(part.get("text"), str, f"{part_path}.text", job_id)
        elif kind == "image_url":
            image = _expect(part.get("image_url"), dict, f"{part_path}.image_url", job_id)
            _expect(image.get("url"), str, f"{part_path}.image_url.url", job_id)
        else:
            raise PayloadError(f"{part_path}.type", f"unknown part type {kind!r}", job_id=job_id)


def _validate_tool_calls(calls: object, path: str, job_id: str) -> None:
    for k, call in enumerate(_expect(calls, list, path, job_id)):
        call_path = f"{path}[{k}]"
        _expect(call, dict, call_path, job_id)
        function = _expect(call.get("function"), dict, f"{call_path}.function", job_id)
        _expect(function.get("name"), str, f"{call_path}.function.name", job_id)


def validate_messages(messages: object, *, job_id: str) -> list[dict[str, Any]]:
    """Check a conversation's shape and return it unchanged.

    Each message has a ``role`` in :data:`ROLES` and ``content`` a string, null or
    a list of ``text``/``image_url`` parts; an assistant's ``tool_calls`` name
    their function; a tool message has a string ``tool_call_id``.

    Raises:
        PayloadError: naming the first bad field, e.g. ``payload.messages[2].role``.
    """
    path = "payload.messages"
    messages = _expect(messages, list, path, job_id)
    if not messages:
        raise PayloadError(path, "empty", job_id=job_id)
    for i, message in enumerate(messages):
        msg_path = f"{path}[{i}]"
        role = _expect(message, dict, msg_path, job_id).get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise PayloadError(f"{msg_path}.role", f"unknown role {str(role)[:40]!r}",
                               job_id=job_id)
        _validate_content(message.get("content"), f"{msg_path}.content", job_id)
        if role == "assistant" and message.get("tool_calls") is not None:
            _validate_tool_calls(message["tool_calls"], f"{msg_path}.tool_calls", job_id)
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise PayloadError(f"{msg_path}.tool_call_id", "not a string", job_id=job_id)
    return messages
