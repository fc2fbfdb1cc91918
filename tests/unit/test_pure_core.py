"""The pure core does no I/O: no network or thread modules, no sleeping, no upward imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "koboldcpp_horde_chat"
PURE_CORE = (
    "declaration",
    "jobs",
    "fit",
    "reasoning",
    "reply",
    "stream",
    "progress",
    "sse",
    "backoff",
    "guard",
    "images",
    "status",
    "jsonbody",
    "joblife",
)
FORBIDDEN_MODULES = {"requests", "urllib", "urllib3", "socket", "http", "threading"}
# Modules above the core: I/O edges, orchestration and hosts.
UPPER_LAYERS = {
    "horde", "backend", "fetch", "netfail", "journal", "worker", "manners", "state", "runs", "submit",
    "chat_run", "text_run", "streamed", "kcpp_hook", "cli", "standalone", "demo", "__main__",
    "devkit", "hosting",
}

EXISTING = [name for name in PURE_CORE if (PACKAGE / f"{name}.py").exists()]


def violations(source: str) -> list[str]:
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
                targets = [module.split(".")[0]] if module else [a.name for a in node.names]
                found.extend(f"from .{t} import ..." for t in targets if t in UPPER_LAYERS)
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
    assert {"declaration", "jobs", "fit", "reasoning", "reply"} <= set(EXISTING)


@pytest.mark.parametrize("name", EXISTING)
def test_a_pure_core_module_does_no_io(name: str) -> None:
    source = (PACKAGE / f"{name}.py").read_text(encoding="utf-8")
    assert violations(source) == []


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
        ("from .horde import HordeClient", ["from .horde import ..."]),
        ("from . import backend", ["from .backend import ..."]),
        ("import time\nx = time.monotonic()", []),
        ("from .errors import ReplyError\nimport json", []),
    ],
)
def test_the_checker_itself_catches_each_kind_of_violation(
    source: str, expected: list[str]
) -> None:
    assert violations(source) == expected
