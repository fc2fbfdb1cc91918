"""The fit check without rendering (seed step 3, koboldcpp's embedded worker)."""

from __future__ import annotations

import copy
import json

from koboldcpp_horde_chat.translate.fit import (
    BASE_TOKENS,
    PER_IMAGE_TOKENS,
    PER_MESSAGE_TOKENS,
    FitResult,
    check_fit,
    count_images,
    fit_prompt,
)

SEED_MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": [{"type": "text", "text": "Name one colour."}]},
]
IMAGE_DATA = "data:image/jpeg;base64," + "A" * 50_000
IMAGE_MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Compare these."},
            {"type": "image_url", "image_url": {"url": IMAGE_DATA, "detail": "low"}},
            {"type": "image_url", "image_url": {"url": "https://store.example/i.jpg"}},
        ],
    },
    {"role": "assistant", "content": "Two cats."},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE_DATA}}]},
]


def test_the_allowances_are_the_seeds() -> None:
    assert (BASE_TOKENS, PER_MESSAGE_TOKENS, PER_IMAGE_TOKENS) == (32, 16, 512)


def test_the_prompt_is_the_json_of_the_messages() -> None:
    text = fit_prompt(SEED_MESSAGES, None, None)
    assert json.loads(text) == SEED_MESSAGES


def test_tools_and_response_format_are_counted_too() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "parameters": {"type": "object"}}}]
    response_format = {"type": "json_object"}
    text = fit_prompt(SEED_MESSAGES, tools, response_format)
    lines = text.split("\n")
    assert [json.loads(line) for line in lines] == [SEED_MESSAGES, tools, response_format]


def test_non_ascii_text_is_kept_as_text_not_escapes() -> None:
    text = fit_prompt([{"role": "user", "content": "Nenne eine Farbe: grün, 日本"}], None, None)
    assert "grün, 日本" in text


def test_image_bytes_are_never_counted() -> None:
    original = copy.deepcopy(IMAGE_MESSAGES)
    text = fit_prompt(IMAGE_MESSAGES, None, None)
    assert "AAAA" not in text
    assert "store.example" not in text
    assert len(text) < 500
    counted = json.loads(text)
    assert counted[0]["content"][1] == {"type": "image_url",
                                        "image_url": {"url": "<image>", "detail": "low"}}
    assert counted[1] == IMAGE_MESSAGES[1]
    assert IMAGE_MESSAGES == original


def test_images_are_counted_per_part() -> None:
    assert count_images(IMAGE_MESSAGES) == 3
    assert count_images(SEED_MESSAGES) == 0
    assert count_images([{"role": "user", "content": None}]) == 0


def test_the_estimate_adds_base_message_and_image_allowances() -> None:
    result = check_fit(100, IMAGE_MESSAGES, max_length=512, max_context_length=4096)
    estimate = 100 + 32 + 16 * 3 + 512 * 3
    assert result == FitResult(estimate=estimate, needed=estimate + 512, limit=4096, fits=True)


def test_a_conversation_fits_exactly_at_the_limit_and_not_one_token_over() -> None:
    # The seed's job: max_length 512, max_context_length 2048, two messages.
    allowance = 32 + 16 * 2
    at_limit = 2048 - 512 - allowance
    assert check_fit(at_limit, SEED_MESSAGES, max_length=512, max_context_length=2048).fits
    over = check_fit(at_limit + 1, SEED_MESSAGES, max_length=512, max_context_length=2048)
    assert not over.fits
    assert over.needed == 2049
    assert over.limit == 2048
