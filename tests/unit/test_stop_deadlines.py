"""The stop's deadlines on waits and calls: a stop never lengthens a wait, its
deadline cuts a retry's pause, and a Horde or koboldcpp call in flight at its
deadline ends then, whatever its read timeout."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from koboldcpp_horde_chat.clock import SYSTEM_CLOCK
from koboldcpp_horde_chat.errors import BackendError, HordeUnavailable
from koboldcpp_horde_chat.horde.client import HordeClient
from koboldcpp_horde_chat.inflight import CallDeadlines
from koboldcpp_horde_chat.koboldcpp.client import KoboldClient
from koboldcpp_horde_chat.state.ports import StopSignal


def signal(stop: threading.Event, deadline: list[float | None]) -> StopSignal:
    """The stop as a job's run sees it, on the real clock."""
    return StopSignal(stop, lambda: deadline[0], SYSTEM_CLOCK)


def timed_pause(s: StopSignal, seconds: float, meanwhile: Callable[[], None]) -> float:
    threading.Timer(0.3, meanwhile).start()
    start = time.monotonic()
    s.pause(seconds)
    return time.monotonic() - start


def test_a_stop_without_a_deadline_does_not_lengthen_a_retrys_pause() -> None:
    """A 1 s pause is 1 s, not 1.3 s, when the stop comes 0.3 s into it."""
    stop = threading.Event()
    took = timed_pause(signal(stop, [None]), 1.0, stop.set)
    assert 0.95 <= took < 1.15


def test_the_stops_deadline_cuts_a_retrys_pause_to_it() -> None:
    """A 2 s pause ends at the stop's deadline, 0.5 s after the stop came."""
    stop = threading.Event()
    deadline: list[float | None] = [None]

    def request_stop() -> None:
        deadline[0] = time.monotonic() + 0.5
        stop.set()

    took = timed_pause(signal(stop, deadline), 2.0, request_stop)
    assert 0.75 <= took < 0.95


# --- a Horde call in flight ---------------------------------------------------------------


@pytest.fixture
def silent_horde() -> Iterator[str]:
    """A server that accepts connections and reads requests but never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stopped = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stopped.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stopped.set()
        thread.join(2)
        for conn in held:
            conn.close()
        server.close()


def test_a_submit_in_flight_at_its_stop_deadline_ends_then_not_at_its_read_timeout(
    silent_horde: str,
) -> None:
    deadlines = CallDeadlines()
    client = HordeClient(silent_horde, "key-0123456789", bridge_agent="t", deadlines=deadlines)
    start = time.monotonic()
    threading.Timer(0.2, lambda: deadlines.set({"submit": time.monotonic() + 0.3})).start()
    with pytest.raises(HordeUnavailable) as caught:
        client.submit({"id": "j1", "state": "faulted"}, timeout_s=30.0)
    took = time.monotonic() - start
    assert 0.45 <= took < 1.0
    assert caught.value.sent is None  # it may have reached the Horde
    assert "stop deadline" in str(caught.value)
    client.close()


def test_a_call_made_past_its_stop_deadline_is_not_sent(silent_horde: str) -> None:
    deadlines = CallDeadlines()
    deadlines.set({"pop": time.monotonic() - 0.1, "submit": time.monotonic() + 0.4})
    client = HordeClient(silent_horde, "key-0123456789", bridge_agent="t", deadlines=deadlines)
    with pytest.raises(HordeUnavailable) as caught:
        client.pop({"name": "w"}, timeout_s=30.0)
    assert caught.value.sent is False
    start = time.monotonic()
    with pytest.raises(HordeUnavailable):  # a submit made now: cut to what is left
        client.submit({"id": "j1", "state": "faulted"}, timeout_s=30.0)
    assert time.monotonic() - start < 0.7
    client.close()


def test_a_koboldcpp_read_in_flight_at_its_stop_deadline_ends_then(silent_horde: str) -> None:
    """A read of koboldcpp's perf (the pop gate's) that koboldcpp does not answer
    ends at the stop's deadline for koboldcpp calls, not after its 10 s timeout."""
    deadlines = CallDeadlines()
    client = KoboldClient(silent_horde)
    client.deadlines = deadlines
    threading.Timer(0.2, lambda: deadlines.set({"kcpp": time.monotonic() + 0.3})).start()
    start = time.monotonic()
    with pytest.raises(BackendError, match="stop deadline"):
        client.perf(timeout_s=10.0)
    assert 0.45 <= time.monotonic() - start < 1.0
    with pytest.raises(BackendError, match="not sent"):
        client.perf(timeout_s=10.0)
    client.close()
