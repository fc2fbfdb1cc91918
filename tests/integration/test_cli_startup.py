"""Starting the standalone worker: flag mistakes are clear errors before any
wait, the wait for koboldcpp is visible and ends cleanly on a signal, and a
wrong koboldcpp password is told apart from a missing one."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp
from koboldcpp_horde_chat.errors import ConfigError
from koboldcpp_horde_chat.hosts.standalone import read_koboldcpp, settings_from_info
from koboldcpp_horde_chat.hosts.standalone_flags import build_parser, check_flags, resolve_url
from koboldcpp_horde_chat.koboldcpp.client import KoboldClient
from koboldcpp_horde_chat.state.journal_paths import JOURNAL_DIR_ENV
from tests.startup_cases import REFUSED_AT_START

from .conftest import API_KEY

ROOT = Path(__file__).resolve().parents[2]
DEAD_URL = "http://127.0.0.1:9"  # the discard port: nothing listens there


def run_cli(*args: str, timeout_s: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "koboldcpp_horde_chat", "--hordekey", API_KEY, "--hordeworkername", "w", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("https://aihorde.net", "https://aihorde.net"),
        ("https://aihorde.net/", "https://aihorde.net"),
        ("https://aihorde.net/api/v2/", "https://aihorde.net"),
        ("https://aihorde.net/api", "https://aihorde.net"),
        ("http://127.0.0.1:7001", "http://127.0.0.1:7001"),
    ],
)
def test_a_horde_url_is_cut_back_to_its_base(value: str, expected: str) -> None:
    assert resolve_url(value, "--horde-url", "AI_HORDE_URL", "") == expected


@pytest.mark.parametrize("value", ["aihorde.net", "htps://aihorde.net", "127.0.0.1:5001", "file:///x", ""])
def test_a_url_without_an_http_scheme_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match="needs an http"):
        resolve_url(value, "--kcpp-url", "KCPP_URL", "")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--horde-url", "aihorde.net"], "--horde-url needs an http"),
        (["--kcpp-url", "127.0.0.1:5001"], "--kcpp-url needs an http"),
        (["--chat-withhold", "teleport"], "unknown name"),
        (["--hordegenlen", "-1"], "must not be negative"),
        (["--kcpp-max-request-mb", "0"], "--kcpp-max-request-mb must be at least 1"),
    ],
)
def test_flag_mistakes_exit_2_at_once_with_one_error_line(flags: list[str], message: str) -> None:
    started = time.monotonic()
    result = run_cli("--kcpp-url", DEAD_URL, *flags)  # a later flag wins
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 10  # no wait for koboldcpp first
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--port", "5001"], "koboldcpp-horde-chat: error: unknown argument --port; did you mean "
         "--kcpp-url? (the worker takes koboldcpp's URL: --kcpp-url http://127.0.0.1:5001)"),
        (["--hordkey", "KEY-typed-here"], "koboldcpp-horde-chat: error: unknown argument "
         "--hordkey; did you mean --hordekey?"),
        (["--hordkey=KEY-typed-here"], "koboldcpp-horde-chat: error: unknown argument "
         "--hordkey; did you mean --hordekey?"),
        (["--password", "pw"], "koboldcpp-horde-chat: error: unknown argument --password; "
         "did you mean --kcpp-password? (the worker takes koboldcpp's --password so)"),
        (["--hordegenlen", "many"], "koboldcpp-horde-chat: error: argument --hordegenlen: "
         "invalid int value: 'many' (koboldcpp-horde-chat --help lists the flags)"),
    ],
)
def test_an_unknown_or_bad_flag_is_one_line_naming_the_nearest_flag(flags: list[str], line: str) -> None:
    """koboldcpp's --port, or a typo: one line on stderr with the flag meant, exit code
    2 as argparse's, and no usage dump (nor the value typed with it)."""
    result = run_cli(*flags)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [line]
    assert "KEY-typed-here" not in result.stderr


def test_a_near_miss_of_a_subcommand_or_a_demo_flag_is_hinted_at_too() -> None:
    for argv, line in (
        (["dmeo"], "koboldcpp-horde-chat: error: unknown argument dmeo; did you mean the "
         "subcommand demo? (named first)"),
        (["demo", "--scripeted"], "koboldcpp-horde-chat demo: error: unknown argument "
         "--scripeted; did you mean --scripted?"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "koboldcpp_horde_chat", *argv],
            cwd=ROOT, capture_output=True, text=True, timeout=20,
        )
        assert result.returncode == 2
        assert result.stderr.splitlines() == [line]


def test_check_flags_normalises_both_urls() -> None:
    args = build_parser().parse_args(
        ["--hordekey", "k", "--hordeworkername", "w", "--horde-url", "http://h:1/api/v2", "--kcpp-url", "http://k:2/"]
    )
    check_flags(args)
    assert (args.horde_url, args.kcpp_url) == ("http://h:1", "http://k:2")


@pytest.mark.parametrize(("flags", "limit"), [([], 32 * 1024 * 1024), (["--kcpp-max-request-mb", "64"], 64 * 1024 * 1024)])
def test_koboldcpps_maxrequestsize_is_given_in_mb_and_32_by_default(flags: list[str], limit: int) -> None:
    with ScriptedKoboldcpp() as kcpp:
        args = build_parser().parse_args(["--hordekey", "k", "--hordeworkername", "w", "--kcpp-url", kcpp.url, *flags])
        settings, _caps = settings_from_info(args, read_koboldcpp(args, KoboldClient(kcpp.url)))
    assert settings.kcpp_max_request_bytes == limit


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_waiting_for_koboldcpp_exits_0_without_a_traceback(signum: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "koboldcpp_horde_chat", "--hordekey", API_KEY, "--hordeworkername", "w",
         "--kcpp-url", DEAD_URL, "--horde-url", DEAD_URL],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Signal once it says it waits (its handlers are set by then), however
        # long a loaded machine takes to start Python.
        assert proc.stderr is not None
        watchdog = threading.Timer(60.0, proc.kill)  # a silent process cannot hang the test
        watchdog.start()
        first = ""
        while "waiting for koboldcpp" not in first and proc.poll() is None:
            # before it: the line that the Horde did not answer the key check
            first += proc.stderr.readline()
        watchdog.cancel()
        assert "waiting for koboldcpp at http://127.0.0.1:9" in first, first
        time.sleep(1.0)
        assert proc.poll() is None, "it should wait for koboldcpp"
        proc.send_signal(signum)
        assert proc.wait(timeout=10) == 0
        stderr = first + proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in stderr


def test_a_wrong_koboldcpp_password_is_told_apart_from_a_missing_one(horde: DevHorde) -> None:
    with ScriptedKoboldcpp(password="secret") as locked:
        wrong = run_cli("--kcpp-url", locked.url, "--horde-url", horde.url, "--kcpp-password", "guess")
        missing = run_cli("--kcpp-url", locked.url, "--horde-url", horde.url)
    assert wrong.returncode == missing.returncode == 2
    assert "refused the password" in wrong.stderr
    assert "is password protected" in missing.stderr
    assert "guess" not in wrong.stderr and "secret" not in wrong.stderr
    assert horde.pops == []


def test_koboldcpp_started_late_is_waited_for(
    horde: DevHorde, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="koboldcpp_horde_chat")
    kcpp = ScriptedKoboldcpp()
    kcpp.start()
    url = kcpp.url
    port = kcpp.port
    kcpp.stop()
    rid = horde.send_chat({"messages": [{"role": "user", "content": "hi"}]})
    worker = start_worker(kcpp_url=url)
    try:
        # koboldcpp started after the worker found it absent (it looks again every 3 s)
        waiting = f"waiting for koboldcpp at {url}"
        deadline = time.monotonic() + 10
        while not any(waiting in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the worker did not say it waits for koboldcpp"
            time.sleep(0.02)
        time.sleep(0.2)
        assert horde.pops == []
        late = ScriptedKoboldcpp(port=port)
        late.start()
        try:
            assert horde.wait([rid], timeout_s=20)
        finally:
            late.stop()
    finally:
        worker.stop()
    assert horde.ledger[0]["action"] == "submitted"


# ----------------------------------------------------- environment variables, names, waiting


def parsed(*flags: str, name: str = "w") -> Any:
    return build_parser().parse_args(["--hordekey", "k", "--hordeworkername", name, *flags])


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_url_variable_falls_back_to_the_default(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AI_HORDE_URL", value)
    monkeypatch.setenv("KCPP_URL", value)
    args = parsed()
    check_flags(args)
    assert (args.horde_url, args.kcpp_url) == ("https://aihorde.net", "http://127.0.0.1:5001")


def test_url_variables_are_used_and_a_flag_wins_over_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AI_HORDE_URL", "http://127.0.0.1:7001/api/v2")
    monkeypatch.setenv("KCPP_URL", "http://127.0.0.1:5002/")
    args = parsed()
    check_flags(args)
    assert (args.horde_url, args.kcpp_url) == ("http://127.0.0.1:7001", "http://127.0.0.1:5002")
    args = parsed("--horde-url", "http://h:1", "--kcpp-url", "http://k:2")
    check_flags(args)
    assert (args.horde_url, args.kcpp_url) == ("http://h:1", "http://k:2")


@pytest.mark.parametrize("variable", ["AI_HORDE_URL", "KCPP_URL"])
def test_a_bad_url_variable_is_reported_under_its_own_name(variable: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("AI_HORDE_URL", "KCPP_URL")}
    env[variable] = "localhost:7001"
    result = subprocess.run(
        [sys.executable, "-m", "koboldcpp_horde_chat", "--hordekey", API_KEY, "--hordeworkername", "w"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"{variable} needs an http:// or https:// URL, not 'localhost:7001'" in result.stderr
    assert "--horde-url" not in result.stderr and "--kcpp-url" not in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "--hordeworkername: a worker name is required (not empty or only spaces)"),
        ("   \t", "--hordeworkername: a worker name is required (not empty or only spaces)"),
        ("x" * 101, "--hordeworkername: the name is 101 characters long; the Horde takes at most 100"),
    ],
)
def test_a_worker_name_the_horde_would_refuse_is_a_config_error(name: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_flags(parsed(name=name))
    assert str(raised.value) == message


def test_a_worker_name_is_stripped_as_the_horde_strips_it_and_100_characters_are_taken() -> None:
    args = parsed(name="  My Worker \n")
    check_flags(args)
    assert args.hordeworkername == "My Worker"
    args = parsed(name=" " + "x" * 100 + " ")
    check_flags(args)
    assert args.hordeworkername == "x" * 100


def test_a_blank_worker_name_exits_2_at_once() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "koboldcpp_horde_chat", "--hordekey", API_KEY, "--hordeworkername", "  ",
         "--kcpp-url", DEAD_URL],
        cwd=ROOT, capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert result.returncode == 2
    assert "a worker name is required" in result.stderr


def test_kcpp_wait_bounds_the_wait_for_koboldcpp_then_exits_2() -> None:
    started = time.monotonic()
    result = run_cli("--kcpp-url", DEAD_URL, "--horde-url", DEAD_URL, "--kcpp-wait", "1")
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert elapsed < 15
    assert "koboldcpp at http://127.0.0.1:9 does not answer (waited 1 s)" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_kcpp_wait_or_stop_grace_that_is_not_seconds_is_a_flag_mistake(value: str) -> None:
    with pytest.raises(ConfigError, match="--kcpp-wait must be a number of seconds, 0 or more"):
        check_flags(parsed("--kcpp-wait", value))
    with pytest.raises(ConfigError, match="--stop-grace must be a number of seconds, 0 or more"):
        check_flags(parsed("--stop-grace", value))


def test_an_unknown_log_level_in_the_environment_exits_2_naming_the_variable() -> None:
    env = dict(os.environ, KCPP_HORDE_LOG_LEVEL="bogus")
    result = subprocess.run(
        [sys.executable, "-m", "koboldcpp_horde_chat", "--hordekey", API_KEY,
         "--hordeworkername", "w", "--kcpp-url", DEAD_URL],
        cwd=ROOT, capture_output=True, text=True, timeout=20, env=env,
    )
    assert result.returncode == 2, result.stderr
    assert (
        "KCPP_HORDE_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, not 'BOGUS'"
        in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_every_flag_of_the_worker_has_help_text() -> None:
    for action in build_parser()._actions:
        if action.option_strings and action.dest not in ("help", "version"):
            assert action.help and len(action.help) > 10, action.option_strings


def test_help_names_the_three_subcommands_and_what_hordegenlen_0_means() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "koboldcpp_horde_chat", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "  koboldcpp-horde-chat demo      watch the whole path against a local dev Horde" in lines
    assert "  koboldcpp-horde-chat devhorde  start a local dev Horde to point a worker at" in lines
    assert "  koboldcpp-horde-chat devkcpp   start a scripted koboldcpp (no model) on 5001" in lines
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert "--hordekey HORDEKEY" in result.stdout  # the worker's own flags are still listed
    genlen = " ".join(build_parser().format_help().split()).split("--hordegenlen HORDEGENLEN ", 1)[1]
    assert genlen.startswith("the most tokens your worker will generate for one job (0 or unset: 1024)")


# ------------------------------------------- the same start-up checks as inside koboldcpp


def run_cli_env(*args: str, env: dict[str, str], timeout_s: float = 20) -> subprocess.CompletedProcess[str]:
    """The standalone command with ``env`` added to (or, for a None value, removed from) ours."""
    full = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-m", "koboldcpp_horde_chat", "--hordekey", API_KEY, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=full,
    )  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSED_AT_START))
def test_what_koboldcpps_hook_refuses_the_standalone_worker_refuses_in_the_same_line(case: str) -> None:
    refused = REFUSED_AT_START[case]
    result = run_cli_env(
        "--hordeworkername", refused.name, "--hordegenlen", str(refused.genlen), "--kcpp-url", DEAD_URL,
        env={"AI_HORDE_URL": "", **refused.env},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("ERROR koboldcpp_horde_chat: " + refused.line), lines


@pytest.mark.parametrize(
    ("how", "reason"),
    [("--journal-dir", "No such file or directory"), (JOURNAL_DIR_ENV, "No such file or directory"),
     ("a file in the way", "a file is in the way of its directory")],
)  # fmt: skip
def test_a_journal_directory_named_explicitly_that_cannot_be_used_exits_2_at_once(
    how: str, reason: str, tmp_path: Path
) -> None:
    """The operator asked for crash recovery there: running without it would be a surprise."""
    if how == "a file in the way":
        (tmp_path / "file").write_text("x")
        directory, flags, env = str(tmp_path / "file" / "journal"), ["--journal-dir", str(tmp_path / "file" / "journal")], {}
    elif how == "--journal-dir":
        directory, flags, env = "/proc/nope", ["--journal-dir", "/proc/nope"], {}
    else:
        directory, flags, env = "/proc/nope", [], {JOURNAL_DIR_ENV: "/proc/nope"}
    source = JOURNAL_DIR_ENV if how == JOURNAL_DIR_ENV else "--journal-dir"
    started = time.monotonic()
    result = run_cli_env("--hordeworkername", "w", "--kcpp-url", DEAD_URL, *flags, env=env)
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 10  # before any wait for koboldcpp
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].endswith(
        f"ERROR koboldcpp_horde_chat: {source} {directory}: the job journal cannot be kept there ({reason})"
    )


def test_an_unusable_default_journal_directory_turns_crash_recovery_off_in_one_line_and_serves_on(
    horde: DevHorde, kcpp: ScriptedKoboldcpp
) -> None:
    """Also: the start line names the Horde and koboldcpp, and nothing says status=0."""
    env = {**os.environ, "XDG_STATE_HOME": "/proc/nope", "AI_HORDE_URL": "", "KCPP_URL": ""}
    env.pop(JOURNAL_DIR_ENV)
    proc = subprocess.Popen(
        [sys.executable, "-m", "koboldcpp_horde_chat", "--hordekey", API_KEY, "--hordeworkername", "w",
         "--horde-url", horde.url, "--kcpp-url", kcpp.url],
        cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not horde.pops and time.monotonic() < deadline:
            time.sleep(0.1)
        assert horde.pops, "the worker did not pop"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    off = [line for line in stderr.splitlines() if "crash recovery is off" in line]
    assert len(off) == 1, stderr
    assert off[0].endswith(
        "WARNING koboldcpp_horde_chat.hosting: job journal directory "
        "/proc/nope/koboldcpp-horde-chat cannot be used (No such file or directory): crash "
        "recovery is off, so a job in hand when the worker dies is left to expire on the Horde; "
        "point --journal-dir at a writable directory to turn it on"
    )
    serving = [line for line in stderr.splitlines() if ": serving " in line]
    assert len(serving) == 1, stderr
    assert serving[0].endswith(
        f"INFO koboldcpp_horde_chat: serving text jobs for {kcpp.model_name} "
        f"from {horde.url} via {kcpp.url}, and chat jobs once that Horde sends them (chat "
        "is declared on every pop; a Horde without the chat routes sends text jobs only)"
    ), serving
    assert "status=0" not in stderr and "Traceback" not in stderr


def test_a_kcpp_url_that_answers_but_not_as_koboldcpp_is_named_so() -> None:
    """Another web server at --kcpp-url (a wrong port) answers 404: the line says it
    answers, not as koboldcpp, rather than that nothing answers."""
    from http.server import BaseHTTPRequestHandler

    from tests.http_server import LocalServer

    def not_found(handler: BaseHTTPRequestHandler, body: bytes) -> None:
        handler.send_response(404)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    with LocalServer(not_found) as other:
        result = run_cli("--kcpp-url", other.url, "--horde-url", DEAD_URL, "--kcpp-wait", "0")
    assert result.returncode == 2, result.stderr
    assert (
        f"{other.url} answers, but not as koboldcpp (/api/v1/model: HTTP 404): "
        "is --kcpp-url koboldcpp's address?"
    ) in result.stderr, result.stderr
    assert "does not answer" not in result.stderr
