"""The fit check of a chat job, without rendering the template (pure; no I/O).

Seed section: "3. Render and fit the conversation" ("koboldcpp's embedded
worker therefore does not render for the check").

Rendering through koboldcpp's chat transform can run a hidden tool-choice
generation, so the worker counts the tokens of the JSON of ``messages``,
``tools`` and ``response_format`` instead (the count itself is done by
koboldcpp's ``/api/extra/tokencount``, outside this module), then adds 32
tokens, 16 per message and 512 per image.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("koboldcpp_horde_chat.fit")

BASE_TOKENS = 32
PER_MESSAGE_TOKENS = 16
PER_IMAGE_TOKENS = 512
IMAGE_PLACEHOLDER = "<image>"
"""Stands in for each image URL in the counted text, so image bytes are never tokenised."""


@dataclass(frozen=True)
class FitResult:
    """The outcome of :func:`check_fit`, all in tokens.

    Attributes:
        estimate: the prompt estimate (counted tokens plus the allowances).
        needed: ``estimate + max_length``.
        limit: the context the job must fit (``max_context_length``).
        fits: ``needed <= limit``.
    """

    estimate: int
    needed: int
    limit: int
    fits: bool


def _is_image_part(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _without_image_data(messages: list[Any]) -> list[Any]:
    """A copy of ``messages`` whose image_url parts carry the placeholder as url."""
    result: list[Any] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image_part(p) for p in content):
            result.append(message)
            continue
        parts: list[Any] = []
        for part in content:
            if _is_image_part(part):
                image = part.get("image_url")
                new_image = dict(image) if isinstance(image, dict) else {}
                new_image["url"] = IMAGE_PLACEHOLDER
                parts.append({**part, "image_url": new_image})
            else:
                parts.append(part)
        result.append({**message, "content": parts})
    return result


def fit_prompt(messages: list[Any], tools: object = None, response_format: object = None) -> str:
    """The text whose tokens are counted for the fit check.

    The JSON (``ensure_ascii=False``) of ``messages``, then of ``tools`` and of
    ``response_format`` when they are not None, joined by ``"\\n"``. Every
    image_url part's ``url`` is replaced by ``"<image>"``; images are paid for
    by :data:`PER_IMAGE_TOKENS` instead. The inputs are not modified.
    """
    pieces = [json.dumps(_without_image_data(messages), ensure_ascii=False)]
    if tools is not None:
        pieces.append(json.dumps(tools, ensure_ascii=False))
    if response_format is not None:
        pieces.append(json.dumps(response_format, ensure_ascii=False))
    return "\n".join(pieces)


def count_images(messages: list[Any]) -> int:
    """How many image_url parts the messages hold."""
    count = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            count += sum(1 for part in content if _is_image_part(part))
    return count


def check_fit(
    counted_tokens: int, messages: list[Any], *, max_length: int, max_context_length: int
) -> FitResult:
    """Whether a conversation fits the context.

    Args:
        counted_tokens: koboldcpp's token count of :func:`fit_prompt`'s text.
        messages: the conversation (for the per-message and per-image allowances).
        max_length: the job's generation budget, tokens.
        max_context_length: the context the prompt and reply must share, tokens.

    Returns:
        ``FitResult`` with ``estimate = counted_tokens + 32 + 16 * len(messages)
        + 512 * images`` and ``fits`` when ``estimate + max_length <=
        max_context_length``. When it does not fit the job is faulted with
        ``prompt_overflow`` (seed step 3 and 7).
    """
    estimate = (
        counted_tokens
        + BASE_TOKENS
        + PER_MESSAGE_TOKENS * len(messages)
        + PER_IMAGE_TOKENS * count_images(messages)
    )
    needed = estimate + max_length
    fits = needed <= max_context_length
    return FitResult(estimate=estimate, needed=needed, limit=max_context_length, fits=fits)
