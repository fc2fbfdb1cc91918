"""The fit check of a chat job without rendering the template (pure; seed "3. Render
and fit the conversation"): rendering can run a hidden tool-choice generation, so
the tokens of the JSON of the conversation are counted instead, plus allowances."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

BASE_TOKENS = 32
PER_MESSAGE_TOKENS = 16
PER_IMAGE_TOKENS = 512
#: Stands in for each image URL in the counted text: image bytes are never tokenised.
IMAGE_PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class FitResult:
    """In tokens: ``needed`` is ``estimate + max_length``, ``fits`` ``needed <= limit``."""

    estimate: int
    needed: int
    limit: int
    fits: bool


def _is_image_part(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _parts(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, list) else []


def _placeholder(part: Any) -> Any:
    """An image_url part with the placeholder as its url; another part as it is."""
    if not _is_image_part(part):
        return part
    image = part.get("image_url")
    return {**part, "image_url": {**(image if isinstance(image, dict) else {}),
                                  "url": IMAGE_PLACEHOLDER}}


def fit_prompt(messages: list[Any], tools: object = None, response_format: object = None) -> str:
    """The JSON of ``messages`` (image URLs replaced by ``"<image>"``), ``tools`` and
    ``response_format`` when not None, one per line: the text counted."""
    shown = [
        {**message, "content": [_placeholder(part) for part in _parts(message)]}
        if _parts(message) else message
        for message in messages
    ]
    pieces = (shown, tools, response_format)
    return "\n".join(json.dumps(p, ensure_ascii=False) for p in pieces if p is not None)


def count_images(messages: list[Any]) -> int:
    return sum(1 for message in messages for part in _parts(message) if _is_image_part(part))


def check_fit(counted_tokens: int, messages: list[Any], *, max_length: int,
              max_context_length: int) -> FitResult:
    """Tokens: ``estimate = counted_tokens + 32 + 16 * messages + 512 * images``; a job
    that does not fit is faulted with ``prompt_overflow`` (seed steps 3 and 7)."""
    estimate = counted_tokens + BASE_TOKENS + PER_MESSAGE_TOKENS * len(messages)
    estimate += PER_IMAGE_TOKENS * count_images(messages)
    needed = estimate + max_length
    fits = needed <= max_context_length
    return FitResult(estimate=estimate, needed=needed, limit=max_context_length, fits=fits)
