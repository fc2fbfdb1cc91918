"""The standalone worker's name: the flag, else ``HORDE_WORKER_NAME`` (a service's
or a container's environment), checked as the Horde checks it."""

from __future__ import annotations

import pytest

from koboldcpp_horde_chat.errors import ConfigError
from koboldcpp_horde_chat.hosts import standalone_flags
from koboldcpp_horde_chat.hosts.hosting import WORKER_NAME_ENV, worker_name_from


def test_the_name_comes_from_the_environment_when_the_flag_is_not_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HORDE_WORKER_NAME", "  My Worker  ")
    monkeypatch.setenv("AI_HORDE_API_KEY", "k" * 22)
    args = standalone_flags.build_parser().parse_args([])
    standalone_flags.check_flags(args)
    assert args.hordeworkername == "My Worker"
    assert WORKER_NAME_ENV == "HORDE_WORKER_NAME"


def test_the_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HORDE_WORKER_NAME", "from-env")
    assert worker_name_from("from-flag") == "from-flag"


def test_a_bad_name_is_named_by_where_it_came_from() -> None:
    with pytest.raises(ConfigError) as env:
        worker_name_from(None, {"HORDE_WORKER_NAME": "x" * 101})
    assert str(env.value) == (
        "HORDE_WORKER_NAME: the name is 101 characters long; the Horde takes at most 100"
    )
    with pytest.raises(ConfigError) as flag:
        worker_name_from("  ", {"HORDE_WORKER_NAME": "fine"})
    assert str(flag.value) == (
        "--hordeworkername: a worker name is required (not empty or only spaces)"
    )


def test_without_flag_or_environment_the_name_is_required_saying_both_ways() -> None:
    with pytest.raises(ConfigError) as missing:
        worker_name_from(None, {})
    assert str(missing.value) == "--hordeworkername is required (or set HORDE_WORKER_NAME)"


def test_the_help_names_the_environment_variable() -> None:
    text = " ".join(standalone_flags.build_parser().format_help().split())
    assert "your AI Horde worker name, 1 to 100 characters (or HORDE_WORKER_NAME)" in text
