"""The lines when the Horde stops answering and when it answers again
(``horde.watch.HordeWatch``): once per episode, not once per call or retry; a call
that waits too long is said while it waits.

Real Horde clients call a dev Horde (its scripted hangs) or a closed port.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

import pytest

from koboldcpp_horde_chat import BRIDGE_AGENT
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.errors import HordeUnavailable
from koboldcpp_horde_chat.horde.client import HordeClient
from koboldcpp_horde_chat.horde.watch import HordeWatch

KEY = "watch-key-9f8e7d"
POP = {"name": "watched", "models": ["koboldcpp/fake"], "max_length": 64,
       "max_context_length": 512, "bridge_agent": BRIDGE_AGENT}
NOT_ANSWERING = re.compile(r"Horde not answering for (\d+) s \((.+)\): waiting")
ANSWERING = re.compile(r"Horde answering again after (\d+) s")


def watch_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if NOT_ANSWERING.fullmatch(r.getMessage()) or ANSWERING.fullmatch(r.getMessage())
    ]


def test_a_call_the_horde_keeps_waiting_is_said_while_it_waits_then_its_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    watch = HordeWatch(quiet_after_s=0.5)
    with DevHorde(api_keys=(KEY,)) as horde, HordeClient(
        horde.url, KEY, bridge_agent=BRIDGE_AGENT, watch=watch
    ) as client:
        horde.inject("pop", "hang:2.2")
        said_during: list[str] = []

        def look() -> None:
            time.sleep(1.2)
            said_during.extend(watch_lines(caplog))

        looker = threading.Thread(target=look)
        looker.start()
        client.pop(POP, timeout_s=10)
        looker.join()
        client.pop(POP, timeout_s=10)  # answered at once: nothing more to say
    assert len(said_during) == 1 and NOT_ANSWERING.fullmatch(said_during[0])
    first, second = watch_lines(caplog)
    assert NOT_ANSWERING.fullmatch(first) and NOT_ANSWERING.fullmatch(first)[2] == "pop"  # type: ignore[index]
    match = ANSWERING.fullmatch(second)
    assert match is not None and 2 <= int(match[1]) <= 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [first]


def test_failed_calls_in_a_row_are_one_episode_and_its_end_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    watch = HordeWatch(quiet_after_s=60.0)
    with HordeClient(
        f"http://127.0.0.1:{port}", KEY, bridge_agent=BRIDGE_AGENT, watch=watch
    ) as client:
        for _ in range(6):
            with pytest.raises(HordeUnavailable):
                client.submit({"id": "j1", "generation": "x"}, timeout_s=1)
    (line,) = watch_lines(caplog)
    match = NOT_ANSWERING.fullmatch(line)
    assert match is not None and match[2] == "submit; 3 calls failed in a row"
    with DevHorde(api_keys=(KEY,), port=port) as horde, HordeClient(
        horde.url, KEY, bridge_agent=BRIDGE_AGENT, watch=watch
    ) as client:
        client.pop(POP, timeout_s=10)
        client.pop(POP, timeout_s=10)
    lines = watch_lines(caplog)
    assert len(lines) == 2 and ANSWERING.fullmatch(lines[1])


def test_a_quick_horde_is_never_said(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    watch = HordeWatch(quiet_after_s=0.5)
    with DevHorde(api_keys=(KEY,)) as horde, HordeClient(
        horde.url, KEY, bridge_agent=BRIDGE_AGENT, watch=watch
    ) as client:
        horde.inject("pop", (503, {"message": "busy"}), (503, {"message": "busy"}))
        for _ in range(2):
            with pytest.raises(HordeUnavailable):
                client.pop(POP, timeout_s=10)
        for _ in range(3):
            client.pop(POP, timeout_s=10)
    assert watch_lines(caplog) == []
