"""The standalone worker as a process, for the tests that run it as a supervisor would
(and for ``bench/bench_stop.py``, which times its stops).

``python -m koboldcpp_horde_chat`` runs in a subprocess against a dev Horde (or
the real one, ``real_horde``) and a scripted koboldcpp of the calling process; its log lines (stderr) are read as
they come. The tests' ``workers`` fixture (``tests/integration/conftest.py``) starts them and kills what
is left at the test's end.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from koboldcpp_horde_chat import BRIDGE_AGENT
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply

ROOT = Path(__file__).resolve().parents[2]
#: The API key the tests' dev Horde accepts.
API_KEY = "test-key-0123456789"
FINAL = ("submitted", "faulted", "cancelled", "expired")
WORKER_NAME = "service-worker"
#: The model the jobs planted before a worker starts are for.
POP_MODEL = "koboldcpp/test-model"
#: A pop body that takes a chat job from the dev Horde, to plant a job in a
#: journal before a worker process starts (its ``name`` is replaced by the
#: worker's own).
POP = {
    "name": "journal-worker",
    "models": [POP_MODEL],
    "max_length": 512,
    "max_context_length": 4096,
    "chat_jobs": True,
    "chat_features": ["prompt_overflow_refused"],
    "chat_limits": {"max_context_length": 2048, "max_length": 512},
    "model_id": POP_MODEL,
    "image_transports": [],
    "bridge_agent": BRIDGE_AGENT,  # a validated agent: the dev Horde skips others
}


class Served(Protocol):
    """A server the worker is pointed at: the dev Horde, the real one, a koboldcpp."""

    @property
    def url(self) -> str: ...


class WorkerProcess:
    """The worker process; its log lines (stderr) are read as they come."""

    def __init__(
        self,
        horde: Served,
        kcpp: Served,
        journal_dir: Path,
        *extra: str,
        key: str = API_KEY,
        name: str = WORKER_NAME,
        cwd: Path = ROOT,
        kcpp_url: str | None = None,
    ) -> None:
        """Start ``python -m koboldcpp_horde_chat`` in ``cwd`` (the package it runs is
        the one there) as worker ``name`` with ``key``, flags ``extra`` added
        (``kcpp_url`` in place of ``kcpp``'s, for one that is down)."""
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "koboldcpp_horde_chat",
                f"--hordekey={key}",  # a key may start with "-" (the real Horde's do)
                "--hordeworkername", name,
                "--horde-url", horde.url,
                "--kcpp-url", kcpp_url or kcpp.url,
                "--hordegenlen", "512",
                "--journal-dir", str(journal_dir),
                "--log-level", "INFO",
                *extra,
            ],
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def said(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    def wait_for(self, text: str, timeout_s: float = 15.0) -> None:
        until(lambda: self.said(text) > 0, timeout_s, lambda: f"no line with {text!r}:\n" + self.log())

    def log(self) -> str:
        return "\n".join(self.lines[-40:])

    def wait(self, timeout_s: float) -> int:
        """The exit code, once the process ended and all its lines were read."""
        code = self.proc.wait(timeout_s)
        self._reader.join(5)
        return code

    def sigterm_to_exit(self, timeout_s: float) -> float | None:
        """Send SIGTERM; seconds until the process exited (None: killed after ``timeout_s``)."""
        self.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            return None
        took = time.monotonic() - signalled
        self._reader.join(5)
        return took

    def sigterm_to_clean_exit(self, timeout_s: float) -> float:
        """:meth:`sigterm_to_exit` for a stop that must end well: the seconds it took.

        Raises:
            AssertionError: the process did not exit within ``timeout_s``, or
                exited with another code than 0 (the message is its log).
        """
        took = self.sigterm_to_exit(timeout_s)
        assert took is not None and self.proc.returncode == 0, self.log()
        return took

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(5)


def until(
    condition: Callable[[], bool],
    timeout_s: float = 15.0,
    why: str | Callable[[], str] = "timed out",
) -> None:
    """Wait until ``condition()``; fail after ``timeout_s`` saying ``why`` (a callable
    is called then, so a worker's log shows its lines up to the failure)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(why() if callable(why) else why)
        time.sleep(0.02)


def job_ids(horde: DevHorde, rid: str) -> list[str]:
    """The ids of the jobs the dev Horde gave out for request ``rid``."""
    return list(horde.status(rid)["job_ids"])


def terminal_actions(horde: DevHorde) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for entry in horde.ledger:
        if entry["action"] in FINAL:
            out.setdefault(entry["job_id"], []).append(entry["action"])
    return out


def slow(kcpp: ScriptedKoboldcpp, seconds: float) -> None:
    """Every generation takes about ``seconds`` (40 tokens)."""
    kcpp.token_delay_s = seconds / 40
    kcpp.script(lambda body: ScriptedReply(text="sky " * 40))


