"""A tiny real HTTP/1.1 server on an ephemeral 127.0.0.1 port, for client tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: Seconds between the server loop's checks for a shutdown: ``stop`` waits about this long.
POLL_S = 0.02


class LocalServer:
    """A threaded HTTP/1.1 server for GETs and POSTs, used as a context manager.

    ``script(handler, body)`` answers each request (``body``: the request body,
    ``b""`` for a GET); a peer that hangs up while it writes is ignored.
    ``seen`` records (path, lower-cased headers) of each request;
    ``connections`` counts TCP connections accepted; ``sent`` is free for a
    script to count the body bytes it wrote.
    """

    def __init__(self, script: Callable[[BaseHTTPRequestHandler, bytes], None]) -> None:
        outer = self
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.connections = 0
        self.sent = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                outer.connections += 1
                super().setup()

            def _answer(self, body: bytes) -> None:
                outer.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                try:
                    script(self, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self) -> None:  # noqa: N802
                self._answer(b"")

            def do_POST(self) -> None:  # noqa: N802
                self._answer(self.rfile.read(int(self.headers.get("Content-Length", "0"))))

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": POLL_S}, daemon=True
        )

    def __enter__(self) -> LocalServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
