"""The toy model: its tokenizer, what a scripted reply is, how a chat is rendered into
a prompt, and a planned output generated token by token under a budget and stops.
"""

from __future__ import annotations

import binascii
import json
import zlib
from dataclasses import dataclass
from typing import Any

from koboldcpp_horde_chat.devkit.kcpp.values import (
    _SPECIAL_RE,
    _SPECIAL_TAGS,
    MAX_STOP_SEQUENCES,
    STOP_CUSTOM,
    STOP_EOS,
    STOP_ERROR,
    STOP_OUT_OF_TOKENS,
    Finish,
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


def token_count(text: str, chars_per_token: int = 4) -> int:
    """Tokens of ``text`` for the scripted tokenizer, without BOS (about len / chars_per_token)."""
    return _Tokenizer(chars_per_token).count(text)


def _finish_reason(stop_reason: int) -> str:
    """koboldcpp's mapping: -2 error, 1 stop, anything else length (``koboldcpp.py`` L5194)."""
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
    ``data:image`` and base64-decodes the text after the first comma (``koboldcpp.py``
    L4390-4391)."""
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
