"""The pure core does no I/O: no network or thread modules, no sleeping, no upward imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "koboldcpp_horde_chat"
PURE_CORE = (
    "horde/declaration",
    "horde/pop",
    "translate/submits",
    "horde/progress",
    "horde/codes",
    "koboldcpp/answers",
    "translate/bodies",
    "koboldcpp/reasoning",
    "translate/chat_stream",
    "koboldcpp/sse",
    "translate/fit",
    "translate/images",
    "state/life",
    "service/backoff",
    "state/guard",
    "state/status",
    "state/skipped",
    "state/lease_fit",
    "state/lease_figures",
    "state/probes",
    "state/refaults",
    "state/submit_answers",
    "state/journal_rules",
    "jsonbody",
)
FORBIDDEN_MODULES = {"requests", "urllib", "urllib3", "socket", "http", "threading"}
# What a core module may import from the package besides the core itself.
FOUNDATION = {"settings", "errors", "jsonbody"}
ALLOWED = {name.replace("/", ".") for name in PURE_CORE} | FOUNDATION

EXISTING = [name for name in PURE_CORE if (PACKAGE / f"{name}.py").exists()]


def _resolve(module: str, level: int, importer: str) -> str:
    """The dotted name (under the package) a relative import in ``importer`` names."""
    base = importer.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([module] if module else [])])


def violations(source: str, importer: str = "core") -> list[str]:
    found: list[str] = []
    sleep_aliases: set[str] = set()
    time_aliases: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in FORBIDDEN_MODULES:
                    found.append(f"import {alias.name}")
                if top == "time":
                    time_aliases.add(alias.asname or "time")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            top = module.split(".")[0]
            if node.level == 0 and top in FORBIDDEN_MODULES:
                found.append(f"from {module} import ...")
            if node.level > 0:
                named = _resolve(module, node.level, importer)
                if named in ALLOWED:
                    continue
                if module:  # from .mod import name: the module is what is imported
                    found.append(f"from {named} import ...")
                    continue
                targets = [".".join(filter(None, [named, a.name])) for a in node.names]
                found.extend(f"from {t} import ..." for t in targets if t not in ALLOWED)
            if node.level == 0 and module == "time":
                for alias in node.names:
                    if alias.name == "sleep":
                        found.append("from time import sleep")
                        sleep_aliases.add(alias.asname or "sleep")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "__import__":
                found.append("__import__()")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "sleep"
                and isinstance(func.value, ast.Name)
                and func.value.id in time_aliases
            ):
                found.append("time.sleep()")
            if isinstance(func, ast.Name) and func.id in sleep_aliases:
                found.append("sleep()")
    return found


def test_the_core_modules_of_this_package_exist() -> None:
    assert EXISTING == list(PURE_CORE)


@pytest.mark.parametrize("name", EXISTING)
def test_a_pure_core_module_does_no_io(name: str) -> None:
    source = (PACKAGE / f"{name}.py").read_text(encoding="utf-8")
    assert violations(source, name.replace("/", ".")) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import requests", ["import requests"]),
        ("import urllib.parse", ["import urllib.parse"]),
        ("from http import HTTPStatus", ["from http import ..."]),
        ("import socket as s", ["import socket"]),
        ("from threading import Event", ["from threading import ..."]),
        ("import time\ntime.sleep(1)", ["time.sleep()"]),
        ("import time as t\nt.sleep(1)", ["time.sleep()"]),
        ("from time import sleep as nap\nnap(1)", ["from time import sleep", "sleep()"]),
        ("from .client import HordeClient", ["from horde.client import ..."]),
        ("from ..koboldcpp import client", ["from koboldcpp import ..."]),
        ("from .. import netfail", ["from netfail import ..."]),
        ("from ..service.loop import Worker", ["from service.loop import ..."]),
        ("import time\nx = time.monotonic()", []),
        ("from ..errors import ReplyError\nimport json", []),
        ("from .pop import ChatJob\nfrom ..koboldcpp.sse import SSEDecoder", []),
    ],
)
def test_the_checker_itself_catches_each_kind_of_violation(
    source: str, expected: list[str]
) -> None:
    assert violations(source, "horde.declaration") == expected
