"""Shutdown of the standalone CLI: SIGINT/SIGTERM finish the job in hand, then exit.

``python -m koboldcpp_horde_chat`` runs in a subprocess against the dev Horde
and the scripted koboldcpp of this test process. A signal stops popping at
once; the job in hand ends in one terminal action; the process exits within
5 s of the job's end with code 0; no job is left popped and unanswered. A
second signal exits at once (code 130), faulting the job in hand first.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply

from .conftest import API_KEY

ROOT = Path(__file__).resolve().parents[2]
FINAL = ("submitted", "faulted", "cancelled", "expired")


@pytest.fixture
def cli(horde: DevHorde, kcpp: ScriptedKoboldcpp) -> Iterator[Callable[[], subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start() -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "koboldcpp_horde_chat",
                "--hordekey", API_KEY,
                "--hordeworkername", "signal-worker",
                "--horde-url", horde.url,
                "--kcpp-url", kcpp.url,
                "--hordegenlen", "512",
                "--log-level", "INFO",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def until(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def one_terminal_action_each(horde: DevHorde) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in horde.ledger:
        if entry["action"] in FINAL:
            assert entry["job_id"] not in out, horde.ledger
            out[entry["job_id"]] = entry["action"]
    return out


def slow_reply(kcpp: ScriptedKoboldcpp) -> None:
    kcpp.token_delay_s = 0.04
    kcpp.script(lambda body: ScriptedReply(text="The sky is blue today. " * 8))  # ~46 tokens, ~2 s


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_signal_mid_job_finishes_that_job_pops_nothing_more_and_exits_0(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, cli: Callable[[], subprocess.Popen[str]],
    signum: int, stream: bool,
) -> None:
    slow_reply(kcpp)
    body = {"messages": [{"role": "user", "content": "Tell me about the sky."}], "stream": stream}
    first = horde.send_chat(body, best_effort=True)
    second = horde.send_chat(body, best_effort=True)
    proc = cli()
    until(lambda: kcpp.generating)
    proc.send_signal(signum)
    signalled = time.monotonic()
    assert horde.wait([first], timeout_s=20)
    job_end = time.monotonic()
    code = proc.wait(timeout=job_end - signalled + 10)
    exited = time.monotonic()
    _, err = proc.communicate(timeout=5)
    assert code == 0, err[-2000:]
    assert exited - job_end < 5.0
    assert one_terminal_action_each(horde) == {horde.status(first)["job_ids"][0]: "submitted"}
    # Popping stopped at the signal: the second request was never handed out.
    assert horde.status(second)["state"] == "waiting" and not horde.status(second)["job_ids"]
    assert "finishing the job in hand" in err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_idle_exits_0_within_5_s(
    horde: DevHorde, cli: Callable[[], subprocess.Popen[str]], signum: int
) -> None:
    proc = cli()
    until(lambda: len(horde.pops) >= 2)
    proc.send_signal(signum)
    signalled = time.monotonic()
    code = proc.wait(timeout=10)
    assert code == 0
    assert time.monotonic() - signalled < 5.0
    assert not horde.ledger
    _, err = proc.communicate(timeout=5)
    assert f"signal {int(signum)}: stopping (no job in hand)" in err, err[-2000:]
    assert "finishing" not in err


def test_a_second_signal_exits_at_once_after_faulting_the_job_in_hand(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, cli: Callable[[], subprocess.Popen[str]]
) -> None:
    kcpp.token_delay_s = 0.1
    kcpp.script(lambda body: ScriptedReply(text="The sky is blue today. " * 40))  # ~20 s
    rid = horde.send_chat({"messages": [{"role": "user", "content": "Sky?"}]}, best_effort=True)
    proc = cli()
    until(lambda: kcpp.generating)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    code = proc.wait(timeout=10)
    assert code == 130
    assert time.monotonic() - signalled < 5.0
    (job_id,) = horde.status(rid)["job_ids"]
    assert one_terminal_action_each(horde) == {job_id: "faulted"}
