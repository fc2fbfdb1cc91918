"""The worker as ``koboldcpp-horde-chat`` builds it, with clients that time their calls.

``TimedHorde`` and ``TimedKobold`` subclass the real clients and note when each
call was entered and returned (an :data:`Event`); "worker code" figures are the
gaps between those calls.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from harness.product import (
    LOG_DATEFMT,
    LOG_FORMAT,
    BackendCapabilities,
    BackendStream,
    HordeClient,
    Journal,
    KoboldClient,
    NoManners,
    StandaloneManners,
    Worker,
    WorkerSettings,
    WorkerState,
    default_state_dir,
    journal_path,
)
from harness.servers import API_KEY, MODEL
from harness.timing import Event

WORKER_NAME = "bench-worker"

class TimedHorde(HordeClient):
    """A ``HordeClient`` that records when each call was entered and returned."""

    def __init__(self, *args: Any, events: list[Event] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the loop's client and the one its next pop goes out on share one record
        self.events: list[Event] = events if events is not None else []

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        t0 = time.monotonic()
        answer: dict[str, Any] = {}
        try:
            answer = super().pop(body, timeout_s=timeout_s)
            return answer
        finally:
            jid = answer.get("id")
            self.events.append(("pop", t0, time.monotonic(), jid if isinstance(jid, str) else None))

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            return super().submit(body, timeout_s=timeout_s)
        finally:
            self.events.append(("submit", t0, time.monotonic(), str(body.get("id"))))

    def progress(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            return super().progress(body, timeout_s=timeout_s)
        finally:
            self.events.append(("progress", t0, time.monotonic(), str(body.get("id"))))


class TimedStream(BackendStream):
    """A ``BackendStream`` proxy that records when the stream ended (``read_chunk``
    returned ``b""`` or raised). It delegates everything to the wrapped stream."""

    def __init__(self, inner: BackendStream, events: list[Event]) -> None:  # noqa: D107
        # the base class's __init__ is not called: the inner stream holds the state
        self._inner = inner
        self._events = events
        self._t0 = time.monotonic()

    @property
    def status(self) -> int:
        return self._inner.status

    @property
    def headers(self) -> dict[str, str]:
        return self._inner.headers

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def read_chunk(self) -> bytes:
        try:
            chunk = self._inner.read_chunk()
        except BaseException:
            self._events.append(("stream_end", self._t0, time.monotonic(), None))
            raise
        if not chunk:
            self._events.append(("stream_end", self._t0, time.monotonic(), None))
        return chunk

    def close(self) -> None:
        self._inner.close()


class TimedKobold(KoboldClient):
    """A ``KoboldClient`` that records each call; ``sent_bodies`` keeps the last chat body."""

    def __init__(self, *args: Any, events: list[Event] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the loop's client and the one its next pop goes out on share one record
        self.events: list[Event] = events if events is not None else []
        self._last_chat_body: dict[str, Any] | bytes | bytearray | None = None

    @property
    def last_chat_body(self) -> dict[str, Any] | None:
        """The last chat body sent, decoded (the worker sends it encoded)."""
        body = self._last_chat_body
        if body is None or isinstance(body, dict):
            return body
        decoded: dict[str, Any] = json.loads(body)
        return decoded

    def _timed(self, name: str, call: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        try:
            return call()
        finally:
            self.events.append((name, t0, time.monotonic(), None))

    def perf(self, *, timeout_s: float = 5.0) -> dict[str, Any]:
        result: dict[str, Any] = self._timed("perf", lambda: super(TimedKobold, self).perf(timeout_s=timeout_s))
        return result

    def tokencount(self, prompt: str, *, timeout_s: float) -> int:
        result: int = self._timed(
            "tokencount", lambda: super(TimedKobold, self).tokencount(prompt, timeout_s=timeout_s)
        )
        return result

    def chat_completion(
        self,
        body: dict[str, Any] | bytes | bytearray,
        *,
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> dict[str, Any]:
        self._last_chat_body = body
        result: dict[str, Any] = self._timed(
            "chat",
            lambda: super(TimedKobold, self).chat_completion(
                body, timeout_s=timeout_s, cancel=cancel
            ),
        )
        return result

    def open_chat_stream(
        self, body: dict[str, Any] | bytes | bytearray, *, read_timeout_s: float
    ) -> BackendStream:
        self._last_chat_body = body
        result: BackendStream = self._timed(
            "chat_stream",
            lambda: super(TimedKobold, self).open_chat_stream(body, read_timeout_s=read_timeout_s),
        )
        return TimedStream(result, self.events)

    def generate(
        self, payload: dict[str, Any], *, timeout_s: float, cancel: threading.Event | None = None
    ) -> dict[str, Any]:
        result: dict[str, Any] = self._timed(
            "generate",
            lambda: super(TimedKobold, self).generate(payload, timeout_s=timeout_s, cancel=cancel),
        )
        return result


def configure_worker_logging() -> None:
    """INFO logging as the CLI formats it, written to os.devnull (its cost is counted)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the process
    handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATEFMT))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("urllib3").setLevel(logging.WARNING)


def build_worker(
    horde_url: str,
    kcpp_url: str,
    *,
    manners: str = "standalone",
    vision: bool = False,
    ctx: int = 4096,
    max_length: int = 512,
    max_request_mib: int = 32,
    journal_dir: Path | None = None,
) -> tuple[Worker, TimedHorde, TimedKobold]:
    """A ``Worker`` wired as ``koboldcpp-horde-chat`` wires it, with timed clients,
    against the Horde at ``horde_url`` and koboldcpp at ``kcpp_url``.

    ``manners``: "standalone" (reads koboldcpp's /api/extra/perf before a pop,
    at most once a second while it is idle, as the CLI does) or "none" (as inside koboldcpp, where the hook reads
    globals for free). ``max_request_mib``: koboldcpp's ``--maxrequestsize``
    (``--kcpp-max-request-mb``). ``journal_dir``: keep the job journal there,
    as the CLI does in its state directory (None: no journal).
    """
    settings = WorkerSettings(
        api_key=API_KEY,
        worker_name=WORKER_NAME,
        model_id=MODEL,
        backend_max_context_length=ctx,
        max_length=max_length,
        horde_url=horde_url,
        kcpp_url=kcpp_url,
        vision=vision,
        kcpp_max_request_bytes=max_request_mib * 1024 * 1024,
    )
    horde = TimedHorde(settings.horde_url, settings.api_key, bridge_agent=settings.bridge_agent)
    backend = TimedKobold(settings.kcpp_url)
    journal = None if journal_dir is None else Journal(journal_path(settings.worker_name, journal_dir))
    state = WorkerState(settings, journal=journal)
    worker = Worker(
        settings,
        horde=horde,
        backend=backend,
        state=state,
        manners=StandaloneManners(backend) if manners == "standalone" else NoManners(),
        caps=BackendCapabilities(vision=vision),
        # The second Horde session the next pop goes out on, beside each submit.
        pop_horde=TimedHorde(
            settings.horde_url,
            settings.api_key,
            bridge_agent=settings.bridge_agent,
            events=horde.events,
        ),
    )
    return worker, horde, backend


def state_disk_dir() -> Path:
    """The parent of the default state directory (created when missing): where a
    temporary journal sits on the disk the CLI's journal is on."""
    parent = default_state_dir().parent
    parent.mkdir(parents=True, exist_ok=True)
    return parent


def run_jobs(
    worker: Worker, n: int, *, deadline_s: float | None = None, stall_s: float = 5.0
) -> tuple[int, float, float]:
    """Call ``run_once`` until ``n`` jobs were served, ``deadline_s`` passed, or no job
    was served for ``stall_s`` seconds (a worker waiting between pops: shows as
    ``served < n``).

    Returns (served, wall seconds, CPU seconds of this process). The default
    deadline is generous: 20 jobs/s plus 10 s.
    """
    served = 0
    limit = deadline_s if deadline_s is not None else 10.0 + n / 20.0
    w0, c0 = time.monotonic(), time.process_time()
    end = w0 + limit
    last = w0
    while served < n:
        now = time.monotonic()
        if now >= end or now - last > stall_s:
            break
        if worker.run_once():
            served += 1
            last = time.monotonic()
    return served, time.monotonic() - w0, time.process_time() - c0


@contextlib.contextmanager
def profiled(on: bool, top: int) -> Iterator[None]:
    """With ``on`` (``--profile``): ``cProfile`` the block, then print its ``top``
    functions by own time."""
    if not on:
        yield
        return
    import cProfile  # not loaded unless asked: the memory figures count imports
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(top)
    print(buf.getvalue())
