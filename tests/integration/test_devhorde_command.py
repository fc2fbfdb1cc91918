"""``koboldcpp-horde-chat devhorde``: the dev Horde by itself, as a user starts it by hand.

It runs as a subprocess: the first line names its URL and key, a worker pops
from it with that key, a client's request is queued, and Ctrl-C stops it with
exit code 0.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from koboldcpp_horde_chat import BRIDGE_AGENT

ROOT = Path(__file__).resolve().parents[2]
FIRST_LINE = re.compile(r"Dev Horde at (http://127\.0\.0\.1:\d+) \(API key: (\S+)\)")
POP = {
    "name": "hand-worker",
    "models": ["koboldcpp/test-model"],
    "max_length": 512,
    "max_context_length": 4096,
    "bridge_agent": BRIDGE_AGENT,  # a validated agent: the dev Horde skips others
}


def start(*flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "koboldcpp_horde_chat", "devhorde", *flags],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def first_line(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> str:
    """The process's first stdout line, read within ``timeout_s``."""
    assert proc.stdout is not None
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout_s)
    assert got, "no line printed in time"
    return got[0]


@pytest.fixture
def devhorde() -> Iterator[tuple[subprocess.Popen[str], str, str]]:
    proc = start("--port", "0", "--key", "hand-key-0123")
    try:
        m = FIRST_LINE.fullmatch(first_line(proc).strip())
        assert m, "the first line names the URL and the key"
        yield proc, m.group(1), m.group(2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_devhorde_prints_its_url_serves_pops_and_stops_on_ctrl_c(
    devhorde: tuple[subprocess.Popen[str], str, str],
) -> None:
    proc, url, key = devhorde
    assert key == "hand-key-0123"
    refused = requests.post(f"{url}/api/v2/generate/text/pop", json=POP, headers={"apikey": "x"}, timeout=10)
    assert refused.status_code == 401
    assert refused.json()["rc"] == "InvalidAPIKey"
    queued = requests.post(
        f"{url}/api/v2/generate/text/async", json={"prompt": "Hello", "params": {"max_length": 16}}, timeout=10
    )
    assert queued.status_code == 202, queued.text
    pop = requests.post(f"{url}/api/v2/generate/text/pop", json=POP, headers={"apikey": key}, timeout=10)
    assert pop.status_code == 200, pop.text
    assert pop.json()["id"] and pop.json()["payload"]["prompt"] == "Hello"

    proc.send_signal(signal.SIGINT)
    assert proc.wait(20) == 0
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    assert "--horde-url " + url in out
    assert f"AI_HORDE_URL={url} python koboldcpp.py" in out
    assert out.rstrip().endswith("Dev Horde stopped.")
    assert "Traceback" not in err
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/api/v2/workers/name/hand-worker", timeout=5)


def test_devhorde_on_a_port_in_use_exits_2_with_one_line() -> None:
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
