"""The worker's bridge agent is one the Horde validates, read the way the Horde reads it.

The Horde stores a pop's ``bridge_agent`` HTML-escaped and stripped, splits it at
its first two colons into name, version and free text, and reads an agent
without two colons or whose version is not a semantic version (minor and patch
optional) as ``unknown``. A text request keeps ``validated_backends: true``
unless its client says otherwise, and then goes only to a worker whose agent
name is in the validated set; every other worker earns 0.3 x the kudos.
"""

from __future__ import annotations

import re

import pytest

from koboldcpp_horde_chat import BRIDGE_AGENT, __version__
from koboldcpp_horde_chat.devkit.horde import (
    LLM_VALIDATED_BACKENDS,
    is_validated_backend,
    parse_bridge_agent,
)
from koboldcpp_horde_chat.horde.declaration import BackendCapabilities, pop_body
from koboldcpp_horde_chat.settings import WorkerSettings

#: The Horde's validated text backends: ``LLM_VALIDATED_BACKENDS`` in
#: ``horde/bridge_reference.py`` of Haidra-Org/AI-Horde.
HORDE_VALIDATED_BACKENDS = frozenset(
    {
        "AI Horde Worker",
        "AI Horde Worker~aphrodite~oai",
        "AI Horde Worker~aphrodite~kai",
        "KoboldCppEmbedWorker",
        "TabbyAPI",
    }
)
#: What koboldcpp's own embedded worker sends (koboldcpp 1.116.1 and 1.117.1).
KOBOLDCPP_AGENT = "KoboldCppEmbedWorker:2:https://github.com/LostRuins/koboldcpp"
#: The longest bridge agent the Horde's pop accepts, characters.
HORDE_BRIDGE_AGENT_MAX_CHARS = 1000


def test_the_bridge_agent_names_koboldcpps_embedded_worker_a_validated_backend() -> None:
    parts = BRIDGE_AGENT.split(":", 2)
    assert len(parts) == 3
    name, version, free_text = parts
    assert name in HORDE_VALIDATED_BACKENDS
    assert (name, version) == tuple(KOBOLDCPP_AGENT.split(":", 2)[:2])
    assert re.fullmatch(r"0|[1-9][0-9]*", version)  # a version the Horde parses
    # The free text tells this package apart from koboldcpp's own worker: its name
    # and version alone (the package has no web page to name).
    assert free_text == f"koboldcpp-horde-chat {__version__}"
    assert BRIDGE_AGENT != KOBOLDCPP_AGENT
    # Stored unchanged: no surrounding space and nothing the Horde HTML-escapes.
    assert BRIDGE_AGENT == BRIDGE_AGENT.strip() and not set("<>&") & set(BRIDGE_AGENT)
    assert len(BRIDGE_AGENT) <= HORDE_BRIDGE_AGENT_MAX_CHARS


def test_every_pop_sends_the_bridge_agent() -> None:
    settings = WorkerSettings(
        api_key="k", worker_name="w", model_id="koboldcpp/m", backend_max_context_length=4096
    )
    body = pop_body(settings, BackendCapabilities())
    assert body["bridge_agent"] == BRIDGE_AGENT
    assert is_validated_backend(body["bridge_agent"])


def test_the_dev_hordes_validated_set_is_the_hordes() -> None:
    assert LLM_VALIDATED_BACKENDS == HORDE_VALIDATED_BACKENDS


@pytest.mark.parametrize(
    ("agent", "parsed", "validated"),
    [
        (KOBOLDCPP_AGENT, ("KoboldCppEmbedWorker", "2"), True),
        (BRIDGE_AGENT, ("KoboldCppEmbedWorker", "2"), True),
        ("  TabbyAPI:0.1.0-rc.1+b7:a:b:c  ", ("TabbyAPI", "0.1.0-rc.1+b7"), True),
        ("AI Horde Worker~aphrodite~oai:1.2:x", ("AI Horde Worker~aphrodite~oai", "1.2"), True),
        ("koboldcpp-horde-chat:0.1.0:https://x", ("koboldcpp-horde-chat", "0.1.0"), False),
        ("unknown:0:unknown", ("unknown", "0"), False),
        ("KoboldCppEmbedWorker:2", ("unknown", "0"), False),
        ("KoboldCppEmbedWorker:v2:x", ("unknown", "0"), False),
        ("KoboldCppEmbedWorker:02:x", ("unknown", "0"), False),
        ("KoboldCppEmbedWorker:2.x:x", ("unknown", "0"), False),
        ("KoboldCppEmbedWorker&:2:x", ("KoboldCppEmbedWorker&amp;", "2"), False),
        ("", ("unknown", "0"), False),
    ],
)
def test_the_dev_horde_reads_a_bridge_agent_as_the_horde_does(
    agent: str, parsed: tuple[str, str], validated: bool
) -> None:
    assert parse_bridge_agent(agent) == parsed
    assert is_validated_backend(agent) is validated
