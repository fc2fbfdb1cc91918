"""The API key checked at start (``key_check.check_api_key``, ``GET /api/v2/find_user``):
each answer the real Horde gives (its ``FindUser``: 404 ``UserNotFound`` for a key
it does not know, 401 ``InvalidAPIKey`` for none, the anonymous user's id 0) read
as a refusal or not; a Horde that does not answer does not hold the start up.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import responses

from koboldcpp_horde_chat.hosts import key_check

HORDE = "https://horde.example"
FIND_USER = f"{HORDE}/api/v2/find_user"
KEY = "key-check-0a1b2c3d4e"


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test asks anew (the check is kept once per Horde and key per process)."""
    monkeypatch.setattr(key_check, "_KEY_CHECKS", {}, raising=False)
    yield


@responses.activate
@pytest.mark.parametrize(
    ("status", "body", "named"),
    [
        (404, {"message": f"User with api_key '{KEY}' not found.", "rc": "UserNotFound"},
         "404 UserNotFound"),
        (401, {"message": "No user matching sent API Key.", "rc": "InvalidAPIKey"},
         "401 InvalidAPIKey"),
        (403, {"message": "Wrong credentials.", "rc": "WrongCredentials"}, "403 WrongCredentials"),
    ],
)
def test_a_key_the_horde_does_not_know_is_refused_in_one_line_without_the_key(
    status: int, body: dict[str, Any], named: str
) -> None:
    responses.get(FIND_USER, status=status, json=body)
    line = key_check.check_api_key(HORDE, KEY)
    assert line == (
        f"the Horde at {HORDE} refused the API key ({named}): check your API key "
        "(--hordekey): the Horde knows no user with it"
    )
    assert responses.calls[0].request.headers["apikey"] == KEY


@responses.activate
def test_the_anonymous_key_is_refused_at_start() -> None:
    responses.get(FIND_USER, json={"username": "Anonymous#0", "id": 0})
    line = key_check.check_api_key(HORDE, "0000000000")
    assert line is not None and "anonymous API key cannot run a worker" in line


@responses.activate
def test_a_known_key_names_its_user(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    responses.get(FIND_USER, json={"username": "owner#42", "id": 42, "kudos": 10.0})
    assert key_check.check_api_key(HORDE, KEY) is None
    assert f"the Horde at {HORDE} knows the API key: user owner#42" in caplog.messages


@responses.activate
def test_the_check_is_asked_once_for_all_the_loops() -> None:
    responses.get(FIND_USER, status=404, json={"rc": "UserNotFound"})
    first = key_check.check_api_key(HORDE, KEY)
    assert key_check.check_api_key(HORDE, KEY) == first
    assert len(responses.calls) == 1


@responses.activate
@pytest.mark.parametrize(
    ("status", "body"),
    [
        (404, {"message": "No route GET /api/v2/find_user.", "rc": "NotFound"}),  # no such route
        (405, {}),
        (503, {"message": "busy"}),
        (500, {}),
    ],
)
def test_a_horde_that_answers_the_check_otherwise_does_not_hold_the_start(
    status: int, body: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    responses.get(FIND_USER, status=status, json=body)
    assert key_check.check_api_key(HORDE, KEY) is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "starting anyway; a wrong key shows at the first pop" in warning


def test_a_horde_that_does_not_answer_the_check_does_not_hold_the_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as listener:  # accepts the connection, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        assert key_check.check_api_key(url, KEY, timeout_s=0.5) is None
        assert time.monotonic() - started < 5.0
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"the Horde at {url} did not answer the API key check (")
    assert KEY not in caplog.text
