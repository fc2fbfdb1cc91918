"""The README's first command: the demo reaches every request's expected end."""

from __future__ import annotations

import pytest

from koboldcpp_horde_chat.demo import main


def test_the_scripted_demo_passes_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scripted", "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    assert "SCRIPTED koboldcpp" in out
    assert "FAIL" not in out and "Demo passed." in out
    for case in ("plain chat", "tool call", "json_object", "does not fit", "streamed reply", "text job", "image"):
        assert case in out


def test_an_explicit_koboldcpp_url_that_does_not_answer_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--kcpp-url", "http://127.0.0.1:9"]) == 2
    assert "--scripted" in capsys.readouterr().out
