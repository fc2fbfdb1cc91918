"""A real koboldcpp: where it is, how the benchmarks start it, and stopping every one.

``find_koboldcpp()`` reads ``$KCPP_DIR`` (default ``kcpp-src/`` in the
repository) and ``$KCPP_MODEL`` (default the first ``*.gguf`` of
``$KCPP_DIR/models``) when called. A :class:`KoboldcppProcess` runs on a free
127.0.0.1 port in a session of its own, gets SIGTERM when the bench dies (even
by SIGKILL, on Linux), and is stopped by :func:`stop_all` at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import requests
from harness import ROOT

DEFAULT_KCPP_DIR = ROOT / "kcpp-src"
READY_TIMEOUT_S = 180.0


def find_koboldcpp() -> tuple[Path | None, Path | None, str]:
    """``(koboldcpp source dir, model, "")`` when both are at hand, else ``(None, None,
    why not)``: no ``koboldcpp.py``, not built (no ``koboldcpp_*.so``), ``KCPP_MODEL``
    naming no file, or no ``*.gguf`` in the tree's ``models/``."""
    kdir = Path(os.environ.get("KCPP_DIR") or DEFAULT_KCPP_DIR)
    if not (kdir / "koboldcpp.py").is_file():
        return None, None, f"no koboldcpp.py in {kdir} (set KCPP_DIR)"
    if not any(kdir.glob("koboldcpp_*.so")):
        return None, None, f"koboldcpp in {kdir} is not built (no koboldcpp_*.so)"
    env_model = os.environ.get("KCPP_MODEL")
    if env_model:
        if not Path(env_model).is_file():
            return None, None, f"KCPP_MODEL={env_model} does not exist"
        return kdir, Path(env_model), ""
    models = sorted((kdir / "models").glob("*.gguf"))
    if not models:
        return None, None, f"no GGUF model in {kdir / 'models'} (set KCPP_MODEL)"
    return kdir, models[0], ""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def koboldcpp_argv(script: str, model: Path, port: int) -> list[str]:
    """How the benchmarks start koboldcpp: ``script`` (its ``koboldcpp.py``) on
    127.0.0.1:``port`` with ``model``, a 2048 context, one thread, no launcher."""
    return [
        sys.executable,
        script,
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--contextsize",
        "2048",
        "--threads",
        "1",
        "--skiplauncher",
        "--quiet",
    ]


def _die_with_parent() -> None:
    """In the child before exec (Linux): get SIGTERM when the bench dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_LIVE: list[KoboldcppProcess] = []


def stop_all() -> None:
    """Stop every koboldcpp this bench started that is still running."""
    for proc in list(_LIVE):
        proc.stop()


atexit.register(stop_all)


class KoboldcppProcess:
    """One koboldcpp on a free 127.0.0.1 port, its output in ``log_path``, until ``stop()``.

    ``script`` runs in ``cwd`` (koboldcpp finds its library beside it) with
    :func:`koboldcpp_argv` plus ``extra_args``; ``env``: variables to set
    (None: unset) over this process's environment. A context manager: ``with``
    waits until it is ready and stops it at the end.
    """

    def __init__(
        self,
        cwd: Path,
        script: str,
        model: Path,
        log_path: Path,
        *,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        environ = dict(os.environ)
        for key, value in (env or {}).items():
            environ.pop(key, None)
            if value is not None:
                environ[key] = value
        args = [*koboldcpp_argv(script, model, self.port), *extra_args]
        self.command = " ".join(args[1:])
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.started_at = time.monotonic()
        self._proc = subprocess.Popen(
            args,
            cwd=str(cwd),
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C goes to the bench, which stops it
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        _LIVE.append(self)

    def wait_ready(self) -> None:
        """Wait until koboldcpp answers ``/api/v1/info/version``; RuntimeError if it dies or not."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"koboldcpp exited with {self._proc.returncode}; see {self.log_path}"
                )
            try:
                if requests.get(self.url + "/api/v1/info/version", timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise RuntimeError(
            f"koboldcpp did not answer within {READY_TIMEOUT_S:.0f} s; see {self.log_path}"
        )

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 15 s; idempotent."""
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        if not self._log.closed:
            self._log.close()
        if self in _LIVE:
            _LIVE.remove(self)

    def __enter__(self) -> KoboldcppProcess:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_sigterm() -> None:
    """SIGTERM to the bench raises KeyboardInterrupt, so every koboldcpp is stopped."""
    signal.signal(signal.SIGTERM, _on_sigterm)
