"""Ctrl-C during the demo: noted as well as raised, and ignored while it stops."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Set by Ctrl-C (while :func:`main` runs in the main thread), read at every wait.
_INTERRUPTED = threading.Event()


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt once Ctrl-C came, even when the one its signal raised
    was lost (raised inside a finalizer, which Python reports and drops)."""
    if _INTERRUPTED.is_set():
        raise KeyboardInterrupt


@contextmanager
def ctrl_c_noted() -> Iterator[None]:
    """Note Ctrl-C in :data:`_INTERRUPTED` as well as raising KeyboardInterrupt (main thread)."""
    _INTERRUPTED.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum: int, frame: object) -> None:
        _INTERRUPTED.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ignore Ctrl-C meanwhile (in the main thread), so a second one cannot cut a stop short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
