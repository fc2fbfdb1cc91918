"""The devkit is an independent oracle: it imports nothing of the worker's package.

The dev Horde and the scripted koboldcpp implement the other sides of the
contract on their own, so an integration test checks the worker against the
contract and not against itself. Every devkit module is parsed with ``ast``;
an import of ``koboldcpp_horde_chat`` outside ``koboldcpp_horde_chat.devkit``
(absolute, relative, or by name through ``importlib.import_module`` /
``__import__``) fails the test.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "koboldcpp_horde_chat"
DEVKIT = f"{PACKAGE}.devkit"
ROOT = Path(__file__).resolve().parents[2]
DEVKIT_DIR = ROOT / PACKAGE / "devkit"


def module_name(path: Path) -> str:
    """``koboldcpp_horde_chat.devkit.horde.leases`` for ``.../devkit/horde/leases.py``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, *, is_package: bool) -> list[str]:
    """Every module name ``source`` imports, relative imports resolved against ``module``."""
    found: list[str] = []
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append(target)
            # "from koboldcpp_horde_chat import settings" imports a module by name
            found.extend(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append(arg.value)
    return found


def outside_devkit(names: list[str]) -> list[str]:
    return [
        n
        for n in names
        if (n == PACKAGE or n.startswith(PACKAGE + "."))
        and not (n == DEVKIT or n.startswith(DEVKIT + "."))
        and n != PACKAGE  # "from koboldcpp_horde_chat import devkit" names the package only
    ]


DEVKIT_FILES = sorted(DEVKIT_DIR.rglob("*.py"))


def test_the_devkit_has_modules_to_check() -> None:
    names = {module_name(p) for p in DEVKIT_FILES}
    assert {f"{DEVKIT}.horde", f"{DEVKIT}.kcpp", f"{DEVKIT}.horde.worker_routes"} <= names


@pytest.mark.parametrize("path", DEVKIT_FILES, ids=lambda p: str(p.relative_to(DEVKIT_DIR)))
def test_devkit_module_imports_nothing_of_the_worker(path: Path) -> None:
    names = imported_modules(
        path.read_text(encoding="utf-8"),
        module_name(path),
        is_package=path.name == "__init__.py",
    )
    assert outside_devkit(names) == []


@pytest.mark.parametrize(
    "source",
    [
        "from koboldcpp_horde_chat.settings import WorkerSettings",
        "import koboldcpp_horde_chat.horde",
        "from koboldcpp_horde_chat import reply",
        "from ... import settings",
        "from ...jobs import parse_pop",
        "importlib.import_module('koboldcpp_horde_chat.stream')",
    ],
)
def test_the_check_sees_an_import_of_the_worker(source: str) -> None:
    names = imported_modules(source, f"{DEVKIT}.horde.leases", is_package=False)
    assert outside_devkit(names) != []


@pytest.mark.parametrize(
    "source",
    [
        "from koboldcpp_horde_chat.devkit._http import JSONServer",
        "from koboldcpp_horde_chat.devkit import kcpp as package",
        "from .. import _http",
        "from .values import ROUTES",
        "importlib.import_module('jsonschema')",
    ],
)
def test_the_check_allows_the_devkit_itself(source: str) -> None:
    names = imported_modules(source, f"{DEVKIT}.horde.leases", is_package=False)
    assert outside_devkit(names) == []
