"""Only the job driver and the submit pipeline move a job, and nothing writes a
job's fields from outside its owner.

A job's life has one driver (``run/driver.py``): it takes the job in hand,
serves it and settles it; the submit pipeline (``run/submit.py``) makes the
terminal action's moves. Every other module reads the job's owner
(``state.job.JobContext``) or calls the methods that do not move it. These
checks parse the package with ``ast``, so a new module that moves a job or
assigns one of its fields fails here, not in a race.
"""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

from koboldcpp_horde_chat.horde.pop import Lease
from koboldcpp_horde_chat.state.job import JobContext

PACKAGE = Path(__file__).resolve().parents[2] / "koboldcpp_horde_chat"

#: The modules that may move a job: its owner, its driver and its terminal action.
MOVERS = {"state/job.py", "run/driver.py", "run/submit.py"}
#: The owner's methods that move a job through its phases (``state.life.MOVES``),
#: and ``begin`` (when serving starts: the driver's to say).
MOVES = {"move", "settle", "end", "start_generation", "begin"}
#: The modules whose classes own the fields (their own methods assign them on ``self``).
OWNERS = {"state/job.py", "horde/pop.py"}
#: The fields of a job's owner and of its lease, but for names other objects
#: have too (a tool call's ``id``, a loop's ``clock``).
FIELDS = ({f.name for f in fields(JobContext)} | {f.name for f in fields(Lease)}) - {
    "id", "kind", "clock", "journal", "steps", "lock", "worker_id", "model_id",
}


def _modules() -> list[tuple[str, ast.Module]]:
    return [
        (str(path.relative_to(PACKAGE)), ast.parse(path.read_text(encoding="utf-8")))
        for path in sorted(PACKAGE.rglob("*.py"))
        if "devkit" not in path.relative_to(PACKAGE).parts
    ]


def _receiver(node: ast.expr) -> str:
    """The last name of an attribute's receiver: ``ctx`` for ``ctx.x``, ``lease``
    for ``self.ctx.lease.x``, ``""`` for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def moves_outside_the_movers(modules: list[tuple[str, ast.Module]]) -> list[str]:
    """``x.move(Move.X)``, ``x.end(Move.X)``, ``x.settle()`` and
    ``x.start_generation()`` outside :data:`MOVERS` (``self.`` calls inside the
    owner included)."""
    found = []
    for name, tree in modules:
        if name in MOVERS:
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            attr = node.func.attr
            if attr not in MOVES:
                continue
            moves_by_name = attr in {"settle", "start_generation", "begin"} and not node.args
            # A move named anywhere in the arguments (``Move.X``, ``life.Move.X``,
            # ``Move.A if c else Move.B``), or any argument on a job-named receiver
            # (``ctx.end(move)``).
            names_a_move = any(
                (isinstance(n, ast.Name) and n.id == "Move")
                or (isinstance(n, ast.Attribute) and n.attr == "Move")
                for arg in node.args
                for n in ast.walk(arg)
            )
            on_a_job = bool(node.args) and attr in {"move", "end"} and _job_named(
                _receiver(node.func.value)
            )
            if moves_by_name or names_a_move or on_a_job:
                found.append(f"{name}:{node.lineno}: .{attr}(")
    return found


def _job_named(receiver: str) -> bool:
    return receiver in {"ctx", "lease"} or receiver.endswith("_ctx")


def writes_by_other_means(modules: list[tuple[str, ast.Module]]) -> list[str]:
    """Outside the owners' modules: ``setattr``/``__setattr__``/``delattr`` on a
    job-named object, ``del ctx.x``, and ``.abandoned.set()`` (a give-up that
    skips ``JobContext.give_up``'s stop of the generation)."""
    found = []
    for name, tree in modules:
        if name in OWNERS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                fname = func.id if isinstance(func, ast.Name) else (
                    func.attr if isinstance(func, ast.Attribute) else ""
                )
                if fname in {"setattr", "delattr", "__setattr__", "__delattr__"} and any(
                    _job_named(_receiver(arg)) for arg in node.args[:1]
                ):
                    found.append(f"{name}:{node.lineno}: {fname}(")
                if (
                    fname == "set"
                    and isinstance(func, ast.Attribute)
                    and isinstance(func.value, ast.Attribute)
                    and func.value.attr == "abandoned"
                ):
                    found.append(f"{name}:{node.lineno}: .abandoned.set()")
            elif isinstance(node, ast.Delete):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and _job_named(_receiver(target.value)):
                        found.append(f"{name}:{node.lineno}: del {target.attr}")
    return found


def fields_assigned_from_outside(modules: list[tuple[str, ast.Module]]) -> list[str]:
    """Assignments of any attribute on a receiver named as a job (``ctx``,
    ``*_ctx``, ``lease``) anywhere, and of a job's or a lease's field
    (:data:`FIELDS`) on any receiver but ``self`` outside the owners' modules."""
    found = []
    for name, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for sub in ast.walk(target):
                    if not (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)):
                        continue
                    receiver = _receiver(sub.value)
                    job_named = receiver in {"ctx", "lease"} or receiver.endswith("_ctx")
                    if job_named or (
                        name not in OWNERS and sub.attr in FIELDS and receiver != "self"
                    ):
                        found.append(f"{name}:{sub.lineno}: {receiver}.{sub.attr} =")
    return found


def test_only_the_driver_the_owner_and_the_submit_pipeline_move_a_job() -> None:
    assert moves_outside_the_movers(_modules()) == []


def test_no_module_writes_a_jobs_or_its_leases_fields_from_outside() -> None:
    assert fields_assigned_from_outside(_modules()) == []
    assert writes_by_other_means(_modules()) == []


def test_the_checks_catch_each_kind_of_violation() -> None:
    """The checks themselves, on sources that break the rule and one that does not."""
    bad = ast.parse(
        "ctx.move(Move.PREPARE)\n"
        "self.ctx.end(Move.NO_SUBMIT)\n"
        "job_ctx.settle()\n"
        "ctx.start_generation()\n"
        "ctx.started = 1.0\n"
        "ctx.lease.deadline = 2.0\n"
        "self.ctx.popped_in_stop = True\n"
        "other.stop_generation = None\n"
        "ctx.end(move)\n"
        "ctx.move(life.Move.OUTCOME)\n"
        "job.end(Move.A if c else Move.B)\n"
        "ctx.begin()\n"
    )
    sideways = ast.parse(
        "setattr(ctx, 'started', 1.0)\n"
        "object.__setattr__(self.ctx, 'phase', None)\n"
        "del ctx.genkey\n"
        "ctx.abandoned.set()\n"
    )
    fine = ast.parse(
        "ctx.check_abandoned()\n"
        "ctx.give_up('why')\n"
        "self.started = 1.0\n"
        "route.move(3)\n"
        "match.end(0)\n"
        "x = ctx.lease.deadline\n"
    )
    assert len(moves_outside_the_movers([("run/chat.py", bad)])) == 8
    assert len(writes_by_other_means([("service/loop.py", sideways)])) == 4
    assert writes_by_other_means([("service/loop.py", fine)]) == []
    assert len(fields_assigned_from_outside([("service/loop.py", bad)])) == 4
    assert moves_outside_the_movers([("run/chat.py", fine)]) == []
    assert fields_assigned_from_outside([("service/loop.py", fine)]) == []
