"""The README's first command: the demo judges the worker, case by case.

A case fails for what the worker did wrong (a fault of a job it should have
served, a reply built wrong); what a real model did not do (no tool call, a
reply cut at max_tokens) is a note beside it. Against the scripted koboldcpp
every case must be as expected.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from koboldcpp_horde_chat.demo import cases, command, main, verdict
from koboldcpp_horde_chat.demo.verdict import Verdict, judge
from koboldcpp_horde_chat.devkit import kcpp as kcpp_module
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp, ScriptedReply
from koboldcpp_horde_chat.run import chat as chat_run
from koboldcpp_horde_chat.state.journal_paths import JOURNAL_DIR_ENV


def after_opening(out: str) -> list[str]:
    """The demo's lines after its three-line opening and the blank line below it."""
    lines = out.splitlines()
    assert tuple(lines[:3]) == command.OPENING and lines[3] == "", lines[:4]
    return lines[4:]


def case_line(out: str, name: str) -> str:
    """The result line of the case ``name`` (``[ok  ] name ...``)."""
    found = [line for line in out.splitlines() if re.match(rf"\[(ok  |FAIL|skip)\] {re.escape(name)}  ", line)]
    assert len(found) == 1, out
    return found[0]


def only(*names: str) -> Callable[..., list[cases.DemoCase]]:
    """``demo_cases`` cut to the cases named, for a quick run."""
    every_case = cases.demo_cases
    return lambda *a, **kw: [c for c in every_case(*a, **kw) if c.name in names]


def test_the_opening_says_what_a_horde_a_job_and_a_fault_are() -> None:
    assert len(command.OPENING) == 3
    horde, job, fault = command.OPENING
    assert "AI Horde: the queue where clients leave requests and workers take them" in horde
    assert "Each request becomes a job" in job
    assert "faults, telling the Horde why" in fault


def test_the_scripted_demo_passes_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scripted", "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    rest = after_opening(out)
    assert rest[0].startswith("--scripted: using the devkit's SCRIPTED koboldcpp at http://127.0.0.1:")
    assert "FAIL" not in out and "model:" not in out and "[skip]" not in out
    assert out.rstrip().endswith("Demo passed: the worker did right in all 10 cases.")
    for case in ("plain chat", "tool call", "json_object", "does not fit", "streamed reply", "text job", "image"):
        assert case_line(out, case).startswith("[ok  ]")
    assert "submitted: finish_reason=tool_calls, tool_calls=['get_weather']" in case_line(out, "tool call")
    assert case_line(out, "does not fit").endswith("faulted with prompt_overflow, as it must")


def test_the_expected_prompt_overflow_warning_is_announced_before_it(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(command, "demo_cases", only("does not fit"))
    assert main(["--scripted", "--timeout", "60"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index(
        "       The next WARNING is expected: this conversation is longer than the model's context, "
        "and the worker must fault it with prompt_overflow."
    )
    assert lines[at + 1].startswith("[ok  ] does not fit ")
    # and pointed at after the case
    assert lines[at + 2] == "       the 1 WARNING line above: the expected prompt_overflow fault"


def test_a_model_that_does_not_call_a_tool_is_not_a_worker_failure(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real koboldcpp whose model answers in text, cut at max_tokens, under a required
    tool_choice: the worker submitted the reply it got, which is right; the case says what
    the model did, apart, and the demo passes."""
    monkeypatch.setattr(command, "demo_cases", only("tool call", "plain chat"))
    with ScriptedKoboldcpp() as kcpp:
        kcpp.script(lambda body: ScriptedReply(text="The weather in", finish="length") if body.get("tools") else None)
        url = kcpp.url
        assert main(["--kcpp-url", url, "--timeout", "60"]) == 0
    out = capsys.readouterr().out
    assert after_opening(out)[0] == f"Using the koboldcpp at {url}."
    lines = out.splitlines()
    at = lines.index(case_line(out, "tool call"))
    assert lines[at].startswith("[ok  ] tool call                submitted: finish_reason=length")
    assert lines[at + 1] == (
        "       model: the model did not call a tool (small models often don't); "
        "its reply was cut at max_tokens 128 (finish_reason=length)"
    )
    assert out.rstrip().endswith(
        "Demo passed: the worker did right in all 2 cases. (1 model note: what the model did, not the worker)"
    )


def test_a_call_to_a_function_not_offered_is_faulted_with_reply_refused_and_passes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model calls GetWeather, which the request does not offer: the Horde refuses each
    reply and the worker faults each job with reply_refused, as it must. Against a real
    koboldcpp that is a model note; the request ending faulted is not the worker's doing."""
    monkeypatch.setattr(command, "demo_cases", only("tool call"))
    with ScriptedKoboldcpp() as kcpp:
        kcpp.script(lambda body: ScriptedReply(tool_calls=[{"name": "GetWeather", "arguments": {"city": "Paris"}}]))
        assert main(["--kcpp-url", kcpp.url, "--timeout", "60"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = lines.index(case_line(out, "tool call"))
    assert lines[at] == (
        "[ok  ] tool call                faulted 2 times (reply_refused); the request ended faulted"
    )
    assert lines[at + 1] == (
        "       model: the Horde refused the model's reply (message.tool_calls[0] calls 'GetWeather', "
        "not a function of the request); the worker faulted it with reply_refused, as it must (2 times)"
    )
    # The WARNING lines (a refusal and a reply_refused fault for each job) are announced
    # before the case and pointed at after it.
    assert lines[at - 1] == "       " + cases.MODEL_REFUSAL_WARNINGS
    assert cases.MODEL_REFUSAL_WARNINGS.startswith("Two WARNING lines may follow, and are expected")
    assert lines[at + 2] == (
        "       the 4 WARNING lines above: expected, from what the model did (model: above)"
    )
    assert "Demo passed" in out



def test_a_case_needing_tools_the_worker_withdrew_is_skipped_as_a_model_note(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the Horde refused the model's tool calls 3 times (twice in the first
    case, whose request the dev Horde then faults, once in the next) the worker
    withdraws tools for a while: the request that needs them would wait, not be
    served, so the demo cancels it and says why, instead of failing every case
    after it."""
    monkeypatch.setattr(command, "demo_cases", only("tool call", "tool-history follow-up"))
    with ScriptedKoboldcpp() as kcpp:
        kcpp.script(lambda body: ScriptedReply(tool_calls=[{"name": "GetWeather", "arguments": {"city": "Paris"}}]))
        assert main(["--kcpp-url", kcpp.url, "--timeout", "60"]) == 0
    out = capsys.readouterr().out
    assert (
        "[skip] tool-history follow-up   model: the worker withdrew tools for a while after "
        "the Horde refused the model's replies for it: the request was cancelled"
    ) in out.splitlines()
    assert "Demo passed" in out and "skipped: tool-history follow-up" in out

NAMELESS_CALL = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "koboldcpp/scripted-model",
    "usage": {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52},
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "call_12345", "type": "function", "function": {"arguments": "{}"}}],
            },
            "finish_reason": "tool_calls",
        }
    ],
}


@pytest.mark.parametrize("scripted", [False, True])
def test_a_tool_call_without_a_name_is_faulted_and_blamed_on_the_model_only_against_a_real_koboldcpp(
    scripted: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen on SmolLM2-135M: koboldcpp returned a tool call without a function name. No
    submit can carry it, so the worker faults the job (without a reason, as for a failed
    generation) and the request is served on its next attempt. Against a real koboldcpp
    that is a model note; against the scripted one, a fault fails the case."""

    class NamelessOnce(ScriptedKoboldcpp):
        def start(self) -> ScriptedKoboldcpp:
            self.inject("chat", (200, NAMELESS_CALL))
            return super().start()

    monkeypatch.setattr(command, "demo_cases", only("tool call"))
    if scripted:
        monkeypatch.setattr(kcpp_module, "ScriptedKoboldcpp", NamelessOnce)
        assert main(["--scripted", "--timeout", "60"]) == 1
    else:
        with NamelessOnce() as kcpp:
            assert main(["--kcpp-url", kcpp.url, "--timeout", "60"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = lines.index(case_line(out, "tool call"))
    mark = "FAIL" if scripted else "ok  "
    assert lines[at].startswith(f"[{mark}] tool call                faulted (no reason), then submitted: ")
    note = (
        "the model wrote a reply no submit can carry (tool_calls[0].function.name is missing); "
        "the worker faulted the job, as it must"
    )
    assert lines[at + 1] == ("       not as expected: " if scripted else "       model: ") + note


def test_a_worker_fault_fails_the_scripted_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """koboldcpp answers one chat request with an error: the worker faults that job and the
    request is served on its second attempt. Against the scripted koboldcpp any fault of a
    job the worker should have served fails the demo (it passed before: the request ended done)."""

    class FailingOnce(ScriptedKoboldcpp):
        def start(self) -> ScriptedKoboldcpp:
            self.inject("chat", (500, {"detail": {"msg": "scripted failure", "type": "server_error"}}))
            return super().start()

    monkeypatch.setattr(kcpp_module, "ScriptedKoboldcpp", FailingOnce)
    monkeypatch.setattr(command, "demo_cases", only("plain chat"))
    assert main(["--scripted", "--timeout", "60"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = lines.index(case_line(out, "plain chat"))
    assert lines[at].startswith("[FAIL] plain chat               faulted (no reason), then submitted: ")
    assert lines[at + 1] == (
        "       worker: a job was faulted instead of served "
        "(generation failed: /v1/chat/completions: HTTP 500 scripted failure)"
    )
    assert out.rstrip().endswith("Demo FAILED: plain chat.")


def test_a_reply_the_worker_built_wrong_fails_even_against_a_real_koboldcpp(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit naming another model than the assigned one is the worker's mistake, not the
    model's: its refusal and reply_refused fault fail the case whatever the koboldcpp."""
    built = chat_run.chat_submit
    monkeypatch.setattr(
        chat_run, "chat_submit", lambda *a, **kw: {**built(*a, **kw), "model_id": "koboldcpp/other"}
    )
    monkeypatch.setattr(command, "demo_cases", only("plain chat"))
    with ScriptedKoboldcpp() as kcpp:
        assert main(["--kcpp-url", kcpp.url, "--timeout", "60"]) == 1
    out = capsys.readouterr().out
    line = case_line(out, "plain chat")
    assert line.startswith("[FAIL] plain chat               faulted 2 times (reply_refused)")
    assert "reply was refused (ChatModelMismatch: model_id 'koboldcpp/other' is not the assigned model" in out
    assert out.rstrip().endswith("Demo FAILED: plain chat.")


def test_a_skipped_case_is_named_with_why(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A koboldcpp without vision: the image case is not sent, and says so."""
    monkeypatch.setattr(command, "demo_cases", only("plain chat", "image"))
    with ScriptedKoboldcpp(vision=False) as kcpp:
        assert main(["--kcpp-url", kcpp.url, "--timeout", "60"]) == 0
    out = capsys.readouterr().out
    assert case_line(out, "image") == (
        "[skip] image                    koboldcpp reports no vision (start it with --mmproj to "
        "load a vision projector and this case runs)"
    )
    assert out.rstrip().endswith("Demo passed: the worker did right in all 1 cases. (skipped: image)")


def test_an_explicit_koboldcpp_url_that_does_not_answer_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--kcpp-url", "http://127.0.0.1:9"]) == 2
    assert "--scripted" in capsys.readouterr().out


def test_the_first_line_names_the_url_it_checked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --kcpp-url the demo checks KCPP_URL; the line names that URL, then the
    scripted one it uses instead."""
    monkeypatch.setattr(command, "demo_cases", lambda *a, **kw: [])  # no requests: a quick run
    monkeypatch.setenv("KCPP_URL", "http://127.0.0.1:9/")
    assert main(["--timeout", "10"]) == 0
    first = after_opening(capsys.readouterr().out)[0]
    assert re.fullmatch(
        r"No koboldcpp answers at http://127\.0\.0\.1:9: using the devkit's SCRIPTED koboldcpp "
        r"at http://127\.0\.0\.1:\d+ \(canned replies, real koboldcpp response shapes\)\.",
        first,
    ), first


def test_with_scripted_the_first_line_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command, "demo_cases", lambda *a, **kw: [])
    assert main(["--scripted", "--timeout", "10"]) == 0
    first = after_opening(capsys.readouterr().out)[0]
    assert first.startswith("--scripted: using the devkit's SCRIPTED koboldcpp at http://127.0.0.1:")


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_kcpp_url_falls_back_to_the_default(
    value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command, "demo_cases", lambda *a, **kw: [])
    monkeypatch.setattr(command, "DEFAULT_KCPP_URL", "http://127.0.0.1:9")  # nothing answers there
    monkeypatch.setenv("KCPP_URL", value)
    assert main(["--timeout", "10"]) == 0
    assert after_opening(capsys.readouterr().out)[0].startswith("No koboldcpp answers at http://127.0.0.1:9: ")


def test_a_bad_kcpp_url_is_named_by_its_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KCPP_URL", "localhost:5001")
    assert main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("KCPP_URL needs an http:// or https:// URL, not 'localhost:5001'")
    assert "--kcpp-url" not in out


def test_results_show_null_and_cut_pieces_with_an_ellipsis() -> None:
    case = cases.DemoCase("tool call", "chat", {})
    status = {
        "done": True,
        "finish_reason": "tool_calls",
        "message": {
            "role": "assistant",
            "content": None,
            "reasoning_content": "r" * 41,
            "tool_calls": [{"function": {"name": "get_weather", "arguments": "{}"}}],
        },
        "stream": [{"content": "short"}, {"content": "p" * 30}],
    }
    line = verdict._describe(case, status)
    assert "content=null" in line and "'None'" not in line
    assert f"reasoning='{'r' * 39}\u2026'" in line
    assert f"arrived in 2 progress posts: ['short', '{'p' * 23}\u2026']" in line
    text = cases.DemoCase("text job", "text", {})
    assert verdict._describe(text, {"generation": "g" * 60}) == f"generation='{'g' * 60}'"
    assert verdict._describe(text, {"generation": "g" * 61}) == f"generation='{'g' * 59}\u2026'"


def test_every_demo_flag_has_help_text() -> None:
    parser = command.build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in flags} == {"kcpp_url", "scripted", "kcpp_password", "timeout", "log_level"}
    for action in flags:
        assert action.help and len(action.help) > 10, action.option_strings


def test_the_demo_writes_nothing_to_the_users_state_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo's worker keeps its job journal in a temporary folder it removes at the end,
    never in the user's state directory (a real run would leave a jobs-demo-worker file there)."""
    home, state, temp = tmp_path / "home", tmp_path / "state", tmp_path / "tmp"
    for folder in (home, state, temp):
        folder.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    monkeypatch.delenv(JOURNAL_DIR_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    # one chat job: the journal is written while a job is in hand
    monkeypatch.setattr(command, "demo_cases", only("plain chat"))
    assert main(["--scripted", "--timeout", "60"]) == 0
    assert "Demo passed: " in capsys.readouterr().out
    assert list(home.rglob("*")) == []
    assert list(state.rglob("*")) == []
    assert list(temp.iterdir()) == []  # the demo's own temporary folder is gone too


def ledger_entry(action: str, body: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"job_id": "job-1", "request_id": "r", "kind": "chat", "action": action, "rc": None,
            "fault_reason": None, "body": body, **extra}


SUBMIT = {"id": "job-1", "message": {"role": "assistant", "content": "Blue."}, "finish_reason": "stop",
          "model_id": "koboldcpp/m", "state": "ok"}
DONE = {"done": True, "faulted": False, "message": {"role": "assistant", "content": "Blue."},
        "finish_reason": "stop", "job_ids": ["job-1"], "refusals": []}


@pytest.mark.parametrize(
    ("ledger", "status", "problem"),
    [
        ([ledger_entry("expired")], {**DONE, "done": False},
         "job job-1 was neither submitted nor faulted before its lease ran out"),
        ([ledger_entry("submitted", SUBMIT), ledger_entry("duplicate", SUBMIT, rc="DuplicateGen")], DONE,
         "job job-1 was submitted again after it ended (DuplicateGen)"),
        ([ledger_entry("submitted", {**SUBMIT, "finish_reason": "eos_token"})], DONE,
         "job job-1: finish_reason 'eos_token' is not one of stop, length, content_filter, tool_calls"),
        ([ledger_entry("refused", SUBMIT, rc="ChatSubmitNonconformant"), ledger_entry("faulted", {})],
         {**DONE, "done": False, "refusals": [{"job_id": "job-1", "rc": "ChatSubmitNonconformant", "message": "x"}]},
         "job job-1 was not faulted with reply_refused after its refusal"),
        ([ledger_entry("submitted", SUBMIT)], {**DONE, "stream": []},
         "the streamed reply was submitted without a progress post"),
    ],
)
def test_the_verdict_names_what_the_worker_did_wrong(
    ledger: list[dict[str, Any]], status: dict[str, Any], problem: str
) -> None:
    case = cases.DemoCase("plain chat", "chat", {"messages": [], "stream": True})
    verdict = judge(case, status, ledger, {"job-1": "koboldcpp/m"}, finished=True)
    assert not verdict.worker_ok and not verdict.passed(scripted=False)
    assert problem in verdict.problems, verdict.problems


def test_a_reply_submitted_once_in_the_seeds_shape_is_the_worker_doing_right() -> None:
    case = cases.DemoCase("plain chat", "chat", {"messages": []}, cases._hope_reply)
    verdict = judge(case, DONE, [ledger_entry("submitted", SUBMIT)], {"job-1": "koboldcpp/m"}, finished=True)
    assert verdict == Verdict(True, "submitted", [], [])


# --- Ctrl-C ------------------------------------------------------------------------------


def test_ctrl_c_in_the_demo_ends_it_in_one_line_with_exit_code_130() -> None:
    """SIGINT to a running demo (as Ctrl-C sends it): no traceback, one line saying it
    stopped, exit code 130, and the process ends promptly (nothing it started keeps it)."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "koboldcpp_horde_chat", "demo", "--scripted"],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None and proc.stderr is not None
    out: list[str] = []
    started = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line.rstrip("\n"))
            if line.startswith("[ok  ] plain chat"):
                started.set()  # the worker runs and serves

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(60), "\n".join(out)
        proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        code = proc.wait(30)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    reader.join(5)
    err = proc.stderr.read()
    assert code == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert out[-1] == command.INTERRUPTED, out
    assert not any(line.startswith("Demo passed") or line.startswith("Demo FAILED") for line in out)
    assert took < 15, took  # the worker, the dev Horde and the scripted koboldcpp stopped


def test_after_ctrl_c_the_demo_has_stopped_its_worker_and_both_servers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process: a KeyboardInterrupt while a case waits returns 130 with one line,
    and the dev Horde and scripted koboldcpp it started no longer answer."""
    import socket
    import threading
    from urllib.parse import urlsplit

    monkeypatch.setattr(command, "demo_cases", only("plain chat"))

    def interrupted(*args: Any) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "_wait", interrupted)
    assert main(["--scripted", "--timeout", "60"]) == 130
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == command.INTERRUPTED
    urls = re.findall(r"(?:koboldcpp at|Dev Horde at) (http://127\.0\.0\.1:\d+)", out)
    assert len(urls) == 2, out
    for url in urls:
        with pytest.raises(OSError):
            socket.create_connection((urlsplit(url).hostname, urlsplit(url).port), timeout=2).close()
    assert not [t for t in threading.enumerate() if t.name == "demo-worker"]


def test_ctrl_c_whose_keyboardinterrupt_python_dropped_still_ends_the_demo(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process: a Ctrl-C whose KeyboardInterrupt is lost (raised inside a finalizer,
    which Python reports and drops; seen on a loaded machine) still ends the demo with
    130 and its one line, before the next case."""
    import os
    import signal

    monkeypatch.setattr(command, "demo_cases", only("plain chat", "tool call"))
    real_judge = command.judge

    def judge_then_ctrl_c_lost(*args: Any, **kwargs: Any) -> Any:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
        except KeyboardInterrupt:
            pass  # as a finalizer would drop it
        return real_judge(*args, **kwargs)

    monkeypatch.setattr(command, "judge", judge_then_ctrl_c_lost)
    assert main(["--scripted", "--timeout", "60"]) == 130
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-1] == command.INTERRUPTED
    assert not any(line.startswith("[ok  ] tool call") for line in lines), lines
