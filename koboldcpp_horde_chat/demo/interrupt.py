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


def _note_and_raise(signum: int, frame: object) -> None:
    _INTERRUPTED.set()
    raise KeyboardInterrupt


@contextmanager
def sigint_handled(*, ignore: bool) -> Iterator[None]:
    """Meanwhile, in the main thread: Ctrl-C ignored (so a second one cannot cut a stop
    short), or noted in :data:`_INTERRUPTED` as well as raising KeyboardInterrupt."""
    if not ignore:
        _INTERRUPTED.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN if ignore else _note_and_raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
