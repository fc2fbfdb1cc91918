"""koboldcpp's cut of a request's max_length and the declared max_length (koboldcpp.py L2168-2180).

The values below come from koboldcpp 1.116.1's ``generate()``: a request's
``max_context_length`` is capped at koboldcpp's context size, and a
``max_length`` of at least ``ctx - max(min(ctx - 4, 16), int(ctx * 0.2))`` is
cut to that value.
"""

from __future__ import annotations

import dataclasses

import pytest

from koboldcpp_horde_chat.settings import (
    WorkerSettings,
    kcpp_context_keeping_budget,
    kcpp_effective_max_length,
    kcpp_max_uncut_length,
    kcpp_reserved_tokens,
)


def settings(**changes: object) -> WorkerSettings:
    base = WorkerSettings(
        api_key="0000000000",
        worker_name="my-worker",
        model_id="koboldcpp/scripted-model",
        backend_max_context_length=4096,
        max_length=512,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("context", "reserved", "uncut"),
    [
        (4096, 819, 3277),  # int(4096 * 0.2) = 819
        (1000, 200, 800),
        (2048, 409, 1639),
        (12288, 2457, 9831),
        (50, 16, 34),  # small contexts keep at least 16 tokens (min(ctx - 4, 16))
        (10, 6, 4),
        (256, 51, 205),
    ],
)
def test_koboldcpps_cut_keeps_a_fifth_of_the_context_for_the_prompt(
    context: int, reserved: int, uncut: int
) -> None:
    assert kcpp_reserved_tokens(context) == reserved
    assert kcpp_max_uncut_length(context) == uncut


@pytest.mark.parametrize(
    ("max_length", "max_context_length", "kcpp_context", "budget"),
    [
        # the request's context, when it is within koboldcpp's
        (900, 1000, 4096, 800),
        (800, 1000, 4096, 800),
        (799, 1000, 4096, 799),
        (512, 4096, 4096, 512),
        (3277, 4096, 4096, 3277),
        (3278, 4096, 4096, 3277),
        # koboldcpp's context, when the request asks for more
        (4000, 8192, 4096, 3277),
        (900, 1000, 512, 410),
        (1, 1000, 4096, 1),
    ],
)
def test_the_effective_budget_is_the_one_koboldcpp_generates_under(
    max_length: int, max_context_length: int, kcpp_context: int, budget: int
) -> None:
    assert kcpp_effective_max_length(max_length, max_context_length, kcpp_context) == budget


def test_a_genlen_that_leaves_room_for_a_prompt_is_declared_as_asked() -> None:
    assert settings(max_length=512).declared_max_length == 512
    assert settings(max_length=3277).declared_max_length == 3277
    assert settings(max_length=512).max_length_warning() is None
    assert settings(max_length=3277).max_length_warning() is None


def test_a_genlen_koboldcpp_would_cut_is_declared_at_koboldcpps_bound() -> None:
    big = settings(max_length=100_000)
    assert big.declared_max_length == 3277
    assert big.max_length_warning() == (
        "max_length 100000 (--hordegenlen) is lowered to 3277: koboldcpp cuts a max_length above 3277 "
        "on this worker's 4096-token context, which keeps room for the prompt"
    )
    # the bound follows the declared context (--hordemaxctx), not koboldcpp's alone
    small = settings(max_length=1024, horde_max_context_length=1000)
    assert small.declared_max_length == 800
    assert "max_length 1024 (--hordegenlen) is lowered to 800" in (small.max_length_warning() or "")


# --- koboldcpp's --genlimit ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_length", "max_context_length", "genlimit", "budget"),
    [
        (512, 4096, 200, 200),  # koboldcpp stops every generation at --genlimit
        (150, 4096, 200, 150),
        (900, 1000, 850, 800),  # the genlimit first, then the 20 % cut
        (900, 1000, 0, 800),  # 0: no --genlimit
    ],
)
def test_the_effective_budget_follows_koboldcpps_genlimit(
    max_length: int, max_context_length: int, genlimit: int, budget: int
) -> None:
    assert kcpp_effective_max_length(max_length, max_context_length, 4096, genlimit) == budget


def test_a_genlen_above_koboldcpps_genlimit_is_declared_at_the_genlimit() -> None:
    limited = settings(max_length=512, kcpp_genlimit=200)
    assert limited.declared_max_length == 200
    assert limited.max_length_warning() == (
        "max_length 512 (--hordegenlen) is lowered to 200: koboldcpp's --genlimit 200 stops every "
        "generation there"
    )
    assert settings(max_length=100, kcpp_genlimit=200).declared_max_length == 100
    assert settings(max_length=100_000, kcpp_genlimit=5000).declared_max_length == 3277


# --- the context sent to koboldcpp --------------------------------------------------------


@pytest.mark.parametrize(
    ("max_length", "max_context_length", "kcpp_context", "sent"),
    [
        (420, 500, 4096, 524),  # 500 would cut 420 to 400; 524 keeps 420 (524 - 104)
        (400, 500, 4096, 500),  # the job's own context already keeps the budget
        (256, 4096, 4096, 4096),
        (3277, 4096, 4096, 4096),
        (420, 8192, 4096, 4096),  # never above koboldcpp's context
        (900, 1000, 1050, 1050),  # nothing larger to give: koboldcpp's own context
    ],
)
def test_the_context_sent_to_koboldcpp_keeps_the_jobs_budget_whole(
    max_length: int, max_context_length: int, kcpp_context: int, sent: int
) -> None:
    assert kcpp_context_keeping_budget(max_length, max_context_length, kcpp_context) == sent


def test_the_context_sent_is_the_smallest_that_keeps_every_declarable_budget() -> None:
    for context in (20, 80, 500, 1000, 2048):
        for max_length in range(1, kcpp_max_uncut_length(4096) + 1, 7):
            sent = kcpp_context_keeping_budget(max_length, context, 4096)
            assert sent >= context
            assert kcpp_effective_max_length(max_length, sent, 4096) == max_length
            assert sent == context or kcpp_max_uncut_length(sent - 1) < max_length
