"""How the real Horde is set up, without starting it (these run in every test run)."""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from bench.harness import real_horde


def _src(tmp_path: Path, requirements: str) -> Path:
    (tmp_path / "requirements.txt").write_text(requirements, encoding="utf-8")
    return tmp_path


def test_the_requirements_name_pypis_patreon_for_the_git_url_and_pin_chardet(tmp_path: Path) -> None:
    """The Horde's requirements.txt names patreon-python by a git URL, which cannot
    be fetched here: PyPI's ``patreon`` is the same library."""
    src = _src(tmp_path, "# a comment\nFlask~=2.2.2\n\ngit+https://github.com/Patreon/patreon-python.git\nnumpy\n")
    assert real_horde._requirements(src).splitlines() == ["Flask~=2.2.2", "patreon", "numpy", "chardet<6"]


def test_an_unknown_git_requirement_is_said_not_skipped(tmp_path: Path) -> None:
    src = _src(tmp_path, "git+https://example.invalid/some/thing.git\n")
    with pytest.raises(real_horde.RealHordeError, match="cannot be fetched"):
        real_horde._requirements(src)


def test_the_model_reference_serves_the_text_models_and_no_image_model() -> None:
    handler = type("Reference", (real_horde._Reference,),
                   {"text_models": json.dumps({"koboldcpp/x": {"parameters": 7}}).encode()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert requests.get(url + "/text.json", timeout=5).json() == {"koboldcpp/x": {"parameters": 7}}
        assert requests.get(url + "/compvis.json", timeout=5).json() == {}
    finally:
        server.shutdown()
        server.server_close()


def test_a_source_without_the_horde_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(real_horde.RealHordeError, match="holds no AI Horde source"):
        real_horde.RealHorde(tmp_path).start()


def test_the_source_comes_from_ai_horde_src(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(real_horde.SRC_ENV, raising=False)
    assert real_horde.source_from_env() is None
    monkeypatch.setenv(real_horde.SRC_ENV, "/somewhere/AI-Horde")
    assert real_horde.source_from_env() == Path("/somewhere/AI-Horde")
