"""The real AI Horde server on this machine, from a source checkout, for the tests
marked ``real_horde`` and ``bench_kudos.py --real-horde``.

``RealHorde(src)`` starts, from the Horde's source files in ``src`` (``$AI_HORDE_SRC``):

* a virtual environment of its own under Python >= 3.12 (pyenv's or one on
  ``PATH``; ``$AI_HORDE_PYTHON`` names one), in ``src/.venv-kcpp-horde-chat``,
  made once with the Horde's ``requirements.txt`` (PyPI's ``patreon`` for the
  git URL it names, ``chardet<6`` as its pyproject pins) and reused while that
  file is unchanged; about 2 minutes the first time;
* a PostgreSQL cluster with pg_cron and a redis-server of its own, in a
  temporary directory, each on a free 127.0.0.1 port (Debian's packages
  ``postgresql``, ``postgresql-<major>-cron`` and ``redis-server``, installed
  with apt-get when missing; PostgreSQL refuses root, so as root its cluster
  belongs to the ``postgres`` user);
* the three model references the Horde downloads at start, served on
  127.0.0.1 by this process (``text_models``: the text model entries, e.g.
  ``{"koboldcpp/x": {"parameters": 7000000000}}``; images none);
* ``server.py`` on a free 127.0.0.1 port, ready when
  ``/api/v2/status/heartbeat`` answers (about 13 s; its log in the temporary
  directory).

``stop()`` ends every process it started and removes the directory; a
``with`` block stops it also on an error or Ctrl-C, and so does the end of
this process (atexit; SIGTERM reaches the children if it dies harder).
Users: :meth:`RealHorde.user` (the Horde's ``POST /api/v2/dev/test-user``).
What the Horde recorded: :meth:`RealHorde.sql` (``psql -U postgres``).

By hand: ``python -m bench.harness.real_horde`` starts it, prints its URL, a
trusted user's API key and the psql command, and stops it at Ctrl-C.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests

SRC_ENV = "AI_HORDE_SRC"
PYTHON_ENV = "AI_HORDE_PYTHON"
VENV_DIR = ".venv-kcpp-horde-chat"
READY_MARK = "kcpp-horde-chat-ready"
#: What the Horde's requirements.txt names by a git URL, and PyPI's name for it.
GIT_REQUIREMENTS = {"patreon-python": "patreon"}
EXTRA_REQUIREMENTS = ("chardet<6",)
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0


class RealHordeError(RuntimeError):
    """The real Horde could not be set up or started (the message says why)."""


@dataclass(frozen=True)
class HordeUser:
    """A user of the real Horde: its API key and its ``users.id``."""

    username: str
    api_key: str
    user_id: int


def source_from_env() -> Path | None:
    """``$AI_HORDE_SRC`` when set, else None."""
    value = os.environ.get(SRC_ENV, "").strip()
    return Path(value).expanduser() if value else None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def sql_literal(value: str) -> str:
    """``value`` as an SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


# --------------------------------------------------------------------------------------
# what it needs on the machine


def _python_version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.split()
        return int(out[0]), int(out[1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def find_python() -> str:
    """A Python >= 3.12: ``$AI_HORDE_PYTHON``, pyenv's newest, or python3.13/3.12 on PATH."""
    candidates: list[str] = []
    if os.environ.get(PYTHON_ENV):
        candidates.append(os.environ[PYTHON_ENV])
    pyenv_root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    versions = sorted(
        (pyenv_root / "versions").glob("3.1[2-9]*"),
        key=lambda p: [int(x) if x.isdigit() else 0 for x in p.name.split(".")],
        reverse=True,
    )
    candidates += [str(v / "bin" / "python3") for v in versions]
    candidates += [p for name in ("python3.13", "python3.12") if (p := shutil.which(name) or "")]
    for python in candidates:
        version = _python_version(python)
        if version is not None and version >= (3, 12):
            return python
    raise RealHordeError(
        "the real Horde needs Python >= 3.12: none found (pyenv, python3.13, python3.12 "
        f"on PATH); set {PYTHON_ENV}"
    )


def _postgres_bins() -> Path | None:
    """The newest ``/usr/lib/postgresql/<major>/bin`` with a postgres binary."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    return found[-1].parent if found else None


def _apt_install(packages: Sequence[str], log: Callable[[str], None]) -> None:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RealHordeError(
            f"the real Horde needs the packages {' '.join(packages)}: install them "
            "(as root with apt-get)"
        )
    log(f"installing {' '.join(packages)} with apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    if subprocess.run(command, env=env, capture_output=True).returncode == 0:
        return
    subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RealHordeError(f"apt-get install {' '.join(packages)} failed: {done.stderr[-800:]}")


def ensure_packages(log: Callable[[str], None] = print) -> Path:
    """PostgreSQL with pg_cron and redis-server from Debian's packages, installed
    when missing. Returns PostgreSQL's ``bin`` directory."""
    if _postgres_bins() is None:
        _apt_install(["postgresql"], log)
    bins = _postgres_bins()
    if bins is None:
        raise RealHordeError("no PostgreSQL in /usr/lib/postgresql after installing it")
    major = bins.parent.name
    missing = []
    if not (bins.parent / "lib" / "pg_cron.so").is_file():
        missing.append(f"postgresql-{major}-cron")
    if shutil.which("redis-server") is None:
        missing.append("redis-server")
    if missing:
        _apt_install(missing, log)
    return bins


def _requirements(src: Path) -> str:
    """The Horde's requirements.txt as pip can install it here."""
    lines = []
    for raw in (src / "requirements.txt").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("git+"):
            name = line.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git")
            line = GIT_REQUIREMENTS.get(name, "")
            if not line:
                raise RealHordeError(f"requirements.txt names {raw!r}, which cannot be fetched here")
        lines.append(line)
    return "\n".join([*lines, *EXTRA_REQUIREMENTS]) + "\n"


def ensure_venv(src: Path, log: Callable[[str], None] = print) -> Path:
    """The Horde's own virtual environment (made or brought up to date); its python."""
    venv = src / VENV_DIR
    python = venv / "bin" / "python"
    wanted = _requirements(src)
    mark = venv / READY_MARK
    digest = hashlib.sha256(wanted.encode()).hexdigest()
    if mark.is_file() and mark.read_text().strip() == digest and python.exists():
        return python
    if not python.exists() or (_python_version(str(python)) or (0, 0)) < (3, 12):
        base = find_python()
        log(f"making the Horde's virtual environment in {venv} with {base}")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True)
    requirements = venv / "requirements.txt"
    requirements.write_text(wanted, encoding="utf-8")
    log("installing the Horde's requirements (about 2 minutes the first time)")
    started = time.monotonic()
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "-r", str(requirements)],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise RealHordeError(f"pip install of the Horde's requirements failed: {done.stderr[-1500:]}")
    mark.write_text(digest + "\n")
    log(f"the Horde's requirements installed in {time.monotonic() - started:.0f} s")
    return python


# --------------------------------------------------------------------------------------
# the processes


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when this process dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _Reference(BaseHTTPRequestHandler):
    """Serves the model references: ``/text.json`` the text models, any other path ``{}``."""

    text_models: bytes = b"{}"

    def do_GET(self) -> None:  # noqa: N802 - the handler's name
        body = self.text_models if self.path.startswith("/text") else b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


_LIVE: list[RealHorde] = []


@atexit.register
def _stop_all() -> None:
    for horde in list(_LIVE):
        horde.stop()


class RealHorde:
    """The real AI Horde with its PostgreSQL and redis, until :meth:`stop`.

    ``src``: the Horde's source files. ``text_models``: the text model
    reference's entries. ``log``: where the set-up's steps are said.
    """

    def __init__(
        self,
        src: Path,
        *,
        text_models: Mapping[str, Mapping[str, Any]] | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.src = Path(src)
        self.text_models = {k: dict(v) for k, v in (text_models or {}).items()}
        self.log = log
        self.url = ""
        self.work: Path | None = None
        self.db_port = 0
        self.redis_port = 0
        self.timings: dict[str, float] = {}
        self._procs: list[tuple[str, subprocess.Popen[bytes], int]] = []
        self._reference: ThreadingHTTPServer | None = None
        self._bins: Path | None = None
        self._as_postgres = os.geteuid() == 0

    # ------------------------------------------------------------ start

    def start(self) -> RealHorde:
        """Set up what is missing and start everything; RealHordeError if it cannot."""
        if not (self.src / "server.py").is_file() or not (self.src / "requirements.txt").is_file():
            raise RealHordeError(f"{SRC_ENV}={self.src} holds no AI Horde source (server.py)")
        t0 = time.monotonic()
        self._bins = ensure_packages(self.log)
        python = ensure_venv(self.src, self.log)
        self.timings["set_up_s"] = time.monotonic() - t0
        _LIVE.append(self)
        try:
            t1 = time.monotonic()
            self.work = Path(tempfile.mkdtemp(prefix="kcpp-real-horde-"))
            self._start_postgres()
            self._start_redis()
            self._serve_reference()
            self._start_server(python)
            self.timings["start_s"] = time.monotonic() - t1
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: Sequence[str], *, log: Path, env: Mapping[str, str] | None = None,
               cwd: Path | None = None, as_postgres: bool = False, stop_signal: int = signal.SIGTERM,
               ) -> subprocess.Popen[bytes]:
        kwargs: dict[str, Any] = {}
        if as_postgres:
            kwargs.update(user="postgres", group="postgres", extra_groups=[])
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                list(argv), cwd=str(cwd or self.work), env=dict(env) if env is not None else None,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                **kwargs,
            )
        self._procs.append((name, proc, stop_signal))
        return proc

    def _start_postgres(self) -> None:
        assert self.work is not None and self._bins is not None
        data = self.work / "pg"
        data.mkdir()
        if self._as_postgres:
            entry = pwd.getpwnam("postgres")
            for path in (self.work, data):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        kwargs: dict[str, Any] = (
            {"user": "postgres", "group": "postgres", "extra_groups": []} if self._as_postgres else {}
        )
        done = subprocess.run(
            [str(self._bins / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
             "-E", "UTF8", "--no-sync"],
            cwd=str(self.work), capture_output=True, text=True, **kwargs,
        )
        if done.returncode != 0:
            raise RealHordeError(f"initdb failed: {(done.stdout + done.stderr)[-1500:]}")
        self.db_port = free_port()
        with open(data / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write(
                f"\nport = {self.db_port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{data}'\n"
                "shared_preload_libraries = 'pg_cron'\ncron.database_name = 'postgres'\n"
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
                "max_connections = 200\n"
            )
        log = self.work / "postgres.log"
        if self._as_postgres:
            log.touch()
            os.chown(log, pwd.getpwnam("postgres").pw_uid, -1)
        proc = self._spawn("postgres", [str(self._bins / "postgres"), "-D", str(data)], log=log,
                           as_postgres=self._as_postgres, stop_signal=signal.SIGINT)
        self._wait("PostgreSQL", proc, log, lambda: self._psql("select 1", check=False) == "1")

    def _start_redis(self) -> None:
        assert self.work is not None
        self.redis_port = free_port()
        redis_dir = self.work / "redis"
        redis_dir.mkdir()
        log = self.work / "redis.log"
        proc = self._spawn(
            "redis-server",
            [shutil.which("redis-server") or "redis-server", "--port", str(self.redis_port),
             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(redis_dir)],
            log=log,
        )

        def pong() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.redis_port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(16).startswith(b"+PONG")
            except OSError:
                return False

        self._wait("redis-server", proc, log, pong)

    def _serve_reference(self) -> None:
        handler = type("Reference", (_Reference,), {"text_models": json.dumps(self.text_models).encode()})
        self._reference = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self._reference.serve_forever, name="horde-model-reference",
                         daemon=True).start()

    def _start_server(self, python: Path) -> None:
        assert self.work is not None and self._reference is not None
        port = free_port()
        ref = f"http://127.0.0.1:{self._reference.server_address[1]}"
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PROFILE")}
        env.update(
            USE_SQLITE="0",
            POSTGRES_URL=f"127.0.0.1:{self.db_port}/postgres",
            POSTGRES_USER="postgres",
            POSTGRES_PASS="postgres",
            REDIS_IP="127.0.0.1",
            REDIS_PORT=str(self.redis_port),
            REDIS_SERVERS='["127.0.0.1"]',
            secret_key=secrets.token_hex(16),
            ADMINS="[]",
            HORDE_TEST_APIKEYS="1",
            HORDE_TEST_RATELIMIT_DISABLED="1",
            OTEL_SDK_DISABLED="true",
            LOGFIRE_SEND_TO_LOGFIRE="false",
            LOGFIRE_IGNORE_NO_CONFIG="1",
            HORDE_IMAGE_COMPVIS_REFERENCE=f"{ref}/compvis.json",
            HORDE_IMAGE_DIFFUSERS_REFERENCE=f"{ref}/diffusers.json",
            HORDE_IMAGE_LLM_REFERENCE=f"{ref}/text.json",
        )
        log = self.work / "horde.log"
        proc = self._spawn(
            "server.py",
            [str(python), "server.py", "-i", "--listen", "127.0.0.1", "-p", str(port),
             "--waitress_threads", "8"],
            log=log, env=env, cwd=self.src,
        )
        self.url = f"http://127.0.0.1:{port}"

        def heartbeat() -> bool:
            try:
                return requests.get(self.url + "/api/v2/status/heartbeat", timeout=2).ok
            except requests.RequestException:
                return False

        self._wait("the Horde's server.py", proc, log, heartbeat)

    def _wait(self, what: str, proc: subprocess.Popen[bytes], log: Path,
              ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready():
            if proc.poll() is not None:
                raise RealHordeError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise RealHordeError(f"{what} not ready in {READY_TIMEOUT_S:.0f} s:\n{_tail(log)}")
            time.sleep(0.2)

    # ------------------------------------------------------------ stop

    def stop(self) -> None:
        """Stop everything started, newest first, and remove the temporary directory; idempotent."""
        t0 = time.monotonic()
        while self._procs:
            name, proc, sig = self._procs.pop()
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if self._reference is not None:
            self._reference.shutdown()
            self._reference.server_close()
            self._reference = None
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None
        if self in _LIVE:
            _LIVE.remove(self)
            self.timings["stop_s"] = time.monotonic() - t0

    def __enter__(self) -> RealHorde:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def server_log(self, lines: int = 40) -> str:
        """The last ``lines`` of the server's log."""
        return _tail(self.work / "horde.log", lines) if self.work is not None else ""

    # ------------------------------------------------------------ use

    def user(self, username: str, *, trusted: bool = True, kudos: int = 10000) -> HordeUser:
        """A new user (not a moderator) with a fresh API key, by ``POST /api/v2/dev/test-user``."""
        resp = requests.post(
            self.url + "/api/v2/dev/test-user",
            json={"username": username, "oauth_id": f"kcpp-{secrets.token_hex(12)}",
                  "moderator": False, "trusted": trusted, "kudos": kudos},
            timeout=30,
        )
        if resp.status_code not in (200, 201):
            raise RealHordeError(f"test-user answered {resp.status_code}: {resp.text[:300]}")
        body = resp.json()
        return HordeUser(username, str(body["api_key"]), int(body["user_id"]))

    def _psql(self, query: str, *, check: bool = True) -> str:
        assert self._bins is not None
        done = subprocess.run(
            [str(self._bins / "psql"), "-X", "-q", "-At", "-F", "\t", "-v", "ON_ERROR_STOP=1",
             "-h", "127.0.0.1", "-p", str(self.db_port), "-U", "postgres", "-d", "postgres",
             "-c", query],
            capture_output=True, text=True, timeout=30,
        )
        if done.returncode != 0:
            if check:
                raise RealHordeError(f"psql failed on {query!r}: {done.stderr.strip()}")
            return ""
        return done.stdout.strip()

    def sql(self, query: str) -> list[list[str]]:
        """The rows ``query`` returns, each a list of its columns as psql prints them
        (``t``/``f`` for booleans, ``""`` for NULL)."""
        out = self._psql(query)
        return [line.split("\t") for line in out.splitlines()] if out else []

    def psql_command(self) -> str:
        """The psql command that reaches its database."""
        return f"psql -h 127.0.0.1 -p {self.db_port} -U postgres -d postgres"


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def main(argv: Sequence[str] | None = None) -> int:
    """Start the real Horde from ``$AI_HORDE_SRC`` (or the one argument) until Ctrl-C."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    src = Path(args[0]) if args else source_from_env()
    if src is None:
        print(f"usage: {SRC_ENV}=/path/to/AI-Horde python -m bench.harness.real_horde", file=sys.stderr)
        return 2
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # SIGINT too where a shell ignores it
        signal.signal(signum, lambda *_: stopped.set())
    horde = RealHorde(src)
    try:
        horde.start()
        owner = horde.user("owner", trusted=True)
        print(f"the real AI Horde is up at {horde.url} (set-up {horde.timings['set_up_s']:.0f} s, "
              f"start {horde.timings['start_s']:.0f} s)")
        print(f"  a trusted user's API key: {owner.api_key}")
        print(f"  its database: {horde.psql_command()}")
        print("  Ctrl-C stops it", flush=True)
        stopped.wait()
    except KeyboardInterrupt:
        pass
    except RealHordeError as exc:
        print(f"the real Horde did not start: {exc}", file=sys.stderr)
        return 1
    finally:
        horde.stop()
        if "stop_s" in horde.timings:
            print(f"stopped in {horde.timings['stop_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
