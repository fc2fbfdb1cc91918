"""The dev Horde: a local Horde serving the chat worker protocol over real HTTP.

A development Horde on 127.0.0.1 for the worker's integration tests, the demo
and other worker authors. It implements the Horde's side of "Serve chat jobs
from a text worker" (seed 000) and the image and messages transports of seed
004, independently of the worker's modules (it imports none of them), so a
test run checks the worker against the contract and not against itself.

Python API (in process)::

    with DevHorde(api_keys=("devkey",)) as h:
        rid = h.send_chat({"messages": [{"role": "user", "content": "Hi"}]})
        ...  # a worker pops from h.url with apikey "devkey"
        h.wait([rid], timeout_s=10)
        h.status(rid)["message"]  # {"role": "assistant", "content": "..."}

Worker routes (``apikey`` header checked; a missing or unknown key answers 401
``InvalidAPIKey``; each key is one owner, and a call for a worker name or a job
of another key's worker answers 403 ``WrongCredentials``):

* ``POST /api/v2/generate/text/pop``: step 1 "Declaration checks and
  withdrawal" (400 ``ChatDeclarationInvalid``; a worker ``name`` over 100
  characters is 400 ``TooLongWorkerName``), the eligibility rules of steps 1,
  4 and 5, the job shapes of step 2 ("One chat job in full") and step 8. As on
  the real AI Horde: a request has ``validated_backends: false`` unless its
  client asks for it and then goes only to a worker whose ``bridge_agent`` names a
  validated backend (:func:`is_validated_backend`); every answer lists the
  moderator messages for the worker (``messages``, :meth:`DevHorde.add_worker_message`),
  and an answer without a job counts the requests it passed over in
  ``skipped`` (``models``, ``max_context_length``, ``max_length``,
  ``bridge_version``). A worker in maintenance is answered 403
  ``WorkerMaintenance`` (see "Aborted jobs and maintenance" below).
* ``POST /api/v2/generate/text/submit``: steps 6 and 7, "Submit refusals"
  (``ChatSubmitInvalid``, ``ChatModelMismatch``, ``ChatSubmitNonconformant``),
  ``DuplicateGen`` and ``AbortedGen`` (a fault for a job that already ended
  without a reply is answered 200 ``{"reward": 0}``, as on the real Horde); 400
  ``NulByteInPayload`` for a body with
  U+0000 anywhere; 400 input validation (no ``rc``) for a ``state`` outside
  ok, censored, faulted, csam and for a text submit (a text job's, or a chat
  job's fault without ``model_id``) without ``generation``. A worker whose
  backend is not validated earns 0.3 x the reward.
* ``POST /api/v2/generate/text/progress``: "Streaming progress"; a ``delta``
  without ``content`` or ``reasoning_content`` is 400 ``ChatProgressInvalid``.

``latency_s`` delays every answer on these three routes, as a network would.

Client routes (no key needed): ``POST /api/v2/generate/chat/async`` (an OpenAI
chat-completions body plus ``"horde": {"best_effort": bool, "validated_backends":
bool}``) and ``POST /api/v2/generate/text/async`` (``prompt``, ``params``,
``models``, ``validated_backends``) answer 202 ``{"id"}``;
``GET /api/v2/generate/{chat,text}/status/<id>``; ``DELETE
/api/v2/generate/chat/status/<id>`` cancels; ``GET /api/v2/workers/name/<name>``;
``GET /api/v2/dev/ledger``. ``GET /api/v2/find_user`` answers who the ``apikey``
header's key belongs to, as the real Horde does (404 ``UserNotFound`` for a key
it does not know, 401 ``InvalidAPIKey`` for none; ``trusted`` as the constructor's).

A second port (``storage_url``) plays object storage: signed URLs for offloaded
messages (valid 120 s, optionally gzipped) and for images (valid max(ttl, 600)
s; an expired URL or a bad signature answers 403). Both ports log every request
to :attr:`DevHorde.requests_log`.

Images (seed 004): at :meth:`DevHorde.send_chat` each ``image_url`` part, a
base64 data URL or an http(s) URL on 127.0.0.1 (fetched then, at most 3
redirects), is checked against the caps (10 MiB per image, 27 MiB per request,
as sent and as stored) and stored as JPEG on the storage port; the request keeps
only a key. The real Horde re-encodes every image as JPEG (longest side at most
2048); without an image library the dev Horde cannot, so it stores a JPEG whose
longest side is at most 2048 as sent and hands anything else to the
``image_converter`` hook, refusing the request (``ValueError``; 400
``ChatRequestInvalid`` over HTTP) when there is none. At pop a worker declaring
``url`` receives signed URLs, one declaring only ``base64`` receives
``data:image/jpeg;base64,`` URLs, and offloaded messages carry data URLs inline.
A request with images goes only to a worker declaring ``vision`` and ``url`` or
``base64``.

The sweep, as on the real AI Horde: every ``sweep_s`` (60 s) it aborts each
job whose lease passed without a submit (an aborted job of its worker; the
request goes back to the queue), so a job expires 0-60 s after its ttl, and a
submit that comes before the sweep is still taken; then it faults each request
with more than 2 faulted jobs (faulted or expired). Until then a faulted
request goes straight back to the queue in its old place, at the head, for the
worker that faulted it too. The sweep is run lazily: by the next call that
looks at state (any HTTP route, :meth:`status`, :meth:`wait`, :meth:`worker`,
:meth:`job`, :attr:`ledger`), what it would have done by then is done first.
Where the dev Horde differs on purpose: ``max_attempts`` (:meth:`send_chat`)
faults a request at once, and ``sweep_s=0`` sweeps at every call.

Aborted jobs and maintenance, as on the real AI Horde: every job of a worker
that ends without a reply is an aborted job of that worker, whether the worker
faulted it (except a fault after a ``ChatSubmitNonconformant`` refusal, counted
apart under ``nonconformant_replies``) or its lease ran out without a submit. A
worker that aborts more than 20 jobs within an hour (a window that starts at
its first pop and starts again at the first aborted job more than an hour
later) is put into maintenance and its count starts again from 0; from then on
every pop it sends is answered 403 ``WorkerMaintenance`` until
:meth:`DevHorde.set_maintenance` ends it. :meth:`DevHorde.worker` shows
``aborted_jobs`` (this window's count), ``uncompleted_jobs`` (every aborted
job) and ``maintenance_mode``.

This package holds :class:`DevHorde` (its constructor, its two ports and the
dispatch of the Horde port's routes), assembled from one mixin per route family,
each in a module read whole on its own: :mod:`.worker_routes` (pop, submit,
progress), :mod:`.client_routes` (chat and text requests, status, wait, cancel,
worker details), :mod:`.eligibility` (the declaration checks and eligibility
rules), :mod:`.chat` (the chat contract: a request's spec, the job payload, the
submit's checks), :mod:`.images` (images and the object store: storage port,
offload, signed URLs), :mod:`.leases` (leases, expiry, aborted jobs,
maintenance, the ledger) and :mod:`.dispatch` (the request log, scripted
answers, body and key checks); beside them :mod:`.state` (the records and the
shared state), :mod:`.values` (the contract's values) and :mod:`.helpers` (small
helpers).
"""

from __future__ import annotations

import copy
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from koboldcpp_horde_chat.devkit._http import JSONServer, Request, Response
from koboldcpp_horde_chat.devkit.horde.client_routes import ClientRoutes
from koboldcpp_horde_chat.devkit.horde.helpers import (
    _ApiError,
    is_validated_backend,
    log,
    parse_bridge_agent,
)
from koboldcpp_horde_chat.devkit.horde.images import (
    jpeg_size,
)
from koboldcpp_horde_chat.devkit.horde.state import _Job, _Req, _Worker, _WorkerMessage
from koboldcpp_horde_chat.devkit.horde.values import (
    ABORTED_JOBS_WINDOW_S,
    BRIDGE_AGENT_MAX_CHARS,
    CHAT_FEATURES,
    DEFAULT_BRIDGE_AGENT,
    DEFAULT_TTL_S,
    FAULT_REASON_SENTENCES,
    FINISH_REASONS,
    IMAGE_FETCH_REDIRECTS,
    IMAGE_FETCH_TIMEOUT_S,
    IMAGE_TRANSPORTS,
    LEASE_CAP_TRUSTED_S,
    LEASE_CAP_UNTRUSTED_S,
    LLM_VALIDATED_BACKENDS,
    MAINTENANCE_MESSAGE,
    MAX_ABORTED_JOBS,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_SIDE,
    MAX_REQUEST_IMAGE_BYTES,
    MAX_TOKEN_COUNT,
    MESSAGES_URL_S,
    MIN_IMAGE_URL_S,
    NATIVE_FINISH_REASON_MAX_CHARS,
    OWNER_MAINTENANCE_MESSAGE,
    PROGRESS_BYTES_PER_TOKEN,
    PROGRESS_MAX_POSTS,
    REASONING_MAX_BYTES,
    ROUTES,
    SUBMIT_STATES,
    SWEEP_FAULTED_JOBS,
    SWEEP_S,
    TEXT_DEFAULT_MAX_CONTEXT,
    TEXT_DEFAULT_MAX_LENGTH,
    UNVALIDATED_KUDOS_FACTOR,
    WORKER_MESSAGE_S,
    WORKER_NAME_MAX_CHARS,
    ImageConverter,
)
from koboldcpp_horde_chat.devkit.horde.worker_routes import WorkerRoutes

__all__ = [
    "ABORTED_JOBS_WINDOW_S",
    "BRIDGE_AGENT_MAX_CHARS",
    "CHAT_FEATURES",
    "DEFAULT_BRIDGE_AGENT",
    "DEFAULT_TTL_S",
    "FAULT_REASON_SENTENCES",
    "FINISH_REASONS",
    "IMAGE_FETCH_REDIRECTS",
    "IMAGE_FETCH_TIMEOUT_S",
    "IMAGE_TRANSPORTS",
    "LEASE_CAP_TRUSTED_S",
    "LEASE_CAP_UNTRUSTED_S",
    "LLM_VALIDATED_BACKENDS",
    "MAINTENANCE_MESSAGE",
    "MAX_ABORTED_JOBS",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_SIDE",
    "MAX_REQUEST_IMAGE_BYTES",
    "MAX_TOKEN_COUNT",
    "MESSAGES_URL_S",
    "MIN_IMAGE_URL_S",
    "NATIVE_FINISH_REASON_MAX_CHARS",
    "OWNER_MAINTENANCE_MESSAGE",
    "PROGRESS_BYTES_PER_TOKEN",
    "PROGRESS_MAX_POSTS",
    "REASONING_MAX_BYTES",
    "ROUTES",
    "SUBMIT_STATES",
    "SWEEP_FAULTED_JOBS",
    "SWEEP_S",
    "TEXT_DEFAULT_MAX_CONTEXT",
    "TEXT_DEFAULT_MAX_LENGTH",
    "UNVALIDATED_KUDOS_FACTOR",
    "WORKER_MESSAGE_S",
    "WORKER_NAME_MAX_CHARS",
    "DevHorde",
    "ImageConverter",
    "is_validated_backend",
    "jpeg_size",
    "parse_bridge_agent",
]


class DevHorde(WorkerRoutes, ClientRoutes):
    """A local Horde with the chat worker routes, on 127.0.0.1 (see the package docstring).

    Args:
        api_keys: the worker API keys accepted in the ``apikey`` header.
        trusted: whether workers count as trusted (lease cap 600 s, else 200 s) and
            their owners are (``find_user``).
        offload_bytes: offload a request's messages when their compact JSON (UTF-8
            bytes, images inline) is larger than this; None turns offload off.
        offload_gzip: store offloaded messages gzipped (``Content-Encoding: gzip``)
            when that is smaller.
        host, port: where the Horde port binds (port 0: ephemeral). The storage
            port always binds an ephemeral port on ``host``.
        ttl_s: the job lease in seconds (the pop's ``ttl``), 150 by default.
        lease_cap_s: the longest lease counted from the pop, in seconds; None
            uses 600 (trusted) or 200 (untrusted).
        messages_url_s: how long a ``messages_url`` stays valid, 120 s.
        image_converter: ``hook(data: bytes, media_type: str) -> bytes`` turning an
            image that is not a JPEG of longest side at most 2048 into one (see
            :data:`ImageConverter`). The real Horde converts every image; without
            a hook the dev Horde refuses such an image (``send_chat`` raises
            ``ValueError``, HTTP 400 ``ChatRequestInvalid``).
        image_url_s: how long a signed image URL stays valid, seconds; None (the
            contract) is max(``ttl_s``, 600). A test hook: a negative value signs
            URLs that have already expired.
        latency_s: seconds added to every answer on the worker routes (pop,
            submit, progress), half before the call is processed and half after,
            as a network round trip would (e.g. 0.15 for benchmarks that compare
            workers at a 150 ms round trip). The attribute of that name can be
            changed at any time; the next call uses the new value.
        aborted_jobs_window_s: the window in which more than 20 aborted jobs put
            a worker into maintenance, seconds: one hour, as on the real Horde (a
            test hook: a short window shows the count starting again).
        sweep_s: how often the sweep runs, seconds: 60, as on the real Horde (it
            aborts each job whose lease passed, so a job expires 0-60 s after its
            ttl, and faults each request with more than 2 faulted jobs); 0 runs it
            at every call (a test hook: a job expires at its ttl).
        chat_routes: False plays the real Horde as it is, without the chat
            routes: the chat client routes answer 404, :meth:`send_chat` raises
            ``ValueError``, and a pop's chat declaration is ignored without a
            word, ``prompt_jobs: false`` included (text jobs still come).
    """

    def __init__(
        self,
        api_keys: Iterable[str] = ("devkey",),
        *,
        trusted: bool = False,
        offload_bytes: int | None = None,
        offload_gzip: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        ttl_s: float = DEFAULT_TTL_S,
        lease_cap_s: float | None = None,
        messages_url_s: float = MESSAGES_URL_S,
        image_converter: ImageConverter | None = None,
        image_url_s: float | None = None,
        latency_s: float = 0.0,
        aborted_jobs_window_s: float = ABORTED_JOBS_WINDOW_S,
        sweep_s: float = SWEEP_S,
        chat_routes: bool = True,
    ) -> None:
        self.api_keys = frozenset(api_keys)
        self.sweep_s = max(0.0, float(sweep_s))
        self._next_sweep = time.monotonic() + self.sweep_s
        self.chat_routes = bool(chat_routes)
        self.aborted_jobs_window_s = float(aborted_jobs_window_s)
        self.latency_s = float(latency_s)
        self.trusted = trusted
        self.offload_bytes = offload_bytes
        self.offload_gzip = offload_gzip
        self.ttl_s = float(ttl_s)
        self.lease_cap_s = (
            float(lease_cap_s)
            if lease_cap_s is not None
            else (LEASE_CAP_TRUSTED_S if trusted else LEASE_CAP_UNTRUSTED_S)
        )
        self.messages_url_s = float(messages_url_s)
        self.image_converter: ImageConverter | None = image_converter
        self.image_url_s = None if image_url_s is None else float(image_url_s)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._secret = secrets.token_bytes(32)
        self._requests: dict[str, _Req] = {}
        self._jobs: dict[str, _Job] = {}
        self._workers: dict[str, _Worker] = {}
        self._worker_messages: list[_WorkerMessage] = []
        self._objects: dict[str, tuple[bytes, dict[str, str]]] = {}
        self._ledger: list[dict[str, Any]] = []
        self._late_faults: list[dict[str, Any]] = []
        self._pops: list[dict[str, Any]] = []
        self._requests_log: list[dict[str, Any]] = []
        self._scripts: dict[str, deque[Any]] = {name: deque() for name in (*ROUTES, "storage")}
        self._order = 0
        self._horde = JSONServer(self._serve_horde, host=host, port=port, name="dev-horde")
        self._storage = JSONServer(self._serve_storage, host=host, port=0, name="dev-storage")

    def start(self) -> None:
        """Bind both ports and serve. Raises ``OSError`` when a bind fails."""
        self._storage.start()
        self._horde.start()
        # Keep the ports: refuse_connections() / accept_connections() rebind them.
        self._storage._port = self._storage.port
        self._horde._port = self._horde.port

    def refuse_connections(self, port: str = "horde") -> None:
        """Close the ``"horde"`` or ``"storage"`` port: connections are refused.

        State (requests, jobs, leases, ledger) is kept; :meth:`accept_connections`
        opens the same port again. Fault injection for a Horde or object store
        that is down.
        """
        (self._horde if port == "horde" else self._storage).stop()

    def accept_connections(self, port: str = "horde") -> None:
        """Open the port closed by :meth:`refuse_connections` again, on the same number."""
        (self._horde if port == "horde" else self._storage).start()

    def stop(self) -> None:
        """Stop both servers and close their connections."""
        self._horde.stop()
        self._storage.stop()

    def __enter__(self) -> DevHorde:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The Horde's base URL, ``http://127.0.0.1:<port>`` (no ``/api``)."""
        if not self._horde.running and self._horde._port:  # during refuse_connections()
            return f"http://{self._horde._host}:{self._horde._port}"
        return self._horde.url

    def _serve_horde(self, req: Request) -> Response:
        self._log_request("horde", req)
        route = next((name for name, path in ROUTES.items() if path == req.path), None)
        if route is not None and req.method != "POST":
            return Response.json(405, {"message": "Use POST.", "rc": "MethodNotAllowed"})

        def serve() -> Response:
            return self._route(req, route)

        def on_scripted(script: Any) -> None:
            log.info("dev horde: scripted answer %r on %s", script, req.path)
            if route == "pop" and (isinstance(script, tuple) or script == "reset"):
                with self._lock:
                    self._pops.append(
                        {
                            "worker": None,
                            "body": self._json_or_none(req),
                            "status": script[0] if isinstance(script, tuple) else None,
                            "response": copy.deepcopy(script[1])
                            if isinstance(script, tuple)
                            else None,
                        }
                    )

        if route is None:
            return self._scripted(route, serve, on_scripted)
        half = max(0.0, self.latency_s) / 2
        if half:
            time.sleep(half)
        resp = self._scripted(route, serve, on_scripted)
        if half:
            time.sleep(half)
        return resp

    def _route(self, req: Request, route: str | None) -> Response:
        try:
            if route is not None:
                key = self._check_key(req)
                body = self._body_object(req)
                if route == "pop":
                    return self._pop(body, key)
                if route == "submit":
                    return self._submit(body, key)
                return self._progress(body, key)
            return self._client_route(req)
        except _ApiError as err:
            if route == "pop":
                with self._lock:
                    self._pops.append(
                        {
                            "worker": None,
                            "body": self._json_or_none(req),
                            "status": err.status,
                            "response": err.body(),
                        }
                    )
            return Response.json(err.status, err.body())
