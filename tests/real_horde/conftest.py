"""Fixtures: the real AI Horde (one per test session), the real worker as a process
and a scripted koboldcpp, and what the Horde recorded in its database.

The real Horde runs from ``$AI_HORDE_SRC`` (``bench.harness.real_horde``); without it
every test here is skipped, so the default run does not pay for it. Each test gets
users of its own (a trusted owner for its workers, a client for its requests) and a
model name of its own, so the requests one test leaves behind never reach another
test's worker.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from bench.harness.real_horde import (
    SRC_ENV,
    HordeUser,
    RealHorde,
    RealHordeError,
    source_from_env,
    sql_literal,
)
from bench.harness.worker_process import WorkerProcess, until
from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp

SKIP_REASON = f"set {SRC_ENV} to an AI Horde source checkout to run the tests against the real Horde"
#: The one text model the Horde's model reference knows (7 B parameters); every other
#: model a test serves is unknown to it.
KNOWN_MODEL = "koboldcpp/real-horde-known-7B"
KNOWN_PARAMETERS = 7_000_000_000


def needs_real_horde() -> list[pytest.MarkDecorator]:
    """A test module's marks: ``real_horde``, skipped without ``$AI_HORDE_SRC``."""
    return [
        pytest.mark.real_horde,
        pytest.mark.skipif(source_from_env() is None, reason=SKIP_REASON),
    ]


@pytest.fixture(scope="session")
def real_horde() -> Iterator[RealHorde]:
    """The real Horde, started once per session and stopped at its end."""
    src = source_from_env()
    if src is None:
        pytest.skip(SKIP_REASON)
    horde = RealHorde(src, text_models={KNOWN_MODEL: {"parameters": KNOWN_PARAMETERS}},
                      log=lambda line: print(f"[real horde] {line}", flush=True))
    try:
        horde.start()
    except RealHordeError as exc:
        pytest.fail(f"the real Horde did not start: {exc}", pytrace=False)
    try:
        yield horde
    finally:
        horde.stop()


def text_kudos(generation: str, prompt: str, max_length: int, *, parameters_b: float | None,
               trusted: bool = True, validated: bool = True) -> float:
    """What the real Horde pays for a text job (its ``get_gen_kudos``, as read from
    its source): tokens are ``ceil(len / 4)``, at least 20 and at most the request's
    ``max_length``, for the generation and the prompt alike; the context multiplier
    is ``1.2 + 2.2 ** log2(prompt tokens / 1024)`` (0.1 to 30). A known model of
    ``parameters_b`` billion parameters earns ``tokens x (max(p, 13) / 13) ** 0.2
    x p / 125``, x 0.3 for a backend the Horde does not validate, rounded to 0.01;
    an unknown one ``tokens x 0.027`` for a trusted owner, nothing per token for
    another; both x the context multiplier."""

    def tokens(text: str) -> int:
        return min(max(math.ceil(len(text) / 4), 20), max_length)

    context = min(max(1.2 + 2.2 ** math.log2(tokens(prompt) / 1024), 0.1), 30.0)
    if parameters_b is None:
        return tokens(generation) * context * 0.027 if trusted else context
    kudos = tokens(generation) * (max(parameters_b, 13) / 13) ** 0.2 * parameters_b / 125
    if not validated:
        kudos *= 0.3
    return round(kudos * context, 2)


@dataclass
class OnRealHorde:
    """One test's users, scripted koboldcpp and workers on the real Horde, and what
    the Horde recorded (read from its database, not its cached pages)."""

    horde: RealHorde
    owner: HordeUser
    client: HordeUser
    model: str
    kcpp: ScriptedKoboldcpp
    journal_dir: Path
    name: str
    workers: list[WorkerProcess] = field(default_factory=list)

    # ------------------------------------------------------------ the worker

    def start_worker(self, *extra: str, name: str | None = None, kcpp_url: str | None = None
                     ) -> WorkerProcess:
        """``python -m koboldcpp_horde_chat`` as ``name`` (the test's worker name) with the
        owner's key against the real Horde and the scripted koboldcpp (or the one at
        ``kcpp_url``), flags ``extra``."""
        worker = WorkerProcess(self.horde, self.kcpp, self.journal_dir, *extra,
                               key=self.owner.api_key, name=name or self.name, kcpp_url=kcpp_url)
        self.workers.append(worker)
        return worker

    # ------------------------------------------------------------ the client

    def send_text(self, prompt: str, *, max_length: int = 32, max_context_length: int = 1024,
                  **extra: Any) -> str:
        """``POST /api/v2/generate/text/async`` by the client for the test's model; the id."""
        body = {
            "prompt": prompt,
            "params": {"max_length": max_length, "max_context_length": max_context_length},
            "models": [self.model],
            **extra,
        }
        resp = requests.post(self.horde.url + "/api/v2/generate/text/async",
                             headers={"apikey": self.client.api_key}, json=body, timeout=30)
        assert resp.status_code == 202, resp.text
        return str(resp.json()["id"])

    def set_maintenance(self, worker_id: str, on: bool, message: str = "") -> None:
        """The owner's ``PUT /api/v2/workers/<id>``."""
        body: dict[str, Any] = {"maintenance": on}
        if message:
            body["maintenance_msg"] = message
        resp = requests.put(f"{self.horde.url}/api/v2/workers/{worker_id}",
                            headers={"apikey": self.owner.api_key}, json=body, timeout=30)
        assert resp.ok, resp.text

    # ------------------------------------------------------------ the record

    def rows(self, query: str) -> list[dict[str, Any]]:
        """``query``'s rows as dicts (PostgreSQL's ``row_to_json``)."""
        return [json.loads(r[0]) for r in self.horde.sql(f"select row_to_json(q) from ({query}) q")]

    def request(self, rid: str) -> dict[str, Any]:
        """The request's ``waiting_prompts`` row: ``n`` (generations still wanted),
        ``faulted``, ``jobs``."""
        found = self.rows(f"select id, n, faulted, jobs, validated_backends from waiting_prompts "
                          f"where id = {sql_literal(rid)}")
        assert found, f"no request {rid} in waiting_prompts"
        return found[0]

    def jobs(self, rid: str) -> list[dict[str, Any]]:
        """The request's ``processing_gens`` rows, oldest first: ``id``, ``generation``
        (None until a reply), ``faulted``, ``worker``."""
        return self.rows(
            "select p.id, p.generation, p.faulted, p.model, w.name as worker, p.created "
            "from processing_gens p join workers w on w.id = p.worker_id "
            f"where p.wp_id = {sql_literal(rid)} order by p.created"
        )

    def worker(self, name: str | None = None) -> dict[str, Any] | None:
        """The worker's ``workers`` row (None before its first pop)."""
        found = self.rows(
            "select id, name, aborted_jobs, uncompleted_jobs, fulfilments, maintenance, "
            f"maintenance_msg, threads, bridge_agent from workers where name = {sql_literal(name or self.name)}"
        )
        return found[0] if found else None

    def worker_jobs(self, name: str | None = None) -> list[dict[str, Any]]:
        """Every ``processing_gens`` row of the worker, oldest first."""
        return self.rows(
            "select p.id, p.wp_id, p.generation, p.faulted, p.created from processing_gens p "
            f"join workers w on w.id = p.worker_id where w.name = {sql_literal(name or self.name)} "
            "order by p.created"
        )

    def credits(self, job_id: str) -> list[float]:
        """The owner's ``kudos_ledger`` postings for the job."""
        return [float(r["amount"]) for r in self.rows(
            f"select amount from kudos_ledger where user_id = {self.owner.user_id} "
            f"and job_id = {sql_literal(job_id)}"
        )]

    def done(self, rids: list[str]) -> int:
        """How many of the requests got their reply: none wanted any more, a job with
        a generation."""
        ids = ", ".join(sql_literal(r) for r in rids)
        found = self.horde.sql(
            f"select count(*) from waiting_prompts wp where wp.id in ({ids}) and wp.n = 0 and "
            "exists (select 1 from processing_gens p where p.wp_id = wp.id and p.generation is not null)"
        )
        return int(found[0][0])

    def wait_done(self, rids: list[str], timeout_s: float) -> None:
        poll(lambda: self.done(rids) == len(rids), timeout_s, self.why)

    def why(self) -> str:
        """The workers' last log lines and the Horde's, for a failure's message."""
        parts = [f"worker {i}:\n{w.log()}" for i, w in enumerate(self.workers)]
        return "\n".join([*parts, "the Horde:", self.horde.server_log(20)])


@pytest.fixture
def on_real(real_horde: RealHorde, request: pytest.FixtureRequest, tmp_path: Path
            ) -> Iterator[OnRealHorde]:
    """The test's users, model, scripted koboldcpp (parametrize indirectly with its keyword
    arguments; ``model_name`` among them replaces the test's model) and workers; every
    worker still running at the end is killed and koboldcpp stopped."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40]
    tag = f"{slug}-{int(time.time() * 1000) % 10**8}"
    options = dict(getattr(request, "param", {}) or {})
    model = str(options.pop("model_name", f"koboldcpp/rh-{tag}"))
    kcpp = ScriptedKoboldcpp(model_name=model, **{"max_context_length": 4096, **options})
    kcpp.start()
    case = OnRealHorde(
        horde=real_horde,
        owner=real_horde.user(f"owner-{tag}"[:50], trusted=True),
        client=real_horde.user(f"client-{tag}"[:50], trusted=False),
        model=model,
        kcpp=kcpp,
        journal_dir=tmp_path / "state",
        name=f"rh-{tag}"[:100],
    )
    try:
        yield case
    finally:
        for worker in case.workers:
            worker.stop()
        kcpp.stop()


def poll(condition: Callable[[], bool], timeout_s: float, why: Callable[[], str]) -> None:
    """``worker_process.until`` asking at most 4 times a second (each ask may run psql)."""

    def slowly() -> bool:
        time.sleep(0.25)
        return condition()

    until(slowly, timeout_s, why)
