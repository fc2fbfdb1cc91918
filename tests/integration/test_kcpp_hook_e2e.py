"""The koboldcpp hook end to end, over real HTTP on 127.0.0.1.

A stand-in koboldcpp module (the globals and ``args`` the real koboldcpp has
when it starts its Horde worker) points at the scripted koboldcpp; the hook
runs the real worker against the dev Horde, as a patched koboldcpp would.

Opt-in checks against a real koboldcpp source tree (skipped unless set):

* ``KOBOLDCPP_SRC=<tree>``: the patch for that tree's release applies with
  ``patch -p1 --dry-run`` and ``git apply --check``, and the patched file compiles;
* plus ``KOBOLDCPP_MODEL=<file.gguf>`` with a built ``koboldcpp_default.so`` in
  the tree: a patched koboldcpp serves a chat job and a text job from the dev Horde;
* plus the ``gguf`` package (the ``test-gguf`` extra): koboldcpp started with a
  tiny random-weight vision projector written at test time (``tiny_projector``)
  serves a ``url`` and a ``base64`` image job, and its log shows each image decoded.

The koboldcpp tree is never changed: koboldcpp runs from a temporary directory
of links to its files, beside a patched copy of ``koboldcpp.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from koboldcpp_horde_chat.demo.cases import DEMO_IMAGE_DATA_URL
from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp
from koboldcpp_horde_chat.horde.declaration import BackendCapabilities
from koboldcpp_horde_chat.hosts import inside_kcpp as kcpp_hook
from koboldcpp_horde_chat.hosts.hosting import run_worker
from koboldcpp_horde_chat.koboldcpp.client import KoboldClient
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.shared import WorkerState

ROOT = Path(__file__).resolve().parents[2]
PATCH_DIR = ROOT / "patches"
WORKER_NAME = "kcpp-hook-worker"


class _LiveBusy:
    """``modelbusy`` as the hook sees it: locked while the scripted koboldcpp generates."""

    def __init__(self, kcpp: ScriptedKoboldcpp) -> None:
        self._kcpp = kcpp

    def locked(self) -> bool:
        return self._kcpp.generating


class _LiveKoboldcpp(types.ModuleType):
    """koboldcpp's module whose ``last_non_horde_req_time`` follows the scripted server."""

    scripted: ScriptedKoboldcpp
    started_at: float

    @property
    def last_non_horde_req_time(self) -> float:
        last = self.scripted.last_non_horde_request_time
        return self.started_at if last is None else last


def stand_in_koboldcpp(kcpp: ScriptedKoboldcpp, *, started_ago_s: float = 3600.0) -> Any:
    """The koboldcpp module as its main leaves it for ``--port <kcpp.port> --host 127.0.0.1
    --contextsize 4096 --hordegenlen 512 --hordekey ... --hordeworkername ...``."""
    module = _LiveKoboldcpp("koboldcpp")
    module.scripted = kcpp
    module.started_at = time.time() - started_ago_s
    module.friendlymodelname = kcpp.model_name
    module.password = kcpp.password
    module.maxctx = kcpp.max_context_length
    module.maxhordectx = 0
    module.maxhordelen = 512
    module.modelbusy = _LiveBusy(kcpp)
    module.exitcounter = -1
    module.punishcounter = 0
    module.has_vision_support = False
    module.sslvalid = False
    module.nocertify = False
    module.args = argparse.Namespace(
        model_param="/m/scripted-model.gguf",
        host="127.0.0.1",
        port=kcpp.port,
        proxy_port=None,
        mmproj="",
        hordemodelname="",
        hordeworkername=WORKER_NAME,
        hordekey="",
        hordemaxctx=0,
        hordegenlen=512,
        debugmode=-1,
        gendefaults="",
        parallelrequests=1,
    )
    return module


@pytest.fixture
def hooked(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """The hook running in a worker thread, as koboldcpp's worker 1; shut down after."""
    monkeypatch.setenv("AI_HORDE_URL", horde.url)
    module = stand_in_koboldcpp(kcpp)
    api_key = sorted(horde.api_keys)[0]
    module.args.hordekey = api_key
    thread = threading.Thread(
        target=kcpp_hook.run_horde_worker,
        args=(module, module.args, api_key, WORKER_NAME, 1, 1),
        daemon=True,
    )
    thread.start()
    module.thread = thread
    yield module
    module.exitcounter = 999
    thread.join(10.0)
    assert not thread.is_alive(), "the hooked worker outlived koboldcpp's shutdown"


def wait_for(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_hooked_koboldcpp_serves_a_chat_job_and_a_text_job(
    hooked: Any, horde: DevHorde, kcpp: ScriptedKoboldcpp
) -> None:
    chat = horde.send_chat(
        {
            "messages": [
                {"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": [{"type": "text", "text": "Name one colour."}]},
            ],
            "max_tokens": 32,
        }
    )
    text = horde.send_text("The capital of France is", max_length=32)
    assert horde.wait([chat, text], timeout_s=30.0), "the jobs were not served"

    chat_status = horde.status(chat)
    assert chat_status["state"] == "done"
    assert chat_status["message"]["role"] == "assistant"
    assert chat_status["message"]["content"] == "Blue."
    assert chat_status["model"] == "koboldcpp/scripted-model"
    assert chat_status["worker"] == WORKER_NAME
    text_status = horde.status(text)
    assert text_status["state"] == "done"
    assert isinstance(text_status["generation"], str) and text_status["generation"]

    pop = horde.pops[0]["body"]
    assert pop["models"] == ["koboldcpp/scripted-model"]
    assert pop["model_id"] == "koboldcpp/scripted-model"
    assert pop["max_length"] == 512 and pop["max_context_length"] == 4096
    assert pop["chat_limits"]["max_context_length"] == 4096
    assert pop["image_transports"] == ["messages_url"]
    assert "threads" not in pop
    # The worker's own generations do not count as local use (HORDEREQ_ genkeys).
    assert kcpp.generations and all(g["genkey"].startswith("HORDEREQ_") for g in kcpp.generations)
    assert kcpp.last_non_horde_request_time is None


def test_a_local_users_generation_pauses_the_hooked_worker(
    hooked: Any, horde: DevHorde, kcpp: ScriptedKoboldcpp
) -> None:
    assert wait_for(lambda: len(horde.pops) >= 1, 10.0), "the worker never popped"
    local = kcpp.local_generate(1.0)
    assert wait_for(lambda: kcpp.generating, 2.0)
    time.sleep(1.2)  # a pop already in flight when the local request started may still land
    paused_at = len(horde.pops)
    local.join(5.0)
    time.sleep(2.0)  # koboldcpp's worker waits 20 s after a local generation ends
    assert len(horde.pops) == paused_at, "popped while a local user was active"


def test_the_hooked_worker_stops_when_koboldcpp_shuts_down(hooked: Any, horde: DevHorde) -> None:
    assert wait_for(lambda: len(horde.pops) >= 1, 10.0)
    hooked.exitcounter = 999
    hooked.thread.join(5.0)
    assert not hooked.thread.is_alive()


# ----------------------------------------------------------- a real koboldcpp tree


def _release_of(tree: Path) -> str:
    text = (tree / "koboldcpp.py").read_text(encoding="utf-8")
    m = re.search(r'^KcppVersion = "([0-9.]+)"', text, re.MULTILINE)
    assert m, "no KcppVersion in koboldcpp.py"
    return m.group(1)


@pytest.fixture
def koboldcpp_src() -> Path:
    src = os.environ.get("KOBOLDCPP_SRC", "")
    if not src:
        pytest.skip("set KOBOLDCPP_SRC to a koboldcpp source tree to check the patch against it")
    tree = Path(src)
    patch = PATCH_DIR / f"koboldcpp-{_release_of(tree)}.patch"
    if not patch.exists():
        pytest.fail(f"no patch for koboldcpp {_release_of(tree)} in {PATCH_DIR}")
    return tree


def _patched_copy(tree: Path, dest: Path) -> Path:
    """``dest`` mirrors ``tree`` by symlinks, with a patched copy of koboldcpp.py."""
    dest.mkdir()
    for entry in tree.iterdir():
        if entry.name != "koboldcpp.py":
            (dest / entry.name).symlink_to(entry)
    shutil.copy2(tree / "koboldcpp.py", dest / "koboldcpp.py")
    patch = PATCH_DIR / f"koboldcpp-{_release_of(tree)}.patch"
    with patch.open("rb") as f:
        subprocess.run(["patch", "-p1", "--quiet"], cwd=dest, stdin=f, check=True)
    return dest


def test_the_patch_applies_to_the_koboldcpp_tree(koboldcpp_src: Path, tmp_path: Path) -> None:
    patch = PATCH_DIR / f"koboldcpp-{_release_of(koboldcpp_src)}.patch"
    with patch.open("rb") as f:
        dry = subprocess.run(
            ["patch", "-p1", "--dry-run"], cwd=koboldcpp_src, stdin=f, capture_output=True
        )
    assert dry.returncode == 0, dry.stdout + dry.stderr
    # each hunk where its header says, as made for this release: no fuzz, no offset
    assert b"fuzz" not in dry.stdout and b"offset" not in dry.stdout, dry.stdout
    check = subprocess.run(
        ["git", "apply", "--check", str(patch)], cwd=koboldcpp_src, capture_output=True
    )
    assert check.returncode == 0, check.stderr
    patched = _patched_copy(koboldcpp_src, tmp_path / "kcpp")
    source = (patched / "koboldcpp.py").read_text(encoding="utf-8")
    compile(source, "koboldcpp.py", "exec")
    original = (koboldcpp_src / "koboldcpp.py").read_text(encoding="utf-8").splitlines()
    added = [
        line for line in patch.read_text(encoding="utf-8").splitlines() if line.startswith("+ ")
    ]
    assert len(added) == 25  # the worker's hand-over (19), the recovery before the load (6)
    assert len(source.splitlines()) == len(original) + len(added)
    # The recovery starts after koboldcpp read its Horde flags, before it loads the model.
    early = source.index("kcpp_hook.start_recovery(sys.modules[__name__], args)")
    assert source.index("maxhordectx = int(args.hordemaxctx)") < early
    assert early < source.index("loadok = load_model(modelname)")


def test_the_patched_trees_worker_without_the_package_never_starts_with_a_local_horde_url(
    koboldcpp_src: Path, tmp_path: Path
) -> None:
    """The patched ``run_horde_worker`` of the real tree, up to koboldcpp's own loop,
    run where the package is not importable with ``AI_HORDE_URL`` at a local Horde:
    one line, and koboldcpp's own loop (which would pop from https://aihorde.net)
    never begins. The loop is a stand-in: nothing here can reach a Horde."""
    source = (_patched_copy(koboldcpp_src, tmp_path / "kcpp") / "koboldcpp.py").read_text(
        encoding="utf-8"
    )
    start = source.index("\ndef run_horde_worker(")
    end = source.index("    epurl = get_my_epurl()\n", start)
    (tmp_path / "head.py").write_text(
        "import os\nimport sys\n"
        "def get_my_epurl():\n    raise SystemExit('koboldcpp own worker: started')\n"
        + source[start:end]
        + "    raise SystemExit('koboldcpp own worker: started')\n",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AI_HORDE_URL")}
    runner = "import head; head.run_horde_worker(None, 'key', 'my-worker', 1, 1)"
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, '.'); {runner}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=dict(env, AI_HORDE_URL="http://127.0.0.1:7001"),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("koboldcpp-horde-chat not installed for this Python (")
    assert result.stdout.count("\n") == 1
    assert "it is not started with AI_HORDE_URL=http://127.0.0.1:7001;" in result.stdout


@pytest.mark.slow
def test_a_patched_koboldcpp_serves_chat_and_text_jobs(
    koboldcpp_src: Path, horde: DevHorde, tmp_path: Path
) -> None:
    model = os.environ.get("KOBOLDCPP_MODEL", "")
    if not model or not (koboldcpp_src / "koboldcpp_default.so").exists():
        pytest.skip("set KOBOLDCPP_MODEL and build koboldcpp_default.so in KOBOLDCPP_SRC")
    patched = _patched_copy(koboldcpp_src, tmp_path / "kcpp")
    api_key = sorted(horde.api_keys)[0]
    env = dict(os.environ, AI_HORDE_URL=horde.url, PYTHONPATH=str(ROOT))
    command = [
        sys.executable, "koboldcpp.py",
        "--model", model,
        "--host", "127.0.0.1", "--port", "0",
        "--contextsize", "2048", "--threads", "2",
        "--hordekey", api_key, "--hordeworkername", WORKER_NAME,
        "--hordegenlen", "48", "--skiplauncher", "--quiet",
    ]  # fmt: skip
    port = _free_port()
    command[command.index("--port") + 1] = str(port)
    log_path = tmp_path / "koboldcpp.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            command, cwd=patched, env=env, stdout=log_file, stderr=subprocess.STDOUT
        )
        try:
            assert wait_for(lambda: len(horde.pops) >= 1, 180.0), log_path.read_text()
            chat = horde.send_chat(
                {"messages": [{"role": "user", "content": "Name one colour."}], "max_tokens": 24}
            )
            text = horde.send_text("The capital of France is", max_length=24)
            assert horde.wait([chat, text], timeout_s=240.0), log_path.read_text()
        finally:
            proc.terminate()
            proc.wait(30)
    assert horde.status(chat)["state"] == "done"
    assert horde.status(text)["state"] == "done"
    assert "chat_jobs" in horde.pops[0]["body"]
    assert "horde-worker-1" in log_path.read_text()


#: koboldcpp's log line for an image its projector decoded (tools/mtmd, 1.116.1).
IMAGE_DECODED = re.compile(r"image decoded \(batch 1/1\) in \d+ ms")


@pytest.fixture
def real_kcpp_with_projector(koboldcpp_src: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A koboldcpp of ``KOBOLDCPP_SRC`` with ``KOBOLDCPP_MODEL`` and a tiny vision
    projector written now (``--mmproj``), on 127.0.0.1; yields (its URL, its log)."""
    model = os.environ.get("KOBOLDCPP_MODEL", "")
    if not model or not (koboldcpp_src / "koboldcpp_default.so").exists():
        pytest.skip("set KOBOLDCPP_MODEL and build koboldcpp_default.so in KOBOLDCPP_SRC")
    try:
        import gguf  # noqa: F401
    except ImportError:
        pytest.skip(
            "the gguf package is not installed (pip install '.[test-gguf]'): it writes the "
            "tiny vision projector this test starts koboldcpp with"
        )
    from tests.integration.tiny_projector import write_tiny_projector

    projector = write_tiny_projector(tmp_path / "tiny-mmproj.gguf")
    patched = _patched_copy(koboldcpp_src, tmp_path / "kcpp")
    port = _free_port()
    command = [
        sys.executable, "koboldcpp.py",
        "--model", model, "--mmproj", str(projector),
        "--host", "127.0.0.1", "--port", str(port),
        "--contextsize", "2048", "--threads", "2", "--skiplauncher", "--quiet",
    ]  # fmt: skip
    log_path = tmp_path / "koboldcpp.log"
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(command, cwd=patched, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            client = KoboldClient(url, connect_timeout_s=2.0)
            assert wait_for(lambda: _answers(client), 180.0), log_path.read_text()
            yield url, log_path
        finally:
            proc.terminate()
            proc.wait(30)


def _answers(client: KoboldClient) -> bool:
    try:
        return client.ready()
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["url", "base64"])
def test_a_real_koboldcpp_with_a_projector_decodes_each_image_job(
    real_kcpp_with_projector: tuple[str, Path], horde: DevHorde, transport: str
) -> None:
    """A ``url`` job (the worker fetches the signed URL without the key) and a
    ``base64`` job (a data URL in the payload, as koboldcpp's own worker declares)
    reach koboldcpp as data URLs, and koboldcpp decodes each one."""
    url, log_path = real_kcpp_with_projector
    info = KoboldClient(url).info()
    assert info.vision, "koboldcpp did not report vision with the projector"
    settings = WorkerSettings(
        api_key=sorted(horde.api_keys)[0],
        worker_name=f"real-kcpp-{transport}",
        model_id=info.model_name,
        backend_max_context_length=info.max_context_length,
        max_length=48,
        horde_url=horde.url,
        kcpp_url=url,
        vision=True,
        image_url_transport=transport == "url",
        local_idle_s=0.0,
    )
    stop = threading.Event()
    caps = BackendCapabilities(vision=True, image_url=transport == "url")
    thread = threading.Thread(
        target=run_worker, args=(settings,), kwargs={"state": WorkerState(settings, stop_event=stop), "caps": caps}, daemon=True
    )
    thread.start()
    try:
        request = horde.send_chat(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is in this picture?"},
                            {"type": "image_url", "image_url": {"url": DEMO_IMAGE_DATA_URL}},
                        ],
                    }
                ],
                "max_tokens": 16,
            },
            best_effort=True,
        )
        assert horde.wait([request], timeout_s=240.0), (horde.status(request), log_path.read_text())
    finally:
        stop.set()
        thread.join(30)
    status = horde.status(request)
    assert status["state"] == "done", status
    assert status["message"]["role"] == "assistant"
    # The job carried the image by the transport the worker declared ...
    served = [p for p in horde.pops if p.get("response", {}).get("id")]
    assert len(served) == 1
    part = served[0]["response"]["payload"]["messages"][0]["content"][1]
    sent = part["image_url"]["url"]
    assert sent.startswith("http://127.0.0.1:" if transport == "url" else "data:image/jpeg;base64,")
    # ... and koboldcpp decoded it.
    assert len(IMAGE_DECODED.findall(log_path.read_text(errors="replace"))) == 1, log_path.read_text()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
