"""What the devkit's two commands (``devhorde``, ``devkcpp``) share.

Their flags ``--host``, ``--port`` and ``--log-level`` (:func:`listen_parser`,
:func:`add_log_level`), and their run (:func:`serve_until_stopped`): start the
server, or print ``Cannot listen on <host>:<port>: <reason>`` and return 2;
then log to the console, print what the server is, serve until Ctrl-C or
SIGTERM, stop it, print ``<name> stopped.`` and return 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Protocol

#: The log levels ``--log-level`` takes.
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


class Served(Protocol):
    """A devkit server (``DevHorde``, ``ScriptedKoboldcpp``)."""

    def start(self) -> object:
        """Bind its port(s) and serve on threads of its own; raises OSError."""
        ...

    def stop(self) -> None:
        """Stop serving and release its port(s)."""
        ...


def listen_parser(
    prog: str, description: str, *, default_port: int, port_note: str = ""
) -> argparse.ArgumentParser:
    """A command's parser with its ``--host`` (127.0.0.1 by default) and ``--port``
    (``default_port``; ``port_note`` follows the default in the help, as in
    ``"(default 5001, koboldcpp's; 0 takes a free one)"``)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)"
    )
    p.add_argument(
        "--port",
        type=int,
        default=default_port,
        help=f"the port to listen on (default {default_port}{port_note}; 0 takes a free one)",
    )
    return p


def add_log_level(p: argparse.ArgumentParser, help_text: str) -> None:
    """Add ``--log-level`` (one of :data:`LOG_LEVELS`, any case; INFO by default)."""
    p.add_argument(
        "--log-level", default="INFO", choices=LOG_LEVELS, type=str.upper, help=help_text
    )


def console_logging(level: str) -> None:
    """Log to the console at ``level`` (a logging level name such as ``"INFO"``),
    one line per event, in the worker's own timestamped format."""
    logging.basicConfig(
        level=level,
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )


def stop_on_signal() -> threading.Event:
    """An event that Ctrl-C (SIGINT) or SIGTERM sets, from now on. The handlers are
    set only on the main thread (elsewhere the event is set by no signal)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
    return stop


def until_set(stop: threading.Event) -> None:
    """Block until ``stop`` is set, waking twice a second (so a signal is taken soon)."""
    while not stop.wait(0.5):
        pass


def serve_until_stopped(
    server: Served, args: argparse.Namespace, *, banner: Callable[[], str], name: str
) -> int:
    """Start ``server`` and serve until Ctrl-C or SIGTERM; the exit code.

    Exit code 2 (after ``Cannot listen on <host>:<port>: <reason>``) when it
    cannot bind ``args.host``/``args.port``. Logging (at ``args.log_level``)
    starts only once it listens, so ``banner()`` (what it is and how to use it,
    its first line the URL) is printed before any log line; ``<name>
    stopped.`` is printed last, with exit code 0.
    """
    try:
        server.start()
    except OSError as exc:
        print(f"Cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", flush=True)
        return 2
    console_logging(args.log_level)
    stop = stop_on_signal()
    print(banner(), flush=True)
    try:
        until_set(stop)
    finally:
        server.stop()
    print(f"{name} stopped.", flush=True)
    return 0
