"""The worker against koboldcpp as it is: its --genlimit, its 20 % cut, its batching.

Against the dev Horde and the scripted koboldcpp, which cuts and batches as
koboldcpp 1.116.1 does (``devkit/kcpp.py``):

* ``--genlimit``: koboldcpp stops every generation there and reports a normal
  ``length``; inside koboldcpp the worker declares and budgets at most it, so a
  reply cut there is submitted with ``length``, not faulted as aborted;
* a job whose context is smaller than koboldcpp's keeps its whole budget:
  koboldcpp would cut ``max_length`` 420 to 400 within a 500-token context;
* with batching an abort by genkey stops nothing: at a stop whose grace runs
  out the worker hangs up its generation requests, so both jobs of two slots
  are faulted and the process exits within the grace + 2 s.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from koboldcpp_horde_chat.devkit.horde import DevHorde
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply
from koboldcpp_horde_chat.hosts import inside_kcpp as kcpp_hook

from .conftest import API_KEY, RunningWorker
from .test_kcpp_hook_e2e import WORKER_NAME, stand_in_koboldcpp

ROOT = Path(__file__).resolve().parents[2]
STORY = [{"role": "user", "content": "Tell me a long story."}]
FINAL = ("submitted", "faulted", "cancelled", "expired")


def until(condition: Callable[[], bool], timeout_s: float = 15.0, why: str = "timed out") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, why
        time.sleep(0.02)


# --- --genlimit, inside koboldcpp ---------------------------------------------------------


@pytest.fixture
def hooked_with_genlimit(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """The hook in a worker thread of a koboldcpp started with ``--genlimit 50``."""
    monkeypatch.setenv("AI_HORDE_URL", horde.url)
    module = stand_in_koboldcpp(kcpp)
    module.args.genlimit = kcpp.genlimit
    api_key = sorted(horde.api_keys)[0]
    module.args.hordekey = api_key
    thread = threading.Thread(
        target=kcpp_hook.run_horde_worker,
        args=(module, module.args, api_key, WORKER_NAME, 1, 1),
        daemon=True,
    )
    thread.start()
    yield module
    module.exitcounter = 999
    thread.join(10.0)
    assert not thread.is_alive()


@pytest.mark.parametrize("kcpp", [{"genlimit": 50}], indirect=True)
def test_inside_koboldcpp_a_reply_cut_at_its_genlimit_is_submitted_as_length(
    hooked_with_genlimit: Any, horde: DevHorde, kcpp: ScriptedKoboldcpp
) -> None:
    served = horde.send_chat({"messages": STORY})  # max_length: the declared limit
    too_long = horde.send_chat({"messages": STORY, "max_tokens": 200})
    assert horde.wait([served], timeout_s=30.0), horde.status(served)
    status = horde.status(served)
    assert status["state"] == "done", status
    assert (status["finish_reason"], status["completion_tokens"]) == ("length", 50)
    pop = horde.pops[0]["body"]
    assert pop["max_length"] == 50 and pop["chat_limits"]["max_length"] == 50  # --hordegenlen 512
    # A client asking for more than koboldcpp would generate is left to other workers.
    assert horde.status(too_long)["state"] == "waiting"
    assert [g["completion_tokens"] for g in kcpp.generations] == [50]


# --- a job's own context, smaller than koboldcpp's ------------------------------------------


def test_a_chat_job_with_a_small_context_gets_its_whole_max_length(
    start_worker: Callable[..., RunningWorker], horde: DevHorde, kcpp: ScriptedKoboldcpp
) -> None:
    start_worker()
    chat = horde.send_chat({"messages": STORY, "max_tokens": 420, "max_context_length": 500})
    assert horde.wait([chat], timeout_s=30.0)
    status = horde.status(chat)
    assert status["state"] == "done", status
    assert (status["finish_reason"], status["completion_tokens"]) == ("length", 420)
    (sent,) = [r["body"] for r in kcpp.requests if r["path"] == "/v1/chat/completions"]
    assert (sent["max_tokens"], sent["max_context_length"]) == (420, 524)


def test_a_text_job_goes_to_koboldcpp_with_its_own_context(
    start_worker: Callable[..., RunningWorker], horde: DevHorde, kcpp: ScriptedKoboldcpp
) -> None:
    """A text prompt is a raw string koboldcpp trims to its context: sent as it came."""
    start_worker()
    text = horde.send_text("Once upon a time", max_length=420, max_context_length=500)
    assert horde.wait([text], timeout_s=30.0)
    (sent,) = [r["body"] for r in kcpp.requests if r["path"] == "/api/v1/generate"]
    assert (sent["max_length"], sent["max_context_length"]) == (420, 500)


# --- a stop with batched generations ---------------------------------------------------------


def batched_worker(horde: DevHorde, kcpp: ScriptedKoboldcpp, tmp_path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "koboldcpp_horde_chat",
            "--hordekey", API_KEY,
            "--hordeworkername", "batching-worker",
            "--horde-url", horde.url,
            "--kcpp-url", kcpp.url,
            "--hordegenlen", "512",
            "--parallelrequests", "2",
            # koboldcpp does not batch a request with reasoning_effort (koboldcpp.py L2372)
            "--chat-withhold", "reasoning_effort",
            "--stop-grace", "1",
            "--journal-dir", str(tmp_path / "state"),
            "--log-level", "INFO",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("kcpp", [{"parallel_requests": 2, "token_delay_s": 0.05}], indirect=True)
@pytest.mark.parametrize("second", ["text", "streamed chat"])
def test_a_stop_hangs_up_batched_generations_and_faults_both_jobs_in_time(
    horde: DevHorde, kcpp: ScriptedKoboldcpp, tmp_path: Path, second: str
) -> None:
    kcpp.script(lambda body: ScriptedReply(text="sky " * 400))  # 400 tokens, 20 s
    first = horde.send_chat({"messages": STORY}, best_effort=True)
    if second == "text":
        other = horde.send_text("Once upon a time", max_length=400)
    else:
        other = horde.send_chat({"messages": STORY, "stream": True}, best_effort=True)
    proc = batched_worker(horde, kcpp, tmp_path)
    try:
        until(lambda: kcpp.running == 2, 20, "the two jobs were not generated together")
        assert not kcpp.generating  # batched: koboldcpp's model lock is free
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = proc.wait(10)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=10)
    assert code == 0, err[-3000:]
    assert took < 1 + 2, took  # --stop-grace 1, + 2 s
    job_ids = [horde.status(rid)["job_ids"][0] for rid in (first, other)]
    final = [(e["job_id"], e["action"]) for e in horde.ledger if e["action"] in FINAL]
    assert sorted(final) == sorted((job_id, "faulted") for job_id in job_ids), horde.ledger
    # The abort by genkey was answered but stopped nothing (batched, as in koboldcpp) ...
    genkeys = {r["body"]["genkey"] for r in kcpp.requests if r["path"] != "/api/extra/abort"
               and isinstance(r["body"], dict) and "genkey" in r["body"]}
    assert set(kcpp.aborts) <= genkeys and kcpp.aborts
    # ... the hang-up ended the streamed one; a whole one runs on inside koboldcpp.
    if second == "streamed chat":
        until(lambda: any(g["client_gone"] for g in kcpp.generations), 2)
    assert not any(g["aborted"] and not g["client_gone"] for g in kcpp.generations)
