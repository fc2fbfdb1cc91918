"""KoboldClient.hang_up against a real local HTTP server that holds its answer.

With koboldcpp batching, an abort by genkey stops nothing; the worker ends
its wait for a generation by closing the request's connection instead. The
server here holds every generation answer until the client goes away, and
says when it saw the client go.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from koboldcpp_horde_chat.errors import BackendError
from koboldcpp_horde_chat.koboldcpp.client import KoboldClient
from tests.http_server import LocalServer, send_json

CHAT = {"choices": [{"message": {"role": "assistant", "content": "Blue."}}]}


class HoldingServer:
    """A ``tests.http_server.LocalServer`` that answers GETs at once (HTTP/1.1
    keep-alive) and holds every POST until its client hangs up (``gone`` then
    records the path) or ``release`` is set."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.gone: list[tuple[str, float]] = []
        self.release = threading.Event()
        self.holding = threading.Event()
        self.local = LocalServer(self._answer)
        self.url = self.local.url

    def _answer(self, handler: BaseHTTPRequestHandler, raw: bytes) -> None:
        if handler.command == "GET":
            send_json(handler, 200, {"result": "1.2.5"})
            return
        body = json.loads(raw or b"{}")
        self.received.append(handler.path)
        if body.get("stream"):
            handler.send_response(200)
            handler.send_header("content-type", "text/event-stream")
            handler.end_headers()
            handler.wfile.write(b'data: {"choices": []}\n\n')
            handler.wfile.flush()
            handler.close_connection = True
        self.holding.set()
        while not self.release.is_set():
            readable, _, _ = select.select([handler.connection], [], [], 0.05)
            if readable and handler.connection.recv(1, socket.MSG_PEEK) == b"":
                self.gone.append((handler.path, time.monotonic()))
                handler.close_connection = True
                return
        if not body.get("stream"):
            reply = CHAT if handler.path.startswith("/v1") else {"results": [{"text": "x"}]}
            send_json(handler, 200, reply)


@pytest.fixture
def server() -> Iterator[HoldingServer]:
    srv = HoldingServer()
    with srv.local:
        yield srv
        srv.release.set()


def hang_up_later(
    client: KoboldClient, server: HoldingServer, results: list[Any]
) -> threading.Thread:
    """Once the server holds the request, hang up from another thread (as the stop does)."""

    def run() -> None:
        assert server.holding.wait(5)
        time.sleep(0.2)
        at = time.monotonic()
        results.append((client.hang_up(), at))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("route", ["chat", "generate"])
def test_hang_up_ends_a_held_generation_at_once_and_closes_its_connection(
    server: HoldingServer, route: str
) -> None:
    client = KoboldClient(server.url, connect_timeout_s=2)
    assert client.ready()  # a pooled keep-alive connection, reused by the generation
    hung: list[Any] = []
    hanger = hang_up_later(client, server, hung)
    started = time.monotonic()
    with pytest.raises(BackendError, match="hung up by the worker") as caught:
        if route == "chat":
            client.chat_completion({"messages": []}, timeout_s=30)
        else:
            client.generate({"prompt": "x"}, timeout_s=30)
    ended = time.monotonic()
    hanger.join(2)
    assert caught.value.status == 0
    assert hung and hung[0][0] is True
    assert ended - hung[0][1] < 0.5  # returned at the hang-up, not at a timeout
    assert ended - started < 3.0
    # koboldcpp sees its client go (what stops a batched streamed generation).
    deadline = time.monotonic() + 2
    while not server.gone and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [path for path, _ in server.gone] == [
        "/v1/chat/completions" if route == "chat" else "/api/v1/generate"
    ]


def test_hang_up_closes_an_open_stream_and_wakes_its_reader(server: HoldingServer) -> None:
    client = KoboldClient(server.url, connect_timeout_s=2)
    stream = client.open_chat_stream({"messages": []}, read_timeout_s=30)
    assert stream.read_chunk().startswith(b"data:")
    hung: list[Any] = []
    hanger = hang_up_later(client, server, hung)
    assert stream.read_chunk() == b""  # blocked until the hang-up
    hanger.join(2)
    assert hung and hung[0][0] is True and stream.closed
    deadline = time.monotonic() + 2
    while not server.gone and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [path for path, _ in server.gone] == ["/v1/chat/completions"]


def test_hang_up_with_nothing_in_flight_does_nothing_and_spoils_no_later_request(
    server: HoldingServer,
) -> None:
    client = KoboldClient(server.url, connect_timeout_s=2)
    assert client.hang_up() is False
    assert client.ready()
    assert client.hang_up() is False
    server.release.set()
    assert client.chat_completion({"messages": []}, timeout_s=5) == CHAT
    assert client.hang_up() is False  # that request has ended
    assert server.gone == []


def test_a_generation_given_up_before_it_is_sent_is_not_sent(server: HoldingServer) -> None:
    client = KoboldClient(server.url, connect_timeout_s=2)
    given_up = threading.Event()
    given_up.set()
    with pytest.raises(BackendError, match="not sent, the job was given up"):
        client.generate({"prompt": "x"}, timeout_s=5, cancel=given_up)
    assert server.received == []


def test_probes_from_another_thread_are_not_hung_up(server: HoldingServer) -> None:
    """An abort or probe sent on the same client from another thread while a generation
    is held is not the request in flight: the hang-up ends the generation only."""
    client = KoboldClient(server.url, connect_timeout_s=2)
    errors: list[BaseException] = []

    def generation() -> None:
        try:
            client.chat_completion({"messages": []}, timeout_s=30)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    thread = threading.Thread(target=generation, daemon=True)
    thread.start()
    assert server.holding.wait(5)
    assert client.ready()  # another thread, another connection
    assert client.hang_up() is True
    thread.join(2)
    assert not thread.is_alive()
    assert len(errors) == 1 and "hung up by the worker" in str(errors[0])
    assert client.ready()
