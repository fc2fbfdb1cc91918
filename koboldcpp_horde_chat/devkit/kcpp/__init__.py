"""A scripted koboldcpp: a real HTTP server that answers like koboldcpp 1.116.1.

:class:`ScriptedKoboldcpp` listens on 127.0.0.1 and answers the routes the chat
worker (and koboldcpp's own embedded worker) uses, with the status codes,
headers, key order and value types recorded from a real koboldcpp 1.116.1
(``kcpp-samples/``) and described in the koboldcpp fact sheet. The replies are
canned and deterministic, so tests and the demo get sensible answers without a
model:

* ``/v1/chat/completions`` (whole or Server-Sent Events over HTTP/1.0, closed at
  the end), ``/api/v1/generate``, ``/api/extra/generate/stream``;
* ``/api/extra/tokencount`` (``{"value", "ids", "prompt"}``, BOS included),
  ``/api/extra/abort`` (string ``"true"``/``"false"`` values, facts §5.2),
  ``/api/extra/generate/check``;
* the open GETs: ``/api/v1/info/version``, ``/api/v1/model``,
  ``/api/extra/version``, ``/api/extra/true_max_context_length``,
  ``/api/v1/config/max_context_length``, ``/api/v1/config/max_length``,
  ``/v1/models``, ``/api/extra/perf``.

Behaviour copied from koboldcpp (facts section in brackets):

* generations are serialised by one lock (``modelbusy``, §5.8): a second request
  waits; ``busy = True`` answers 503 ``Server is busy`` instead;
* with a password, generation POSTs, tokencount, abort and generate/check need
  ``Authorization: Bearer <password>`` (401 otherwise, checked after the lock
  is taken); GETs stay open and ``/api/v1/model`` masks the name (§6);
* ``finish_reason`` is ``"stop"`` only for EOS; the token budget, a stop
  sequence and an abort all report ``"length"`` (§4.9);
* ``<think>`` blocks are split into ``reasoning_content`` (non-stream: only when
  both tags or only the end tag are present; stream: tag by tag) (§4.6);
* ``response_format: json_object`` yields a JSON *array* (§4.4, §9); a
  ``grammar`` rooted at an object or a ``json_schema`` yields an object;
* tools: ids ``call_<10000-99999>``, ``content`` ``""``, ``finish_reason``
  ``"tool_calls"``; streamed tool replies are fake-streamed after generation
  with chunk id ``"koboldcpp"`` and no usage chunk (§4.5, §4.8);
* a generation whose genkey does not start with ``HORDEREQ_`` is a local user's:
  it updates :attr:`ScriptedKoboldcpp.last_non_horde_request_time` (§2.5);
* prompts longer than the context are cut at the front silently and
  ``prompt_tokens`` reports the kept part (§4.3);
* a request's ``max_context_length`` is capped at the context size, its
  ``max_length`` at ``--genlimit`` (``genlimit``, when above 0) and then cut to
  leave ``max(min(ctx - 4, 16), int(ctx * 0.2))`` tokens of the context to the
  prompt, as ``generate()`` does (``koboldcpp.py`` L2167-2178); the cut budget
  ends with ``"length"``;
* batching (``parallel_requests`` > 1, ``--parallelrequests``): a batchable
  generation (no grammar, tools, images, ``reasoning_effort`` or the samplers
  koboldcpp does not batch, L2347-2378) releases the model lock at once and
  runs beside the others, ``parallel_requests`` at a time; a request that is
  not batchable waits until none runs (L7107-7122). An abort by genkey does
  not stop a batched generation (it only sets the single-slot flag, L6532-6541;
  ``gpttype_adapter.cpp`` L3802-3809 against L4443), though it is answered
  ``done: "true"`` as usual; a batched stream ends when its client hangs up
  (L5752-5753), a batched non-streamed generation runs to its end whatever
  the client does (no disconnect check outside streams, L5798-5812).

The tokenizer is a toy: a token is ``chars_per_token`` characters, except that
reasoning and ChatML tags are one token each. Token ids are stable hashes.

Default replies (no script): tools under a ``tool_choice`` other than ``"none"``
give one call of the named (or first) tool with arguments for its required
parameters (after a tool result under ``"auto"``: a text answer quoting it); a
``json_schema`` or an object-rooted ``grammar`` gives a JSON object; a
``json_object`` gives a JSON array; a last user message containing "think"
gives ``<think>`` reasoning and an answer; "colour"/"color" gives ``"Blue."``;
"story", "essay" or "long" gives a long text (about 1,000 tokens); otherwise
``"You said: <the first words>."``. ``script(fn)`` overrides any of these.

Not simulated: the Ollama, Anthropic, Responses and ``/v1/completions`` routes,
images beyond a fixed token cost, logprobs, the tool-decision poll, and the
load-time settings that turn batching off (``--noshift`` is taken as given).
"""

from __future__ import annotations

import binascii
import json
import logging
import random
import re
import select
import socket
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Literal, cast
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

__all__ = [
    "BUSY_BODY",
    "PROTECTED_MODEL_NAME",
    "UNAUTHORIZED_BODY",
    "ScriptedKoboldcpp",
    "ScriptedReply",
]

KAI_API_VERSION = "1.2.5"
"""What ``GET /api/v1/info/version`` reports: a fixed KoboldAI United API version."""

PROTECTED_MODEL_NAME = "koboldcpp/protected-model"
"""``/api/v1/model`` on a password-protected koboldcpp without the right bearer."""

HORDE_GENKEY_PREFIX = "HORDEREQ_"
DEFAULT_CHAT_GENLEN = 1536
"""koboldcpp's ``--defaultgenamt``: the chat budget when the body sets none."""
DEFAULT_KOBOLD_GENLEN = 200
"""The ``/api/v1/generate`` budget when the body sets no ``max_length`` (KoboldAI's default)."""
MAX_REQUEST_BYTES = 32 * 1024 * 1024
"""koboldcpp's ``--maxrequestsize`` default: larger bodies get 500 "Payload is too big"."""
IMAGE_TOKENS = 256
"""Tokens one data-URL image adds to ``prompt_tokens`` when ``vision`` is on (a toy value)."""
BOS_ID = 2
MAX_STOP_SEQUENCES = 256

UNAUTHORIZED_BODY: dict[str, Any] = {
    "detail": {
        "error": "Unauthorized",
        "msg": "Authentication key is missing or invalid.",
        "type": "unauthorized",
    }
}
BUSY_BODY: dict[str, Any] = {
    "detail": {"msg": "Server is busy; please try again later.", "type": "service_unavailable"}
}
BAD_INPUT_BODY: dict[str, Any] = {"detail": {"msg": "Error parsing input.", "type": "bad_input"}}


def too_big_body(max_request_bytes: int) -> dict[str, Any]:
    """koboldcpp's 500 answer to a body over ``--maxrequestsize`` (facts §5.8):
    ``{"detail": {"msg": "Payload is too big. Max payload size is 32MB.", "type":
    "bad_input"}}`` (a limit that is not whole MB is given in bytes)."""
    mib = 1024 * 1024
    size = (
        f"{max_request_bytes // mib}MB"
        if max_request_bytes % mib == 0
        else f"{max_request_bytes} bytes"
    )
    message = f"Payload is too big. Max payload size is {size}."
    return {"detail": {"msg": message, "type": "bad_input"}}


TOO_BIG_BODY: dict[str, Any] = too_big_body(MAX_REQUEST_BYTES)

THINK_PAIRS: tuple[tuple[str, str], ...] = (
    ("<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"),
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<|channel>thought", "<channel|>"),
)
"""koboldcpp's ``thinkformats``, in its order (facts §1)."""

_CHAT_TAGS = ("<|im_start|>", "<|im_end|>")
_SPECIAL_TAGS = sorted(
    {tag for pair in THINK_PAIRS for tag in pair} | set(_CHAT_TAGS), key=len, reverse=True
)
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in _SPECIAL_TAGS) + ")")

_CORS_HEADERS = (
    ("access-control-allow-origin", "*"),
    ("access-control-allow-methods", "*"),
    (
        "access-control-allow-headers",
        "*, Accept, Content-Type, Content-Length, Cache-Control, Accept-Encoding, "
        "X-CSRF-Token, Client-Agent, X-Fields, Content-Type, Authorization, "
        "X-Requested-With, X-HTTP-Method-Override, apikey, genkey",
    ),
)

# koboldcpp's C++ stop reasons (facts §4.9)
STOP_ERROR = -2
STOP_INVALID = -1
STOP_OUT_OF_TOKENS = 0
STOP_EOS = 1
STOP_CUSTOM = 2

Finish = Literal["eos", "length", "stop_sequence", "error"]

GET_ROUTES: dict[str, str] = {
    "/api/v1/info/version": "info_version",
    "/api/v1/model": "model",
    "/api/extra/version": "version",
    "/api/extra/true_max_context_length": "true_max_context_length",
    "/api/v1/config/max_context_length": "max_context_length",
    "/api/v1/config/max_length": "max_length",
    "/v1/models": "models",
    "/api/extra/perf": "perf",
    "/api/extra/generate/check": "generate_check",
}
"""GET path -> route name used by :meth:`ScriptedKoboldcpp.inject`."""

POST_ROUTES: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/api/v1/generate": "generate",
    "/api/latest/generate": "generate",
    "/api/extra/generate/stream": "generate_stream",
    "/api/extra/tokencount": "tokencount",
    "/api/extra/tokenize": "tokencount",
    "/api/extra/abort": "abort",
    "/api/extra/generate/check": "generate_check",
}
"""POST path -> route name used by :meth:`ScriptedKoboldcpp.inject`."""

ROUTE_NAMES = frozenset(GET_ROUTES.values()) | frozenset(POST_ROUTES.values())

_LONG_STORY = " ".join(
    [
        "Once upon a time a small fox lived at the edge of a quiet forest.",
        "Every morning she walked to the river to watch the light on the water.",
        "The birds told her stories of the mountains far away,",
        "and the old oak by the path remembered every winter it had seen.",
    ]
    * 40
)


@dataclass
class ScriptedReply:
    """What the scripted model "generates" for one request.

    Attributes:
        text: the answer text (the model's output after any reasoning).
        reasoning: reasoning text; the raw output is then
            ``"<think>" + reasoning + "</think>" + text``.
        tool_calls: calls to return (chat only), each ``{"name", "arguments"}`` or
            OpenAI-shaped ``{"id"?, "type", "function": {"name", "arguments"}}``;
            ``arguments`` may be a dict or a JSON string; an id is minted
            (``call_<5 digits>``) when none is given. Needs ``tools`` in the body.
        finish: how generation ends after ``text``: ``"eos"`` (reported
            ``"stop"``), ``"length"`` (the budget ran out right there: reported
            ``"length"`` with ``completion_tokens`` equal to the budget),
            ``"stop_sequence"`` (the first of the body's stop strings follows and
            is trimmed; reported ``"length"``) or ``"error"``. The body's token
            budget and stop strings still cut ``text`` first.
        prompt_tokens: reported instead of the counted prompt tokens.
    """

    text: str = ""
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    finish: Finish = "eos"
    prompt_tokens: int | None = None


Fault = tuple[int, Any] | str
"""An injected answer: ``(status, body)``, ``"reset"``, ``"hang:<s>"``, ``"truncate"``,
``"stream_cut"``, ``"stream_error"``, ``"no_finish"`` or ``"stall:<s>"`` (see
:meth:`ScriptedKoboldcpp.inject`)."""

STREAM_ERROR_EVENT: dict[str, Any] = {
    "error": {"message": "scripted in-band error", "type": "server_error", "code": 500}
}
"""The in-band error object a ``"stream_error"`` fault sends as one event's data."""


# ----------------------------------------------------------------- tokenizer


class _Tokenizer:
    """``chars_per_token`` characters per token; special tags are one token each."""

    def __init__(self, chars_per_token: int) -> None:
        self.chars_per_token = max(1, int(chars_per_token))

    def pieces(self, text: str) -> list[str]:
        out: list[str] = []
        for part in _SPECIAL_RE.split(text):
            if not part:
                continue
            if part in _SPECIAL_TAGS:
                out.append(part)
                continue
            step = self.chars_per_token
            out.extend(part[i : i + step] for i in range(0, len(part), step))
        return out

    def count(self, text: str) -> int:
        return len(self.pieces(text))

    @staticmethod
    def ids(pieces: list[str]) -> list[int]:
        return [3 + zlib.crc32(p.encode("utf-8")) % 250000 for p in pieces]


# ------------------------------------------------------------ pure helpers


def _finish_reason(stop_reason: int) -> str:
    """koboldcpp's mapping: -2 error, 1 stop, anything else length (facts §4.9)."""
    if stop_reason == STOP_ERROR:
        return "error"
    return "stop" if stop_reason == STOP_EOS else "length"


def _stop_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list):
        return [s for s in value if isinstance(s, str) and s][:MAX_STOP_SEQUENCES]
    return []


def _float_or(value: Any, default: float) -> float:
    """koboldcpp's ``tryparsefloat``: the number, else ``default``."""
    if isinstance(value, bool):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _content_text(content: Any) -> tuple[str, int]:
    """The text of a message content and the number of data-URL images in it."""
    if content is None:
        return "", 0
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        return str(content), 0
    texts: list[str] = []
    images = 0
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict):
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if isinstance(url, str) and url.startswith("data:image"):
                    images += 1
                    texts.append(f"\n(Attached Image {images})\n")
    return "".join(texts), images


def _received_images(messages: Any) -> dict[str, Any] | None:
    """The image parts of a chat body as koboldcpp takes them (see ``images``), or
    None when there are none. koboldcpp uses a url only when it starts with
    ``data:image`` and base64-decodes the text after the first comma (facts §3)."""
    if not isinstance(messages, list):
        return None
    data_urls: list[str] = []
    decoded: list[bytes | None] = []
    dropped: list[str] = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:image"):
                dropped.append(str(url))
                continue
            data_urls.append(url)
            try:
                decoded.append(binascii.a2b_base64(url.split(",", 1)[1].encode("ascii")))
            except (IndexError, UnicodeEncodeError, binascii.Error):
                decoded.append(None)
    if not data_urls and not dropped:
        return None
    return {"genkey": "", "data_urls": data_urls, "decoded": decoded, "dropped": dropped}


def _render_chat(messages: list[Any], tools: list[Any] | None) -> tuple[str, int]:
    """A ChatML-like rendering of ``messages`` (tools in front) and its image count."""
    parts: list[str] = []
    images = 0
    if tools:
        compact = [t.get("function", t) if isinstance(t, dict) else t for t in tools]
        parts.append("### Available Tools:\n" + json.dumps(compact) + "\n")
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        role = msg.get("role")
        text, n = _content_text(msg.get("content"))
        images += n
        if role == "assistant" and not text and isinstance(msg.get("tool_calls"), list):
            calls = []
            for call in msg["tool_calls"]:
                fn = call.get("function", {}) if isinstance(call, dict) else {}
                calls.append(
                    f"(Made a function call {call.get('id') if isinstance(call, dict) else ''}"
                    f" to {fn.get('name')} with arguments={fn.get('arguments')})"
                )
            text = "\n".join(calls)
        if role == "tool":
            text = f"\nReceived results of function call {msg.get('tool_call_id')}:\n{text}"
        if role in ("system", "user", "assistant", "tool"):
            parts.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
        else:
            parts.append(text)
    parts.append("<|im_start|>assistant\n")
    return "".join(parts), images


def _last_user_text(messages: list[Any]) -> tuple[str, int]:
    for msg in reversed(messages):
        if isinstance(msg, dict) and msg.get("role") == "user":
            return _content_text(msg.get("content"))
    return "", 0


def _default_answer(text: str, images: int) -> str:
    """The canned answer to a user message (see the module docstring)."""
    low = text.lower()
    if "colour" in low or "color" in low:
        return "Blue."
    if any(word in low for word in ("story", "essay", "long")):
        return _LONG_STORY
    if images:
        return f"I see {images} image{'s' if images != 1 else ''}."
    words = re.sub(r"\(Attached Image \d+\)", "", text).split()
    if not words:
        return "Hello."
    return "You said: " + " ".join(words[:8]).rstrip(".?!,;:") + "."


def example_value(schema: Any, depth: int = 0) -> Any:
    """A plausible JSON value satisfying a simple JSON schema.

    Handles ``const``, ``enum``, ``anyOf``/``oneOf``/``allOf`` (first branch),
    ``type`` (string, list of strings), ``object`` (its ``required``
    properties, or all properties when ``required`` is absent), ``array`` (one
    item, or none without ``items``), strings, numbers, booleans and null.
    """
    if not isinstance(schema, dict) or depth > 8:
        return "example"
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return example_value(schema[key][0], depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if kind is None and isinstance(schema.get("properties"), dict):
        kind = "object"
    if kind == "object":
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        required = schema.get("required")
        names = (
            [n for n in required if isinstance(n, str)]
            if isinstance(required, list)
            else list(props)
        )
        return {name: example_value(props.get(name, {}), depth + 1) for name in names}
    if kind == "array":
        items = schema.get("items")
        count = max(1, _int_or_none(schema.get("minItems")) or 0) if items is not None else 0
        return [example_value(items, depth + 1) for _ in range(count)]
    if kind == "integer":
        return max(1, _int_or_none(schema.get("minimum")) or 0)
    if kind == "number":
        return 1.5
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return "example"


_RULE_RE = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*::=\s*(.*)$")
_ELEMENT_RE = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z0-9_-]+|\(|\)|\||[*+?]')


def grammar_root_kind(grammar: str) -> Literal["object", "array", "other"]:
    """Whether a GBNF grammar's ``root`` starts with ``{``, ``[`` or anything else.

    Follows rule references from ``root`` to the first literal, skipping rules
    that may match nothing (whitespace rules such as ``ws ::= [ \\t\\n]*``).
    """
    rules: dict[str, str] = {}
    current: str | None = None
    for line in grammar.splitlines():
        if line.lstrip().startswith("#"):
            continue
        stripped = line
        match = _RULE_RE.match(stripped)
        if match:
            current = match.group(1)
            rules[current] = match.group(2)
        elif current is not None and stripped.strip():
            rules[current] += " " + stripped.strip()

    def first(rule: str, seen: frozenset[str]) -> str | None:
        if rule in seen or rule not in rules:
            return None
        element: str
        for element in _ELEMENT_RE.findall(rules[rule]):
            if element in ("(", ")", "*", "+", "?"):
                continue
            if element == "|":
                return None
            if element.startswith('"'):
                literal = element[1:-1]
                if literal:
                    return literal[0]
                continue
            if element.startswith("["):
                return None
            if _may_be_empty(rules.get(element, "")):
                continue
            return first(element, seen | {rule})
        return None

    char = first("root", frozenset())
    if char == "{":
        return "object"
    if char == "[":
        return "array"
    return "other"


def _may_be_empty(rhs: str) -> bool:
    """A rule such as ``( [ \\t\\n] ... )?`` or ``[ \\t\\n]*`` that may match nothing."""
    text = rhs.strip()
    return bool(text) and (text.endswith(")?") or text.endswith("]*") or text.endswith(")*"))


def split_reasoning(text: str) -> tuple[str, str]:
    """koboldcpp's non-stream split: ``(content, reasoning)`` (facts §4.6).

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
    Every delta carries ``"role": "assistant"`` (facts §4.8).
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


@dataclass
class _Plan:
    """The model's whole output if nothing cut it, and how it would end."""

    raw: str
    end: Finish
    prompt_tokens: int
    tool_calls: list[dict[str, Any]] | None = None
    tool_path: bool = False


@dataclass
class _Outcome:
    pieces: list[str]
    stop_reason: int
    completion_tokens: int


def execute_plan(
    tokenizer: _Tokenizer, raw: str, end: Finish, *, budget: int, stops: list[str]
) -> _Outcome:
    """Generate ``raw`` token by token under the budget and stop strings.

    The stop string (with ``end == "stop_sequence"``) follows the text; EOS needs
    one more token of budget, as in llama.cpp.
    """
    pieces = tokenizer.pieces(raw)
    if end == "stop_sequence" and stops:
        pieces += tokenizer.pieces(stops[0])
    out: list[str] = []
    text = ""
    for piece in pieces:
        if len(out) >= budget:
            return _Outcome(out, STOP_OUT_OF_TOKENS, len(out))
        out.append(piece)
        text += piece
        window = text[-(len(piece) + max((len(s) for s in stops), default=0)) :]
        if any(stop in window for stop in stops):
            return _Outcome(out, STOP_CUSTOM, len(out))
    if end == "eos":
        if len(out) >= budget:
            return _Outcome(out, STOP_OUT_OF_TOKENS, len(out))
        return _Outcome(out, STOP_EOS, len(out))
    if end == "stop_sequence":
        return _Outcome(out, STOP_CUSTOM, len(out))
    if end == "error":
        return _Outcome(out, STOP_ERROR, len(out))
    return _Outcome(out, STOP_OUT_OF_TOKENS, max(len(out), budget))


def _normalise_scripted_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for call in calls:
        fn = call.get("function") if isinstance(call.get("function"), dict) else call
        assert isinstance(fn, dict)
        args = fn.get("arguments", {})
        out.append(
            {
                "id": str(call.get("id") or _mint_call_id()),
                "type": "function",
                "function": {
                    "name": str(fn.get("name", "")),
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    return out


def _mint_call_id() -> str:
    return f"call_{random.randint(10000, 99999)}"


# ------------------------------------------------------------------- server


@dataclass(eq=False)
class _Run:
    """One generation: the one holding the model lock, or a batched one."""

    genkey: str
    abort: threading.Event = field(default_factory=threading.Event)
    partial: str = ""


class _ClientGone(Exception):
    """The client closed the connection during a stream."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], kcpp: ScriptedKoboldcpp) -> None:
        self.kcpp = kcpp
        self.open_sockets: set[socket.socket] = set()
        self.sockets_lock = threading.Lock()
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    server_version = "KoboldCppServer"
    sys_version = "1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        log.debug("scripted koboldcpp: " + format, *args)

    def setup(self) -> None:
        super().setup()
        server = cast(_Server, self.server)
        with server.sockets_lock:
            server.open_sockets.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            server = cast(_Server, self.server)
            with server.sockets_lock:
                server.open_sockets.discard(self.connection)

    def _dispatch(self) -> None:
        cast(_Server, self.server).kcpp._handle(self)

    do_GET = _dispatch
    do_POST = _dispatch

    def do_OPTIONS(self) -> None:  # noqa: N802 - stdlib name
        self.send_response(200)
        for name, value in _CORS_HEADERS:
            self.send_header(name, value)
        self.send_header("content-length", "0")
        self.end_headers()


class _Exchange:
    """One request: its handler, parsed body and any injected fault mode."""

    def __init__(self, handler: _Handler, route: str, body: Any, raw: bytes) -> None:
        self.h = handler
        self.route = route
        self.body = body
        self.raw = raw
        self.cut: str | None = None  # "truncate" or "stream_cut"
        self.stream_fault: str | None = None  # "stream_error", "no_finish" or "stall:<s>"

    @property
    def sock(self) -> socket.socket:
        return cast(socket.socket, self.h.connection)

    def header(self, name: str) -> str:
        return str(self.h.headers.get(name, ""))

    def send_json(self, status: int, obj: Any) -> None:
        payload = (
            obj
            if isinstance(obj, bytes)
            else (obj.encode("utf-8") if isinstance(obj, str) else json.dumps(obj).encode("utf-8"))
        )
        h = self.h
        try:
            h.send_response(status)
            h.send_header("content-length", str(len(payload)))
            for name, value in _CORS_HEADERS:
                h.send_header(name, value)
            h.send_header("cache-control", "no-store")
            h.send_header("content-type", "application/json")
            h.end_headers()
            if self.cut is not None:
                h.wfile.write(payload[: len(payload) // 2])
                h.close_connection = True
                return
            h.wfile.write(payload)
        except OSError:
            h.close_connection = True

    def start_sse(self) -> None:
        h = self.h
        h.send_response(200)
        h.send_header("X-Accel-Buffering", "no")
        h.send_header("cache-control", "no-cache")
        h.send_header("connection", "keep-alive")
        for name, value in _CORS_HEADERS:
            h.send_header(name, value)
        h.send_header("cache-control", "no-store")
        h.send_header("content-type", "text/event-stream")
        h.end_headers()
        h.close_connection = True  # HTTP/1.0: the stream ends when the connection closes
        h.wfile.flush()

    def write(self, data: bytes) -> None:
        try:
            self.h.wfile.write(data)
            self.h.wfile.flush()
        except OSError as exc:
            raise _ClientGone() from exc

    def client_gone(self) -> bool:
        """True when the peer closed its end (checked without blocking)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return False
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def reset(self) -> None:
        """Close with a TCP reset and no answer."""
        self.h.close_connection = True
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.sock.close()
        except OSError:
            pass


class ScriptedKoboldcpp:
    """A scripted koboldcpp 1.116.1 on ``127.0.0.1:<port>`` (see the module docstring).

    Args:
        model_name: ``friendlymodelname`` (``/api/v1/model``, chat ``model``).
        max_context_length: ``--contextsize`` in tokens.
        vision: report ``"vision": true`` and count image tokens.
        password: ``--password``; "" for an open instance.
        version: the ``version`` in ``/api/extra/version``.
        jinja: the ``jinja`` flag in ``/api/extra/version``.
        token_delay_s: seconds per generated token.
        chars_per_token: the toy tokenizer's characters per token.
        prompt_delay_s: seconds of "prompt processing" before the first token.
        horde_max_length: ``/api/v1/config/max_length`` (``--hordegenlen``).
        horde_max_context_length: ``--hordemaxctx`` (0: the context size).
        abort_reply_delay_s: koboldcpp waits 0.1 s before answering an abort.
        host, port: where to listen (port 0: an ephemeral port).
        max_request_bytes: ``--maxrequestsize`` in bytes (default
            :data:`MAX_REQUEST_BYTES`, read when the object is made): a request
            whose ``Content-Length`` is larger is answered 500 "Payload is too
            big. Max payload size is 32MB." without reading its body.
        genlimit: ``--genlimit`` in tokens (0: none): every generation's
            ``max_length`` is capped there before the 20 % cut.
        parallel_requests: ``--parallelrequests``: above 1, batchable
            generations run beside each other (see the module docstring).

    Public state, readable from tests (append-only lists):
        requests: ``{"method", "path", "headers" (lower-case names), "body"
            (parsed JSON or None)}`` for every request received.
        aborts: the genkey of every abort answered ``done: "true"`` ("" when
            the abort named none).
        generations: one dict per finished generation: ``{"route", "genkey",
            "stream", "prompt_tokens", "completion_tokens", "finish_reason",
            "aborted", "client_gone", "overflow"}`` (plus ``"cut": True`` after a
            ``stream_cut`` fault).
        images: one dict per chat completion whose messages hold image parts:
            ``{"genkey": str, "data_urls": [str, ...] (the urls starting with
            "data:image", in order: what koboldcpp reads), "decoded": [bytes |
            None, ...] (each one's text after the first comma base64-decoded;
            None when that fails), "dropped": [str, ...] (other image urls,
            ignored as koboldcpp ignores http URLs)}``.
        tokencount_messages: bodies of tokencount calls that sent ``messages``
            (the real server would render them and may run a tool poll).
        last_non_horde_request_time: ``time.time()`` of the last local user's
            generation (start and end), or None.
        busy: when True every generation answers 503 "Server is busy".
        running: how many generations run now, batched or not (property).
        hold_stop_sequences: True (koboldcpp's way, facts §4.8): a stream holds
            back text that could start a stop sequence and trims the one that
            ended generation. False streams a stop sequence as generated (a
            backend that does not trim), so the client side must strip it.
        chunk_log: with ``log_chunks = True``, ``(time.monotonic(), delta)`` of
            every streamed chat chunk just before it is written (for benches).
    """

    def __init__(
        self,
        model_name: str = "koboldcpp/scripted-model",
        max_context_length: int = 4096,
        vision: bool = False,
        password: str = "",
        version: str = "1.116.1",
        jinja: bool = False,
        token_delay_s: float = 0.0,
        chars_per_token: int = 4,
        *,
        prompt_delay_s: float = 0.0,
        horde_max_length: int = 1024,
        horde_max_context_length: int = 0,
        abort_reply_delay_s: float = 0.1,
        host: str = "127.0.0.1",
        port: int = 0,
        max_request_bytes: int | None = None,
        genlimit: int = 0,
        parallel_requests: int = 1,
    ) -> None:
        self.model_name = model_name
        self.genlimit = genlimit
        self.parallel_requests = max(1, parallel_requests)
        self.max_request_bytes = (
            MAX_REQUEST_BYTES if max_request_bytes is None else max_request_bytes
        )
        self.max_context_length = max_context_length
        self.vision = vision
        self.password = password
        self.version = version
        self.jinja = jinja
        self.token_delay_s = token_delay_s
        self.prompt_delay_s = prompt_delay_s
        self.horde_max_length = horde_max_length
        self.horde_max_context_length = horde_max_context_length
        self.abort_reply_delay_s = abort_reply_delay_s
        self.tokenizer = _Tokenizer(chars_per_token)
        self._host = host
        self._port = port

        self.requests: list[dict[str, Any]] = []
        self.aborts: list[str] = []
        self.generations: list[dict[str, Any]] = []
        self.tokencount_messages: list[dict[str, Any]] = []
        self.images: list[dict[str, Any]] = []
        self.last_non_horde_request_time: float | None = None
        self.busy = False
        self.hold_stop_sequences = True
        self.log_chunks = False
        self.chunk_log: list[tuple[float, dict[str, Any]]] = []

        self._script: Callable[[dict[str, Any]], ScriptedReply | None] | None = None
        self._faults: dict[str, deque[Fault]] = {}
        self._lock = threading.Lock()  # state below
        self._model = threading.Lock()  # koboldcpp's modelbusy
        self._queue = 0
        self._current_genkey = ""
        self._current_run: _Run | None = None
        self._batched_runs: set[_Run] = set()  # batched generations now (under _lock)
        self._batch_cond = threading.Condition()  # koboldcpp's batched_cond
        self._batched = 0  # koboldcpp's batched_request_runner_count (under _batch_cond)
        self._batch_slots = threading.Semaphore(self.parallel_requests)
        self._pending_abort: str | None = None
        self._last_text = ""
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._started_at = time.time()
        self._last_req_time = self._started_at
        self._perf: dict[str, Any] = {
            "last_process": 0.0,
            "last_eval": 0.0,
            "last_token_count": 0,
            "last_input_count": 0,
            "last_process_time": 0.0,
            "last_eval_time": 0.0,
            "last_process_speed": 0,
            "last_eval_speed": 0,
            "last_seed": -1,
            "last_draft_success": 0,
            "last_draft_failed": 0,
            "total_gens": 0,
            "stop_reason": -1,
            "total_img_gens": 0,
            "total_tts_gens": 0,
            "total_transcribe_gens": 0,
        }

    # ------------------------------------------------------------ lifecycle

    def start(self) -> ScriptedKoboldcpp:
        """Bind and serve on a daemon thread; returns self."""
        if self._server is not None:
            return self
        self._stopping.clear()
        self._server = _Server((self._host, self._port), self)
        self._started_at = self._last_req_time = time.time()
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="scripted-kcpp",
            daemon=True,
        )
        self._thread.start()
        log.info("scripted koboldcpp listening on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving; running generations are aborted and hangs released."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._stopping.set()
        with self._lock:
            if self._current_run is not None:
                self._current_run.abort.set()
            for run in self._batched_runs:
                run.abort.set()
        with self._batch_cond:
            self._batch_cond.notify_all()
        self._server = None
        self._thread = None
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)

    def kill(self) -> None:
        """Die like a killed koboldcpp process: no answer to anything in flight.

        Every open connection is reset (TCP RST) before a byte more is written,
        running generations end, and the port closes. A new
        ``ScriptedKoboldcpp(port=<the same port>)`` then plays the restarted one.
        """
        server = self._server
        if server is None:
            return
        with server.sockets_lock:
            socks = list(server.open_sockets)
        for sock in socks:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.stop()

    def __enter__(self) -> ScriptedKoboldcpp:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The bound port. Raises RuntimeError before start()."""
        if self._server is None:
            raise RuntimeError("the scripted koboldcpp is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` without a trailing slash."""
        return f"http://{self._host}:{self.port}"

    # -------------------------------------------------------------- scripting

    def script(self, fn: Callable[[dict[str, Any]], ScriptedReply | None] | None) -> None:
        """Set ``fn(body) -> ScriptedReply | None`` for chat and generate (None: default reply).

        ``script(None)`` removes it.
        """
        self._script = fn

    def inject(self, route: str, *responses: Fault) -> None:
        """Queue faults for the next requests on ``route`` (one per request, in order).

        Routes: the values of :data:`GET_ROUTES` and :data:`POST_ROUTES`
        (``"chat"``, ``"generate"``, ``"tokencount"``, ``"abort"``, ``"perf"``,
        ``"version"``, ``"info_version"``, ``"model"``...). Each response is:

        * ``(status, body)``: answered at once as JSON (``body`` may be a dict,
          list, str or bytes; str and bytes are sent as they are);
        * ``"reset"``: the connection is reset (TCP RST) without an answer;
        * ``"hang:<s>"``: wait ``s`` seconds (released by ``stop()``), then serve
          the request normally;
        * ``"truncate"``: the normal answer with its full ``content-length`` but
          only half the body, then close (a stream is cut like ``stream_cut``);
        * ``"stream_cut"``: a stream stops after half its tokens, in the middle
          of a ``data:`` line, and the connection closes (no ``[DONE]``); on a
          JSON route it acts like ``"truncate"``;
        * ``"stream_error"``: after half its tokens a chat stream sends an
          in-band error event (:data:`STREAM_ERROR_EVENT`) and then goes on
          generating and streaming as if nothing happened;
        * ``"no_finish"``: a chat stream's final chunk carries
          ``finish_reason: null``; usage and ``[DONE]`` follow as usual;
        * ``"stall:<s>"``: a chat stream goes silent for ``s`` seconds after
          half its tokens, then carries on.

        The last three apply to streamed chat completions only.

        Raises ValueError for an unknown route or fault.
        """
        if route not in ROUTE_NAMES:
            raise ValueError(f"unknown route {route!r}; known: {sorted(ROUTE_NAMES)}")
        for fault in responses:
            if isinstance(fault, tuple):
                if len(fault) != 2 or not isinstance(fault[0], int):
                    raise ValueError(f"a fault tuple is (status, body), got {fault!r}")
            elif fault.startswith("hang:"):
                float(fault[5:])
            elif fault.startswith("stall:"):
                float(fault[6:])
            elif fault not in ("reset", "truncate", "stream_cut", "stream_error", "no_finish"):
                raise ValueError(f"unknown fault {fault!r}")
        with self._lock:
            self._faults.setdefault(route, deque()).extend(responses)

    @property
    def generating(self) -> bool:
        """True while a generation holds the model lock."""
        return self._model.locked()

    @property
    def queue(self) -> int:
        """Requests waiting for the model lock."""
        return self._queue

    @property
    def running(self) -> int:
        """Generations running now: the one holding the model lock, if any, and the batched ones."""
        with self._lock:
            return len(self._batched_runs) + (1 if self._current_run is not None else 0)

    def local_generate(self, seconds: float, *, genkey: str = "KCPP0001") -> threading.Thread:
        """Simulate a local user's generation holding the model for ``seconds``.

        Runs in a daemon thread (returned, already started): waits for the model
        lock like any request, updates ``last_non_horde_request_time`` at the
        start and the end, and can be aborted like a real generation.
        """

        def work() -> None:
            with self._lock:
                self._queue += 1
            try:
                acquired = self._acquire_model()
            finally:
                with self._lock:
                    self._queue -= 1
            if not acquired:
                return
            try:
                with self._lock:
                    self._last_req_time = time.time()
                run = self._begin(genkey)
                aborted = run.abort.wait(seconds)
                self._finish_stats(0, 0, STOP_OUT_OF_TOKENS if aborted else STOP_EOS)
                self._end(run)
            finally:
                self._model.release()

        thread = threading.Thread(target=work, name="scripted-kcpp-local", daemon=True)
        thread.start()
        return thread

    # ----------------------------------------------------------- dispatching

    def _handle(self, h: _Handler) -> None:
        path = urlsplit(h.path).path
        try:
            length = int(h.headers.get("content-length") or 0)
        except ValueError:
            length = 0
        if length > self.max_request_bytes:
            ex = _Exchange(h, "", None, b"")
            self._record(h, path, None)
            ex.send_json(500, too_big_body(self.max_request_bytes))
            h.close_connection = True
            return
        raw = h.rfile.read(length) if length > 0 else b""
        body: Any = None
        if raw:
            try:
                body = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                body = None
        self._record(h, path, body)
        routes = GET_ROUTES if h.command == "GET" else POST_ROUTES
        route = routes.get(path)
        ex = _Exchange(h, route or "", body, raw)
        if route is None:
            ex.send_json(404, {"detail": {"msg": "Not found.", "type": "not_found"}})
            return
        fault: Fault | None = None
        with self._lock:
            queued = self._faults.get(route)
            if queued:
                fault = queued.popleft()
        if isinstance(fault, tuple):
            ex.send_json(fault[0], fault[1])
            return
        if fault == "reset":
            ex.reset()
            return
        if isinstance(fault, str) and fault.startswith("hang:"):
            if self._stopping.wait(float(fault[5:])):
                ex.reset()
                return
        elif fault in ("truncate", "stream_cut"):
            ex.cut = fault
        elif isinstance(fault, str):
            ex.stream_fault = fault
        try:
            getattr(self, "_route_" + route)(ex)
        except _ClientGone:
            log.debug("scripted koboldcpp: client went away on %s", path)

    def _record(self, h: _Handler, path: str, body: Any) -> None:
        self.requests.append(
            {
                "method": h.command,
                "path": path,
                "headers": {k.lower(): v for k, v in h.headers.items()},
                "body": body,
            }
        )

    def _authorized(self, ex: _Exchange) -> bool:
        if not self.password:
            return True
        return ex.header("Authorization").strip() == f"Bearer {self.password}"

    # ------------------------------------------------------------ open GETs

    def _route_info_version(self, ex: _Exchange) -> None:
        ex.send_json(200, {"result": KAI_API_VERSION})

    def _route_model(self, ex: _Exchange) -> None:
        name = self.model_name if self._authorized(ex) else PROTECTED_MODEL_NAME
        ex.send_json(200, {"result": name})

    def _route_version(self, ex: _Exchange) -> None:
        ex.send_json(
            200,
            {
                "result": "KoboldCpp",
                "version": self.version,
                "protected": bool(self.password),
                "llm": self.model_name != "inactive",
                "txt2img": False,
                "vision": self.vision,
                "audio": False,
                "transcribe": False,
                "multiplayer": False,
                "websearch": False,
                "tts": False,
                "embeddings": False,
                "music": False,
                "savedata": False,
                "admin": 0,
                "router": False,
                "guidance": False,
                "jinja": self.jinja,
                "mcp": False,
            },
        )

    def _route_true_max_context_length(self, ex: _Exchange) -> None:
        ex.send_json(200, {"value": self.max_context_length})

    def _route_max_context_length(self, ex: _Exchange) -> None:
        ctx = self.max_context_length
        horde = self.horde_max_context_length
        ex.send_json(200, {"value": min(ctx, horde if horde > 0 else ctx)})

    def _route_max_length(self, ex: _Exchange) -> None:
        ex.send_json(200, {"value": self.horde_max_length})

    def _route_models(self, ex: _Exchange) -> None:
        ex.send_json(
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": int(self._started_at),
                        "owned_by": "koboldcpp",
                        "status": {"value": "loaded"},
                        "permission": [],
                        "root": "koboldcpp",
                    }
                ],
            },
        )

    def _route_perf(self, ex: _Exchange) -> None:
        now = time.time()
        with self._lock:
            body = dict(self._perf)
            body["queue"] = self._queue
            body["idle"] = 0 if self._model.locked() or self._batched_runs else 1
            body["hordeexitcounter"] = -1
            body["uptime"] = now - self._started_at
            body["idletime"] = now - self._last_req_time
            body["quiet"] = True
        ex.send_json(200, body)

    # ----------------------------------------------------- protected helpers

    def _route_tokencount(self, ex: _Exchange) -> None:
        if not self._authorized(ex):
            ex.send_json(401, UNAUTHORIZED_BODY)
            return
        body = ex.body if isinstance(ex.body, dict) else {}
        prompt = body.get("prompt", "")
        if prompt is None:
            prompt = ""
        if not isinstance(prompt, str):
            ex.send_json(400, {"value": -1})
            return
        if prompt == "" and "messages" in body:
            self.tokencount_messages.append(body)
            messages = body.get("messages")
            if isinstance(messages, list):
                # adapter mode keeps tools in memory, which tokencount does not count (§5.1)
                prompt, _ = _render_chat(messages, None)
        pieces = self.tokenizer.pieces(prompt)
        ids = self.tokenizer.ids(pieces)
        if body.get("special", True) is not False:
            ids = [BOS_ID, *ids]
        ex.send_json(200, {"value": len(ids), "ids": ids, "prompt": prompt})

    def _route_abort(self, ex: _Exchange) -> None:
        if not self._authorized(ex):
            ex.send_json(401, UNAUTHORIZED_BODY)
            return
        body = ex.body if isinstance(ex.body, dict) else {}
        genkey = body.get("genkey", "")
        genkey = genkey if isinstance(genkey, str) else ""
        with self._lock:
            if (not genkey and self._queue == 0) or (genkey and genkey == self._current_genkey):
                if self._current_run is not None:
                    self._current_run.abort.set()
                self.aborts.append(genkey)
                answer = {"success": "true", "done": "true"}
            elif genkey and self._queue > 0:
                self._pending_abort = genkey
                answer = {"success": "true", "done": "false"}
            else:
                answer = {"success": "false", "done": "false"}
        if self.abort_reply_delay_s > 0:
            self._stopping.wait(self.abort_reply_delay_s)
        ex.send_json(200, answer)

    def _route_generate_check(self, ex: _Exchange) -> None:
        if not self._authorized(ex):
            ex.send_json(401, UNAUTHORIZED_BODY)
            return
        body = ex.body if isinstance(ex.body, dict) else {}
        genkey = body.get("genkey", "") if ex.h.command == "POST" else ""
        with self._lock:
            run = self._current_run
            text = run.partial if run is not None else self._last_text
            if genkey:
                ok = genkey == self._current_genkey
            else:
                ok = (
                    self._queue == 0 and self._perf["total_gens"] > 0 and self._current_genkey == ""
                )
        ex.send_json(200, {"results": [{"text": text if ok else ""}]})

    # ----------------------------------------------------------- generation

    def _route_chat(self, ex: _Exchange) -> None:
        self._serve_generation(ex, self._chat)

    def _route_generate(self, ex: _Exchange) -> None:
        self._serve_generation(ex, self._kobold_generate)

    def _route_generate_stream(self, ex: _Exchange) -> None:
        self._serve_generation(ex, self._kobold_stream)

    def _acquire_model(self) -> bool:
        while not self._stopping.is_set():
            if self._model.acquire(timeout=0.05):
                return True
        return False

    def _serve_generation(
        self, ex: _Exchange, serve: Callable[[_Exchange, dict[str, Any], _Run], None]
    ) -> None:
        if self.busy:
            ex.send_json(503, BUSY_BODY)
            return
        with self._lock:
            self._queue += 1
        try:
            acquired = self._acquire_model()
        finally:
            with self._lock:
                self._queue -= 1
        if not acquired:
            ex.reset()
            return
        released = False
        try:
            with self._lock:
                self._last_req_time = time.time()  # koboldcpp sets it before the auth check
            if not self._authorized(ex):
                ex.send_json(401, UNAUTHORIZED_BODY)
                return
            if not isinstance(ex.body, dict):
                ex.send_json(500, BAD_INPUT_BODY)
                return
            genkey = ex.body.get("genkey", "")
            genkey = genkey if isinstance(genkey, str) else ""
            if self._batchable(ex.route, ex.body):
                # koboldcpp releases modelbusy and counts a batched runner (L7116-7122)
                with self._batch_cond:
                    self._batched += 1
                self._model.release()
                released = True
                try:
                    self._serve_batched(ex, serve, genkey)
                finally:
                    with self._batch_cond:
                        self._batched -= 1
                        self._batch_cond.notify_all()
                return
            # a request that is not batchable waits, holding the lock, for the
            # batched ones to end (L7107-7111)
            with self._batch_cond:
                while self._batched > 0 and not self._stopping.is_set():
                    self._batch_cond.wait(0.05)
            run = self._begin(genkey)
            try:
                serve(ex, ex.body, run)
            finally:
                self._end(run)
        finally:
            if not released:
                self._model.release()

    def _serve_batched(
        self,
        ex: _Exchange,
        serve: Callable[[_Exchange, dict[str, Any], _Run], None],
        genkey: str,
    ) -> None:
        """One batched generation, in one of ``parallel_requests`` batch slots."""
        while not self._batch_slots.acquire(timeout=0.05):
            if self._stopping.is_set():
                ex.reset()
                return
        try:
            run = self._begin(genkey, batched=True)
            try:
                serve(ex, cast(dict[str, Any], ex.body), run)
            finally:
                self._end(run)
        finally:
            self._batch_slots.release()

    def _batchable(self, route: str, body: dict[str, Any]) -> bool:
        """koboldcpp's ``continuous_batching_python_eligible`` (L2347-2378) on the body.

        Tools count when a ``tool_choice`` other than ``"none"`` may use them
        (koboldcpp then sets ``using_openai_tools``); a ``response_format`` or
        ``json_schema`` counts as the grammar koboldcpp makes of it.
        """
        if self.parallel_requests <= 1:
            return False
        if body.get("negative_prompt") or body.get("images") or body.get("audio"):
            return False
        received = _received_images(body.get("messages")) if route == "chat" else None
        if received is not None and received["data_urls"]:
            return False
        if any(body.get(key) for key in ("grammar", "grammar_retain_state")):
            return False
        if any(body.get(key) for key in ("banned_tokens", "banned_strings")):
            return False
        if route == "chat":
            fmt = body.get("response_format")
            if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
                return False
            if isinstance(body.get("json_schema"), dict):
                return False
            tools = body.get("tools")
            if isinstance(tools, list) and tools and body.get("tool_choice") != "none":
                return False
        for key in ("dry_multiplier", "mirostat", "xtc_probability", "nsigma"):
            if _float_or(body.get(key), 0.0):
                return False
        if _float_or(body.get("smoothing_factor"), 0.0) or _float_or(
            body.get("adaptive_target"), -1.0
        ) > 0:
            return False
        if _float_or(body.get("top_a"), 0.0) or _float_or(body.get("tfs"), 1.0) != 1:
            return False
        if _float_or(body.get("dynatemp_range"), 0.0):
            return False
        order = body.get("sampler_order")
        if order and order != [6, 0, 1, 3, 4, 2, 5]:
            return False
        return not body.get("reasoning_effort")

    def _begin(self, genkey: str, *, batched: bool = False) -> _Run:
        """Start a generation. A batched one is not the single slot an abort stops."""
        run = _Run(genkey)
        now = time.time()
        with self._lock:
            if not genkey.startswith(HORDE_GENKEY_PREFIX):
                self.last_non_horde_request_time = now
            self._current_genkey = genkey
            if batched:
                self._batched_runs.add(run)
            else:
                self._current_run = run
            if self._pending_abort is not None and genkey == self._pending_abort:
                self._pending_abort = None
                self.aborts.append(genkey)
                run.abort.set()
        return run

    def _end(self, run: _Run) -> None:
        with self._lock:
            if self._current_run is run:
                self._current_run = None
            self._batched_runs.discard(run)
            self._last_text = run.partial
            if not run.genkey.startswith(HORDE_GENKEY_PREFIX):
                self.last_non_horde_request_time = time.time()

    def _finish_stats(self, prompt_tokens: int, completion_tokens: int, stop_reason: int) -> None:
        eval_time = completion_tokens * self.token_delay_s
        with self._lock:
            p = self._perf
            p["last_process_time"] = float(self.prompt_delay_s)
            p["last_eval_time"] = float(eval_time)
            p["last_process"] = (
                self.prompt_delay_s * 1000.0 / prompt_tokens if prompt_tokens else 0.0
            )
            p["last_eval"] = eval_time * 1000.0 / completion_tokens if completion_tokens else 0.0
            p["last_process_speed"] = (
                prompt_tokens / self.prompt_delay_s if self.prompt_delay_s > 0 else 0
            )
            p["last_eval_speed"] = completion_tokens / eval_time if eval_time > 0 else 0
            p["last_token_count"] = completion_tokens
            p["last_input_count"] = prompt_tokens
            p["last_seed"] = random.randint(0, 2**31 - 1)
            p["total_gens"] += 1
            p["stop_reason"] = stop_reason

    def _budget(self, body: dict[str, Any], *, chat: bool) -> tuple[int, int]:
        """(max_length, context) after koboldcpp's clamps (facts §2.8, §4.2).

        As ``generate()`` (L2167-2178): the context capped at the loaded one,
        ``max_length`` capped at ``--genlimit`` when above 0, then a
        ``max_length`` of at least ``ctx - max(min(ctx - 4, 16), int(ctx * 0.2))``
        cut to that value.
        """
        ctx = self.max_context_length
        req_ctx = _int_or_none(body.get("max_context_length"))
        if req_ctx is not None and 0 < req_ctx < ctx:
            ctx = req_ctx
        budget = _int_or_none(body.get("max_length"))
        if chat and (budget is None or budget <= 0):
            budget = _int_or_none(body.get("max_tokens"))
            if budget is None or budget <= 0:
                budget = _int_or_none(body.get("max_completion_tokens"))
            if budget is None or budget <= 0:
                budget = DEFAULT_CHAT_GENLEN
        elif budget is None or budget <= 0:
            budget = DEFAULT_KOBOLD_GENLEN
        if self.genlimit > 0 and budget > self.genlimit:
            budget = self.genlimit
        reserved = max(min(ctx - 4, 16), int(ctx * 0.2))
        if budget >= ctx - reserved:
            budget = ctx - reserved
        return max(1, budget), ctx

    def _scripted(self, body: dict[str, Any]) -> ScriptedReply | None:
        fn = self._script
        return fn(body) if fn is not None else None

    def _run_tokens(self, ex: _Exchange, run: _Run, outcome: _Outcome, *, watch: bool) -> bool:
        """Wait out prompt processing and each token; False when aborted or the client left.

        Trims ``outcome`` to the tokens generated before an abort.
        """
        if not self._wait(ex, run, self.prompt_delay_s, watch=watch):
            outcome.pieces = []
            outcome.stop_reason = STOP_OUT_OF_TOKENS
            outcome.completion_tokens = 0
            return False
        for i, piece in enumerate(outcome.pieces):
            try:
                waited = self._wait(ex, run, self.token_delay_s, watch=watch)
            except _ClientGone:
                outcome.pieces, outcome.completion_tokens = outcome.pieces[:i], i
                raise
            if not waited:
                outcome.pieces = outcome.pieces[:i]
                outcome.stop_reason = STOP_OUT_OF_TOKENS
                outcome.completion_tokens = i
                return False
            run.partial += piece
        return True

    def _wait(self, ex: _Exchange, run: _Run, seconds: float, *, watch: bool) -> bool:
        """Sleep ``seconds``; False when aborted, stopping or (``watch``) the client left."""
        deadline = time.monotonic() + max(0.0, seconds)
        while True:
            if run.abort.is_set() or self._stopping.is_set():
                return False
            if watch and ex.client_gone():
                run.abort.set()
                raise _ClientGone()
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            run.abort.wait(min(left, 0.05))

    # -- chat completions

    def _plan_chat(self, body: dict[str, Any]) -> _Plan:
        messages = body.get("messages")
        messages = messages if isinstance(messages, list) else []
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        tools = [t for t in tools or [] if isinstance(t, dict)] or None
        rendered, images = _render_chat(messages, tools)
        prompt_tokens = 1 + self.tokenizer.count(rendered)
        if self.vision:
            prompt_tokens += images * IMAGE_TOKENS

        scripted = self._scripted(body)
        choice = body.get("tool_choice", "auto")
        chosen = self._choose_tool(tools, choice, messages)
        if scripted is not None:
            reasoning = (
                f"<think>{scripted.reasoning}</think>" if scripted.reasoning is not None else ""
            )
            if scripted.prompt_tokens is not None:
                prompt_tokens = scripted.prompt_tokens
            if scripted.tool_calls and tools:
                calls = _normalise_scripted_calls(scripted.tool_calls)
                return _Plan(
                    reasoning + self._tool_json(calls), scripted.finish, prompt_tokens, calls, True
                )
            return _Plan(reasoning + scripted.text, scripted.finish, prompt_tokens)

        if chosen is not None:
            fn = chosen.get("function") if isinstance(chosen.get("function"), dict) else chosen
            assert isinstance(fn, dict)
            args = example_value(fn.get("parameters") or {"type": "object"})
            calls = [
                {
                    "id": _mint_call_id(),
                    "type": "function",
                    "function": {"name": str(fn.get("name", "")), "arguments": json.dumps(args)},
                }
            ]
            return _Plan(self._tool_json(calls), "eos", prompt_tokens, calls, True)

        user_text, user_images = _last_user_text(messages)
        last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
        if last.get("role") == "tool":
            result, _ = _content_text(last.get("content"))
            answer = f"The tool returned: {result.strip()[:200]}"
        else:
            answer = _default_answer(user_text, user_images)
        answer = self._format_answer(body, answer)
        if "think" in user_text.lower():
            words = " ".join(user_text.split()[:12])
            thought = f"The user wrote: {words} I will answer briefly."
            return _Plan(f"<think>\n{thought}\n</think>\n\n{answer}", "eos", prompt_tokens)
        return _Plan(answer, "eos", prompt_tokens)

    @staticmethod
    def _format_answer(body: dict[str, Any], answer: str) -> str:
        """Structured output: json_schema -> object, json_object -> array, grammar -> its root."""
        fmt = body.get("response_format")
        schema: Any = None
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema", {}) if isinstance(spec, dict) else {}
        elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
            return "[\n" + json.dumps(answer) + "\n]"
        elif isinstance(body.get("json_schema"), dict):
            schema = body["json_schema"]
        if schema is not None:
            return json.dumps(example_value(schema or {"type": "object"}), indent=2)
        grammar = body.get("grammar")
        if isinstance(grammar, str) and grammar.strip():
            kind = grammar_root_kind(grammar)
            if kind == "object":
                return json.dumps({"answer": answer}, indent=2)
            if kind == "array":
                return "[\n" + json.dumps(answer) + "\n]"
        return answer

    @staticmethod
    def _choose_tool(
        tools: list[dict[str, Any]] | None, choice: Any, messages: list[Any]
    ) -> dict[str, Any] | None:
        """The tool the default reply calls, or None (facts §4.5)."""
        if not tools or choice is None or choice == "none":
            return None

        def by_name(name: Any) -> dict[str, Any] | None:
            if not isinstance(name, str):
                return None
            for tool in tools:
                fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
                if isinstance(fn, dict) and str(fn.get("name", "")).lower() == name.lower():
                    return tool
            return None

        if isinstance(choice, dict):
            fn = choice.get("function")
            named = by_name(fn.get("name") if isinstance(fn, dict) else None)
            if named is not None:
                return named
            choice = "auto"
        elif isinstance(choice, str) and choice not in ("auto", "required"):
            named = by_name(choice)
            if named is not None:
                return named
            choice = "auto"
        last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
        if choice == "auto" and last.get("role") == "tool":
            return None
        return tools[0]

    @staticmethod
    def _tool_json(calls: list[dict[str, Any]]) -> str:
        return json.dumps(
            [
                {
                    "id": "call_001",
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.loads(c["function"]["arguments"] or "{}"),
                    },
                }
                for c in calls
            ]
        )

    def _chat(self, ex: _Exchange, body: dict[str, Any], run: _Run) -> None:
        received = _received_images(body.get("messages"))
        if received is not None:
            received["genkey"] = run.genkey
            with self._lock:
                self.images.append(received)
        plan = self._plan_chat(body)
        budget, ctx = self._budget(body, chat=True)
        stops = _stop_list(body.get("stop"))
        prompt_tokens = plan.prompt_tokens
        overflow = prompt_tokens + budget > ctx
        if overflow:
            prompt_tokens = max(1, ctx - budget)
        if run.abort.is_set():  # pre-aborted by a pending abort key
            outcome = _Outcome([], STOP_INVALID, 0)
        else:
            outcome = execute_plan(self.tokenizer, plan.raw, plan.end, budget=budget, stops=stops)
        stream = body.get("stream") is True
        encapsulate = body.get("encapsulate_thinking", True) is not False
        record: dict[str, Any] = {
            "route": "chat",
            "genkey": run.genkey,
            "stream": stream,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "finish_reason": None,
            "aborted": False,
            "client_gone": False,
            "overflow": overflow,
        }
        finish = "length"
        recorded = False
        try:
            if stream and plan.tool_path:
                ex.start_sse()
                record["aborted"] = not self._run_tokens(ex, run, outcome, watch=True)
                message, finish = self._chat_message(plan, outcome, stops, encapsulate)
                self._write_fake_stream(ex, message, finish)
            elif stream:
                self._chat_stream(ex, body, run, outcome, stops, prompt_tokens, encapsulate, record)
                finish = _finish_reason(outcome.stop_reason)
            else:
                record["aborted"] = not self._run_tokens(ex, run, outcome, watch=False)
                message, finish = self._chat_message(plan, outcome, stops, encapsulate)
                # Recorded before the answer leaves, so a client that reads
                # ``generations`` right after the answer always finds it.
                recorded = self._record_generation(record, outcome, finish, prompt_tokens)
                ex.send_json(
                    200,
                    {
                        "id": f"chatcmpl-A{random.randint(100000, 999999)}",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": self.model_name,
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": outcome.completion_tokens,
                            "total_tokens": prompt_tokens + outcome.completion_tokens,
                        },
                        "choices": [
                            {
                                "index": 0,
                                "message": message,
                                "finish_reason": finish,
                                "logprobs": None,
                            }
                        ],
                    },
                )
        except _ClientGone:
            record["client_gone"] = True
            record["aborted"] = True
            finish = "length"
            raise
        finally:
            if not recorded:
                self._record_generation(record, outcome, finish, prompt_tokens)

    def _record_generation(
        self, record: dict[str, Any], outcome: _Outcome, finish: str, prompt_tokens: int
    ) -> bool:
        """Finish a generation record, update the perf figures and keep the record."""
        record["completion_tokens"] = outcome.completion_tokens
        record["finish_reason"] = finish
        self._finish_stats(prompt_tokens, outcome.completion_tokens, outcome.stop_reason)
        self.generations.append(record)
        return True

    def _chat_message(
        self, plan: _Plan, outcome: _Outcome, stops: list[str], encapsulate: bool
    ) -> tuple[dict[str, Any], str]:
        """The non-stream ``message`` and ``finish_reason`` (facts §4.5-§4.7)."""
        text = "".join(outcome.pieces)
        if outcome.stop_reason == STOP_CUSTOM:
            text = _trim_stops(text, stops)
        finish = _finish_reason(outcome.stop_reason)
        content, reasoning = split_reasoning(text)
        if plan.tool_path and plan.tool_calls is not None:
            complete = content.strip() == self._tool_json(plan.tool_calls)
            if complete and outcome.stop_reason != STOP_ERROR:
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": None if reasoning else "",
                    "tool_calls": plan.tool_calls,
                }
                if reasoning and encapsulate:
                    message["reasoning_content"] = reasoning
                return message, "tool_calls"
        message = {"role": "assistant", "content": content, "tool_calls": []}
        if reasoning and encapsulate:
            message["reasoning_content"] = reasoning
        elif reasoning:
            message["content"] = reasoning + content
        return message, finish

    def _chunk(self, chunk_id: str, delta: dict[str, Any], finish: str | None) -> bytes:
        event = {
            "id": chunk_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "finish_reason": finish, "delta": delta}],
        }
        return b"data: " + json.dumps(event).encode("utf-8") + b"\n\n"

    def _chat_stream(
        self,
        ex: _Exchange,
        body: dict[str, Any],
        run: _Run,
        outcome: _Outcome,
        stops: list[str],
        prompt_tokens: int,
        encapsulate: bool,
        record: dict[str, Any],
    ) -> None:
        chunk_id = f"chatcmpl-A{random.randint(100000, 999999)}"
        splitter = OaiStreamSplitter(
            stops if self.hold_stop_sequences else [], encapsulate_thinking=encapsulate
        )
        ex.start_sse()
        half = max(1, len(outcome.pieces) // 2)
        cut_after = half if ex.cut is not None else -1
        fault = ex.stream_fault or ""
        error_after = half if fault == "stream_error" else -1
        stall_after = half if fault.startswith("stall:") else -1
        if not self._wait(ex, run, self.prompt_delay_s, watch=True):
            outcome.pieces, outcome.completion_tokens = [], 0
            outcome.stop_reason = STOP_OUT_OF_TOKENS
            record["aborted"] = True
        sent = 0
        try:
            for piece in list(outcome.pieces):
                if record["aborted"]:
                    break
                if not self._wait(ex, run, self.token_delay_s, watch=True):
                    outcome.stop_reason = STOP_OUT_OF_TOKENS
                    record["aborted"] = True
                    break
                run.partial += piece
                sent += 1
                for delta, finish in splitter.step(piece):
                    self._log_chunk(delta)
                    ex.write(self._chunk(chunk_id, delta, finish))
                if sent == error_after:
                    ex.write(b"data: " + json.dumps(STREAM_ERROR_EVENT).encode("utf-8") + b"\n\n")
                    record["error_sent"] = True
                if sent == stall_after and not self._wait(ex, run, float(fault[6:]), watch=True):
                    outcome.stop_reason = STOP_OUT_OF_TOKENS
                    record["aborted"] = True
                    break
                if sent == cut_after:
                    partial = self._chunk(chunk_id, {"role": "assistant", "content": "x"}, None)
                    ex.write(partial[: len(partial) // 2])
                    record["cut"] = True
                    raise _ClientGone()
        finally:
            if sent < len(outcome.pieces):
                outcome.pieces, outcome.completion_tokens = outcome.pieces[:sent], sent
        reason = _finish_reason(outcome.stop_reason)
        for delta, finish in splitter.finish(None if fault == "no_finish" else reason):
            self._log_chunk(delta)
            ex.write(self._chunk(chunk_id, delta, finish))
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            completion = len(outcome.pieces)
            usage_event = {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion,
                },
            }
            ex.write(b"data: " + json.dumps(usage_event).encode("utf-8") + b"\n\n")
        ex.write(b"data: [DONE]\n\n")

    def _log_chunk(self, delta: dict[str, Any]) -> None:
        if self.log_chunks:
            self.chunk_log.append((time.monotonic(), dict(delta)))

    def _write_fake_stream(self, ex: _Exchange, message: dict[str, Any], finish: str) -> None:
        """koboldcpp's tool fake-stream: whole reply after generation, id "koboldcpp"."""
        chunks: list[bytes] = []
        if message.get("reasoning_content"):
            chunks.append(
                self._chunk("koboldcpp", {"reasoning_content": message["reasoning_content"]}, None)
            )
        if message.get("content"):
            chunks.append(self._chunk("koboldcpp", {"content": message["content"]}, None))
        calls = message.get("tool_calls") or []
        for index, call in enumerate(calls):
            head = {
                "index": index,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            chunks.append(self._chunk("koboldcpp", {"tool_calls": [head]}, None))
        for index, call in enumerate(calls):
            args = {"index": index, "function": {"arguments": call["function"]["arguments"]}}
            chunks.append(self._chunk("koboldcpp", {"tool_calls": [args]}, None))
        chunks.append(self._chunk("koboldcpp", {}, finish))
        if ex.cut is not None:
            data = b"".join(chunks)
            ex.write(data[: len(data) // 2])
            raise _ClientGone()
        for chunk in chunks:
            ex.write(chunk)
        ex.write(b"data: [DONE]\n\n")

    # -- Kobold API

    def _plan_kobold(self, body: dict[str, Any]) -> _Plan:
        prompt = body.get("prompt")
        prompt = prompt if isinstance(prompt, str) else ""
        memory = body.get("memory")
        memory = memory if isinstance(memory, str) else ""
        prompt_tokens = 1 + self.tokenizer.count(memory + prompt)
        scripted = self._scripted(body)
        if scripted is not None:
            reasoning = (
                f"<think>{scripted.reasoning}</think>" if scripted.reasoning is not None else ""
            )
            if scripted.prompt_tokens is not None:
                prompt_tokens = scripted.prompt_tokens
            return _Plan(reasoning + scripted.text, scripted.finish, prompt_tokens)
        lines = [line for line in prompt.splitlines() if line.strip()]
        answer = _default_answer(lines[-1] if lines else "", 0)
        return _Plan(" " + answer, "eos", prompt_tokens)

    def _kobold_outcome(
        self, body: dict[str, Any], run: _Run
    ) -> tuple[_Plan, _Outcome, list[str], int, bool]:
        plan = self._plan_kobold(body)
        budget, ctx = self._budget(body, chat=False)
        stops = _stop_list(body.get("stop_sequence"))
        prompt_tokens = plan.prompt_tokens
        overflow = prompt_tokens + budget > ctx
        if overflow:
            prompt_tokens = max(1, ctx - budget)
        if run.abort.is_set():
            outcome = _Outcome([], STOP_INVALID, 0)
        else:
            outcome = execute_plan(self.tokenizer, plan.raw, plan.end, budget=budget, stops=stops)
        return plan, outcome, stops, prompt_tokens, overflow

    def _kobold_generate(self, ex: _Exchange, body: dict[str, Any], run: _Run) -> None:
        _, outcome, stops, prompt_tokens, overflow = self._kobold_outcome(body, run)
        aborted = not self._run_tokens(ex, run, outcome, watch=False)
        text = "".join(outcome.pieces)
        if outcome.stop_reason == STOP_CUSTOM and body.get("trim_stop", True) is not False:
            text = _trim_stops(text, stops)
        finish = _finish_reason(outcome.stop_reason)
        self._finish_stats(prompt_tokens, outcome.completion_tokens, outcome.stop_reason)
        self.generations.append(
            {
                "route": "generate",
                "genkey": run.genkey,
                "stream": False,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": outcome.completion_tokens,
                "finish_reason": finish,
                "aborted": aborted,
                "client_gone": False,
                "overflow": overflow,
            }
        )
        ex.send_json(
            200,
            {
                "results": [
                    {
                        "text": text,
                        "tool_calls": [],
                        "finish_reason": finish,
                        "logprobs": None,
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": outcome.completion_tokens,
                    }
                ]
            },
        )

    def _kobold_stream(self, ex: _Exchange, body: dict[str, Any], run: _Run) -> None:
        _, outcome, stops, prompt_tokens, overflow = self._kobold_outcome(body, run)
        ex.start_sse()
        record: dict[str, Any] = {
            "route": "generate_stream",
            "genkey": run.genkey,
            "stream": True,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "finish_reason": "length",
            "aborted": False,
            "client_gone": False,
            "overflow": overflow,
        }
        try:
            text = "".join(outcome.pieces)
            if outcome.stop_reason == STOP_CUSTOM:
                text = _trim_stops(text, stops)
            emitted = 0
            if not self._wait(ex, run, self.prompt_delay_s, watch=True):
                record["aborted"] = True
            for i, piece in enumerate(list(outcome.pieces)):
                if record["aborted"]:
                    break
                if not self._wait(ex, run, self.token_delay_s, watch=True):
                    outcome.pieces, outcome.completion_tokens = outcome.pieces[:i], i
                    outcome.stop_reason = STOP_OUT_OF_TOKENS
                    record["aborted"] = True
                    break
                run.partial += piece
                token = text[emitted : emitted + len(piece)]
                emitted += len(token)
                if token:
                    event = json.dumps({"token": token, "finish_reason": None})
                    ex.write(f"event: message\ndata: {event}\n\n".encode())
            finish = _finish_reason(outcome.stop_reason)
            record["finish_reason"] = finish
            event = json.dumps({"token": "", "finish_reason": finish})
            ex.write(f"event: message\ndata: {event}\n\n".encode())
        except _ClientGone:
            record["client_gone"] = record["aborted"] = True
            raise
        finally:
            record["completion_tokens"] = outcome.completion_tokens
            self._finish_stats(prompt_tokens, outcome.completion_tokens, outcome.stop_reason)
            self.generations.append(record)


def token_count(text: str, chars_per_token: int = 4) -> int:
    """Tokens of ``text`` for the scripted tokenizer, without BOS (about len / chars_per_token)."""
    return _Tokenizer(chars_per_token).count(text)
