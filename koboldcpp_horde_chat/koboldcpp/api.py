"""koboldcpp's client as the worker uses it: the seam a fake koboldcpp implements
(``client.KoboldClient`` over HTTP). Imports no implementation."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

#: A JSON request body, or one already encoded.
Body: TypeAlias = dict[str, Any] | bytes | bytearray


@dataclass(frozen=True)
class BackendInfo:
    """What the running koboldcpp reports: ``max_context_length`` in tokens;
    ``version`` ``""`` when absent; ``chat_template`` ``""`` when the model carries
    none (koboldcpp then uses Alpaca), None when unknown (before 1.79)."""

    model_name: str
    max_context_length: int
    vision: bool
    version: str
    chat_template: str | None = None


class KcppStream(Protocol):
    """An open chat event stream: ``read_chunk`` gives ``b""`` at the end or once
    closed, raises ``errors.BackendError``; ``close`` may come from any thread."""

    def read_chunk(self) -> bytes: ...

    def close(self) -> None: ...


class KcppProbes(Protocol):
    """koboldcpp's read-only probes."""

    def info(self, *, timeout_s: float = ...) -> BackendInfo: ...

    def perf(self, *, timeout_s: float = ...) -> dict[str, Any]: ...


class KcppAPI(KcppProbes, Protocol):
    """koboldcpp's HTTP API (timeouts in seconds). A generation call sends nothing
    once ``cancel`` is set and ends at once at :meth:`hang_up` (any thread). Calls
    raise ``errors.BackendUnauthorized`` (401), ``BackendBusy`` (503), ``BackendError``."""

    def ready(self, *, timeout_s: float = ...) -> bool: ...

    def tokencount(self, prompt: str, *, timeout_s: float) -> int: ...

    def chat_completion(
        self, body: Body, *, timeout_s: float, cancel: threading.Event | None = None
    ) -> dict[str, Any]: ...

    def open_chat_stream(
        self, body: Body, *, read_timeout_s: float, cancel: threading.Event | None = None
    ) -> KcppStream: ...

    def generate(
        self, payload: dict[str, Any], *, timeout_s: float, cancel: threading.Event | None = None
    ) -> dict[str, Any]: ...

    def abort(self, genkey: str, *, timeout_s: float = ...) -> bool: ...

    def hang_up(self) -> bool: ...

    def close(self) -> None: ...
