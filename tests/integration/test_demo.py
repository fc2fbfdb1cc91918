"""The README's first command: the demo reaches every request's expected end."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from koboldcpp_horde_chat import demo
from koboldcpp_horde_chat.demo import main
from koboldcpp_horde_chat.journal import JOURNAL_DIR_ENV


def test_the_scripted_demo_passes_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scripted", "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--scripted: using the devkit's SCRIPTED koboldcpp at http://127.0.0.1:")
    assert "FAIL" not in out and "Demo passed." in out
    for case in ("plain chat", "tool call", "json_object", "does not fit", "streamed reply", "text job", "image"):
        assert case in out


def test_an_explicit_koboldcpp_url_that_does_not_answer_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--kcpp-url", "http://127.0.0.1:9"]) == 2
    assert "--scripted" in capsys.readouterr().out


def test_the_first_line_names_the_url_it_checked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --kcpp-url the demo checks KCPP_URL; the line names that URL, then the
    scripted one it uses instead."""
    monkeypatch.setattr(demo, "demo_cases", lambda *a, **kw: [])  # no requests: a quick run
    monkeypatch.setenv("KCPP_URL", "http://127.0.0.1:9/")
    assert main(["--timeout", "10"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert re.fullmatch(
        r"No koboldcpp answers at http://127\.0\.0\.1:9: using the devkit's SCRIPTED koboldcpp "
        r"at http://127\.0\.0\.1:\d+ \(canned replies, real koboldcpp response shapes\)\.",
        first,
    ), first


def test_with_scripted_the_first_line_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "demo_cases", lambda *a, **kw: [])
    assert main(["--scripted", "--timeout", "10"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("--scripted: using the devkit's SCRIPTED koboldcpp at http://127.0.0.1:")


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_kcpp_url_falls_back_to_the_default(
    value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "demo_cases", lambda *a, **kw: [])
    monkeypatch.setattr(demo, "DEFAULT_KCPP_URL", "http://127.0.0.1:9")  # nothing answers there
    monkeypatch.setenv("KCPP_URL", value)
    assert main(["--timeout", "10"]) == 0
    assert capsys.readouterr().out.startswith("No koboldcpp answers at http://127.0.0.1:9: ")


def test_a_bad_kcpp_url_is_named_by_its_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KCPP_URL", "localhost:5001")
    assert main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("KCPP_URL needs an http:// or https:// URL, not 'localhost:5001'")
    assert "--kcpp-url" not in out


def test_results_show_null_and_cut_pieces_with_an_ellipsis() -> None:
    case = demo.DemoCase("tool call", "chat", {}, "done", lambda s: True)
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
    line = demo._describe(case, status)
    assert "content=null" in line and "'None'" not in line
    assert f"reasoning='{'r' * 39}\u2026'" in line
    assert f"arrived in 2 progress posts: ['short', '{'p' * 23}\u2026']" in line
    text = demo.DemoCase("text job", "text", {}, "done", lambda s: True)
    assert demo._describe(text, {"generation": "g" * 60}) == f"generation='{'g' * 60}'"
    assert demo._describe(text, {"generation": "g" * 61}) == f"generation='{'g' * 59}\u2026'"


def test_every_demo_flag_has_help_text() -> None:
    parser = demo.build_parser()
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
    every_case = demo.demo_cases
    monkeypatch.setattr(  # one chat job: the journal is written while a job is in hand
        demo, "demo_cases", lambda *a, **kw: [c for c in every_case(*a, **kw) if c.name == "plain chat"]
    )
    assert main(["--scripted", "--timeout", "60"]) == 0
    assert "Demo passed." in capsys.readouterr().out
    assert list(home.rglob("*")) == []
    assert list(state.rglob("*")) == []
    assert list(temp.iterdir()) == []  # the demo's own temporary folder is gone too
