"""``koboldcpp-horde-chat devkcpp``: the scripted koboldcpp by itself, as a user starts it by hand.

It runs as a subprocess: its first line says what it is (scripted, not a model)
and where, it answers koboldcpp's routes there, the standalone worker it prints
serves a job from the dev Horde through it, and Ctrl-C stops it with exit code 0.
"""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import requests

from bench.harness.worker_process import API_KEY
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.hosts.standalone import run_standalone

from .test_devhorde_command import ROOT, first_line, lines_until

FIRST_LINE = re.compile(
    r"Scripted koboldcpp at (http://127\.0\.0\.1:\d+) \(model (\S+), context (\d+) tokens, "
    r"vision (on|off)\): canned replies, not a model"
)


def start(*flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "koboldcpp_horde_chat", "devkcpp", *flags],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def devkcpp(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[str], re.Match[str]]]:
    proc = start("--port", "0", *getattr(request, "param", ()))
    try:
        m = FIRST_LINE.fullmatch(first_line(proc).strip())
        assert m, "the first line says it is scripted and names its URL"
        yield proc, m
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_devkcpp_answers_koboldcpps_model_route_and_stops_on_ctrl_c(
    devkcpp: tuple[subprocess.Popen[str], re.Match[str]],
) -> None:
    proc, m = devkcpp
    url = m.group(1)
    assert (m.group(2), m.group(3), m.group(4)) == ("koboldcpp/scripted-model", "4096", "off")
    model = requests.get(f"{url}/api/v1/model", timeout=10)
    assert model.status_code == 200
    assert model.json() == {"result": "koboldcpp/scripted-model"}
    assert requests.get(f"{url}/api/extra/version", timeout=10).json()["vision"] is False
    proc.send_signal(signal.SIGINT)
    assert proc.wait(20) == 0
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    assert out.rstrip().endswith("Scripted koboldcpp stopped.")
    assert "Traceback" not in err
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/api/v1/model", timeout=5)


@pytest.mark.parametrize("devkcpp", [("--vision", "--model-name", "koboldcpp/my-vision")],
                         indirect=True)
def test_devkcpp_with_vision_reports_a_projector(
    devkcpp: tuple[subprocess.Popen[str], re.Match[str]],
) -> None:
    _, m = devkcpp
    assert (m.group(2), m.group(4)) == ("koboldcpp/my-vision", "on")
    assert requests.get(f"{m.group(1)}/api/extra/version", timeout=10).json()["vision"] is True
    assert requests.get(f"{m.group(1)}/api/v1/model", timeout=10).json() == {
        "result": "koboldcpp/my-vision"
    }


def test_the_printed_worker_serves_a_chat_job_through_it(
    devkcpp: tuple[subprocess.Popen[str], re.Match[str]], horde: DevHorde
) -> None:
    """The standalone worker as printed (the dev Horde's URL and key swapped for the
    test's), against this process: a chat request is served with its canned reply."""
    proc, m = devkcpp
    lines = lines_until(proc, "Ctrl-C stops it.")
    (worker,) = [shlex.split(line) for line in lines if line.startswith("  koboldcpp-horde-chat")]
    assert worker[worker.index("--kcpp-url") + 1] == m.group(1)
    flags = worker[1:]
    flags[flags.index("--horde-url") + 1] = horde.url
    flags[flags.index("--hordekey") + 1] = API_KEY
    rid = horde.send_chat({"messages": [{"role": "user", "content": "Name a colour."}],
                           "max_tokens": 16})
    stop = threading.Event()
    thread = threading.Thread(target=run_standalone, args=(flags,), kwargs={"stop_event": stop},
                              daemon=True)
    thread.start()
    try:
        assert horde.wait([rid], timeout_s=60)
    finally:
        stop.set()
        thread.join(20)
    assert not thread.is_alive()
    status = horde.status(rid)
    assert status["state"] == "done", status
    assert "Blue." in str(status)  # the scripted reply to a colour question


def test_devkcpp_on_a_port_in_use_exits_2_with_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = start("--port", str(port))
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2, err
    assert out.startswith(f"Cannot listen on 127.0.0.1:{port}: ")
    assert len(out.splitlines()) == 1
    assert "Traceback" not in err
