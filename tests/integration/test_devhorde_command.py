"""``koboldcpp-horde-chat devhorde``: the dev Horde by itself, as a user starts it by hand.

It runs as a subprocess: the first line names its URL and key, a worker pops
from it with that key, a client's request is queued, the printed example
requests are served by the real worker, and Ctrl-C stops it with exit code 0.
"""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from koboldcpp_horde_chat import BRIDGE_AGENT
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp
from koboldcpp_horde_chat.hosts.standalone import run_standalone

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


def lines_until(proc: subprocess.Popen[str], last: str, timeout_s: float = 30.0) -> list[str]:
    """The process's stdout lines up to and including ``last``, read within ``timeout_s``."""
    assert proc.stdout is not None
    got: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            got.append(line.rstrip("\n"))
            if line.strip() == last:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert got and got[-1].strip() == last, got
    return got


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


def test_the_printed_chat_and_text_requests_are_served_with_64_tokens(
    devhorde: tuple[subprocess.Popen[str], str, str], kcpp: ScriptedKoboldcpp
) -> None:
    """Run as printed: the standalone worker's command (beside the scripted koboldcpp),
    each example request as its curl would send it, and its status command."""
    proc, url, key = devhorde
    lines = lines_until(proc, "Ctrl-C stops it.")
    commands = [shlex.split(line) for line in lines if line.startswith("  ")]
    worker = next(c for c in commands if c[0] == "koboldcpp-horde-chat")
    sends = {c[4].rsplit("/", 2)[-2]: c for c in commands if c[:4] == ["curl", "-s", "-X", "POST"]}
    statuses = {c[2].rsplit("/", 3)[-3]: c[2] for c in commands if c[:2] == ["curl", "-s"] and len(c) == 3}
    assert sorted(sends) == sorted(statuses) == ["chat", "text"]

    stop = threading.Event()
    thread = threading.Thread(
        target=run_standalone, args=([*worker[1:], "--kcpp-url", kcpp.url],), kwargs={"stop_event": stop}, daemon=True
    )
    thread.start()
    try:
        ids: dict[str, str] = {}
        for kind, curl in sends.items():
            assert curl[5:8] == ["-H", "Content-Type: application/json", "-d"] and len(curl) == 9, curl
            answer = requests.post(curl[4], data=curl[8].encode(), headers={"Content-Type": "application/json"}, timeout=10)
            assert answer.status_code == 202, answer.text
            ids[kind] = answer.json()["id"]
        final: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + 60
        while len(final) < 2 and time.monotonic() < deadline:
            for kind, status_url in statuses.items():
                status = requests.get(status_url.replace("REQUEST_ID", ids[kind]), timeout=10).json()
                if status["done"] or status["faulted"]:
                    final[kind] = status
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join(20)
    assert not thread.is_alive()
    assert final["chat"]["done"] and not final["chat"]["faulted"] and final["chat"]["message"]["content"], final
    assert final["text"]["done"] and isinstance(final["text"]["generation"], str), final
    bodies = {r["path"]: r["body"] for r in kcpp.requests if r["method"] == "POST"}
    assert bodies["/v1/chat/completions"]["max_tokens"] == 64
    assert bodies["/api/v1/generate"]["max_length"] == 64


def test_devhorde_latency_ms_delays_each_worker_answer_as_a_round_trip() -> None:
    proc = start("--port", "0", "--key", "k-latency", "--latency-ms", "300")
    try:
        m = FIRST_LINE.fullmatch(first_line(proc).strip())
        assert m
        url = m.group(1)
        started = time.monotonic()
        pop = requests.post(
            f"{url}/api/v2/generate/text/pop", json=POP, headers={"apikey": "k-latency"}, timeout=10
        )
        assert pop.status_code == 200
        assert time.monotonic() - started >= 0.3
    finally:
        proc.kill()
        proc.communicate(timeout=10)
    bad = start("--port", "0", "--latency-ms", "nan")
    out, _ = bad.communicate(timeout=30)
    assert bad.returncode == 2
    assert out.strip() == "--latency-ms must be a number of milliseconds, 0 or more"


def test_devhorde_names_its_object_store_below_the_url_and_logs_nothing_before(
    devhorde: tuple[subprocess.Popen[str], str, str],
) -> None:
    """On a terminal the URL and key come first: no log line is written before them
    (the object store's port was once logged first as "dev-storage listening on ...",
    unexplained); the second line names that port in plain words."""
    proc, url, key = devhorde
    lines = lines_until(proc, "Ctrl-C stops it.")
    store = re.fullmatch(
        r"Its object store at (http://127\.0\.0\.1:\d+) serves chat images and large requests' "
        r"messages by signed URL, as the real Horde's does\.",
        lines[0],
    )
    assert store and store.group(1) != url, lines[:2]
    assert lines[1] == "Its log lines (requests queued, pops, submits, faults) go to stderr."
    proc.send_signal(signal.SIGINT)
    assert proc.wait(20) == 0
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert "listening on" not in err, err


def test_the_docs_show_what_devhorde_prints(devhorde: tuple[subprocess.Popen[str], str, str]) -> None:
    """docs/development.md's devhorde block is its output, line for line (URL, key
    and the object store's free port aside)."""
    proc, url, key = devhorde
    printed = lines_until(proc, "Ctrl-C stops it.")
    page = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    block = page.split("demo use) by itself and keeps it running until Ctrl-C. It prints:\n\n```text\n", 1)[1]
    shown = block.split("\n```", 1)[0].splitlines()
    assert shown[0] == "Dev Horde at http://127.0.0.1:7001 (API key: devkey)"
    expected = [
        re.sub(r"object store at http://127\.0\.0\.1:\d+", "object store at STORE", line)
        .replace("http://127.0.0.1:7001", url)
        .replace("devkey", key)
        for line in shown[1:]
    ]
    got = [re.sub(r"object store at http://127\.0\.0\.1:\d+", "object store at STORE", line) for line in printed]
    assert got == expected
