"""What the worker calls on a koboldcpp client: the seam a fake koboldcpp implements.

:class:`KcppAPI` is koboldcpp's client as the pop loop, the pop gate, the
chat and text runs and the bounded stop use it; :class:`KcppProbes` the part
the standalone local-use manners read; :class:`KcppStream` an open chat
stream as the streamed run reads it; :class:`BackendInfo` what koboldcpp
reports about itself. :class:`~.client.KoboldClient` (and its
``BackendStream``) implement them over HTTP; tests pass an in-process
koboldcpp typed against them, checked by ``mypy --strict``. This module
imports no implementation.

Seed: "Worked example: koboldcpp's embedded worker".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class BackendInfo:
    """What the running koboldcpp reports about itself.

    Attributes:
        model_name: ``/api/v1/model`` ``result``, e.g. ``"koboldcpp/Qwen3-8B-Q4_K_M"``
            (``"inactive"`` when no text model is loaded).
        max_context_length: ``/api/extra/true_max_context_length``, tokens
            (``--contextsize``).
        vision: ``/api/extra/version`` ``vision`` (a multimodal projector is loaded).
        version: ``/api/extra/version`` ``version``, e.g. ``"1.116.1"`` ("" if absent).
        protected: ``/api/extra/version`` ``protected`` (``--password`` is set).
        jinja: ``/api/extra/version`` ``jinja`` (``--jinja``).
        chat_template: ``/props`` ``chat_template``: the model's chat template,
            ``""`` when the model carries none (koboldcpp then renders chat
            with its fallback, Alpaca); None when unknown (a koboldcpp before
            1.79 has no ``/props``: ``koboldcpp.versions``).
    """

    model_name: str
    max_context_length: int
    vision: bool
    version: str
    protected: bool
    jinja: bool
    chat_template: str | None = None


class KcppStream(Protocol):
    """An open ``text/event-stream`` answer of ``POST /v1/chat/completions``."""

    def read_chunk(self) -> bytes:
        """The next bytes of the stream as they arrive; ``b""`` at its end or once
        closed. Raises ``errors.BackendError`` when reading fails."""
        ...

    def close(self) -> None:
        """Close the stream (from any thread); koboldcpp then ends the generation."""
        ...


class KcppProbes(Protocol):
    """koboldcpp's read-only probes (what ``manners.StandaloneManners`` reads)."""

    def info(self, *, timeout_s: float = ...) -> BackendInfo:
        """Model name, context size (tokens) and capabilities. Raises
        ``errors.BackendUnauthorized`` (wrong or missing password), ``errors.BackendError``."""
        ...

    def perf(self, *, timeout_s: float = ...) -> dict[str, Any]:
        """``GET /api/extra/perf`` (``idle``, ``queue``, ``idletime`` seconds,
        ``uptime`` seconds, ...). Raises ``errors.BackendError``."""
        ...


class KcppAPI(KcppProbes, Protocol):
    """koboldcpp's HTTP API as the worker calls it (timeouts in seconds).

    The generation calls (:meth:`chat_completion`, :meth:`open_chat_stream`,
    :meth:`generate`) send nothing when ``cancel`` is set before the request
    goes out, and end at once, raising ``errors.BackendError``, when
    :meth:`hang_up` is called from another thread. They raise
    ``errors.BackendUnauthorized`` (401), ``errors.BackendBusy`` (503) and
    ``errors.BackendError`` (anything else that is not an answer).
    """

    def ready(self, *, timeout_s: float = ...) -> bool:
        """koboldcpp answers its readiness GET (``/api/v1/info/version``); never raises."""
        ...

    def tokencount(self, prompt: str, *, timeout_s: float) -> int:
        """Tokens of ``prompt`` by koboldcpp's tokenizer (``/api/extra/tokencount``)."""
        ...

    def chat_completion(
        self,
        body: dict[str, Any] | bytes | bytearray,
        *,
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/chat/completions`` (not streamed): the decoded JSON answer."""
        ...

    def open_chat_stream(
        self,
        body: dict[str, Any] | bytes | bytearray,
        *,
        read_timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> KcppStream:
        """``POST /v1/chat/completions`` streamed: the open event stream."""
        ...

    def generate(
        self,
        payload: dict[str, Any],
        *,
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> dict[str, Any]:
        """``POST /api/v1/generate`` (Kobold API): the decoded JSON answer."""
        ...

    def abort(self, genkey: str, *, timeout_s: float = ...) -> bool:
        """``POST /api/extra/abort``: True when a generation with ``genkey`` was stopped."""
        ...

    def hang_up(self) -> bool:
        """Close the connection of the generation request in flight (any thread);
        True when there was one. Never raises."""
        ...

    def close(self) -> None:
        """Release the client's connections."""
        ...
