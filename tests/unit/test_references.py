"""The map is true: every module, file and logger docs/DESIGN.md names exists, and
so does every dotted module reference and file name in the package's docstrings.

A reference is a dotted name in backquotes (````state.job.JobContext````,
``:class:`~koboldcpp_horde_chat.state.shared.WorkerState```) whose first part
is the package, a module's name (``journal``, ``pop``...) or a name a module
once had (``runs``, ``jobs``, ``backend``...). It resolves when the
package holds that module (from the package's root, the docstring's own room,
or any room holding a module of that name) and the module holds the names that
follow (a class's attribute may be one its instances set). A dotted name that
is a logger of the package resolves too. Names with another first part
(``ctx.lease``, ``time.monotonic``) are not module references.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "koboldcpp_horde_chat"
PACKAGE_DIR = ROOT / PACKAGE
DESIGN = ROOT / "docs" / "DESIGN.md"

#: Names modules of the package had before they moved or were renamed: a
#: reference starting with one is checked (and fails unless it also names a module now).
FORMER_MODULE_NAMES = frozenset({
    "runs", "joblife", "jobs", "backend", "worker", "reply", "stream", "streamed",
    "fetch", "runner", "chat_run", "text_run", "edges", "hook",
})
#: A dotted name in backquotes, with an optional Sphinx role and ``~``/``.`` prefix.
REFERENCE = re.compile(r"(?::\w+:)?`+[~.]?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`+")
#: A path in backquotes in DESIGN.md: ``room/module.py``, ``module.py``, ``room/``.
PATH = re.compile(r"`([\w./-]+(?:\.py|/))`")
#: A file name in backquotes in a docstring.
DOC_PATH = re.compile(r"`+([\w./-]+\.py)`+")
#: Files cited by path that are not this repository's: koboldcpp's and the AI Horde's.
NOT_OURS = frozenset({"koboldcpp.py", "horde/classes/base/worker.py", "horde/utils.py"})


def modules() -> dict[str, Path]:
    """{dotted name under the package: path} (the package itself as "")."""
    found: dict[str, Path] = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = modules()
BY_LEAF: dict[str, list[str]] = {}
for _name in MODULES:
    if _name:
        BY_LEAF.setdefault(_name.rpartition(".")[2], []).append(_name)


def logger_names() -> set[str]:
    """Every ``logging.getLogger("koboldcpp_horde_chat...")`` name the worker
    uses (the devkit aside)."""
    names = set()
    for path in MODULES.values():
        if "devkit" in path.relative_to(PACKAGE_DIR).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "getLogger"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith(PACKAGE)
            ):
                names.add(str(node.args[0].value))
    return names


LOGGERS = logger_names()


def _holds(owner: Any, rest: list[str]) -> bool:
    for name in rest:
        if hasattr(owner, name):
            owner = getattr(owner, name)
            continue
        if isinstance(owner, type):  # an attribute its instances set
            try:
                source = inspect.getsource(owner)
            except (OSError, TypeError):
                return False
            return re.search(rf"\bself\.{name}\b|^\s+{name}\s*:", source, re.M) is not None
        return False
    return True


def resolves(reference: str, here: str = "") -> bool:
    """Whether ``reference`` names a module of the package (and names in it).

    ``here``: the dotted module whose docstring holds it ("" for DESIGN.md)."""
    if reference in LOGGERS:
        return True
    parts = reference.split(".")
    bases: list[str] = [""]
    if parts[0] == PACKAGE:
        parts = parts[1:]
    else:
        if "." in here:
            bases.append(here.partition(".")[0])
        bases += [m.rpartition(".")[0] for m in BY_LEAF.get(parts[0], [])]
    for base in bases:
        full = [*filter(None, base.split(".")), *parts]
        for cut in range(len(full), 0, -1):
            module = ".".join(full[:cut])
            if module not in MODULES:
                continue
            if module.endswith("__main__"):  # importing it runs the command
                return cut == len(full)
            if _holds(importlib.import_module(f"{PACKAGE}.{module}"), full[cut:]):
                return True
            break
    return False


def is_module_reference(reference: str) -> bool:
    """Whether a dotted name is meant as a module (a file name is not: the path
    check reads those)."""
    head = reference.split(".")[0]
    if reference.endswith(".py"):
        return False
    return head == PACKAGE or head in BY_LEAF or head in FORMER_MODULE_NAMES


def stale_references(text: str, here: str = "") -> list[str]:
    return [
        ref
        for ref in dict.fromkeys(m[1] for m in REFERENCE.finditer(text))
        if is_module_reference(ref) and not resolves(ref, here)
    ]


def docstrings(path: Path) -> list[str]:
    """The module's, classes' and functions' docstrings, and attribute docstrings."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                found.append(node.value.value)
    return found


def test_every_module_a_docstring_of_the_package_names_exists() -> None:
    stale = [
        f"{path.relative_to(ROOT)}: {ref}"
        for name, path in sorted(MODULES.items())
        for text in docstrings(path)
        for ref in stale_references(text, name)
    ]
    assert stale == []


def test_every_module_a_docstring_of_the_tests_or_benchmarks_names_exists() -> None:
    paths = sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")])
    stale = [
        f"{path.relative_to(ROOT)}: {ref}"
        for path in paths
        for text in docstrings(path)
        for ref in stale_references(text)
    ]
    assert stale == []


def test_every_file_a_docstring_of_the_package_names_exists() -> None:
    missing = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted(MODULES.values())
        for text in docstrings(path)
        for name in DOC_PATH.findall(text)
        if name not in NOT_OURS and not any(p.exists() for p in (PACKAGE_DIR / name, ROOT / name))
    ]
    assert missing == []


def test_every_module_and_logger_the_design_map_names_exists() -> None:
    assert stale_references(DESIGN.read_text(encoding="utf-8")) == []


def test_every_file_the_design_map_names_exists() -> None:
    missing = []
    for path in dict.fromkeys(PATH.findall(DESIGN.read_text(encoding="utf-8"))):
        if path in NOT_OURS:
            continue
        here = [PACKAGE_DIR / path, ROOT / path]
        if not any(p.exists() for p in here):
            missing.append(path)
    assert missing == []


def test_the_design_maps_logger_table_says_which_module_uses_each_logger() -> None:
    """Each row: a logger and the modules that get it; every logger has its row."""
    rows = re.findall(r"^\| `(koboldcpp_horde_chat[\w.]*)` \| (.+) \|$", DESIGN.read_text("utf-8"), re.M)
    assert {logger for logger, _ in rows} == LOGGERS
    for logger, where in rows:
        for path in re.findall(r"`([\w/]+\.py)`", where):
            source = (PACKAGE_DIR / path).read_text(encoding="utf-8")
            assert f'getLogger("{logger}")' in source, (logger, path)


@pytest.mark.parametrize(
    ("text", "stale"),
    [
        ("its owner (``runs.JobContext``)", ["runs.JobContext"]),
        ("checked by ``joblife.next_phase``", ["joblife.next_phase"]),
        (":class:`~service.state.WorkerState`", ["service.state.WorkerState"]),
        ("``koboldcpp_horde_chat.koboldcpp.bodies``", ["koboldcpp_horde_chat.koboldcpp.bodies"]),
        ("``state.job.Nope``", ["state.job.Nope"]),
        ("``koboldcpp_horde_chat.nope``", ["koboldcpp_horde_chat.nope"]),
        # resolved: a module, a name in it, an attribute instances set, a leaf, a logger
        ("``state.job.JobContext`` and :func:`koboldcpp_horde_chat.horde.pop.parse_pop`", []),
        ("``state.job.JobContext.lease`` and ``journal.Journal``", []),
        ("``koboldcpp_horde_chat.worker`` lines", []),
        # not module references: a variable's attribute, the standard library
        ("``ctx.lease.deadline`` and ``time.monotonic``", []),
    ],
)
def test_the_reference_check_sees_a_name_that_does_not_exist(text: str, stale: list[str]) -> None:
    assert stale_references(text) == stale
