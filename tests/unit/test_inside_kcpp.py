"""The koboldcpp hook: settings read from koboldcpp's globals, live manners, the patches.

A stand-in koboldcpp module object carries the globals and ``args`` that the
real koboldcpp 1.116.1 has at the moment it starts its Horde worker threads
(koboldcpp.py L88-186, L11452-11472: names, types and the values derived from its flags).
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import re
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import koboldcpp_horde_chat
from koboldcpp_horde_chat.horde.declaration import pop_body
from koboldcpp_horde_chat.hosts import inside_kcpp as kcpp_hook
from koboldcpp_horde_chat.hosts import standalone, standalone_flags
from koboldcpp_horde_chat.service import loop as worker_mod
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.shared import WorkerState
from tests.startup_cases import REFUSED_AT_START

ROOT = Path(__file__).resolve().parents[2]
PATCH_DIR = ROOT / "patches"
RELEASES = ("1.116.1", "1.117.1")
#: The patches earlier versions shipped (tests/data/earlier-patches/README.md):
#: a koboldcpp patched with any of them serves through today's package.
EARLIER_PATCH_DIRS = {
    "0.1.0": ROOT / "tests" / "data" / "earlier-patches" / "0.1.0",
}
#: Every patch a koboldcpp may carry: (which, release) -> its file.
EVERY_PATCH = {
    ("current", release): PATCH_DIR / f"koboldcpp-{release}.patch" for release in RELEASES
} | {
    (which, release): folder / f"koboldcpp-{release}.patch"
    for which, folder in EARLIER_PATCH_DIRS.items()
    for release in RELEASES
}
SEED_FEATURES = [
    "seed",
    "presence_penalty",
    "tools",
    "json_object",
    "json_schema",
    "reasoning_effort",
    "prompt_overflow_refused",
]
API_KEY = "horde-key-0123456789"
PASSWORD = "kcpp-secret-pw"


def make_kcpp(**globals_: Any) -> types.ModuleType:
    """A stand-in ``koboldcpp`` module as koboldcpp's main leaves it before the worker starts.

    Defaults: a model file ``/m/Qwen3-8B-Q4_K_M.gguf`` (so ``friendlymodelname``
    is ``koboldcpp/Qwen3-8B-Q4_K_M``), ``--contextsize 12288``, no horde limits,
    horde flags set (so koboldcpp forced ``debugmode`` to -1), no local request
    for an hour. Keyword arguments override module globals; ``args_`` overrides
    entries of ``args``.
    """
    arg_values: dict[str, Any] = {
        "model_param": "/m/Qwen3-8B-Q4_K_M.gguf",
        "host": "",
        "port": 5001,
        "port_param": 5001,
        "proxy_port": None,
        "ssl": None,
        "nocertify": False,
        "mmproj": "",
        "hordemodelname": "",
        "hordeworkername": "my-worker",
        "hordekey": API_KEY,
        "hordemaxctx": 0,
        "hordegenlen": 0,
        "debugmode": -1,
        "gendefaults": "",
        "parallelrequests": 1,
        "contextsize": 12288,
        "password": None,
        "maxrequestsize": 32,
    }
    arg_values.update(globals_.pop("args_", {}))
    kcpp = types.ModuleType("koboldcpp")
    defaults: dict[str, Any] = {
        "KcppVersion": "1.116.1",
        "friendlymodelname": "koboldcpp/Qwen3-8B-Q4_K_M",
        "password": "",
        "maxctx": 12288,
        "maxhordectx": 0,
        "maxhordelen": 1024,
        "modelbusy": threading.Lock(),
        "requestsinqueue": 0,
        "exitcounter": -1,
        "punishcounter": 0,
        "rewardcounter": 0,
        "session_kudos_earned": 0,
        "session_jobs": 0,
        "has_vision_support": False,
        "has_audio_support": False,
        "sslvalid": False,
        "nocertify": False,
        "last_req_time": time.time() - 3600,
        "last_non_horde_req_time": time.time() - 3600,
        "args": argparse.Namespace(**arg_values),
    }
    defaults.update(globals_)
    for name, value in defaults.items():
        setattr(kcpp, name, value)
    return kcpp


def hook_settings(kcpp: types.ModuleType, threads: int = 1, **env: str) -> WorkerSettings:
    return kcpp_hook.settings_from_kcpp(
        kcpp, kcpp.args, kcpp.args.hordekey, kcpp.args.hordeworkername, threads, environ=env
    )


# --------------------------------------------------------------------- settings


def test_settings_take_koboldcpp_globals_and_flags() -> None:
    kcpp = make_kcpp(maxctx=8192, maxhordectx=4096, maxhordelen=512, password=PASSWORD)
    s = hook_settings(kcpp)
    assert s.api_key == API_KEY
    assert s.worker_name == "my-worker"
    assert s.model_id == "koboldcpp/Qwen3-8B-Q4_K_M"
    assert s.backend_max_context_length == 8192
    assert s.max_context_length == 4096
    assert s.max_length == 512
    assert s.kcpp_password == PASSWORD
    assert s.kcpp_url == "http://localhost:5001"
    assert s.horde_url == "https://aihorde.net"
    assert s.vision is False
    assert s.threads == 1
    assert s.prompt_jobs is True
    assert PASSWORD not in repr(s) and API_KEY not in repr(s)


@pytest.mark.parametrize(
    ("maxctx", "maxhordectx", "advertised"),
    [(12288, 0, 12288), (8192, 4096, 4096), (4096, 16384, 4096), (4096, -5, 4096)],
)
def test_context_is_the_smaller_of_maxctx_and_hordemaxctx(
    maxctx: int, maxhordectx: int, advertised: int
) -> None:
    """koboldcpp pops with min(maxctx, maxctx if maxhordectx == 0 else maxhordectx)."""
    s = hook_settings(make_kcpp(maxctx=maxctx, maxhordectx=maxhordectx))
    body = pop_body(s, kcpp_hook.capabilities(s))
    assert body["max_context_length"] == advertised
    assert body["chat_limits"]["max_context_length"] == advertised


@pytest.mark.parametrize(
    ("maxrequestsize", "limit"),
    [(32, 32 * 1024 * 1024), (64, 64 * 1024 * 1024), (0, 32 * 1024 * 1024), (None, 32 * 1024 * 1024)],
)
def test_the_request_size_limit_is_koboldcpps_maxrequestsize_in_mb(
    maxrequestsize: int | None, limit: int
) -> None:
    """koboldcpp refuses a body over int(args.maxrequestsize) MB, reading 0 or None as 32."""
    s = hook_settings(make_kcpp(args_={"maxrequestsize": maxrequestsize}))
    assert s.kcpp_max_request_bytes == limit


def test_a_koboldcpp_without_maxrequestsize_gets_its_default_limit() -> None:
    kcpp = make_kcpp()
    del kcpp.args.maxrequestsize
    assert hook_settings(kcpp).kcpp_max_request_bytes == 32 * 1024 * 1024


@pytest.mark.parametrize(
    ("args", "friendlymodelname"),
    [
        ({}, "koboldcpp/Qwen3-8B-Q4_K_M"),
        ({"hordemodelname": "Foo"}, "koboldcpp/Foo"),
        ({"hordemodelname": "Foo", "debugmode": 1}, "koboldcpp/debug-Foo"),
        ({"hordemodelname": "Foo", "gendefaults": '{"temperature": 0.5}'}, "koboldcpp/debug-Foo"),
        ({"hordemodelname": "koboldcpp/Foo", "debugmode": 1}, "koboldcpp/debug-koboldcpp/Foo"),
        ({"gendefaults": '{"temperature": 0.5}'}, "koboldcpp/Qwen3-8B-Q4_K_M"),
        ({"model_param": "/m/My Model (v2).gguf"}, "koboldcpp/MyModelv2"),
    ],
)
def test_model_id_is_koboldcpps_friendlymodelname(
    args: dict[str, Any], friendlymodelname: str
) -> None:
    """The hook takes the name koboldcpp registered; it follows the naming rule of koboldcpp 1.116.1 koboldcpp.py L11453-11465."""
    kcpp = make_kcpp(friendlymodelname=friendlymodelname, args_=args)
    s = hook_settings(kcpp)
    assert s.model_id == friendlymodelname


@pytest.mark.parametrize(
    ("args", "sslvalid", "url"),
    [
        ({}, False, "http://localhost:5001"),
        ({"host": "192.168.1.5", "port": 6000}, False, "http://192.168.1.5:6000"),
        ({}, True, "https://localhost:5001"),
        ({"port": 15001, "proxy_port": 5001}, False, "http://localhost:5001"),
        ({"host": "::1"}, False, "http://[::1]:5001"),
    ],
)
def test_local_url_mirrors_get_my_epurl(args: dict[str, Any], sslvalid: bool, url: str) -> None:
    """Scheme from sslvalid, port from --port (or the router's proxy port), host or localhost."""
    assert hook_settings(make_kcpp(sslvalid=sslvalid, args_=args)).kcpp_url == url


def test_horde_url_comes_from_ai_horde_url() -> None:
    kcpp = make_kcpp()
    assert hook_settings(kcpp).horde_url == "https://aihorde.net"
    assert hook_settings(kcpp, AI_HORDE_URL="").horde_url == "https://aihorde.net"
    assert (
        hook_settings(kcpp, AI_HORDE_URL="http://127.0.0.1:7001/").horde_url
        == "http://127.0.0.1:7001"
    )
    with pytest.raises(kcpp_hook.ConfigError, match="AI_HORDE_URL"):
        hook_settings(kcpp, AI_HORDE_URL="aihorde.net")


@pytest.mark.parametrize(
    ("mmproj", "has_vision_support", "vision"),
    [
        ("/m/mmproj.gguf", True, True),
        ("/m/mmproj-audio.gguf", False, False),  # a projector that reads audio only
        ("", False, False),
        ("", True, False),
    ],
)
def test_vision_needs_a_projector_that_reads_images(
    mmproj: str, has_vision_support: bool, vision: bool
) -> None:
    kcpp = make_kcpp(has_vision_support=has_vision_support, args_={"mmproj": mmproj})
    s = hook_settings(kcpp)
    assert s.vision is vision
    body = pop_body(s, kcpp_hook.capabilities(s))
    assert ("vision" in body["chat_features"]) is vision
    # Seed 004's messages_url, plus base64 and url with vision.
    assert body["image_transports"] == (
        ["messages_url", "base64", "url"] if vision else ["messages_url"]
    )


def test_pop_body_is_koboldcpps_plus_the_seed_declaration() -> None:
    """The text fields are koboldcpp's own pop fields; the declaration is the worked example's."""
    kcpp = make_kcpp(maxctx=8192, maxhordectx=4096, maxhordelen=512)
    s = hook_settings(kcpp, threads=3)
    body = pop_body(s, kcpp_hook.capabilities(s))
    assert body == {
        "name": "my-worker",
        "models": ["koboldcpp/Qwen3-8B-Q4_K_M"],
        "max_length": 512,
        "max_context_length": 4096,
        "priority_usernames": [],
        "softprompts": [],
        "bridge_agent": koboldcpp_horde_chat.BRIDGE_AGENT,
        "threads": 3,
        "chat_jobs": True,
        "chat_features": SEED_FEATURES,
        "chat_limits": {
            "max_context_length": 4096,
            "max_length": 512,
            "tools_max_temperature": 1.0,
        },
        "model_id": "koboldcpp/Qwen3-8B-Q4_K_M",
        "image_transports": ["messages_url"],
    }


def _cli_pop_body(flags: list[str], info: Any) -> dict[str, Any]:
    class Backend:
        def info(self) -> Any:
            return info

    args = standalone_flags.build_parser().parse_args(flags)
    info = standalone.read_koboldcpp(args, Backend())  # type: ignore[arg-type]
    settings, caps = standalone.settings_from_info(args, info)
    return pop_body(settings, caps)


def test_same_declaration_as_the_standalone_cli_for_the_same_settings() -> None:
    """koboldcpp --hordegenlen 512 --hordemaxctx 4096 --contextsize 8192 --password ...
    and the standalone worker beside that koboldcpp pop with the same body."""
    kcpp = make_kcpp(maxctx=8192, maxhordectx=4096, maxhordelen=512, password=PASSWORD)
    hook = hook_settings(kcpp, AI_HORDE_URL="http://127.0.0.1:7001")
    flags = [
        "--hordekey", API_KEY,
        "--hordeworkername", "my-worker",
        "--hordegenlen", "512",
        "--hordemaxctx", "4096",
        "--kcpp-url", "http://localhost:5001",
        "--kcpp-password", PASSWORD,
        "--horde-url", "http://127.0.0.1:7001",
    ]  # fmt: skip
    info = types.SimpleNamespace(
        model_name="koboldcpp/Qwen3-8B-Q4_K_M", max_context_length=8192, vision=False,
        version="1.116.1",
    )
    assert pop_body(hook, kcpp_hook.capabilities(hook)) == _cli_pop_body(flags, info)


def test_with_vision_the_same_declaration_as_the_standalone_cli() -> None:
    """--mmproj with a projector that reads images: both declare vision and the
    messages_url, base64 and url transports (the worker fetches signed URLs itself)."""
    kcpp = make_kcpp(has_vision_support=True, args_={"mmproj": "/m/mmproj.gguf"})
    hook = pop_body(hook_settings(kcpp), kcpp_hook.capabilities(hook_settings(kcpp)))
    flags = ["--hordekey", API_KEY, "--hordeworkername", "my-worker"]
    info = types.SimpleNamespace(
        model_name="koboldcpp/Qwen3-8B-Q4_K_M", max_context_length=12288, vision=True,
        version="1.116.1",
    )
    standalone = _cli_pop_body(flags, info)
    assert hook == standalone
    assert hook["chat_features"] == [*SEED_FEATURES, "vision"]
    assert hook["image_transports"] == ["messages_url", "base64", "url"]


# ---------------------------------------------------------------------- manners


def test_manners_say_whether_requests_wait_for_the_model_lock() -> None:
    kcpp = make_kcpp(requestsinqueue=0)
    manners = kcpp_hook.KcppManners(kcpp)
    assert manners.requests_queued() is False
    kcpp.requestsinqueue = 2
    assert manners.requests_queued() is True
    del kcpp.requestsinqueue
    assert manners.requests_queued() is False


def test_manners_read_last_non_horde_req_time_live() -> None:
    kcpp = make_kcpp(last_non_horde_req_time=1000.0)
    manners = kcpp_hook.KcppManners(kcpp)
    assert manners.last_local_request_time() == 1000.0
    kcpp.last_non_horde_req_time = 2000.5  # koboldcpp refreshed it for a local request
    assert manners.last_local_request_time() == 2000.5
    del kcpp.last_non_horde_req_time
    assert manners.last_local_request_time() is None


def test_manners_report_modelbusy_unless_batching() -> None:
    kcpp = make_kcpp()
    single = kcpp_hook.KcppManners(kcpp, check_busy=True)
    batched = kcpp_hook.KcppManners(kcpp, check_busy=False)
    assert single.model_busy() is False
    with kcpp.modelbusy:
        assert single.model_busy() is True
        assert batched.model_busy() is False
    assert single.model_busy() is False


@pytest.mark.parametrize(
    ("exitcounter", "stop"),
    [(-1, False), (0, False), (9, False), (10, False), (100, True), (999, True)],
)
def test_manners_stop_when_koboldcpp_closes(exitcounter: int, stop: bool) -> None:
    """koboldcpp sets exitcounter to 999 when it shuts down; below 100 it is its worker's error count."""
    assert kcpp_hook.KcppManners(make_kcpp(exitcounter=exitcounter)).should_stop() is stop


# ------------------------------------------------------------ the loop, in place


class FakeHorde:
    """Answers every pop with "no job" and records when it was asked."""

    def __init__(self) -> None:
        self.pops: list[tuple[float, dict[str, Any]]] = []
        self.popped = threading.Event()

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.pops.append((time.monotonic(), body))
        self.popped.set()
        return {"id": None, "ids": [], "payload": {}, "skipped": {}}


class FakeBackend:
    def ready(self) -> bool:
        return True


@pytest.fixture
def real_loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Replace ``run_worker`` by one that runs the real ``Worker`` loop with fake clients."""
    seen: dict[str, Any] = {"horde": FakeHorde(), "calls": []}

    def run_worker(settings: WorkerSettings, **kw: Any) -> int:
        seen["calls"].append(
            {"settings": settings, "thread": threading.current_thread().name, **kw}
        )
        w = worker_mod.Worker(
            settings,
            horde=seen["horde"],
            backend=FakeBackend(),  # type: ignore[arg-type]
            state=WorkerState(settings, stop_event=kw.get("stop_event")),
            manners=kw["manners"],
            caps=kw["caps"],
            worker_id=kw["worker_id"],
        )
        return w.run()

    monkeypatch.setattr(kcpp_hook.hosting, "run_worker", run_worker)
    yield seen


def start_hook(kcpp: types.ModuleType, worker_id: int = 1, threads: int = 1) -> threading.Thread:
    t = threading.Thread(
        target=kcpp_hook.run_horde_worker,
        args=(kcpp, kcpp.args, API_KEY, "my-worker", worker_id, threads),
        daemon=True,
    )
    t.start()
    return t


def shut_down(kcpp: types.ModuleType, thread: threading.Thread) -> None:
    kcpp.exitcounter = 999
    thread.join(5.0)
    assert not thread.is_alive()


def test_yields_while_a_local_request_is_recent(real_loop: dict[str, Any]) -> None:
    kcpp = make_kcpp(last_non_horde_req_time=time.time() - 5.0)  # a local user 5 s ago
    thread = start_hook(kcpp)
    try:
        assert not real_loop["horde"].popped.wait(1.5), "popped within 20 s of a local request"
        kcpp.last_non_horde_req_time = time.time() - 21.0  # koboldcpp quiet for 21 s now
        assert real_loop["horde"].popped.wait(3.0), "did not pop once the local user was gone"
    finally:
        shut_down(kcpp, thread)


def test_waits_while_modelbusy_is_held(real_loop: dict[str, Any]) -> None:
    kcpp = make_kcpp()
    kcpp.modelbusy.acquire()  # koboldcpp is generating for someone
    thread = start_hook(kcpp)
    try:
        assert not real_loop["horde"].popped.wait(1.0), "popped while the model was busy"
        kcpp.modelbusy.release()
        assert real_loop["horde"].popped.wait(2.0), "did not pop once the model was free"
    finally:
        shut_down(kcpp, thread)


def test_with_batching_it_pops_while_modelbusy_is_held(real_loop: dict[str, Any]) -> None:
    """koboldcpp skips the busy check when --parallelrequests > 1 (koboldcpp 1.116.1 koboldcpp.py L10174)."""
    kcpp = make_kcpp()
    kcpp.modelbusy.acquire()
    thread = start_hook(kcpp, threads=2)
    try:
        assert real_loop["horde"].popped.wait(2.0)
        assert real_loop["horde"].pops[0][1]["threads"] == 2
    finally:
        kcpp.modelbusy.release()
        shut_down(kcpp, thread)


def test_stops_when_koboldcpp_shuts_down(real_loop: dict[str, Any]) -> None:
    kcpp = make_kcpp()
    thread = start_hook(kcpp)
    assert real_loop["horde"].popped.wait(2.0)
    kcpp.exitcounter = 999  # what koboldcpp does on Ctrl+C or /api/extra/shutdown
    thread.join(5.0)
    assert not thread.is_alive(), "the worker thread outlived koboldcpp's shutdown"
    count = len(real_loop["horde"].pops)
    time.sleep(1.2)
    assert len(real_loop["horde"].pops) == count
    assert kcpp.exitcounter == 999  # the hook never writes koboldcpp's globals


def test_each_worker_thread_runs_its_own_loop_named_after_its_id(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[dict[str, Any]] = []
    lock = threading.Lock()

    def run_worker(settings: WorkerSettings, **kw: Any) -> int:
        logging.getLogger("koboldcpp_horde_chat.worker").info("loop of %d", kw["worker_id"])
        with lock:
            calls.append({"settings": settings, "thread": threading.current_thread().name, **kw})
        return 0

    monkeypatch.setattr(kcpp_hook.hosting, "run_worker", run_worker)
    kcpp = make_kcpp(args_={"parallelrequests": 2})
    kcpp.modelbusy.acquire()
    caplog.set_level(logging.INFO, logger="koboldcpp_horde_chat")
    threads = [start_hook(kcpp, worker_id=i, threads=2) for i in (1, 2)]
    for t in threads:
        t.join(5.0)
    assert sorted((c["worker_id"], c["thread"]) for c in calls) == [
        (1, "horde-worker-1"),
        (2, "horde-worker-2"),
    ]
    assert calls[0]["manners"] is not calls[1]["manners"]
    for c in calls:
        assert c["settings"].threads == 2
        assert c["manners"].model_busy() is False  # batching: koboldcpp skips the check
    loop_lines = {r.threadName: r.getMessage() for r in caplog.records if r.msg == "loop of %d"}
    assert loop_lines == {"horde-worker-1": "loop of 1", "horde-worker-2": "loop of 2"}
    assert API_KEY not in caplog.text


def test_a_bad_horde_url_or_no_model_does_not_start_the_loop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    started: list[int] = []
    monkeypatch.setattr(kcpp_hook.hosting, "run_worker", lambda s, **kw: started.append(1) or 0)
    monkeypatch.setenv("AI_HORDE_URL", "ftp://example.invalid")
    kcpp_hook.run_horde_worker(make_kcpp(), make_kcpp().args, API_KEY, "w", 1, 1)
    assert "AI_HORDE_URL needs an http:// or https:// URL" in caplog.text
    monkeypatch.delenv("AI_HORDE_URL")
    kcpp_hook.run_horde_worker(
        make_kcpp(friendlymodelname="inactive"), make_kcpp().args, API_KEY, "w", 1, 1
    )
    assert "no text model loaded" in caplog.text
    assert started == []


def test_an_error_in_the_loop_is_logged_not_raised_into_koboldcpp(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def run_worker(settings: WorkerSettings, **kw: Any) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(kcpp_hook.hosting, "run_worker", run_worker)
    kcpp = make_kcpp(password=PASSWORD)
    assert kcpp_hook.run_horde_worker(kcpp, kcpp.args, API_KEY, "w", 3, 1) is None
    assert "worker 3: stopped by an unexpected error" in caplog.text
    assert PASSWORD not in caplog.text and API_KEY not in caplog.text


# ---------------------------------------------------------------------- logging


@pytest.fixture
def bare_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[logging.Logger]:
    """The package logger without handlers and not yet configured; restored after.

    A test clears the root logger's handlers itself (pytest adds its capture
    handler to the root logger after fixtures are set up).
    """
    package_logger = logging.getLogger("koboldcpp_horde_chat")
    saved = (list(package_logger.handlers), package_logger.level, package_logger.propagate)
    monkeypatch.setattr(kcpp_hook, "_logging_configured", False)
    package_logger.handlers = []
    yield package_logger
    package_logger.handlers, package_logger.level, package_logger.propagate = (
        saved[0],
        saved[1],
        saved[2],
    )


def test_logging_is_configured_once_with_koboldcpp_like_timestamps(
    bare_logging: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # koboldcpp configures no logging
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda: results.append(kcpp_hook.configure_logging()))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, True]
    assert len(bare_logging.handlers) == 1

    def emit() -> None:
        threading.current_thread().name = "horde-worker-2"
        logging.getLogger("koboldcpp_horde_chat.worker").info("job=%s kind=chat received", "j1")

    t = threading.Thread(target=emit)
    t.start()
    t.join()
    assert re.fullmatch(
        r"\[\d\d:\d\d:\d\d\] horde-worker-2 INFO: job=j1 kind=chat received\n", out.getvalue()
    )


def test_logging_is_left_alone_when_the_host_configured_it(
    bare_logging: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    assert kcpp_hook.configure_logging() is False
    assert bare_logging.handlers == []


# ---------------------------------------------------------------------- patches


def parse_patch(text: str) -> tuple[list[str], list[tuple[int, int, int, int, list[str]]]]:
    """(file headers, hunks as (old_start, old_len, new_start, new_len, lines))."""
    headers: list[str] = []
    hunks: list[tuple[int, int, int, int, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(("--- ", "+++ ")):
            headers.append(line)
        m = re.match(r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@", line)
        if m:
            old_start, old_len, new_start, new_len = map(int, m.groups())
            body: list[str] = []
            i += 1
            while i < len(lines) and lines[i][:1] in (" ", "+", "-", "\\"):
                body.append(lines[i])
                i += 1
            hunks.append((old_start, old_len, new_start, new_len, body))
            continue
        i += 1
    return headers, hunks


@pytest.mark.parametrize("release", RELEASES)
def test_patch_only_adds_the_guarded_import_inside_run_horde_worker(release: str) -> None:
    text = (PATCH_DIR / f"koboldcpp-{release}.patch").read_text(encoding="utf-8")
    headers, hunks = parse_patch(text)
    assert headers == ["--- a/koboldcpp.py", "+++ b/koboldcpp.py"]
    assert len(hunks) == 2
    old_start, old_len, new_start, new_len, body = hunks[0]
    removed = [line for line in body if line.startswith("-")]
    added = [line[1:] for line in body if line.startswith("+")]
    context = [line[1:] for line in body if line.startswith(" ")]
    assert removed == []
    assert old_len == len(context) and new_len == len(context) + len(added)
    assert old_start == new_start
    # The added lines sit between the function's global statement and its first line.
    kinds = "".join(line[:1] for line in body)
    assert kinds == " " * 3 + "+" * len(added) + " " * 3
    assert context[1] == (
        "def run_horde_worker(args, api_key, worker_name, worker_id, parallel_batching_threads):"
    )
    assert context[2].startswith("    global friendlymodelname")
    assert context[3] == "    epurl = get_my_epurl()"
    assert all(line.startswith("    ") for line in added)
    code = "\n".join(added)
    # The entry point every patch has imported since 0.1.0, kept in every version.
    assert "from koboldcpp_horde_chat import kcpp_hook" in code
    # Silent only when the package is not installed; any other failure is said.
    assert 'isinstance(hookerr, ModuleNotFoundError) and hookerr.name == "koboldcpp_horde_chat"' in code
    assert "print(" in code
    assert (
        "kcpp_hook.run_horde_worker(sys.modules[__name__], args, api_key, worker_name, "
        "worker_id, parallel_batching_threads)" in code
    )


@pytest.mark.parametrize("release", RELEASES)
def test_patch_starts_the_recovery_before_the_model_loads_in_a_guarded_block(
    release: str,
) -> None:
    """The second hunk: after koboldcpp read the Horde settings (friendlymodelname set),
    before it loads the model; it only adds lines, and its line numbers follow the
    first hunk's added lines."""
    _, hunks = parse_patch((PATCH_DIR / f"koboldcpp-{release}.patch").read_text(encoding="utf-8"))
    first, (old_start, old_len, new_start, new_len, body) = hunks
    added = [line[1:] for line in body if line.startswith("+")]
    context = [line[1:] for line in body if line.startswith(" ")]
    assert [line for line in body if line.startswith("-")] == []
    assert old_start > first[0] + first[1]
    assert new_start == old_start + (first[3] - first[1])
    assert old_len == len(context) and new_len == len(context) + len(added)
    assert "".join(line[:1] for line in body) == " " * 3 + "+" * len(added) + " " * 3
    assert context[:3] == [
        "        maxhordelen = int(args.hordegenlen)",
        "    if args.hordemaxctx and args.hordemaxctx >= 0:",
        "        maxhordectx = int(args.hordemaxctx)",
    ]
    assert added[0].startswith("    if args.hordekey and args.hordeworkername:")
    assert added[1:] == [
        "        try:",
        "            from koboldcpp_horde_chat import kcpp_hook",
        "            kcpp_hook.start_recovery(sys.modules[__name__], args)",
        added[4],
        "            pass",
    ]
    assert added[4].startswith("        except Exception:")


def early_block(release: str) -> str:
    """The second hunk's added lines as a function of ``args`` (koboldcpp's start-up)."""
    body = parse_patch((PATCH_DIR / f"koboldcpp-{release}.patch").read_text(encoding="utf-8"))[1][1][4]
    return "def startup(args):\n" + "\n".join(line[1:] for line in body if line.startswith("+"))


@pytest.mark.parametrize("release", RELEASES)
def test_the_early_block_hands_args_to_start_recovery_and_never_raises(
    release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from koboldcpp_horde_chat import kcpp_hook as entry

    calls: list[tuple[Any, ...]] = []
    module = types.ModuleType("patched_koboldcpp_start")
    module.__dict__["sys"] = sys
    exec(compile(early_block(release), "early", "exec"), module.__dict__)  # noqa: S102
    monkeypatch.setitem(sys.modules, "patched_koboldcpp_start", module)
    monkeypatch.setattr(entry, "start_recovery", lambda *a: calls.append(a))
    args = argparse.Namespace(hordekey=API_KEY, hordeworkername="my-worker")
    module.startup(args)
    assert calls == [(module, args)]
    module.startup(argparse.Namespace(hordekey="", hordeworkername="my-worker"))
    assert len(calls) == 1  # no key: no Horde worker, nothing recovered
    # A package older than 0.2.0 has no start_recovery: nothing happens, nothing raised.
    monkeypatch.delattr(entry, "start_recovery")
    module.startup(args)


@pytest.mark.parametrize("release", RELEASES)
def test_each_patch_header_names_koboldcpps_release_tag_and_the_package_version_it_needs(
    release: str,
) -> None:
    header = (PATCH_DIR / f"koboldcpp-{release}.patch").read_text(encoding="utf-8").split(
        "--- a/koboldcpp.py"
    )[0]
    assert f"Made against koboldcpp's release v{release} (LostRuins/koboldcpp, tag v{release}" in header
    assert "Needs koboldcpp-horde-chat 0.1.0 or newer" in header
    assert "License: AGPL-3.0" in header


def test_the_entry_point_every_patch_imported_is_kept_with_its_signature() -> None:
    import inspect

    from koboldcpp_horde_chat import kcpp_hook as entry

    expected = [
        "kcpp", "args", "api_key", "worker_name", "worker_id", "parallel_batching_threads"
    ]
    assert list(inspect.signature(entry.run_horde_worker).parameters) == expected
    imported = {
        re.search(r"^\+\s+(from koboldcpp_horde_chat\S* import .+)$", path.read_text(), re.M)[1]  # type: ignore[index]
        for path in EVERY_PATCH.values()
    }
    assert imported == {"from koboldcpp_horde_chat import kcpp_hook"}


def test_both_releases_carry_the_same_change() -> None:
    """The worker code is identical in 1.116.1 and 1.117.1; only the line numbers differ."""
    bodies = [
        [hunk[4] for hunk in parse_patch((PATCH_DIR / f"koboldcpp-{r}.patch").read_text(
            encoding="utf-8"))[1]]
        for r in RELEASES
    ]
    assert bodies[0] == bodies[1]


def patched_function(
    release: str, monkeypatch: pytest.MonkeyPatch, which: str = "current"
) -> Callable[..., Any]:
    """koboldcpp's ``run_horde_worker`` head with the patch applied, up to its first own line.

    ``which``: the patch of ``patches/`` ("current") or one shipped earlier
    (a key of :data:`EARLIER_PATCH_DIRS`). ``get_my_epurl`` stands for
    koboldcpp's own worker: reaching it means the patch fell back to koboldcpp's loop.
    """
    body = parse_patch(EVERY_PATCH[(which, release)].read_text(encoding="utf-8"))[1][0][4]
    new_side = [line[1:] for line in body if line[:1] in (" ", "+")]
    end = new_side.index("    epurl = get_my_epurl()")
    source = "\n".join(new_side[: end + 1]) + "\n    return ('koboldcpp loop', epurl)\n"
    module = types.ModuleType("patched_koboldcpp")
    module.__dict__["get_my_epurl"] = lambda: "http://localhost:5001"
    module.__dict__["sys"] = sys
    module.__dict__["os"] = os
    exec(compile(source, f"koboldcpp-{release}.patch", "exec"), module.__dict__)  # noqa: S102
    monkeypatch.setitem(sys.modules, "patched_koboldcpp", module)
    return module.run_horde_worker  # type: ignore[no-any-return]


@pytest.mark.parametrize(("which", "release"), sorted(EVERY_PATCH))
def test_patched_koboldcpp_hands_its_worker_to_the_hook(
    which: str, release: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Also a koboldcpp patched for an earlier version, after the package's upgrade."""
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(kcpp_hook, "run_horde_worker", lambda *a: calls.append(a))
    run = patched_function(release, monkeypatch, which)
    args = argparse.Namespace(port=5001)
    assert run(args, API_KEY, "my-worker", 2, 3) is None
    assert calls == [(sys.modules["patched_koboldcpp"], args, API_KEY, "my-worker", 2, 3)]
    assert capsys.readouterr() == ("", "")


class _NotInstalled:
    """An import finder for which the package does not exist (as when not installed)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == "koboldcpp_horde_chat":
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


@pytest.mark.parametrize("release", RELEASES)
def test_patched_koboldcpp_runs_its_own_worker_silently_when_the_package_is_missing(
    release: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(kcpp_hook, "run_horde_worker", lambda *a: pytest.fail("hook called"))
    monkeypatch.delenv("AI_HORDE_URL", raising=False)  # koboldcpp's own loop runs only then
    # Not installed: no module of the package is loaded, and none can be found.
    for name in [m for m in sys.modules if m.split(".")[0] == "koboldcpp_horde_chat"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NotInstalled(), *sys.meta_path])
    run = patched_function(release, monkeypatch)
    assert run(argparse.Namespace(), API_KEY, "my-worker", 1, 1) == (
        "koboldcpp loop",
        "http://localhost:5001",
    )
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("release", RELEASES)
def test_patched_koboldcpp_says_why_when_the_installed_package_does_not_import(
    release: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(kcpp_hook, "run_horde_worker", lambda *a: pytest.fail("hook called"))
    monkeypatch.delenv("AI_HORDE_URL", raising=False)  # koboldcpp's own loop runs only then
    monkeypatch.delattr(koboldcpp_horde_chat, "kcpp_hook", raising=False)
    monkeypatch.setitem(sys.modules, "koboldcpp_horde_chat.kcpp_hook", None)  # import fails
    run = patched_function(release, monkeypatch)
    assert run(argparse.Namespace(), API_KEY, "my-worker", 1, 1) == (
        "koboldcpp loop",
        "http://localhost:5001",
    )
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out
    assert out.startswith("koboldcpp-horde-chat is installed but does not import (")
    assert "koboldcpp's own Horde worker runs (text jobs only, on https://aihorde.net: it ignores AI_HORDE_URL)" in out


BROKEN_PACKAGES = {
    # what the package's __init__ does -> the error named on the console line
    "a Python too old for the package": (
        "raise ImportError(\"cannot import name 'UTC' from 'datetime'\")",
        "ImportError: cannot import name 'UTC' from 'datetime'",
    ),
    "a missing dependency": ("import requests_not_installed_here", "ModuleNotFoundError"),
    "a damaged file": ("def broken(:", "SyntaxError"),
}


def run_patched_koboldcpp(
    release: str,
    tmp_path: Path,
    package_init: str | None,
    which: str = "current",
    package_files: dict[str, str] | None = None,
    horde_url: str | None = None,
) -> str:
    """Run the patched ``run_horde_worker`` in a fresh interpreter; returns its stdout.

    The interpreter is isolated (``-I -S``: no site-packages, no environment,
    no current directory), so ``koboldcpp_horde_chat`` is importable only when
    ``package_init`` gives it a stand-in ``__init__.py`` in ``tmp_path``
    (``package_files``: more of its files, by path inside the package). ``which``
    is the patch (see :func:`patched_function`). ``horde_url``: the value of
    ``AI_HORDE_URL`` in its environment (``None``: unset, whatever the caller's is).
    "koboldcpp own worker: started" on its stdout means koboldcpp's own loop began.
    """
    body = parse_patch(EVERY_PATCH[(which, release)].read_text(encoding="utf-8"))[1][0][4]
    new_side = [line[1:] for line in body if line[:1] in (" ", "+")]
    end = new_side.index("    epurl = get_my_epurl()")
    (tmp_path / "koboldcpp.py").write_text(
        "import os\n"
        "import sys\n"
        "def get_my_epurl():\n"
        "    print('koboldcpp own worker: started')\n"
        "    return 'http://localhost:5001'\n"
        + "\n".join(new_side[: end + 1])
        + "\n    return epurl\n",
        encoding="utf-8",
    )
    if package_init is not None:
        (tmp_path / "koboldcpp_horde_chat").mkdir()
        (tmp_path / "koboldcpp_horde_chat" / "__init__.py").write_text(package_init + "\n")
        for name, text in (package_files or {}).items():
            path = tmp_path / "koboldcpp_horde_chat" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
    runner = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import koboldcpp; "
        "koboldcpp.run_horde_worker(None, 'key', 'my-worker', 1, 1)"
    )
    env = {k: v for k, v in os.environ.items() if k != "AI_HORDE_URL"}
    if horde_url is not None:
        env["AI_HORDE_URL"] = horde_url
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", runner],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


@pytest.mark.parametrize("release", RELEASES)
def test_without_the_package_koboldcpp_runs_its_own_worker_and_says_nothing(
    release: str, tmp_path: Path
) -> None:
    assert run_patched_koboldcpp(release, tmp_path, None) == "koboldcpp own worker: started\n"


#: AI_HORDE_URL values that name a Horde other than the public one koboldcpp's loop serves.
ANOTHER_HORDE = ("http://127.0.0.1:7001", "  http://127.0.0.1:7001/ ", "https://horde.example.org")


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("horde_url", ["", "   ", "https://aihorde.net", "https://aihorde.net/"])
def test_without_the_package_and_ai_horde_url_unset_or_public_koboldcpp_runs_its_own_worker(
    release: str, horde_url: str, tmp_path: Path
) -> None:
    out = run_patched_koboldcpp(release, tmp_path, None, horde_url=horde_url)
    assert out == "koboldcpp own worker: started\n"


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("horde_url", ANOTHER_HORDE)
def test_without_the_package_another_horde_url_never_starts_koboldcpps_own_worker(
    release: str, horde_url: str, tmp_path: Path
) -> None:
    """koboldcpp's own loop hard-codes https://aihorde.net: started with a local
    AI_HORDE_URL it would send the key and worker name to the public Horde."""
    out = run_patched_koboldcpp(release, tmp_path, None, horde_url=horde_url)
    assert out == (
        f"koboldcpp-horde-chat not installed for this Python ({sys.executable}); koboldcpp's own "
        "worker serves only https://aihorde.net, so it is not started with "
        f"AI_HORDE_URL={horde_url.strip()}; install the package for this Python or unset "
        "AI_HORDE_URL.\n"
    )


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("broken", sorted(BROKEN_PACKAGES))
def test_a_broken_install_with_another_horde_url_says_so_in_one_line_and_starts_nothing(
    release: str, broken: str, tmp_path: Path
) -> None:
    package_init, error = BROKEN_PACKAGES[broken]
    out = run_patched_koboldcpp(
        release, tmp_path, package_init, horde_url="http://127.0.0.1:7001"
    )
    assert out.count("\n") == 1 and "koboldcpp own worker: started" not in out, out
    assert out.startswith("koboldcpp-horde-chat is installed but does not import (")
    assert error in out
    assert (
        "so koboldcpp's own Horde worker serves only https://aihorde.net, so it is not started "
        "with AI_HORDE_URL=http://127.0.0.1:7001. Fix: reinstall it for this Python ("
    ) in out
    assert out.endswith("or uninstall it, or unset AI_HORDE_URL.\n")


@pytest.mark.parametrize("release", RELEASES)
def test_a_package_without_the_entry_point_and_another_horde_url_starts_nothing(
    release: str, tmp_path: Path
) -> None:
    out = run_patched_koboldcpp(
        release, tmp_path, "__version__ = '9.0.0'", horde_url="http://127.0.0.1:7001"
    )
    assert out.count("\n") == 1 and "koboldcpp own worker: started" not in out, out
    assert "it is not started with AI_HORDE_URL=http://127.0.0.1:7001. Fix: apply the " in out


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("broken", sorted(BROKEN_PACKAGES))
def test_a_broken_install_prints_one_line_then_koboldcpp_runs_its_own_worker(
    release: str, broken: str, tmp_path: Path
) -> None:
    package_init, error = BROKEN_PACKAGES[broken]
    lines = run_patched_koboldcpp(release, tmp_path, package_init).splitlines()
    assert len(lines) == 2, lines
    said, fallback = lines
    assert said.startswith("koboldcpp-horde-chat is installed but does not import (")
    assert error in said
    # koboldcpp's own worker serves the public Horde whatever AI_HORDE_URL says.
    assert "so koboldcpp's own Horde worker runs (text jobs only, on https://aihorde.net: it ignores AI_HORDE_URL)" in said
    # It names what to install, as the README installs it: the package's source tree or wheel.
    assert (
        f"Fix: reinstall it for this Python ({sys.executable} -m pip install "
        "/path/to/koboldcpp-horde-chat, its source tree or wheel;"
    ) in said
    assert said.endswith("or uninstall it.")
    assert fallback == "koboldcpp own worker: started"


@pytest.mark.parametrize("release", RELEASES)
def test_a_broken_entry_module_is_a_broken_install_to_reinstall(
    release: str, tmp_path: Path
) -> None:
    lines = run_patched_koboldcpp(
        release, tmp_path, "", package_files={"kcpp_hook.py": "import requests_not_installed_here"}
    ).splitlines()
    assert len(lines) == 2, lines
    assert "(ModuleNotFoundError: No module named 'requests_not_installed_here')" in lines[0]
    assert "Fix: reinstall it for this Python (" in lines[0]
    assert lines[1] == "koboldcpp own worker: started"


@pytest.mark.parametrize("release", RELEASES)
def test_a_package_without_the_patchs_entry_point_says_to_apply_its_own_patch(
    release: str, tmp_path: Path
) -> None:
    """A version whose entry point is not the one this patch imports: reinstalling
    changes nothing, so the line says which patch to apply instead."""
    lines = run_patched_koboldcpp(
        release, tmp_path, "__version__ = '9.0.0'", package_files={"entry.py": "x = 1"}
    ).splitlines()
    assert len(lines) == 2, lines
    said, fallback = lines
    assert said.startswith(
        "koboldcpp-horde-chat is installed but does not import (ImportError: cannot import "
        "name 'kcpp_hook' from 'koboldcpp_horde_chat'"
    )
    assert said.endswith(
        "Fix: apply the koboldcpp patch that comes with the installed version (patches/ in its "
        "source tree or sdist): this patch imports koboldcpp_horde_chat.kcpp_hook, which that "
        "version does not have."
    )
    assert "reinstall" not in said
    assert fallback == "koboldcpp own worker: started"


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("which", sorted(EARLIER_PATCH_DIRS))
def test_a_koboldcpp_patched_for_an_earlier_version_runs_this_worker_after_an_upgrade(
    which: str, release: str, tmp_path: Path
) -> None:
    """The upgrade that silently dropped the worker: a koboldcpp patched for 0.1.0
    with today's package installed runs the package's worker, says nothing, and
    never falls back to koboldcpp's own."""
    package = ROOT / "koboldcpp_horde_chat"
    entry = (package / "kcpp_hook.py").read_text(encoding="utf-8")
    assert "from .hosts import inside_kcpp" in entry
    # The package as installed (its entry path as it is), its hook replaced
    # by one that says it ran.
    out = run_patched_koboldcpp(
        release,
        tmp_path,
        "",
        which,
        package_files={
            "kcpp_hook.py": entry,
            "hosts/__init__.py": "",
            "hosts/inside_kcpp.py": "def run_horde_worker(kcpp, *a):\n    print('this worker: started', a)",
        },
    )
    assert out == "this worker: started (None, 'key', 'my-worker', 1, 1)\n"


# ------------------------------------------ start-up checks, journal and console in koboldcpp


@pytest.mark.parametrize("case", sorted(REFUSED_AT_START))
def test_what_the_standalone_worker_refuses_is_refused_inside_koboldcpp_in_one_line(
    case: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same checks as standalone: the worker thread says why in one line and does
    not start; koboldcpp carries on (the hook returns, nothing raised)."""
    refused = REFUSED_AT_START[case]
    started: list[int] = []
    monkeypatch.setattr(kcpp_hook.hosting, "run_worker", lambda s, **kw: started.append(1) or 0)
    monkeypatch.delenv("AI_HORDE_URL", raising=False)
    for name, value in refused.env.items():
        monkeypatch.setenv(name, value)
    kcpp = make_kcpp(args_={"hordegenlen": refused.genlen, "hordeworkername": refused.name})
    caplog.set_level(logging.INFO, logger="koboldcpp_horde_chat")
    assert kcpp_hook.run_horde_worker(kcpp, kcpp.args, API_KEY, refused.name, 1, 1) is None
    assert started == []
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "worker 1: not started: " + refused.line)
    ]


def test_a_name_of_100_characters_once_stripped_is_served_stripped_inside_koboldcpp() -> None:
    kcpp = make_kcpp()
    settings = kcpp_hook.settings_from_kcpp(kcpp, kcpp.args, API_KEY, " " + "x" * 100 + " ", 1, environ={})
    assert settings.worker_name == "x" * 100


def test_a_journal_directory_that_cannot_be_used_turns_crash_recovery_off_in_one_line_and_serves_on(
    real_loop: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Inside koboldcpp nothing can exit for it: one line says why, and the worker pops."""
    monkeypatch.setattr(kcpp_hook, "_SHARED", {})
    monkeypatch.setenv("KOBOLDCPP_HORDE_CHAT_JOURNAL_DIR", "/proc/nope")
    caplog.set_level(logging.INFO, logger="koboldcpp_horde_chat")
    kcpp = make_kcpp()
    threads = [start_hook(kcpp, worker_id=i, threads=2) for i in (1, 2)]
    try:
        assert real_loop["horde"].popped.wait(3.0), "the worker did not serve on"
    finally:
        for thread in threads:
            shut_down(kcpp, thread)
    off = [r for r in caplog.records if "crash recovery is off" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in off] == [
        (
            "WARNING",
            "job journal directory /proc/nope cannot be used (No such file or directory): crash "
            "recovery is off, so a job in hand when the worker dies is left to expire on the "
            "Horde; point KOBOLDCPP_HORDE_CHAT_JOURNAL_DIR at a writable directory to turn it on",
        )
    ]
    assert all(call["state"].journal is None for call in real_loop["calls"])


@pytest.mark.parametrize(
    ("code", "line"),
    [
        (0, "worker 1: stopped: koboldcpp is shutting down"),
        (2, "worker 1: stopped: the Horde refused a setting (above); koboldcpp serves on without this worker"),
        (3, "worker 1: stopped: the Horde refused the API key (above); koboldcpp serves on without this worker"),
    ],
)
def test_the_last_line_says_why_the_worker_stopped_never_an_exit_code(
    code: int, line: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kcpp_hook, "_SHARED", {})
    monkeypatch.setattr(kcpp_hook.hosting, "run_worker", lambda s, **kw: code)
    caplog.set_level(logging.INFO, logger="koboldcpp_horde_chat")
    kcpp = make_kcpp()
    kcpp_hook.run_horde_worker(kcpp, kcpp.args, API_KEY, "my-worker", 1, 1)
    assert caplog.records[-1].getMessage() == line
    assert "exit code" not in caplog.text


def test_the_start_line_names_the_horde_and_koboldcpp_as_the_standalone_one_does(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kcpp_hook, "_SHARED", {})
    monkeypatch.setattr(kcpp_hook.hosting, "run_worker", lambda s, **kw: 0)
    monkeypatch.setenv("AI_HORDE_URL", "http://127.0.0.1:7001/api/v2/")
    caplog.set_level(logging.INFO, logger="koboldcpp_horde_chat")
    kcpp = make_kcpp(args_={"port": 5005})
    kcpp_hook.run_horde_worker(kcpp, kcpp.args, API_KEY, "my-worker", 2, 2)
    assert (
        "worker 2: serving text jobs for koboldcpp/Qwen3-8B-Q4_K_M from "
        "http://127.0.0.1:7001 via http://localhost:5005, 2 at once, and chat jobs once that "
        "Horde sends them (chat is declared on every pop; a Horde without the chat routes "
        "sends text jobs only)"
    ) in [r.getMessage() for r in caplog.records]


def console(bare_logging: logging.Logger, monkeypatch: pytest.MonkeyPatch, kcpp: types.ModuleType) -> io.StringIO:
    """koboldcpp's console (stdout) with the hook's handler on it."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert kcpp_hook.configure_logging(kcpp=kcpp) is True
    return out


def test_each_worker_line_starts_on_a_line_of_its_own_after_koboldcpps_unterminated_stats_line(
    bare_logging: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    kcpp = make_kcpp(totalgens=0, currentusergenkey="")
    out = console(bare_logging, monkeypatch, kcpp)
    log = logging.getLogger("koboldcpp_horde_chat.submit")
    log.info("worker 1: ready")
    log.info("job=j1 kind=chat received")
    # koboldcpp generates: it counts the generation, then prints its statistics
    # line without a newline at the end (gpttype_adapter.cpp).
    kcpp.totalgens = 1
    out.write("\n[19:41:00] CtxLimit:120/4096, Init:0.01s, Processed:100 in 0.20s, Generated:20/64 in 0.28s, Total:0.49s")
    log.info("job=j1 kind=chat submitted")
    log.info("job=j2 kind=chat received")
    lines = [
        re.sub(r"^\[\d\d:\d\d:\d\d\] ([\w-]+ INFO: )?", "[T] ", line)
        for line in out.getvalue().split("\n")
    ]
    assert lines == [
        "",  # before the first line: koboldcpp's last output is not known
        "[T] worker 1: ready",
        "[T] job=j1 kind=chat received",  # no empty line between the worker's own lines
        "",  # koboldcpp's statistics line starts with a newline of its own
        "[T] CtxLimit:120/4096, Init:0.01s, Processed:100 in 0.20s, Generated:20/64 in 0.28s, Total:0.49s",
        "[T] job=j1 kind=chat submitted",
        "[T] job=j2 kind=chat received",
        "",
    ]


def test_while_koboldcpp_generates_a_worker_line_starts_on_a_new_line(
    bare_logging: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """koboldcpp's progress ("Generating (12 / 64 tokens)") is written with a carriage return."""
    kcpp = make_kcpp(totalgens=3)
    out = console(bare_logging, monkeypatch, kcpp)
    log = logging.getLogger("koboldcpp_horde_chat.worker")
    log.info("first")
    kcpp.modelbusy.acquire()
    out.write("\rGenerating (12 / 64 tokens)")
    log.info("during")
    kcpp.modelbusy.release()
    out.write("\n[19:41:00] CtxLimit:1/4096, Total:0.49s")
    log.info("after")
    text = out.getvalue()
    assert "tokens)\n[" in text and "Total:0.49s\n[" in text


# ------------------------------------------------- the recovery before the model loads


def test_start_recovery_starts_it_once_and_the_first_worker_thread_takes_it_over(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """koboldcpp's early block starts the recovery before the model loads; the worker
    thread started after it uses that journal and waits for that recovery, and
    starts no second one (a second recovery would find the journal held)."""
    monkeypatch.setattr(kcpp_hook, "_SHARED", {})
    monkeypatch.setattr(kcpp_hook, "_EARLY", {})
    monkeypatch.setenv("KOBOLDCPP_HORDE_CHAT_JOURNAL_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("AI_HORDE_URL", "http://127.0.0.1:9")  # an empty journal sends nothing
    started: list[Any] = []
    real = kcpp_hook.hosting.start_recovery
    monkeypatch.setattr(
        kcpp_hook.hosting, "start_recovery", lambda *a, **kw: started.append(real(*a, **kw))
        or started[-1]
    )
    kcpp = make_kcpp()
    args = kcpp.args
    assert kcpp_hook.start_recovery(kcpp, args) is True
    assert kcpp_hook.start_recovery(kcpp, args) is False  # once per worker
    (recovery,) = started
    assert recovery.wait(timeout_s=5)
    settings = kcpp_hook.settings_from_kcpp(kcpp, args, API_KEY, "my-worker", 1)
    state = kcpp_hook.shared_state(settings)
    try:
        assert state.recovery is recovery and state.journal is recovery.journal
        assert state.stop_event is recovery.stop_event
        assert len(started) == 1  # the worker thread started no second recovery
        assert kcpp_hook.start_recovery(kcpp, args) is False  # nor a late early block
    finally:
        assert state.journal is not None
        state.journal.unlock()


def test_without_the_early_block_the_first_worker_thread_starts_the_recovery(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A koboldcpp patched before 0.2.0 never calls start_recovery: as before."""
    monkeypatch.setattr(kcpp_hook, "_SHARED", {})
    monkeypatch.setattr(kcpp_hook, "_EARLY", {})
    monkeypatch.setenv("KOBOLDCPP_HORDE_CHAT_JOURNAL_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("AI_HORDE_URL", "http://127.0.0.1:9")
    kcpp = make_kcpp()
    settings = kcpp_hook.settings_from_kcpp(kcpp, kcpp.args, API_KEY, "my-worker", 1)
    state = kcpp_hook.shared_state(settings)
    try:
        assert state.recovery is not None and state.journal is not None
        assert state.recovery.wait(timeout_s=5)
    finally:
        assert state.journal is not None
        state.journal.unlock()


def test_start_recovery_never_raises_and_says_why_it_did_not_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kcpp_hook, "_EARLY", {})
    monkeypatch.setenv("AI_HORDE_URL", "ftp://example.invalid")
    caplog.set_level(logging.ERROR, "koboldcpp_horde_chat")
    kcpp = make_kcpp()
    assert kcpp_hook.start_recovery(kcpp, kcpp.args) is False
    assert any("not recovered yet" in r.getMessage() and "AI_HORDE_URL" in r.getMessage()
               for r in caplog.records)


# ------------------------------------------------------------- what it found


@pytest.mark.parametrize(
    ("template", "said"), [("{{ messages }}", "yes"), ("", "none"), (None, "unknown")]
)
def test_inside_koboldcpp_the_line_says_its_version_and_the_models_chat_template(
    template: str | None, said: str
) -> None:
    from koboldcpp_horde_chat.hosts.hosting import koboldcpp_found_line

    kcpp = make_kcpp(cached_chat_template=template)
    settings = hook_settings(kcpp)
    info = kcpp_hook.found_info(kcpp, settings)
    assert info.version == "1.116.1" and info.chat_template == template
    line = koboldcpp_found_line(info, settings, kcpp_hook.capabilities(settings))
    assert line.startswith(
        f"koboldcpp 1.116.1 at http://localhost:5001: model Qwen3-8B-Q4_K_M, context 12288, "
        f"chat template {said}, vision no; declaring chat ("
    )
