"""A scripted koboldcpp: a real HTTP server that answers like koboldcpp 1.116.1.

:class:`ScriptedKoboldcpp` listens on 127.0.0.1 and answers the routes the chat
worker (and koboldcpp's own embedded worker) uses, with the status codes,
headers, key order and value types recorded from a real koboldcpp 1.116.1
(``tests/data/kcpp-samples/``) and read in its ``koboldcpp.py``. The replies are
canned and deterministic, so tests and the demo get sensible answers without a
model:

* ``/v1/chat/completions`` (whole or Server-Sent Events over HTTP/1.0, closed at
  the end), ``/api/v1/generate``, ``/api/extra/generate/stream``;
* ``/api/extra/tokencount`` (``{"value", "ids", "prompt"}``, BOS included),
  ``/api/extra/abort`` (string ``"true"``/``"false"`` values, L6521-6541),
  ``/api/extra/generate/check``;
* the open GETs: ``/api/v1/info/version``, ``/api/v1/model``,
  ``/api/extra/version``, ``/api/extra/true_max_context_length``,
  ``/api/v1/config/max_context_length``, ``/api/v1/config/max_length``,
  ``/v1/models``, ``/api/extra/perf``, and ``/props`` (the model's
  ``chat_template``, L6316-6335).

It can play an older koboldcpp or another model: ``version`` (what
``/api/extra/version`` reports), ``chat_route`` False (no
``/v1/chat/completions``: a POST there is answered 404 as koboldcpp answers a
POST route it lacks, L7540; koboldcpp before 1.46 had no such route), and
``chat_template`` (``""``: a model that carries none, which koboldcpp renders
with its Alpaca fallback; None: no ``/props`` route, as before koboldcpp 1.79).

Behaviour copied from koboldcpp (lines of koboldcpp 1.116.1 ``koboldcpp.py`` in brackets):

* generations are serialised by one lock (``modelbusy``, L6886-6897): a second request
  waits; ``busy = True`` answers 503 ``Server is busy`` instead;
* with a password, generation POSTs, tokencount, abort and generate/check need
  ``Authorization: Bearer <password>`` (401 otherwise, checked after the lock
  is taken); GETs stay open and ``/api/v1/model`` masks the name (L5850-5862, L6077-6082);
* ``finish_reason`` is ``"stop"`` only for EOS; the token budget, a stop
  sequence and an abort all report ``"length"`` (L5194, L5435);
* ``<think>`` blocks are split into ``reasoning_content`` (non-stream: only when
  both tags or only the end tag are present; stream: tag by tag) (L5208-5225, L5455-5570);
* ``response_format: json_object`` yields a JSON *array* (L4193; recorded in
  ``json_object_smollm.body``); a ``grammar`` rooted at an object or a
  ``json_schema`` yields an object;
* tools: ids ``call_<10000-99999>``, ``content`` ``""``, ``finish_reason``
  ``"tool_calls"``; streamed tool replies are fake-streamed after generation
  with chunk id ``"koboldcpp"`` and no usage chunk (L5249, L7165-7360);
* a generation whose genkey does not start with ``HORDEREQ_`` is a local user's:
  it updates :attr:`ScriptedKoboldcpp.last_non_horde_request_time` (L5176-5179, L5203-5206);
* prompts longer than the context are cut at the front silently and
  ``prompt_tokens`` reports the kept part (``gpttype_adapter.cpp`` L5616-5629, L6965-6966);
* a request's ``max_context_length`` is capped at the context size, its
  ``max_length`` at ``--genlimit`` (``genlimit``, when above 0) and then cut to
  leave ``max(min(ctx - 4, 16), int(ctx * 0.2))`` tokens of the context to the
  prompt, as ``generate()`` does (L2168-2180); the cut budget
  ends with ``"length"``;
* batching (``parallel_requests`` > 1, ``--parallelrequests``): a batchable
  generation (no grammar, tools, images, ``reasoning_effort`` or the samplers
  koboldcpp does not batch, L2347-2378) releases the model lock at once and
  runs beside the others, ``parallel_requests`` at a time; a request that is
  not batchable waits until none runs (L7107-7122). An abort by genkey does
  not stop a batched generation (it only sets the single-slot flag, L6532-6541;
  ``gpttype_adapter.cpp`` L3802-3809 against L4443), though it is answered
  ``done: "true"`` as usual; a batched stream ends when its client hangs up
  (L5752-5753), a batched non-streamed generation runs to its end whatever
  the client does (no disconnect check outside streams, L5798-5812).

The tokenizer is a toy: a token is ``chars_per_token`` characters, except that
reasoning and ChatML tags are one token each. Token ids are stable hashes.

Default replies (no script): tools under a ``tool_choice`` other than ``"none"``
give one call of the named (or first) tool with arguments for its required
parameters (after a tool result under ``"auto"``: a text answer quoting it); a
``json_schema`` or an object-rooted ``grammar`` gives a JSON object; a
``json_object`` gives a JSON array; a last user message containing "think"
gives ``<think>`` reasoning and an answer; "colour"/"color" gives ``"Blue."``;
"story", "essay" or "long" gives a long text (about 1,000 tokens); otherwise
``"You said: <the first words>."``. ``script(fn)`` overrides any of these.

Not simulated: the Ollama, Anthropic, Responses and ``/v1/completions`` routes,
images beyond a fixed token cost, logprobs, the tool-decision poll, and the
load-time settings that turn batching off (``--noshift`` is taken as given).

This package holds :class:`ScriptedKoboldcpp` (its constructor, lifecycle, and
the dispatch of each request, faults first, to its route), assembled from one
mixin per route family, each in a module read whole on its own: :mod:`.chat`
(chat completions, whole and streamed), :mod:`.kobold` (the Kobold API's
generate and stream), :mod:`.generation` (the model lock, batching, budgets,
timing, perf figures), :mod:`.aborts` (aborts and ``generate/check``),
:mod:`.info` (the open GETs and tokencount) and :mod:`.replies` (scripted
replies, injected faults, default replies); beside them :mod:`.output` (the
reasoning split and stop strings), :mod:`.model` (the toy tokenizer, prompt
rendering, planned output), :mod:`.wire` (the HTTP exchange as koboldcpp writes
it), :mod:`.state` (the shared state) and :mod:`.values` (constants).
``MAX_REQUEST_BYTES`` here is read when a :class:`ScriptedKoboldcpp` is made, so
setting it on this package changes the default.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from koboldcpp_horde_chat.devkit.kcpp.chat import ChatCompletions
from koboldcpp_horde_chat.devkit.kcpp.info import InfoRoutes
from koboldcpp_horde_chat.devkit.kcpp.kobold import KoboldGenerate
from koboldcpp_horde_chat.devkit.kcpp.model import (
    ScriptedReply,
    _Tokenizer,
    execute_plan,
    token_count,
)
from koboldcpp_horde_chat.devkit.kcpp.output import (
    OaiStreamSplitter,
    split_reasoning,
)
from koboldcpp_horde_chat.devkit.kcpp.replies import (
    example_value,
    grammar_root_kind,
)
from koboldcpp_horde_chat.devkit.kcpp.state import _Run
from koboldcpp_horde_chat.devkit.kcpp.values import (
    BAD_INPUT_BODY,
    BOS_ID,
    BUSY_BODY,
    CHATML_TEMPLATE,
    DEFAULT_CHAT_GENLEN,
    DEFAULT_KOBOLD_GENLEN,
    GET_ROUTES,
    HORDE_GENKEY_PREFIX,
    IMAGE_TOKENS,
    KAI_API_VERSION,
    MAX_REQUEST_BYTES,
    MAX_STOP_SEQUENCES,
    POST_ROUTES,
    PROTECTED_MODEL_NAME,
    ROUTE_NAMES,
    STOP_CUSTOM,
    STOP_EOS,
    STOP_ERROR,
    STOP_INVALID,
    STOP_OUT_OF_TOKENS,
    STREAM_ERROR_EVENT,
    THINK_PAIRS,
    TOO_BIG_BODY,
    UNAUTHORIZED_BODY,
    Fault,
    Finish,
    too_big_body,
)
from koboldcpp_horde_chat.devkit.kcpp.wire import _ClientGone, _Exchange, _Handler, _Server, log

__all__ = [
    "BAD_INPUT_BODY",
    "BOS_ID",
    "BUSY_BODY",
    "CHATML_TEMPLATE",
    "DEFAULT_CHAT_GENLEN",
    "DEFAULT_KOBOLD_GENLEN",
    "GET_ROUTES",
    "HORDE_GENKEY_PREFIX",
    "IMAGE_TOKENS",
    "KAI_API_VERSION",
    "MAX_REQUEST_BYTES",
    "MAX_STOP_SEQUENCES",
    "POST_ROUTES",
    "PROTECTED_MODEL_NAME",
    "ROUTE_NAMES",
    "STOP_CUSTOM",
    "STOP_EOS",
    "STOP_ERROR",
    "STOP_INVALID",
    "STOP_OUT_OF_TOKENS",
    "STREAM_ERROR_EVENT",
    "THINK_PAIRS",
    "TOO_BIG_BODY",
    "UNAUTHORIZED_BODY",
    "Fault",
    "Finish",
    "OaiStreamSplitter",
    "ScriptedKoboldcpp",
    "ScriptedReply",
    "example_value",
    "execute_plan",
    "grammar_root_kind",
    "split_reasoning",
    "token_count",
    "too_big_body",
]


class ScriptedKoboldcpp(ChatCompletions, KoboldGenerate, InfoRoutes):
    """A scripted koboldcpp 1.116.1 on ``127.0.0.1:<port>`` (see the package docstring).

    Args:
        model_name: ``friendlymodelname`` (``/api/v1/model``, chat ``model``).
        max_context_length: ``--contextsize`` in tokens.
        vision: report ``"vision": true`` and count image tokens.
        password: ``--password``; "" for an open instance.
        version: the ``version`` in ``/api/extra/version``.
        jinja: the ``jinja`` flag in ``/api/extra/version``.
        chat_route: answer ``/v1/chat/completions`` (False: 404, a koboldcpp
            without the route).
        chat_template: ``/props`` ``chat_template`` (default
            :data:`CHATML_TEMPLATE`; ``""`` a model without one; None: no
            ``/props`` route, 404).
        token_delay_s: seconds per generated token.
        chars_per_token: the toy tokenizer's characters per token.
        prompt_delay_s: seconds of "prompt processing" before the first token.
        prompt_token_delay_s: seconds of "prompt processing" per prompt token,
            besides ``prompt_delay_s`` (a host slow only for long prompts). As in
            koboldcpp, the prompt is processed in batches of
            :data:`.values.PROMPT_BATCH_TOKENS` and an abort ends it only between two
            (``gpttype_adapter.cpp`` L6093, L6754, L6909).
        hang_prompts_over: a generation whose prompt has more tokens than this
            never starts (it hangs until aborted, the client leaves or the
            server stops); None: none hangs.
        horde_max_length: ``/api/v1/config/max_length`` (``--hordegenlen``).
        horde_max_context_length: ``--hordemaxctx`` (0: the context size).
        abort_reply_delay_s: koboldcpp waits 0.1 s before answering an abort.
        host, port: where to listen (port 0: an ephemeral port).
        max_request_bytes: ``--maxrequestsize`` in bytes (default
            :data:`MAX_REQUEST_BYTES`, read when the object is made): a request
            whose ``Content-Length`` is larger is answered 500 "Payload is too
            big. Max payload size is 32MB." without reading its body.
        genlimit: ``--genlimit`` in tokens (0: none): every generation's
            ``max_length`` is capped there before the 20 % cut.
        parallel_requests: ``--parallelrequests``: above 1, batchable
            generations run beside each other (see the package docstring).

    Public state, readable from tests (append-only lists):
        requests: ``{"method", "path", "headers" (lower-case names), "body"
            (parsed JSON or None)}`` for every request received.
        aborts: the genkey of every abort answered ``done: "true"`` ("" when
            the abort named none).
        generations: one dict per finished generation: ``{"route", "genkey",
            "stream", "prompt_tokens", "completion_tokens", "finish_reason",
            "aborted", "client_gone", "overflow"}`` (plus ``"cut": True`` after a
            ``stream_cut`` fault).
        images: one dict per chat completion whose messages hold image parts:
            ``{"genkey": str, "data_urls": [str, ...] (the urls starting with
            "data:image", in order: what koboldcpp reads), "decoded": [bytes |
            None, ...] (each one's text after the first comma base64-decoded;
            None when that fails), "dropped": [str, ...] (other image urls,
            ignored as koboldcpp ignores http URLs)}``.
        tokencount_messages: bodies of tokencount calls that sent ``messages``
            (the real server would render them and may run a tool poll).
        last_non_horde_request_time: ``time.time()`` of the last local user's
            generation (start and end), or None.
        busy: when True every generation answers 503 "Server is busy".
        running: how many generations run now, batched or not (property).
        hold_stop_sequences: True (koboldcpp's way, ``koboldcpp.py`` L5470-5486): a
            stream holds back text that could start a stop sequence and trims the one that
            ended generation. False streams a stop sequence as generated (a
            backend that does not trim), so the client side must strip it.
        chunk_log: with ``log_chunks = True``, ``(time.monotonic(), delta)`` of
            every streamed chat chunk just before it is written (for benches).
    """

    def __init__(
        self,
        model_name: str = "koboldcpp/scripted-model",
        max_context_length: int = 4096,
        vision: bool = False,
        password: str = "",
        version: str = "1.116.1",
        jinja: bool = False,
        token_delay_s: float = 0.0,
        chars_per_token: int = 4,
        *,
        prompt_delay_s: float = 0.0,
        prompt_token_delay_s: float = 0.0,
        hang_prompts_over: int | None = None,
        horde_max_length: int = 1024,
        horde_max_context_length: int = 0,
        abort_reply_delay_s: float = 0.1,
        host: str = "127.0.0.1",
        port: int = 0,
        max_request_bytes: int | None = None,
        genlimit: int = 0,
        parallel_requests: int = 1,
        chat_route: bool = True,
        chat_template: str | None = CHATML_TEMPLATE,
    ) -> None:
        self.model_name = model_name
        self.chat_route = chat_route
        self.chat_template = chat_template
        self.genlimit = genlimit
        self.parallel_requests = max(1, parallel_requests)
        self.max_request_bytes = (
            MAX_REQUEST_BYTES if max_request_bytes is None else max_request_bytes
        )
        self.max_context_length = max_context_length
        self.vision = vision
        self.password = password
        self.version = version
        self.jinja = jinja
        self.token_delay_s = token_delay_s
        self.prompt_delay_s = prompt_delay_s
        self.prompt_token_delay_s = prompt_token_delay_s
        self.hang_prompts_over = hang_prompts_over
        self.horde_max_length = horde_max_length
        self.horde_max_context_length = horde_max_context_length
        self.abort_reply_delay_s = abort_reply_delay_s
        self.tokenizer = _Tokenizer(chars_per_token)
        self._host = host
        self._port = port

        self.requests: list[dict[str, Any]] = []
        self.aborts: list[str] = []
        self.generations: list[dict[str, Any]] = []
        self.tokencount_messages: list[dict[str, Any]] = []
        self.images: list[dict[str, Any]] = []
        self.last_non_horde_request_time: float | None = None
        self.busy = False
        self.hold_stop_sequences = True
        self.log_chunks = False
        self.chunk_log: list[tuple[float, dict[str, Any]]] = []

        self._script: Callable[[dict[str, Any]], ScriptedReply | None] | None = None
        self._fail_rule: Callable[[str, Any], Fault | None] | None = None
        self._faults: dict[str, deque[Fault]] = {}
        self._lock = threading.Lock()  # state below
        self._model = threading.Lock()  # koboldcpp's modelbusy
        self._queue = 0
        self._current_genkey = ""
        self._current_run: _Run | None = None
        self._batched_runs: set[_Run] = set()  # batched generations now (under _lock)
        self._batch_cond = threading.Condition()  # koboldcpp's batched_cond
        self._batched = 0  # koboldcpp's batched_request_runner_count (under _batch_cond)
        self._batch_slots = threading.Semaphore(self.parallel_requests)
        self._pending_abort: str | None = None
        self._last_text = ""
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._started_at = time.time()
        self._last_req_time = self._started_at
        self._perf: dict[str, Any] = {
            "last_process": 0.0,
            "last_eval": 0.0,
            "last_token_count": 0,
            "last_input_count": 0,
            "last_process_time": 0.0,
            "last_eval_time": 0.0,
            "last_process_speed": 0,
            "last_eval_speed": 0,
            "last_seed": -1,
            "last_draft_success": 0,
            "last_draft_failed": 0,
            "total_gens": 0,
            "stop_reason": -1,
            "total_img_gens": 0,
            "total_tts_gens": 0,
            "total_transcribe_gens": 0,
        }

    def start(self) -> ScriptedKoboldcpp:
        """Bind and serve on a daemon thread; returns self."""
        if self._server is not None:
            return self
        self._stopping.clear()
        self._server = _Server((self._host, self._port), self)
        self._started_at = self._last_req_time = time.time()
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="scripted-kcpp",
            daemon=True,
        )
        self._thread.start()
        log.info("scripted koboldcpp listening on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving; running generations are aborted and hangs released."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._stopping.set()
        with self._lock:
            if self._current_run is not None:
                self._current_run.abort.set()
            for run in self._batched_runs:
                run.abort.set()
        with self._batch_cond:
            self._batch_cond.notify_all()
        self._server = None
        self._thread = None
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)

    def kill(self) -> None:
        """Die like a killed koboldcpp process: no answer to anything in flight.

        Every open connection is reset (TCP RST) before a byte more is written,
        running generations end, and the port closes. A new
        ``ScriptedKoboldcpp(port=<the same port>)`` then plays the restarted one.
        """
        server = self._server
        if server is None:
            return
        with server.sockets_lock:
            socks = list(server.open_sockets)
        for sock in socks:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.stop()

    def __enter__(self) -> ScriptedKoboldcpp:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The bound port. Raises RuntimeError before start()."""
        if self._server is None:
            raise RuntimeError("the scripted koboldcpp is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` without a trailing slash."""
        return f"http://{self._host}:{self.port}"

    def _handle(self, h: _Handler) -> None:
        path = urlsplit(h.path).path
        try:
            length = int(h.headers.get("content-length") or 0)
        except ValueError:
            length = 0
        if length > self.max_request_bytes:
            ex = _Exchange(h, "", None, b"")
            self._record(h, path, None)
            ex.send_json(500, too_big_body(self.max_request_bytes))
            h.close_connection = True
            return
        raw = h.rfile.read(length) if length > 0 else b""
        body: Any = None
        if raw:
            try:
                body = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                body = None
        self._record(h, path, body)
        routes = GET_ROUTES if h.command == "GET" else POST_ROUTES
        route = routes.get(path)
        if (route == "chat" and not self.chat_route) or (
            route == "props" and self.chat_template is None
        ):
            route = None
        ex = _Exchange(h, route or "", body, raw)
        if route is None:
            ex.send_json(404, {"detail": {"msg": "Not found.", "type": "not_found"}})
            return
        fault: Fault | None = None
        with self._lock:
            queued = self._faults.get(route)
            if queued:
                fault = queued.popleft()
        if fault is None:
            fault = self._standing_fault(route, body)
        if isinstance(fault, tuple):
            ex.send_json(fault[0], fault[1])
            return
        if fault == "reset":
            ex.reset()
            return
        if isinstance(fault, str) and fault.startswith("hang:"):
            if self._stopping.wait(float(fault[5:])):
                ex.reset()
                return
        elif fault in ("truncate", "stream_cut"):
            ex.cut = fault
        elif isinstance(fault, str):
            ex.stream_fault = fault
        try:
            getattr(self, "_route_" + route)(ex)
        except _ClientGone:
            log.debug("scripted koboldcpp: client went away on %s", path)

    def _record(self, h: _Handler, path: str, body: Any) -> None:
        self.requests.append(
            {
                "method": h.command,
                "path": path,
                "headers": {k.lower(): v for k, v in h.headers.items()},
                "body": body,
            }
        )
