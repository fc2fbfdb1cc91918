"""koboldcpp's --genlimit and the context sent with a chat job, as the worker reads and sends them.

koboldcpp 1.116.1 ``generate()`` caps every ``max_length`` at ``--genlimit``
(``koboldcpp.py`` L2175-2176) and cuts one that leaves less than about 20 %
of the request's context to the prompt (L2167-2178).
"""

from __future__ import annotations

import pytest

from koboldcpp_horde_chat.errors import ConfigError
from koboldcpp_horde_chat.horde.declaration import pop_body
from koboldcpp_horde_chat.hosts import inside_kcpp as kcpp_hook
from koboldcpp_horde_chat.hosts import standalone_flags
from koboldcpp_horde_chat.translate.bodies import chat_request_body

from .test_inside_kcpp import hook_settings, make_kcpp
from .test_pop_and_bodies import chat_job


@pytest.mark.parametrize(("genlimit", "declared"), [(200, 200), (0, 512), (None, 512), (-3, 512)])
def test_inside_koboldcpp_its_genlimit_bounds_both_declared_max_lengths(
    genlimit: int | None, declared: int
) -> None:
    s = hook_settings(make_kcpp(maxhordelen=512, args_={"genlimit": genlimit}))
    body = pop_body(s, kcpp_hook.capabilities(s))
    assert body["max_length"] == declared
    assert body["chat_limits"]["max_length"] == declared


def test_a_koboldcpp_without_genlimit_declares_its_hordegenlen() -> None:
    kcpp = make_kcpp(maxhordelen=512)
    assert not hasattr(kcpp.args, "genlimit")
    assert hook_settings(kcpp).declared_max_length == 512


def test_the_standalone_worker_takes_koboldcpps_genlimit_from_a_flag() -> None:
    args = standalone_flags.build_parser().parse_args(
        ["--hordekey", "k", "--hordeworkername", "w", "--kcpp-genlimit", "200"]
    )
    standalone_flags.check_flags(args)
    assert args.kcpp_genlimit == 200
    bad = standalone_flags.build_parser().parse_args(
        ["--hordekey", "k", "--hordeworkername", "w", "--kcpp-genlimit", "-1"]
    )
    with pytest.raises(ConfigError, match="--kcpp-genlimit must not be negative"):
        standalone_flags.check_flags(bad)


def test_a_chat_request_carries_the_context_it_is_given_else_the_jobs() -> None:
    job = chat_job()
    sent = chat_request_body(job, [], genkey="HORDEREQ_1", stream=False, max_context_length=2600)
    assert (sent["max_tokens"], sent["max_context_length"]) == (512, 2600)
    assert chat_request_body(job, [], genkey="HORDEREQ_1", stream=False)["max_context_length"] == 2048
